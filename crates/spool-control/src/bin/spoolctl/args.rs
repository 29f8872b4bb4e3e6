//! spoolctl's command line (clap derive): one variant per subcommand.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Manage a running spoold: its pool, devices and volumes.
#[derive(Parser)]
#[command(version)]
pub struct Args {
    /// spoold's RPC socket.
    #[arg(
        short,
        long,
        env = "SPOOL_SOCKET",
        default_value = "spool-state/spoold.sock"
    )]
    pub socket: PathBuf,
    /// Print the raw JSON result (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// The storage pool.
    Pool {
        #[command(subcommand)]
        cmd: PoolCmd,
    },
    /// Devices of the pool.
    Device {
        #[command(subcommand)]
        cmd: DeviceCmd,
    },
    /// Logical volumes.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// Snapshots of thin volumes (docs/snapshots.md).
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
    /// Show the daemon: worker and keeper, how it last (re)started, restart phases.
    Status,
    /// Replace the running worker with a new binary without disconnecting any VM: the old
    /// worker drains and hands its descriptors over through the keeper. If the new binary
    /// refuses the state or fails, the old one keeps (or resumes) serving and this says why.
    Upgrade {
        /// The new spoold binary (default: the binary the worker runs now).
        #[arg(long)]
        binary: Option<PathBuf>,
    },
    /// Health events (device state changes, warnings, replacements), oldest first.
    Events {
        /// Only events after this sequence number.
        #[arg(long, default_value_t = 0)]
        since: u64,
        /// Keep printing new events until interrupted.
        #[arg(long, short)]
        follow: bool,
    },
    /// Send any RPC method with JSON params (for debugging).
    Rpc {
        method: String,
        params: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum SnapshotCmd {
    /// Delete a snapshot: the chunks no other map (the volume's, a clone's) names go back
    /// to the pool.
    Delete {
        /// VOLUME@SNAPSHOT.
        snapshot: String,
    },
}

#[derive(Subcommand)]
pub enum PoolCmd {
    /// Show the pool: size, free space, devices.
    Show,
    /// Check the pool's metadata: every extent and thin map read back from the devices and
    /// compared with each other and with the allocators (overlaps, corrupt or duplicated map
    /// entries, leaked space, wrong sharing counts). Exits 1 when it finds a problem.
    Check,
}

#[derive(Subcommand)]
pub enum DeviceCmd {
    /// List devices.
    List,
    /// Add a file or block device to the pool.
    Add {
        path: PathBuf,
        /// Create a sparse file of this size if PATH does not exist (e.g. 10G).
        #[arg(long)]
        create_size: Option<String>,
        /// Reformat the device if it holds foreign or unreadable metadata (its data is lost).
        #[arg(long)]
        force: bool,
    },
    /// Health of every device (or one): state, why, error counters, SMART warning.
    Health { id: Option<String> },
    /// Controller reset: hold the device's I/O, check it answers, resubmit what was in flight.
    Reset { id: String },
    /// Replace a failed or removed device with a blank one; volumes on the old device come
    /// back online: a mirrored volume's copy there is rebuilt from another (a mirrored thin
    /// volume's copy is made anew there, holes kept), a thin volume loses only the chunks
    /// it had there, a plain volume the data it had there.
    Replace {
        old: String,
        new: PathBuf,
        /// Create a sparse file of this size if NEW does not exist (e.g. 10G).
        #[arg(long)]
        create_size: Option<String>,
        /// Replace a healthy device, or reformat a NEW that is not blank.
        #[arg(long)]
        force: bool,
    },
    /// Inject a fault (to test and rehearse failure handling). Kinds: media (ENODATA,
    /// until cleared), transient (EIO, once), link-down (EIO, probes fail too, until cleared
    /// or --duration-ms), timeout (commands hang until the reset aborts them, once),
    /// removed (ENODEV), errno (--errno), smart (--bits: SMART critical-warning byte),
    /// reset-panic / reset-wedge (the worker's queue thread that resets the device panics
    /// there, or stops there for good: the keeper's restart and the worker watchdog), crash
    /// (the worker aborts when a matching command reaches the device).
    Inject(InjectArgs),
    /// Armed fault-injection rules of a device.
    Faults { id: String },
    /// Disarm every injected fault of a device (and clear its simulated SMART warning).
    ClearFaults { id: String },
}

#[derive(Subcommand)]
pub enum VolumeCmd {
    /// List volumes.
    List,
    /// Show one volume (by name or UUID).
    Show { id: String },
    /// Create a volume.
    Create {
        name: String,
        /// Capacity, e.g. 10G (a multiple of 512 bytes); leave it out to attach an RBD image
        /// at its own size.
        size: Option<String>,
        #[arg(long)]
        read_only: bool,
        /// Number of virtqueues (1-64).
        #[arg(long, default_value_t = 2)]
        queues: u16,
        /// Keep 2 or 3 copies, each on a different device (RAID-1): a device failure costs
        /// no data, and the volume rebuilds online onto a replacement.
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
        mirror: Option<u8>,
        /// Keep the data in Ceph RBD ([ceph] in the config): POOL creates image POOL/NAME,
        /// POOL/IMAGE attaches an existing image (docs/ceph.md).
        #[arg(long, value_name = "POOL[/IMAGE]")]
        rbd: Option<String>,
        /// Encrypt the volume's data (AES-XTS-256, a data key of its own wrapped under the
        /// key-encryption key of [encryption] in the config; docs/encryption.md).
        #[arg(long)]
        encrypt: bool,
        /// Take the volume's space from the pool on first write, one chunk (the pool's
        /// min_extent) at a time; discards give whole chunks back (docs/thin.md). With
        /// --mirror, each copy takes its chunks from devices of its own.
        #[arg(long)]
        thin: bool,
    },
    /// Rewrap every encrypted volume's data key under a new key-encryption key, without
    /// touching any data (docs/encryption.md).
    ///
    /// Put the new key where [encryption] points first (keep the old one until this
    /// succeeds), or pass --key-file; then make the config point at the new key.
    Rekey {
        /// Read the new key from this file (32 bytes or 64 hex digits, mode 0600) instead of
        /// the configured source.
        #[arg(long)]
        key_file: Option<String>,
    },
    /// Delete a volume (its data is lost).
    Delete {
        id: String,
        /// Disconnect a connected client first.
        #[arg(long)]
        force: bool,
        /// Also remove the RBD image of a volume that attached one (an image spoold created
        /// is removed anyway).
        #[arg(long)]
        remove_image: bool,
    },
    /// Grow a volume to SIZE.
    Resize { id: String, size: String },
    /// Take a snapshot of a running thin volume: crash-consistent (every write completed
    /// before it is in it, none started after it); the volume then copies a chunk before
    /// its first write there (docs/snapshots.md).
    Snapshot {
        /// The volume (by name or UUID).
        id: String,
        /// The snapshot's name (unique among the volume's).
        snapshot: String,
        /// Refuse it when the copies the volume's writes could need after it (every chunk it
        /// maps) exceed the pool's free space; without this it is taken with a warning.
        #[arg(long)]
        require_space: bool,
    },
    /// List a thin volume's snapshots, oldest first.
    Snapshots { id: String },
    /// Make a volume hold a snapshot's data again; only while no VM is connected to it. The
    /// data written since the snapshot is lost (take another snapshot first to keep it).
    Revert {
        /// The volume.
        id: String,
        /// The snapshot's name.
        snapshot: String,
    },
    /// Copy every chunk a volume (a clone) shares with a snapshot, so that it depends on
    /// none: it then takes its full size in the pool.
    Inflate { id: String },
    /// List the byte ranges that differ between a snapshot and another snapshot of the
    /// same volume, or the volume now (in whole chunks).
    Diff {
        /// VOLUME@SNAPSHOT.
        from: String,
        /// VOLUME@SNAPSHOT, or VOLUME for the volume now (the default).
        to: Option<String>,
    },
    /// Serve a snapshot read-only over NBD, for qemu-img, nbdinfo, nbdcopy and backup tools:
    /// meta context base:allocation, and with --since qemu:dirty-bitmap:SNAP (what changed
    /// since that snapshot). Over TCP with TLS (nbds://, [tls] dir in the config).
    Export {
        /// VOLUME@SNAPSHOT.
        snapshot: String,
        /// unix:PATH or HOST:PORT.
        #[arg(long, value_name = "unix:PATH|HOST:PORT")]
        nbd: String,
        /// An older snapshot of the same volume the dirty bitmap is against.
        #[arg(long, value_name = "SNAPSHOT")]
        since: Option<String>,
        /// Serve a snapshot of an encrypted volume decrypted: plaintext to whoever reaches
        /// the export (refused without it).
        #[arg(long)]
        decrypt: bool,
        /// Over TCP without TLS: whoever reaches HOST:PORT reads the snapshot and whoever is
        /// on the path sees its data (over TCP, TLS from [tls] dir is required otherwise).
        #[arg(long)]
        plaintext: bool,
    },
    /// Stop serving a snapshot over NBD.
    Unexport {
        /// VOLUME@SNAPSHOT.
        snapshot: String,
    },
    /// Receive a volume's data from elsewhere: serve the volume (thick or thin, on the pool's
    /// own devices, not encrypted when written by hand, no VM running it) as a writable NBD
    /// export, for another host, `qemu-img convert -n` or `nbdcopy` to write into. It ends when a VM starts the
    /// volume, with --stop, or when the volume is deleted; worker restarts keep it. With
    /// --token instead of --nbd: expect another spoold sending the volume (created here as
    /// the sender has it if missing) on the `[transfer] listen` socket (docs/transfer.md).
    Receive(ReceiveArgs),
    /// Send a volume to another host while it runs: the destination's NBD export (its
    /// spoold's `volume receive`) becomes a remote copy, rebuilt online and then kept in step
    /// (a write completes once both hosts have it). A dropped link is resumed from the
    /// write-intent bitmap. Without an option: how the send stands (docs/transfer.md).
    Send(SendArgs),
    /// Keep a standing replica of a volume on another spoold (docs/replicas.md): as `volume
    /// send` through its transfer listener, but the copy there stays a replica, which no VM
    /// runs until `volume promote` there; every write completes once both hosts have it.
    /// The destination expects it with `volume receive NAME --token T --replica`.
    Replicate(ReplicateArgs),
    /// Make a replica of another host's volume this host's own (its primary died or is cut
    /// off): the primary's transfer ends first, the volume is served at a higher epoch
    /// (the old primary is fenced off it: its hellos are refused), and VMs waiting on its
    /// socket go on (docs/replicas.md).
    Promote {
        /// The volume (name or UUID).
        id: String,
        /// Promote a replica whose primary never said its copy here was complete (it loses
        /// what the primary's copy had not brought over yet).
        #[arg(long)]
        force: bool,
    },
    /// Create a writable thin volume from a snapshot and serve it: it shares the snapshot's
    /// chunks until it writes there.
    Clone {
        /// VOLUME@SNAPSHOT.
        snapshot: String,
        /// The new volume's name.
        name: String,
    },
    /// Compare a mirrored volume's copies region by region (a scrub) and report
    /// differences.
    Verify { id: String },
    /// Add a copy to a volume (a plain volume becomes a mirror; the copy is rebuilt online;
    /// a thin volume gets two copies on devices of their own, which then take over from its
    /// map), remove one (the last complete copy is never removed), or accept a leg as
    /// current where no usable copy is (state no-current-copy).
    ///
    /// accept --leg N makes leg N's bytes the volume's content in every region that has no
    /// usable current copy, and copies them to the other legs. Acknowledged writes that leg
    /// missed there are LOST: use it only when the leg holding them is gone for good (see
    /// docs/mirror.md, "Regions with no current copy").
    Mirror {
        #[arg(value_parser = ["add", "remove", "accept"])]
        action: String,
        id: String,
        /// The leg to remove (default: one that is not current, else the newest), or to
        /// accept (required).
        #[arg(long)]
        leg: Option<u8>,
    },
    /// I/O statistics of every volume (or one): requests, bytes, errors, latency, in flight.
    ///
    /// Without --watch: totals since the worker started. With --watch: rates and latency
    /// over each interval, refreshed until interrupted (or --count times).
    Stats {
        id: Option<String>,
        #[arg(long, short)]
        watch: bool,
        /// Seconds between refreshes with --watch.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes with --watch.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Set or clear a volume's I/O limits (IOPS, bandwidth, burst).
    ///
    /// Running queues apply them at once, and they are kept in the pool metadata. Limits not
    /// named keep their current values (0 removes one); with no option, shows the limits.
    Qos(QosArgs),
}

// `volume qos` (no doc comment: the variant's is its help).
#[derive(clap::Args)]
pub struct QosArgs {
    /// The volume (name or UUID).
    pub id: String,
    /// Operations per second, reads and writes together (e.g. 20k; k = 1000).
    #[arg(long)]
    pub iops: Option<String>,
    /// Read operations per second.
    #[arg(long)]
    pub read_iops: Option<String>,
    /// Write operations per second (flushes and discards count as writes).
    #[arg(long)]
    pub write_iops: Option<String>,
    /// Bytes per second, reads and writes together (e.g. 200M, 1G; K/M/G = powers of 1024).
    #[arg(long)]
    pub bw: Option<String>,
    /// Bytes read per second.
    #[arg(long)]
    pub read_bw: Option<String>,
    /// Bytes written per second.
    #[arg(long)]
    pub write_bw: Option<String>,
    /// Burst allowance: how long an idle volume may exceed its limits (e.g. 250ms, 1s;
    /// default 1s).
    #[arg(long)]
    pub burst: Option<String>,
    /// Fair-share weight against the other busy volumes (1-10000, default 100; 0 resets):
    /// a volume of weight 200 gets twice the service of one of weight 100 when both want
    /// more than they get.
    #[arg(long)]
    pub weight: Option<u32>,
    /// Scheduling class of the volume's worker threads: latency (ahead of the others),
    /// normal, or batch (behind everyone, never preempting).
    #[arg(long, value_parser = ["latency", "normal", "batch"])]
    pub priority: Option<String>,
    /// Remove every limit first (options given with it then apply alone).
    #[arg(long)]
    pub clear: bool,
}

// `device inject` (no doc comment: the variant's is its help).
#[derive(clap::Args)]
pub struct InjectArgs {
    pub id: String,
    pub kind: String,
    /// read, write or any (the queues' I/O); meta-read, meta-write, meta-zero or meta (the
    /// device's metadata I/O: pool tables, thin maps, chunk zeroing and copies).
    #[arg(long, default_value = "any")]
    pub op: String,
    /// Device byte offset of the affected range (e.g. 1G).
    #[arg(long)]
    pub offset: Option<String>,
    /// Length of the range (default: the whole device).
    #[arg(long)]
    pub len: Option<String>,
    /// Operations to hit before disarming (0 = until cleared).
    #[arg(long)]
    pub count: Option<u64>,
    /// Disarm after this many milliseconds.
    #[arg(long)]
    pub duration_ms: Option<u64>,
    /// For kind errno: a number or a name (EIO, ENODATA, ...).
    #[arg(long)]
    pub errno: Option<String>,
    /// For kind smart: the critical-warning byte (1 spare, 2 temperature, 4 reliability,
    /// 8 read-only).
    #[arg(long)]
    pub bits: Option<u8>,
}

/// `volume receive`.
#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("receive_how").required(true).args(["nbd", "token", "token_file", "stop"]))]
pub struct ReceiveArgs {
    /// The volume (name or UUID; with --token, the name, which need not exist yet).
    pub id: String,
    /// unix:PATH or HOST:PORT.
    #[arg(long, value_name = "unix:PATH|HOST:PORT")]
    pub nbd: Option<String>,
    /// The token the sender gives (16 to 256 printable characters; `openssl rand -hex
    /// 16` makes one). Visible to other users of this host in the process list while
    /// spoolctl runs: --token-file keeps it out of it.
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
    /// --token read from a file (its first line), or from standard input with `-`.
    #[arg(long, value_name = "PATH|-")]
    pub token_file: Option<std::path::PathBuf>,
    /// With a token: refuse a sender whose volume is larger than this (e.g. 100G), so the
    /// token's holder cannot take all of the pool's free space.
    #[arg(long, value_name = "SIZE", conflicts_with_all = ["nbd", "stop"])]
    pub max_size: Option<String>,
    /// End the transfer (open connections fail their next request).
    #[arg(long)]
    pub stop: bool,
    /// With a token: keep the volume as a standing replica of the sender's (which runs
    /// `volume replicate`): no VM runs it here until `volume promote` (docs/replicas.md).
    #[arg(long, conflicts_with_all = ["nbd", "stop"])]
    pub replica: bool,
}

/// `volume replicate`.
#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("replicate_token").required(true).args(["token", "token_file"]))]
pub struct ReplicateArgs {
    /// The volume (name or UUID).
    pub id: String,
    /// The destination spoold's transfer listener, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub to: String,
    /// The token the destination's operator gave `volume receive NAME --token T
    /// --replica` there.
    #[arg(long, value_name = "TOKEN", conflicts_with = "token_file")]
    pub token: Option<String>,
    /// --token read from a file (its first line), or from standard input with `-`.
    #[arg(long, value_name = "PATH|-")]
    pub token_file: Option<std::path::PathBuf>,
    /// Print the progress every second until the replica is current.
    #[arg(long)]
    pub wait: bool,
}

/// `volume send`.
#[derive(clap::Args, Debug)]
pub struct SendArgs {
    /// The volume (name or UUID).
    pub id: String,
    /// The destination: nbd://HOST:PORT/NAME or nbd+unix:///NAME?socket=PATH; with
    /// --token, the destination spoold's transfer listener, HOST:PORT.
    #[arg(long, value_name = "NBD-URI|HOST:PORT", conflicts_with_all = ["cancel", "finish"])]
    pub to: Option<String>,
    /// The token the destination's operator gave `volume receive NAME --token` there: the
    /// destination then creates the volume as it is here and answers with its export.
    #[arg(
        long,
        value_name = "TOKEN",
        requires = "to",
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// --token read from a file (its first line), or from standard input with `-`: kept out
    /// of the process list, where other users of this host see --token.
    #[arg(long, value_name = "PATH|-", requires = "to")]
    pub token_file: Option<std::path::PathBuf>,
    /// Stop sending: the remote copy is dropped, the volume here is as it was.
    #[arg(long, conflicts_with = "finish")]
    pub cancel: bool,
    /// The VM has moved: delete the volume here (refused until the copy there is complete
    /// and while a VM still runs it here).
    #[arg(long)]
    pub finish: bool,
    /// Print the progress every second until the copy there is current.
    #[arg(long, conflicts_with_all = ["cancel", "finish"])]
    pub wait: bool,
}
