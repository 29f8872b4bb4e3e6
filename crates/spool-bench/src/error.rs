//! What stops a benchmark run, with the messages spool-bench prints for it.
//!
//! Owns: [`BenchError`], the error of the plain run and of the A/B mode.
//!
//! Must not know: how the load is generated or reported.

/// Why a run could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A libblkio call failed (`what` names the step or property).
    #[error("{what}: {message}")]
    Blkio { what: &'static str, message: String },
    #[error("device smaller than one block")]
    TooSmall,
    /// The server started no queue.
    #[error("no queue")]
    NoQueue,
    /// The `--timeline` file could not be written.
    #[error("{path}: {source}")]
    Timeline {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A/B mode: no pair of slices had completions on both sides.
    #[error("no pair of slices completed requests on both sides ({errors} requests failed)")]
    NoPairs { errors: u64 },
    /// A/B mode: an error of one of the two servers, named by its socket.
    #[error("{socket}: {source}")]
    Socket {
        socket: String,
        #[source]
        source: Box<BenchError>,
    },
}

impl BenchError {
    /// Turns a failed libblkio call at step `what` into a [`BenchError::Blkio`].
    pub fn blkio(what: &'static str) -> impl Fn(blkio::Error) -> BenchError {
        move |err| BenchError::Blkio {
            what,
            message: err.message().to_string(),
        }
    }
}
