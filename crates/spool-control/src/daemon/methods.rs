//! The daemon's method table: every method of the typed API (`crate::api`) with the handler
//! that answers it (registered by the module that holds the handler), and serving that table
//! on the RPC socket.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;

use super::Daemon;
use crate::kept::RPC_LISTEN_KEY;
use crate::rpc::{self, MethodTable};

/// Every method spoold answers, in the order docs/rpc.md lists them.
pub fn method_table() -> MethodTable<Daemon> {
    let mut t = MethodTable::default();
    super::devices::register(&mut t);
    super::volumes::register(&mut t);
    super::mirrors::register(&mut t);
    super::snapshots::register(&mut t);
    super::exports::register(&mut t);
    super::receive::register(&mut t);
    super::replica::register(&mut t);
    super::send::register(&mut t);
    super::stats::register(&mut t);
    super::status::register(&mut t);
    t
}

impl Daemon {
    /// Binds the RPC socket (mode 0600), or adopts the one the keeper kept, deposits it with
    /// the keeper, and serves the method table on a background thread.
    pub fn serve_rpc(self: &Arc<Self>) -> std::io::Result<()> {
        let listener = match self.take_kept_rpc_listener() {
            Some(l) => l,
            None => rpc::bind(&self.cfg.rpc_socket)?,
        };
        self.keep_rpc_listener(&listener);
        rpc::serve(listener, Arc::new(method_table()), Arc::downgrade(self))
    }

    /// What the keeper left for the RPC socket.
    fn take_kept_rpc_listener(&self) -> Option<UnixListener> {
        let (_, f) = self.keeping.as_ref()?.take(RPC_LISTEN_KEY)?;
        let f = f.into_iter().next()?;
        Some(UnixListener::from(std::os::fd::OwnedFd::from(f)))
    }

    /// Deposits the RPC listening socket with the keeper.
    fn keep_rpc_listener(&self, l: &UnixListener) {
        if let Some(s) = &self.store {
            if let Err(e) = s.put(RPC_LISTEN_KEY, "{}".into(), &[l.as_raw_fd()]) {
                tracing::error!("cannot deposit the RPC socket with the keeper: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The method list is derived from the table; docs/rpc.md must describe every method.
    #[test]
    fn every_method_is_documented() {
        let doc = include_str!("../../../../docs/rpc.md");
        let t = method_table();
        let names: Vec<_> = t.methods().map(|m| m.name).collect();
        assert_eq!(names.len(), 36, "{names:?}");
        for n in names {
            assert!(doc.contains(&format!("| `{n}` |")), "docs/rpc.md lacks {n}");
        }
    }
}
