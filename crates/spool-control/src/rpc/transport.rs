//! The RPC socket: binding it without a window of looser permissions, accepting
//! connections, and reading one request line at a time.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Weak};

use serde_json::Value;

use super::{error_response, MethodTable, RpcError};

/// Largest request line accepted (bytes).
pub const MAX_REQUEST: usize = 1 << 20;

/// Serves `listener` on a background thread: every connection on its own thread, each request
/// dispatched through `table` with `ctx`. The threads hold `ctx` only while they answer a
/// request: once its owner drops it (the daemon stopped), requests are answered with an error.
pub fn serve<C: Send + Sync + 'static>(
    listener: UnixListener,
    table: Arc<MethodTable<C>>,
    ctx: Weak<C>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("rpc".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (table, ctx) = (table.clone(), ctx.clone());
                let _ = std::thread::Builder::new()
                    .name("rpc-conn".into())
                    .spawn(move || serve_conn(conn, &table, &ctx));
            }
        })?;
    Ok(())
}

/// Binds the RPC socket at `path` with mode 0600 (refused if another spoold listens there).
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if std::fs::symlink_metadata(path).is_ok() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "{}: another spoold is already listening here",
                    path.display()
                ),
            ));
        }
        std::fs::remove_file(path)?;
    }
    // The socket must never exist at `path` with a looser mode, not even between bind and
    // chmod (a local user could connect in that window and keep the connection): it is bound
    // inside a fresh private directory next to `path`, tightened there, and renamed into place.
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = tempfile::Builder::new()
        .prefix(".spoold-rpc-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(parent)?;
    let tmp = staging.path().join("sock");
    let listener = UnixListener::bind(&tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, path)?;
    Ok(listener)
}

fn serve_conn<C: 'static>(conn: UnixStream, table: &MethodTable<C>, ctx: &Weak<C>) {
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    loop {
        line.clear();
        match reader
            .by_ref()
            .take(MAX_REQUEST as u64 + 1)
            .read_line(&mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(n) if n > MAX_REQUEST => {
                let r = error_response(Value::Null, RpcError::InvalidRequest("request too large"));
                let _ = writeln!(out, "{r}");
                return;
            }
            Ok(_) => {}
        }
        if line.trim().is_empty() {
            continue;
        }
        let Some(ctx) = ctx.upgrade() else {
            let id = serde_json::from_str::<Value>(line.trim())
                .ok()
                .and_then(|v| v.get("id").cloned())
                .unwrap_or(Value::Null);
            let r = error_response(id, RpcError::Stopping);
            let _ = writeln!(out, "{r}");
            return;
        };
        if let Some(resp) = table.handle_line(&ctx, line.trim(), Some(&out)) {
            if writeln!(out, "{resp}").is_err() {
                return;
            }
        }
    }
}
