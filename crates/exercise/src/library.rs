//! The exerciser's target through the client library, without the kernel: what the mount
//! does, minus the page cache and FUSE. No mapped I/O here.

use std::io;

use bytes::Bytes;
use freeflow_client::{Allocation, Client, ClientError, FileHandle, OpenOptions};
use tokio::runtime::Handle;

use crate::{AllocateMode, Target};

/// One file at `path` of a cluster, opened through `clients` (several clients of one
/// cluster: reopens move between them, with close-to-open in between).
pub struct LibraryTarget {
    clients: Vec<Client>,
    current: usize,
    path: String,
    handle: Option<FileHandle>,
    runtime: Handle,
}

fn io_error(error: ClientError) -> io::Error {
    io::Error::from_raw_os_error(error.code().errno())
}

fn with_reason(error: ClientError) -> io::Error {
    let code = error.code().errno();
    io::Error::new(
        io::Error::from_raw_os_error(code).kind(),
        format!("{error} (errno {code})"),
    )
}

impl LibraryTarget {
    /// Open (creating) `path` through the first client. Call from outside the runtime
    /// (the target blocks on it).
    pub fn open(clients: Vec<Client>, path: &str, runtime: Handle) -> io::Result<LibraryTarget> {
        if clients.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the exerciser needs a client",
            ));
        }
        let mut target = LibraryTarget {
            clients,
            current: 0,
            path: path.to_string(),
            handle: None,
            runtime,
        };
        target.handle = Some(target.open_handle(false)?);
        Ok(target)
    }

    fn open_handle(&self, truncate: bool) -> io::Result<FileHandle> {
        let options = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(truncate);
        let client = &self.clients[self.current];
        self.runtime
            .block_on(client.open_path(&self.path, &options))
            .map_err(with_reason)
    }

    fn handle(&self) -> io::Result<&FileHandle> {
        self.handle
            .as_ref()
            .ok_or_else(|| io::Error::other("the file is not open (an earlier open failed)"))
    }
}

impl Target for LibraryTarget {
    fn describe(&self) -> String {
        format!("ff:{} (client {})", self.path, self.current)
    }

    fn read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>> {
        let handle = self.handle()?;
        let data = self
            .runtime
            .block_on(handle.read_at(offset, length))
            .map_err(with_reason)?;
        Ok(data.to_vec())
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let handle = self.handle()?;
        self.runtime
            .block_on(handle.write_at(offset, Bytes::copy_from_slice(data)))
            .map_err(with_reason)
    }

    fn supports_mmap(&self) -> bool {
        false
    }

    fn map_read(&mut self, _offset: u64, _length: u64) -> io::Result<Vec<u8>> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }

    fn map_write(&mut self, _offset: u64, _data: &[u8]) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }

    fn set_size(&mut self, size: u64, by_path: bool) -> io::Result<()> {
        let handle = self.handle()?;
        let client = &self.clients[self.current];
        let result = if by_path {
            self.runtime
                .block_on(client.truncate_path(&self.path, size))
        } else {
            self.runtime.block_on(handle.set_size(size))
        };
        result.map(|_| ()).map_err(with_reason)
    }

    fn allocate(&mut self, offset: u64, length: u64, mode: AllocateMode) -> io::Result<()> {
        let how = match mode {
            AllocateMode::Allocate => Allocation::Allocate { keep_size: false },
            AllocateMode::AllocateKeepSize => Allocation::Allocate { keep_size: true },
            AllocateMode::PunchHole => Allocation::PunchHole,
            AllocateMode::ZeroRange => Allocation::ZeroRange { keep_size: false },
            AllocateMode::ZeroRangeKeepSize => Allocation::ZeroRange { keep_size: true },
        };
        let handle = self.handle()?;
        self.runtime
            .block_on(handle.allocate(offset, length, how))
            .map_err(with_reason)
    }

    fn copy_range(
        &mut self,
        source_offset: u64,
        target_offset: u64,
        length: u64,
    ) -> io::Result<u64> {
        let handle = self.handle()?;
        self.runtime
            .block_on(handle.copy_range_from(handle, source_offset, target_offset, length))
            .map_err(with_reason)
    }

    fn sync(&mut self) -> io::Result<()> {
        let handle = self.handle()?;
        self.runtime.block_on(handle.fsync()).map_err(with_reason)
    }

    fn reopen(&mut self, truncate: bool, choice: u64) -> io::Result<String> {
        if let Some(handle) = self.handle.take() {
            self.runtime.block_on(handle.close()).map_err(with_reason)?;
        }
        self.current = (choice % self.clients.len() as u64) as usize;
        self.handle = Some(self.open_handle(truncate)?);
        Ok(self.describe())
    }

    fn close(&mut self) -> io::Result<()> {
        // From outside the runtime: the target blocks on its calls.
        match self.handle.take() {
            Some(handle) => self.runtime.block_on(handle.close()).map_err(with_reason),
            None => Ok(()),
        }
    }

    fn size(&mut self) -> io::Result<u64> {
        Ok(self.handle()?.size())
    }
}

impl Drop for LibraryTarget {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                // Dropped on a runtime thread (a test that failed and unwinds): blocking
                // here would panic again, so the close goes on in the background.
                self.runtime.spawn(async move { handle.close().await });
                return;
            }
            if let Err(error) = self.runtime.block_on(handle.close()) {
                let error = io_error(error);
                eprintln!("closing the exercised file: {error}");
            }
        }
    }
}
