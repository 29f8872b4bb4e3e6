//! A TCP link between two hosts that a test can cut: a forwarder on a free port of
//! 127.0.0.1 to a target address. Cutting it shuts every connection down and turns new ones
//! away until it is mended, as a network partition looks to both ends (the target keeps
//! running, its listener untouched).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Link {
    pub port: u16,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    /// Connections forwarded so far.
    pub accepted: Arc<AtomicU64>,
}

impl Link {
    /// Forwards every connection to `to` until dropped.
    pub fn start(to: SocketAddr) -> Link {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let (cut, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));
        let (c, s, k, n) = (cut.clone(), stop.clone(), conns.clone(), accepted.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((inner, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: the link is cut
                }
                let Ok(outer) = TcpStream::connect(to) else {
                    continue;
                };
                inner.set_nonblocking(false).unwrap();
                let _ = inner.set_nodelay(true);
                let _ = outer.set_nodelay(true);
                let mut kept = k.lock().unwrap();
                kept.push(inner.try_clone().unwrap());
                kept.push(outer.try_clone().unwrap());
                drop(kept);
                n.fetch_add(1, Ordering::SeqCst);
                pump(inner.try_clone().unwrap(), outer.try_clone().unwrap());
                pump(outer, inner);
            }
        });
        Link {
            port,
            cut,
            stop,
            conns,
            accepted,
        }
    }

    /// Cuts the link for `time`: open connections are shut down, new ones turned away.
    pub fn cut(&self, time: Duration) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        std::thread::sleep(time);
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` on a thread of its own until either end closes.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
