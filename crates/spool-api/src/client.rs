//! A blocking JSON-RPC client of spoold's socket (used by spoolctl and the tests), and the
//! JSON-RPC error object as it travels.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::Method;

/// A JSON-RPC error object, as sent and as a client receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ErrorObject {
    pub code: i64,
    pub message: String,
}

/// Why a client could not talk to spoold.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to spoold at {}: {source} (is spoold running? pass --socket PATH)", .path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("send: {0}")]
    Send(std::io::Error),
    #[error("receive: {0}")]
    Receive(std::io::Error),
    #[error("spoold closed the connection")]
    Closed,
    #[error("bad response: {0}")]
    BadResponse(serde_json::Error),
}

impl From<ClientError> for ErrorObject {
    /// A transport failure, reported like an operation that failed.
    fn from(e: ClientError) -> Self {
        ErrorObject {
            code: -32000,
            message: e.to_string(),
        }
    }
}

/// One connection to spoold's RPC socket.
pub struct Client {
    stream: BufReader<UnixStream>,
    next_id: u64,
}

impl Client {
    /// Connects to a spoold RPC socket.
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Client {
            stream: BufReader::new(s),
            next_id: 1,
        })
    }

    /// Calls `method`; `Err` carries the server's error object or a transport error.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, ErrorObject> {
        let id = self.next_id;
        self.next_id += 1;
        let req = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.stream.get_mut(), "{req}").map_err(ClientError::Send)?;
        let mut line = String::new();
        self.stream
            .read_line(&mut line)
            .map_err(ClientError::Receive)?;
        if line.is_empty() {
            return Err(ClientError::Closed.into());
        }
        let resp: Value = serde_json::from_str(&line).map_err(ClientError::BadResponse)?;
        if let Some(e) = resp.get("error") {
            return Err(ErrorObject {
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

    /// Calls the typed method `M`.
    pub fn request<M: Method>(&mut self, params: &M::Params) -> Result<M::Result, ErrorObject> {
        let params = serde_json::to_value(params).map_err(ClientError::BadResponse)?;
        let r = self.call(M::NAME, params)?;
        Ok(serde_json::from_value(r).map_err(ClientError::BadResponse)?)
    }
}
