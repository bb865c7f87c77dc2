//! `freeflow fsck` against a real cluster corrupted on purpose (issue 13): objects with no
//! inode, an object of a directory, an object outside its file's layout and an object
//! longer than its file's size are each found; `--repair` fixes them without touching the
//! files' data, and the file whose stray object was removed stays writable on that server.
//! Objects of a file open for writing and objects written within the grace period are left
//! alone.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use bytes::Bytes;
use common::{assert_bytes_eq, Cluster, Xorshift, FREEFLOW};
use freeflow_client::{Client, OpenOptions};

fn fsck(cluster: &Cluster, args: &[&str]) -> (i32, String) {
    let output: Output = Command::new(FREEFLOW)
        .arg("--cluster")
        .arg(cluster.client_toml())
        .arg("fsck")
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run freeflow fsck");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().unwrap_or(-1), text)
}

async fn write_file(client: &Client, path: &str, data: &[u8]) -> u64 {
    let options = OpenOptions::new().read(true).write(true).create(true);
    let handle = client.open_path(path, &options).await.expect("create");
    handle
        .write_at(0, Bytes::copy_from_slice(data))
        .await
        .expect("write");
    let inode = handle.inode();
    handle.close().await.expect("close");
    inode
}

async fn read_file(client: &Client, path: &str) -> Vec<u8> {
    let handle = client
        .open_path(path, &OpenOptions::new().read(true))
        .await
        .expect("open");
    let size = handle.size();
    let data = handle.read_at(0, size).await.expect("read").to_vec();
    handle.close().await.expect("close");
    data
}

fn append(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|error| panic!("open {}: {error}", path.display()));
    file.write_all(bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsck_finds_each_kind_of_disagreement_and_repairs_it() {
    let cluster = Cluster::start(3).await;
    let client = cluster.client().await;
    let mut random = Xorshift::new(13);
    let big = random.bytes(3 << 20);
    let small = random.bytes(5_000);
    let big_inode = write_file(&client, "/big", &big).await;
    let small_inode = write_file(&client, "/small", &small).await;
    let directory = client.mkdir_all("/dir").await.expect("mkdir").inode;
    let layout = client.stat("/big").await.unwrap().layout.expect("a layout");
    let small_layout = client
        .stat("/small")
        .await
        .unwrap()
        .layout
        .expect("a layout");

    let (status, text) = fsck(&cluster, &["--grace-ms", "0"]);
    assert_eq!(status, 0, "a healthy cluster: {text}");
    assert!(text.contains(" 0 problems"), "{text}");

    // The corruptions, made behind the servers' backs.
    let server_of_stripe0 = layout.servers[0] as usize;
    std::fs::write(cluster.object_path(0, 999_999, 0), b"nobody's").unwrap();
    std::fs::write(cluster.object_path(1, directory, 0), b"a directory's").unwrap();
    std::fs::copy(
        cluster.object_path(server_of_stripe0, big_inode, 0),
        cluster.object_path(server_of_stripe0, big_inode, 7),
    )
    .unwrap();
    let small_object = cluster.object_path(small_layout.servers[0] as usize, small_inode, 0);
    append(&small_object, b"bytes past the end of the file");

    let (status, text) = fsck(&cluster, &["--grace-ms", "0"]);
    assert_eq!(status, 65, "problems left: exit 65\n{text}");
    for expected in [
        format!(
            "{:016x}.0 (8 bytes): a number the meta server never gave out",
            999_999
        ),
        format!("{directory:016x}.0 (13 bytes): its inode is a Directory"),
        format!("{big_inode:016x}.7 (1048576 bytes): outside its file's layout"),
        format!("{small_inode:016x}.0 (5030 bytes): longer than the file's size"),
    ] {
        assert!(text.contains(&expected), "{expected:?} not in:\n{text}");
    }
    assert!(text.contains(" 4 problems, 0 repaired"), "{text}");
    assert!(
        cluster.object_path(0, 999_999, 0).exists(),
        "nothing changed without --repair"
    );

    // Young objects are left for the grace period.
    let (status, text) = fsck(&cluster, &[]);
    assert_eq!(status, 0, "everything is younger than a minute: {text}");
    assert!(
        text.contains("4 written in the last grace period"),
        "{text}"
    );

    let (status, text) = fsck(&cluster, &["--grace-ms", "0", "--repair"]);
    assert_eq!(status, 0, "all repaired: {text}");
    assert!(text.contains(" 4 problems, 4 repaired"), "{text}");
    assert!(!cluster.object_path(0, 999_999, 0).exists());
    assert!(!cluster.object_path(1, directory, 0).exists());
    assert!(!cluster
        .object_path(server_of_stripe0, big_inode, 7)
        .exists());
    assert_eq!(std::fs::metadata(&small_object).unwrap().len(), 5_000);

    let (status, text) = fsck(&cluster, &["--grace-ms", "0"]);
    assert_eq!(status, 0, "clean after the repair: {text}");
    assert_bytes_eq(&read_file(&client, "/big").await, &big, "/big after repair");
    assert_bytes_eq(
        &read_file(&client, "/small").await,
        &small,
        "/small after repair",
    );

    // The file whose stray object went is still writable on that server.
    let patch = random.bytes(4096);
    let handle = client
        .open_path("/big", &OpenOptions::new().read(true).write(true))
        .await
        .unwrap();
    handle
        .write_at(0, Bytes::copy_from_slice(&patch))
        .await
        .unwrap();
    handle
        .close()
        .await
        .expect("a write to stripe 0 after the repair");
    let mut now = big.clone();
    now[..4096].copy_from_slice(&patch);
    assert_bytes_eq(&read_file(&client, "/big").await, &now, "/big rewritten");

    // A file open for writing may run past its committed size: not a problem.
    let options = OpenOptions::new().read(true).write(true).create(true);
    let open = client.open_path("/open", &options).await.unwrap();
    open.write_at(0, Bytes::from(random.bytes(1 << 20)))
        .await
        .unwrap();
    open.flush().await.unwrap();
    let (status, text) = fsck(&cluster, &["--grace-ms", "0"]);
    assert_eq!(status, 0, "{text}");
    open.close().await.unwrap();
    client.shutdown().await;
}
