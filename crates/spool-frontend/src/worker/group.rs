//! Poll groups: one thread serving one or more queues of a volume (docs/qos.md, "Scaling").
//!
//! A queue per thread polls best while every thread has a core; with more queues than cores
//! each request costs two wake-ups (the queue's thread and the client's), and the threads take
//! turns at the cores. A poll group runs several queues' poll rounds in one loop, sleeps once
//! for all of them (on an epoll of their epolls: kicks, wake-ups and device completions of any
//! member wake the thread), and takes what every member's guest published in one wake-up.
//!
//! A group belongs to one volume, so what is per thread (the scheduling class, the pause of a
//! volume ahead of its fair share, a throttled volume's wait) is the volume's anyway. A thread
//! starts when its first queue joins and ends when its last queue stopped; a group of one is
//! the thread per queue that `[io] volume_threads = 0` asks for.
//!
//! A session that publishes a memory map whose writes must be marked (a migration's dirty log
//! turned on or replaced) waits until the thread has passed the top of its loop once since:
//! a round that loaded the earlier map may still be writing into guest memory unmarked, and
//! the frontend syncs its log as soon as the message is answered ([`PollGroup::ask_pass`]).
//!
//! Owns: the group thread's loop (when to poll, when to sleep), members joining and leaving.
//! Must not know: what a poll round does to a request (`QueueWorker`), the vhost-user protocol.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_queue::Queue;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::run::{Preemptions, SHARE_PAUSE};
use super::{QueueWorker, TOKEN_GROUP};
use crate::share::ShareGroup;

/// A queue in a group, and where its queue goes back when it stopped.
struct Member {
    worker: QueueWorker,
    done: SyncSender<Queue>,
}

/// What the group's thread and the queues' handles share.
struct Shared {
    /// Queues waiting to join, and whether a thread is running.
    state: Mutex<GroupState>,
    /// Set when a queue joined or was asked to stop: the thread looks at its members.
    attention: AtomicBool,
    /// Written when a queue joins (watched by every member's epoll).
    wake: EventFd,
    name: String,
    share_group: Arc<ShareGroup>,
    /// The drain window the members share (a hung device costs the thread one drain
    /// timeout, not one per queue: `recovery::drain_deadline`).
    drain_window: Arc<Mutex<Option<Instant>>>,
    /// Passes asked for (`PollGroup::ask_pass`), and the last one the thread made: it has
    /// been at the top of its loop, between rounds, since that ask.
    passes_asked: AtomicU64,
    passes_made: AtomicU64,
}

#[derive(Default)]
struct GroupState {
    joining: Vec<Member>,
    running: bool,
}

/// One thread's worth of a volume's queues.
pub struct PollGroup {
    shared: Arc<Shared>,
}

impl PollGroup {
    /// A group whose thread will be called `name` (at most 15 characters are kept).
    pub fn new(name: &str, share_group: Arc<ShareGroup>) -> std::io::Result<PollGroup> {
        Ok(PollGroup {
            shared: Arc::new(Shared {
                state: Mutex::default(),
                attention: AtomicBool::new(false),
                wake: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?,
                name: name.chars().take(15).collect(),
                share_group,
                drain_window: Arc::default(),
                passes_asked: AtomicU64::new(0),
                passes_made: AtomicU64::new(0),
            }),
        })
    }

    /// Asks the thread to pass the top of its loop (between two rounds) once; returns the
    /// ticket [`Self::passed`] takes. Whatever was published before the ask (a memory map)
    /// is what every round after the pass loads: a session waits for the pass before
    /// answering a frontend that relies on it. The thread must be woken if it sleeps (a
    /// member's wake eventfd).
    pub(super) fn ask_pass(&self) -> u64 {
        // SeqCst: ordered after the caller's publication, which the thread's fence after
        // reading the ask then sees.
        self.shared.passes_asked.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Whether the thread passed the top of its loop since the ask that gave `ticket`, or
    /// no longer runs.
    pub(super) fn passed(&self, ticket: u64) -> bool {
        self.shared.passes_made.load(Ordering::Acquire) >= ticket
            || !self
                .shared
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .running
    }

    /// Hands `worker` to the group's thread (starting it if none runs). The queue comes back
    /// on the returned receiver once the worker was stopped and drained.
    pub(super) fn join(&self, worker: QueueWorker) -> std::io::Result<Receiver<Queue>> {
        use std::os::fd::AsRawFd;
        let (done, back) = sync_channel(1);
        worker.epoll.ctl(
            ControlOperation::Add,
            self.shared.wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_GROUP),
        )?;
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.joining.push(Member { worker, done });
        self.shared.attention.store(true, Ordering::Release);
        if st.running {
            let _ = self.shared.wake.write(1);
        } else {
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(self.shared.name.clone())
                .spawn(move || run(shared));
            match spawned {
                Ok(_) => st.running = true,
                Err(e) => {
                    st.joining.pop();
                    return Err(e);
                }
            }
        }
        Ok(back)
    }

    /// Tells the thread to look at its members (one of them was asked to stop).
    pub(super) fn attend(&self) {
        self.shared.attention.store(true, Ordering::Release);
    }

    /// The same group (for a queue's handle).
    pub(crate) fn handle(&self) -> PollGroup {
        PollGroup {
            shared: self.shared.clone(),
        }
    }
}

/// Marks the group's thread gone should it die of a panic (a bug), so the next queue to
/// join starts a new thread instead of waiting for ever on a dead one; queues that joined
/// meanwhile get that new thread at once, and a pass asked for is not waited for. The
/// queues it served went down with it (their handles see no queue). Weak: the thread's own
/// reference must be the one whose drop closes the group's descriptors on a normal end.
struct Unwinding(std::sync::Weak<Shared>);

impl Drop for Unwinding {
    fn drop(&mut self) {
        let Some(shared) = self.0.upgrade().filter(|_| std::thread::panicking()) else {
            return;
        };
        tracing::error!(group = %shared.name, "a poll thread panicked: its queues stopped; queues joining get a new thread");
        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.running = false;
        if st.joining.is_empty() {
            return;
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(shared.name.clone())
            .spawn(move || run(s));
        match spawned {
            Ok(_) => st.running = true,
            Err(_) => st.joining.clear(),
        }
    }
}

/// The group's thread: takes new members, stops those asked to, polls every member each
/// round, and after `poll_idle` without work sleeps once for all of them.
fn run(shared: Arc<Shared>) {
    let mut members: Vec<Member> = Vec::new();
    // After `members`, so dropped before them: the group is marked free before the queues'
    // ways back close (a handle that sees its queue gone may join again at once).
    let _unwinding = Unwinding(Arc::downgrade(&shared));
    let mut events = vec![EpollEvent::default(); 16];
    let mut idle = Idle::new();
    let epoll = match Epoll::new() {
        Ok(e) => e,
        Err(e) => {
            // Nothing to sleep on: the members are given back unserved (their handles see
            // no queue) rather than left hanging.
            tracing::error!(group = %shared.name, error = %e, "cannot create the poll group's epoll");
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.joining.clear();
            st.running = false;
            return;
        }
    };
    shared.share_group.wake();
    let mut passes = 0;
    loop {
        // Between rounds: no round of this thread is writing into guest memory. One relaxed
        // load of a line only a session's rare ask writes.
        let asked = shared.passes_asked.load(Ordering::Relaxed);
        if asked != passes {
            // Pairs with the ask: the rounds from here load what was published before it.
            fence(Ordering::SeqCst);
            passes = asked;
            shared.passes_made.store(asked, Ordering::Release);
        }
        if shared.attention.swap(false, Ordering::AcqRel) || members.is_empty() {
            let mut stopped = Vec::new();
            if !attend(&shared, &epoll, &mut members, &mut stopped) {
                // The thread's descriptors (its epoll, the group's wake eventfd when this
                // was the last reference) are closed before the last queue goes back: a
                // stopped queue's handle sees nothing of the group left open.
                drop(epoll);
                shared.share_group.doze();
                drop(shared);
                send_back(stopped);
                return;
            }
            send_back(stopped);
            idle.work();
        }
        idle.look_at_contention(&mut members);
        let mut work = false;
        let mut stepped_aside = false;
        for m in &mut members {
            let mem = m.worker.begin_round();
            work |= m.worker.poll_round(&mem);
            stepped_aside |= m.worker.take_stepped_aside();
        }
        if stepped_aside {
            // The volume is ahead of its fair share: off the core for a moment, once for
            // every queue of this thread. Rounds are slow now: the look at contention is
            // due by the clock too, or the share's view of this thread would go stale.
            idle.look_at_sharing_soon(&members);
            std::thread::sleep(SHARE_PAUSE);
        }
        if work {
            idle.work();
            continue;
        }
        if !idle.may_sleep(&shared.share_group, &members) {
            std::hint::spin_loop();
            continue;
        }
        if sleep(&shared.share_group, &epoll, &mut members, &mut events) {
            idle.work();
        }
    }
}

/// Gives stopped queues back to their handles.
fn send_back(stopped: Vec<(SyncSender<Queue>, Queue)>) {
    for (done, queue) in stopped {
        let _ = done.send(queue);
    }
}

/// Takes the queues waiting to join and stops those asked to stop (joiners first: a queue
/// may be asked to stop before its thread took it). Returns false when the group has no
/// queue left (the thread ends; a queue joining later starts a new one).
fn attend(
    shared: &Shared,
    epoll: &Epoll,
    members: &mut Vec<Member>,
    stopped: &mut Vec<(SyncSender<Queue>, Queue)>,
) -> bool {
    let lock = || shared.state.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        // The wake-up is read with the joiners it announced (`join` writes it under the
        // lock), so neither is left behind. Started outside the lock (a start replays the
        // queue's journal): a session adding another queue meanwhile does not wait for it.
        let joining = {
            let mut st = lock();
            let _ = shared.wake.read();
            std::mem::take(&mut st.joining)
        };
        for mut m in joining {
            let watched = epoll.ctl(
                ControlOperation::Add,
                m.worker.epoll_fd(),
                EpollEvent::new(EventSet::IN, 0),
            );
            if let Err(e) = watched {
                // Dropping the member drops its sender: its handle sees no queue back.
                tracing::error!(group = %shared.name, error = %e, "cannot watch a queue in its poll group");
                continue;
            }
            m.worker.drain_window = shared.drain_window.clone();
            m.worker.start();
            members.push(m);
        }
        let mut i = 0;
        while i < members.len() {
            if members[i].worker.stopping() {
                let m = members.swap_remove(i);
                let _ = epoll.ctl(
                    ControlOperation::Delete,
                    m.worker.epoll_fd(),
                    EpollEvent::default(),
                );
                stopped.push((m.done, m.worker.finish()));
            } else {
                i += 1;
            }
        }
        if !members.is_empty() {
            return true;
        }
        // No queue left: the thread ends, unless one joined since (under the lock a joining
        // queue sees `running` and leaves the start to us, or starts a new thread).
        let mut st = lock();
        if st.joining.is_empty() {
            st.running = false;
            return false;
        }
    }
}

/// When an idle group stops polling: after `poll_idle` without work, at once when more
/// threads are awake than cores or the scheduler took this core for another thread.
struct Idle {
    last_work: Instant,
    rounds: u32,
    preempted: Preemptions,
    /// Rounds since the last look at contention, and that look's own count.
    since_contention: u32,
    contention: Preemptions,
    /// The fair share's window on contention: since when, preemptions since it began (a
    /// count of its own), and this thread's run-queue wait (ns, its schedstat) then.
    window_start: Instant,
    share_preemptions: Preemptions,
    window_wait: Option<u64>,
    schedstat: Option<std::fs::File>,
    last_look: Instant,
    /// The end of the last window that found this thread's core shared.
    contended_since: Option<Instant>,
}

/// Every how many rounds the thread asks whether it was preempted (one `getrusage`).
const CONTENTION_ROUNDS: u32 = 2048;
/// The fair share looks at preemptions over windows this long ...
const SHARE_WINDOW: Duration = Duration::from_millis(20);
/// ... and calls the thread's core shared when it lost it this many times in one (150 a
/// second and more: another runnable thread takes turns with it; the few preemptions a
/// second of the kernel's own threads on an otherwise free core are not that) ...
const SHARE_PREEMPTIONS: u64 = 3;
/// ... or when it waited for a core this share of the window (threads that give way by
/// sleeping are not preempted, but they wait to run again; wake-ups on a free core wait a
/// few microseconds, a few percent of a busy queue's time at most).
const SHARE_WAIT_PERCENT: u64 = 15;
/// How often a thread that keeps giving way for the fair share looks at contention.
const FORCED_LOOK: Duration = Duration::from_millis(2);

impl Idle {
    fn new() -> Self {
        Idle {
            last_work: Instant::now(),
            rounds: 0,
            preempted: Preemptions::default(),
            since_contention: 0,
            contention: Preemptions::default(),
            window_start: Instant::now(),
            share_preemptions: {
                // Counted from now (the thread's earlier preemptions are not this window's).
                let mut p = Preemptions::default();
                p.count_since_last_look();
                p
            },
            window_wait: None,
            // Opened by the thread itself: `thread-self` names it for good.
            schedstat: std::fs::File::open("/proc/thread-self/schedstat").ok(),
            last_look: Instant::now(),
            // Presumed shared until CONTENDED_HOLD of windows say otherwise.
            contended_since: Some(Instant::now()),
        }
    }

    /// This thread's time spent waiting for a core so far (ns), from its schedstat.
    fn run_wait(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 96];
        let n = self.schedstat.as_ref()?.read_at(&mut b, 0).ok()?;
        let text = std::str::from_utf8(&b[..n]).ok()?;
        text.split_whitespace().nth(1)?.parse().ok()
    }

    /// Every [`CONTENTION_ROUNDS`] rounds: whether the scheduler took this thread's core for
    /// another thread since the last look; the members take smaller batches only while not
    /// (`INLINE_TAKE_BUDGET`).
    #[inline]
    fn look_at_contention(&mut self, members: &mut [Member]) {
        self.since_contention += 1;
        if self.since_contention < CONTENTION_ROUNDS {
            return;
        }
        self.since_contention = 0;
        // Every member, every look: one that joined since takes the thread's state.
        let contended = self.contention.since_last_look();
        for m in members.iter_mut() {
            m.worker.set_contended(contended);
        }
        self.look_at_sharing(members);
    }

    /// [`Self::look_at_sharing`] for a thread that keeps giving way (its rounds are slow:
    /// it looks by the clock, at most every [`FORCED_LOOK`]).
    fn look_at_sharing_soon(&mut self, members: &[Member]) {
        if self.last_look.elapsed() >= FORCED_LOOK {
            self.look_at_sharing(members);
        }
    }

    /// Whether this thread's core is shared, for the fair share (share.rs), which holds a
    /// volume back only where cores are shared: over windows of [`SHARE_WINDOW`], it is
    /// when the thread was preempted [`SHARE_PREEMPTIONS`] times or waited to run
    /// [`SHARE_WAIT_PERCENT`] of the window, and it stays so until `CONTENDED_HOLD` passed
    /// without that.
    fn look_at_sharing(&mut self, members: &[Member]) {
        self.last_look = Instant::now();
        let elapsed = self.window_start.elapsed();
        if elapsed < SHARE_WINDOW {
            return;
        }
        let preempted = self.share_preemptions.count_since_last_look();
        let wait = self.run_wait();
        let waited = match (self.window_wait, wait) {
            (Some(a), Some(b)) => b.saturating_sub(a) * 100,
            _ => 0,
        };
        if preempted >= SHARE_PREEMPTIONS
            || waited >= elapsed.as_nanos() as u64 * SHARE_WAIT_PERCENT
        {
            self.contended_since = Some(Instant::now());
        }
        let contended = self
            .contended_since
            .is_some_and(|t| t.elapsed() < crate::share::CONTENDED_HOLD);
        if let Some(m) = members.first() {
            m.worker.pace.share.set_contended(contended);
        }
        self.window_start = Instant::now();
        self.window_wait = wait;
    }

    #[inline]
    fn work(&mut self) {
        self.last_work = Instant::now();
        self.rounds = 0;
    }

    /// Reading the clock costs more than a poll round: looks only every 64 idle rounds.
    #[inline]
    fn may_sleep(&mut self, share_group: &ShareGroup, members: &[Member]) -> bool {
        self.rounds += 1;
        if !self.rounds.is_multiple_of(64) {
            return false;
        }
        let poll_idle = members
            .iter()
            .map(|m| m.worker.poll_idle)
            .max()
            .unwrap_or(Duration::ZERO);
        // More threads awake than cores, or the scheduler took this core for another thread
        // while we polled: sleep now, polling would only take a core from a worker or client
        // with work (docs/qos.md, "Scaling").
        if self.last_work.elapsed() < poll_idle
            && !share_group.crowded()
            && !self.preempted.since_last_look()
        {
            return false;
        }
        !members.iter().any(|m| m.worker.must_poll())
    }
}

/// Event-driven mode for the whole group: every member asks to be woken and checks once
/// more; if none found work, the thread sleeps until any member's kick, wake-up or device
/// completion (or the shortest of their sleep budgets). Returns whether it slept.
fn sleep(
    group: &ShareGroup,
    epoll: &Epoll,
    members: &mut [Member],
    events: &mut [EpollEvent],
) -> bool {
    let mut ready = true;
    let mut wait_ms = i32::MAX;
    for m in members.iter_mut() {
        m.worker.note_idle();
        let mem = m.worker.current_memory();
        if !m.worker.prepare_sleep(&mem) {
            ready = false;
            break;
        }
        wait_ms = wait_ms.min(m.worker.sleep_budget_ms());
    }
    if ready {
        group.doze();
        match members {
            // One queue: its own epoll is the only one to sleep on (no second look).
            [m] => {
                let mem = m.worker.current_memory();
                m.worker.sleep_alone(&mem, wait_ms, events);
                group.wake();
                return true;
            }
            _ => {
                if let Err(e) = epoll.wait(wait_ms, events) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        tracing::error!(error = %e, "poll group epoll failed");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        group.wake();
    }
    for m in members.iter_mut() {
        let mem = m.worker.current_memory();
        m.worker.after_sleep(&mem, events);
    }
    ready
}
