//! What the scenarios need from the machine: dropping the page cache (so a read phase reads
//! the file system, not memory), host facts for the report, the file system type under a
//! target, page-aligned buffers for O_DIRECT, a deterministic random generator, and fresh
//! names (ext4 here creates files ~20x slower for a minute after mass deletes nearby, so
//! no scenario ever reuses a directory name).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Alignment of O_DIRECT buffers and offsets (512 suffices on this disk; 4096 everywhere).
pub const DIRECT_ALIGN_BYTES: usize = 4096;

/// True when the effective user is root (needed to drop caches and make namespaces).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `sync`, then drop the page cache, dentries and inodes. Err says why it could not be.
pub fn drop_caches() -> Result<(), String> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    if !is_root() {
        return Err("not running as root, so the page cache was not dropped".into());
    }
    std::fs::write("/proc/sys/vm/drop_caches", b"3")
        .map_err(|error| format!("writing /proc/sys/vm/drop_caches failed: {error}"))
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

pub fn cpu_count() -> u64 {
    std::thread::available_parallelism()
        .map(|count| count.get() as u64)
        .unwrap_or(1)
}

/// Total memory from /proc/meminfo, 0 if unreadable.
pub fn memory_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    proc_kib_field(&text, "MemTotal:").map_or(0, |kib| kib * 1024)
}

/// A `Name:   123 kB` field of a /proc file, in KiB.
pub fn proc_kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
}

/// Peak resident memory (VmHWM) of a process, in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    proc_kib_field(&text, "VmHWM:")
}

/// Reset a process's peak resident memory to its current one (`clear_refs` 5), so the
/// next VmHWM reading is the peak of what follows. False if the kernel refused.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), b"5").is_ok()
}

/// The file system type under `path` by statfs magic, e.g. `ext4`, `fuse`, `tmpfs`.
pub fn fs_type(path: &Path) -> String {
    let Ok(c_path) = CString::new(path.as_os_str().as_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stats) } != 0 {
        return "unknown".into();
    }
    #[allow(clippy::unnecessary_cast)]
    match stats.f_type as i64 {
        0xEF53 => "ext4".into(),
        0x6573_5546 => "fuse".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794C_7630 => "overlayfs".into(),
        other => format!("0x{other:x}"),
    }
}

/// Deterministic pseudo-random numbers (xorshift64*): cheap enough not to show in an IOPS
/// loop, and a run can be replayed from its seed.
#[derive(Clone, Debug)]
pub struct Xorshift(u64);

impl Xorshift {
    pub fn new(seed: u64) -> Xorshift {
        Xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..bound` (`bound` > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "below(0)");
        self.next_u64() % bound
    }

    pub fn fill(&mut self, buffer: &mut [u8]) {
        for chunk in buffer.chunks_mut(8) {
            let bytes = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN_BYTES`], as O_DIRECT needs.
pub struct AlignedBuffer {
    pointer: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is uniquely owned memory, like a Vec<u8>.
unsafe impl Send for AlignedBuffer {}

impl AlignedBuffer {
    /// `length_bytes` must be above 0 (a programmer error otherwise).
    pub fn new(length_bytes: usize) -> AlignedBuffer {
        assert!(length_bytes > 0, "empty aligned buffer");
        let layout = std::alloc::Layout::from_size_align(length_bytes, DIRECT_ALIGN_BYTES)
            .expect("buffer length fits a layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(pointer) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        AlignedBuffer { pointer, layout }
    }
}

impl std::ops::Deref for AlignedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `pointer` owns `layout.size()` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.pointer.as_ptr(), self.layout) };
    }
}

static NAME_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A name no earlier call in any bench process has returned: prefix, process id, the time
/// in microseconds and a counter (never a name that was just emptied and removed).
pub fn fresh_name(prefix: &str) -> String {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.as_micros())
        .unwrap_or(0);
    let sequence = NAME_SEQUENCE.fetch_add(1, Ordering::Relaxed);
    format!(
        "ffbench-{prefix}-{}-{micros:x}-{sequence}",
        std::process::id()
    )
}

/// Bytes over seconds in MB/s (10^6 bytes per second).
pub fn megabytes_per_second(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / 1e6 / seconds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_names_never_repeat() {
        let names: std::collections::HashSet<String> = (0..1000).map(|_| fresh_name("x")).collect();
        assert_eq!(names.len(), 1000);
    }

    #[test]
    fn aligned_buffers_are_aligned_and_writable() {
        let mut buffer = AlignedBuffer::new(8192);
        assert_eq!(buffer.as_ptr() as usize % DIRECT_ALIGN_BYTES, 0);
        buffer[8191] = 7;
        assert_eq!(buffer[8191], 7);
        assert_eq!(buffer.len(), 8192);
    }

    #[test]
    fn proc_fields_parse_in_kib() {
        let text = "Name:\tx\nVmHWM:\t   1234 kB\nVmRSS:\t 99 kB\n";
        assert_eq!(proc_kib_field(text, "VmHWM:"), Some(1234));
        assert_eq!(proc_kib_field(text, "VmSwap:"), None);
        assert!(peak_rss_kib(std::process::id()).is_some_and(|kib| kib > 0));
    }
}
