//! The local-reads socket: how a client on the I/O server's own host is handed a read-only
//! descriptor of an object, so it reads the object's bytes from the shared page cache
//! itself instead of having them copied into a reply, across a socket and out again
//! (DESIGN.md §6.6; the same idea as HDFS's short-circuit reads).
//!
//! A Unix `SOCK_SEQPACKET` socket beside the server's RPC socket
//! ([`local_reads_path`]). Not an RPC connection: one packet each way per request, the
//! postcard encoding of `freeflow_proto::io::OpenForReading` and of
//! `Result<OpenedForReading, WireError>`, the descriptor attached to the answer with
//! `SCM_RIGHTS`. Packets keep their bounds, so no framing is needed; a descriptor can
//! only travel on a Unix socket as ancillary data, so the RPC streams cannot carry it.
//!
//! No cluster key: the server answers only a peer running as its own user or as root
//! ([`SeqpacketConn::peer_uid`]), who can open the objects' files anyway. A client
//! watches its connection: the server closes it when it stops serving data (its data
//! gate closes) or when its process ends, and a descriptor is used only while the
//! connection that brought it is open ([`SeqpacketConn::hung_up`]).

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The local-reads socket of the server whose RPC socket is at `unix_socket`.
pub fn local_reads_path(unix_socket: &str) -> String {
    format!("{unix_socket}.reads")
}

/// The largest packet either side sends (a request or an answer with its error text).
pub const LOCAL_PACKET_BYTES_MAX: usize = 4096;

fn nonblocking_seqpacket() -> std::io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// A listening local-reads socket; its file is removed when it is dropped.
pub struct SeqpacketListener {
    fd: AsyncFd<OwnedFd>,
    path: std::path::PathBuf,
}

impl Drop for SeqpacketListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl SeqpacketListener {
    /// Listen at `path`, replacing a socket file no server answers on any more. Must be
    /// called inside a Tokio runtime.
    pub fn bind(path: &Path) -> std::io::Result<SeqpacketListener> {
        use std::os::unix::fs::FileTypeExt;
        if let Ok(metadata) = std::fs::symlink_metadata(path) {
            if !metadata.file_type().is_socket() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            // Left by a stopped server (a live one would take the connection).
            if blocking_probe(path) {
                std::fs::remove_file(path)?;
            }
        }
        let fd = nonblocking_seqpacket()?;
        let address = UnixAddr::new(path)?;
        socket::bind(fd.as_raw_fd(), &address)?;
        socket::listen(&fd, Backlog::new(128)?)?;
        Ok(SeqpacketListener {
            // SAFETY: the AsyncFd owns the descriptor for as long as it lives.
            fd: unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?,
            path: path.to_path_buf(),
        })
    }

    /// The next connection.
    pub async fn accept(&self) -> std::io::Result<SeqpacketConn> {
        loop {
            let mut ready = self.fd.readable().await?;
            match socket::accept4(
                self.fd.get_ref().as_raw_fd(),
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            ) {
                Ok(raw) => {
                    // SAFETY: accept4 returned a new descriptor that nothing else owns.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    return SeqpacketConn::new(fd);
                }
                Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
                Err(error) => return Err(error.into()),
            }
        }
    }
}

/// Whether no server answers a seqpacket connection at `path` (a stale socket file:
/// connections are refused; any other failure leaves the file alone).
fn blocking_probe(path: &Path) -> bool {
    let Ok(fd) = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    let Ok(address) = UnixAddr::new(path) else {
        return false;
    };
    socket::connect(fd.as_raw_fd(), &address) == Err(nix::errno::Errno::ECONNREFUSED)
}

/// One `recvmsg` of a packet into `buffer` and the descriptors with it. Every descriptor
/// that arrived is owned (and closed if not returned); more than one, a packet longer
/// than `buffer`, or control data cut short are errors.
fn receive_packet(fd: RawFd, buffer: &mut [u8]) -> std::io::Result<(usize, Option<OwnedFd>)> {
    // Room for several descriptors: a peer sending too many is found out, and the ones
    // that fit are closed rather than leaked.
    let mut control = [0u64; 16];
    let mut vector = libc::iovec {
        iov_base: buffer.as_mut_ptr().cast(),
        iov_len: buffer.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no vectors, no control).
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut vector;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: the header points at `vector` (covering `buffer`) and `control`, which
    // outlive the call.
    let received = unsafe { libc::recvmsg(fd, &mut header, libc::MSG_CMSG_CLOEXEC) };
    if received < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut descriptors = Vec::new();
    // SAFETY: the control messages walked are the ones the kernel wrote, within
    // `msg_controllen`; each SCM_RIGHTS message's data holds installed descriptors,
    // which nothing else owns.
    unsafe {
        let mut message = libc::CMSG_FIRSTHDR(&header);
        while !message.is_null() {
            if (*message).cmsg_level == libc::SOL_SOCKET && (*message).cmsg_type == libc::SCM_RIGHTS
            {
                let data = libc::CMSG_DATA(message);
                let length = (*message).cmsg_len as usize - (data as usize - message as usize);
                for index in 0..length / std::mem::size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(index));
                    descriptors.push(OwnedFd::from_raw_fd(raw));
                }
            }
            message = libc::CMSG_NXTHDR(&header, message);
        }
    }
    if header.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a packet longer than {} bytes", buffer.len()),
        ));
    }
    if header.msg_flags & libc::MSG_CTRUNC != 0 || descriptors.len() > 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} or more descriptors with one packet",
                descriptors.len().max(2)
            ),
        ));
    }
    Ok((received as usize, descriptors.pop()))
}

/// One end of a local-reads connection.
pub struct SeqpacketConn {
    fd: AsyncFd<OwnedFd>,
}

impl SeqpacketConn {
    fn new(fd: OwnedFd) -> std::io::Result<SeqpacketConn> {
        Ok(SeqpacketConn {
            // SAFETY: the AsyncFd owns the descriptor for as long as it lives.
            fd: unsafe { AsyncFd::register(fd) }?,
        })
    }

    /// Connect to the local-reads socket at `path`. Must be called inside a Tokio runtime.
    pub fn connect(path: &Path) -> std::io::Result<SeqpacketConn> {
        let fd = nonblocking_seqpacket()?;
        let address = UnixAddr::new(path)?;
        // A Unix connect completes at once, or fails (EAGAIN: the backlog is full; the
        // caller reads through the RPC path meanwhile).
        socket::connect(fd.as_raw_fd(), &address)?;
        SeqpacketConn::new(fd)
    }

    /// The user id the peer ran as when the connection was made.
    pub fn peer_uid(&self) -> std::io::Result<u32> {
        let credentials = socket::getsockopt(self.fd.get_ref(), socket::sockopt::PeerCredentials)?;
        Ok(credentials.uid())
    }

    /// Send one packet, with `descriptor` attached when given.
    pub async fn send(
        &self,
        packet: &[u8],
        descriptor: Option<BorrowedFd<'_>>,
    ) -> std::io::Result<()> {
        let raw: Vec<RawFd> = descriptor.iter().map(|fd| fd.as_raw_fd()).collect();
        let rights = [ControlMessage::ScmRights(&raw)];
        let control: &[ControlMessage] = if raw.is_empty() { &[] } else { &rights };
        loop {
            let mut ready = self.fd.writable().await?;
            let sent = socket::sendmsg::<UnixAddr>(
                self.fd.get_ref().as_raw_fd(),
                &[IoSlice::new(packet)],
                control,
                MsgFlags::MSG_NOSIGNAL,
                None,
            );
            match sent {
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// Receive one packet into `buffer`: its length (0 when the peer closed the
    /// connection) and the descriptor attached to it, if any. A packet longer than
    /// `buffer` is an error.
    pub async fn recv(&self, buffer: &mut [u8]) -> std::io::Result<(usize, Option<OwnedFd>)> {
        loop {
            let mut ready = self.fd.readable().await?;
            match receive_packet(self.fd.get_ref().as_raw_fd(), buffer) {
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    ready.clear_ready();
                }
                received => return received,
            }
        }
    }

    /// Send one request (with `descriptor` attached when given) and receive its answer:
    /// the answer's bytes and the descriptor that came with it. Err says what failed, the
    /// peer closing the connection included.
    pub async fn ask(
        &self,
        request: &[u8],
        descriptor: Option<BorrowedFd<'_>>,
    ) -> Result<(Vec<u8>, Option<OwnedFd>), String> {
        self.send(request, descriptor)
            .await
            .map_err(|error| format!("send failed: {error}"))?;
        let mut packet = vec![0u8; LOCAL_PACKET_BYTES_MAX];
        let (length, descriptor) = self
            .recv(&mut packet)
            .await
            .map_err(|error| format!("receive failed: {error}"))?;
        if length == 0 {
            return Err("the server closed the connection".into());
        }
        packet.truncate(length);
        Ok((packet, descriptor))
    }

    /// Whether the peer closed its end (or the connection failed): a question to the
    /// kernel that never waits.
    pub fn hung_up(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.fd.get_ref().as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no waiting.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        // A failed poll says nothing good about the connection.
        ready < 0
            || ready != 0
                && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL)
                    != 0
    }

    /// Wait until the peer closes its end (or the connection fails), reading nothing.
    pub async fn closed(&self) {
        loop {
            let Ok(mut ready) = self.fd.ready(Interest::READABLE).await else {
                return;
            };
            if self.hung_up() {
                return;
            }
            ready.clear_ready();
        }
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_descriptor_travels_with_its_packet_and_a_closed_peer_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("io.sock.reads");
        let listener = SeqpacketListener::bind(&path).unwrap();
        let client = SeqpacketConn::connect(&path).unwrap();
        let server = listener.accept().await.unwrap();
        assert_eq!(server.peer_uid().unwrap(), unsafe { libc::geteuid() });

        let file_path = dir.path().join("object");
        std::fs::write(&file_path, b"object bytes").unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        server.send(b"here", Some(file.as_fd())).await.unwrap();
        server.send(b"none", None).await.unwrap();

        let mut buffer = [0u8; 16];
        let (length, descriptor) = client.recv(&mut buffer).await.unwrap();
        assert_eq!(&buffer[..length], b"here");
        let received = std::fs::File::from(descriptor.expect("a descriptor came"));
        let mut read = String::new();
        std::io::Read::read_to_string(&mut &received, &mut read).unwrap();
        assert_eq!(read, "object bytes");
        let (length, descriptor) = client.recv(&mut buffer).await.unwrap();
        assert_eq!(
            (&buffer[..length], descriptor.is_none()),
            (&b"none"[..], true)
        );

        assert!(!client.hung_up());
        drop(server);
        client.closed().await;
        assert!(client.hung_up());
        let (length, _) = client.recv(&mut buffer).await.unwrap();
        assert_eq!(length, 0);
    }

    #[tokio::test]
    async fn a_packet_longer_than_the_buffer_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.reads");
        let listener = SeqpacketListener::bind(&path).unwrap();
        let client = SeqpacketConn::connect(&path).unwrap();
        let server = listener.accept().await.unwrap();
        client.send(&[7u8; 100], None).await.unwrap();
        let mut small = [0u8; 10];
        let error = server.recv(&mut small).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn more_than_one_descriptor_with_a_packet_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.reads");
        let listener = SeqpacketListener::bind(&path).unwrap();
        let client = SeqpacketConn::connect(&path).unwrap();
        let server = listener.accept().await.unwrap();
        let file = std::fs::File::open(dir.path()).unwrap();
        let raw = [file.as_raw_fd(), file.as_raw_fd(), file.as_raw_fd()];
        socket::sendmsg::<UnixAddr>(
            client.as_fd().as_raw_fd(),
            &[IoSlice::new(b"three")],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut buffer = [0u8; 16];
        let error = server.recv(&mut buffer).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData, "{error}");
    }

    #[tokio::test]
    async fn a_stale_socket_file_is_replaced_and_a_live_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.reads");
        // A socket file nothing listens on (as a killed server leaves).
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let first = SeqpacketListener::bind(&path).unwrap();
        assert!(
            SeqpacketListener::bind(&path).is_err(),
            "a live socket stays"
        );
        drop(first);
        assert!(!path.exists(), "a dropped listener removes its file");
        let second = SeqpacketListener::bind(&path).unwrap();
        let _client = SeqpacketConn::connect(&path).unwrap();
        second.accept().await.unwrap();
    }
}
