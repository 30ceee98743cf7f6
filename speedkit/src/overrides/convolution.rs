//! [`Override::Convolution`](super::Override::Convolution): `aten::conv1d`, `conv2d` and `conv3d`
//! under CUDA autocast (`nn::conv2d`, `Tensor::conv2d`) without a kept copy of the weight.
//!
//! Autocast casts each fp32 weight to bf16/fp16 in the forward, and ATen's convolution node keeps
//! that copy for the layer's backward, so at the end of the forward, a convolutional network's
//! memory peak, every layer's copy is alive (about 21 MiB for a CIFAR ResNet-18). speedkit's convolution saves
//! the fp32 weight instead, which the model holds anyway, and casts it again in the backward: one
//! more pass over each weight per step, what torch.compile's partitioner chooses for the same
//! graph. The convolutions run on the operands autocast would give ATen's; the 2-D ones in bf16 and
//! fp16 that ATen would give cuDNN, with `cudnn.benchmark` on, through cuDNN plans speedkit chose
//! by timing once and keeps in the kernel cache (`speedkit/shim/conv_plans.cpp`), so that a later
//! run of the same model times nothing.

use tch::{Kind, Tensor};

use super::{DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::amp::AutocastState;
use crate::error::Result;
use crate::ffi::{self, convolution::ConvolutionParams, convolution::PlanCounts};
use crate::kernels::KernelOp;

/// The overrides: ATen's `conv1d`, `conv2d` and `conv3d` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 3] {
    ["aten::conv1d", "aten::conv2d", "aten::conv3d"]
        .map(|op| OperatorOverride::new(op, DispatchKey::AutocastCuda, convolution))
}

fn convolution(call: &OverrideCall<'_>) -> Result<Reply> {
    let (x, weight) = (call.tensor("input")?, call.tensor("weight")?);
    let bias = call.optional_tensor("bias")?;
    // Autocast's type, read while its key is excluded (as the override runs): the type is kept.
    let kind = AutocastState::current(x.device())?.dtype;
    if let Some(why) = unsupported([Some(x), Some(weight), bias].into_iter().flatten(), x) {
        return Ok(Reply::Declined(why));
    }
    let params = ConvolutionParams {
        stride: call.ints("stride")?,
        padding: call.ints("padding")?,
        dilation: call.ints("dilation")?,
        groups: call.int("groups")?,
    };
    let y = ffi::convolution::convolution(x, weight, bias, &params, kind)?;
    Ok(Reply::Ran(vec![y]))
}

/// Why speedkit's convolution does not take these operands, or `None`: autocast casts only fp32,
/// fp16 and bf16 CUDA tensors, and ATen's own checks (shapes, a batch-less input) give the
/// clearest errors, so anything else runs autocast's path.
fn unsupported<'a>(operands: impl Iterator<Item = &'a Tensor>, x: &Tensor) -> Option<String> {
    for t in operands {
        if !matches!(t.kind(), Kind::Float | Kind::Half | Kind::BFloat16) {
            return Some(format!(
                "{:?} operands (autocast casts fp32, fp16, bf16)",
                t.kind()
            ));
        }
        if t.device() != x.device() || t.dim() != x.dim() && t.dim() != 1 {
            return Some("operands on different devices or of different ranks".into());
        }
    }
    if !crate::kernels::op_enabled(KernelOp::Convolution) {
        return Some("speedkit's kernels are switched off".into());
    }
    crate::kernels::unavailable_reason(x.device()).unwrap_or_else(|e| Some(e.to_string()))
}

/// What the cuDNN plans of speedkit's convolution took in this process so far: with
/// `cudnn.benchmark` on, its 2-D convolutions in bf16 and fp16 that ATen would give cuDNN run plans
/// speedkit chose by timing cuDNN's candidates once and keeps in the kernel cache, so that a later
/// run builds them from there without timing anything.
///
/// ```
/// let plans = speedkit::overrides::CudnnPlans::now();
/// println!(
///     "{} timed in {:.2} s, {} from the kernel cache",
///     plans.timed, plans.timing_seconds, plans.from_disk
/// );
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CudnnPlans {
    /// Plans chosen by timing cuDNN's candidates.
    pub timed: u64,
    /// The seconds that timing took.
    pub timing_seconds: f64,
    /// Plans built from the choices an earlier run kept in the kernel cache.
    pub from_disk: u64,
    /// The seconds building those took (cuDNN compiles some engines' kernels as it builds).
    pub building_seconds: f64,
    /// Convolutions left to ATen's because no plan could be had then (one first met during a
    /// CUDA-graph capture, where nothing can be timed).
    pub to_aten: u64,
    /// Depthwise convolutions' passes (a forward or an input gradient at one set of shapes) that
    /// run on speedkit's own depthwise kernel, timed faster than the plans' or ATen's.
    pub depthwise_on_kernels: u64,
    /// Depthwise convolutions' passes timed and left to the plans' or ATen's path as the faster.
    pub depthwise_left: u64,
    /// Depthwise passes run on speedkit's depthwise kernel, however it was chosen.
    pub depthwise_kernel_runs: u64,
}

impl CudnnPlans {
    /// The counts now, from the start of the process.
    pub fn now() -> CudnnPlans {
        let PlanCounts {
            timed,
            timing_seconds,
            from_disk,
            building_seconds,
            to_aten,
        } = ffi::convolution::plan_counts();
        let depthwise = ffi::convolution::depthwise_counts();
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        CudnnPlans {
            timed: count(timed),
            timing_seconds,
            from_disk: count(from_disk),
            building_seconds,
            to_aten: count(to_aten),
            depthwise_on_kernels: count(depthwise.on_kernels),
            depthwise_left: count(depthwise.left),
            depthwise_kernel_runs: count(depthwise.kernel_runs),
        }
    }

    /// The audit's line for the plans taken since `start`, if any were.
    pub(crate) fn note_since(start: &CudnnPlans) -> Option<String> {
        let now = CudnnPlans::now();
        let timed = now.timed.saturating_sub(start.timed);
        let from_disk = now.from_disk.saturating_sub(start.from_disk);
        let to_aten = now.to_aten.saturating_sub(start.to_aten);
        let on_kernels = now
            .depthwise_on_kernels
            .saturating_sub(start.depthwise_on_kernels);
        let left = now.depthwise_left.saturating_sub(start.depthwise_left);
        let depthwise = if on_kernels + left > 0 {
            format!(
                "; depthwise passes timed: {on_kernels} faster on speedkit's depthwise kernel, \
                 {left} left to cuDNN's or ATen's"
            )
        } else {
            String::new()
        };
        (timed + from_disk + to_aten + on_kernels + left > 0).then(|| {
            format!(
                "cuDNN convolution plans: {timed} chosen by timing cuDNN's candidates ({:.2} s), \
                 {from_disk} built from the kernel cache's earlier choices ({:.2} s), {to_aten} \
                 convolution(s) first met during a graph capture left to ATen{depthwise}",
                now.timing_seconds - start.timing_seconds,
                now.building_seconds - start.building_seconds
            )
        })
    }
}

/// How speedkit's convolution runs a depthwise convolution's forward and input gradient that its
/// own depthwise kernel takes: channels-last bf16 or fp16, one 3×3, 5×5 or 7×7 filter per channel,
/// channels a multiple of 8, stride 1, no dilation. cuDNN's depthwise kernels are far slower than
/// speedkit's at some of those shapes (a ConvNeXt's 7×7 filters over 32 × 32 images) and faster at
/// others (3×3 filters over large images).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepthwiseChoice {
    /// Each pass at each set of shapes is timed once per process on both, outside graph captures,
    /// and the faster runs from then on (the default).
    Timed,
    /// speedkit's depthwise kernel, untimed.
    Kernel,
    /// cuDNN's plans (or ATen's convolution where those do not run), untimed.
    Cudnn,
}

impl DepthwiseChoice {
    fn code(self) -> i32 {
        match self {
            DepthwiseChoice::Timed => 0,
            DepthwiseChoice::Kernel => 1,
            DepthwiseChoice::Cudnn => 2,
        }
    }

    fn from_code(code: i32) -> DepthwiseChoice {
        match code {
            1 => DepthwiseChoice::Kernel,
            2 => DepthwiseChoice::Cudnn,
            _ => DepthwiseChoice::Timed,
        }
    }
}

/// Holds a [`DepthwiseChoice`] for the process until dropped, then puts back the one it found.
///
/// Pinning the kernel makes a run's depthwise convolutions the same kernels from run to run, where
/// timing may choose differently on a busy GPU.
///
/// ```
/// use speedkit::overrides::{choose_depthwise, DepthwiseChoice};
///
/// let pinned = choose_depthwise(DepthwiseChoice::Kernel);
/// assert_eq!(pinned.previous(), DepthwiseChoice::Timed);
/// drop(pinned); // timed again
/// ```
#[must_use = "the choice holds only while the guard lives"]
#[derive(Debug)]
pub struct DepthwiseChoiceGuard {
    previous: DepthwiseChoice,
}

impl DepthwiseChoiceGuard {
    /// The choice this guard replaced, and puts back when dropped.
    pub fn previous(&self) -> DepthwiseChoice {
        self.previous
    }
}

impl Drop for DepthwiseChoiceGuard {
    fn drop(&mut self) {
        ffi::convolution::choose_depthwise(self.previous.code());
    }
}

/// Sets how depthwise convolutions choose their kernel until the returned guard drops (see
/// [`DepthwiseChoice`]).
pub fn choose_depthwise(choice: DepthwiseChoice) -> DepthwiseChoiceGuard {
    let previous = DepthwiseChoice::from_code(ffi::convolution::choose_depthwise(choice.code()));
    DepthwiseChoiceGuard { previous }
}
