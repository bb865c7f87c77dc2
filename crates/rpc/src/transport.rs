//! The transport adaptation layer (DESIGN.md §6.6; seed 004's swappable transport): the RPC
//! layer sees a pair of byte streams. [`Tcp`] between hosts; [`Unix`] sockets between
//! processes of one host (no TCP/IP stack on the way: addresses `unix:/path`); `net::Network`
//! picks one by the address (or a simulated network), and is what connections use. RDMA
//! would fit behind the same trait.

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

/// Addresses of Unix sockets start with this (`unix:/run/freeflow/io-0.sock`).
pub const UNIX_ADDRESS_PREFIX: &str = "unix:";

/// The socket path of a `unix:` address, None for any other address.
pub fn unix_socket_path(address: &str) -> Option<&str> {
    address.strip_prefix(UNIX_ADDRESS_PREFIX)
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

/// Unix stream sockets, for addresses `unix:/path`.
pub struct Unix;

impl Transport for Unix {
    fn connect<'a>(&'a self, address: &'a str) -> ConnectFuture<'a> {
        Box::pin(async move {
            let path = unix_socket_path(address).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{address:?} is not a unix: address"),
                )
            })?;
            // A full backlog fails a Unix connect at once (EAGAIN) where TCP would retry its
            // SYN: retry likewise, within the caller's connect timeout.
            let mut pause = std::time::Duration::from_millis(1);
            let stream = loop {
                match tokio::net::UnixStream::connect(path).await {
                    Ok(stream) => break stream,
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(std::time::Duration::from_millis(100));
                    }
                    Err(error) => return Err(error),
                }
            };
            widen_send_buffer(&stream);
            let (read, write) = stream.into_split();
            Ok((Box::new(read) as ReadHalf, Box::new(write) as WriteHalf))
        })
    }
}

/// Bytes a Unix socket may hold on its way: what one side can write before the other
/// reads. The default (about 200 KiB) holds less than one 1 MiB request, so a writer with
/// many requests in flight would wait on every one; TCP's buffers grow by themselves.
pub const UNIX_SEND_BUFFER_BYTES: libc::c_int = 4 << 20;

/// Raise a Unix socket's send buffer to [`UNIX_SEND_BUFFER_BYTES`] (the kernel caps it at
/// `net.core.wmem_max`; a failure leaves the default, which only costs speed).
pub fn widen_send_buffer(stream: &impl std::os::fd::AsRawFd) {
    let size = UNIX_SEND_BUFFER_BYTES;
    // SAFETY: a valid descriptor, an int option and its length.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
