//! Shrinking a failing case: steps are taken out (halves, then quarters, down to single
//! steps) while the case still fails, as delta debugging does, within a budget of runs.
//!
//! Owns: the reduction. Must not know: what steps do.

use crate::case::Case;
use crate::run::Failure;

/// The shortest case found that still fails, its failure, and the runs it took; at most
/// `budget` runs of `run`.
pub fn shrink(
    case: &Case,
    failure: Failure,
    budget: usize,
    run: &mut dyn FnMut(&Case) -> Result<(), Failure>,
) -> (Case, Failure, usize) {
    let mut best = case.clone();
    // Steps after the failing one never ran.
    best.steps.truncate(failure.step + 1);
    let mut last = failure;
    let mut runs = 0;
    let mut chunk = best.steps.len().div_ceil(2);
    while chunk >= 1 && runs < budget {
        let mut i = 0;
        let mut progressed = false;
        while i < best.steps.len() && runs < budget {
            let mut cand = best.clone();
            let end = (i + chunk).min(cand.steps.len());
            cand.steps.drain(i..end);
            runs += 1;
            match run(&cand) {
                Err(f) => {
                    cand.steps.truncate(f.step + 1);
                    best = cand;
                    last = f;
                    progressed = true;
                }
                Ok(()) => i += chunk,
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    (best, last, runs)
}
