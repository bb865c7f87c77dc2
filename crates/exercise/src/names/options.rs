//! What a run of the namespace exerciser is asked to do: its seed, its size, its names
//! and whether workers run under the model's lock.

/// What to run.
#[derive(Clone, Debug)]
pub struct NamesOptions {
    pub seed: u64,
    /// Operations of all workers together.
    pub operations: u64,
    /// Operations of all workers together between two walks.
    pub batch_operations: u64,
    /// Workers run without the model's lock (see the module doc).
    pub concurrent: bool,
    /// Directory names `d0`.. (also used for other kinds, less often).
    pub directory_names: u32,
    /// Other names `f0`..
    pub file_names: u32,
    /// Deepest directory `mkdir` makes (1: only in the root).
    pub depth_max: usize,
    /// Targets of one cluster show the same inode numbers (false where the targets are
    /// different file systems that only hold the same tree).
    pub same_inode_numbers: bool,
    /// Remove the whole tree at the end (children first, `rm -rf` on the first target) and
    /// check every target then lists the root empty.
    pub remove_at_end: bool,
    /// Operations of each worker kept for a failure's report.
    pub history_per_worker: usize,
    /// Print every operation and its result to standard error.
    pub trace: bool,
}

impl Default for NamesOptions {
    fn default() -> NamesOptions {
        NamesOptions {
            seed: 1,
            operations: 10_000,
            batch_operations: 1_000,
            concurrent: false,
            directory_names: 8,
            file_names: 16,
            depth_max: 3,
            same_inode_numbers: true,
            remove_at_end: true,
            history_per_worker: 20,
            trace: false,
        }
    }
}
