//! One request builder per subcommand: the method of the typed API and its params, checked
//! here (sizes, paths) before spoold is asked anything.

use std::path::{Path, PathBuf};

use serde_json::Value;
use spool_api::qos::parse_burst_ms;
use spool_api::size::parse_size;
use spool_api::{
    self as api, CloneParams, ErrnoArg, IdParams, Method, NoParams, RateValue, SizeValue,
    SnapshotParams,
};

use super::args::{
    Cmd, DeviceCmd, InjectArgs, PoolCmd, QosArgs, ReceiveArgs, SendArgs, SnapshotCmd, VolumeCmd,
};
use super::snapshot;
use super::CtlError;

/// A method call, ready to send.
pub struct Request {
    pub method: String,
    pub params: Value,
}

fn build<M: Method>(params: M::Params) -> Result<Request, CtlError> {
    Ok(Request {
        method: M::NAME.to_string(),
        params: serde_json::to_value(params).map_err(CtlError::Params)?,
    })
}

fn size(s: &str) -> Result<SizeValue, CtlError> {
    Ok(SizeValue::Bytes(parse_size(s)?))
}

fn opt_size(s: &Option<String>) -> Result<Option<SizeValue>, CtlError> {
    s.as_deref().map(size).transpose()
}

fn id<M: Method<Params = IdParams>>(id: &str) -> Result<Request, CtlError> {
    build::<M>(IdParams { id: id.to_string() })
}

/// A device path as the daemon needs it: files absolute (the daemon has its own working
/// directory), `nvme:PCI-ADDRESS` as given.
fn device_path(p: &Path) -> Result<PathBuf, CtlError> {
    if p.to_str().is_some_and(|s| s.starts_with("nvme:")) {
        return Ok(p.to_path_buf());
    }
    std::path::absolute(p).map_err(CtlError::Path)
}

/// The request `cmd` sends (`events` has its own loop and sends none here).
pub fn request(cmd: &Cmd) -> Result<Request, CtlError> {
    match cmd {
        Cmd::Pool { cmd: PoolCmd::Show } => build::<api::PoolShow>(NoParams),
        Cmd::Pool {
            cmd: PoolCmd::Check,
        } => build::<api::PoolCheck>(NoParams),
        Cmd::Device { cmd } => device(cmd),
        Cmd::Volume { cmd } => volume(cmd),
        Cmd::Snapshot {
            cmd: SnapshotCmd::Delete { snapshot: s },
        } => snapshot_delete(s),
        Cmd::Status => build::<api::DaemonStatus>(NoParams),
        Cmd::Upgrade { binary } => upgrade(binary.as_deref()),
        Cmd::Events { since, .. } => events(*since, 0),
        Cmd::Rpc { method, params } => rpc(method, params.as_deref()),
    }
}

fn device(cmd: &DeviceCmd) -> Result<Request, CtlError> {
    match cmd {
        DeviceCmd::List => build::<api::DeviceList>(NoParams),
        DeviceCmd::Add {
            path,
            create_size,
            force,
        } => build::<api::DeviceAdd>(api::DeviceAddParams {
            path: device_path(path)?,
            create_size: opt_size(create_size)?,
            force: *force,
        }),
        DeviceCmd::Health { id } => {
            build::<api::DeviceHealth>(api::DeviceHealthParams { id: id.clone() })
        }
        DeviceCmd::Reset { id: d } => id::<api::DeviceReset>(d),
        DeviceCmd::Faults { id: d } => id::<api::DeviceFaults>(d),
        DeviceCmd::ClearFaults { id: d } => id::<api::DeviceClearFaults>(d),
        DeviceCmd::Replace {
            old,
            new,
            create_size,
            force,
        } => build::<api::DeviceReplace>(api::DeviceReplaceParams {
            old: old.clone(),
            new: device_path(new)?,
            create_size: opt_size(create_size)?,
            force: *force,
        }),
        DeviceCmd::Inject(a) => inject(a),
    }
}

fn inject(a: &InjectArgs) -> Result<Request, CtlError> {
    build::<api::DeviceInject>(api::InjectParams {
        id: a.id.clone(),
        kind: a.kind.clone(),
        op: Some(a.op.clone()),
        offset: opt_size(&a.offset)?,
        len: opt_size(&a.len)?,
        count: a.count,
        duration_ms: a.duration_ms,
        errno: a.errno.as_deref().map(ErrnoArg::from_cli),
        bits: a.bits,
    })
}

fn volume(cmd: &VolumeCmd) -> Result<Request, CtlError> {
    match cmd {
        VolumeCmd::List => build::<api::VolumeList>(NoParams),
        VolumeCmd::Show { id: v } => id::<api::VolumeShow>(v),
        VolumeCmd::Verify { id: v } => id::<api::VolumeVerify>(v),
        VolumeCmd::Stats { id, .. } => {
            build::<api::VolumeStatsGet>(api::VolumeStatsParams { id: id.clone() })
        }
        VolumeCmd::Mirror { action, id, leg } => {
            build::<api::VolumeMirror>(api::VolumeMirrorParams {
                id: id.clone(),
                action: action.clone(),
                leg: *leg,
            })
        }
        VolumeCmd::Create {
            name,
            size: sz,
            read_only,
            queues,
            mirror,
            rbd,
            encrypt,
            thin,
        } => build::<api::VolumeCreate>(api::VolumeCreateParams {
            name: name.clone(),
            size: sz.as_deref().map(size).transpose()?,
            read_only: *read_only,
            num_queues: Some(*queues),
            mirror: *mirror,
            rbd: rbd.clone(),
            encrypt: *encrypt,
            thin: *thin,
        }),
        VolumeCmd::Rekey { key_file } => build::<api::VolumeRekey>(api::RekeyParams {
            key_file: key_file
                .as_deref()
                .map(|f| std::path::absolute(f).map(|p| p.display().to_string()))
                .transpose()
                .map_err(CtlError::Path)?,
        }),
        VolumeCmd::Delete {
            id,
            force,
            remove_image,
        } => build::<api::VolumeDelete>(api::VolumeDeleteParams {
            id: id.clone(),
            force: *force,
            remove_image: *remove_image,
        }),
        VolumeCmd::Resize { id, size: sz } => build::<api::VolumeResize>(api::VolumeResizeParams {
            id: id.clone(),
            size: size(sz)?,
        }),
        VolumeCmd::Qos(a) => qos(a),
        VolumeCmd::Snapshot { .. } => snapshot_take(cmd),
        VolumeCmd::Snapshots { id: v } => id::<api::VolumeSnapshots>(v),
        VolumeCmd::Clone { snapshot: s, name } => snapshot_clone(s, name),
        VolumeCmd::Diff { from, to } => diff(from, to.as_deref()),
        VolumeCmd::Revert { id, snapshot: s } => build::<api::VolumeRevert>(SnapshotParams {
            id: id.clone(),
            snapshot: s.clone(),
        }),
        VolumeCmd::Inflate { id: v } => id::<api::VolumeInflate>(v),
        VolumeCmd::Export {
            snapshot: s,
            nbd,
            since,
            decrypt,
            plaintext,
        } => export(s, nbd, since.clone(), (*decrypt, *plaintext)),
        VolumeCmd::Unexport { snapshot: s } => {
            let (id, snapshot) = snapshot::split(s)?;
            build::<api::SnapshotUnexport>(SnapshotParams { id, snapshot })
        }
        VolumeCmd::Receive(a) => receive(a),
        VolumeCmd::Send(a) => send(a),
        VolumeCmd::Replicate(_) | VolumeCmd::Promote { .. } => replica(cmd),
    }
}

fn snapshot_take(cmd: &VolumeCmd) -> Result<Request, CtlError> {
    let VolumeCmd::Snapshot {
        id,
        snapshot,
        require_space,
    } = cmd
    else {
        unreachable!("called for `volume snapshot` only");
    };
    build::<api::VolumeSnapshot>(api::TakeSnapshotParams {
        id: id.clone(),
        snapshot: snapshot.clone(),
        require_space: *require_space,
    })
}

fn snapshot_delete(snapshot: &str) -> Result<Request, CtlError> {
    let (id, snapshot) = snapshot::split(snapshot)?;
    build::<api::SnapshotDelete>(SnapshotParams { id, snapshot })
}

fn snapshot_clone(snapshot: &str, name: &str) -> Result<Request, CtlError> {
    let (id, snapshot) = snapshot::split(snapshot)?;
    build::<api::VolumeClone>(CloneParams {
        id,
        snapshot,
        name: name.into(),
    })
}

fn diff(from: &str, to: Option<&str>) -> Result<Request, CtlError> {
    let (id, from) = snapshot::split(from)?;
    let to = match to.map(|t| t.rsplit_once('@').map_or((t, None), |(v, s)| (v, Some(s)))) {
        Some((v, _)) if v != id => {
            return Err(CtlError::Usage(format!(
                "'{v}' is not '{id}': a diff is between maps of one volume"
            )))
        }
        Some((_, s)) => s.map(str::to_string),
        None => None,
    };
    build::<api::VolumeDiff>(api::DiffParams { id, from, to })
}

/// `volume export`.
fn export(
    s: &str,
    nbd: &str,
    since: Option<String>,
    (decrypt, plaintext): (bool, bool),
) -> Result<Request, CtlError> {
    let (id, snapshot) = snapshot::split(s)?;
    build::<api::SnapshotExport>(api::ExportParams {
        id,
        snapshot,
        nbd: absolute_nbd(nbd)?,
        since,
        decrypt,
        plaintext,
    })
}

/// `volume send ID [--to URI | --cancel | --finish]` (none: how it stands).
fn send(a: &SendArgs) -> Result<Request, CtlError> {
    build::<api::VolumeSend>(api::SendParams {
        id: a.id.clone(),
        to: a.to.clone(),
        token: token_of(a.token.as_deref(), a.token_file.as_deref())?,
        cancel: a.cancel,
        finish: a.finish,
        replica: false,
    })
}

/// `volume replicate ID --to HOST:PORT --token T`, `volume promote ID`.
fn replica(cmd: &VolumeCmd) -> Result<Request, CtlError> {
    match cmd {
        VolumeCmd::Replicate(a) => build::<api::VolumeSend>(api::SendParams {
            id: a.id.clone(),
            to: Some(a.to.clone()),
            token: token_of(a.token.as_deref(), a.token_file.as_deref())?,
            replica: true,
            ..Default::default()
        }),
        VolumeCmd::Promote { id, force } => build::<api::VolumePromote>(api::PromoteParams {
            id: id.clone(),
            force: *force,
        }),
        _ => unreachable!("only replicate and promote are built here"),
    }
}

/// The transfer token: `--token`, or the first line of `--token-file` (`-`: standard input).
fn token_of(
    token: Option<&str>,
    file: Option<&std::path::Path>,
) -> Result<Option<String>, CtlError> {
    let Some(path) = file else {
        return Ok(token.map(str::to_string));
    };
    let text = match path.as_os_str() == "-" {
        true => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| CtlError::Usage(format!("--token-file -: {e}")))?;
            line
        }
        false => std::fs::read_to_string(path)
            .map_err(|e| CtlError::Usage(format!("--token-file {}: {e}", path.display())))?,
    };
    let first = text.lines().next().unwrap_or("").trim();
    if first.is_empty() {
        return Err(CtlError::Usage(format!(
            "--token-file {}: no token in it",
            path.display()
        )));
    }
    Ok(Some(first.to_string()))
}

/// `volume receive`: start (with an address, or a token for the transfer listener) or
/// stop.
fn receive(a: &ReceiveArgs) -> Result<Request, CtlError> {
    let token = token_of(a.token.as_deref(), a.token_file.as_deref())?;
    let (id, nbd) = (a.id.clone(), a.nbd.as_deref());
    match (nbd, token) {
        (None, None) => build::<api::VolumeReceiveStop>(api::ReceiveStopParams { id }),
        (nbd, token) => build::<api::VolumeReceive>(api::ReceiveParams {
            id,
            nbd: nbd.map(absolute_nbd).transpose()?,
            token,
            max_size: opt_size(&a.max_size)?,
            replica: a.replica,
        }),
    }
}

/// An NBD listening address with a Unix socket path made absolute (spoold has its own
/// working directory).
fn absolute_nbd(nbd: &str) -> Result<String, CtlError> {
    Ok(match nbd.strip_prefix("unix:") {
        Some(p) if !p.is_empty() => format!(
            "unix:{}",
            std::path::absolute(p).map_err(CtlError::Path)?.display()
        ),
        _ => nbd.to_string(),
    })
}

/// `volume qos`: every value is read here, so a typo fails before spoold is asked.
fn qos(a: &QosArgs) -> Result<Request, CtlError> {
    let iops = |v: &Option<String>, what: &str| -> Result<Option<RateValue>, CtlError> {
        let Some(v) = v else { return Ok(None) };
        let n = RateValue::Text(v.clone()).iops(what)?;
        Ok(Some(RateValue::Number(n)))
    };
    let bw = |v: &Option<String>, what: &str| -> Result<Option<RateValue>, CtlError> {
        let Some(v) = v else { return Ok(None) };
        let n = RateValue::Text(v.clone()).bps(what)?;
        Ok(Some(RateValue::Number(n)))
    };
    build::<api::VolumeQos>(api::VolumeQosParams {
        id: a.id.clone(),
        iops: iops(&a.iops, "--iops")?,
        read_iops: iops(&a.read_iops, "--read-iops")?,
        write_iops: iops(&a.write_iops, "--write-iops")?,
        bps: bw(&a.bw, "--bw")?,
        read_bps: bw(&a.read_bw, "--read-bw")?,
        write_bps: bw(&a.write_bw, "--write-bw")?,
        burst_ms: a.burst.as_deref().map(parse_burst_ms).transpose()?,
        weight: a.weight,
        priority: a.priority.as_deref().and_then(spool_api::Priority::parse),
        clear: a.clear,
    })
}

fn upgrade(binary: Option<&Path>) -> Result<Request, CtlError> {
    let binary = binary
        .map(|b| std::path::absolute(b).map_err(CtlError::Path))
        .transpose()?;
    build::<api::DaemonUpgrade>(api::UpgradeParams { binary })
}

/// `events_list` from `since`, waiting up to `wait_ms` for one.
fn events(since: u64, wait_ms: u64) -> Result<Request, CtlError> {
    build::<api::EventsList>(api::EventsParams { since, wait_ms })
}

/// Any method with JSON params (for debugging).
fn rpc(method: &str, params: Option<&str>) -> Result<Request, CtlError> {
    let params = match params {
        Some(t) => serde_json::from_str(t).map_err(CtlError::NotJson)?,
        None => Value::Object(Default::default()),
    };
    Ok(Request {
        method: method.to_string(),
        params,
    })
}
