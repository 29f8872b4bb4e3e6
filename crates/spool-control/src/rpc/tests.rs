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
