//! The control: on the local file system (ext4 under the target directory, which has every
//! fallocate mode) the exerciser must pass, mapped I/O, fallocate and copy_file_range
//! included. Runs on a Freeflow mount are compared against this.

use freeflow_exercise::posix::PosixTarget;

#[test]
fn the_local_file_system_passes() {
    let directory = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = directory.path().join("exercised");
    // The same file by two paths: reopens alternate between them.
    let mut target = PosixTarget::open(vec![path.clone(), path]).unwrap();
    let options = freeflow_exercise::Options {
        operations: 2_000,
        seed: 11,
        size_max: 256 << 10,
        length_max: 32 << 10,
        ..freeflow_exercise::Options::default()
    };
    let report = freeflow_exercise::run(&mut target, &options, 0, |_| {}).unwrap();
    assert_eq!(report.operations, 2_000);
    for kind in [
        "MapWrite", "MapRead", "Copy", "Allocate", "Truncate", "Reopen",
    ] {
        assert!(report.counts.contains_key(kind), "no {kind}: {report}");
    }
}
