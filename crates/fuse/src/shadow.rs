//! Writeback mounts: what the kernel's pages of a file held before this host's programs
//! changed them, so that a page written back carries only the bytes changed here.
//!
//! The kernel writes back whole pages. A page it read from the cluster, then changed in a
//! few bytes, would otherwise carry the rest of the page as it was read, over bytes another
//! client wrote there since (two hosts writing neighbouring records of one file, records
//! meeting or taking turns inside a page). So while the kernel has a file open for
//! writing here, the mount keeps a copy of every page it answers a read with and of every
//! page written back (the *shadow*). A page written back is compared with its shadow and
//! only the runs of changed bytes are sent; runs closer than [`CHANGED_GAP_MIN`] bytes go
//! as one (bytes equal by chance inside what a program wrote do not cut it up; a
//! neighbour's record between them would be shorter than that), and a page changed in
//! more than [`PAGE_SPANS_MAX`] places goes from its first changed byte to its last.
//!
//! A page the kernel did not read has no shadow: it was written whole, or begun past what
//! the kernel knew as the end of the file, where it fills the rest with zeros. Such a page
//! goes whole, but for a page outside what this host knows the file holds (`known`: the
//! size at the first write open or at its last truncation, and every range this host
//! wrote since; at the open, the smaller of the meta server's size and the size the
//! kernel keeps, `held.rs`, since the kernel begins pages past its own end unread): its
//! zeros are taken for the kernel's filling around what was written here
//! (the room of other hosts' records, in an N-to-1 file) and only its runs of other bytes
//! are sent (the cluster holds nothing of this host's there, so zeros a program wrote read
//! as zeros unsent, and another host's bytes under them stay); a page of zeros alone was
//! written and goes whole. Ranges, not a high-water mark: the kernel's write-backs reach
//! the mount out of order (one per session thread), and a page begun past the end whose
//! write-back comes after a later range's is still known as filling. A write-back that
//! goes past `extent` (the most this host knows the file holds: the size at the first
//! write open, grown by this host's writes, set by its truncations) ends the file where
//! the kernel says: if its last bytes are not sent, the file grows to its end without them
//! (`FileHandle::extend_to`) rather than by a byte written over another host's. A page
//! this host knows of and that was not read still goes whole.
//!
//! The kernel drops a file's pages at every open (no `FOPEN_KEEP_CACHE`), so copies start
//! at the first write open and go at the last close (the kernel writes back before a
//! release). A copy can outlive its page (reclaim, a revocation's invalidation, a second
//! write open): a later write of the whole page is then compared with it, and bytes equal
//! to it are not sent, which on one host changes nothing (the copy is what the cluster
//! holds there: truncations, direct writes, `fallocate`, `copy_file_range` and failed
//! writes drop the copies they make untrue, and a read that began before one of them is
//! not copied). Only reads into the kernel's pages are copied (not direct reads), and only
//! whole pages (or the page the file ends in).
//!
//! A write-back's copy is a view of the buffer the write-back came in, not a copy of its
//! bytes (a page of its own only where that buffer ends inside the page): the bytes are
//! copied once out of the kernel's request buffer, and that one buffer is what is sent and
//! what is kept. A read's pages are copied together into one buffer (its answer may be a
//! view of a larger buffer, which a view kept here would hold uncounted). A buffer stays in memory whole while any page
//! is a view of it, so the bound, [`SHADOW_BYTES_MAX`], counts the buffers' bytes; past
//! it the oldest copies go, and their pages are sent whole if written back (as without
//! shadows). Where the kernel's pages are not [`PAGE_BYTES`] long nothing is copied.

// A Vec of one range here is one span of bytes, not the numbers in it.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use std::sync::Mutex;

use bytes::Bytes;
use freeflow_types::InodeId;

/// The kernel's page size here (x86-64, arm64 with 4 KiB pages).
pub const PAGE_BYTES: u64 = 4096;

/// Most bytes the copies keep in memory over all files (64 MiB, counting whole the
/// buffers they are views of); past it the oldest copies go.
pub const SHADOW_BYTES_MAX: usize = 64 << 20;

/// The order of copies is rid of stale entries once they pass twice this many or twice
/// the pages held.
const SHADOW_ORDER_MIN: usize = 16_384;

/// A page of zeros, what a page begun past the end is compared with.
static ZEROS: [u8; PAGE_BYTES as usize] = [0; PAGE_BYTES as usize];

/// Changed bytes closer than this are sent as one span: bytes equal by chance inside what a
/// program wrote do not cut it into pieces (a neighbour's record is longer).
const CHANGED_GAP_MIN: usize = 16;

/// Most spans one page is sent in; a page changed in more places goes from its first to
/// its last changed byte (each span is a request of its own).
const PAGE_SPANS_MAX: usize = 8;

struct FileShadow {
    /// The most this host knows the file holds (see the module doc).
    extent: u64,
    /// Where this host knows what the file holds (see the module doc).
    known: Known,
    /// Page index → the page's copy as the kernel holds it (zeros past the file's end).
    pages: BTreeMap<u64, Page>,
    /// Moves at each change of the file here that is not a write-back (truncation, direct
    /// write, failed write): a read answered from before it is not copied.
    epoch: u64,
}

/// Most ranges written here that a file's [`Known`] keeps apart; past it they are taken
/// as one, from the start of the file to the end of the last (a page below that end
/// without a copy then goes whole, as with a high-water mark).
const KNOWN_RANGES_MAX: usize = 4096;

/// Where this host knows what a file holds: below `below` (its size at the first write
/// open or its last truncation here) and in each range this host wrote since.
#[derive(Default)]
struct Known {
    below: u64,
    /// Start → end of the ranges written here, apart (neither overlapping nor touching).
    ranges: BTreeMap<u64, u64>,
}

impl Known {
    fn new(below: u64) -> Known {
        Known {
            below,
            ranges: BTreeMap::new(),
        }
    }

    /// This host wrote `start..end`.
    fn add(&mut self, mut start: u64, mut end: u64) {
        if end <= start || end <= self.below {
            return;
        }
        start = start.max(self.below);
        // Take in every range that overlaps or touches `start..end`.
        let first = self
            .ranges
            .range(..=start)
            .next_back()
            .filter(|(_, &previous_end)| previous_end >= start)
            .map_or(start, |(&previous_start, _)| previous_start);
        let joined: Vec<(u64, u64)> = self
            .ranges
            .range(first..=end)
            .map(|(&from, &to)| (from, to))
            .collect();
        for (from, to) in joined {
            self.ranges.remove(&from);
            start = start.min(from);
            end = end.max(to);
        }
        self.ranges.insert(start, end);
        if self.ranges.len() > KNOWN_RANGES_MAX {
            // Apart and in order: the last range ends last.
            let last = self.ranges.last_key_value().map_or(end, |(_, &last)| last);
            *self = Known::new(last);
        }
    }

    /// Whether this host knows what the file holds anywhere in `start..end`.
    fn covers_any(&self, start: u64, end: u64) -> bool {
        start < self.below
            || self
                .ranges
                .range(..end)
                .next_back()
                .is_some_and(|(_, &range_end)| range_end > start)
    }
}

/// One page's copy: a view of the buffer a write-back or a read came in (not a copy of
/// its bytes), or a page of its own where that buffer ends inside the page.
struct Page {
    /// When it was kept (a number of `Table::copied`).
    number: u64,
    /// The buffer its bytes are a view of (a number of `Table::buffers`).
    buffer: u64,
    /// [`PAGE_BYTES`] long.
    bytes: Bytes,
}

/// A buffer that pages are views of: kept whole in memory while any of them is.
struct Buffer {
    length: usize,
    pages: usize,
}

#[derive(Default)]
struct Table {
    files: HashMap<InodeId, FileShadow>,
    /// Pages held, over all files.
    pages: usize,
    /// Copies made so far: numbers each one.
    copied: u64,
    /// Buffers numbered so far.
    numbered: u64,
    /// The buffers the held pages are views of, by number.
    buffers: HashMap<u64, Buffer>,
    /// Their bytes: what the copies keep in memory, at most [`SHADOW_BYTES_MAX`] (and one
    /// buffer) past each change.
    held_bytes: usize,
    /// Pages in the order they were copied, by number (an entry whose page was copied again
    /// or dropped since is stale and skipped): the oldest go first past
    /// [`SHADOW_BYTES_MAX`].
    order: VecDeque<(InodeId, u64, u64)>,
}

impl Table {
    /// Number a buffer of `length` bytes that pages will be views of.
    fn buffer(&mut self, length: usize) -> u64 {
        self.numbered += 1;
        self.buffers
            .insert(self.numbered, Buffer { length, pages: 0 });
        self.numbered
    }

    /// A buffer numbered by [`Table::buffer`] is done with: if no page is a view of it,
    /// it goes.
    fn buffer_done(&mut self, buffer: u64) {
        if self
            .buffers
            .get(&buffer)
            .is_some_and(|held| held.pages == 0)
        {
            self.buffers.remove(&buffer);
        }
    }

    /// Keep `bytes` (zeros past them) as the copy of page `index` of `inode`: a view of
    /// `bytes` (of buffer `buffer`) when it is a whole page, else a page of its own.
    fn keep(&mut self, inode: InodeId, index: u64, bytes: Bytes, buffer: u64) {
        if !self.files.contains_key(&inode) {
            return;
        }
        let (bytes, buffer) = if bytes.len() == PAGE_BYTES as usize {
            (bytes, buffer)
        } else {
            let mut page = vec![0u8; PAGE_BYTES as usize];
            page[..bytes.len()].copy_from_slice(&bytes);
            let own = self.buffer(PAGE_BYTES as usize);
            (Bytes::from(page), own)
        };
        self.copied += 1;
        let number = self.copied;
        let page = Page {
            number,
            buffer,
            bytes,
        };
        self.hold(buffer);
        let replaced = self
            .files
            .get_mut(&inode)
            .and_then(|file| file.pages.insert(index, page));
        match replaced {
            Some(old) => self.release(old.buffer),
            None => self.pages += 1,
        }
        self.order.push_back((inode, index, number));
        self.evict();
    }

    /// A page now views `buffer`.
    fn hold(&mut self, buffer: u64) {
        let Some(held) = self.buffers.get_mut(&buffer) else {
            return;
        };
        held.pages += 1;
        if held.pages == 1 {
            self.held_bytes += held.length;
        }
    }

    /// A page viewing `buffer` went: the buffer goes with its last page.
    fn release(&mut self, buffer: u64) {
        let Some(held) = self.buffers.get_mut(&buffer) else {
            return;
        };
        held.pages -= 1;
        if held.pages == 0 {
            self.held_bytes -= held.length;
            self.buffers.remove(&buffer);
        }
    }

    /// Take page `index` of `inode` out of the table.
    fn remove(&mut self, inode: InodeId, index: u64) -> Option<Page> {
        let page = self.files.get_mut(&inode)?.pages.remove(&index)?;
        self.pages -= 1;
        self.release(page.buffer);
        Some(page)
    }

    /// Whether the order's entry stands for a copy still held.
    fn live(&self, inode: InodeId, index: u64, number: u64) -> bool {
        self.files
            .get(&inode)
            .and_then(|file| file.pages.get(&index))
            .is_some_and(|page| page.number == number)
    }

    /// Drop the oldest copy; false if there is none.
    fn drop_oldest(&mut self) -> bool {
        while let Some((inode, index, number)) = self.order.pop_front() {
            if self.live(inode, index, number) {
                return self.remove(inode, index).is_some();
            }
        }
        false
    }

    /// Drop the oldest copies while their buffers hold more than the bound (their pages go
    /// whole if written back), and the order's stale entries when they outnumber the live
    /// ones (each copy has one live entry, so the order stays within twice the pages).
    fn evict(&mut self) {
        while self.held_bytes > SHADOW_BYTES_MAX && self.drop_oldest() {}
        if self.order.len() > 2 * SHADOW_ORDER_MIN.max(self.pages) {
            let order = std::mem::take(&mut self.order);
            self.order = order
                .into_iter()
                .filter(|&(inode, index, number)| self.live(inode, index, number))
                .collect();
        }
    }

    /// Drop the copies of `inode`'s pages in `indexes`.
    fn forget(&mut self, inode: InodeId, indexes: impl std::ops::RangeBounds<u64>) {
        let Some(file) = self.files.get_mut(&inode) else {
            return;
        };
        file.epoch += 1;
        let gone: Vec<u64> = file.pages.range(indexes).map(|(&index, _)| index).collect();
        for index in gone {
            self.remove(inode, index);
        }
    }
}

/// The shadows of the files open for writing on a writeback mount.
pub struct Shadows {
    table: Mutex<Table>,
    /// Off on a mount without the kernel's writeback cache, and where the kernel's pages
    /// are not [`PAGE_BYTES`] long: nothing is followed, and no call takes the lock.
    enabled: bool,
}

/// Where a file stood when a read began (`Shadows::reading`): its answer is copied only if
/// nothing but write-backs changed the file meanwhile.
#[derive(Clone, Copy)]
pub struct ReadStart(Option<u64>);

impl Shadows {
    /// Shadows for a mount with the kernel's writeback cache on (`writeback`), or none.
    pub fn new(writeback: bool) -> Shadows {
        // SAFETY: sysconf reads a constant of the system; no memory is involved.
        let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Shadows {
            table: Mutex::new(Table::default()),
            enabled: writeback && page_bytes == PAGE_BYTES as libc::c_long,
        }
    }

    /// The table, unless shadows are off.
    fn table(&self) -> Option<std::sync::MutexGuard<'_, Table>> {
        self.enabled
            .then(|| self.table.lock().expect("shadows not poisoned"))
    }

    /// The kernel opens `inode` for writing: its pages are dropped at this open, and
    /// both the cluster and the kernel hold at least `size` bytes of it (the smaller of
    /// the two sizes: pages past the kernel's own end are begun unread). A file followed
    /// already keeps its copies and its `extent` (a later open's size may include other
    /// hosts' growth, which this host's kernel has not seen: its pages there are its own
    /// filling).
    pub fn begin(&self, inode: InodeId, size: u64) {
        let Some(mut table) = self.table() else {
            return;
        };
        table.files.entry(inode).or_insert(FileShadow {
            extent: size,
            known: Known::new(size),
            pages: BTreeMap::new(),
            epoch: 0,
        });
    }

    /// A read of `inode` begins (see [`Shadows::read`]).
    pub fn reading(&self, inode: InodeId) -> ReadStart {
        ReadStart(
            self.table()
                .and_then(|table| table.files.get(&inode).map(|file| file.epoch)),
        )
    }

    /// A write-back or a flush of `inode` failed: what the copies say the cluster holds
    /// may not be there, so they go (its pages go whole from here).
    pub fn failed(&self, inode: InodeId) {
        if let Some(mut table) = self.table() {
            table.forget(inode, ..);
        }
    }

    /// The cluster holds at least `size` bytes of `inode` after a change by this host.
    pub fn grown(&self, inode: InodeId, size: u64) {
        let Some(mut table) = self.table() else {
            return;
        };
        if let Some(file) = table.files.get_mut(&inode) {
            file.extent = file.extent.max(size);
        }
    }

    /// The most this host knows `inode` holds while the kernel has it open for writing
    /// here (no more than the size the kernel keeps of it, once its writes went back),
    /// if followed.
    pub fn extent(&self, inode: InodeId) -> Option<u64> {
        self.table()?.files.get(&inode).map(|file| file.extent)
    }

    /// The last write open of `inode` here was released: its dirty pages went out before.
    pub fn end(&self, inode: InodeId) {
        let Some(mut table) = self.table() else {
            return;
        };
        if let Some(file) = table.files.get(&inode) {
            let indexes: Vec<u64> = file.pages.keys().copied().collect();
            for index in indexes {
                table.remove(inode, index);
            }
            table.files.remove(&inode);
        }
        table.evict();
    }

    /// The kernel asked for `size` bytes at `offset` through its page cache (not a direct
    /// read) and is given `data` (short at the end of the file: it fills the rest of the
    /// page with zeros). Called before the reply, so that the copy is there before the
    /// kernel can change the page; `start` from [`Shadows::reading`] before the read.
    /// Only whole pages are copied (or the page the file ends in).
    pub fn read(&self, inode: InodeId, start: ReadStart, offset: u64, size: u64, data: &[u8]) {
        if !offset.is_multiple_of(PAGE_BYTES) {
            return;
        }
        let Some(mut table) = self.table() else {
            return;
        };
        let current = table.files.get(&inode).map(|file| file.epoch);
        if start.0.is_none() || current != start.0 {
            return;
        }
        let ended = (data.len() as u64) < size;
        // Copied: a reply's bytes may be a view of a larger buffer (a local read's), which
        // a view kept here would hold in memory uncounted.
        let data = Bytes::copy_from_slice(data);
        let buffer = table.buffer(data.len());
        let mut at = 0u64;
        while at < size {
            if at + PAGE_BYTES > size && !ended {
                break;
            }
            let from = (at as usize).min(data.len());
            let to = ((at + PAGE_BYTES) as usize).min(data.len());
            table.keep(
                inode,
                (offset + at) / PAGE_BYTES,
                data.slice(from..to),
                buffer,
            );
            at += PAGE_BYTES;
        }
        table.buffer_done(buffer);
    }

    /// The kernel writes back `data` at `offset` (pages from its cache): the spans to send,
    /// as offsets into `data`, in order, and the size the file must grow to without a byte
    /// sent there (the write-back's end, when it goes past what this host knows the file
    /// holds and its last bytes are not sent: they are the kernel's filling or what the
    /// copy says is there, and another host may have written there since). The shadows
    /// take the new bytes (as views of `data`) and `extent` grows to the write's end. A
    /// file not followed is sent whole.
    pub fn write_back(
        &self,
        inode: InodeId,
        offset: u64,
        data: &Bytes,
    ) -> (Vec<Range<usize>>, Option<u64>) {
        let whole = (vec![0..data.len()], None);
        if data.is_empty() || !offset.is_multiple_of(PAGE_BYTES) {
            return whole;
        }
        let Some(mut table) = self.table() else {
            return whole;
        };
        let Some(file) = table.files.get(&inode) else {
            return whole;
        };
        let extent = file.extent;
        let buffer = table.buffer(data.len());
        // Runs of neighbouring pages join under the rule of runs inside a page: a page
        // that happens to begin or end in a zero byte does not cut a long write-back of
        // a program's bytes into pieces (each a request of its own, unaligned, so past
        // the I/O server's O_DIRECT path and into its page cache for the fsync to flush).
        let mut spans: Vec<Range<usize>> = Vec::new();
        let mut add = |span: Range<usize>| match spans.last_mut() {
            Some(previous) if span.start - previous.end < CHANGED_GAP_MIN => {
                previous.end = span.end
            }
            _ => spans.push(span),
        };
        let mut at = 0usize;
        while at < data.len() {
            let end = (at + PAGE_BYTES as usize).min(data.len());
            let bytes = &data[at..end];
            let index = (offset + at as u64) / PAGE_BYTES;
            let file = table.files.get(&inode).expect("followed above");
            let runs = match file.pages.get(&index).map(|page| &page.bytes) {
                Some(shadow) if *bytes == shadow[..bytes.len()] => Vec::new(),
                Some(shadow) => changed_runs(bytes, &shadow[..bytes.len()]),
                // A page outside what this host knows the file holds (this write-back
                // counts as known only after the loop): its zeros are the kernel's
                // filling around what was written here (the room of other hosts' records)
                // or zeros a program here wrote where the cluster holds nothing of this
                // host's, which read as zeros unsent; only the runs of other bytes go (a
                // page of zeros alone was written, and goes whole).
                None if !file
                    .known
                    .covers_any(offset + at as u64, offset + end as u64) =>
                {
                    let runs = changed_runs(bytes, &ZEROS[..bytes.len()]);
                    if runs.is_empty() {
                        vec![0..bytes.len()]
                    } else {
                        runs
                    }
                }
                None => vec![0..bytes.len()],
            };
            for run in runs {
                add(at + run.start..at + run.end);
            }
            table.keep(inode, index, data.slice(at..end), buffer);
            at = end;
        }
        table.buffer_done(buffer);
        // A write past what is known to be held ends the file there, as the kernel says;
        // where its last bytes are not sent, the size grows without them (sending the last
        // byte would write the kernel's zero over another host's byte).
        let write_end = offset + data.len() as u64;
        let grow = (write_end > extent && spans.last().is_none_or(|span| span.end < data.len()))
            .then_some(write_end);
        if let Some(file) = table.files.get_mut(&inode) {
            file.extent = file.extent.max(write_end);
            file.known.add(offset, write_end);
        }
        (spans, grow)
    }

    /// This host changes `length` bytes at `offset` past the kernel's pages (a direct
    /// write, `fallocate`, `copy_file_range`): the pages it covers will be the cluster's,
    /// not what a shadow says. Called before the change is sent; [`Shadows::grown`] after
    /// it, with the size it left.
    pub fn written_directly(&self, inode: InodeId, offset: u64, length: u64) {
        if length == 0 {
            return;
        }
        let Some(mut table) = self.table() else {
            return;
        };
        table.forget(
            inode,
            offset / PAGE_BYTES..=(offset + length - 1) / PAGE_BYTES,
        );
        // Known from here, whether or not the change lands whole: a page of it written
        // whole later goes whole, zeros too.
        if let Some(file) = table.files.get_mut(&inode) {
            file.known.add(offset, offset + length);
        }
    }

    /// This host cut `inode` to `size`: the kernel dropped its pages past it and zeroed the
    /// rest of the page the end falls in; nothing of this host's is past it any more.
    pub fn truncated(&self, inode: InodeId, size: u64) {
        let Some(mut table) = self.table() else {
            return;
        };
        table.forget(inode, size.div_ceil(PAGE_BYTES)..);
        let Some(file) = table.files.get_mut(&inode) else {
            return;
        };
        file.extent = size;
        file.known = Known::new(size);
        // The rest of the page the end falls in is zeros now: the page is kept again, cut
        // there (a page of its own; the view it was may be shared).
        let index = size / PAGE_BYTES;
        if !size.is_multiple_of(PAGE_BYTES) {
            if let Some(page) = file.pages.get(&index) {
                let kept = page.bytes.slice(..(size % PAGE_BYTES) as usize);
                table.keep(inode, index, kept, 0);
            }
        }
    }

    /// Pages copied now, over all files.
    #[cfg(test)]
    fn pages(&self) -> usize {
        self.table().map_or(0, |table| table.pages)
    }
}

/// The runs of `bytes` that differ from `old`, runs closer than [`CHANGED_GAP_MIN`] joined;
/// past [`PAGE_SPANS_MAX`] runs, one from the first changed byte to the last.
fn changed_runs(bytes: &[u8], old: &[u8]) -> Vec<Range<usize>> {
    const WORD: usize = 8;
    let old = &old[..bytes.len()];
    let mut runs: Vec<Range<usize>> = Vec::new();
    // The whole page first, in one compare (a page written back unchanged, zeros over
    // the kernel's filling); then word by word, each word compared in a register (a call
    // of `memcmp` per word cost more than the rest of a write-back's work here), and each
    // run's ends to the byte.
    if bytes == old {
        return runs;
    }
    let words = bytes.len().div_ceil(WORD);
    let same = |k: usize| {
        let (from, to) = (k * WORD, ((k + 1) * WORD).min(bytes.len()));
        match (bytes[from..to].try_into(), old[from..to].try_into()) {
            (Ok(new), Ok(was)) => u64::from_ne_bytes(new) == u64::from_ne_bytes(was),
            _ => bytes[from..to] == old[from..to],
        }
    };
    let mut k = 0;
    while k < words {
        if same(k) {
            k += 1;
            continue;
        }
        let at = k * WORD;
        let start = (at..bytes.len())
            .find(|&i| bytes[i] != old[i])
            .expect("a word that differs has a byte that does");
        let mut last = k + 1;
        while last < words && !same(last) {
            last += 1;
        }
        k = last;
        let mut end = (last * WORD).min(bytes.len());
        // Back to the last changed byte of the run's last word.
        while end > start + 1 && bytes[end - 1] == old[end - 1] {
            end -= 1;
        }
        match runs.last_mut() {
            Some(previous) if start - previous.end < CHANGED_GAP_MIN => previous.end = end,
            _ => runs.push(start..end),
        }
    }
    if runs.len() > PAGE_SPANS_MAX {
        let whole = runs[0].start..runs[runs.len() - 1].end;
        runs = vec![whole];
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = PAGE_BYTES as usize;

    /// Pages of their own the bound holds.
    const PAGES_MAX: usize = SHADOW_BYTES_MAX / PAGE;

    impl Shadows {
        /// The spans of a write-back alone.
        fn spans(&self, inode: InodeId, offset: u64, data: &Bytes) -> Vec<Range<usize>> {
            self.write_back(inode, offset, data).0
        }
    }

    /// A buffer of `bytes`, as a write-back or a read comes.
    fn b(bytes: &[u8]) -> Bytes {
        Bytes::copy_from_slice(bytes)
    }

    #[test]
    fn a_page_read_then_changed_in_part_sends_only_the_changed_span() {
        let shadows = Shadows::new(true);
        shadows.begin(7, 3 * PAGE_BYTES);
        let old = vec![b'o'; 2 * PAGE];
        shadows.read(7, shadows.reading(7), 0, 2 * PAGE_BYTES, &old);
        let mut page = old.clone();
        page[10..20].fill(b'n');
        page[PAGE + 100] = b'n';
        assert_eq!(
            shadows.spans(7, 0, &b(&page[..PAGE])),
            vec![10..20],
            "inside the file: the changed span alone"
        );
        let shadows = Shadows::new(true);
        shadows.begin(7, 3 * PAGE_BYTES);
        shadows.read(7, shadows.reading(7), 0, 2 * PAGE_BYTES, &old);
        assert_eq!(
            shadows.spans(7, 0, &b(&page)),
            vec![10..20, PAGE + 100..PAGE + 101],
            "one span per changed page"
        );
        // Written back again unchanged: nothing goes.
        assert_eq!(shadows.spans(7, 0, &b(&page)), Vec::<Range<usize>>::new());
        // Past the end: the last page goes to the write's end, for the size.
        let mut longer = page.clone();
        longer.resize(3 * PAGE + 10, b'o');
        assert_eq!(
            shadows.spans(7, 0, &b(&longer)),
            vec![2 * PAGE..3 * PAGE + 10],
            "a page not read inside the file goes whole, the rest to the write's end"
        );
        // Changed again: compared with what was written back, not with what was read.
        page[30] = b'm';
        assert_eq!(shadows.spans(7, 0, &b(&page)), vec![30..31]);
    }

    #[test]
    fn pages_begun_past_the_end_do_not_send_the_kernels_zeros() {
        let shadows = Shadows::new(true);
        // An empty file: another host writes [0, 1000), this one [1000, 2000).
        shadows.begin(3, 0);
        let mut page = vec![0u8; 2000];
        page[1000..].fill(b'a');
        assert_eq!(shadows.spans(3, 0, &b(&page)), vec![1000..2000]);
        // Then this host writes [3000, 3100) in the same page: [2000, 3000) is the
        // kernel's zeros, the page compares with what went out.
        let mut page = page.clone();
        page.resize(3100, 0);
        page[3000..].fill(b'b');
        assert_eq!(shadows.spans(3, 0, &b(&page)), vec![3000..3100]);
        // Below what the file held when opened, a page not read is sent whole.
        let shadows = Shadows::new(true);
        shadows.begin(4, 10 * PAGE_BYTES);
        let zeros = vec![0u8; PAGE];
        assert_eq!(
            shadows.spans(4, PAGE_BYTES, &b(&zeros)),
            vec![0..PAGE],
            "zeros written over old bytes are sent"
        );
        // Past it, a page of zeros alone is sent whole too (written, not filled).
        assert_eq!(shadows.spans(4, 20 * PAGE_BYTES, &b(&zeros)), vec![0..PAGE]);
        // A long write-back goes as one span, and each of its pages is copied.
        let shadows = Shadows::new(true);
        shadows.begin(8, 0);
        let data = vec![b'd'; 5 * PAGE + 7];
        assert_eq!(shadows.spans(8, 0, &b(&data)), vec![0..data.len()]);
        assert_eq!(shadows.pages(), 6);
        // Written a second time, the page compares with its copy: records of two hosts
        // taking turns inside it each keep their own bytes.
        let shadows = Shadows::new(true);
        shadows.begin(10, 0);
        let mut page = vec![0u8; 1000];
        page.fill(b'a');
        assert_eq!(shadows.spans(10, 0, &b(&page)), vec![0..1000]);
        page.resize(3000, 0);
        page[2000..].fill(b'a');
        assert_eq!(shadows.spans(10, 0, &b(&page)), vec![2000..3000]);
        // Past the end this host knows, zeros go unsent wherever they are in a page (the
        // cluster holds nothing of this host's there, so they read as zeros anyway).
        let mut page = vec![b'a'; PAGE];
        page[100..1000].fill(0);
        assert_eq!(
            shadows.spans(10, 4 * PAGE_BYTES, &b(&page)),
            vec![0..100, 1000..PAGE]
        );
        // So in every page of a long write-back begun past the end, not only its first:
        // this host's records with the room of another host's between them.
        let shadows = Shadows::new(true);
        shadows.begin(16, 0);
        let mut pages = vec![0u8; 3 * PAGE];
        for record in [
            0..1000,
            2000..3000,
            4000..5000,
            6000..7000,
            8000..9000,
            10_000..11_000,
        ] {
            pages[record].fill(b'r');
        }
        assert_eq!(
            shadows.spans(16, 0, &b(&pages)),
            vec![
                0..1000,
                2000..3000,
                4000..5000,
                6000..7000,
                8000..9000,
                10_000..11_000
            ],
            "the zeros between the records stay unsent in the second and third pages too"
        );
        // A program's bytes that happen to end one page and begin the next in zeros go
        // as one span, as inside a page: a long write-back is not cut at page edges.
        let shadows = Shadows::new(true);
        shadows.begin(17, 0);
        let mut pages = vec![b'p'; 3 * PAGE];
        pages[PAGE - 3..PAGE + 5].fill(0);
        pages[2 * PAGE - 1] = 0;
        assert_eq!(shadows.spans(17, 0, &b(&pages)), vec![0..3 * PAGE]);
        // But a gap as long as a record between pages still stays unsent.
        let shadows = Shadows::new(true);
        shadows.begin(18, 0);
        let mut pages = vec![b'p'; 2 * PAGE];
        pages[PAGE - 8..PAGE + 8].fill(0);
        assert_eq!(
            shadows.spans(18, 0, &b(&pages)),
            vec![0..PAGE - 8, PAGE + 8..2 * PAGE]
        );
    }

    #[test]
    fn a_write_back_past_the_end_grows_the_file_without_sending_its_last_zeros() {
        let shadows = Shadows::new(true);
        shadows.begin(20, 0);
        let mut page = vec![b'a'; 1000];
        assert_eq!(shadows.write_back(20, 0, &b(&page)), (vec![0..1000], None));
        // This kernel has since learned the file is longer (another host wrote past it) and
        // writes the page back whole, with bytes of its own at 1000 and its zeros past
        // them, where the other host's bytes may be: they are not sent, the size grows.
        page.resize(PAGE, 0);
        page[1000..1500].fill(b'b');
        assert_eq!(
            shadows.write_back(20, 0, &b(&page)),
            (vec![1000..1500], Some(PAGE_BYTES)),
            "the zeros at the end stay unsent"
        );
        // Nothing past what it knows now: no growth asked.
        page[2000] = b'c';
        assert_eq!(
            shadows.write_back(20, 0, &b(&page)),
            (vec![2000..2001], None)
        );
        // A second write open here, after another host grew the file, does not move the
        // end this host knows: this kernel's pages past it are still its own filling.
        shadows.begin(20, 40 * PAGE_BYTES);
        let mut far = vec![0u8; PAGE];
        far[100..200].fill(b'f');
        assert_eq!(
            shadows.write_back(20, 8 * PAGE_BYTES, &b(&far)),
            (vec![100..200], Some(9 * PAGE_BYTES))
        );
        // A write-back whose last byte is sent needs none either.
        let tail = vec![b'd'; 10];
        assert_eq!(
            shadows.write_back(20, 2 * PAGE_BYTES, &b(&tail)),
            (vec![0..10], None)
        );
    }

    #[test]
    fn write_backs_out_of_order_still_leave_the_kernels_zeros_unsent() {
        // An empty file; this host writes a record in page 0 and one in page 2, the
        // rest is the kernel's filling (other hosts' records go there). The session
        // threads hand the later page over first.
        let shadows = Shadows::new(true);
        shadows.begin(30, 0);
        let mut later = vec![0u8; PAGE];
        later[100..200].fill(b'l');
        assert_eq!(
            shadows.write_back(30, 2 * PAGE_BYTES, &b(&later)),
            (vec![100..200], Some(3 * PAGE_BYTES))
        );
        // Page 0, begun past the end this host knew, comes second: its zeros stay unsent
        // (with a high-water mark it went whole, zeros over the other hosts' records).
        let mut earlier = vec![0u8; PAGE];
        earlier[..100].fill(b'e');
        assert_eq!(
            shadows.write_back(30, 0, &b(&earlier)),
            (vec![0..100], None)
        );
        // Page 1 too, though both neighbours are known now.
        let mut middle = vec![0u8; PAGE];
        middle[4000..].fill(b'm');
        assert_eq!(shadows.spans(30, PAGE_BYTES, &b(&middle)), vec![4000..PAGE]);
        // What this host wrote directly is known: a page of it written whole later goes
        // whole, zeros too.
        shadows.written_directly(30, 5 * PAGE_BYTES, PAGE_BYTES);
        let mut rewritten = vec![0u8; PAGE];
        rewritten[..10].fill(b'r');
        assert_eq!(
            shadows.spans(30, 5 * PAGE_BYTES, &b(&rewritten)),
            vec![0..PAGE]
        );
        // A truncation resets it: below the cut is known, past it nothing is.
        shadows.truncated(30, 4 * PAGE_BYTES);
        assert_eq!(
            shadows.spans(30, 5 * PAGE_BYTES, &b(&rewritten)),
            vec![0..10]
        );
        assert_eq!(
            shadows.spans(30, 3 * PAGE_BYTES, &b(&rewritten)),
            vec![0..PAGE]
        );
    }

    #[test]
    fn known_ranges_join_and_are_bounded() {
        let mut known = Known::new(100);
        known.add(50, 120);
        assert_eq!(
            known.ranges.into_iter().collect::<Vec<_>>(),
            vec![(100, 120)]
        );
        let mut known = Known::new(0);
        known.add(10, 20);
        known.add(30, 40);
        known.add(60, 70);
        assert!(!known.covers_any(20, 30) && !known.covers_any(40, 60));
        assert!(known.covers_any(19, 21) && known.covers_any(0, 11) && known.covers_any(65, 66));
        // Touching ranges join; one that spans several takes them in.
        known.add(20, 30);
        known.add(35, 65);
        assert_eq!(
            known
                .ranges
                .iter()
                .map(|(&a, &b)| (a, b))
                .collect::<Vec<_>>(),
            vec![(10, 70)]
        );
        assert!(!known.covers_any(0, 10) && !known.covers_any(70, 80));
        // Past the bound they are taken as one from the start of the file.
        let mut known = Known::new(0);
        for range in 0..=KNOWN_RANGES_MAX as u64 {
            known.add(range * 10, range * 10 + 5);
        }
        assert!(known.ranges.is_empty());
        assert!(known.covers_any(6, 7));
        assert!(!known.covers_any(KNOWN_RANGES_MAX as u64 * 10 + 5, u64::MAX));
    }

    #[test]
    fn a_failure_a_late_read_or_a_part_of_a_page_leaves_no_copy() {
        let shadows = Shadows::new(true);
        shadows.begin(11, 2 * PAGE_BYTES);
        let old = vec![b'o'; 2 * PAGE];
        shadows.read(11, shadows.reading(11), 0, 2 * PAGE_BYTES, &old);
        assert_eq!(shadows.pages(), 2);
        // A failed write-back: the copies may claim what never landed.
        shadows.failed(11);
        assert_eq!(shadows.pages(), 0);
        assert_eq!(shadows.spans(11, 0, &b(&old[..PAGE])), vec![0..PAGE]);
        // A read that began before a truncation answers with what the cut removed.
        let start = shadows.reading(11);
        shadows.truncated(11, 0);
        shadows.read(11, start, PAGE_BYTES, PAGE_BYTES, &old[..PAGE]);
        assert_eq!(shadows.pages(), 0, "the late read is not copied");
        // A read of part of a page (not where the file ends) is not a page.
        let shadows = Shadows::new(true);
        shadows.begin(12, 2 * PAGE_BYTES);
        shadows.read(12, shadows.reading(12), 0, 512, &old[..512]);
        assert_eq!(shadows.pages(), 0);
        // Where the file ends, the rest of the page is the kernel's zeros.
        shadows.read(12, shadows.reading(12), 0, PAGE_BYTES, &old[..100]);
        assert_eq!(shadows.pages(), 1);
        // A file not followed is not copied.
        shadows.read(13, shadows.reading(13), 0, PAGE_BYTES, &old[..PAGE]);
        assert_eq!(shadows.pages(), 1);
    }

    #[test]
    fn a_file_cut_and_written_again_and_again_keeps_the_order_bounded() {
        let shadows = Shadows::new(true);
        shadows.begin(14, 0);
        let page = vec![b'p'; PAGE];
        for _ in 0..5 * SHADOW_ORDER_MIN {
            shadows.spans(14, 0, &b(&page));
            shadows.truncated(14, 0);
        }
        let table = shadows.table().unwrap();
        assert!(
            table.order.len() <= 2 * SHADOW_ORDER_MIN + 1,
            "{} entries",
            table.order.len()
        );
        assert_eq!(table.pages, 0);
    }

    #[test]
    fn copies_are_views_of_what_is_sent_and_the_bound_counts_whole_buffers() {
        let shadows = Shadows::new(true);
        shadows.begin(15, 0);
        const MIB: usize = 1 << 20;
        let first = b(&vec![b'a'; MIB]);
        assert_eq!(shadows.spans(15, 0, &first), vec![0..MIB]);
        {
            let table = shadows.table().unwrap();
            let page = &table.files[&15].pages[&3].bytes;
            assert_eq!(
                page.as_ptr(),
                first[3 * PAGE..].as_ptr(),
                "a view of the buffer, not a copy"
            );
            assert_eq!(table.held_bytes, MIB);
        }
        // Each round writes back a MiB and then all of it but its first page again: the
        // first buffer stays whole for one page, so each round holds about 2 MiB for 257
        // pages. Counting pages alone would let 64 rounds (128 MiB) stay.
        for round in 1..100u64 {
            let at = round * MIB as u64;
            let data = b(&vec![round as u8; MIB]);
            shadows.spans(15, at, &data);
            let rest = b(&vec![round as u8 ^ 0xff; MIB - PAGE]);
            shadows.spans(15, at + PAGE_BYTES, &rest);
            let table = shadows.table().unwrap();
            assert!(
                table.held_bytes <= SHADOW_BYTES_MAX,
                "round {round}: {} bytes held",
                table.held_bytes
            );
            let viewed: usize = table.buffers.values().map(|held| held.length).sum();
            assert_eq!(viewed, table.held_bytes, "round {round}");
        }
        // The newest copies compare, the oldest went: sent whole.
        let mut page = vec![99u8 ^ 0xff; PAGE];
        page[7] = 0;
        let last = 99 * MIB as u64 + PAGE_BYTES;
        assert_eq!(shadows.spans(15, last, &b(&page)), vec![7..8]);
        assert_eq!(shadows.spans(15, PAGE_BYTES, &b(&page)), vec![0..PAGE]);
        // Everything goes at the last close, buffers too.
        shadows.end(15);
        let table = shadows.table().unwrap();
        assert_eq!((table.pages, table.held_bytes), (0, 0));
        assert!(table.buffers.is_empty());
    }

    /// Byte by byte: what `changed_runs` must find.
    fn runs_by_bytes(bytes: &[u8], old: &[u8]) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for i in (0..bytes.len()).filter(|&i| bytes[i] != old[i]) {
            match runs.last_mut() {
                Some(previous) if i - previous.end < CHANGED_GAP_MIN => previous.end = i + 1,
                _ => runs.push(i..i + 1),
            }
        }
        if runs.len() > PAGE_SPANS_MAX {
            runs = vec![runs[0].start..runs[runs.len() - 1].end];
        }
        runs
    }

    #[test]
    fn word_by_word_finds_the_runs_byte_by_byte_does() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..5_000 {
            let length = (next() % PAGE_BYTES) as usize + 1;
            let old: Vec<u8> = (0..length).map(|_| next() as u8 % 4).collect();
            let mut new = old.clone();
            for _ in 0..next() % 12 {
                let at = (next() as usize) % length;
                let run = ((next() % 40) as usize).min(length - at);
                for byte in &mut new[at..at + run] {
                    *byte = next() as u8 % 4;
                }
            }
            assert_eq!(
                changed_runs(&new, &old),
                runs_by_bytes(&new, &old),
                "{length}"
            );
        }
    }

    #[test]
    fn changed_bytes_close_together_go_as_one_span() {
        let old = vec![b'o'; 1000];
        let mut new = old.clone();
        new[10] = b'n';
        new[20] = b'n';
        new[500..600].fill(b'n');
        assert_eq!(changed_runs(&new, &old), vec![10..21, 500..600]);
        assert_eq!(changed_runs(&old, &old), vec![]);
        // Changed in many places: one span from the first to the last.
        let mut scattered = old.clone();
        for i in 0..20 {
            scattered[i * 40] = b'n';
        }
        assert_eq!(changed_runs(&scattered, &old), vec![0..761]);
    }

    #[test]
    fn truncations_direct_writes_and_the_bound_reset_what_is_known() {
        let shadows = Shadows::new(true);
        shadows.begin(5, 4 * PAGE_BYTES);
        shadows.read(
            5,
            shadows.reading(5),
            0,
            4 * PAGE_BYTES,
            &vec![b'o'; 4 * PAGE],
        );
        assert_eq!(shadows.pages(), 4);
        // A direct write over page 1: its shadow goes (the cluster holds other bytes).
        shadows.written_directly(5, PAGE_BYTES + 5, 10);
        assert_eq!(shadows.pages(), 3);
        assert_eq!(
            shadows.spans(5, PAGE_BYTES, &b(&vec![b'o'; PAGE])),
            vec![0..PAGE]
        );
        // Cut to 100 bytes: pages past it go, the rest of page 0 is zeros.
        shadows.truncated(5, 100);
        assert_eq!(shadows.pages(), 1);
        let mut page = vec![b'o'; 100];
        page.resize(200, b'x');
        assert_eq!(shadows.spans(5, 0, &b(&page)), vec![100..200]);
        // Not followed: sent whole.
        assert_eq!(shadows.spans(6, 0, &b(&page)), vec![0..200]);
        shadows.end(5);
        assert_eq!(shadows.pages(), 0);
        // Past the bound the oldest copies go: their pages go whole if written back.
        let shadows = Shadows::new(true);
        shadows.begin(9, u64::MAX / 2);
        let data = vec![b'o'; PAGE];
        for index in 0..=PAGES_MAX as u64 {
            shadows.read(
                9,
                shadows.reading(9),
                index * PAGE_BYTES,
                PAGE_BYTES,
                &b(&data),
            );
        }
        assert_eq!(shadows.pages(), PAGES_MAX);
        let mut changed = data.clone();
        changed[0] = b'n';
        assert_eq!(
            shadows.spans(9, 0, &b(&changed)),
            vec![0..PAGE],
            "the oldest"
        );
        let last = PAGES_MAX as u64 * PAGE_BYTES;
        assert_eq!(
            shadows.spans(9, last, &b(&changed)),
            vec![0..1],
            "the newest"
        );
        assert_eq!(shadows.pages(), PAGES_MAX);
    }
}
