use serde_json::{json, Value};

use super::*;
use crate::api::{self, IdParams, NoParams};

struct Ctx;

fn table() -> MethodTable<Ctx> {
    let mut t = MethodTable::default();
    t.register::<api::PoolShow>(|_, _: NoParams| Err(RpcError::NoKeeper))
        .register::<api::DeviceClearFaults>(|_, p: IdParams| {
            Ok(api::ClearFaultsResult {
                device: p
                    .id
                    .parse()
                    .map_err(|_| RpcError::InvalidParams("id".into()))?,
                cleared: 2,
            })
        })
        .register_deferred::<api::DaemonUpgrade>(|_, _, _| Ok(()));
    t
}

fn ask(line: &str) -> Option<Value> {
    table().handle_line(&Ctx, line, None)
}

#[test]
fn requests_are_checked_and_dispatched() {
    assert_eq!(ask("{not json").unwrap()["error"]["code"], json!(-32700));
    let r = ask(r#"{"id":1,"method":"pool_show"}"#).unwrap();
    assert_eq!(r["error"]["code"], json!(-32600));
    let r = ask(r#"{"jsonrpc":"2.0","id":2,"method":"nope"}"#).unwrap();
    assert_eq!(r["error"]["code"], json!(-32601));
    assert_eq!(
        r["error"]["message"],
        json!("unknown method 'nope'; methods: pool_show, device_clear_faults, daemon_upgrade")
    );
    let r = ask(r#"{"jsonrpc":"2.0","id":3,"method":"pool_show","params":{"x":1}}"#).unwrap();
    assert_eq!(
        r["error"],
        json!({"code": -32602, "message": "invalid params: this method takes no parameters"})
    );
    let r = ask(r#"{"jsonrpc":"2.0","id":4,"method":"pool_show","params":[]}"#).unwrap();
    assert_eq!(
        r["error"]["message"],
        json!("invalid params: params must be an object")
    );
    let r = ask(r#"{"jsonrpc":"2.0","id":5,"method":"pool_show"}"#).unwrap();
    assert_eq!(r["error"]["code"], json!(-32000));
    let u = uuid::Uuid::nil();
    let line = format!(
        r#"{{"jsonrpc":"2.0","id":6,"method":"device_clear_faults","params":{{"id":"{u}"}}}}"#
    );
    assert_eq!(
        ask(&line).unwrap(),
        json!({"jsonrpc": "2.0", "id": 6, "result": {"device": u, "cleared": 2}})
    );
}

#[test]
fn notifications_and_deferred_methods_get_no_answer_now() {
    assert_eq!(ask(r#"{"jsonrpc":"2.0","method":"pool_show"}"#), None);
    assert_eq!(
        ask(r#"{"jsonrpc":"2.0","id":7,"method":"daemon_upgrade"}"#),
        None
    );
    let r = ask(r#"{"jsonrpc":"2.0","id":8,"method":"daemon_upgrade","params":{"b":1}}"#);
    assert_eq!(r.unwrap()["error"]["code"], json!(-32602));
}

/// The socket's threads hold the context only while they answer: once its owner drops it
/// (the daemon stopped, and its devices must close), a request gets a clear error, with its id.
#[test]
fn a_socket_whose_context_is_gone_answers_that_spoold_is_stopping() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rpc.sock");
    let ctx = std::sync::Arc::new(Ctx);
    serve(
        bind(&path).unwrap(),
        std::sync::Arc::new(table()),
        std::sync::Arc::downgrade(&ctx),
    )
    .unwrap();
    let call = |line: &str| {
        let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        writeln!(s, "{line}").unwrap();
        let mut out = String::new();
        BufReader::new(s).read_line(&mut out).unwrap();
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let r = call(r#"{"jsonrpc":"2.0","id":7,"method":"pool_show"}"#);
    assert_eq!(r["error"]["message"], json!(RpcError::NoKeeper.to_string()));
    drop(ctx);
    let r = call(r#"{"jsonrpc":"2.0","id":8,"method":"pool_show"}"#);
    assert_eq!(
        r,
        json!({"jsonrpc": "2.0", "id": 8, "error": {"code": -32000, "message": "spoold is stopping: it takes no more requests"}})
    );
}
