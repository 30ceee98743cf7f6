//! speedkit's own CUDA kernels: the fused operations behind [`crate::nn`]'s modules, and the layer
//! they run on.
//!
//! The kernels live as CUDA C++ source in `speedkit/kernels/<op>.cuh` (one file per operation: a
//! params struct per entry point, its forward and backward, and the host launcher), embedded in
//! the binary and compiled at run time with NVRTC for the GPU in use. More sources can be
//! registered at run time ([`register_source`]). Each source's cubin is cached on disk under a key
//! of its own (its text, the registered sources it includes, the architecture and NVRTC's version),
//! under `$SPEEDKIT_KERNEL_CACHE`, else `$XDG_CACHE_HOME/speedkit/kernels`, else
//! `~/.cache/speedkit/kernels`. NVRTC and the CUDA headers come from the torch wheel next to
//! libtorch (`nvidia/cu13`), or from `CUDA_HOME`.
//!
//! Compiling needs no GPU, so every kernel is compiled in CI ([`compile`]); loading and launching
//! use the CUDA driver library and happen on first use on a GPU, during the warm-up steps that
//! precede CUDA-graph capture. Kernels launch on PyTorch's current stream, allocate through its
//! caching allocator and never synchronise, so they can be captured.
//!
//! Every fused op takes one path: its kernel where the kernel switch allows it ([`set_enabled`],
//! the config's `kernels`, per op through [`Flag::SpeedkitKernel`](crate::flags::Flag)) and its
//! inputs pass the op's checks, ATen's composite otherwise; each outcome is counted in one channel
//! of [`notes`], which the audit, the runner and the profiler read.
//!
//! ```
//! for file in speedkit::kernels::files()? {
//!     println!("{file}");
//! }
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

use serde::Serialize;
use tch::Device;

use crate::error::{Result, SpeedkitError};
use crate::ffi::{self, raw};
use crate::flags::{Flag, FlagValue};

/// A GPU architecture, compiled for as `sm_<major><minor>`.
///
/// ```
/// let hopper = speedkit::kernels::Arch { major: 9, minor: 0 };
/// assert_eq!(hopper.to_string(), "sm_90");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// The compute capability's major number (8 for Ampere, 9 for Hopper).
    pub major: u32,
    /// The compute capability's minor number.
    pub minor: u32,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// One of speedkit's fused ops, as the kernel switch and the notes name it.
///
/// ```
/// use speedkit::kernels::KernelOp;
/// assert_eq!(KernelOp::LayerNorm.name(), "layer_norm");
/// assert_eq!(KernelOp::ALL.len(), 10);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelOp {
    /// LayerNorm, with the residual add before it ([`crate::nn::LayerNorm`]).
    LayerNorm,
    /// The classifier's softmax cross-entropy ([`crate::nn::cross_entropy`]).
    CrossEntropy,
    /// Bias + tanh-GELU after a Linear ([`crate::nn::Linear::forward_gelu`]).
    BiasGelu,
    /// Token + position embedding ([`crate::nn::embedding`]).
    Embedding,
    /// Linear's cheaper backward ([`crate::nn::Linear`]).
    Linear,
    /// The transformer MLP on cuBLASLt epilogues ([`crate::nn::Mlp`]).
    Mlp,
    /// AdamW writing the weight copies ([`crate::optim::AdamWOptimizer`]).
    AdamW,
    /// The FP8 casts ([`crate::nn::quantize_fp8`]).
    Fp8Cast,
    /// BatchNorm in training mode over channels-last activations
    /// ([`Override::BatchNorm`](crate::overrides::Override::BatchNorm)).
    BatchNorm,
    /// Convolution under autocast without a kept copy of the weight
    /// ([`Override::Convolution`](crate::overrides::Override::Convolution)).
    Convolution,
}

impl KernelOp {
    /// Every op, in the shim's order.
    pub const ALL: [KernelOp; 10] = [
        KernelOp::LayerNorm,
        KernelOp::CrossEntropy,
        KernelOp::BiasGelu,
        KernelOp::Embedding,
        KernelOp::Linear,
        KernelOp::Mlp,
        KernelOp::AdamW,
        KernelOp::Fp8Cast,
        KernelOp::BatchNorm,
        KernelOp::Convolution,
    ];

    /// The name the audit and the runner show.
    pub const fn name(self) -> &'static str {
        match self {
            KernelOp::LayerNorm => "layer_norm",
            KernelOp::CrossEntropy => "cross_entropy",
            KernelOp::BiasGelu => "bias_gelu",
            KernelOp::Embedding => "embedding",
            KernelOp::Linear => "linear",
            KernelOp::Mlp => "mlp",
            KernelOp::AdamW => "adamw",
            KernelOp::Fp8Cast => "fp8 cast",
            KernelOp::BatchNorm => "batch_norm",
            KernelOp::Convolution => "convolution",
        }
    }

    /// The shim's id (speedkit.h's `sk_op`).
    pub(crate) const fn code(self) -> i32 {
        match self {
            KernelOp::LayerNorm => raw::SK_OP_LAYER_NORM,
            KernelOp::CrossEntropy => raw::SK_OP_CROSS_ENTROPY,
            KernelOp::BiasGelu => raw::SK_OP_BIAS_GELU,
            KernelOp::Embedding => raw::SK_OP_EMBEDDING,
            KernelOp::Linear => raw::SK_OP_LINEAR,
            KernelOp::Mlp => raw::SK_OP_MLP,
            KernelOp::AdamW => raw::SK_OP_ADAMW,
            KernelOp::Fp8Cast => raw::SK_OP_FP8_CAST,
            KernelOp::BatchNorm => raw::SK_OP_BATCH_NORM,
            KernelOp::Convolution => raw::SK_OP_CONVOLUTION,
        }
    }

    fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.code() == code)
    }
}

impl fmt::Display for KernelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// speedkit's own kernel files (`speedkit/kernels/*.cuh`), by file name, sorted.
///
/// ```
/// assert!(speedkit::kernels::files()?.contains(&"layernorm.cuh".to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn files() -> Result<Vec<String>> {
    let (mut names, builtin) = ffi::kernels::source_names()?;
    names.truncate(builtin);
    Ok(names)
}

/// The sources registered at run time ([`register_source`]), in order of registration.
///
/// ```
/// speedkit::kernels::register_source("doc_empty.cu", "// nothing yet\n")?;
/// assert!(speedkit::kernels::registered()?.contains(&"doc_empty.cu".to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn registered() -> Result<Vec<String>> {
    let (names, builtin) = ffi::kernels::source_names()?;
    Ok(names.into_iter().skip(builtin).collect())
}

/// Registers CUDA C++ `source` under the file name `name`, to be compiled with NVRTC on first use
/// with a cache key of its own; speedkit's sources are available to it as headers by their names
/// (`#include "common.cuh"`). The same name and text again is the same source; the same name with
/// other text is an error.
///
/// ```
/// let name = "doc_scale.cu";
/// speedkit::kernels::register_source(
///     name,
///     r#"extern "C" __global__ void scale(float* x, float k, int n) {
///            int i = blockIdx.x * blockDim.x + threadIdx.x;
///            if (i < n) x[i] *= k;
///        }"#,
/// )?;
/// assert!(speedkit::kernels::registered()?.contains(&name.to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn register_source(name: &str, source: &str) -> Result<()> {
    ffi::kernels::register_source(name, source).map(|_| ())
}

/// Compiles the kernel source `file` (one of [`files`] or [`registered`]) with NVRTC for `arch`,
/// bypassing the cache, and returns the size of the cubin in bytes. Needs NVRTC and the CUDA headers, not a GPU. The error carries
/// NVRTC's log when the file does not compile.
///
/// ```no_run
/// use speedkit::kernels::{compile, Arch};
/// let bytes = compile("layernorm.cuh", Arch { major: 8, minor: 0 })?;
/// assert!(bytes > 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn compile(file: &str, arch: Arch) -> Result<usize> {
    let index = ffi::kernels::source_names()?
        .0
        .iter()
        .position(|name| name == file)
        .ok_or_else(|| SpeedkitError::Misuse(format!("speedkit has no kernel file {file}")))?;
    ffi::kernels::compile(index, arch.major, arch.minor)
}

/// NVRTC's version, e.g. `(13, 0)`; an error saying where NVRTC was looked for when it is missing.
///
/// ```no_run
/// let (major, minor) = speedkit::kernels::nvrtc_version()?;
/// println!("NVRTC {major}.{minor}");
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn nvrtc_version() -> Result<(u32, u32)> {
    let version = ffi::kernels::nvrtc_version()?;
    Ok((version / 1000, (version % 1000) / 10))
}

/// Why speedkit's kernels cannot run on `device`, or `None` when they can: a CUDA device of
/// SM ≥ 8.0, with NVRTC, the CUDA headers and the CUDA driver library found.
///
/// ```
/// use tch::Device;
/// let why = speedkit::kernels::unavailable_reason(Device::Cpu)?;
/// assert!(why.is_some());
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn unavailable_reason(device: Device) -> Result<Option<String>> {
    match device {
        Device::Cuda(index) => ffi::kernels::unavailable_reason(index),
        other => Ok(Some(format!(
            "speedkit's kernels run on CUDA devices, not on {other:?}"
        ))),
    }
}

// ----- the kernel switch -------------------------------------------------------------------------

/// Turns speedkit's kernels on or off for every op in the process and returns the previous
/// setting: the raw setter of [`Flag::SpeedkitKernels`]. A [`crate::SpeedContext`] holds the
/// config's `kernels` setting in its flag guard instead, with the flags' stacking, restore and
/// thread rule; prefer that, or a [`FlagGuard`](crate::flags::FlagGuard).
///
/// ```
/// let before = speedkit::kernels::set_enabled(false);   // ATen everywhere
/// assert!(!speedkit::kernels::enabled());
/// speedkit::kernels::set_enabled(before);
/// ```
pub fn set_enabled(on: bool) -> bool {
    let before = enabled();
    // Writing the shim's switch fails only for an unknown op id, which ALL excludes.
    let _ = Flag::SpeedkitKernels.set(FlagValue::Bool(on));
    before
}

/// Whether speedkit's kernels are switched on (see [`set_enabled`]).
///
/// ```
/// println!("kernels on: {}", speedkit::kernels::enabled());
/// ```
pub fn enabled() -> bool {
    ffi::kernels::setting_get(raw::SK_OP_ALL).unwrap_or(false)
}

/// Whether `op`'s kernels are switched on: the switch of every op, and the op's own.
pub(crate) fn op_enabled(op: KernelOp) -> bool {
    enabled() && ffi::kernels::setting_get(op.code()).unwrap_or(false)
}

// ----- the notes ---------------------------------------------------------------------------------

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
