//! The transport adaptation layer (DESIGN.md §6.6; seed 004's swappable transport): the RPC
//! layer sees a pair of byte streams. TCP is the transport today; Unix sockets and RDMA fit
//! behind the same trait.

use std::future::Future;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

pub type ReadHalf = Box<dyn AsyncRead + Unpin + Send>;
pub type WriteHalf = Box<dyn AsyncWrite + Unpin + Send>;

pub type ConnectFuture<'a> =
    Pin<Box<dyn Future<Output = std::io::Result<(ReadHalf, WriteHalf)>> + Send + 'a>>;

/// A way to open a byte stream to a server address.
pub trait Transport: Send + Sync {
    fn connect<'a>(&'a self, address: &'a str) -> ConnectFuture<'a>;
}

/// TCP with Nagle off (requests are small and latency-bound, payloads are large).
pub struct Tcp;

impl Transport for Tcp {
    fn connect<'a>(&'a self, address: &'a str) -> ConnectFuture<'a> {
        Box::pin(async move {
            let stream = tokio::net::TcpStream::connect(address).await?;
            stream.set_nodelay(true)?;
            let (read, write) = stream.into_split();
            Ok((Box::new(read) as ReadHalf, Box::new(write) as WriteHalf))
        })
    }
}
