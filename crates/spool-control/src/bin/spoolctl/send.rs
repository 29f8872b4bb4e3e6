//! `spoolctl volume send`: the answer, and `--wait`'s progress line until the copy on the
//! other host is current (the request is built in `request.rs`).

use std::time::Duration;

use spool_api as api;
use spool_api::client::Client;
use spool_api::size::format_size;

use crate::args::Args;
use crate::CtlError;

/// How the send of volume `id` stands.
fn status(id: &str) -> api::SendParams {
    api::SendParams {
        id: id.into(),
        ..Default::default()
    }
}

/// One line saying how a send stands.
pub fn line(s: &api::SendInfo) -> String {
    let progress = match s.state.as_str() {
        "copying" => format!(
            ": {} {} left{}{}",
            bar(s.copied_bytes, s.remaining_bytes),
            format_size(s.remaining_bytes),
            match s.rate {
                0 => String::new(),
                r => format!(", {}/s", format_size(r)),
            },
            s.eta_secs
                .map_or(String::new(), |e| format!(", about {e} s to go"))
        ),
        "current" => ": every write completed here is there too".into(),
        "disconnected" => format!(
            " ({}; {} to copy when it is back)",
            s.trouble.as_deref().unwrap_or("no link"),
            format_size(s.remaining_bytes)
        ),
        "waiting" => format!(
            " ({}): the copy there was current, so the volume's I/O waits until the link is \
             back, or until `volume send {} --cancel` drops that copy",
            s.trouble.as_deref().unwrap_or("no link"),
            s.volume
        ),
        "finished" => ": the volume here is deleted".into(),
        "fenced" => ": the copy there was promoted, so this host is fenced off the volume: \
                     its writes fail here (docs/replicas.md)"
            .into(),
        "cancelled" => {
            ": the volume here is as it was; what the other host received stays there".into()
        }
        _ => String::new(),
    };
    format!("sending {} to {}: {}{progress}", s.volume, s.to, s.state)
}

/// A progress bar of what the copy has done since it (re)started: `[#####.....] 50%`.
fn bar(done: u64, left: u64) -> String {
    const WIDTH: u64 = 20;
    let total = (done + left).max(1);
    let filled = (done.min(total) * WIDTH / total) as usize;
    format!(
        "[{}{}] {:>3}%",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled),
        done.min(total) * 100 / total
    )
}

/// `--wait`: asks every second and prints the progress until the copy is current (or the
/// send ended, or the link is down and `--wait` would wait for ever).
pub fn wait(args: &Args, id: &str) -> Result<(), CtlError> {
    let mut c = Client::connect(&args.socket)?;
    loop {
        let s = c.request::<api::VolumeSend>(&status(id))?;
        println!("{}", line(&s));
        match s.state.as_str() {
            "current" => return Ok(()),
            "copying" => std::thread::sleep(Duration::from_secs(1)),
            _ => {
                return Err(CtlError::Found(format!(
                    "the send of volume {} is {}; not waiting",
                    s.volume, s.state
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_bar_shows_the_share_copied() {
        assert_eq!(super::bar(0, 10), "[....................]   0%");
        assert_eq!(super::bar(5, 5), "[##########..........]  50%");
        assert_eq!(super::bar(10, 0), "[####################] 100%");
        assert_eq!(super::bar(0, 0), "[....................]   0%");
    }
}
