//! The errors a method answers with, and the JSON-RPC error object they become on the wire.

use uuid::Uuid;

/// Why a request failed. Each variant maps to the JSON-RPC code the wire uses
/// ([`RpcError::code`]); the message says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("parse error: {0}")]
    Parse(String),
    #[error("{0}")]
    InvalidRequest(&'static str),
    #[error("unknown method '{method}'; methods: {known}")]
    MethodNotFound { method: String, known: String },
    #[error("invalid params: {0}")]
    InvalidParams(String),
    /// The pool refused (no such volume, no space, a foreign device, ...).
    #[error(transparent)]
    Pool(#[from] spool_pool::Error),
    #[error("device {0} is not present")]
    NotPresent(Uuid),
    #[error("volume '{0}' is in use by a connected client; stop the VM first, or pass force=true (spoolctl volume delete --force) to disconnect it")]
    InUse(String),
    #[error("volume '{volume}' is stopped, but {commands} device command(s) into it never completed (a hung device): its extents stay allocated until spoold restarts, so a late write cannot land in another volume; delete it again after a restart")]
    Quarantined { volume: String, commands: u64 },
    #[error("volume created but not served: {0}")]
    NotServed(String),
    /// The health monitor refused (an isolated device cannot be reset).
    #[error("{0}")]
    Health(String),
    #[error("spoold runs without a keeper (--no-keeper): a live upgrade needs the keeper; restart spoold without --no-keeper")]
    NoKeeper,
    #[error("cannot reach the keeper: {0}")]
    Keeper(std::io::Error),
    #[error("spoold is stopping: it takes no more requests")]
    Stopping,
    /// The other host promoted its replica of the volume (docs/replicas.md).
    #[error("volume '{volume}' was promoted on the other host (epoch {epoch}): this host is fenced off it, and its writes fail here")]
    Fenced { volume: String, epoch: u64 },
}

impl RpcError {
    /// The JSON-RPC error code: the standard ones, and -32000 for an operation that was
    /// understood but failed.
    pub fn code(&self) -> i64 {
        match self {
            RpcError::Parse(_) => -32700,
            RpcError::InvalidRequest(_) => -32600,
            RpcError::MethodNotFound { .. } => -32601,
            RpcError::InvalidParams(_) => -32602,
            RpcError::Pool(_)
            | RpcError::NotPresent(_)
            | RpcError::InUse(_)
            | RpcError::Quarantined { .. }
            | RpcError::NotServed(_)
            | RpcError::Health(_)
            | RpcError::Fenced { .. }
            | RpcError::NoKeeper
            | RpcError::Keeper(_)
            | RpcError::Stopping => -32000,
        }
    }
}

pub use spool_api::client::ErrorObject;

impl From<&RpcError> for ErrorObject {
    fn from(e: &RpcError) -> Self {
        ErrorObject {
            code: e.code(),
            message: e.to_string(),
        }
    }
}
