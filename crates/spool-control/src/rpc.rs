//! JSON-RPC 2.0 over a Unix socket (mode 0600), one JSON object per line in each direction.
//! Methods are named `<object>_<verb>` (`volume_create`, `pool_show`, ...); see docs/rpc.md.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use serde_json::{json, Value};

use crate::daemon::Daemon;

/// Largest request line accepted (bytes).
pub const MAX_REQUEST: usize = 1 << 20;

/// A JSON-RPC error object.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    pub fn parse(msg: impl Into<String>) -> Self {
        RpcError {
            code: -32700,
            message: msg.into(),
        }
    }
    pub fn invalid_request(msg: impl Into<String>) -> Self {
        RpcError {
            code: -32600,
            message: msg.into(),
        }
    }
    pub fn method_not_found(m: &str) -> Self {
        RpcError {
            code: -32601,
            message: format!("unknown method '{m}'; methods: pool_show, device_list, device_add, device_reset, volume_list, volume_show, volume_create, volume_delete, volume_resize, daemon_status, daemon_upgrade"),
        }
    }
    pub fn invalid_params(msg: impl Into<String>) -> Self {
        RpcError {
            code: -32602,
            message: format!("invalid params: {}", msg.into()),
        }
    }
    /// An operation that was understood but failed (the message says why and what to do).
    pub fn app(e: impl std::fmt::Display) -> Self {
        RpcError {
            code: -32000,
            message: e.to_string(),
        }
    }
}

/// Handles one request line; returns the response line (None for notifications, and for
/// `daemon_upgrade`, which the keeper answers on `conn` once the new worker serves).
pub fn handle_line(d: &Daemon, line: &str, conn: Option<&UnixStream>) -> Option<Value> {
    let req: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            return Some(error_response(
                Value::Null,
                RpcError::parse(format!("parse error: {e}")),
            ))
        }
    };
    let id = req.get("id").cloned();
    let check = || -> Result<(String, Value), RpcError> {
        let obj = req
            .as_object()
            .ok_or_else(|| RpcError::invalid_request("request must be a JSON object"))?;
        if obj.get("jsonrpc") != Some(&json!("2.0")) {
            return Err(RpcError::invalid_request(
                "\"jsonrpc\": \"2.0\" is required",
            ));
        }
        let method = obj
            .get("method")
            .and_then(Value::as_str)
            .ok_or_else(|| RpcError::invalid_request("\"method\" must be a string"))?;
        let params = obj.get("params").cloned().unwrap_or(Value::Null);
        if !(params.is_object() || params.is_null()) {
            return Err(RpcError::invalid_params("params must be an object"));
        }
        Ok((method.to_string(), params))
    };
    let checked = check();
    if let Ok((m, p)) = &checked {
        if m == "daemon_upgrade" {
            match d.upgrade(p.clone(), id.clone(), conn) {
                Ok(()) => return None,
                Err(e) => return id.map(|id| error_response(id, e)),
            }
        }
    }
    let result = checked.and_then(|(m, p)| d.call(&m, p));
    let id = id?;
    Some(match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": id, "result": v}),
        Err(e) => error_response(id, e),
    })
}

fn error_response(id: Value, e: RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": e})
}

/// Binds the RPC socket (mode 0600), or adopts the one the keeper kept, and serves it on a
/// background thread.
pub fn serve(path: &Path, d: Arc<Daemon>) -> std::io::Result<()> {
    let listener = match d.take_kept_rpc_listener() {
        Some(l) => l,
        None => bind(path)?,
    };
    d.keep_rpc_listener(&listener);
    std::thread::Builder::new()
        .name("rpc".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let d = d.clone();
                let _ = std::thread::Builder::new()
                    .name("rpc-conn".into())
                    .spawn(move || serve_conn(conn, &d));
            }
        })?;
    Ok(())
}

fn bind(path: &Path) -> std::io::Result<UnixListener> {
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

fn serve_conn(conn: UnixStream, d: &Daemon) {
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
                let r = error_response(Value::Null, RpcError::invalid_request("request too large"));
                let _ = writeln!(out, "{r}");
                return;
            }
            Ok(_) => {}
        }
        if line.trim().is_empty() {
            continue;
        }
        if let Some(resp) = handle_line(d, line.trim(), Some(&out)) {
            if writeln!(out, "{resp}").is_err() {
                return;
            }
        }
    }
}

/// A blocking JSON-RPC client (used by spoolctl and the tests).
pub struct Client {
    stream: BufReader<UnixStream>,
    next_id: u64,
}

impl Client {
    /// Connects to a spoold RPC socket.
    pub fn connect(path: &Path) -> Result<Client, String> {
        let s = UnixStream::connect(path).map_err(|e| {
            format!(
                "cannot connect to spoold at {}: {e} (is spoold running? pass --socket PATH)",
                path.display()
            )
        })?;
        Ok(Client {
            stream: BufReader::new(s),
            next_id: 1,
        })
    }

    /// Calls `method`; `Err` carries the server's error object or a transport error.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, RpcError> {
        let id = self.next_id;
        self.next_id += 1;
        let req = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.stream.get_mut(), "{req}")
            .map_err(|e| RpcError::app(format!("send: {e}")))?;
        let mut line = String::new();
        self.stream
            .read_line(&mut line)
            .map_err(|e| RpcError::app(format!("receive: {e}")))?;
        if line.is_empty() {
            return Err(RpcError::app("spoold closed the connection"));
        }
        let resp: Value =
            serde_json::from_str(&line).map_err(|e| RpcError::app(format!("bad response: {e}")))?;
        if let Some(e) = resp.get("error") {
            return Err(RpcError {
                code: e.get("code").and_then(Value::as_i64).unwrap_or(-32000),
                message: e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown error")
                    .to_string(),
            });
        }
        Ok(resp.get("result").cloned().unwrap_or(Value::Null))
    }
}
