//! The kernel layer's one outcome channel: every call of a fused op, from the shim or from an
//! override built in Rust, noted under its op as run on speedkit's kernel or fallen back to ATen
//! with the reason. The audit, the profiler and the runner's `kernels` column read these notes.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

use serde::Serialize;

use super::KernelOp;
use crate::ffi;

/// What happened to one op: it ran on its kernel, or took ATen's path for a reason.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The op ran on speedkit's kernel.
    Ran,
    /// The op ran ATen's composite, for this reason.
    FellBack(String),
}

/// One distinct note of the kernel layer and how often it happened.
///
/// ```
/// for note in speedkit::kernels::notes() {
///     println!("{}: {:?} ×{}", note.op, note.outcome, note.count);
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelNote {
    /// The op.
    pub op: KernelOp,
    /// What happened.
    pub outcome: Outcome,
    /// How many calls it happened to.
    pub count: u64,
}

impl fmt::Display for KernelNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let calls = if self.count == 1 { "call" } else { "calls" };
        match &self.outcome {
            Outcome::Ran => write!(
                f,
                "{}: ran on speedkit's kernel ({} {calls})",
                self.op, self.count
            ),
            Outcome::FellBack(reason) => write!(
                f,
                "{}: {reason}: ran ATen's composite instead ({} {calls})",
                self.op, self.count
            ),
        }
    }
}

/// Every distinct note since the process started, in order of first occurrence. An op switched off
/// is not noted (the plan says so already).
pub fn notes() -> Vec<KernelNote> {
    ffi::kernels::notes()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|n| {
            Some(KernelNote {
                op: KernelOp::from_code(n.op)?,
                outcome: n.reason.map_or(Outcome::Ran, Outcome::FellBack),
                count: n.count,
            })
        })
        .collect()
}

/// Notes that `op` ran on its kernel (`fell_back` `None`) or took ATen's path for that reason: how
/// the overrides built in Rust ([`crate::overrides`]) report to the channel the shim's ops use.
pub(crate) fn note(op: KernelOp, fell_back: Option<&str>) {
    // Fails only for an op code outside the header's, which KernelOp excludes.
    let _ = ffi::kernels::note(op.code(), fell_back);
}

/// The notes as they stand at one moment, to read what happened after it ([`NoteMark::since`]):
/// what a context's audit shows, and what a test asserts about the calls it made.
///
/// ```
/// use speedkit::kernels::NoteMark;
/// let mark = NoteMark::now();
/// // ... run some ops ...
/// assert!(mark.since().iter().all(|n| n.count > 0));
/// ```
#[derive(Clone, Debug, Default)]
pub struct NoteMark(BTreeMap<(KernelOp, Outcome), u64>);

impl NoteMark {
    /// The notes now.
    pub fn now() -> Self {
        Self(
            notes()
                .into_iter()
                .map(|n| ((n.op, n.outcome), n.count))
                .collect(),
        )
    }

    /// What was noted after this mark, with the counts of those calls only, in order of first
    /// occurrence.
    pub fn since(&self) -> Vec<KernelNote> {
        notes()
            .into_iter()
            .filter_map(|mut n| {
                let before = self.0.get(&(n.op, n.outcome.clone())).copied().unwrap_or(0);
                n.count = n.count.checked_sub(before).filter(|&c| c > 0)?;
                Some(n)
            })
            .collect()
    }

    /// The ops that fell back after this mark, as `"op: reason"`, each once.
    pub fn fallbacks_since(&self) -> Vec<String> {
        fallback_lines(self.since())
    }
}

fn fallback_lines(notes: Vec<KernelNote>) -> Vec<String> {
    notes
        .into_iter()
        .filter_map(|n| match n.outcome {
            Outcome::FellBack(reason) => Some(format!("{}: {reason}", n.op)),
            Outcome::Ran => None,
        })
        .collect()
}

/// The distinct reasons an op ran on ATen instead of a kernel so far in the process, each once,
/// as `"op: reason"`.
///
/// ```
/// for line in speedkit::kernels::fallbacks() {
///     println!("{line}");
/// }
/// ```
pub fn fallbacks() -> Vec<String> {
    fallback_lines(notes())
}

/// Where [`take_ops_run`] counts from.
static OPS_RUN_MARK: Mutex<Option<NoteMark>> = Mutex::new(None);

/// The ops (`layer_norm`, `cross_entropy`, ...) that ran on speedkit's kernels since the previous
/// call, each once, and starts counting afresh: the benchmark runner reports them per row.
///
/// ```
/// let _ = speedkit::kernels::take_ops_run();
/// assert!(speedkit::kernels::take_ops_run().is_empty());   // nothing ran in between
/// ```
pub fn take_ops_run() -> Vec<&'static str> {
    let mut mark = OPS_RUN_MARK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let now = NoteMark::now();
    let ran = mark
        .take()
        .unwrap_or_default()
        .since()
        .into_iter()
        .filter(|n| n.outcome == Outcome::Ran)
        .map(|n| n.op.name())
        .collect();
    *mark = Some(now);
    ran
}
