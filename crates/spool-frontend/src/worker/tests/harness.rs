//! The recovery tests' harness: a scripted [`DeviceQueue`] whose completions, errors, hangs
//! and health changes come in the order a test chooses, and a worker on it with a guest that
//! posts 512-byte reads and a journal.

use super::*;
/// What the scripted device does and did; shared by every queue the worker opens on it.
pub(super) struct Script {
    /// Every submission's tag, in order.
    pub(super) submitted: Vec<u64>,
    /// Submitted and not completed by the device yet (hung until the test completes them).
    pub(super) outstanding: Vec<u64>,
    /// Completed by the device, not reaped yet.
    pub(super) done: VecDeque<(u64, i32)>,
    /// What an abort does to outstanding commands: completes them with this negative errno,
    /// or (None) leaves them hung.
    pub(super) abort_with: Option<i32>,
    /// Commands submitted from now on complete at once with this result (None: they wait
    /// for the test).
    pub(super) complete_at_once: Option<i32>,
    /// What giving up (`abandon`) does to outstanding commands, where an abort cannot take
    /// them back (an RBD operation): completes them with this negative errno; None: as abort.
    pub(super) abandon_with: Option<i32>,
    pub(super) abandons: usize,
    /// Queues opened on the device (a reset opens new ones).
    pub(super) opened: usize,
    pub(super) aborts: usize,
}

/// A [`DeviceQueue`] that completes nothing on its own.
pub(super) struct ScriptedQueue {
    pub(super) script: Arc<Mutex<Script>>,
    pub(super) event: EventFd,
    pub(super) waits: Arc<LockWaits>,
}

/// How often the worker's device queues went for the script's lock, and got it: while a test
/// holds the lock, `tries > got` says the worker waits for it (inside a device call).
#[derive(Default)]
pub(super) struct LockWaits {
    tries: AtomicU64,
    got: AtomicU64,
}

impl LockWaits {
    pub(super) fn waiting(&self) -> bool {
        self.tries.load(Ordering::SeqCst) > self.got.load(Ordering::SeqCst)
    }
}

impl ScriptedQueue {
    fn lock(&self) -> MutexGuard<'_, Script> {
        self.waits.tries.fetch_add(1, Ordering::SeqCst);
        let g = lock(&self.script);
        self.waits.got.fetch_add(1, Ordering::SeqCst);
        g
    }
}

pub(super) fn lock(s: &Mutex<Script>) -> MutexGuard<'_, Script> {
    s.lock().unwrap()
}

impl DeviceQueue for ScriptedQueue {
    unsafe fn submit(&mut self, _io: DeviceIo, tag: u64) {
        let mut s = self.lock();
        s.submitted.push(tag);
        match s.complete_at_once {
            Some(res) => s.done.push_back((tag, res)),
            None => s.outstanding.push(tag),
        }
    }
    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let ready: Vec<_> = self.lock().done.drain(..).collect();
        for &(tag, res) in &ready {
            done(tag, res);
        }
        ready.len()
    }
    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }
    fn ack_completion_event(&self) {}
    fn in_flight(&self) -> usize {
        let s = self.lock();
        s.outstanding.len() + s.done.len()
    }
    fn abandon(&mut self) -> usize {
        let mut s = self.lock();
        let Some(res) = s.abandon_with else {
            drop(s);
            return self.abort();
        };
        s.abandons += 1;
        let tags = std::mem::take(&mut s.outstanding);
        s.done.extend(tags.iter().map(|&t| (t, res)));
        tags.len()
    }
    fn abort(&mut self) -> usize {
        let mut s = self.lock();
        s.aborts += 1;
        let Some(res) = s.abort_with else { return 0 };
        let tags = std::mem::take(&mut s.outstanding);
        s.done.extend(tags.iter().map(|&t| (t, res)));
        tags.len()
    }
}

pub(super) const QSIZE: u16 = 16;
pub(super) const DESC: u64 = 0x0;
pub(super) const AVAIL: u64 = 0x1000;
pub(super) const USED: u64 = 0x2000;
pub(super) const SIZE: u64 = 1 << 20;
pub(super) const LEN: u32 = 512;
/// What a status byte holds before the worker writes it.
pub(super) const UNWRITTEN: u8 = 0xee;

/// A worker on one scripted device, a guest that posts 512-byte reads, and a journal.
pub(super) struct Harness {
    pub(super) w: QueueWorker,
    pub(super) mem: Arc<GuestMemory>,
    /// Where the worker finds the frontend's current memory map (a new table is stored here).
    pub(super) mem_src: Arc<ArcSwap<GuestMemory>>,
    pub(super) script: Arc<Mutex<Script>>,
    pub(super) health: Arc<DeviceHealth>,
    pub(super) avail: u16,
    pub(super) waits: Arc<LockWaits>,
    pub(super) _dir: tempfile::TempDir,
}

/// A descriptor for `fd` the worker can watch in epoll, as its kick eventfd.
pub(super) fn pollable_file() -> std::fs::File {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    std::fs::File::from(OwnedFd::from(a))
}

impl Harness {
    pub(super) fn new(request_retries: u32) -> Harness {
        let device = Arc::new(
            Device::open_null("w", SIZE, NullReads::Untouched, &Default::default()).unwrap(),
        );
        Self::on(request_retries, device)
    }

    /// The harness with `device` in the volume's layout (its queues are still the scripted
    /// ones: the layout's device decides only what the worker knows of it).
    pub(super) fn on(request_retries: u32, device: Arc<Device>) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(GuestMemory::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap());
        let mut q = Queue::new(QSIZE).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        let (mut j, _) = Journal::open_or_create(dir.path(), Uuid::new_v4(), 0, QSIZE).unwrap();
        let rings = RingAddrs {
            desc: DESC,
            avail: AVAIL,
            used: USED,
        };
        let view = RingView {
            rings,
            size: QSIZE,
            avail_idx: 0,
            used_idx: 0,
            memory: None,
        };
        resume(&mut j, view, ResumeFrom::Frontend(0), &mut |_| {}).unwrap();
        let health = device.health().clone();
        let layout = VolumeLayout {
            uuid: Uuid::new_v4(),
            name: "v".into(),
            size: SIZE,
            read_only: false,
            num_queues: 1,
            segments: vec![Segment {
                logical: 0,
                len: SIZE,
                device: 0,
                offset: 0,
            }],
            devices: vec![device],
            qos: None,
            cipher: None,
            discard_alignment: 4096,
            generation: 0,
        };
        let mem_src = Arc::new(ArcSwap::from(mem.clone()));
        let spec = WorkerSpec {
            index: 0,
            queue: q,
            journal: Some(j),
            resubmit: vec![],
            mem: mem_src.clone(),
            kick: pollable_file(),
            call: Arc::new(ArcSwapOption::empty()),
            layout: Arc::new(ArcSwap::from_pointee(layout)),
            limits: Limits {
                capacity_sectors: SIZE / SECTOR,
                read_only: false,
                max_data: 1 << 20,
                max_discard_segs: 1,
                max_discard_sectors: 1 << 10,
            },
            serial: [0; crate::request::ID_LEN],
            poll_idle: Duration::from_secs(1),
            io_timeout: Duration::from_millis(4),
            request_retries,
            volume: "v".into(),
            fault: Arc::new(crate::SessionFault::new()),
            abandoned: Arc::new(AtomicU64::new(0)),
            clock: Arc::default(),
            replay: None,
            poison: vec![],
            qos: Arc::new(crate::qos::VolumeQos::default()),
            stats: Arc::new(crate::stats::VolumeStats::new(1)),
            share: crate::share::ShareGroup::default().join(0),
            share_group: Arc::default(),
            fair_share: true,
            witness: None,
        };
        let script = Arc::new(Mutex::new(Script {
            submitted: vec![],
            outstanding: vec![],
            done: VecDeque::new(),
            abort_with: Some(-libc::ECANCELED),
            complete_at_once: None,
            abandon_with: None,
            abandons: 0,
            opened: 0,
            aborts: 0,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let reset = Arc::new(AtomicBool::new(false));
        let wake = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut w = QueueWorker::assemble(spec, stop, reset, wake).unwrap();
        let s = script.clone();
        let waits = Arc::new(LockWaits::default());
        let r = waits.clone();
        w.dev.factory = Some(Box::new(move |_d| {
            lock(&s).opened += 1;
            Ok(Box::new(ScriptedQueue {
                script: s.clone(),
                event: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                waits: r.clone(),
            }) as Box<dyn DeviceQueue>)
        }));
        w.open_device_queues().unwrap();
        Harness {
            w,
            mem,
            mem_src,
            script,
            health,
            avail: 0,
            waits,
            _dir: dir,
        }
    }

    /// Posts request `k` (< 5): a read of sector `k` in descriptors 3k..3k+2; returns its head.
    pub(super) fn post_read(&mut self, k: u16) -> u16 {
        self.post_read_into(k, 0x10_0000 + k as u64 * 0x1000 + 0x100)
    }

    /// [`Self::post_read`] with its data buffer at guest address `data`.
    pub(super) fn post_read_into(&mut self, k: u16, data: u64) -> u16 {
        let head = 3 * k;
        let buf = 0x10_0000 + k as u64 * 0x1000;
        let m = &self.mem;
        m.write_obj(VIRTIO_BLK_T_IN.to_le(), GuestAddress(buf))
            .unwrap();
        m.write_obj((k as u64).to_le(), GuestAddress(buf + 8))
            .unwrap();
        m.write_obj(UNWRITTEN, GuestAddress(buf + 0x800)).unwrap();
        let (next, write) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
        let chain = [
            Descriptor::new(buf, 16, next, head + 1),
            Descriptor::new(data, LEN, next | write, head + 2),
            Descriptor::new(buf + 0x800, 1, write, 0),
        ];
        for (i, d) in chain.into_iter().enumerate() {
            m.write_obj(d, GuestAddress(DESC + 16 * (head as u64 + i as u64)))
                .unwrap();
        }
        let slot = AVAIL + 4 + 2 * (self.avail % QSIZE) as u64;
        m.write_obj(head.to_le(), GuestAddress(slot)).unwrap();
        self.avail = self.avail.wrapping_add(1);
        m.write_obj(self.avail.to_le(), GuestAddress(AVAIL + 2))
            .unwrap();
        head
    }

    /// One poll round of the worker loop.
    pub(super) fn round(&mut self) {
        let mem = self.w.begin_round();
        self.w.poll_round(&mem);
    }

    /// The status byte of the request at `head`.
    pub(super) fn status(&self, head: u16) -> u8 {
        let buf = 0x10_0000 + (head / 3) as u64 * 0x1000;
        self.mem.read_obj(GuestAddress(buf + 0x800)).unwrap()
    }

    /// Every used element published so far: (head, length).
    pub(super) fn used(&self) -> Vec<(u16, u32)> {
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = USED + 4 + 8 * (i % QSIZE) as u64;
                let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
                (id as u16, len)
            })
            .collect()
    }

    /// The heads the journal records INFLIGHT.
    pub(super) fn journaled(&self) -> Vec<u16> {
        self.w.ring.vq.journaled_inflight().unwrap()
    }

    pub(super) fn submitted(&self) -> Vec<u64> {
        lock(&self.script).submitted.clone()
    }

    /// The device completes the outstanding command for `head` with `res`.
    pub(super) fn device_completes(&self, head: u16, res: i32) {
        let mut s = lock(&self.script);
        let i = s
            .outstanding
            .iter()
            .position(|&t| t == head as u64)
            .expect("command outstanding");
        s.outstanding.remove(i);
        s.done.push_back((head as u64, res));
    }

    pub(super) fn state(&self) -> HealthState {
        self.health.state()
    }
}
