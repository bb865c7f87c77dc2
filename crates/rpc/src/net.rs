//! Where servers listen and where connections go ([`Network`]): the host's TCP stack or
//! Unix sockets, or a simulated network installed for one thread.
//!
//! A simulation (the replication tests under turmoil) runs every simulated host on the
//! thread that runs the test; [`simulate_on_this_thread`] makes [`bind`] and
//! [`crate::Network`] use its network there, and nowhere else, so other tests of the same
//! process keep their real sockets. Work moved to other threads (blocking tasks, the meta
//! writer) opens no connections.

use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use crate::transport::{
    unix_socket_path, ConnectFuture, ReadHalf, Tcp, Transport, Unix, WriteHalf,
};

/// A connection taken by a listener: its two halves and the peer's address.
pub type Accepted = (ReadHalf, WriteHalf, String);

pub type AcceptFuture<'a> = Pin<Box<dyn Future<Output = std::io::Result<Accepted>> + Send + 'a>>;

/// A bound listening socket.
pub trait Accept: Send + Sync + 'static {
    fn accept(&self) -> AcceptFuture<'_>;
    fn local_addr(&self) -> std::io::Result<SocketAddr>;
}

/// What servers serve on.
pub type Listener = Box<dyn Accept>;

impl Accept for Listener {
    fn accept(&self) -> AcceptFuture<'_> {
        (**self).accept()
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        (**self).local_addr()
    }
}

impl Accept for tokio::net::TcpListener {
    fn accept(&self) -> AcceptFuture<'_> {
        Box::pin(async move {
            let (stream, address) = tokio::net::TcpListener::accept(self).await?;
            // Requests are small and latency-bound: no Nagle.
            let _ = stream.set_nodelay(true);
            let (read, write) = stream.into_split();
            Ok((
                Box::new(read) as ReadHalf,
                Box::new(write) as WriteHalf,
                address.to_string(),
            ))
        })
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        tokio::net::TcpListener::local_addr(self)
    }
}

pub type BindFuture<'a> = Pin<Box<dyn Future<Output = std::io::Result<Listener>> + Send + 'a>>;

/// A network other than the host's: it connects (as a [`Transport`]) and binds.
pub trait SimulatedNetwork: Transport {
    fn bind<'a>(&'a self, address: &'a str) -> BindFuture<'a>;
}

thread_local! {
    static SIMULATED: RefCell<Option<Arc<dyn SimulatedNetwork>>> = const { RefCell::new(None) };
}

/// Use `network` for every bind and connection made on this thread from now on (None:
/// the host's again).
pub fn simulate_on_this_thread(network: Option<Arc<dyn SimulatedNetwork>>) {
    SIMULATED.with(|simulated| *simulated.borrow_mut() = network);
}

/// The simulated network of this thread, if one is installed.
pub(crate) fn simulated() -> Option<Arc<dyn SimulatedNetwork>> {
    SIMULATED.with(|simulated| simulated.borrow().clone())
}

/// Listen on `address` (`host:port`): over TCP, or on this thread's simulated network.
pub async fn bind(address: &str) -> std::io::Result<Listener> {
    match simulated() {
        Some(network) => network.bind(address).await,
        None => Ok(Box::new(tokio::net::TcpListener::bind(address).await?)),
    }
}

/// Connect to `address` on this thread's simulated network, None without one.
pub(crate) fn connect_simulated(address: &str) -> Option<ConnectFuture<'static>> {
    let network = simulated()?;
    let address = address.to_string();
    Some(Box::pin(async move { network.connect(&address).await }))
}

/// [`Unix`] for `unix:` addresses, [`Tcp`] for the rest; on a thread with a simulated
/// network ([`simulate_on_this_thread`]), that network.
pub struct Network;

impl Transport for Network {
    fn connect<'a>(&'a self, address: &'a str) -> ConnectFuture<'a> {
        if let Some(simulated) = connect_simulated(address) {
            return simulated;
        }
        if unix_socket_path(address).is_some() {
            Unix.connect(address)
        } else {
            Tcp.connect(address)
        }
    }
}
