//! What `freeflow fsck` asks of the servers: the meta server's facts about inodes and the
//! I/O servers' objects, and the repairs it may make (cut an object to its length, remove
//! objects). Nothing here is needed to use the file system.

use bytes::Bytes;
use freeflow_proto::io::{ListObjects, ObjectListing, RemoveObject, RemoveObjects, TruncateObject};
use freeflow_proto::meta::{InodeFacts, InspectInodes};
use freeflow_proto::Request;
use freeflow_types::{InodeId, ObjectId, ServerId};

use crate::{Client, ClientError};

impl Client {
    /// What the meta server knows of each of `inodes` (at most `INSPECT_INODES_MAX`).
    pub async fn inspect_inodes(&self, inodes: &[InodeId]) -> Result<Vec<InodeFacts>, ClientError> {
        let request = InspectInodes {
            inodes: inodes.to_vec(),
        };
        self.shared
            .pool
            .meta_call(&request, || format!("{} inodes", inodes.len()))
            .await
    }

    /// The objects of shard `shard` of I/O server `server` after `after` (at most
    /// `limit`), in order.
    pub async fn list_objects(
        &self,
        server: ServerId,
        shard: u32,
        after: Option<ObjectId>,
        limit: u32,
    ) -> Result<ObjectListing, ClientError> {
        let request = ListObjects {
            shard,
            after,
            limit,
        };
        let what = format!("objects of shard {shard}");
        self.io_request(server, 0, &request, what).await
    }

    /// Cut `object` on `server` to `length` bytes (never extends it).
    pub async fn cut_object(
        &self,
        server: ServerId,
        object: ObjectId,
        length: u64,
    ) -> Result<(), ClientError> {
        let request = TruncateObject {
            object,
            length,
            forward: Vec::new(),
        };
        let what = format!("object {}.{}", object.inode, object.stripe_index);
        self.io_request(server, object.inode, &request, what)
            .await
            .map(|_| ())
    }

    /// Remove `object` from `server`, leaving the inode's other objects there writable.
    pub async fn remove_object(
        &self,
        server: ServerId,
        object: ObjectId,
    ) -> Result<(), ClientError> {
        let request = RemoveObject { object };
        let what = format!("object {}.{}", object.inode, object.stripe_index);
        self.io_request(server, object.inode, &request, what).await
    }

    /// Remove the objects of `stripes` of `inode` from `server`; the server then refuses
    /// writes to that inode (it is gone).
    pub async fn remove_objects(
        &self,
        server: ServerId,
        inode: InodeId,
        stripes: Vec<u32>,
    ) -> Result<(), ClientError> {
        let request = RemoveObjects { inode, stripes };
        let what = format!("objects of inode {inode}");
        self.io_request(server, inode, &request, what).await
    }

    /// One request without payload to I/O server `server`, about `what`.
    async fn io_request<R: Request>(
        &self,
        server: ServerId,
        inode: InodeId,
        request: &R,
        what: String,
    ) -> Result<R::Reply, ClientError> {
        let target = || format!("{what} on server {server}");
        let (reply, _) = self
            .shared
            .pool
            .io_call(server, inode, request, Bytes::new(), target)
            .await?;
        Ok(reply)
    }
}
