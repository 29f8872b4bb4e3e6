//! spoolctl: command-line client of spoold's JSON-RPC API. Each subcommand has one request
//! builder (`request`) and one renderer (`render`) over the typed API (`spool_api::api`).

use std::process::ExitCode;

use clap::Parser;
use spool_api as api;
use spool_api::client::{Client, ClientError, ErrorObject};

mod args;
mod mirror;
mod render;
mod request;
mod send;
mod snapshot;
mod stats;
mod table;

use args::{Args, Cmd, VolumeCmd};

/// Why spoolctl failed (printed after `spoolctl: error: `).
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error(transparent)]
    Connect(#[from] ClientError),
    #[error(transparent)]
    Rpc(#[from] ErrorObject),
    #[error(transparent)]
    Size(#[from] spool_api::size::SizeError),
    #[error(transparent)]
    Qos(#[from] spool_api::qos::QosError),
    #[error("{0}")]
    Path(std::io::Error),
    #[error("params are not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("params: {0}")]
    Params(serde_json::Error),
    #[error("bad response: {0}")]
    Decode(serde_json::Error),
    #[error("{0}")]
    Usage(String),
    /// A check found something wrong (printed above).
    #[error("{0}")]
    Found(String),
}

fn run(args: Args) -> Result<(), CtlError> {
    if let Cmd::Events { since, follow } = args.cmd {
        return follow_events(&args, since, follow);
    }
    if let Cmd::Volume {
        cmd:
            VolumeCmd::Stats {
                id,
                watch: true,
                interval,
                count,
            },
    } = &args.cmd
    {
        return stats::watch(&args, id.clone(), *interval, *count);
    }
    let req = request::request(&args.cmd)?;
    let mut c = Client::connect(&args.socket)?;
    let r = c.call(&req.method, req.params)?;
    if let Cmd::Volume { cmd } = &args.cmd {
        let wait = match cmd {
            VolumeCmd::Send(a) => a.wait.then_some(&a.id),
            VolumeCmd::Replicate(a) => a.wait.then_some(&a.id),
            _ => None,
        };
        if let Some(id) = wait.filter(|_| !args.json) {
            return send::wait(&args, id);
        }
    }
    if args.json || matches!(args.cmd, Cmd::Rpc { .. }) {
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
        if let Cmd::Pool {
            cmd: args::PoolCmd::Check,
        } = args.cmd
        {
            let r: api::CheckReport = serde_json::from_value(r).map_err(CtlError::Decode)?;
            return render::check_verdict(&r);
        }
        return Ok(());
    }
    render::render(&args.cmd, r)
}

/// `spoolctl events`: prints the events after `since`, and with `follow` keeps waiting for
/// more until interrupted.
fn follow_events(args: &Args, mut since: u64, follow: bool) -> Result<(), CtlError> {
    let mut c = Client::connect(&args.socket)?;
    loop {
        let wait_ms = if follow { 10_000 } else { 0 };
        let r = c.request::<api::EventsList>(&api::EventsParams { since, wait_ms })?;
        for e in &r.events {
            if args.json {
                println!("{}", serde_json::to_value(e).unwrap_or_default());
            } else {
                render::print_event(e);
            }
            since = since.max(e.seq);
        }
        if !follow {
            return Ok(());
        }
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CtlError::Found(e)) => {
            // Distinct from a failure to ask (1): the check ran and found problems.
            eprintln!("spoolctl: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("spoolctl: error: {e}");
            ExitCode::FAILURE
        }
    }
}
