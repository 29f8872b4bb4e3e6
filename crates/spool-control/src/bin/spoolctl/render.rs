//! One renderer per subcommand: the typed result as tables and lines for people (`--json`
//! prints the raw result instead, before any of this).

use std::fmt::Display;

use serde::Serialize;
use serde_json::Value;
use spool_api::restart::RestartReport;
use spool_api::size::format_size;
use spool_api::{self as api, DeviceHealthReport, DeviceInfo, HealthEvent, Method, Volume};

use super::args::{Cmd, DeviceCmd, PoolCmd, VolumeCmd};
use super::table::{header, table};
use super::CtlError;

/// Decodes `r` as the result of `M` and renders it with `f`.
fn show<M: Method>(r: Value, f: fn(&M::Result)) -> Result<(), CtlError> {
    let r: M::Result = serde_json::from_value(r).map_err(CtlError::Decode)?;
    f(&r);
    Ok(())
}

/// Renders the result of `cmd`.
pub fn render(cmd: &Cmd, r: Value) -> Result<(), CtlError> {
    match cmd {
        Cmd::Pool {
            cmd: PoolCmd::Check,
        } => {
            let r: api::CheckReport = serde_json::from_value(r).map_err(CtlError::Decode)?;
            check(&r);
            check_verdict(&r)
        }
        Cmd::Pool { .. } => show::<api::PoolShow>(r, pool),
        Cmd::Device { cmd } => match cmd {
            DeviceCmd::List => show::<api::DeviceList>(r, |d| println!("{}", devices_table(d))),
            DeviceCmd::Add { .. } => show::<api::DeviceAdd>(r, |d| {
                println!("{}", devices_table(std::slice::from_ref(d)))
            }),
            DeviceCmd::Health { .. } => {
                show::<api::DeviceHealth>(r, |h| println!("{}", health_table(h)))
            }
            DeviceCmd::Reset { .. } => show::<api::DeviceReset>(r, device_reset),
            DeviceCmd::Replace { .. } => show::<api::DeviceReplace>(r, device_replace),
            DeviceCmd::Inject(_) => show::<api::DeviceInject>(r, device_inject),
            DeviceCmd::Faults { .. } => show::<api::DeviceFaults>(r, device_faults),
            DeviceCmd::ClearFaults { .. } => show::<api::DeviceClearFaults>(r, |c| {
                println!("device {}: {} rules cleared", c.device, c.cleared)
            }),
        },
        Cmd::Volume { cmd } => match cmd {
            VolumeCmd::List => show::<api::VolumeList>(r, |v| println!("{}", volumes_table(v))),
            VolumeCmd::Delete { .. } => {
                show::<api::VolumeDelete>(r, |v| println!("deleted volume {} ({})", v.name, v.uuid))
            }
            VolumeCmd::Snapshot { .. } => show::<api::VolumeSnapshot>(r, super::snapshot::taken),
            VolumeCmd::Snapshots { .. } => {
                show::<api::VolumeSnapshots>(r, |s| super::snapshot::list(s))
            }
            VolumeCmd::Diff { .. } => show::<api::VolumeDiff>(r, super::snapshot::diff),
            VolumeCmd::Revert { .. } => show::<api::VolumeRevert>(r, |c| {
                println!(
                    "volume {} holds its snapshot's data again ({} chunk entries changed)",
                    c.volume, c.chunks
                )
            }),
            VolumeCmd::Inflate { .. } => show::<api::VolumeInflate>(r, |c| {
                println!(
                    "volume {}: {} shared chunks copied; it depends on no snapshot now",
                    c.volume, c.chunks
                )
            }),
            VolumeCmd::Export { .. } => show::<api::SnapshotExport>(r, super::snapshot::exported),
            VolumeCmd::Unexport { .. } => show::<api::SnapshotUnexport>(r, |e| {
                println!("stopped serving {}@{} on {}", e.volume, e.snapshot, e.nbd)
            }),
            VolumeCmd::Receive(a) => receive(a.stop, r),
            VolumeCmd::Send(_) | VolumeCmd::Replicate(_) => {
                show::<api::VolumeSend>(r, |s| println!("{}", super::send::line(s)))
            }
            VolumeCmd::Promote { .. } => show::<api::VolumePromote>(r, volume),
            VolumeCmd::Show { .. }
            | VolumeCmd::Clone { .. }
            | VolumeCmd::Create { .. }
            | VolumeCmd::Resize { .. }
            | VolumeCmd::Qos(_)
            | VolumeCmd::Mirror { .. } => show::<api::VolumeShow>(r, volume),
            VolumeCmd::Rekey { .. } => show::<api::VolumeRekey>(r, |k| {
                println!(
                    "{} data keys rewrapped under key-encryption key {} (was {}); make the config give that key from now on",
                    k.rewrapped, k.kek_id, k.old_kek_id
                )
            }),
            VolumeCmd::Verify { .. } => show::<api::VolumeVerify>(r, super::mirror::verify),
            VolumeCmd::Stats { .. } => {
                show::<api::VolumeStatsGet>(r, |v| println!("{}", super::stats::totals(v)))
            }
        },
        Cmd::Snapshot { .. } => show::<api::SnapshotDelete>(r, super::snapshot::deleted),
        Cmd::Status => show::<api::DaemonStatus>(r, status),
        Cmd::Upgrade { .. } => show::<api::DaemonUpgrade>(r, print_restart),
        Cmd::Rpc { .. } | Cmd::Events { .. } => Ok(()),
    }
}

/// A value as the tables show it: `-` when absent.
fn opt<T: Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".into(), T::to_string)
}

/// A value as compact JSON with sorted keys (how lists and rules are shown).
fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v).map_or_else(|_| "-".into(), |v| v.to_string())
}

fn pool(p: &api::PoolInfo) {
    println!(
        "pool {} ({})  generation {}  size {}  free {}  min extent {}  volumes {}",
        p.name,
        p.uuid,
        p.generation,
        format_size(p.size),
        format_size(p.free),
        format_size(p.min_extent),
        p.volumes
    );
    if p.thin_provisioned > 0 {
        let over = p.thin_provisioned as f64 / p.size.max(1) as f64;
        println!(
            "thin volumes: {} provisioned ({:.0}% of the pool), {} in chunks ({} shared with snapshots or clones){}",
            format_size(p.thin_provisioned),
            over * 100.0,
            format_size(p.thin_mapped),
            format_size(p.thin_shared),
            if p.thin_provisioned > p.size {
                "  (over-committed: writes wait, then fail, when the pool fills)"
            } else {
                ""
            }
        );
    }
    println!("{}", devices_table(&p.devices));
}

fn devices_table(ds: &[DeviceInfo]) -> String {
    let mut rows = vec![header(&["UUID", "PATH", "SIZE", "FREE", "DIRECT", "STATE"])];
    for d in ds {
        rows.push(vec![
            d.uuid.to_string(),
            d.path.clone(),
            format_size(d.size),
            format_size(d.free),
            if d.direct_io { "yes" } else { "no" }.into(),
            if d.present { "present" } else { "MISSING" }.into(),
        ]);
    }
    table(rows)
}

fn volumes_table(vs: &[Volume]) -> String {
    let mut rows = vec![header(&[
        "NAME", "UUID", "SIZE", "QUEUES", "MODE", "STATE", "SOCKET",
    ])];
    for v in vs {
        let i = &v.info;
        rows.push(vec![
            i.name.clone(),
            i.uuid.to_string(),
            format_size(i.size),
            i.num_queues.to_string(),
            if i.read_only { "ro" } else { "rw" }.into(),
            if !i.online {
                "offline"
            } else if v.connected {
                "connected"
            } else if v.socket.is_none() {
                "not-served"
            } else {
                "ready"
            }
            .into(),
            opt(&v.socket),
        ]);
    }
    table(rows)
}

/// One volume: its table row, its I/O limits, its mirror and where its data lies.
fn volume(v: &Volume) {
    println!("{}", volumes_table(std::slice::from_ref(v)));
    println!(
        "I/O limits: {}",
        spool_api::qos::describe(v.info.qos.as_ref())
    );
    if v.info.encrypted {
        println!(
            "encryption: {} (its own data key, wrapped under key-encryption key {})",
            spool_api::CIPHER,
            v.info.kek_id.as_deref().unwrap_or("?")
        );
    }
    if let Some(t) = &v.info.thin {
        println!(
            "thin: {} of {} backed by chunks of {} (map {}, grows up to {}){}",
            format_size(t.mapped),
            format_size(v.info.size),
            format_size(t.chunk),
            format_size(t.map_bytes),
            format_size(t.max_size),
            match t.waiting_for_space {
                0 => String::new(),
                n => format!("; {n} writes waiting for free space (the pool is full)"),
            }
        );
    }
    if let Some(why) = &v.not_served {
        println!("not served: {why}");
    }
    match (&v.info.replica_of, v.info.epoch) {
        (Some(p), e) => println!(
            "replica of {} on {p} (epoch {e}, {}): VMs connecting here wait until `volume promote {}`",
            v.info.name,
            match v.info.replica_complete {
                true => "complete",
                false => "not complete yet: its primary's copy was never current",
            },
            v.info.name
        ),
        (None, 0) => {}
        (None, e) => println!("epoch {e} (promoted here from a replica)"),
    }
    if let Some(r) = &v.receiving {
        match &r.ended {
            None => println!(
                "receiving over NBD: {} ({} written)",
                r.uri,
                format_size(r.written)
            ),
            Some(why) => println!(
                "received over NBD until {why} ({} written); `volume receive {} --stop` closes {}",
                format_size(r.written),
                r.volume,
                r.nbd
            ),
        }
    }
    if let Some(s) = &v.sending {
        println!("{}", super::send::line(s));
    }
    if let Some(m) = &v.mirror {
        super::mirror::status(m);
    }
    if !v.info.extent_map.is_empty() {
        let mut rows = vec![header(&["COPY", "AT", "DEVICE", "OFFSET", "LEN"])];
        rows.extend(v.info.extent_map.iter().map(|e| {
            vec![
                e.copy.to_string(),
                format_size(e.volume_offset),
                e.device.to_string(),
                e.offset.to_string(),
                format_size(e.len),
            ]
        }));
        println!("extents:\n{}", table(rows));
    }
}

fn device_reset(r: &api::DeviceResetResult) {
    println!(
        "device {} resetting; volumes resubmitting in-flight I/O: {}",
        r.device,
        json(&r.volumes)
    );
}

fn device_replace(r: &api::Replacement) {
    println!(
        "device {} replaced by {} ({}): {} extents of volumes {} moved; their data that was on the old device is lost",
        r.old,
        r.new.uuid,
        r.new.path,
        r.extents,
        json(&r.volumes)
    );
}

fn device_inject(r: &api::InjectResult) {
    let what = match &r.rule {
        None => format!("SMART critical warning {}", opt(&r.smart_critical_warning)),
        Some(rule) => json(rule),
    };
    println!("device {}: injected {what}", r.device);
}

fn device_faults(r: &api::FaultsResult) {
    println!(
        "device {}  SMART critical warning {}",
        r.device, r.smart_critical_warning
    );
    for rule in &r.rules {
        println!("  {}", json(rule));
    }
}

fn health_table(ds: &[DeviceHealthReport]) -> String {
    let mut rows = vec![header(&[
        "DEVICE", "PATH", "STATE", "MEDIA", "PATH-ERR", "TIMEOUTS", "RESETS", "SMART", "REASON",
    ])];
    for d in ds {
        let c = &d.counters;
        rows.push(vec![
            d.device.to_string(),
            d.path.clone(),
            d.state.to_uppercase(),
            c.media_errors.to_string(),
            c.path_errors.to_string(),
            c.timeouts.to_string(),
            c.resets.to_string(),
            format!("0x{:02x}", d.smart_critical_warning),
            d.reason.clone(),
        ]);
    }
    let mut out = table(rows);
    for d in ds {
        if let Some(n) = &d.nvme {
            out.push_str(&nvme_lines(&d.path, n));
        }
    }
    out
}

/// The NVMe controller under a device of the health table.
fn nvme_lines(path: &str, n: &api::NvmeHealth) -> String {
    let mut out = format!(
        "\n{path} NVMe {} {} (sn {}, fw {}, v{}): {} x {} B, {} I/O queues, max transfer {} KiB\n  controller resets by this worker {}{}; requests zero-copy {} (SGL {}), bounced {}; flush {}, deallocate {}, write-zeroes {}",
        n.pci,
        n.model,
        n.serial,
        n.firmware,
        n.version,
        n.blocks,
        n.lba_size,
        n.io_queues,
        n.max_transfer / 1024,
        n.resets,
        if n.attached { " (taken over live from the previous worker)" } else { "" },
        n.zero_copy_requests,
        n.sgl_requests,
        n.bounced_requests,
        n.flush_commands,
        n.deallocate_commands,
        n.write_zeroes_commands,
    );
    if let Some(m) = &n.smart {
        out.push_str(&format!(
            "\n  SMART: critical warning 0x{:02x}, {} K, spare {}%, used {}%, media errors {}, error log entries {}",
            m.critical_warning,
            m.temperature_k,
            m.available_spare_pct,
            m.percentage_used,
            m.media_errors,
            m.error_log_entries
        ));
    }
    for e in &n.error_log {
        out.push_str(&format!(
            "\n  error log #{}: queue {} command {} status {} LBA {}",
            e.error_count, e.sqid, e.cid, e.status, e.lba
        ));
    }
    out
}

/// One event of `spoolctl events`.
pub fn print_event(e: &HealthEvent) {
    let secs = e.time_ms as f64 / 1e3;
    let change = match (&e.from, &e.to) {
        (Some(f), Some(t)) => format!("{f} -> {t}"),
        (None, Some(t)) => format!("-> {t}"),
        _ => serde_json::to_value(e.kind)
            .ok()
            .and_then(|k| k.as_str().map(str::to_string))
            .unwrap_or_default(),
    };
    println!(
        "#{:<5} {secs:.3}  {}  {}  {change}: {}",
        e.seq.to_string(),
        e.device,
        e.path,
        e.reason
    );
}

fn status(r: &api::Status) {
    println!(
        "spoold {}  worker pid {}  binary {}",
        r.version,
        r.pid,
        opt(&r.binary)
    );
    match &r.keeper {
        Some(k) => println!(
            "keeper pid {}  worker generation {}  started by {}",
            k.pid, k.generation, k.start_reason
        ),
        None => println!("no keeper (--no-keeper): restarts make VMs reconnect"),
    }
    if let Some(l) = &r.last_restart {
        print_restart(l);
    }
    if let Some(f) = r.first_io_after_restart_ms {
        println!("first I/O served {f:.2} ms after the restart began");
    }
}

fn print_restart(r: &RestartReport) {
    println!(
        "last {}: pid {} -> {}  stall {:.2} ms  outcome: {}",
        r.kind, r.old_pid, r.new_pid, r.stall_ms, r.outcome
    );
    for p in &r.phases {
        println!("  {:<36} {:>8.2} ms", p.name, p.ms);
    }
}

/// `pool check`: what was read, then every problem and what was skipped.
fn check(r: &api::CheckReport) {
    println!(
        "checked {} volumes: {} of extents, {} thin maps naming {} chunks ({} shared by more than one map)",
        r.volumes,
        format_size(r.extent_bytes),
        r.maps,
        r.chunks,
        r.shared_chunks
    );
    for s in &r.skipped {
        println!("not checked: {s}");
    }
    for p in &r.problems {
        println!("problem: {p}");
    }
    if r.problems.is_empty() {
        println!("no problems found");
    }
}

/// Fails (exit status 1) when `pool check` found a problem.
pub fn check_verdict(r: &api::CheckReport) -> Result<(), CtlError> {
    match r.problems.len() {
        0 => Ok(()),
        n => Err(CtlError::Found(format!(
            "pool check found {n} problem{} ({} leaked); see docs/pool-check.md",
            if n == 1 { "" } else { "s" },
            format_size(r.leaked_bytes)
        ))),
    }
}

/// `volume receive` (started, or with --stop ended).
fn receive(stop: bool, r: Value) -> Result<(), CtlError> {
    if stop {
        return show::<api::VolumeReceiveStop>(r, |e| {
            println!(
                "volume {} no longer received on {}: {} written",
                e.volume,
                e.nbd,
                format_size(e.written)
            )
        });
    }
    show::<api::VolumeReceive>(r, |e| {
        if e.expecting {
            return println!(
                "expecting volume {} on the transfer listener {}: on the sending host, `spoolctl volume send {} --to {} --token TOKEN` with the same token",
                e.volume, e.nbd, e.volume, e.nbd
            );
        }
        println!(
            "receiving volume {} ({}) over NBD: {}\nwrite it with: qemu-img convert -n -O raw IMAGE '{}' (or nbdcopy IMAGE '{}')",
            e.volume,
            format_size(e.size),
            e.uri,
            e.uri,
            e.uri
        )
    })
}
