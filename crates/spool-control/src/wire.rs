//! The lower layers' reports as the control API's wire types (`spool_api`): the pool's
//! devices, volumes, snapshots and check, the monitor's health and events, the devices'
//! fault rules and NVMe status, the mirror's progress, the frontend's counters and the
//! keeper's restart reports.
//!
//! Owns: every conversion into the wire, so that the wire crate knows none of those layers
//! and each of them can change without changing what spoolctl reads. Must not know: RPC
//! framing, rendering.

use spool_frontend::stats::{OpTotals, VolumeStatsSnapshot};
use uuid::Uuid;

use crate::api::restart::{KindHistory, Phase, RestartReport};
use crate::api::stats::quantile_us;
use crate::api::*;

/// A lower layer's report as its wire type.
pub trait ToWire<T> {
    fn wire(self) -> T;
}

impl ToWire<Priority> for spool_pool::Priority {
    fn wire(self) -> Priority {
        match self {
            spool_pool::Priority::Normal => Priority::Normal,
            spool_pool::Priority::Latency => Priority::Latency,
            spool_pool::Priority::Batch => Priority::Batch,
        }
    }
}

/// The pool's priority from the wire's.
pub fn priority_from_wire(p: Priority) -> spool_pool::Priority {
    match p {
        Priority::Normal => spool_pool::Priority::Normal,
        Priority::Latency => spool_pool::Priority::Latency,
        Priority::Batch => spool_pool::Priority::Batch,
    }
}

impl ToWire<Phase> for spool_keeper::Phase {
    fn wire(self) -> Phase {
        Phase {
            name: self.name,
            ms: self.ms,
        }
    }
}

impl ToWire<RestartReport> for spool_keeper::RestartReport {
    fn wire(self) -> RestartReport {
        RestartReport {
            kind: self.kind,
            old_pid: self.old_pid,
            new_pid: self.new_pid,
            binary: self.binary,
            began_us: self.began_us,
            phases: self.phases.into_iter().map(ToWire::wire).collect(),
            stall_ms: self.stall_ms,
            outcome: self.outcome,
            counts: self.counts,
            history: self
                .history
                .into_iter()
                .map(|(kind, h)| {
                    let h = KindHistory {
                        stall_buckets: h.stall_buckets,
                        stall_sum_ms: h.stall_sum_ms,
                        phase_sum_ms: h.phase_sum_ms,
                    };
                    (kind, h)
                })
                .collect(),
        }
    }
}

impl ToWire<StateFormat> for crate::kept::StateFormat {
    fn wire(self) -> StateFormat {
        StateFormat {
            session: self.session,
        }
    }
}

impl ToWire<DeviceInfo> for spool_pool::DeviceInfo {
    fn wire(self) -> DeviceInfo {
        let d = self;
        DeviceInfo {
            uuid: d.uuid,
            path: d.path,
            size: d.size,
            free: d.free,
            present: d.present,
            direct_io: d.direct_io,
        }
    }
}

impl ToWire<PoolInfo> for spool_pool::PoolInfo {
    fn wire(self) -> PoolInfo {
        let p = self;
        PoolInfo {
            name: p.name,
            uuid: p.uuid,
            generation: p.generation,
            min_extent: p.min_extent,
            size: p.size,
            free: p.free,
            devices: p.devices.into_iter().map(ToWire::wire).collect(),
            volumes: p.volumes,
            left_out: p
                .left_out
                .into_iter()
                .map(|l| LeftOut {
                    path: l.path,
                    reason: l.reason,
                })
                .collect(),
            thin_provisioned: p.thin_provisioned,
            thin_mapped: p.thin_mapped,
            thin_shared: p.thin_shared,
        }
    }
}

impl ToWire<QosLimits> for spool_pool::QosLimits {
    fn wire(self) -> QosLimits {
        let q = self;
        QosLimits {
            iops: q.iops,
            read_iops: q.read_iops,
            write_iops: q.write_iops,
            bps: q.bps,
            read_bps: q.read_bps,
            write_bps: q.write_bps,
            burst_ms: q.burst_ms,
            weight: q.weight,
            priority: q.priority.wire(),
        }
    }
}

/// The pool's limits from the wire's.
pub fn qos_from_wire(q: QosLimits) -> spool_pool::QosLimits {
    spool_pool::QosLimits {
        iops: q.iops,
        read_iops: q.read_iops,
        write_iops: q.write_iops,
        bps: q.bps,
        read_bps: q.read_bps,
        write_bps: q.write_bps,
        burst_ms: q.burst_ms,
        weight: q.weight,
        priority: priority_from_wire(q.priority),
    }
}

impl ToWire<VolumeInfo> for spool_pool::VolumeInfo {
    fn wire(self) -> VolumeInfo {
        let v = self;
        VolumeInfo {
            uuid: v.uuid,
            name: v.name,
            size: v.size,
            allocated: v.allocated,
            read_only: v.read_only,
            num_queues: v.num_queues,
            extents: v.extents,
            devices: v.devices,
            online: v.online,
            qos: v.qos.map(ToWire::wire),
            rbd: v.rbd,
            extent_map: v
                .extent_map
                .into_iter()
                .map(|e| ExtentInfo {
                    copy: e.copy,
                    volume_offset: e.volume_offset,
                    device: e.device,
                    offset: e.offset,
                    len: e.len,
                })
                .collect(),
            encrypted: v.encrypted,
            kek_id: v.kek_id,
            thin: v.thin.map(ToWire::wire),
            replica_complete: v.replica.as_ref().is_some_and(|r| r.complete),
            replica_of: v.replica.map(|r| r.primary),
            epoch: v.epoch,
        }
    }
}

impl ToWire<Replacement> for spool_pool::Replacement {
    fn wire(self) -> Replacement {
        let r = self;
        Replacement {
            old: r.old,
            new: r.new.wire(),
            volumes: r.volumes,
            extents: r.extents,
        }
    }
}

/// The monitor's report of a device, with its NVMe controller's status if it has one.
pub fn health_report(
    r: spool_health::DeviceReport,
    nvme: Option<spool_devices::ControllerStatus>,
) -> DeviceHealthReport {
    let c = r.counters;
    DeviceHealthReport {
        device: r.device,
        path: r.path,
        state: r.state.to_string(),
        reason: r.reason,
        epoch: r.epoch,
        counters: Counters {
            media_errors: c.media_errors,
            path_errors: c.path_errors,
            timeouts: c.timeouts,
            gone_errors: c.gone_errors,
            request_errors: c.request_errors,
            dropped_reports: c.dropped_reports,
            resets: c.resets,
            failed_probes: c.failed_probes,
        },
        last_error: r.last_error,
        smart_critical_warning: r.smart_critical_warning,
        injected_faults: r.injected_faults,
        injected_hits: r.injected_hits,
        since_s: r.since_s,
        nvme: nvme.map(ToWire::wire),
    }
}

impl ToWire<NvmeHealth> for spool_devices::ControllerStatus {
    fn wire(self) -> NvmeHealth {
        let n = self;
        NvmeHealth {
            pci: n.pci,
            model: n.model,
            serial: n.serial,
            firmware: n.firmware,
            version: n.version,
            lba_size: n.lba_size,
            blocks: n.blocks,
            io_queues: n.io_queues,
            max_transfer: n.max_transfer,
            resets: n.resets,
            attached: n.attached,
            zero_copy_requests: n.zero_copy_requests,
            bounced_requests: n.bounced_requests,
            sgl: n.sgl,
            sgl_requests: n.sgl_requests,
            flush_commands: n.flush_commands,
            deallocate_commands: n.deallocate_commands,
            write_zeroes_commands: n.write_zeroes_commands,
            gone: n.gone,
            error_log: n
                .error_log
                .iter()
                .map(|e| NvmeErrorEntry {
                    error_count: e.error_count,
                    sqid: e.sqid,
                    cid: e.cid,
                    status: e.status.to_string(),
                    lba: e.lba,
                    nsid: e.nsid,
                })
                .collect(),
            smart: n.smart.map(|s| NvmeSmart {
                critical_warning: s.critical_warning,
                temperature_k: s.temperature,
                available_spare_pct: s.available_spare,
                percentage_used: s.percentage_used,
                media_errors: s.media_errors,
                error_log_entries: s.error_log_entries,
            }),
        }
    }
}

/// The monitor's event; `None` for a kind this layer does not know.
pub fn health_event(e: &spool_health::Event) -> Option<HealthEvent> {
    Some(HealthEvent {
        seq: e.seq,
        time_ms: e.time_ms,
        device: e.device,
        path: e.path.clone(),
        kind: HealthEventKind::parse(&e.kind)?,
        from: e.from.map(str::to_string),
        to: e.to.map(str::to_string),
        reason: e.reason.clone(),
    })
}

pub fn fault_rule(
    id: u64,
    r: &spool_devices::FaultRule,
    hits: u64,
    remaining: Option<u64>,
) -> FaultRuleInfo {
    use spool_devices::{FaultEffect, FaultOps};
    FaultRuleInfo {
        id,
        effect: match r.effect {
            FaultEffect::Errno(e) => {
                format!("errno {e} ({})", std::io::Error::from_raw_os_error(e))
            }
            FaultEffect::Hang => "hang".into(),
            FaultEffect::Stuck => "stuck".into(),
            FaultEffect::Crash => "crash".into(),
            FaultEffect::PanicOnReset => "panic on reset".into(),
            FaultEffect::WedgeOnReset => "wedge on reset".into(),
        },
        op: match r.ops {
            FaultOps::Read => "read",
            FaultOps::Write => "write",
            FaultOps::Any => "any",
            FaultOps::MetaRead => "meta-read",
            FaultOps::MetaWrite => "meta-write",
            FaultOps::MetaZero => "meta-zero",
            FaultOps::Meta => "meta",
        }
        .into(),
        offset: r.offset,
        len: r.len,
        count: r.count,
        remaining,
        duration_ms: r.duration.map(|d| d.as_millis() as u64),
        fails_probe: r.fails_probe,
        hits,
    }
}

/// The status of a mirrored volume from the pool's view of it and, when it is served,
/// its mirror's progress.
pub fn mirror_status(
    info: &spool_pool::VolumeInfo,
    progress: Option<spool_mirror::Progress>,
) -> MirrorStatus {
    let legs: Vec<MirrorLeg> = info
        .legs
        .iter()
        .map(|l| {
            let p = progress
                .as_ref()
                .and_then(|p| p.legs.iter().find(|x| x.slot == l.slot));
            MirrorLeg {
                slot: l.slot,
                synced: l.synced,
                state: p
                    .map_or(if l.present { "idle" } else { "missing" }, |p| p.state)
                    .to_string(),
                stale_bytes: p.map_or(0, |p| p.stale_bytes),
                devices: l.devices.clone(),
                remote: l.remote.clone(),
                required: p.is_some_and(|p| p.required),
            }
        })
        .collect();
    let current = legs.iter().filter(|l| l.state == "current").count();
    let copying = legs.iter().any(|l| l.state == "catching-up");
    let p = progress.as_ref();
    let state = match () {
        _ if !info.online => "offline",
        _ if p.is_some_and(|p| p.regions_without_current > 0) => "no-current-copy",
        _ if copying => "rebuilding",
        _ if p.is_some_and(|p| p.out_of_sync_bytes > 0) => "resyncing",
        _ if progress.is_some() && current < info.copies as usize => "degraded",
        _ if progress.is_none() && legs.len() < info.copies as usize => "degraded",
        _ => "healthy",
    };
    let copied = p.map_or(0, |p| p.copied_bytes);
    let remaining = p.map_or(0, |p| p.remaining_bytes);
    MirrorStatus {
        copies: info.copies,
        state: state.into(),
        legs,
        copied_bytes: copied,
        remaining_bytes: remaining,
        rate: p.map_or(0, |p| p.rate),
        eta_secs: p.and_then(|p| p.eta_secs),
        percent: match copied + remaining {
            0 => 100.0,
            t => 100.0 * copied as f64 / t as f64,
        },
        resync_at_open: p.map_or(0, |p| p.resync_at_open),
        regions_copied: p.map_or(0, |p| p.regions_copied),
        region_size: p.map_or(0, |p| p.region_size),
        zeroed_bytes: p.map_or(0, |p| p.zeroed_bytes),
        unwritten_bytes: p.map_or(0, |p| p.unwritten_bytes),
        out_of_sync_bytes: p.map_or(0, |p| p.out_of_sync_bytes),
        regions_without_current: p.map_or(0, |p| p.regions_without_current),
        without_current_offsets: p.map_or(Vec::new(), |p| p.without_current_offsets.clone()),
        bitmap_syncs: p.map_or(0, |p| p.bitmap_syncs),
        bitmap_sync_us: p.map_or(0.0, |p| p.bitmap_sync_us),
    }
}

impl ToWire<OpStats> for &OpTotals {
    fn wire(self) -> OpStats {
        let t = self;
        OpStats {
            ops: t.ops,
            bytes: t.bytes,
            errors: t.errors,
            mean_us: if t.ops == 0 {
                0.0
            } else {
                t.latency_sum_ns as f64 / t.ops as f64 / 1e3
            },
            p50_us: quantile_us(&t.buckets, 0.5),
            p99_us: quantile_us(&t.buckets, 0.99),
            buckets: t.buckets[..LATENCY_BUCKETS].to_vec(),
        }
    }
}

pub fn volume_stats(
    volume: String,
    uuid: Uuid,
    queues: u16,
    s: &VolumeStatsSnapshot,
    uptime_s: f64,
) -> VolumeStats {
    VolumeStats {
        volume,
        uuid,
        read: (&s.ops[0]).wire(),
        write: (&s.ops[1]).wire(),
        other: (&s.ops[2]).wire(),
        rejected: s.rejected,
        in_flight: s.in_flight,
        queues,
        queue_size: s.queue_size,
        resubmitted: s.resubmitted,
        journal_recoveries: s.recoveries,
        qos_throttled_rounds: s.throttled_rounds,
        uptime_s,
    }
}

impl ToWire<CheckReport> for spool_pool::CheckReport {
    fn wire(self) -> CheckReport {
        let r = self;
        CheckReport {
            volumes: r.volumes,
            maps: r.maps,
            extent_bytes: r.extent_bytes,
            chunks: r.chunks,
            shared_chunks: r.shared_chunks,
            leaked_bytes: r.leaked_bytes,
            problems: r.problems,
            skipped: r.skipped,
        }
    }
}

impl ToWire<ThinInfo> for spool_pool::ThinInfo {
    fn wire(self) -> ThinInfo {
        let t = self;
        ThinInfo {
            chunk: t.chunk,
            mapped: t.mapped,
            map_bytes: t.map_bytes,
            waiting_for_space: t.waiting_for_space,
            max_size: t.max_size,
            error: t.error,
        }
    }
}

impl ToWire<Snapshot> for spool_pool::SnapshotInfo {
    fn wire(self) -> Snapshot {
        let s = self;
        Snapshot {
            volume: s.volume,
            name: s.name,
            uuid: s.uuid,
            size: s.size,
            created: s.created,
            mapped: s.mapped,
            exclusive: s.exclusive,
            error: s.error,
            rbd: s.rbd,
            copies_could_need: None,
            pool_free: None,
            warning: None,
        }
    }
}
