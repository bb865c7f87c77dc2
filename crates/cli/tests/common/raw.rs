//! Raw connections to servers for tests that send what a well-behaved client never
//! would: the handshake done by hand (domain strings from `crates/rpc`'s lib.rs), then
//! frames of any kind.

use std::time::Duration;

use freeflow_client::ClusterKey;
use freeflow_proto::frame::{FLAG_REPLY, OPCODE_AUTHENTICATE, OPCODE_HELLO};
use freeflow_proto::handshake::{Authenticate, Hello, ServerProof};
use freeflow_proto::{decode, encode, WireError};
use freeflow_rpc::{read_frame, write_frame};
use tokio::net::TcpStream;

/// The handshake proof as `crates/rpc` computes it (domain strings from its lib.rs).
pub fn proof(key: &ClusterKey, domain: &[u8], nonce: &[u8; 32]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_keyed(key.bytes());
    hasher.update(domain);
    hasher.update(nonce);
    *hasher.finalize().as_bytes()
}

pub const CLIENT_PROOF_DOMAIN: &[u8] = b"freeflow v1 client proof";
pub const SERVER_PROOF_DOMAIN: &[u8] = b"freeflow v1 server proof";

/// Connect and read the server's hello (servers speak first).
pub async fn connect_raw(address: &str) -> (TcpStream, Hello) {
    let mut stream = TcpStream::connect(address).await.expect("tcp connect");
    // Frames go out in pieces: without this, delayed acknowledgements stall each one.
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let frame = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut stream, 0))
        .await
        .expect("hello within 10 s")
        .expect("a hello frame");
    assert_eq!(frame.fixed.opcode, OPCODE_HELLO);
    let hello: Hello = decode(&frame.header).expect("hello decodes");
    (stream, hello)
}

/// Send our authenticate frame and read the server's answer.
pub async fn authenticate(
    stream: &mut TcpStream,
    hello: &Hello,
    key: &ClusterKey,
    client_nonce: [u8; 32],
) -> Result<ServerProof, WireError> {
    let authenticate = Authenticate {
        proof: proof(key, CLIENT_PROOF_DOMAIN, &hello.nonce),
        client_nonce,
        client_name: "bad-input-test".to_string(),
        client_id: 0,
    };
    write_frame(
        stream,
        0,
        OPCODE_AUTHENTICATE,
        0,
        &encode(&authenticate),
        &[],
    )
    .await
    .expect("send authenticate");
    let frame = tokio::time::timeout(Duration::from_secs(10), read_frame(stream, 0))
        .await
        .expect("authenticate reply within 10 s")
        .expect("an authenticate reply frame");
    assert_eq!(frame.fixed.opcode, OPCODE_AUTHENTICATE);
    assert_ne!(
        frame.fixed.flags & FLAG_REPLY,
        0,
        "the reply is flagged as one"
    );
    decode::<Result<ServerProof, WireError>>(&frame.header).expect("outcome decodes")
}

/// A raw connection that passed the handshake with the right key.
pub async fn authenticated_raw(address: &str, key: &ClusterKey) -> TcpStream {
    let (mut stream, hello) = connect_raw(address).await;
    let client_nonce = [0x5a; 32];
    let server = authenticate(&mut stream, &hello, key, client_nonce)
        .await
        .expect("the right key is accepted");
    assert_eq!(
        server.proof,
        proof(key, SERVER_PROOF_DOMAIN, &client_nonce),
        "the server proves it holds the key"
    );
    stream
}
