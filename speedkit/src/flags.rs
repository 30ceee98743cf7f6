//! PyTorch's global speed flags: one registry, typed access, and a [`FlagGuard`] that applies a set of
//! changes, records each one with its reason, and restores them all when it drops.
//!
//! # The thread rule
//! These flags live in libtorch's process-wide `at::globalContext()`: a change made on one thread is
//! seen by every thread. A [`FlagGuard`] is therefore neither `Send` nor `Sync` (it must be dropped
//! where it was created, in LIFO order with other guards), and two threads must not apply different
//! plans at the same time. Nested guards on one thread compose: each restores what it found.
//!
//! ```compile_fail
//! fn assert_send<T: Send>() {}
//! assert_send::<speedkit::flags::FlagGuard>(); // a guard cannot move to another thread
//! ```
//! ```compile_fail
//! fn assert_send<T: Send>() {}
//! assert_send::<speedkit::SpeedContext>(); // nor can the context that owns one
//! ```
//!
//! ```
//! use speedkit::flags::{Flag, FlagGuard, FlagSetting, FlagValue};
//! let before = Flag::CudnnBenchmark.get()?;
//! {
//!     let guard = FlagGuard::apply(&[FlagSetting::new(
//!         Flag::CudnnBenchmark,
//!         FlagValue::Bool(!before.as_bool().unwrap()),
//!         "example",
//!     )])?;
//!     assert_ne!(Flag::CudnnBenchmark.get()?, before);
//!     assert_eq!(guard.changes().len(), 1);
//! } // restored here
//! assert_eq!(Flag::CudnnBenchmark.get()?, before);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use serde::Serialize;
use std::fmt;
use std::marker::PhantomData;

use crate::config::MatmulPrecision;
use crate::error::{Result, SpeedkitError};
use crate::ffi;

/// Every global flag speedkit may touch, named as PyTorch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Flag {
    /// `torch.backends.cuda.matmul.allow_tf32`
    CudaMatmulAllowTf32,
    /// `torch.get_float32_matmul_precision()` (`highest` | `high` | `medium`)
    Float32MatmulPrecision,
    /// `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`
    CudaMatmulAllowBf16ReducedPrecisionReduction,
    /// `torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`
    CudaMatmulAllowFp16ReducedPrecisionReduction,
    /// `torch.backends.cudnn.allow_tf32`
    CudnnAllowTf32,
    /// `torch.backends.cudnn.benchmark`
    CudnnBenchmark,
    /// `torch.backends.cudnn.deterministic`
    CudnnDeterministic,
    /// `torch.backends.cudnn.enabled`
    CudnnEnabled,
    /// `torch.backends.cuda.flash_sdp_enabled()`
    SdpFlash,
    /// `torch.backends.cuda.mem_efficient_sdp_enabled()`
    SdpMemEfficient,
    /// `torch.backends.cuda.math_sdp_enabled()`
    SdpMath,
    /// `torch.backends.cuda.cudnn_sdp_enabled()`
    SdpCudnn,
    /// `torch.are_deterministic_algorithms_enabled()` (`torch.use_deterministic_algorithms`)
    DeterministicAlgorithms,
}

/// The kind of value a flag holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlagKind {
    /// `true`/`false`.
    Bool,
    /// A [`MatmulPrecision`].
    MatmulPrecision,
}

impl Flag {
    /// Every flag, in the order reports list them.
    pub const ALL: [Flag; 13] = [
        Flag::CudaMatmulAllowTf32,
        Flag::Float32MatmulPrecision,
        Flag::CudaMatmulAllowBf16ReducedPrecisionReduction,
        Flag::CudaMatmulAllowFp16ReducedPrecisionReduction,
        Flag::CudnnAllowTf32,
        Flag::CudnnBenchmark,
        Flag::CudnnDeterministic,
        Flag::CudnnEnabled,
        Flag::SdpFlash,
        Flag::SdpMemEfficient,
        Flag::SdpMath,
        Flag::SdpCudnn,
        Flag::DeterministicAlgorithms,
    ];

    /// PyTorch's spelling of the flag.
    ///
    /// ```
    /// assert_eq!(speedkit::flags::Flag::CudnnBenchmark.name(), "torch.backends.cudnn.benchmark");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Flag::CudaMatmulAllowTf32 => "torch.backends.cuda.matmul.allow_tf32",
            Flag::Float32MatmulPrecision => "torch.get_float32_matmul_precision()",
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction => {
                "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
            }
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction => {
                "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"
            }
            Flag::CudnnAllowTf32 => "torch.backends.cudnn.allow_tf32",
            Flag::CudnnBenchmark => "torch.backends.cudnn.benchmark",
            Flag::CudnnDeterministic => "torch.backends.cudnn.deterministic",
            Flag::CudnnEnabled => "torch.backends.cudnn.enabled",
            Flag::SdpFlash => "torch.backends.cuda.flash_sdp_enabled()",
            Flag::SdpMemEfficient => "torch.backends.cuda.mem_efficient_sdp_enabled()",
            Flag::SdpMath => "torch.backends.cuda.math_sdp_enabled()",
            Flag::SdpCudnn => "torch.backends.cuda.cudnn_sdp_enabled()",
            Flag::DeterministicAlgorithms => "torch.are_deterministic_algorithms_enabled()",
        }
    }

    /// What kind of value the flag holds.
    pub const fn kind(self) -> FlagKind {
        match self {
            Flag::Float32MatmulPrecision => FlagKind::MatmulPrecision,
            _ => FlagKind::Bool,
        }
    }

    /// The shim's id for boolean flags (mirrors `BoolFlag` in speedkit_shim.cpp).
    const fn shim_id(self) -> Option<i32> {
        Some(match self {
            Flag::CudaMatmulAllowTf32 => 0,
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction => 1,
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction => 2,
            Flag::CudnnAllowTf32 => 3,
            Flag::CudnnBenchmark => 4,
            Flag::CudnnDeterministic => 5,
            Flag::CudnnEnabled => 6,
            Flag::SdpFlash => 7,
            Flag::SdpMemEfficient => 8,
            Flag::SdpMath => 9,
            Flag::SdpCudnn => 10,
            Flag::DeterministicAlgorithms => 11,
            Flag::Float32MatmulPrecision => return None,
        })
    }

    /// Reads the flag's current value from libtorch.
    pub fn get(self) -> Result<FlagValue> {
        match self.shim_id() {
            Some(id) => Ok(FlagValue::Bool(ffi::flag_get_bool(id)?)),
            None => Ok(FlagValue::MatmulPrecision(
                match ffi::matmul_precision_get()? {
                    0 => MatmulPrecision::Highest,
                    1 => MatmulPrecision::High,
                    _ => MatmulPrecision::Medium,
                },
            )),
        }
    }

    /// Sets the flag. Prefer [`FlagGuard`], which records and restores; this is the raw setter.
    pub fn set(self, value: FlagValue) -> Result<()> {
        match (self.shim_id(), value) {
            (Some(id), FlagValue::Bool(b)) => ffi::flag_set_bool(id, b),
            (None, FlagValue::MatmulPrecision(p)) => ffi::matmul_precision_set(match p {
                MatmulPrecision::Highest => 0,
                MatmulPrecision::High => 1,
                MatmulPrecision::Medium => 2,
            }),
            _ => Err(SpeedkitError::Misuse(format!(
                "{} takes a {:?} value, not {value}",
                self.name(),
                self.kind()
            ))),
        }
    }
}

impl fmt::Display for Flag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum FlagValue {
    /// A boolean flag's value.
    Bool(bool),
    /// The float32 matmul precision.
    MatmulPrecision(MatmulPrecision),
}

impl FlagValue {
    /// The boolean, for boolean flags.
    pub fn as_bool(self) -> Option<bool> {
        match self {
            FlagValue::Bool(b) => Some(b),
            FlagValue::MatmulPrecision(_) => None,
        }
    }
}

impl fmt::Display for FlagValue {
    /// Python's spelling, as `print()` would show it: `True`, `False`, `high`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlagValue::Bool(true) => f.write_str("True"),
            FlagValue::Bool(false) => f.write_str("False"),
            FlagValue::MatmulPrecision(p) => f.write_str(p.as_str()),
        }
    }
}

/// The value of every flag at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlagState(Vec<(Flag, FlagValue)>);

impl FlagState {
    /// Reads every flag in [`Flag::ALL`].
    pub fn capture() -> Result<Self> {
        Flag::ALL
            .iter()
            .map(|&f| Ok((f, f.get()?)))
            .collect::<Result<Vec<_>>>()
            .map(Self)
    }

    /// The value of one flag in this snapshot.
    pub fn get(&self, flag: Flag) -> Option<FlagValue> {
        self.0.iter().find(|(f, _)| *f == flag).map(|(_, v)| *v)
    }

    /// `(flag, value)` pairs in [`Flag::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Flag, FlagValue)> + '_ {
        self.0.iter().copied()
    }

    /// Flags whose value differs between `self` and `other`: `(flag, self's, other's)`.
    pub fn diff(&self, other: &FlagState) -> Vec<(Flag, FlagValue, FlagValue)> {
        self.iter()
            .filter_map(|(flag, a)| match other.get(flag) {
                Some(b) if b != a => Some((flag, a, b)),
                _ => None,
            })
            .collect()
    }
}

/// One requested change: set `flag` to `value`, because `reason`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlagSetting {
    /// The flag.
    pub flag: Flag,
    /// The value to set.
    pub value: FlagValue,
    /// Why, in a sentence a person can check.
    pub reason: String,
}

impl FlagSetting {
    /// A setting with its reason.
    pub fn new(flag: Flag, value: FlagValue, reason: impl Into<String>) -> Self {
        Self {
            flag,
            value,
            reason: reason.into(),
        }
    }
}

/// One recorded change, as a [`FlagGuard`] applied it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlagChange {
    /// The flag.
    pub flag: Flag,
    /// PyTorch's spelling (for JSON consumers).
    pub name: &'static str,
    /// Value before the guard.
    pub before: FlagValue,
    /// Value after the guard applied its settings (read back).
    pub after: FlagValue,
    /// Why. Flags that moved as a side effect of another setting say so.
    pub reason: String,
}

impl FlagChange {
    /// Whether the value actually changed.
    pub fn changed(&self) -> bool {
        self.before != self.after
    }
}

/// Applies flag settings, records them, and restores the previous values on drop — on return, on `?`,
/// and during panic unwinding — then reads every flag back to check that the state really is what it
/// was. Not `Send`: see the [module docs](self) for the thread rule.
#[must_use = "flags are restored when the guard drops; binding it to `_` restores at once"]
pub struct FlagGuard {
    before: FlagState,
    changes: Vec<FlagChange>,
    restored: bool,
    _not_send: PhantomData<*const ()>,
}

impl FlagGuard {
    /// Applies `settings` in order. If any setting fails, everything already applied is put back and
    /// the error returned: a failed apply changes nothing.
    pub fn apply(settings: &[FlagSetting]) -> Result<Self> {
        let before = FlagState::capture()?;
        let mut guard = FlagGuard {
            before,
            changes: Vec::new(),
            restored: false,
            _not_send: PhantomData,
        };
        for setting in settings {
            if let Err(e) = setting.flag.set(setting.value) {
                // Dropping the guard restores what was applied so far.
                drop(guard);
                return Err(SpeedkitError::Unsupported(format!(
                    "cannot set {} to {}: {e}",
                    setting.flag, setting.value
                )));
            }
        }
        let after = FlagState::capture()?;
        for setting in settings {
            let (Some(was), Some(now)) = (guard.before.get(setting.flag), after.get(setting.flag))
            else {
                continue;
            };
            guard.changes.push(FlagChange {
                flag: setting.flag,
                name: setting.flag.name(),
                before: was,
                after: now,
                reason: setting.reason.clone(),
            });
        }
        // Some flags are coupled inside libtorch (matmul precision `high` also reads back as
        // `allow_tf32 = True`): record those too, so the audit shows every flag that moved.
        for (flag, was, now) in guard.before.diff(&after) {
            if !guard.changes.iter().any(|c| c.flag == flag) {
                guard.changes.push(FlagChange {
                    flag,
                    name: flag.name(),
                    before: was,
                    after: now,
                    reason: "follows from another setting above (coupled inside libtorch)".into(),
                });
            }
        }
        Ok(guard)
    }

    /// The changes this guard made, in the order applied.
    pub fn changes(&self) -> &[FlagChange] {
        &self.changes
    }

    /// The state found when the guard was created.
    pub fn state_before(&self) -> &FlagState {
        &self.before
    }

    /// Restores now and reports the result; dropping the guard does the same silently.
    pub fn restore(mut self) -> Result<FlagState> {
        self.restore_inner()
    }

    fn restore_inner(&mut self) -> Result<FlagState> {
        self.restored = true;
        let mut first_error = None;
        for change in self.changes.iter().rev() {
            if let Err(e) = change.flag.set(change.before) {
                first_error.get_or_insert(e);
            }
        }
        // Coupled flags can leave a second flag off its old value after the first is restored;
        // a second pass from the full snapshot settles them.
        let mut now = FlagState::capture()?;
        for (flag, _, was) in now.diff(&self.before) {
            if let Err(e) = flag.set(was) {
                first_error.get_or_insert(e);
            }
        }
        now = FlagState::capture()?;
        let left = now.diff(&self.before);
        if let Some(e) = first_error {
            return Err(SpeedkitError::Restore(e.to_string()));
        }
        if !left.is_empty() {
            let list: Vec<String> = left
                .iter()
                .map(|(f, now, was)| format!("{f} is {now}, was {was}"))
                .collect();
            return Err(SpeedkitError::Restore(list.join("; ")));
        }
        Ok(now)
    }
}

impl Drop for FlagGuard {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        if let Err(e) = self.restore_inner() {
            // Drop cannot return an error, and panicking here could abort during unwinding; say it
            // loudly instead, since a flag left changed silently is the one thing we must not do.
            eprintln!("speedkit: WARNING: {e}");
        }
    }
}

impl fmt::Debug for FlagGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlagGuard")
            .field("changes", &self.changes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_names_are_unique() {
        let mut names: Vec<_> = Flag::ALL.iter().map(|f| f.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Flag::ALL.len());
    }

    #[test]
    fn bool_flag_rejects_a_precision_value() {
        let err = Flag::CudnnBenchmark.set(FlagValue::MatmulPrecision(MatmulPrecision::High));
        assert!(matches!(err, Err(SpeedkitError::Misuse(_))));
    }
}
