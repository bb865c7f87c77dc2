//! `freeflow exercise`: a seeded random-operation file exerciser in the tradition of fsx.
//!
//! One file is changed by a random mix of reads, writes, mapped reads and writes, size
//! changes up and down (by descriptor and by path), `fallocate` in every mode the target
//! keeps, `copy_file_range` within the file, `fsync`, and closes followed by opens (with
//! `O_TRUNC` now and then, and on another mount of the same cluster in two-mount mode). An
//! in-memory model holds what the file must contain; every read, and the size after each
//! size-changing operation and each open, is checked against it byte for byte.
//!
//! A run is a pure function of its seed ([`random::SplitMix64`]). On a mismatch the
//! [`Failure`] names the seed, the operation number, the first differing offset with the
//! bytes expected and found, and the last operations that touched the bad range, so the
//! case can be replayed and cut down. Written bytes are never zero and differ by operation,
//! so a byte found where zeros belong tells that stale data came back.
//!
//! Targets: [`posix::PosixTarget`] (any path: a Freeflow mount, a local file system for
//! comparison, two mounts alternating) and [`library::LibraryTarget`] (the client library
//! directly, without the kernel).

pub mod library;
pub mod names;
pub mod posix;
pub mod random;

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use random::SplitMix64;

/// `fallocate(2)` modes as the exerciser uses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocateMode {
    Allocate,
    AllocateKeepSize,
    PunchHole,
    ZeroRange,
    ZeroRangeKeepSize,
}

/// What a target can do. Every method acts on the one open file; errors are I/O errors
/// with the errno of the failure.
pub trait Target {
    /// Where the file is (for messages).
    fn describe(&self) -> String;
    /// Read `length` bytes at `offset`; fewer only at the end of the file.
    fn read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>>;
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Whether mapped reads and writes are possible (a mount: yes; the library: no).
    fn supports_mmap(&self) -> bool;
    /// Read through a shared mapping; `offset + length` is within the file.
    fn map_read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>>;
    /// Write through a shared mapping and `msync`; `offset + data.len()` is within the file.
    fn map_write(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Set the size through the open file (`ftruncate`), or by its path (`truncate`).
    fn set_size(&mut self, size: u64, by_path: bool) -> io::Result<()>;
    fn allocate(&mut self, offset: u64, length: u64, mode: AllocateMode) -> io::Result<()>;
    /// Copy within the file; returns the bytes copied.
    fn copy_range(
        &mut self,
        source_offset: u64,
        target_offset: u64,
        length: u64,
    ) -> io::Result<u64>;
    fn sync(&mut self) -> io::Result<()>;
    /// Close the file and open it again, truncating it with `truncate`; `choice` picks
    /// among the target's places (mounts) where it has several. Returns where it opened.
    fn reopen(&mut self, truncate: bool, choice: u64) -> io::Result<String>;
    /// The size as the target reports it (`fstat`).
    fn size(&mut self) -> io::Result<u64>;
    /// Close the file at the end of a run, reporting what the close reports (dropping a
    /// target closes it too, quietly).
    fn close(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub operations: u64,
    pub seed: u64,
    /// Largest file size the operations aim at (offsets and sizes stay below it).
    pub size_max: u64,
    /// Longest read, write or copy.
    pub length_max: u64,
    pub mmap: bool,
    pub fallocate: bool,
    pub copy_range: bool,
    /// Operations kept for the report of a failure.
    pub history_max: usize,
    /// Print every operation to standard error as it is run.
    pub trace: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            operations: 10_000,
            seed: 1,
            size_max: 1 << 20,
            length_max: 128 << 10,
            mmap: true,
            fallocate: true,
            copy_range: true,
            history_max: 100_000,
            trace: false,
        }
    }
}

/// One operation as run, for the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub number: u64,
    pub kind: StepKind,
    /// The byte range the operation read or changed (size changes: between the old and
    /// the new size; copies: the target range).
    pub start: u64,
    pub end: u64,
    /// For copies: where the bytes came from.
    pub source: Option<u64>,
    pub note: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepKind {
    Read,
    Write,
    MapRead,
    MapWrite,
    Truncate,
    Allocate,
    Copy,
    Sync,
    Reopen,
}

impl StepKind {
    pub const ALL: [StepKind; 9] = [
        StepKind::Read,
        StepKind::Write,
        StepKind::MapRead,
        StepKind::MapWrite,
        StepKind::Truncate,
        StepKind::Allocate,
        StepKind::Copy,
        StepKind::Sync,
        StepKind::Reopen,
    ];
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} {:?} [{}, {}) ({} bytes)",
            self.number,
            self.kind,
            self.start,
            self.end,
            self.end - self.start
        )?;
        if let Some(source) = self.source {
            write!(f, " from {source}")?;
        }
        if !self.note.is_empty() {
            write!(f, " {}", self.note)?;
        }
        Ok(())
    }
}

/// How a run went.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub operations: u64,
    pub counts: std::collections::BTreeMap<String, u64>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub elapsed: Duration,
    pub final_size: u64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = self.operations as f64 / self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "{} operations in {:.1} s ({rate:.0}/s), all reads matched the model; final size {} bytes",
            self.operations,
            self.elapsed.as_secs_f64(),
            self.final_size
        )?;
        let counts: Vec<String> = self
            .counts
            .iter()
            .map(|(kind, count)| format!("{kind} {count}"))
            .collect();
        write!(
            f,
            "  {}; {} bytes read, {} written",
            counts.join(", "),
            self.bytes_read,
            self.bytes_written
        )
    }
}

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("{}", mismatch_text(.seed, .operation, .target, .offset, .expected, .found, .size, .history))]
    Mismatch {
        seed: u64,
        operation: Step,
        target: String,
        /// First differing offset in the file.
        offset: u64,
        expected: Vec<u8>,
        found: Vec<u8>,
        size: u64,
        /// The last operations that touched the bad range, oldest first.
        history: Vec<Step>,
    },
    #[error("seed {seed}, operation {operation}: the size is {found} bytes, the model says {expected} (on {target})\nlast operations:\n{}", lines(.history))]
    Size {
        seed: u64,
        operation: Step,
        target: String,
        expected: u64,
        found: u64,
        history: Vec<Step>,
    },
    #[error("seed {seed}, operation {operation}: {error} (on {target})")]
    Io {
        seed: u64,
        operation: Step,
        target: String,
        error: io::Error,
    },
}

fn lines(steps: &[Step]) -> String {
    steps
        .iter()
        .map(|step| format!("  {step}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[allow(clippy::too_many_arguments)]
fn mismatch_text(
    seed: &u64,
    operation: &Step,
    target: &str,
    offset: &u64,
    expected: &[u8],
    found: &[u8],
    size: &u64,
    history: &[Step],
) -> String {
    format!(
        "seed {seed}, operation {operation}: bytes differ from offset {offset} (file size {size}, on {target})\n  expected {}\n  found    {}\nlast operations touching [{offset}, {}):\n{}",
        hex(expected),
        hex(found),
        offset + expected.len() as u64,
        lines(history)
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Bytes shown around a mismatch.
const MISMATCH_SHOWN_BYTES: usize = 16;
/// Operations listed for a failure.
const FAILURE_HISTORY_SHOWN: usize = 12;

/// The byte operation `number` writes at file offset `offset`: never zero, and different
/// for different operations at one offset, so stale and missing data are told apart.
pub fn pattern_byte(number: u64, offset: u64) -> u8 {
    (1 + (number.wrapping_mul(7919).wrapping_add(offset)) % 255) as u8
}

fn pattern(number: u64, offset: u64, length: u64) -> Vec<u8> {
    (offset..offset + length)
        .map(|at| pattern_byte(number, at))
        .collect()
}

/// The run: the model, the history and the random stream.
struct Run<'a> {
    target: &'a mut dyn Target,
    options: &'a Options,
    random: SplitMix64,
    model: Vec<u8>,
    history: VecDeque<Step>,
    report: Report,
}

impl Run<'_> {
    fn failure_history(&self, start: u64, end: u64) -> Vec<Step> {
        let mut touching: Vec<Step> = self
            .history
            .iter()
            .rev()
            .filter(|step| {
                let overlaps =
                    step.start < end.max(start + 1) && start < step.end.max(step.start + 1);
                let from = step
                    .source
                    .is_some_and(|source| source < end && start < source + (step.end - step.start));
                overlaps || from || matches!(step.kind, StepKind::Truncate | StepKind::Reopen)
            })
            .take(FAILURE_HISTORY_SHOWN)
            .cloned()
            .collect();
        touching.reverse();
        touching
    }

    fn io_failure(&self, step: &Step, error: io::Error) -> Box<Failure> {
        Box::new(Failure::Io {
            seed: self.options.seed,
            operation: step.clone(),
            target: self.target.describe(),
            error,
        })
    }

    fn check_bytes(&self, step: &Step, offset: u64, found: &[u8]) -> Result<(), Box<Failure>> {
        let start = offset as usize;
        let expected_end = (start + found.len()).min(self.model.len());
        let expected = self.model.get(start..expected_end).unwrap_or(&[]);
        let first_difference = expected
            .iter()
            .zip(found)
            .position(|(a, b)| a != b)
            .or_else(|| (expected.len() != found.len()).then_some(expected.len().min(found.len())));
        let Some(at) = first_difference else {
            return Ok(());
        };
        let shown_end = |bytes: &[u8]| (at + MISMATCH_SHOWN_BYTES).min(bytes.len());
        let bad = offset + at as u64;
        Err(Box::new(Failure::Mismatch {
            seed: self.options.seed,
            operation: step.clone(),
            target: self.target.describe(),
            offset: bad,
            expected: expected[at.min(expected.len())..shown_end(expected)].to_vec(),
            found: found[at.min(found.len())..shown_end(found)].to_vec(),
            size: self.model.len() as u64,
            history: self.failure_history(bad, bad + MISMATCH_SHOWN_BYTES as u64),
        }))
    }

    fn check_size(&mut self, step: &Step) -> Result<(), Box<Failure>> {
        let found = self
            .target
            .size()
            .map_err(|error| self.io_failure(step, error))?;
        let expected = self.model.len() as u64;
        if found != expected {
            return Err(Box::new(Failure::Size {
                seed: self.options.seed,
                operation: step.clone(),
                target: self.target.describe(),
                expected,
                found,
                history: self.failure_history(found.min(expected), found.max(expected)),
            }));
        }
        Ok(())
    }

    fn choose_kind(&mut self) -> StepKind {
        let options = self.options;
        let mmap = options.mmap && self.target.supports_mmap();
        let weights = [
            (StepKind::Read, 16),
            (StepKind::Write, 18),
            (StepKind::MapRead, if mmap { 6 } else { 0 }),
            (StepKind::MapWrite, if mmap { 6 } else { 0 }),
            (StepKind::Truncate, 8),
            (StepKind::Allocate, if options.fallocate { 8 } else { 0 }),
            (StepKind::Copy, if options.copy_range { 8 } else { 0 }),
            (StepKind::Sync, 2),
            (StepKind::Reopen, 3),
        ];
        let total: u64 = weights.iter().map(|(_, weight)| weight).sum();
        let mut pick = self.random.below(total);
        for (kind, weight) in weights {
            if pick < weight {
                return kind;
            }
            pick -= weight;
        }
        StepKind::Read
    }

    fn length(&mut self) -> u64 {
        1 + self.random.below(self.options.length_max)
    }

    /// Zero-fill the model up to `size` if it is shorter.
    fn grow_model(&mut self, size: u64) {
        if (self.model.len() as u64) < size {
            self.model.resize(size as usize, 0);
        }
    }

    fn step(&mut self, number: u64) -> Result<(), Box<Failure>> {
        let kind = self.choose_kind();
        let size = self.model.len() as u64;
        let size_max = self.options.size_max;
        let mut step = Step {
            number,
            kind,
            start: 0,
            end: 0,
            source: None,
            note: String::new(),
        };
        match kind {
            StepKind::Read | StepKind::MapRead => {
                let mapped = kind == StepKind::MapRead;
                if size == 0 || (mapped && size < 1) {
                    return self.plain_read_at_zero(step);
                }
                let offset = self.random.below(size);
                let mut length = self.length();
                if mapped {
                    length = length.min(size - offset);
                }
                step.start = offset;
                step.end = offset + length;
                let found = if mapped {
                    self.target.map_read(offset, length)
                } else {
                    self.target.read(offset, length)
                }
                .map_err(|error| self.io_failure(&step, error))?;
                self.report.bytes_read += found.len() as u64;
                self.check_bytes(&step, offset, &found)?;
                self.remember(step.clone());
                if !mapped {
                    self.check_size(&step)?;
                }
            }
            StepKind::Write | StepKind::MapWrite => {
                let length = self.length();
                let offset = self.random.below(size_max.saturating_sub(length).max(1));
                step.start = offset;
                step.end = offset + length;
                let data = pattern(number, offset, length);
                if kind == StepKind::MapWrite {
                    if offset + length > size {
                        // A mapping cannot grow the file: grow it first, as fsx does.
                        step.note = format!("(grown from {size} first)");
                        self.target
                            .set_size(offset + length, false)
                            .map_err(|error| self.io_failure(&step, error))?;
                        self.grow_model(offset + length);
                    }
                    self.target
                        .map_write(offset, &data)
                        .map_err(|error| self.io_failure(&step, error))?;
                } else {
                    self.target
                        .write(offset, &data)
                        .map_err(|error| self.io_failure(&step, error))?;
                }
                self.report.bytes_written += length;
                self.grow_model(offset + length);
                self.model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
                self.remember(step);
            }
            StepKind::Truncate => {
                let new_size = self.random.below(size_max + 1);
                let by_path = self.random.chance(1, 3);
                step.start = new_size.min(size);
                step.end = new_size.max(size);
                step.note = format!(
                    "to {new_size} from {size}{}",
                    if by_path { " by path" } else { "" }
                );
                self.target
                    .set_size(new_size, by_path)
                    .map_err(|error| self.io_failure(&step, error))?;
                self.model.resize(new_size as usize, 0);
                self.remember(step.clone());
                self.check_size(&step)?;
            }
            StepKind::Allocate => {
                let modes = [
                    AllocateMode::Allocate,
                    AllocateMode::AllocateKeepSize,
                    AllocateMode::PunchHole,
                    AllocateMode::ZeroRange,
                    AllocateMode::ZeroRangeKeepSize,
                ];
                let mode = modes[self.random.below(modes.len() as u64) as usize];
                let length = self.length();
                let offset = self.random.below(size_max.saturating_sub(length).max(1));
                let end = offset + length;
                step.start = offset;
                step.end = end;
                step.note = format!("{mode:?}");
                self.target
                    .allocate(offset, length, mode)
                    .map_err(|error| self.io_failure(&step, error))?;
                let size = self.model.len() as u64;
                match mode {
                    AllocateMode::Allocate => self.grow_model(end),
                    AllocateMode::AllocateKeepSize => {}
                    AllocateMode::PunchHole | AllocateMode::ZeroRangeKeepSize => {
                        let stop = end.min(size);
                        if offset < stop {
                            self.model[offset as usize..stop as usize].fill(0);
                        }
                    }
                    AllocateMode::ZeroRange => {
                        self.grow_model(end);
                        self.model[offset as usize..end as usize].fill(0);
                    }
                }
                self.remember(step.clone());
                self.check_size(&step)?;
            }
            StepKind::Copy => {
                if size == 0 {
                    return self.plain_read_at_zero(step);
                }
                let source = self.random.below(size);
                let length = self.length().min(size - source);
                // A target range that does not overlap the source (the kernel refuses
                // overlapping ranges within one file).
                let mut target = self.random.below(size_max.saturating_sub(length).max(1));
                if target < source + length && source < target + length {
                    target = source + length;
                }
                step.start = target;
                step.end = target + length;
                step.source = Some(source);
                let copied = self
                    .target
                    .copy_range(source, target, length)
                    .map_err(|error| self.io_failure(&step, error))?;
                if copied != length {
                    step.note = format!("copied {copied}");
                }
                let bytes = self.model[source as usize..(source + copied) as usize].to_vec();
                self.grow_model(target + copied);
                self.model[target as usize..(target + copied) as usize].copy_from_slice(&bytes);
                self.report.bytes_written += copied;
                self.remember(step.clone());
                if copied != length {
                    return Err(self.io_failure(
                        &step,
                        io::Error::other(format!(
                            "copy_file_range copied {copied} of {length} bytes inside the file"
                        )),
                    ));
                }
            }
            StepKind::Sync => {
                self.target
                    .sync()
                    .map_err(|error| self.io_failure(&step, error))?;
                self.remember(step);
            }
            StepKind::Reopen => {
                let truncate = self.random.chance(1, 8);
                let choice = self.random.next_u64();
                let place = self
                    .target
                    .reopen(truncate, choice)
                    .map_err(|error| self.io_failure(&step, error))?;
                step.note = format!("at {place}{}", if truncate { " with O_TRUNC" } else { "" });
                if truncate {
                    step.end = size;
                    self.model.clear();
                }
                self.remember(step.clone());
                self.check_size(&step)?;
            }
        }
        *self.report.counts.entry(format!("{kind:?}")).or_default() += 1;
        Ok(())
    }

    /// A read of an empty file (what a read or copy of an empty file reduces to).
    fn plain_read_at_zero(&mut self, mut step: Step) -> Result<(), Box<Failure>> {
        step.kind = StepKind::Read;
        let found = self
            .target
            .read(0, 1)
            .map_err(|error| self.io_failure(&step, error))?;
        self.check_bytes(&step, 0, &found)?;
        self.remember(step.clone());
        *self.report.counts.entry("Read".to_string()).or_default() += 1;
        self.check_size(&step)
    }

    fn remember(&mut self, step: Step) {
        if self.options.trace {
            eprintln!("{step}");
        }
        if self.history.len() >= self.options.history_max.max(1) {
            self.history.pop_front();
        }
        self.history.push_back(step);
    }
}

/// Run the exerciser on `target`, whose file it truncates to 0 first. `progress` is called
/// every `progress_every` operations with the count done.
pub fn run(
    target: &mut dyn Target,
    options: &Options,
    progress_every: u64,
    mut progress: impl FnMut(u64),
) -> Result<Report, Box<Failure>> {
    assert!(options.size_max > 0 && options.length_max > 0);
    let started = Instant::now();
    let mut run = Run {
        target,
        options,
        random: SplitMix64::new(options.seed),
        model: Vec::new(),
        history: VecDeque::new(),
        report: Report::default(),
    };
    let start = Step {
        number: 0,
        kind: StepKind::Truncate,
        start: 0,
        end: 0,
        source: None,
        note: "to 0 at the start".into(),
    };
    run.target
        .set_size(0, false)
        .map_err(|error| run.io_failure(&start, error))?;
    run.remember(start);
    for number in 1..=options.operations {
        run.step(number)?;
        run.report.operations = number;
        if progress_every > 0 && number % progress_every == 0 {
            progress(number);
        }
    }
    // A last full read of what the file holds.
    let size = run.model.len() as u64;
    let last = Step {
        number: options.operations + 1,
        kind: StepKind::Read,
        start: 0,
        end: size,
        source: None,
        note: "(the whole file, at the end)".into(),
    };
    let found = run
        .target
        .read(0, size + 1)
        .map_err(|error| run.io_failure(&last, error))?;
    run.check_bytes(&last, 0, &found)?;
    run.report.final_size = size;
    run.report.elapsed = started.elapsed();
    Ok(run.report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target over a Vec, with a fault to inject: after a shrink, bytes beyond the new
    /// size are kept and come back on a later grow (the bug the exerciser was built for).
    struct Memory {
        data: Vec<u8>,
        stale: Vec<u8>,
        keep_stale_bytes: bool,
    }

    impl Target for Memory {
        fn describe(&self) -> String {
            "memory".into()
        }
        fn read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>> {
            let start = (offset as usize).min(self.data.len());
            let end = (start + length as usize).min(self.data.len());
            Ok(self.data[start..end].to_vec())
        }
        fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
            let end = offset as usize + data.len();
            if self.data.len() < end {
                self.set_size(end as u64, false)?;
            }
            self.data[offset as usize..end].copy_from_slice(data);
            Ok(())
        }
        fn supports_mmap(&self) -> bool {
            true
        }
        fn map_read(&mut self, offset: u64, length: u64) -> io::Result<Vec<u8>> {
            self.read(offset, length)
        }
        fn map_write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
            self.write(offset, data)
        }
        fn set_size(&mut self, size: u64, _by_path: bool) -> io::Result<()> {
            let size = size as usize;
            if size < self.data.len() {
                if self.keep_stale_bytes {
                    self.stale = self.data.clone();
                }
                self.data.truncate(size);
            } else {
                let old = self.data.len();
                self.data.resize(size, 0);
                for at in old..size.min(self.stale.len()) {
                    self.data[at] = self.stale[at];
                }
            }
            Ok(())
        }
        fn allocate(&mut self, offset: u64, length: u64, mode: AllocateMode) -> io::Result<()> {
            let end = (offset + length) as usize;
            let size = self.data.len();
            match mode {
                AllocateMode::Allocate => {
                    if end > size {
                        self.set_size(end as u64, false)?
                    }
                }
                AllocateMode::AllocateKeepSize => {}
                AllocateMode::PunchHole | AllocateMode::ZeroRangeKeepSize => {
                    let stop = end.min(size);
                    if (offset as usize) < stop {
                        self.data[offset as usize..stop].fill(0);
                    }
                }
                AllocateMode::ZeroRange => {
                    if end > size {
                        self.set_size(end as u64, false)?
                    }
                    self.data[offset as usize..end].fill(0);
                }
            }
            Ok(())
        }
        fn copy_range(&mut self, source: u64, target: u64, length: u64) -> io::Result<u64> {
            let bytes = self.read(source, length)?;
            self.write(target, &bytes)?;
            Ok(bytes.len() as u64)
        }
        fn sync(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn reopen(&mut self, truncate: bool, _choice: u64) -> io::Result<String> {
            if truncate {
                self.set_size(0, false)?;
            }
            Ok("memory".into())
        }
        fn size(&mut self) -> io::Result<u64> {
            Ok(self.data.len() as u64)
        }
    }

    fn options(seed: u64) -> Options {
        Options {
            operations: 3_000,
            seed,
            size_max: 64 << 10,
            length_max: 8 << 10,
            ..Options::default()
        }
    }

    #[test]
    fn a_correct_target_passes_every_seed() {
        for seed in 0..5 {
            let mut memory = Memory {
                data: Vec::new(),
                stale: Vec::new(),
                keep_stale_bytes: false,
            };
            let report = run(&mut memory, &options(seed), 0, |_| {}).unwrap();
            assert_eq!(report.operations, 3_000);
            assert_eq!(report.final_size, memory.data.len() as u64);
            assert!(report.counts.len() >= 8, "{report}");
        }
    }

    #[test]
    fn stale_bytes_after_a_shrink_are_caught_with_the_seed_and_the_history() {
        let mut memory = Memory {
            data: Vec::new(),
            stale: Vec::new(),
            keep_stale_bytes: true,
        };
        let failure = run(&mut memory, &options(3), 0, |_| {}).unwrap_err();
        let text = failure.to_string();
        assert!(text.starts_with("seed 3, operation #"), "{text}");
        match *failure {
            Failure::Mismatch {
                found,
                expected,
                history,
                ..
            } => {
                assert_ne!(found, expected);
                assert!(!history.is_empty());
                assert!(
                    history.iter().any(|step| step.kind == StepKind::Truncate),
                    "{text}"
                );
            }
            other => panic!("expected a mismatch, got {other}"),
        }
    }

    #[test]
    fn the_pattern_is_never_zero_and_tells_operations_apart() {
        for number in 0..1000 {
            for offset in [0u64, 1, 4095, 1 << 20] {
                assert_ne!(pattern_byte(number, offset), 0);
            }
        }
        assert_ne!(pattern_byte(1, 10), pattern_byte(2, 10));
    }
}
