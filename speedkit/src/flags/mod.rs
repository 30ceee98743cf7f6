//! PyTorch's global speed flags: one registry, typed access, and a [`FlagGuard`] that applies a set of
//! changes, records each one with its reason, and restores them all when it drops.
//!
//! # The thread rule
//! These flags live in libtorch's process-wide `at::globalContext()`: a change made on one thread is
//! seen by every thread. speedkit keeps a process-wide record of the active guards (every
//! [`SpeedContext`](crate::SpeedContext) holds one), so the rule is enforced, not just documented:
//! - guards on one thread nest, each restoring what it found; one dropped out of order still leaves
//!   exactly the flags of the guards that remain;
//! - while a guard is active on one thread, a guard on another thread that would change any flag is
//!   refused with [`SpeedkitError::ThreadConflict`]; one that changes nothing (the same plan) is
//!   allowed, and the flags stay in force until the last of them drops.
//!
//! A [`FlagGuard`] is neither `Send` nor `Sync`: it is dropped on the thread that made it.
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

mod guard;
mod registry;
mod switch;

pub use guard::{FlagChange, FlagGuard};
pub use switch::{Switch, SwitchTable};

use serde::Serialize;
use std::fmt;

use crate::config::MatmulPrecision;
use crate::error::{Result, SpeedkitError};
use crate::ffi::{self, raw};

/// Every global flag speedkit may touch, named as PyTorch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Flag {
    /// `torch.backends.cuda.matmul.allow_tf32`
    CudaMatmulAllowTf32,
    /// `torch.get_float32_matmul_precision()` (`highest` | `high` | `medium`): the legacy field, read
    /// as stored, also when PyTorch's checked getter would refuse a mix of the legacy and new APIs.
    Float32MatmulPrecision,
    /// `torch.backends.cuda.matmul.fp32_precision` (new API; `none` inherits from `cuda.fp32_precision`)
    CudaMatmulFp32Precision,
    /// `torch.backends.mkldnn.matmul.fp32_precision` (new API; `medium` sets it to `bf16`)
    MkldnnMatmulFp32Precision,
    /// `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`
    CudaMatmulAllowBf16ReducedPrecisionReduction,
    /// `torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`
    CudaMatmulAllowFp16ReducedPrecisionReduction,
    /// `torch.backends.cudnn.allow_tf32` (the legacy field)
    CudnnAllowTf32,
    /// `torch.backends.cudnn.conv.fp32_precision` (new API)
    CudnnConvFp32Precision,
    /// `torch.backends.cudnn.rnn.fp32_precision` (new API)
    CudnnRnnFp32Precision,
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
    /// The CUDA caching allocator's `expandable_segments` (`PYTORCH_CUDA_ALLOC_CONF`,
    /// `torch.cuda.memory._set_allocator_settings`): segments made from then on grow in place
    /// instead of new ones being made, which keeps large, changing allocations from fragmenting
    /// memory.
    CudaExpandableSegments,
    /// An on/off switch of a layer above the flags: speedkit's kernel switches
    /// ([`crate::kernels::flag`], [`KernelOp::flag`](crate::kernels::KernelOp::flag)) and
    /// the operator overrides' registrations
    /// ([`Override::flag`](crate::overrides::Override::flag)).
    Switch(&'static Switch),
}

/// The kind of value a flag holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlagKind {
    /// `true`/`false`.
    Bool,
    /// A [`MatmulPrecision`].
    MatmulPrecision,
    /// An [`Fp32Precision`].
    Fp32Precision,
}

impl Flag {
    /// PyTorch's own flags, in the order reports list them.
    pub const TORCH: [Flag; 18] = [
        Flag::CudaMatmulAllowTf32,
        Flag::Float32MatmulPrecision,
        Flag::CudaMatmulFp32Precision,
        Flag::MkldnnMatmulFp32Precision,
        Flag::CudaMatmulAllowBf16ReducedPrecisionReduction,
        Flag::CudaMatmulAllowFp16ReducedPrecisionReduction,
        Flag::CudnnAllowTf32,
        Flag::CudnnConvFp32Precision,
        Flag::CudnnRnnFp32Precision,
        Flag::CudnnBenchmark,
        Flag::CudnnDeterministic,
        Flag::CudnnEnabled,
        Flag::SdpFlash,
        Flag::SdpMemEfficient,
        Flag::SdpMath,
        Flag::SdpCudnn,
        Flag::DeterministicAlgorithms,
        Flag::CudaExpandableSegments,
    ];

    /// Every flag, in the order reports list them: PyTorch's ([`Flag::TORCH`]), then every
    /// [`Switch`] of the layers above.
    ///
    /// ```
    /// use speedkit::flags::Flag;
    /// let all = Flag::all();
    /// assert!(all.len() > Flag::TORCH.len());
    /// assert!(all.iter().any(|f| f.name() == "speedkit.kernels"));
    /// ```
    pub fn all() -> Vec<Flag> {
        Flag::TORCH
            .into_iter()
            .chain(switch::all().map(Flag::Switch))
            .collect()
    }

    /// PyTorch's spelling of the flag.
    ///
    /// ```
    /// assert_eq!(speedkit::flags::Flag::CudnnBenchmark.name(), "torch.backends.cudnn.benchmark");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Flag::CudaMatmulAllowTf32 => "torch.backends.cuda.matmul.allow_tf32",
            Flag::Float32MatmulPrecision => "torch.get_float32_matmul_precision()",
            Flag::CudaMatmulFp32Precision => "torch.backends.cuda.matmul.fp32_precision",
            Flag::MkldnnMatmulFp32Precision => "torch.backends.mkldnn.matmul.fp32_precision",
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction => {
                "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
            }
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction => {
                "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"
            }
            Flag::CudnnAllowTf32 => "torch.backends.cudnn.allow_tf32",
            Flag::CudnnConvFp32Precision => "torch.backends.cudnn.conv.fp32_precision",
            Flag::CudnnRnnFp32Precision => "torch.backends.cudnn.rnn.fp32_precision",
            Flag::CudnnBenchmark => "torch.backends.cudnn.benchmark",
            Flag::CudnnDeterministic => "torch.backends.cudnn.deterministic",
            Flag::CudnnEnabled => "torch.backends.cudnn.enabled",
            Flag::SdpFlash => "torch.backends.cuda.flash_sdp_enabled()",
            Flag::SdpMemEfficient => "torch.backends.cuda.mem_efficient_sdp_enabled()",
            Flag::SdpMath => "torch.backends.cuda.math_sdp_enabled()",
            Flag::SdpCudnn => "torch.backends.cuda.cudnn_sdp_enabled()",
            Flag::DeterministicAlgorithms => "torch.are_deterministic_algorithms_enabled()",
            Flag::CudaExpandableSegments => "PYTORCH_CUDA_ALLOC_CONF expandable_segments",
            Flag::Switch(switch) => switch.name,
        }
    }

    /// What kind of value the flag holds.
    pub const fn kind(self) -> FlagKind {
        match self {
            Flag::Float32MatmulPrecision => FlagKind::MatmulPrecision,
            _ if self.fp32_precision_id().is_some() => FlagKind::Fp32Precision,
            _ => FlagKind::Bool,
        }
    }

    /// Whether the flag is a view of others with no storage of its own inside libtorch:
    /// `torch.backends.cuda.matmul.allow_tf32` reads `cuda.matmul.fp32_precision == "tf32"`. A view
    /// is restored by restoring what it views.
    pub const fn is_view(self) -> bool {
        matches!(self, Flag::CudaMatmulAllowTf32)
    }

    /// The shim's id for PyTorch's boolean flags (speedkit.h's `sk_bool_flag`).
    const fn bool_id(self) -> Option<i32> {
        Some(match self {
            Flag::CudaMatmulAllowTf32 => raw::SK_FLAG_CUDA_MATMUL_ALLOW_TF32,
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction => {
                raw::SK_FLAG_CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION
            }
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction => {
                raw::SK_FLAG_CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION
            }
            Flag::CudnnAllowTf32 => raw::SK_FLAG_CUDNN_ALLOW_TF32,
            Flag::CudnnBenchmark => raw::SK_FLAG_CUDNN_BENCHMARK,
            Flag::CudnnDeterministic => raw::SK_FLAG_CUDNN_DETERMINISTIC,
            Flag::CudnnEnabled => raw::SK_FLAG_CUDNN_ENABLED,
            Flag::SdpFlash => raw::SK_FLAG_SDP_FLASH,
            Flag::SdpMemEfficient => raw::SK_FLAG_SDP_MEM_EFFICIENT,
            Flag::SdpMath => raw::SK_FLAG_SDP_MATH,
            Flag::SdpCudnn => raw::SK_FLAG_SDP_CUDNN,
            Flag::DeterministicAlgorithms => raw::SK_FLAG_USE_DETERMINISTIC_ALGORITHMS,
            Flag::CudaExpandableSegments => raw::SK_FLAG_CUDA_EXPANDABLE_SEGMENTS,
            _ => return None,
        })
    }

    /// The shim's id for entries of the per-backend precision table (speedkit.h's
    /// `sk_fp32_precision_entry`).
    const fn fp32_precision_id(self) -> Option<i32> {
        Some(match self {
            Flag::CudaMatmulFp32Precision => raw::SK_FP32_CUDA_MATMUL,
            Flag::MkldnnMatmulFp32Precision => raw::SK_FP32_MKLDNN_MATMUL,
            Flag::CudnnConvFp32Precision => raw::SK_FP32_CUDNN_CONV,
            Flag::CudnnRnnFp32Precision => raw::SK_FP32_CUDNN_RNN,
            _ => return None,
        })
    }

    /// Reads the flag's current value from libtorch, as stored: never refused, whatever mix of
    /// PyTorch's legacy and new precision APIs set it.
    pub fn get(self) -> Result<FlagValue> {
        if let Flag::Switch(switch) = self {
            return Ok(FlagValue::Bool((switch.get)()?));
        }
        if let Some(id) = self.bool_id() {
            return Ok(FlagValue::Bool(ffi::flags::get_bool(id)?));
        }
        if let Some(id) = self.fp32_precision_id() {
            return Fp32Precision::from_code(ffi::flags::fp32_precision_get(id)?)
                .map(FlagValue::Fp32Precision);
        }
        Ok(FlagValue::MatmulPrecision(matmul_precision_from_code(
            ffi::flags::matmul_precision_get()?,
        )))
    }

    /// Sets the flag as PyTorch's own setter does (`torch.set_float32_matmul_precision("high")` also
    /// moves the per-backend matmul entries, so the two APIs stay consistent). Prefer [`FlagGuard`],
    /// which records and restores; this is the raw setter.
    pub fn set(self, value: FlagValue) -> Result<()> {
        match (value, self, self.bool_id(), self.fp32_precision_id()) {
            (FlagValue::Bool(on), Flag::Switch(switch), _, _) => (switch.set)(on),
            (FlagValue::Bool(b), _, Some(id), _) => ffi::flags::set_bool(id, b),
            (FlagValue::Fp32Precision(p), _, _, Some(id)) => {
                ffi::flags::fp32_precision_set(id, p as i32)
            }
            (FlagValue::MatmulPrecision(p), Flag::Float32MatmulPrecision, _, _) => {
                ffi::flags::matmul_precision_set(matmul_precision_code(p))
            }
            _ => Err(self.wrong_kind(value)),
        }
    }

    /// Writes back a value read by [`Flag::get`], touching only this flag's own storage (a legacy
    /// field alone, one table entry alone), so that a captured state, consistent or not, comes
    /// back exactly. A view has nothing of its own to write.
    pub(crate) fn restore(self, value: FlagValue) -> Result<()> {
        match (value, self, self.bool_id(), self.fp32_precision_id()) {
            _ if self.is_view() => Ok(()),
            (FlagValue::Bool(on), Flag::Switch(switch), _, _) => (switch.set)(on),
            (FlagValue::Bool(b), _, Some(id), _) => ffi::flags::restore_bool(id, b),
            (FlagValue::Fp32Precision(p), _, _, Some(id)) => {
                ffi::flags::fp32_precision_set(id, p as i32)
            }
            (FlagValue::MatmulPrecision(p), Flag::Float32MatmulPrecision, _, _) => {
                ffi::flags::matmul_precision_restore(matmul_precision_code(p))
            }
            _ => Err(self.wrong_kind(value)),
        }
    }

    fn wrong_kind(self, value: FlagValue) -> SpeedkitError {
        SpeedkitError::Misuse(format!(
            "{} takes a {:?} value, not {value}",
            self.name(),
            self.kind()
        ))
    }
}

fn matmul_precision_code(p: MatmulPrecision) -> i32 {
    match p {
        MatmulPrecision::Highest => 0,
        MatmulPrecision::High => 1,
        MatmulPrecision::Medium => 2,
    }
}

fn matmul_precision_from_code(code: i32) -> MatmulPrecision {
    match code {
        0 => MatmulPrecision::Highest,
        1 => MatmulPrecision::High,
        _ => MatmulPrecision::Medium,
    }
}

/// A value of PyTorch's per-backend fp32 precision API (`torch.backends.*.fp32_precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp32Precision {
    /// `none`: inherit from the backend's (or the generic) `fp32_precision`.
    None,
    /// `ieee`: full fp32.
    Ieee,
    /// `tf32`: TF32 Tensor Cores.
    Tf32,
    /// `bf16`: oneDNN's bf16 (CPU only).
    Bf16,
}

impl Fp32Precision {
    /// PyTorch's spelling.
    ///
    /// ```
    /// assert_eq!(speedkit::flags::Fp32Precision::Tf32.as_str(), "tf32");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Fp32Precision::None => "none",
            Fp32Precision::Ieee => "ieee",
            Fp32Precision::Tf32 => "tf32",
            Fp32Precision::Bf16 => "bf16",
        }
    }

    fn from_code(code: i32) -> Result<Self> {
        Ok(match code {
            0 => Fp32Precision::None,
            1 => Fp32Precision::Ieee,
            2 => Fp32Precision::Tf32,
            3 => Fp32Precision::Bf16,
            _ => {
                return Err(SpeedkitError::Torch(format!(
                    "libtorch reported fp32 precision code {code}, which speedkit does not know"
                )))
            }
        })
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
    /// A per-backend fp32 precision.
    Fp32Precision(Fp32Precision),
}

impl FlagValue {
    /// The boolean, for boolean flags.
    pub fn as_bool(self) -> Option<bool> {
        match self {
            FlagValue::Bool(b) => Some(b),
            FlagValue::MatmulPrecision(_) | FlagValue::Fp32Precision(_) => None,
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
            FlagValue::Fp32Precision(p) => f.write_str(p.as_str()),
        }
    }
}

/// The value of every flag at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlagState(Vec<(Flag, FlagValue)>);

impl FlagState {
    /// Reads every flag in [`Flag::all`].
    pub fn capture() -> Result<Self> {
        Flag::all()
            .into_iter()
            .map(|f| Ok((f, f.get()?)))
            .collect::<Result<Vec<_>>>()
            .map(Self)
    }

    /// The value of one flag in this snapshot.
    pub fn get(&self, flag: Flag) -> Option<FlagValue> {
        self.0.iter().find(|(f, _)| *f == flag).map(|(_, v)| *v)
    }

    /// `(flag, value)` pairs in [`Flag::all`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Flag, FlagValue)> + '_ {
        self.0.iter().copied()
    }

    /// Puts every flag back to its value in this snapshot, touching only the storage of flags that
    /// differ, and reads back to check. A write that fails is tried again once after the others
    /// (coupled flags can need a second pass); what still differs is reported.
    pub(crate) fn write_back(&self) -> Result<()> {
        let mut first_error = None;
        for _pass in 0..2 {
            for (flag, now, was) in FlagState::capture()?.diff(self) {
                if flag.is_view() {
                    continue;
                }
                if let Err(e) = flag.restore(was) {
                    first_error.get_or_insert(format!("{flag} is {now}, was {was}: {e}"));
                }
            }
        }
        let left = FlagState::capture()?.diff(self);
        if left.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = left
            .iter()
            .map(|(f, now, was)| format!("{f} is {now}, was {was}"))
            .collect();
        let cause = first_error
            .map(|e| format!(" (first failure: {e})"))
            .unwrap_or_default();
        Err(SpeedkitError::Restore(format!(
            "{}{cause}",
            list.join("; ")
        )))
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

/// Makes the `n`-th flag write from now fail once inside the shim, as a libtorch setter that throws
/// would (`0` turns it off). Test-only: it proves that every path that writes flags puts every flag
/// back when one write fails.
#[doc(hidden)]
pub fn inject_write_fault(n: u32) {
    ffi::flags::fail_nth_write(n);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_names_are_unique() {
        let all = Flag::all();
        let mut names: Vec<_> = all.iter().map(|f| f.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn bool_flag_rejects_a_precision_value() {
        let err = Flag::CudnnBenchmark.set(FlagValue::MatmulPrecision(MatmulPrecision::High));
        assert!(matches!(err, Err(SpeedkitError::Misuse(_))));
    }
}
