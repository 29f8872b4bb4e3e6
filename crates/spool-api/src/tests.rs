use serde_json::json;

use super::*;

fn wire<T: Serialize>(t: &T) -> String {
    serde_json::to_value(t).unwrap().to_string()
}

#[test]
fn no_params_is_null_or_empty() {
    assert_eq!(wire(&NoParams), "{}");
    assert!(serde_json::from_value::<NoParams>(json!({})).is_ok());
    assert!(serde_json::from_value::<NoParams>(Value::Null).is_ok());
    let e = serde_json::from_value::<NoParams>(json!({"x": 1})).unwrap_err();
    assert_eq!(e.to_string(), "this method takes no parameters");
}

#[test]
fn params_are_written_as_spoolctl_always_wrote_them() {
    let add = DeviceAddParams {
        path: "/d.img".into(),
        create_size: None,
        force: false,
    };
    assert_eq!(wire(&add), r#"{"force":false,"path":"/d.img"}"#);
    let create = VolumeCreateParams {
        name: "v".into(),
        size: Some(SizeValue::Bytes(4096)),
        read_only: false,
        num_queues: Some(2),
        mirror: None,
        rbd: None,
        encrypt: false,
        thin: false,
    };
    assert_eq!(
        wire(&create),
        r#"{"name":"v","num_queues":2,"read_only":false,"size":4096}"#
    );
    let health = DeviceHealthParams { id: None };
    assert_eq!(wire(&health), r#"{"id":null}"#);
    assert_eq!(wire(&UpgradeParams { binary: None }), "{}");
    let errno: InjectParams =
        serde_json::from_value(json!({"id": "d", "kind": "errno", "errno": "EIO"})).unwrap();
    assert!(matches!(errno.errno, Some(ErrnoArg::Name(ref n)) if n == "EIO"));
    assert_eq!(ErrnoArg::from_cli("61").to_string(), "61");
    assert_eq!(ErrnoArg::from_cli("EIO").to_string(), "\"EIO\"");
}

#[test]
fn unknown_fields_are_refused_with_the_expected_ones() {
    let e = serde_json::from_value::<IdParams>(json!({"idd": "x"})).unwrap_err();
    assert!(e.to_string().contains("unknown field `idd`"), "{e}");
    let e = serde_json::from_value::<VolumeCreateParams>(json!({"name": 3})).unwrap_err();
    assert!(e.to_string().contains("invalid type"), "{e}");
}

#[test]
fn volume_results_flatten_and_skip_what_the_old_json_left_out() {
    let info = VolumeInfo {
        uuid: uuid::Uuid::nil(),
        name: "v".into(),
        size: 1,
        allocated: 2,
        read_only: false,
        num_queues: 2,
        extents: 1,
        devices: vec![],
        online: true,
        qos: None,
        rbd: None,
        extent_map: vec![],
        encrypted: false,
        kek_id: None,
        thin: None,
        replica_of: None,
        replica_complete: false,
        epoch: 0,
    };
    let v = Volume {
        info,
        socket: None,
        connected: false,
        quarantined_io: None,
        mirror: None,
        not_served: None,
        receiving: None,
        sending: None,
    };
    let j = serde_json::to_value(&v).unwrap();
    assert!(j.get("receiving").is_none(), "no transfer, no field: {j}");
    assert!(j.get("sending").is_none(), "no send, no field: {j}");
    assert_eq!(j["socket"], Value::Null);
    assert!(j.get("quarantined_io").is_none());
    assert!(j.get("qos").is_none(), "no limits, no qos field: {j}");
    assert!(
        j.get("thin").is_none(),
        "thick volumes have no thin field: {j}"
    );
    assert!(
        j.get("mirror").is_none(),
        "plain volumes have no mirror field: {j}"
    );
    assert_eq!(j["name"], json!("v"));
    let back: Volume = serde_json::from_value(j).unwrap();
    assert_eq!(back.info.name, "v");
}

#[test]
fn event_kinds_are_the_monitors_strings() {
    for k in [
        "state",
        "warning",
        "replaced",
        "restored",
        "mirror",
        "pool-space",
        "send",
    ] {
        let kind = HealthEventKind::parse(k).unwrap();
        assert_eq!(serde_json::to_value(kind).unwrap(), json!(k));
    }
    assert_eq!(HealthEventKind::parse("other"), None);
    for (kind, name) in FaultKind::ALL {
        assert_eq!(FaultKind::parse(name), Some(kind));
    }
}

#[test]
fn volume_qos_params_and_limits_on_the_wire() {
    let p: VolumeQosParams =
        serde_json::from_value(json!({"id": "v", "iops": "20k", "bps": 1024, "burst_ms": 100}))
            .unwrap();
    let c = p.change().unwrap();
    assert_eq!(
        (c.iops, c.bps, c.burst_ms, c.clear),
        (Some(20_000), Some(1024), Some(100), false)
    );
    assert_eq!(c.read_iops, None);
    let e = serde_json::from_value::<VolumeQosParams>(json!({"id": "v", "iopz": 1})).unwrap_err();
    assert!(e.to_string().contains("unknown field `iopz`"), "{e}");
    let bad: VolumeQosParams =
        serde_json::from_value(json!({"id": "v", "write_bps": "fast"})).unwrap();
    let e = bad.change().unwrap_err().to_string();
    assert!(e.contains("write_bps \"fast\" is not a bandwidth"), "{e}");
    let q = QosLimits {
        iops: 1000,
        read_iops: 0,
        write_iops: 0,
        bps: 0,
        read_bps: 0,
        write_bps: 0,
        burst_ms: 1000,
        weight: 0,
        priority: Priority::Normal,
    };
    assert_eq!(wire(&q), r#"{"burst_ms":1000,"iops":1000}"#);
    let clear = VolumeQosParams {
        id: "v".into(),
        clear: true,
        ..VolumeQosParams::default()
    };
    assert_eq!(wire(&clear), r#"{"clear":true,"id":"v"}"#);
}

/// A thick volume's hello is what a spoold from before the `thin` field reads (it refuses
/// unknown fields); a thin one's says so, and reads back.
#[test]
fn a_transfer_hello_names_thin_only_for_thin_volumes() {
    let mut hello = TransferHello {
        version: TRANSFER_VERSION,
        nonce: "ab".repeat(32),
        sender_nonce: "ef".repeat(32),
        proof: "cd".repeat(32),
        volume: "v".into(),
        size: 1 << 20,
        num_queues: 1,
        copies: 1,
        qos: None,
        key: None,
        thin: false,
        replica: false,
        epoch: 0,
        current: false,
        ask: false,
    };
    assert!(!wire(&hello).contains("thin"), "{}", wire(&hello));
    // Nor does a move's hello name a replica or an epoch it does not have.
    let w = wire(&hello);
    assert!(!w.contains("replica") && !w.contains("epoch"), "{w}");
    hello.thin = true;
    (hello.replica, hello.epoch, hello.current) = (true, 3, true);
    let back: TransferHello = serde_json::from_str(&wire(&hello)).unwrap();
    assert_eq!(back, hello);
}
