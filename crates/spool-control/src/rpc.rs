//! JSON-RPC 2.0 over a Unix socket (mode 0600), one JSON object per line in each direction.
//! Methods are named `<object>_<verb>` (`volume_create`, `pool_show`, ...); see docs/rpc.md.
//!
//! Owns: the errors a method can answer with and their JSON-RPC codes, the method table
//! (name → handler + help; the method list is derived from it), request checking and
//! dispatch, the socket (`transport`); the blocking client is the wire crate's
//! (`spool_api::client`, re-exported here).
//!
//! Must not know: what the methods do. The daemon registers one handler per [`Method`] of
//! the typed API (`crate::api`) and hands the table and itself to [`serve`].

use std::os::unix::net::UnixStream;

use serde_json::{json, Value};

use crate::api::Method;

mod error;
mod transport;

pub use error::{ErrorObject, RpcError};
pub use spool_api::client::{Client, ClientError};
pub use transport::{bind, serve, MAX_REQUEST};

/// The request a handler answers: its id (`None` for a notification) and the connection it
/// came on (a deferred method answers there later).
pub struct Call<'a> {
    pub id: Option<Value>,
    pub conn: Option<&'a UnixStream>,
}

/// What a handler produced.
pub enum Reply {
    /// The result, answered at once.
    Result(Value),
    /// Someone else answers on the connection later (`daemon_upgrade`: the keeper).
    Deferred,
}

type Handler<C> = Box<dyn Fn(&C, Value, &Call<'_>) -> Result<Reply, RpcError> + Send + Sync>;

/// One registered method.
pub struct MethodEntry<C> {
    pub name: &'static str,
    pub help: &'static str,
    handler: Handler<C>,
}

/// Every method a server answers, in registration order, each with its handler over the
/// context `C` (the daemon).
pub struct MethodTable<C> {
    entries: Vec<MethodEntry<C>>,
}

impl<C: 'static> Default for MethodTable<C> {
    fn default() -> Self {
        MethodTable {
            entries: Vec::new(),
        }
    }
}

impl<C: 'static> MethodTable<C> {
    /// Registers `M`, answered by `f` with its result.
    pub fn register<M: Method>(
        &mut self,
        f: fn(&C, M::Params) -> Result<M::Result, RpcError>,
    ) -> &mut Self {
        self.add::<M>(Box::new(move |c, params, _| {
            let r = f(c, params_of::<M::Params>(params)?)?;
            Ok(Reply::Result(
                serde_json::to_value(r).unwrap_or(Value::Null),
            ))
        }))
    }

    /// Registers `M`, whose answer `f` arranges to be sent later on the call's connection.
    pub fn register_deferred<M: Method>(
        &mut self,
        f: fn(&C, M::Params, &Call<'_>) -> Result<(), RpcError>,
    ) -> &mut Self {
        self.add::<M>(Box::new(move |c, params, call| {
            f(c, params_of::<M::Params>(params)?, call)?;
            Ok(Reply::Deferred)
        }))
    }

    fn add<M: Method>(&mut self, handler: Handler<C>) -> &mut Self {
        assert!(
            self.entries.iter().all(|e| e.name != M::NAME),
            "method {} registered twice",
            M::NAME
        );
        self.entries.push(MethodEntry {
            name: M::NAME,
            help: M::HELP,
            handler,
        });
        self
    }

    /// Every method, in registration order.
    pub fn methods(&self) -> impl Iterator<Item = &MethodEntry<C>> {
        self.entries.iter()
    }

    /// Runs `method`.
    pub fn dispatch(
        &self,
        ctx: &C,
        method: &str,
        params: Value,
        call: &Call<'_>,
    ) -> Result<Reply, RpcError> {
        match self.entries.iter().find(|e| e.name == method) {
            Some(e) => (e.handler)(ctx, params, call),
            None => Err(RpcError::MethodNotFound {
                method: method.to_string(),
                known: self
                    .entries
                    .iter()
                    .map(|e| e.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// Handles one request line; returns the response (None for notifications, and for
    /// deferred methods, answered later on `conn`).
    pub fn handle_line(&self, ctx: &C, line: &str, conn: Option<&UnixStream>) -> Option<Value> {
        let req: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => return Some(error_response(Value::Null, RpcError::Parse(e.to_string()))),
        };
        let call = Call {
            id: req.get("id").cloned(),
            conn,
        };
        let result = check(&req).and_then(|(m, p)| self.dispatch(ctx, m, p, &call));
        let id = call.id?;
        match result {
            Ok(Reply::Deferred) => None,
            Ok(Reply::Result(v)) => Some(json!({"jsonrpc": "2.0", "id": id, "result": v})),
            Err(e) => Some(error_response(id, e)),
        }
    }
}

/// The method and params of a well-formed request.
fn check(req: &Value) -> Result<(&str, Value), RpcError> {
    let obj = req
        .as_object()
        .ok_or(RpcError::InvalidRequest("request must be a JSON object"))?;
    if obj.get("jsonrpc") != Some(&json!("2.0")) {
        return Err(RpcError::InvalidRequest("\"jsonrpc\": \"2.0\" is required"));
    }
    let method = obj
        .get("method")
        .and_then(Value::as_str)
        .ok_or(RpcError::InvalidRequest("\"method\" must be a string"))?;
    let params = obj.get("params").cloned().unwrap_or(Value::Null);
    if !(params.is_object() || params.is_null()) {
        return Err(RpcError::InvalidParams("params must be an object".into()));
    }
    Ok((method, params))
}

/// Params as `T` (absent params are `{}`).
fn params_of<T: serde::de::DeserializeOwned>(p: Value) -> Result<T, RpcError> {
    let p = if p.is_null() { json!({}) } else { p };
    serde_json::from_value(p).map_err(|e| RpcError::InvalidParams(e.to_string()))
}

fn error_response(id: Value, e: RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": ErrorObject::from(&e)})
}

#[cfg(test)]
mod tests;
