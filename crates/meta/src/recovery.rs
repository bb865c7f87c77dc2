//! The recovery window after a restart (issue 10).
//!
//! Mutations are answered before they are durable, so a crash of the metadata server can
//! lose the last ones. Their clients still hold them and replay them, in the order they
//! were applied, when they find the server restarted (a new epoch in its hello). New
//! requests wait while replays run, so a replayed change is applied to the state it was
//! first applied to. The clients waited for are those recorded in the `clients` table
//! (written durably before a client's first early reply); each says `ReplayDone`, and the
//! window ends when all have, or at `recovery_window_ms`: a client that does not come back
//! in time loses the changes it held, and nothing else is lost.
//!
//! A change that any other client saw was made durable first (commit on share,
//! `writer/`), so replays of different clients never depend on each other: each client's
//! own order is enough.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use tokio::sync::watch;

pub struct Recovery {
    state: Mutex<State>,
    /// True once the window is over.
    ended: watch::Sender<bool>,
}

struct State {
    deadline: Instant,
    /// Clients not done replaying.
    expected: HashSet<u64>,
}

impl Recovery {
    /// A window waiting for `expected` (over at once if none), at most `window` long.
    pub fn new(expected: HashSet<u64>, window: Duration) -> Recovery {
        let ended = expected.is_empty();
        Recovery {
            state: Mutex::new(State {
                deadline: Instant::now() + window,
                expected,
            }),
            ended: watch::Sender::new(ended),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn is_recovering(&self) -> bool {
        !*self.ended.borrow()
    }

    /// When the window ends at the latest.
    pub fn deadline(&self) -> Instant {
        self.state().deadline
    }

    /// Wait until the window is over (returns at once outside one).
    pub async fn wait(&self) {
        let mut receiver = self.ended.subscribe();
        // Fails only if the sender is gone, and `self` owns it.
        let _ = receiver.wait_for(|ended| *ended).await;
    }

    /// `client` has replayed all it kept; the window ends if it was the last awaited.
    pub fn client_done(&self, client: u64) {
        let mut state = self.state();
        if state.expected.remove(&client) && state.expected.is_empty() {
            drop(state);
            tracing::info!("every client has replayed: recovery is over");
            self.ended.send_replace(true);
        }
    }

    /// End the window (its deadline passed); returns the clients that did not come back.
    pub fn end(&self) -> Vec<u64> {
        let missing: Vec<u64> = self.state().expected.drain().collect();
        self.ended.send_replace(true);
        missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_window_ends_when_every_client_is_done_or_at_its_end() {
        let recovery = Recovery::new(HashSet::from([1, 2]), Duration::from_secs(60));
        assert!(recovery.is_recovering());
        recovery.client_done(1);
        recovery.client_done(7);
        assert!(recovery.is_recovering());
        recovery.client_done(2);
        assert!(!recovery.is_recovering());
        recovery.wait().await;

        let none = Recovery::new(HashSet::new(), Duration::from_secs(60));
        assert!(!none.is_recovering());

        let late = Recovery::new(HashSet::from([3, 4]), Duration::from_millis(1));
        late.client_done(3);
        assert_eq!(late.end(), vec![4]);
        assert!(!late.is_recovering());
    }
}
