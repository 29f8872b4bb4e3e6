//! The transfers a volume's host expects (`volume receive NAME --token`, docs/transfer.md):
//! each with its token, kept with the keeper so that a worker restart forgets neither an
//! expectation nor the token a sender's hello proves (a replica's sender says hello again
//! long after the first: docs/replicas.md).
//!
//! Owns: [`Expected`] and its kept form. Must not know: the hello's framing and proofs.

use super::Daemon;

/// A volume a sender may send here, with its token (`volume receive NAME --token`), and
/// the volume a hello was answered for: a later hello with the token gets the same export
/// while that transfer runs, and nothing once it has ended.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Expected {
    pub(super) volume: String,
    pub(super) token: String,
    /// The largest volume the sender may send (`volume receive --max-size`).
    pub(super) max_size: Option<u64>,
    /// A standing replica (`volume receive --replica`), not a move.
    pub(super) replica: bool,
    pub(super) answered: Option<uuid::Uuid>,
}

/// Where the keeper keeps each expected transfer (`expected/NAME/`).
const EXPECTED_PREFIX: &str = "expected/";

fn expected_key(volume: &str) -> String {
    format!("{EXPECTED_PREFIX}{volume}/")
}

impl Daemon {
    /// Keeps expectation `e` with the keeper, so that the next worker expects it too (and
    /// a replica's sender can still say its copy became current).
    pub(super) fn keep_expected(&self, e: &Expected) {
        let Some(s) = &self.store else { return };
        let value = serde_json::to_string(e).unwrap_or_default();
        if let Err(err) = s.put(&expected_key(&e.volume), value, &[]) {
            tracing::error!(volume = %e.volume, "cannot keep the expected transfer with the keeper ({err}): a worker restart forgets it");
        }
    }

    pub(super) fn forget_kept_expected(&self, name: &str) {
        if let Some(s) = &self.store {
            if let Err(e) = s.remove(&expected_key(name)) {
                tracing::error!(volume = %name, "keeper: {e}");
            }
        }
    }

    /// Expects again the transfers the previous worker expected.
    pub(super) fn restore_expected(&self) {
        let Some(k) = &self.keeping else { return };
        let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        for key in k.keys(EXPECTED_PREFIX) {
            let kept = k
                .take(&key)
                .map(|(v, _)| serde_json::from_str::<Expected>(&v));
            match kept {
                Some(Ok(e)) => {
                    self.keep_expected(&e);
                    expected.push(e);
                }
                _ => tracing::warn!(%key, "a kept expected transfer cannot be read: forgotten"),
            }
        }
    }
}
