//! A minimal QMP client (QEMU's JSON monitor over a Unix socket) for the migration tests:
//! greeting, capabilities, commands; events are skipped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects to the QMP socket at `path` (waiting up to 60 s for QEMU to create it).
    pub fn connect(path: &Path) -> Qmp {
        let deadline = Instant::now() + Duration::from_secs(60);
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "QMP {}: {e}", path.display());
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut q = Qmp {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
        };
        let greeting = q.line().expect("QMP greeting");
        assert!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        q.execute("qmp_capabilities", json!({})).unwrap();
        q
    }

    /// The next message, or `{"io": ...}` when QEMU closed the connection.
    fn line(&mut self) -> Result<Value, Value> {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(0) => Err(json!({ "io": "QMP connection closed" })),
            Ok(_) => Ok(serde_json::from_str(&l).unwrap_or_else(|e| panic!("QMP sent {l:?}: {e}"))),
            Err(e) => Err(json!({ "io": e.to_string() })),
        }
    }

    /// Runs `cmd`: its return value, or the error QEMU gave (`{"io": ...}` when QEMU was
    /// gone before it answered).
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value, Value> {
        let msg = json!({ "execute": cmd, "arguments": args });
        if let Err(e) = writeln!(self.writer, "{msg}") {
            return Err(json!({ "io": e.to_string() }));
        }
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(e.clone());
            }
        }
    }
}
