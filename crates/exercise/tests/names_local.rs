//! The control of the namespace exerciser: on the local file system (ext4 under the target
//! directory) its model must be right, so every seed runs clean, with two workers on the
//! same directory, in serial and in concurrent mode. Runs on Freeflow mounts are held to
//! the same model.

use freeflow_exercise::names::posix::PosixTarget;
use freeflow_exercise::names::{self, NamesOptions, NamesTarget, OperationKind};

fn two_workers_on(directory: &std::path::Path) -> Vec<Box<dyn NamesTarget + Send>> {
    (0..2)
        .map(|_| Box::new(PosixTarget::new(directory).unwrap()) as Box<dyn NamesTarget + Send>)
        .collect()
}

#[test]
fn the_local_file_system_matches_the_model_call_by_call() {
    for seed in 1..=4 {
        let directory = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let options = NamesOptions {
            seed,
            operations: 2_000,
            batch_operations: 250,
            ..NamesOptions::default()
        };
        let report = names::run(two_workers_on(directory.path()), &options)
            .unwrap_or_else(|failure| panic!("{failure}"));
        assert_eq!(report.operations, 2_000);
        for kind in [
            OperationKind::Rename,
            OperationKind::RenameNoReplace,
            OperationKind::RenameExchange,
            OperationKind::Link,
            OperationKind::RemoveDirectory,
        ] {
            let (succeeded, failed) = report.counts[&kind];
            assert!(succeeded > 0 && failed > 0, "{kind:?}: {report}");
        }
    }
}

#[test]
fn the_local_file_system_agrees_with_itself_under_concurrent_workers() {
    let directory = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let options = NamesOptions {
        seed: 9,
        operations: 2_000,
        batch_operations: 500,
        concurrent: true,
        ..NamesOptions::default()
    };
    let report = names::run(two_workers_on(directory.path()), &options)
        .unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(report.operations, 2_000);
}
