//! A store in a temporary directory with the writer's state, applying one operation per
//! transaction: the harness of the ops unit and property tests.

use std::path::PathBuf;

use freeflow_proto::meta::{Caller, Create, Lookup, Mkdir};
use freeflow_types::{Attr, FileKind, InodeId, TimeSpec};

use super::{initialise, OpContext, OpError, OpResult, Placement, WriterState};
use crate::store::{MetaStore, RedbRead, RedbStore, RedbWrite, StoreWrite};

pub struct Harness {
    pub directory: tempfile::TempDir,
    pub store: Option<RedbStore>,
    pub state: WriterState,
    pub placement: Placement,
    pub clock_seconds: i64,
}

impl Harness {
    pub fn new() -> Harness {
        let directory = tempfile::tempdir().expect("temp dir");
        let mut harness = Harness {
            directory,
            store: None,
            state: WriterState {
                next_inode: 0,
                reserved_until: 0,
                inode_count: 0,
                orphan_count: 0,
                boot_epoch: 0,
                placement_counter: 0,
                next_txn: 1,
                txn_reserved_until: 1,
                recovered_txn: 0,
                high_water_moved: false,
            },
            placement: Placement {
                servers: vec![10, 11, 12],
                spares: Vec::new(),
                default_stripe_unit_bytes: 1 << 20,
                default_stripe_count: 0,
                default_replicas: 1,
            },
            clock_seconds: 1_000,
        };
        harness.reopen();
        harness
    }

    pub fn path(&self) -> PathBuf {
        self.directory.path().join("meta.redb")
    }

    /// Close and open the store again, as a restart does.
    pub fn reopen(&mut self) {
        self.store = None;
        let store = RedbStore::open(&self.path()).expect("open store");
        let mut write = store.begin_write().expect("begin");
        self.state = initialise(&mut write, TimeSpec::new(self.clock_seconds, 0)).expect("init");
        write.commit().expect("commit");
        self.store = Some(store);
    }

    pub fn store(&self) -> &RedbStore {
        self.store.as_ref().expect("store open")
    }

    /// One operation in its own transaction, committed unless the store failed.
    pub fn write<T>(
        &mut self,
        operation: impl FnOnce(&mut RedbWrite, &mut OpContext<'_>) -> OpResult<T>,
    ) -> OpResult<T> {
        self.clock_seconds += 1;
        let store = self.store.as_ref().expect("store open");
        let mut write = store.begin_write()?;
        let txn = self.state.begin_txn(&mut write)?;
        let mut context = OpContext::new(
            TimeSpec::new(self.clock_seconds, 0),
            &self.placement,
            &mut self.state,
            txn,
        );
        let result = operation(&mut write, &mut context);
        match &result {
            Err(OpError::Store(_)) => write.abort()?,
            _ => {
                self.state.persist(&mut write)?;
                write.commit()?;
            }
        }
        result
    }

    pub fn read<T>(&self, operation: impl FnOnce(&RedbRead) -> OpResult<T>) -> OpResult<T> {
        let read = self.store().begin_read()?;
        operation(&read)
    }

    pub fn mkdir(&mut self, parent: InodeId, name: &str) -> OpResult<Attr> {
        let request = Mkdir {
            caller: Caller::root(),
            parent,
            name: name.into(),
            permissions: 0o755,
        };
        self.write(|write, context| super::create::mkdir(write, context, &request))
    }

    pub fn create(&mut self, parent: InodeId, name: &str) -> OpResult<Attr> {
        self.create_as(Caller::root(), parent, name, 0o644)
    }

    pub fn create_as(
        &mut self,
        caller: Caller,
        parent: InodeId,
        name: &str,
        permissions: u32,
    ) -> OpResult<Attr> {
        let request = Create {
            caller,
            parent,
            name: name.into(),
            kind: FileKind::Regular,
            permissions,
            device: 0,
            exclusive: true,
            open: None,
            inode: None,
        };
        self.write(|write, context| super::create::create(write, context, &request))
            .map(|outcome| outcome.reply.attr)
    }

    pub fn lookup(&self, parent: InodeId, name: &str) -> OpResult<Attr> {
        let request = Lookup {
            caller: Caller::root(),
            parent,
            name: name.into(),
        };
        self.read(|read| super::lookup::lookup(read, &request))
    }

    pub fn attr(&self, inode: InodeId) -> OpResult<Attr> {
        self.read(|read| Ok(super::load_inode(read, inode)?.attr))
    }
}

pub fn user(user_id: u32, group_id: u32) -> Caller {
    Caller {
        user_id,
        group_id,
        groups: Vec::new(),
    }
}
