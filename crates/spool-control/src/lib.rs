//! Control plane: the `spoold` process (config, start-up, signals, JSON-RPC API) and the
//! client side `spoolctl` uses.
//!
//! Owns: turning a config file or RPC call into pool and frontend operations, and the
//! socket layout under the state directory. The typed control API (`api`: the `spool-api`
//! crate) is shared by both ends, and `wire` converts the lower layers' reports into it;
//! `rpc` carries it (errors, method table, socket) without knowing the daemon, which
//! registers a handler per method (`daemon`); `kept` names what is kept with the keeper.
//!
//! Must not know: virtio or on-device formats; it talks to the pool and frontend layers only
//! through their public APIs.

pub use spool_api as api;
pub use spool_api::size;
pub mod config;
pub mod daemon;
pub mod faults;
pub mod kept;
pub mod metrics;
pub mod qos;
pub mod rpc;
pub mod wire;

pub use config::Config;
pub use daemon::{Daemon, Keeping};

/// A ready-to-paste QEMU command line that boots a VM with `socket` as its disk.
pub fn qemu_command_line(socket: &std::path::Path, name: &str, num_queues: u16) -> String {
    format!(
        "qemu-system-x86_64 -machine q35 -accel kvm -cpu host -smp 2 -m 1G \\\n  \
         -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={name},path={},reconnect=1 \\\n  \
         -device vhost-user-blk-pci,chardev={name},num-queues={num_queues} \\\n  \
         -kernel YOUR_KERNEL -append 'console=ttyS0 root=/dev/vda' -nographic",
        socket.display()
    )
}
