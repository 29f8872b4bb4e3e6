//! spoolctl: command-line client of spoold's JSON-RPC API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use spool_control::rpc::Client;
use spool_control::size::{format_size, parse_size};

/// Manage a running spoold: its pool, devices and volumes.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// spoold's RPC socket.
    #[arg(
        short,
        long,
        env = "SPOOL_SOCKET",
        default_value = "spool-state/spoold.sock"
    )]
    socket: PathBuf,
    /// Print the raw JSON result (for scripts).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
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
enum PoolCmd {
    /// Show the pool: size, free space, devices.
    Show,
}

#[derive(Subcommand)]
enum DeviceCmd {
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
    /// back online (their data that was on it is lost: there is no mirror yet).
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
    /// removed (ENODEV), errno (--errno), smart (--bits: SMART critical-warning byte).
    Inject {
        id: String,
        kind: String,
        /// read, write or any.
        #[arg(long, default_value = "any")]
        op: String,
        /// Device byte offset of the affected range (e.g. 1G).
        #[arg(long)]
        offset: Option<String>,
        /// Length of the range (default: the whole device).
        #[arg(long)]
        len: Option<String>,
        /// Operations to hit before disarming (0 = until cleared).
        #[arg(long)]
        count: Option<u64>,
        /// Disarm after this many milliseconds.
        #[arg(long)]
        duration_ms: Option<u64>,
        /// For kind errno: a number or a name (EIO, ENODATA, ...).
        #[arg(long)]
        errno: Option<String>,
        /// For kind smart: the critical-warning byte (1 spare, 2 temperature, 4 reliability,
        /// 8 read-only).
        #[arg(long)]
        bits: Option<u8>,
    },
    /// Armed fault-injection rules of a device.
    Faults { id: String },
    /// Disarm every injected fault of a device (and clear its simulated SMART warning).
    ClearFaults { id: String },
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// List volumes.
    List,
    /// Show one volume (by name or UUID).
    Show { id: String },
    /// Create a volume.
    Create {
        name: String,
        /// Capacity, e.g. 10G (a multiple of 512 bytes).
        size: String,
        #[arg(long)]
        read_only: bool,
        /// Number of virtqueues (1-64).
        #[arg(long, default_value_t = 2)]
        queues: u16,
    },
    /// Delete a volume (its data is lost).
    Delete {
        id: String,
        /// Disconnect a connected client first.
        #[arg(long)]
        force: bool,
    },
    /// Grow a volume to SIZE.
    Resize { id: String, size: String },
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s)
}

/// A device path as the daemon needs it: files absolute (the daemon has its own working
/// directory), `nvme:PCI-ADDRESS` as given.
fn device_path(p: &std::path::Path) -> Result<std::path::PathBuf, String> {
    if p.to_str().is_some_and(|s| s.starts_with("nvme:")) {
        return Ok(p.to_path_buf());
    }
    std::path::absolute(p).map_err(|e| e.to_string())
}

fn table(rows: Vec<Vec<String>>) -> String {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            r.iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn s(v: &Value, k: &str) -> String {
    match &v[k] {
        Value::String(x) => x.clone(),
        Value::Null => "-".into(),
        x => x.to_string(),
    }
}

fn sz(v: &Value, k: &str) -> String {
    v[k].as_u64().map(format_size).unwrap_or_else(|| "-".into())
}

fn volumes_table(vs: &[Value]) -> String {
    let mut rows = vec![
        ["NAME", "UUID", "SIZE", "QUEUES", "MODE", "STATE", "SOCKET"]
            .map(String::from)
            .to_vec(),
    ];
    for v in vs {
        rows.push(vec![
            s(v, "name"),
            s(v, "uuid"),
            sz(v, "size"),
            s(v, "num_queues"),
            if v["read_only"] == json!(true) {
                "ro".into()
            } else {
                "rw".into()
            },
            if v["online"] == json!(false) {
                "offline".into()
            } else if v["connected"] == json!(true) {
                "connected".into()
            } else {
                "ready".into()
            },
            s(v, "socket"),
        ]);
    }
    table(rows)
}

fn devices_table(ds: &[Value]) -> String {
    let mut rows = vec![["UUID", "PATH", "SIZE", "FREE", "DIRECT", "STATE"]
        .map(String::from)
        .to_vec()];
    for d in ds {
        rows.push(vec![
            s(d, "uuid"),
            s(d, "path"),
            sz(d, "size"),
            sz(d, "free"),
            if d["direct_io"] == json!(true) {
                "yes".into()
            } else {
                "no".into()
            },
            if d["present"] == json!(true) {
                "present".into()
            } else {
                "MISSING".into()
            },
        ]);
    }
    table(rows)
}

fn run(args: Args) -> Result<(), String> {
    let (method, params): (&str, Value) = match &args.cmd {
        Cmd::Pool { cmd: PoolCmd::Show } => ("pool_show", json!({})),
        Cmd::Device {
            cmd: DeviceCmd::List,
        } => ("device_list", json!({})),
        Cmd::Device {
            cmd:
                DeviceCmd::Add {
                    path,
                    create_size,
                    force,
                },
        } => {
            let path = device_path(path)?;
            let mut p = json!({"path": path, "force": force});
            if let Some(c) = create_size {
                p["create_size"] = json!(size(c)?);
            }
            ("device_add", p)
        }
        Cmd::Device {
            cmd: DeviceCmd::Health { id },
        } => ("device_health", json!({"id": id})),
        Cmd::Device {
            cmd: DeviceCmd::Reset { id },
        } => ("device_reset", json!({"id": id})),
        Cmd::Device {
            cmd: DeviceCmd::Faults { id },
        } => ("device_faults", json!({"id": id})),
        Cmd::Device {
            cmd: DeviceCmd::ClearFaults { id },
        } => ("device_clear_faults", json!({"id": id})),
        Cmd::Device {
            cmd:
                DeviceCmd::Replace {
                    old,
                    new,
                    create_size,
                    force,
                },
        } => {
            let new = device_path(new)?;
            let mut p = json!({"old": old, "new": new, "force": force});
            if let Some(c) = create_size {
                p["create_size"] = json!(size(c)?);
            }
            ("device_replace", p)
        }
        Cmd::Device {
            cmd:
                DeviceCmd::Inject {
                    id,
                    kind,
                    op,
                    offset,
                    len,
                    count,
                    duration_ms,
                    errno,
                    bits,
                },
        } => {
            let mut p = json!({"id": id, "kind": kind, "op": op});
            if let Some(o) = offset {
                p["offset"] = json!(size(o)?);
            }
            if let Some(l) = len {
                p["len"] = json!(size(l)?);
            }
            if let Some(c) = count {
                p["count"] = json!(c);
            }
            if let Some(d) = duration_ms {
                p["duration_ms"] = json!(d);
            }
            if let Some(e) = errno {
                p["errno"] = match e.parse::<i64>() {
                    Ok(n) => json!(n),
                    Err(_) => json!(e),
                };
            }
            if let Some(b) = bits {
                p["bits"] = json!(b);
            }
            ("device_inject", p)
        }
        Cmd::Events { since, follow } => return follow_events(&args, *since, *follow),
        Cmd::Volume {
            cmd: VolumeCmd::List,
        } => ("volume_list", json!({})),
        Cmd::Volume {
            cmd: VolumeCmd::Show { id },
        } => ("volume_show", json!({"id": id})),
        Cmd::Volume {
            cmd:
                VolumeCmd::Create {
                    name,
                    size: sz,
                    read_only,
                    queues,
                },
        } => (
            "volume_create",
            json!({"name": name, "size": size(sz)?, "read_only": read_only, "num_queues": queues}),
        ),
        Cmd::Volume {
            cmd: VolumeCmd::Delete { id, force },
        } => ("volume_delete", json!({"id": id, "force": force})),
        Cmd::Volume {
            cmd: VolumeCmd::Resize { id, size: sz },
        } => ("volume_resize", json!({"id": id, "size": size(sz)?})),
        Cmd::Status => ("daemon_status", json!({})),
        Cmd::Upgrade { binary } => {
            let mut p = json!({});
            if let Some(b) = binary {
                p["binary"] = json!(std::path::absolute(b).map_err(|e| e.to_string())?);
            }
            ("daemon_upgrade", p)
        }
        Cmd::Rpc { method, params } => {
            let p = match params {
                Some(t) => {
                    serde_json::from_str(t).map_err(|e| format!("params are not JSON: {e}"))?
                }
                None => json!({}),
            };
            (method.as_str(), p)
        }
    };
    let mut c = Client::connect(&args.socket)?;
    let r = c.call(method, params).map_err(|e| e.message)?;
    if args.json || matches!(args.cmd, Cmd::Rpc { .. }) {
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
        return Ok(());
    }
    match &args.cmd {
        Cmd::Pool { .. } => {
            println!(
                "pool {} ({})  generation {}  size {}  free {}  min extent {}  volumes {}",
                s(&r, "name"),
                s(&r, "uuid"),
                s(&r, "generation"),
                sz(&r, "size"),
                sz(&r, "free"),
                sz(&r, "min_extent"),
                s(&r, "volumes")
            );
            println!(
                "{}",
                devices_table(r["devices"].as_array().map(Vec::as_slice).unwrap_or(&[]))
            );
        }
        Cmd::Device {
            cmd: DeviceCmd::List,
        } => {
            println!(
                "{}",
                devices_table(r.as_array().map(Vec::as_slice).unwrap_or(&[]))
            )
        }
        Cmd::Device {
            cmd: DeviceCmd::Health { .. },
        } => println!(
            "{}",
            health_table(r.as_array().map(Vec::as_slice).unwrap_or(&[]))
        ),
        Cmd::Device {
            cmd: DeviceCmd::Reset { .. },
        } => println!(
            "device {} resetting; volumes resubmitting in-flight I/O: {}",
            s(&r, "device"),
            s(&r, "volumes")
        ),
        Cmd::Device {
            cmd: DeviceCmd::Replace { .. },
        } => println!(
            "device {} replaced by {} ({}): {} extents of volumes {} moved; their data that was on the old device is lost",
            s(&r, "old"),
            s(&r["new"], "uuid"),
            s(&r["new"], "path"),
            s(&r, "extents"),
            s(&r, "volumes")
        ),
        Cmd::Device {
            cmd: DeviceCmd::Inject { .. },
        } => println!(
            "device {}: injected {}",
            s(&r, "device"),
            if r["rule"].is_null() {
                format!("SMART critical warning {}", s(&r, "smart_critical_warning"))
            } else {
                r["rule"].to_string()
            }
        ),
        Cmd::Device {
            cmd: DeviceCmd::Faults { .. },
        } => {
            println!(
                "device {}  SMART critical warning {}",
                s(&r, "device"),
                s(&r, "smart_critical_warning")
            );
            for rule in r["rules"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                println!("  {rule}");
            }
        }
        Cmd::Device {
            cmd: DeviceCmd::ClearFaults { .. },
        } => println!("device {}: {} rules cleared", s(&r, "device"), s(&r, "cleared")),
        Cmd::Device { .. } => println!("{}", devices_table(&[r])),
        Cmd::Volume {
            cmd: VolumeCmd::List,
        } => {
            println!(
                "{}",
                volumes_table(r.as_array().map(Vec::as_slice).unwrap_or(&[]))
            )
        }
        Cmd::Volume {
            cmd: VolumeCmd::Delete { .. },
        } => println!("deleted volume {} ({})", s(&r, "name"), s(&r, "uuid")),
        Cmd::Volume { .. } => println!("{}", volumes_table(&[r])),
        Cmd::Status => {
            println!(
                "spoold {}  worker pid {}  binary {}",
                s(&r, "version"),
                s(&r, "pid"),
                s(&r, "binary")
            );
            match r.get("keeper").filter(|k| !k.is_null()) {
                Some(k) => println!(
                    "keeper pid {}  worker generation {}  started by {}",
                    s(k, "pid"),
                    s(k, "generation"),
                    s(k, "start_reason")
                ),
                None => println!("no keeper (--no-keeper): restarts make VMs reconnect"),
            }
            if let Some(l) = r.get("last_restart").filter(|l| !l.is_null()) {
                print_restart(l);
            }
            if let Some(f) = r["first_io_after_restart_ms"].as_f64() {
                println!("first I/O served {f:.2} ms after the restart began");
            }
        }
        Cmd::Upgrade { .. } => print_restart(&r),
        Cmd::Rpc { .. } | Cmd::Events { .. } => {}
    }
    Ok(())
}

fn health_table(ds: &[Value]) -> String {
    let mut rows = vec![[
        "DEVICE", "PATH", "STATE", "MEDIA", "PATH-ERR", "TIMEOUTS", "RESETS", "SMART", "REASON",
    ]
    .map(String::from)
    .to_vec()];
    for d in ds {
        let c = &d["counters"];
        rows.push(vec![
            s(d, "device"),
            s(d, "path"),
            s(d, "state").to_uppercase(),
            s(c, "media_errors"),
            s(c, "path_errors"),
            s(c, "timeouts"),
            s(c, "resets"),
            format!(
                "0x{:02x}",
                d["smart_critical_warning"].as_u64().unwrap_or(0)
            ),
            s(d, "reason"),
        ]);
    }
    let mut out = table(rows);
    for d in ds.iter().filter(|d| d["nvme"].is_object()) {
        let n = &d["nvme"];
        out.push_str(&format!(
            "\n{} NVMe {} {} (sn {}, fw {}, v{}): {} x {} B, {} I/O queues, max transfer {} KiB\n  controller resets by this worker {}{}; requests zero-copy {} (SGL {}), bounced {}; flush {}, deallocate {}, write-zeroes {}{}",
            s(d, "path"),
            s(n, "pci"),
            s(n, "model"),
            s(n, "serial"),
            s(n, "firmware"),
            s(n, "version"),
            s(n, "blocks"),
            s(n, "lba_size"),
            s(n, "io_queues"),
            n["max_transfer"].as_u64().unwrap_or(0) / 1024,
            s(n, "resets"),
            if n["attached"].as_bool() == Some(true) { " (taken over live from the previous worker)" } else { "" },
            s(n, "zero_copy_requests"),
            s(n, "sgl_requests"),
            s(n, "bounced_requests"),
            s(n, "flush_commands"),
            s(n, "deallocate_commands"),
            s(n, "write_zeroes_commands"),
            match n["smart"].as_object() {
                Some(m) => format!(
                    "\n  SMART: critical warning 0x{:02x}, {} K, spare {}%, used {}%, media errors {}, error log entries {}",
                    m["critical_warning"].as_u64().unwrap_or(0),
                    m["temperature_k"],
                    m["available_spare_pct"],
                    m["percentage_used"],
                    m["media_errors"],
                    m["error_log_entries"]
                ),
                None => String::new(),
            }
        ));
        for e in n["error_log"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "\n  error log #{}: queue {} command {} status {} LBA {}",
                s(e, "error_count"),
                s(e, "sqid"),
                s(e, "cid"),
                s(e, "status"),
                s(e, "lba")
            ));
        }
    }
    out
}

fn print_event(e: &Value) {
    let secs = e["time_ms"].as_u64().unwrap_or(0) as f64 / 1e3;
    let change = match (e["from"].as_str(), e["to"].as_str()) {
        (Some(f), Some(t)) => format!("{f} -> {t}"),
        (None, Some(t)) => format!("-> {t}"),
        _ => s(e, "kind"),
    };
    println!(
        "#{:<5} {secs:.3}  {}  {}  {change}: {}",
        s(e, "seq"),
        s(e, "device"),
        s(e, "path"),
        s(e, "reason")
    );
}

fn follow_events(args: &Args, mut since: u64, follow: bool) -> Result<(), String> {
    let mut c = Client::connect(&args.socket)?;
    loop {
        let wait = if follow { 10_000 } else { 0 };
        let r = c
            .call("events_list", json!({"since": since, "wait_ms": wait}))
            .map_err(|e| e.message)?;
        for e in r["events"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            if args.json {
                println!("{e}");
            } else {
                print_event(e);
            }
            since = since.max(e["seq"].as_u64().unwrap_or(0));
        }
        if !follow {
            return Ok(());
        }
    }
}

fn print_restart(r: &Value) {
    println!(
        "last {}: pid {} -> {}  stall {:.2} ms  outcome: {}",
        s(r, "kind"),
        s(r, "old_pid"),
        s(r, "new_pid"),
        r["stall_ms"].as_f64().unwrap_or(0.0),
        s(r, "outcome")
    );
    for p in r["phases"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        println!(
            "  {:<36} {:>8.2} ms",
            s(p, "name"),
            p["ms"].as_f64().unwrap_or(0.0)
        );
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spoolctl: error: {e}");
            ExitCode::FAILURE
        }
    }
}
