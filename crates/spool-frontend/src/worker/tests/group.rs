//! Poll groups driven directly: queues handed to a group's thread are served there, and a
//! queue asked to stop comes back, however early the stop.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use super::*;
use crate::worker::PollGroup;

/// A harness's worker handed to `group`, and what its handle would keep: its stop flag and
/// wake eventfd, and where its queue comes back. The rest of the harness (guest memory, the
/// scripted device) stays with the caller.
struct Joined {
    stop: Arc<AtomicBool>,
    wake: EventFd,
    back: Receiver<Queue>,
}

fn join(group: &PollGroup, h: &mut Option<Harness>) -> (Joined, Harness) {
    let Harness {
        w,
        mem,
        mem_src,
        script,
        health,
        avail,
        waits,
        _dir,
    } = h.take().unwrap();
    let stop = w.stop.clone();
    let wake = w.wake.try_clone().unwrap();
    let back = group.join(w).unwrap();
    // The rest, with a placeholder worker no test drives.
    let rest = Harness::new(0);
    let rest = Harness {
        w: rest.w,
        mem,
        mem_src,
        script,
        health,
        avail,
        waits,
        _dir,
    };
    (Joined { stop, wake, back }, rest)
}

impl Joined {
    /// What `WorkerHandle::stop` does; the queue must come back within 5 s.
    fn stop(self, group: &PollGroup) -> Queue {
        self.stop.store(true, Ordering::Release);
        group.attend();
        let _ = self.wake.write(1);
        self.back
            .recv_timeout(Duration::from_secs(5))
            .expect("the stopped queue came back")
    }
}

/// A stop sent right after the queue was handed over (before the thread may have taken it)
/// is not lost: the thread takes the queue, sees the stop, and gives it back.
#[test]
fn a_queue_stopped_as_soon_as_it_joined_comes_back() {
    for _ in 0..100 {
        let group = PollGroup::new("t", Arc::default()).unwrap();
        let mut h = Some(Harness::new(0));
        let (j, _rest) = join(&group, &mut h);
        j.stop(&group);
    }
}

/// Two queues on one thread: each takes its guest's request, submits it to its own device
/// queue, and completes it when its device does; stopped, each gives its queue back.
#[test]
fn queues_of_one_group_are_served_by_its_thread() {
    let group = PollGroup::new("t", Arc::default()).unwrap();
    let mut a = Harness::new(0);
    let mut b = Harness::new(0);
    // The device completes when the test says, which on a loaded host can be long after
    // the harness's 4 ms timeout: the thread's own sweep would abort the command first.
    a.w.sweep.io_timeout = Duration::from_secs(600);
    b.w.sweep.io_timeout = Duration::from_secs(600);
    let (ha, hb) = (a.post_read(0), b.post_read(1));
    let (ja, a) = join(&group, &mut Some(a));
    let (jb, b) = join(&group, &mut Some(b));
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.submitted().is_empty() || b.submitted().is_empty() {
        assert!(Instant::now() < deadline, "both requests submitted");
        std::thread::sleep(Duration::from_millis(1));
    }
    a.device_completes(ha, LEN as i32);
    b.device_completes(hb, LEN as i32);
    while a.status(ha) == UNWRITTEN || b.status(hb) == UNWRITTEN {
        assert!(Instant::now() < deadline, "both requests completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.status(ha), VIRTIO_BLK_S_OK as u8);
    assert_eq!(b.status(hb), VIRTIO_BLK_S_OK as u8);
    assert_eq!(a.used(), vec![(ha, LEN + 1)]);
    assert_eq!(b.used(), vec![(hb, LEN + 1)]);
    assert_eq!(ja.stop(&group).next_avail(), 1);
    assert_eq!(jb.stop(&group).next_avail(), 1);
}

/// A pass asked for while the thread is in a round comes only once that round ended: a
/// session that published a dirty log waits for the pass before answering QEMU, so no round
/// that loaded the earlier map (without the log) writes into guest memory after the answer.
#[test]
fn a_pass_asked_during_a_round_comes_after_it() {
    let group = PollGroup::new("t", Arc::default()).unwrap();
    let mut a = Harness::new(0);
    // The request times out (the harness's io_timeout is 4 ms) and fails: the rounds go on.
    a.post_read(0);
    let (ja, a) = join(&group, &mut Some(a));
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.submitted().is_empty() {
        assert!(Instant::now() < deadline, "request submitted");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Not held, the thread passes as soon as it gets to the top of its loop.
    let t = group.ask_pass();
    let _ = ja.wake.write(1);
    while !group.passed(t) {
        assert!(Instant::now() < deadline, "the thread passed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The device's lock held, and the thread woken (it may sleep in epoll): every round
    // goes to the device, so the thread is soon waiting for the lock inside one (or inside
    // the checks before a sleep, also mid-loop). Only then the ask.
    let held = lock(&a.script);
    let _ = ja.wake.write(1);
    while !a.waits.waiting() {
        assert!(Instant::now() < deadline, "the thread waits for the device");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t = group.ask_pass();
    let _ = ja.wake.write(1);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!group.passed(t), "passed while a round was under way");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !group.passed(t) {
        assert!(Instant::now() < deadline, "passed once the round ended");
        std::thread::sleep(Duration::from_millis(1));
    }
    ja.stop(&group);
}

/// A device queue whose submit panics: a bug in the poll thread, as a test can make one.
struct Panicking;

impl DeviceQueue for Panicking {
    unsafe fn submit(&mut self, _: DeviceIo, _: u64) {
        panic!("a bug in the poll thread (injected by the test)");
    }
    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn reap(&mut self, _: &mut dyn FnMut(u64, i32)) -> usize {
        0
    }
    fn completion_fd(&self) -> std::os::fd::RawFd {
        -1
    }
    fn ack_completion_event(&self) {}
    fn in_flight(&self) -> usize {
        0
    }
}

/// A group whose thread died of a panic gives the next queue a new thread rather than
/// handing it to the dead one (where it would never be served).
#[test]
fn after_its_thread_panicked_a_group_serves_the_next_queue_on_a_new_one() {
    let group = PollGroup::new("t", Arc::default()).unwrap();
    let mut a = Harness::new(0);
    a.w.dev.queues[0] = Box::new(Panicking);
    a.post_read(0);
    let (ja, _a) = join(&group, &mut Some(a));
    // The queue went down with the thread: its way back is closed.
    assert!(ja.back.recv_timeout(Duration::from_secs(5)).is_err());
    let mut b = Harness::new(0);
    b.w.sweep.io_timeout = Duration::from_secs(600);
    let hb = b.post_read(1);
    let (jb, b) = join(&group, &mut Some(b));
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.submitted().is_empty() {
        assert!(Instant::now() < deadline, "the next queue was never served");
        std::thread::sleep(Duration::from_millis(1));
    }
    b.device_completes(hb, LEN as i32);
    while b.status(hb) == UNWRITTEN {
        assert!(Instant::now() < deadline, "its request never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(jb.stop(&group).next_avail(), 1);
}
