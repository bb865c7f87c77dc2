//! How big each scenario is. A preset (`tiny` for the smoke test, `small`, `default` which
//! finishes in minutes on this 2-core machine, `large`) fills every knob; the command line
//! may then override single knobs.

use crate::error::BenchError;

const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizePreset {
    Tiny,
    Small,
    Default,
    Large,
}

impl SizePreset {
    pub fn parse(text: &str) -> Result<SizePreset, BenchError> {
        match text {
            "tiny" => Ok(SizePreset::Tiny),
            "small" => Ok(SizePreset::Small),
            "default" => Ok(SizePreset::Default),
            "large" => Ok(SizePreset::Large),
            other => Err(BenchError::Usage(format!(
                "size {other:?}: expected tiny, small, default or large"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SizePreset::Tiny => "tiny",
            SizePreset::Small => "small",
            SizePreset::Default => "default",
            SizePreset::Large => "large",
        }
    }
}

/// Every knob of every scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// `seq`: bytes of the file written then read at each block size.
    pub seq_file_bytes: u64,
    pub seq_block_bytes: Vec<u64>,
    /// `chunk`: bytes of the one large file, written in `chunk_write_bytes` calls.
    pub chunk_file_bytes: u64,
    pub chunk_write_bytes: u64,
    /// `concurrent-writers`: bytes of the shared file; writers; bytes per pwrite.
    pub concurrent_file_bytes: u64,
    pub concurrent_writers: u32,
    pub concurrent_block_bytes: u64,
    /// `random`: bytes of the file read and written at random 4 KiB offsets; time per phase.
    pub random_file_bytes: u64,
    pub random_duration_ms: u64,
    pub random_threads: Vec<u32>,
    /// `metadata`: files per phase (in total over the workers); worker counts; files per
    /// directory in the spread layout.
    pub metadata_files: u64,
    pub metadata_workers: Vec<u32>,
    pub metadata_files_per_dir: u64,
    /// `startup`: file counts of the metadata servers restarted.
    pub startup_files: Vec<u64>,
    /// `incast`: clients writing to the one I/O server at once, bytes each.
    pub incast_clients: u32,
    pub incast_client_bytes: u64,
    /// `incast`: the I/O server's memory budget, `memory_budget_bytes` (None: its default, 768 MiB).
    pub incast_budget_bytes: Option<u64>,
    /// `striping`: I/O server counts compared, bytes of the file, per-link rate.
    pub striping_servers: Vec<u32>,
    pub striping_file_bytes: u64,
    pub striping_rate_mbit: u32,
}

impl Sizes {
    pub fn preset(preset: SizePreset) -> Sizes {
        let block_sizes = vec![4 << 10, 64 << 10, MIB, 4 * MIB];
        match preset {
            SizePreset::Tiny => Sizes {
                seq_file_bytes: 4 * MIB,
                seq_block_bytes: block_sizes,
                chunk_file_bytes: 4 * MIB,
                chunk_write_bytes: MIB,
                concurrent_file_bytes: 4 * MIB,
                concurrent_writers: 4,
                concurrent_block_bytes: 256 << 10,
                random_file_bytes: 4 * MIB,
                random_duration_ms: 150,
                random_threads: vec![1, 8],
                metadata_files: 200,
                metadata_workers: vec![1, 4],
                metadata_files_per_dir: 25,
                startup_files: vec![100, 1000],
                incast_clients: 4,
                incast_client_bytes: 2 * MIB,
                incast_budget_bytes: None,
                striping_servers: vec![1, 2],
                striping_file_bytes: 4 * MIB,
                striping_rate_mbit: 200,
            },
            SizePreset::Small => Sizes {
                seq_file_bytes: 32 * MIB,
                seq_block_bytes: block_sizes,
                chunk_file_bytes: 64 * MIB,
                chunk_write_bytes: MIB,
                concurrent_file_bytes: 64 * MIB,
                concurrent_writers: 4,
                concurrent_block_bytes: MIB,
                random_file_bytes: 64 * MIB,
                random_duration_ms: 1000,
                random_threads: vec![1, 8],
                metadata_files: 2000,
                metadata_workers: vec![1, 4],
                metadata_files_per_dir: 100,
                startup_files: vec![1000, 10_000],
                incast_clients: 8,
                incast_client_bytes: 16 * MIB,
                incast_budget_bytes: None,
                striping_servers: vec![1, 2, 4],
                striping_file_bytes: 32 * MIB,
                striping_rate_mbit: 200,
            },
            SizePreset::Default => Sizes {
                seq_file_bytes: 256 * MIB,
                seq_block_bytes: block_sizes,
                chunk_file_bytes: 512 * MIB,
                chunk_write_bytes: MIB,
                concurrent_file_bytes: 256 * MIB,
                concurrent_writers: 4,
                concurrent_block_bytes: MIB,
                random_file_bytes: 256 * MIB,
                random_duration_ms: 3000,
                random_threads: vec![1, 8],
                metadata_files: 10_000,
                metadata_workers: vec![1, 4],
                metadata_files_per_dir: 100,
                startup_files: vec![1000, 100_000],
                incast_clients: 8,
                incast_client_bytes: 64 * MIB,
                incast_budget_bytes: None,
                striping_servers: vec![1, 2, 4],
                striping_file_bytes: 128 * MIB,
                striping_rate_mbit: 200,
            },
            SizePreset::Large => Sizes {
                seq_file_bytes: 1024 * MIB,
                seq_block_bytes: block_sizes,
                chunk_file_bytes: 2048 * MIB,
                chunk_write_bytes: MIB,
                concurrent_file_bytes: 1024 * MIB,
                concurrent_writers: 4,
                concurrent_block_bytes: MIB,
                random_file_bytes: 1024 * MIB,
                random_duration_ms: 5000,
                random_threads: vec![1, 8],
                metadata_files: 50_000,
                metadata_workers: vec![1, 4],
                metadata_files_per_dir: 100,
                startup_files: vec![1000, 100_000, 1_000_000],
                incast_clients: 16,
                incast_client_bytes: 128 * MIB,
                incast_budget_bytes: None,
                striping_servers: vec![1, 2, 4],
                striping_file_bytes: 512 * MIB,
                striping_rate_mbit: 200,
            },
        }
    }

    /// Check the knobs make sense together (after command-line overrides).
    pub fn validate(&self) -> Result<(), BenchError> {
        let fail = |message: &str| Err(BenchError::Usage(message.to_string()));
        if self.seq_block_bytes.is_empty()
            || self
                .seq_block_bytes
                .iter()
                .any(|&block| block == 0 || !self.seq_file_bytes.is_multiple_of(block))
        {
            return fail("seq: every block size must be above 0 and divide the file size");
        }
        if self.chunk_write_bytes == 0 || self.chunk_file_bytes < self.chunk_write_bytes {
            return fail("chunk: the file must hold at least one write");
        }
        if self.concurrent_writers < 2
            || self.concurrent_block_bytes == 0
            || !self
                .concurrent_file_bytes
                .is_multiple_of(u64::from(self.concurrent_writers) * self.concurrent_block_bytes)
        {
            return fail(
                "concurrent-writers: at least 2 writers, and the file size a multiple of \
                 writers x block size",
            );
        }
        if self.random_file_bytes < 4096 * 16 || self.random_duration_ms == 0 {
            return fail("random: the file must be at least 64 KiB and the duration above 0");
        }
        if self.random_threads.is_empty() || self.random_threads.contains(&0) {
            return fail("random: thread counts must be above 0");
        }
        if self.metadata_files == 0
            || self.metadata_files_per_dir == 0
            || self.metadata_workers.is_empty()
            || self.metadata_workers.contains(&0)
        {
            return fail("metadata: files, files per directory and worker counts must be above 0");
        }
        if self.startup_files.is_empty() {
            return fail("startup: at least one file count");
        }
        if self.incast_clients == 0 || self.incast_client_bytes == 0 {
            return fail("incast: clients and bytes must be above 0");
        }
        if self.striping_servers.is_empty()
            || self.striping_servers.iter().any(|&n| n == 0 || n > 16)
            || self.striping_file_bytes == 0
            || self.striping_rate_mbit == 0
        {
            return fail("striping: server counts 1 to 16, bytes and rate above 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid() {
        for preset in [
            SizePreset::Tiny,
            SizePreset::Small,
            SizePreset::Default,
            SizePreset::Large,
        ] {
            assert!(
                Sizes::preset(preset).validate().is_ok(),
                "{}",
                preset.as_str()
            );
            assert_eq!(SizePreset::parse(preset.as_str()).ok(), Some(preset));
        }
    }

    #[test]
    fn a_block_size_that_does_not_divide_the_file_is_refused() {
        let mut sizes = Sizes::preset(SizePreset::Tiny);
        sizes.seq_block_bytes = vec![3000];
        assert!(sizes.validate().is_err());
    }
}
