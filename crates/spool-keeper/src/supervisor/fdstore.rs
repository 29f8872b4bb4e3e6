//! The keeper's store mirrored into systemd's file-descriptor store, so that a keeper that
//! dies (and with it, by PR_SET_PDEATHSIG, its worker) is restarted by systemd with every
//! descriptor of every VM connection still open: systemd holds them meanwhile, and the new
//! keeper rebuilds its store from them and starts a worker as after a worker crash.
//!
//! Layout in systemd's store: each distinct open file once, named `fd-N` (systemd ignores a
//! second copy of a file it already holds, so names are per file, never per key), and one
//! memfd `index-G` with every key, its value and the names of its files. A change deposits
//! the new files first, then the new index, then removes the previous index and the files no
//! key refers to any more: whatever instant the keeper dies at, the newest index systemd holds
//! is complete.
//!
//! Owns: the naming, the index and the restore. Must not know: what keys and files mean.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd};

use serde::{Deserialize, Serialize};

use super::Kept;
use crate::proto::RestartHistory;
use crate::systemd::{Inherited, Notifier};

const INDEX_PREFIX: &str = "index-";
const INDEX_FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Index {
    format: u32,
    /// The keeper's worker generation, continued by the next keeper.
    generation: u64,
    entries: Vec<IndexEntry>,
    /// Restarts and upgrades by kind, continued by the next keeper.
    #[serde(default)]
    restarts: BTreeMap<String, u64>,
    /// Their stalls and phases by kind, continued by the next keeper.
    #[serde(default)]
    history: RestartHistory,
}

#[derive(Serialize, Deserialize)]
struct IndexEntry {
    key: String,
    value: String,
    fds: Vec<String>,
}

/// A store rebuilt from systemd's, its worker generation, restart counts and history.
pub(super) type Restored = (
    BTreeMap<String, Kept>,
    u64,
    BTreeMap<String, u64>,
    RestartHistory,
);

/// What identifies an open file cheaply; equal ids are confirmed with kcmp(2).
pub(super) type FileId = (u64, u64);

pub(super) fn file_id(f: &File) -> FileId {
    match f.metadata() {
        Ok(m) => (
            std::os::unix::fs::MetadataExt::dev(&m),
            std::os::unix::fs::MetadataExt::ino(&m),
        ),
        Err(_) => (u64::MAX, f.as_raw_fd() as u64),
    }
}

/// True when `a` and `b` are the same open file (not merely the same inode: every eventfd
/// shares one anonymous inode).
fn same_file(a: &File, a_id: FileId, b: &File, b_id: FileId) -> bool {
    if a_id != b_id {
        return false;
    }
    let pid = std::process::id() as libc::c_long;
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp(2) compares two of our own descriptors by number; no memory is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            a.as_raw_fd() as libc::c_long,
            b.as_raw_fd() as libc::c_long,
        )
    };
    // Without kcmp (r < 0), equal device and inode is the best we know.
    r <= 0
}

/// The mirror of the keeper's store in systemd's.
pub(super) struct FdStore {
    notifier: Notifier,
    next_fd: u64,
    index: u64,
    /// Names systemd holds for us (files and the current index).
    held: BTreeSet<String>,
    warned: bool,
}

impl FdStore {
    pub(super) fn new(notifier: Notifier) -> FdStore {
        FdStore {
            notifier,
            next_fd: 1,
            index: 0,
            held: BTreeSet::new(),
            warned: false,
        }
    }

    pub(super) fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    fn send(&mut self, state: &str, fds: &[i32]) {
        if let Err(e) = self.notifier.send(state, fds) {
            if !self.warned {
                tracing::error!("keeper: systemd's descriptor store refused a message ({e}); a keeper restart may make VMs reconnect");
                self.warned = true;
            }
        }
    }

    /// Names for `files` about to be stored: a file systemd already holds (under any key)
    /// keeps its name; a new one is deposited under a new name.
    pub(super) fn name_files(
        &mut self,
        store: &BTreeMap<String, Kept>,
        files: &[File],
        ids: &[FileId],
    ) -> Vec<String> {
        files
            .iter()
            .zip(ids)
            .map(|(f, &id)| {
                let known = store.values().find_map(|k| {
                    k.files
                        .iter()
                        .zip(&k.ids)
                        .zip(&k.names)
                        .find_map(|((g, &gid), n)| same_file(f, id, g, gid).then(|| n.clone()))
                });
                known.unwrap_or_else(|| {
                    let name = format!("fd-{}", self.next_fd);
                    self.next_fd += 1;
                    self.send(&format!("FDSTORE=1\nFDNAME={name}"), &[f.as_raw_fd()]);
                    self.held.insert(name.clone());
                    name
                })
            })
            .collect()
    }

    /// Deposits a new index of `store`, then drops the old index and unreferenced files.
    pub(super) fn publish(
        &mut self,
        store: &BTreeMap<String, Kept>,
        generation: u64,
        restarts: &BTreeMap<String, u64>,
        history: &RestartHistory,
    ) {
        let index = Index {
            format: INDEX_FORMAT,
            generation,
            restarts: restarts.clone(),
            history: history.clone(),
            entries: store
                .iter()
                .map(|(k, v)| IndexEntry {
                    key: k.clone(),
                    value: v.value.clone(),
                    fds: v.names.clone(),
                })
                .collect(),
        };
        let memfd = match write_memfd(&index) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!("keeper: cannot write the descriptor store's index: {e}");
                return;
            }
        };
        self.index += 1;
        let name = format!("{INDEX_PREFIX}{}", self.index);
        self.send(&format!("FDSTORE=1\nFDNAME={name}"), &[memfd.as_raw_fd()]);
        let referenced: BTreeSet<&String> = store.values().flat_map(|k| &k.names).collect();
        let stale: Vec<String> = self
            .held
            .iter()
            .filter(|n| !referenced.contains(n))
            .cloned()
            .collect();
        for n in stale {
            self.send(&format!("FDSTOREREMOVE=1\nFDNAME={n}"), &[]);
            self.held.remove(&n);
        }
        self.held.insert(name);
    }

    /// Rebuilds the store from what systemd passed back: the newest readable index, its files
    /// by name. Returns the store and the generation it had; anything else systemd held is
    /// removed from its store.
    pub(super) fn restore(&mut self, inherited: Vec<Inherited>) -> Option<Restored> {
        let mut by_name: BTreeMap<String, File> =
            inherited.into_iter().map(|i| (i.name, i.file)).collect();
        let mut indexes: Vec<(u64, String)> = by_name
            .keys()
            .filter_map(|n| Some((n.strip_prefix(INDEX_PREFIX)?.parse().ok()?, n.clone())))
            .collect();
        indexes.sort();
        let newest = indexes.iter().rev().find_map(|(g, n)| {
            let f = by_name.get_mut(n)?;
            match read_memfd(f) {
                Ok(ix) => Some((*g, n.clone(), ix)),
                Err(e) => {
                    tracing::error!(index = %n, "keeper: ignoring an unreadable descriptor-store index: {e}");
                    None
                }
            }
        });
        for name in by_name.keys() {
            if let Some(n) = name.strip_prefix("fd-").and_then(|n| n.parse::<u64>().ok()) {
                self.next_fd = self.next_fd.max(n + 1);
            }
            self.held.insert(name.clone());
        }
        self.index = indexes.last().map(|(g, _)| *g).unwrap_or(0);
        let (_, index_name, ix) = newest?;
        by_name.remove(&index_name);
        let mut store = BTreeMap::new();
        'entries: for e in ix.entries {
            let mut files = Vec::new();
            for n in &e.fds {
                let Some(f) = by_name.get(n).and_then(|f| f.try_clone().ok()) else {
                    tracing::error!(key = %e.key, fd = %n, "keeper: systemd did not give back a descriptor of this entry; dropping it");
                    continue 'entries;
                };
                files.push(f);
            }
            let ids = files.iter().map(file_id).collect();
            store.insert(
                e.key,
                Kept {
                    value: e.value,
                    files,
                    names: e.fds,
                    ids,
                },
            );
        }
        Some((store, ix.generation, ix.restarts, ix.history))
    }
}

fn write_memfd(index: &Index) -> std::io::Result<File> {
    let body = serde_json::to_vec(index).map_err(std::io::Error::other)?;
    // SAFETY: memfd_create takes a NUL-terminated name and flags; the new descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"spool-keeper-index".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let mut f = unsafe { File::from_raw_fd(fd) };
    f.write_all(&body)?;
    Ok(f)
}

fn read_memfd(f: &mut File) -> std::io::Result<Index> {
    let mut body = Vec::new();
    f.rewind()?;
    f.read_to_end(&mut body)?;
    let ix: Index = serde_json::from_slice(&body).map_err(std::io::Error::other)?;
    if ix.format != INDEX_FORMAT {
        return Err(std::io::Error::other(format!(
            "index format {} (this keeper reads {INDEX_FORMAT})",
            ix.format
        )));
    }
    Ok(ix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{SocketAddr, UnixDatagram};

    fn store_with_listener(tag: &str) -> (FdStore, UnixDatagram) {
        let name = format!("spool-fdstore-test-{tag}-{}", std::process::id());
        let addr =
            <SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name.as_bytes())
                .unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::connect(format!("@{name}").as_ref()).unwrap();
        (FdStore::new(n), server)
    }

    fn memfd_with(body: &[u8]) -> File {
        // SAFETY: a NUL-terminated name and flags; the descriptor is ours.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: just created, owned by nobody else.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(body).unwrap();
        f
    }

    fn inherited(name: &str, file: File) -> Inherited {
        Inherited {
            name: name.into(),
            file,
        }
    }

    #[test]
    fn a_corrupt_newest_index_falls_back_to_the_previous_one_and_lost_files_drop_their_key() {
        let (mut sd, _server) = store_with_listener("restore");
        let good = Index {
            format: INDEX_FORMAT,
            generation: 7,
            restarts: BTreeMap::new(),
            history: RestartHistory::new(),
            entries: vec![
                IndexEntry {
                    key: "vol/a".into(),
                    value: "{}".into(),
                    fds: vec!["fd-3".into(), "fd-3".into()],
                },
                IndexEntry {
                    key: "vol/b".into(),
                    value: "{}".into(),
                    fds: vec!["fd-9".into()],
                },
            ],
        };
        let got = sd
            .restore(vec![
                inherited("fd-3", tempfile::tempfile().unwrap()),
                inherited("index-4", memfd_with(&serde_json::to_vec(&good).unwrap())),
                inherited("index-5", memfd_with(b"{\"format\": 1, \"generation\": tr")),
                inherited(
                    "index-6",
                    memfd_with(br#"{"format":99,"generation":1,"entries":[]}"#),
                ),
            ])
            .expect("the older, intact index");
        let (store, generation, _, _) = got;
        assert_eq!(generation, 7);
        assert_eq!(
            store.keys().collect::<Vec<_>>(),
            ["vol/a"],
            "vol/b lost fd-9"
        );
        assert_eq!(store["vol/a"].files.len(), 2);
        assert_eq!(sd.next_fd, 4);
        assert_eq!(sd.index, 6, "the next index is newer than every one seen");
        // Publishing drops the unreadable indexes systemd still holds.
        sd.publish(&store, generation, &BTreeMap::new(), &RestartHistory::new());
        assert!(sd.held.contains("index-7") && sd.held.contains("fd-3"));
        assert!(!sd.held.contains("index-5") && !sd.held.contains("index-4"));
    }

    #[test]
    fn a_file_already_stored_keeps_its_name_and_an_eventfd_is_told_from_another() {
        let (mut sd, _server) = store_with_listener("names");
        let mut store = BTreeMap::new();
        // SAFETY: eventfd(2) with flags only; the descriptors are ours.
        let (e1, e2) = unsafe {
            (
                File::from_raw_fd(libc::eventfd(0, libc::EFD_CLOEXEC)),
                File::from_raw_fd(libc::eventfd(0, libc::EFD_CLOEXEC)),
            )
        };
        let files = vec![e1.try_clone().unwrap()];
        let ids: Vec<_> = files.iter().map(file_id).collect();
        let names = sd.name_files(&store, &files, &ids);
        store.insert(
            "k".to_string(),
            Kept {
                value: String::new(),
                files,
                names: names.clone(),
                ids,
            },
        );
        let again = vec![e1.try_clone().unwrap(), e2];
        let ids2: Vec<_> = again.iter().map(file_id).collect();
        assert_eq!(ids2[0], ids2[1], "eventfds share one inode");
        let names2 = sd.name_files(&store, &again, &ids2);
        assert_eq!(names2[0], names[0], "the same eventfd keeps its name");
        assert_ne!(names2[1], names[0], "another eventfd gets its own");
    }
}
