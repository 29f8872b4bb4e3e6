//! A VM defined through libvirt (the shipped contrib/libvirt-domain.xml: `<disk
//! type='vhostuser'>`, memfd shared memory) runs the verifying fio job on a spoold volume
//! while the worker is SIGKILLed and upgraded: the libvirt-managed QEMU never reconnects and
//! fio sees no error. `#[ignore]`d like the other guest tests (scripts/test.sh runs them), against a private
//! libvirtd (common/libvirt.rs).

mod common;

use std::time::{Duration, Instant};

use common::guest::{assert_pass, guest_dir, KILLTEST_CONFIG};
use common::libvirt::Libvirtd;
use common::Spoold;

#[test]
#[ignore = "needs QEMU and the test guest: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn a_libvirt_domain_keeps_its_spool_disk_across_worker_kills_and_upgrades() {
    let d = Spoold::start(KILLTEST_CONFIG);
    let lv = Libvirtd::start();
    let console = d.dir.path().join("libvirt.console");
    let g = guest_dir();
    let xml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/libvirt-domain.xml"
    ))
    .unwrap()
    .replace("@DOMAIN_TYPE@", "qemu") // TCG here; "kvm" on a host that has it
    .replace("@NAME@", "spool-libvirt-test")
    .replace("@KERNEL@", &g.join("vmlinuz").display().to_string())
    .replace(
        "@INITRD@",
        &g.join("initramfs.cpio.gz").display().to_string(),
    )
    .replace(
        "@CMDLINE@",
        "console=ttyS0 quiet panic=-1 spool.job=killtest spool.runtime=25",
    )
    .replace("@SOCKET@", &d.socket("vm").display().to_string())
    .replace("@CONSOLE@", &console.display().to_string());
    assert!(!xml.contains('@'), "a placeholder was left: {xml}");
    let xml_path = d.dir.path().join("domain.xml");
    std::fs::write(&xml_path, &xml).unwrap();
    let (ok, out) = lv.virsh(&["create", xml_path.to_str().unwrap()]);
    assert!(ok, "virsh create: {out}\n{}", lv.log());
    let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(240);
    while !read_console().contains("SPOOL-E2E: disk") {
        assert!(
            Instant::now() < deadline,
            "guest did not start: {}",
            read_console()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        d.kill_worker();
        std::thread::sleep(Duration::from_millis(1500));
        let r = d.upgrade(None).expect("upgrade");
        assert_eq!(r["outcome"], "ok", "{r}");
    }
    // The domain is transient: it disappears when the guest powers off.
    let deadline = Instant::now() + Duration::from_secs(300);
    while lv.virsh(&["domstate", "spool-libvirt-test"]).0 {
        assert!(
            Instant::now() < deadline,
            "the guest did not finish: {}",
            read_console()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_pass(&read_console(), &d, "killtest under libvirt");
    assert_eq!(
        d.log().matches("frontend connected").count(),
        1,
        "the libvirt-managed QEMU reconnected\n{}",
        d.log()
    );
}
