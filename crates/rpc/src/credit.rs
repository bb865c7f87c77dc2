//! Credits: how many payload bytes a connection may have in flight, decided by the server
//! while the connection runs (seed 004's write tokens).
//!
//! [`Window`] is one connection's allowance on either side: the client takes from it before
//! it sends a request's payload, the server before it reads one. Its size changes while
//! credit is out; what a shrink cannot take at once (it is in flight) is owed and taken as
//! it comes back. [`CreditBook`] is the server's account of every connection's window: each
//! [`REBALANCE_INTERVAL`] it shares the server's payload budget among the connections that
//! sent payload (or asked for credit) lately, halves the shares while the budget is mostly
//! in use (the disk or the network out is behind), and, when the budget cannot cover a
//! share for every connection, takes credit back from the connections that have held
//! theirs longest, so those that waited are served next. A change reaches the client in the
//! `credit` word of the connection's next reply, or in an unasked ping reply when none is
//! due (docs/protocol.md, "Credits").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};

use crate::metrics::ServerMetrics;

/// How often the server shares its budget out again.
pub const REBALANCE_INTERVAL: Duration = Duration::from_millis(25);

/// A connection that sent no payload and asked for no credit for this long is idle: it
/// keeps only the smallest window, if the budget has room for it.
pub const ACTIVE_FOR: Duration = Duration::from_millis(1_000);

/// An active connection that sent nothing for this long, with nothing in flight, starts
/// again from the smallest window (slow start after idle, as TCP restarts its window): a
/// burst of writers that paused begins again on equal terms, not with the windows they had
/// when they paused.
pub const RESTART_AFTER: Duration = Duration::from_millis(100);

/// The smallest window an active connection gets while the budget allows: one stripe unit
/// of the default layout, so a writer always has one whole request in flight.
pub const WINDOW_MIN_BYTES: u32 = 1 << 20;

/// How much an active connection's window may grow from one share-out to the next.
pub const GROWTH: u32 = 8;

/// While a call waits with no credit at all, how often it tells the server it wants some.
const WANT_INTERVAL: Duration = Duration::from_millis(100);

/// Payload bytes one connection may have in flight, resizable while credit is out.
#[derive(Debug)]
pub struct Window {
    permits: Semaphore,
    state: Mutex<WindowState>,
    changed: Notify,
}

#[derive(Debug)]
struct WindowState {
    size: u32,
    /// Credit a shrink could not take because it was out; taken as it comes back.
    owed: u64,
}

impl Window {
    pub fn new(size: u32) -> Window {
        Window {
            permits: Semaphore::new(size as usize),
            state: Mutex::new(WindowState { size, owed: 0 }),
            changed: Notify::new(),
        }
    }

    pub fn size(&self) -> u32 {
        self.state.lock().expect("window not poisoned").size
    }

    /// Credit not in flight now (what is free, less what is owed).
    pub fn available(&self) -> u64 {
        let owed = self.state.lock().expect("window not poisoned").owed;
        (self.permits.available_permits() as u64).saturating_sub(owed)
    }

    /// Make the window `size` bytes. Growth first cancels what is owed; a shrink takes the
    /// credit that is not out now and owes the rest.
    pub fn resize(&self, size: u32) {
        {
            let mut state = self.state.lock().expect("window not poisoned");
            if size == state.size {
                return;
            }
            if size > state.size {
                let grow = u64::from(size - state.size);
                let cancelled = grow.min(state.owed);
                state.owed -= cancelled;
                self.permits.add_permits((grow - cancelled) as usize);
            } else {
                let shrink = (state.size - size) as usize;
                let taken = self.permits.forget_permits(shrink);
                state.owed += (shrink - taken) as u64;
            }
            state.size = size;
        }
        self.changed.notify_waiters();
    }

    /// Credit for `bytes` (or the whole window when they are more) if it is free now.
    pub fn try_acquire(self: &Arc<Self>, bytes: u32) -> Option<Credit> {
        if bytes == 0 {
            return Some(Credit {
                window: None,
                bytes: 0,
            });
        }
        let size = self.size();
        if size == 0 {
            return None;
        }
        let need = bytes.min(size);
        let permit = self.permits.try_acquire_many(need).ok()?;
        permit.forget();
        Some(Credit {
            window: Some(self.clone()),
            bytes: need,
        })
    }

    /// Wait for credit to send (or read) `bytes` of payload: all of them, or the whole
    /// window when they are more than it. While the window is 0, `want` is called (and again
    /// every [`WANT_INTERVAL`]) so the server hears that credit is wanted.
    pub async fn acquire(self: &Arc<Self>, bytes: u32, want: impl Fn()) -> Credit {
        if bytes == 0 {
            return Credit {
                window: None,
                bytes: 0,
            };
        }
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let size = self.size();
            if size == 0 {
                want();
                let _ = tokio::time::timeout(WANT_INTERVAL, changed).await;
                continue;
            }
            let need = bytes.min(size);
            tokio::select! {
                permit = self.permits.acquire_many(need) => {
                    permit.expect("window semaphore never closed").forget();
                    return Credit { window: Some(self.clone()), bytes: need };
                }
                () = &mut changed => {}
            }
        }
    }

    fn give_back(&self, bytes: u32) {
        let mut state = self.state.lock().expect("window not poisoned");
        let paid = u64::from(bytes).min(state.owed);
        state.owed -= paid;
        self.permits.add_permits((u64::from(bytes) - paid) as usize);
    }
}

/// Credit taken from a [`Window`], given back when dropped.
#[derive(Debug)]
pub struct Credit {
    window: Option<Arc<Window>>,
    bytes: u32,
}

impl Credit {
    pub fn bytes(&self) -> u32 {
        self.bytes
    }
}

impl Drop for Credit {
    fn drop(&mut self) {
        if let Some(window) = self.window.take() {
            window.give_back(self.bytes);
        }
    }
}

/// Milliseconds since the book began: connections note their last want in an atomic.
fn millis_since(start: tokio::time::Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

/// One connection as the book sees it.
struct Holder {
    window: Arc<Window>,
    wanted: Arc<AtomicU64>,
    /// Whether it holds a window, and since when: holders that have held theirs longest
    /// give it up first; connections that have waited longest are served first.
    holds: bool,
    since: tokio::time::Instant,
    /// Tells the connection its window changed (it sends an unasked ping reply).
    tell: Arc<Notify>,
}

/// The server's account of its connections' windows.
pub struct CreditBook {
    budget_bytes: u64,
    window_max: u32,
    window_min: u32,
    budget: Arc<Semaphore>,
    start: tokio::time::Instant,
    next_id: AtomicU64,
    holders: Mutex<HashMap<u64, Holder>>,
    /// Under pressure: shares are halved (see `rebalance`).
    pressed: AtomicBool,
    metrics: Option<ServerMetrics>,
}

/// A connection's entry in the book: its window, how it says it wants credit, and how it
/// hears that its window changed. Leaves the book when dropped.
pub struct Account {
    book: Arc<CreditBook>,
    id: u64,
    pub window: Arc<Window>,
    wanted: Arc<AtomicU64>,
    pub changed: Arc<Notify>,
}

impl Account {
    /// This connection sent payload or waits for credit: it counts as active. A connection
    /// that was idle has the budget shared out again at once, so it does not wait for the
    /// next share-out with only the smallest window.
    pub fn want(&self) {
        let now = millis_since(self.book.start).max(1);
        let before = self.wanted.swap(now, Ordering::Relaxed);
        if before == 0 || now.saturating_sub(before) > RESTART_AFTER.as_millis() as u64 {
            self.book.share_out(Some(self.id));
        }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        self.book
            .holders
            .lock()
            .expect("credit book not poisoned")
            .remove(&self.id);
    }
}

impl CreditBook {
    /// `budget` is the server-wide payload budget (the semaphore the connections take from
    /// too, so the book can see how much of it is in use); windows lie between
    /// [`WINDOW_MIN_BYTES`] (or `window_max` or the budget, if smaller) and `window_max`.
    pub fn new(
        budget: Arc<Semaphore>,
        budget_bytes: u64,
        window_max: u32,
        metrics: Option<ServerMetrics>,
    ) -> Arc<CreditBook> {
        Arc::new(CreditBook {
            budget_bytes,
            window_max,
            window_min: WINDOW_MIN_BYTES
                .min(window_max)
                .min(budget_bytes.min(u64::from(u32::MAX)) as u32)
                .max(1),
            budget,
            start: tokio::time::Instant::now(),
            next_id: AtomicU64::new(1),
            holders: Mutex::new(HashMap::new()),
            pressed: AtomicBool::new(false),
            metrics,
        })
    }

    /// A new (authenticated) connection, idle until it sends, with the smallest window if
    /// the budget has that much not held by others, else none. `announced` is the window
    /// its hello gave: if this differs, the connection is told at once.
    pub fn open(self: &Arc<Self>, announced: u32) -> Account {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let wanted = Arc::new(AtomicU64::new(0));
        let tell = Arc::new(Notify::new());
        let mut holders = self.holders.lock().expect("credit book not poisoned");
        let held: u64 = holders
            .values()
            .map(|holder| u64::from(holder.window.size()))
            .sum();
        let first = if held + u64::from(self.window_min) <= self.budget_bytes {
            self.window_min
        } else {
            0
        };
        let window = Arc::new(Window::new(first));
        holders.insert(
            id,
            Holder {
                window: window.clone(),
                wanted: wanted.clone(),
                holds: first > 0,
                since: tokio::time::Instant::now(),
                tell: tell.clone(),
            },
        );
        drop(holders);
        if first != announced {
            tell.notify_one();
        }
        Account {
            book: self.clone(),
            id,
            window,
            wanted,
            changed: tell,
        }
    }

    /// The window a connection's hello announces (what [`CreditBook::open`] gives when
    /// the budget has room).
    pub fn window_min(&self) -> u32 {
        self.window_min
    }

    fn is_active(&self, holder: &Holder, now_ms: u64) -> bool {
        let wanted = holder.wanted.load(Ordering::Relaxed);
        wanted != 0 && now_ms.saturating_sub(wanted) <= ACTIVE_FOR.as_millis() as u64
    }

    /// Each of `active` connections' window: the budget shared evenly, halved while the
    /// server is under pressure.
    fn share(&self, active: u64) -> u32 {
        let pool = if self.pressed.load(Ordering::Relaxed) {
            self.budget_bytes / 2
        } else {
            self.budget_bytes
        };
        (pool / active.max(1)).clamp(u64::from(self.window_min), u64::from(self.window_max)) as u32
    }

    /// Share the budget out again (every [`REBALANCE_INTERVAL`], see [`CreditBook::run`]).
    pub fn rebalance(&self) {
        self.share_out(None);
    }

    /// Share out; `woke` is the connection that just turned active, when that is why: only
    /// its window grows then (the others' grow on the schedule).
    fn share_out(&self, woke: Option<u64>) {
        let now_ms = millis_since(self.start);
        let mut holders = self.holders.lock().expect("credit book not poisoned");
        // Pressure: most of the budget is held by payloads not yet written (the disk or
        // the replies are behind). Shares are halved from three quarters in use until the
        // use falls under a half.
        let in_use = self
            .budget_bytes
            .saturating_sub(self.budget.available_permits() as u64);
        if in_use * 4 > self.budget_bytes * 3 {
            self.pressed.store(true, Ordering::Relaxed);
        } else if in_use * 2 < self.budget_bytes {
            self.pressed.store(false, Ordering::Relaxed);
        }
        // Who is served first: active before idle; among them those holding nothing, the
        // longest waiting first, then the holders, the newest first. The oldest holders
        // are last: when the budget runs out, theirs is the credit taken back (and they are
        // then the first served once they have waited longest).
        let mut order: Vec<(bool, bool, tokio::time::Instant, u64)> = holders
            .iter()
            .map(|(&id, holder)| {
                (
                    self.is_active(holder, now_ms),
                    holder.holds,
                    holder.since,
                    id,
                )
            })
            .collect();
        let active = order.iter().filter(|(active, ..)| *active).count() as u64;
        let share = self.share(active);
        order.sort_by(|a, b| {
            b.0.cmp(&a.0).then_with(|| match (a.1, b.1) {
                (false, false) => a.2.cmp(&b.2),
                (false, true) => std::cmp::Ordering::Less,
                (true, false) => std::cmp::Ordering::Greater,
                (true, true) => b.2.cmp(&a.2),
            })
        });
        let mut left = self.budget_bytes;
        let now = tokio::time::Instant::now();
        let (mut without, mut revoked) = (0u64, 0u64);
        for (active, _, _, id) in order {
            let holder = holders.get_mut(&id).expect("listed above");
            let old = holder.window.size();
            // Paused: nothing sent lately and nothing in flight (a connection whose window
            // is all out, waiting for a slow disk, is busy, not paused).
            let paused = now_ms.saturating_sub(holder.wanted.load(Ordering::Relaxed))
                > RESTART_AFTER.as_millis() as u64
                && holder.window.available() >= u64::from(old);
            let size = if active && paused {
                // Counted in the shares, but starts again from the smallest window.
                if u64::from(self.window_min) <= left {
                    self.window_min
                } else {
                    0
                }
            } else if active {
                // An active connection's window grows at most [`GROWTH`]-fold a share-out
                // (slow start), so a connection that starts first cannot fill the server's
                // queues before the others of a burst have begun.
                let growth = if woke.is_none_or(|woke| woke == id) {
                    GROWTH
                } else {
                    1
                };
                let grown = old.max(self.window_min).saturating_mul(growth);
                let wanted = share.min(grown);
                // What is left, if less than that but at least the smallest window.
                if u64::from(wanted) <= left {
                    wanted
                } else if left >= u64::from(self.window_min) {
                    left as u32
                } else {
                    0
                }
            } else if old > 0 && u64::from(self.window_min) <= left {
                // An idle connection keeps the smallest window if the budget has room, and
                // one without a window waits for its next request: credit never passes from
                // one idle connection to another.
                self.window_min
            } else {
                0
            };
            left -= u64::from(size);
            if size != old {
                holder.window.resize(size);
                holder.tell.notify_one();
            }
            if (size > 0) != holder.holds {
                holder.holds = size > 0;
                holder.since = now;
            }
            if size == 0 {
                without += 1;
                revoked += u64::from(old > 0);
            }
        }
        if let Some(metrics) = &self.metrics {
            metrics.windows_shared(self.budget_bytes - left, without, revoked);
        }
    }

    /// Share out every [`REBALANCE_INTERVAL`], until the serving task drops it.
    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(REBALANCE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.rebalance();
        }
    }

    /// Every connection's window now.
    #[cfg(test)]
    fn windows(&self) -> Vec<u32> {
        self.holders
            .lock()
            .expect("credit book not poisoned")
            .values()
            .map(|holder| holder.window.size())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u32 = 1 << 20;

    #[tokio::test]
    async fn a_shrink_takes_what_is_free_and_owes_what_is_out() {
        let window = Arc::new(Window::new(8 * MIB));
        let out = window.acquire(6 * MIB, || {}).await;
        assert_eq!(window.available(), u64::from(2 * MIB));
        window.resize(4 * MIB);
        // 2 MiB free went at once, 2 MiB more are owed by what is out.
        assert_eq!(window.available(), 0);
        drop(out);
        assert_eq!(window.available(), u64::from(4 * MIB));
        // Growth cancels what is owed before it adds.
        let out = window.acquire(4 * MIB, || {}).await;
        window.resize(MIB);
        window.resize(2 * MIB);
        drop(out);
        assert_eq!(window.available(), u64::from(2 * MIB));
        // A payload larger than the window takes all of it.
        let whole = window.acquire(64 * MIB, || {}).await;
        assert_eq!(whole.bytes(), 2 * MIB);
        assert_eq!(window.available(), 0);
    }

    #[tokio::test]
    async fn a_call_with_no_window_asks_for_credit_and_goes_once_it_comes() {
        let window = Arc::new(Window::new(0));
        let asked = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (window, asked) = (window.clone(), asked.clone());
            tokio::spawn(async move {
                let want = || {
                    asked.fetch_add(1, Ordering::Relaxed);
                };
                window.acquire(3 * MIB, want).await.bytes()
            })
        };
        tokio::time::sleep(WANT_INTERVAL * 3).await;
        assert!(!waiter.is_finished(), "sent with no credit");
        assert!(
            asked.load(Ordering::Relaxed) >= 2,
            "asked for credit once only"
        );
        window.resize(MIB);
        assert_eq!(waiter.await.unwrap(), MIB);
    }

    fn book(budget: u64, window_max: u32) -> Arc<CreditBook> {
        let budget_semaphore = Arc::new(Semaphore::new(budget as usize));
        CreditBook::new(budget_semaphore, budget, window_max, None)
    }

    #[tokio::test]
    async fn active_connections_share_the_budget_growing_from_the_smallest_window() {
        let book = book(64 * u64::from(MIB), 64 * MIB);
        let mut accounts: Vec<Account> = (0..4).map(|_| book.open(MIB)).collect();
        assert!(accounts.iter().all(|a| a.window.size() == MIB));
        // Each turns active in turn: its own window grows GROWTH-fold at once, the others'
        // do not grow then.
        for account in &accounts {
            account.want();
        }
        assert!(accounts.iter().all(|a| a.window.size() == 8 * MIB));
        // Then on the schedule, up to the even share (16 MiB), and no further.
        for _ in 0..3 {
            book.rebalance();
            assert!(accounts.iter().all(|a| a.window.size() == 16 * MIB));
        }
        // One leaves: the others' shares grow.
        drop(accounts.remove(0));
        book.rebalance();
        let windows = book.windows();
        assert_eq!(windows.len(), 3);
        assert!(windows
            .iter()
            .all(|&w| w > 16 * MIB && w <= 64 * MIB / 3 + 1));
    }

    #[tokio::test]
    async fn when_the_budget_cannot_cover_everyone_the_oldest_holders_give_theirs_up() {
        // Room for two smallest windows, four connections wanting credit.
        let book = book(2 * u64::from(MIB), 64 * MIB);
        let accounts: Vec<Account> = (0..4).map(|_| book.open(MIB)).collect();
        for account in &accounts {
            account.want();
        }
        let mut served = [0u32; 4];
        for _ in 0..8 {
            book.rebalance();
            let sizes: Vec<u32> = accounts.iter().map(|a| a.window.size()).collect();
            assert!(sizes.iter().map(|&s| u64::from(s)).sum::<u64>() <= 2 * u64::from(MIB));
            assert_eq!(sizes.iter().filter(|&&s| s > 0).count(), 2, "{sizes:?}");
            for (count, size) in served.iter_mut().zip(&sizes) {
                *count += u32::from(*size > 0);
            }
            for account in &accounts {
                account.want();
            }
        }
        // Credit went round: every connection held it, none all the time.
        assert!(served.iter().all(|&n| n > 0 && n < 8), "{served:?}");
    }

    #[tokio::test]
    async fn every_busy_connection_is_served_however_many_wait() {
        // Seven busy connections, room for two windows: the longest waiting go first, so
        // each is served within a few rounds, not only those the map lists first.
        let book = book(2 * u64::from(MIB), 64 * MIB);
        let accounts: Vec<Account> = (0..7).map(|_| book.open(MIB)).collect();
        let mut served = [0u32; 7];
        for _ in 0..8 {
            for account in &accounts {
                account.want();
            }
            book.rebalance();
            for (count, account) in served.iter_mut().zip(&accounts) {
                *count += u32::from(account.window.size() > 0);
            }
        }
        assert!(served.iter().all(|&n| n >= 2), "{served:?}");
    }

    #[tokio::test]
    async fn idle_connections_do_not_pass_credit_among_themselves() {
        let book = book(2 * u64::from(MIB), 64 * MIB);
        let accounts: Vec<Account> = (0..4).map(|_| book.open(MIB)).collect();
        let before: Vec<u32> = accounts.iter().map(|a| a.window.size()).collect();
        assert_eq!(before, [MIB, MIB, 0, 0]);
        for _ in 0..5 {
            book.rebalance();
        }
        let after: Vec<u32> = accounts.iter().map(|a| a.window.size()).collect();
        assert_eq!(after, before);
        // One turns busy: it is served its share (the whole budget), taken from the idle.
        accounts[3].want();
        let now: Vec<u32> = accounts.iter().map(|a| a.window.size()).collect();
        assert_eq!(now, [0, 0, 0, 2 * MIB]);
    }

    #[tokio::test]
    async fn a_paused_connection_starts_again_from_the_smallest_window_but_a_busy_one_does_not() {
        let book = book(64 * u64::from(MIB), 64 * MIB);
        let account = book.open(MIB);
        account.want();
        for _ in 0..2 {
            book.rebalance();
        }
        assert_eq!(account.window.size(), 64 * MIB);
        // Nothing sent and nothing in flight for longer than RESTART_AFTER: back to 1 MiB
        // (still active: within ACTIVE_FOR).
        tokio::time::sleep(RESTART_AFTER + Duration::from_millis(50)).await;
        book.rebalance();
        assert_eq!(account.window.size(), MIB);
        // Sending again grows its own window at once.
        account.want();
        assert_eq!(account.window.size(), 8 * MIB);
        book.rebalance();
        assert_eq!(account.window.size(), 64 * MIB);
        // A window all out (waiting for the disk) is busy, not paused.
        let out = account.window.acquire(64 * MIB, || {}).await;
        tokio::time::sleep(RESTART_AFTER + Duration::from_millis(50)).await;
        book.rebalance();
        assert_eq!(account.window.size(), 64 * MIB);
        drop(out);
    }

    #[tokio::test]
    async fn shares_are_halved_while_most_of_the_budget_is_in_use() {
        let budget = 64 * u64::from(MIB);
        let semaphore = Arc::new(Semaphore::new(budget as usize));
        let book = CreditBook::new(semaphore.clone(), budget, 64 * MIB, None);
        let account = book.open(MIB);
        account.want();
        for _ in 0..4 {
            book.rebalance();
        }
        assert_eq!(account.window.size(), 64 * MIB);
        let held = semaphore.try_acquire_many(50 * MIB).unwrap();
        book.rebalance();
        assert_eq!(account.window.size(), 32 * MIB);
        drop(held);
        book.rebalance();
        assert_eq!(account.window.size(), 64 * MIB);
    }
}
