//! [`Override::LogSoftmax`](super::Override::LogSoftmax): `log_softmax` of bf16/fp16 logits under
//! autocast on speedkit's kernels, built entirely on the public layer a user has: the kernels
//! through [`crate::cuda`], the op through [`crate::function`], the registration through
//! [`OperatorOverride`].
//!
//! Autocast runs `log_softmax` in fp32: it casts the logits to an fp32 copy, runs ATen's fp32
//! kernel, and in the backward casts the fp32 gradient back. A classifier over a large vocabulary
//! pays for both casts and the two fp32 tensors of [rows, vocabulary] they write (1.6 GB each for
//! GPT-2's 50k classes at 8 × 1024 tokens). The kernels here read the logits in their own type and
//! write fp32 log-probabilities, and write the gradient in the logits' type: the same arithmetic
//! (fp32 throughout), two kernels and two large tensors fewer. This is what tch's
//! `cross_entropy_for_logits` and `log_softmax(-1, Kind::Float)` call.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tch::{Device, Kind, Tensor};

use super::{DispatchKey, OperatorOverride, Outcome, OverrideCall};
use crate::cuda::{Arg, CudaKernel, CudaModule, Param};
use crate::error::Result;
use crate::function::{apply, BackwardContext, ForwardContext, Function};
use crate::kernels::KernelOp;

/// The kernels' file name, as NVRTC's messages and the kernel cache name it.
pub(crate) const SOURCE_NAME: &str = "log_softmax.cu";
const SOURCE: &str = include_str!("log_softmax.cu");

/// The override: ATen's `log_softmax.int` under autocast on CUDA.
pub(crate) fn operator_override() -> OperatorOverride {
    OperatorOverride::new(
        "aten::log_softmax.int",
        DispatchKey::AutocastCuda,
        log_softmax,
    )
}

/// Registers the kernels' source with the kernel layer (without compiling it).
pub(crate) fn register_source() -> Result<()> {
    CudaModule::new(SOURCE_NAME, SOURCE).map(|_| ())
}

fn log_softmax(call: &OverrideCall<'_>) -> Result<Outcome> {
    let x = call.tensor("self")?;
    let fp32_result = matches!(call.kind("dtype"), Ok(None | Some(Kind::Float)));
    if let Some(why) = unsupported(x, call.int("dim")?, fp32_result) {
        return Ok(Outcome::Declined(why));
    }
    let kernels = Kernels::get(x.device(), x.kind())?;
    let function = LogSoftmax {
        kernels,
        logits: x.kind(),
    };
    let y = apply(function, &[x])?.remove(0);
    Ok(Outcome::Ran(vec![y]))
}

/// Why the kernels cannot take this call, or `None`.
fn unsupported(x: &Tensor, dim: i64, fp32_result: bool) -> Option<String> {
    let kind = x.kind();
    if !matches!(kind, Kind::BFloat16 | Kind::Half) {
        return Some(format!("{kind:?} logits (the kernels read bf16 and fp16)"));
    }
    if !fp32_result {
        return Some("a result type other than fp32".into());
    }
    let last = x.dim() as i64 - 1;
    if x.dim() == 0 || (dim != -1 && dim != last) {
        return Some(format!("over dimension {dim}, not the last"));
    }
    let width = x.size()[last as usize];
    let rows = if width == 0 {
        0
    } else {
        x.numel() as i64 / width
    };
    if rows == 0 || width > i64::from(i32::MAX) || rows > i64::from(i32::MAX) {
        return Some(format!("{rows} rows of {width} (empty, or past 2^31)"));
    }
    if !x.is_contiguous() || (width % 8 == 0 && x.data_ptr() as usize % 16 != 0) {
        return Some("logits that are not contiguous and 16-byte aligned".into());
    }
    if !crate::kernels::op_enabled(KernelOp::CrossEntropy) {
        return Some("speedkit's kernels are switched off".into());
    }
    crate::kernels::unavailable_reason(x.device()).unwrap_or_else(|e| Some(e.to_string()))
}

/// The forward and backward kernels for one logits type on one device.
struct Kernels {
    forward: CudaKernel,
    backward: CudaKernel,
}

impl Kernels {
    /// Compiled and loaded once per (device, type): the first call compiles with NVRTC (or reads
    /// the on-disk cache), later ones are a lookup.
    fn get(device: Device, kind: Kind) -> Result<Arc<Kernels>> {
        type Loaded = Mutex<Vec<((Device, Kind), Arc<Kernels>)>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let mut loaded = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, k)) = loaded.iter().find(|(key, _)| *key == (device, kind)) {
            return Ok(Arc::clone(k));
        }
        let tag = if kind == Kind::Half { "f16" } else { "bf16" };
        let module = CudaModule::new(SOURCE_NAME, SOURCE)?;
        let (x, fp32) = (Param::Tensor(kind), Param::Tensor(Kind::Float));
        let kernels = Arc::new(Kernels {
            forward: module.kernel(
                &format!("log_softmax_forward_{tag}"),
                &[x, fp32, Param::I32],
                device,
            )?,
            backward: module.kernel(
                &format!("log_softmax_backward_{tag}"),
                &[fp32, fp32, x, Param::I32],
                device,
            )?,
        });
        loaded.push(((device, kind), Arc::clone(&kernels)));
        Ok(kernels)
    }
}

/// A row per block; the threads a multiple of 32 (the block reductions' warps), at most 1024, no
/// more than the row has columns (8 per thread when vectorised).
fn launch_shape(rows: i64, width: i64) -> (u32, u32) {
    let per_thread = if width % 8 == 0 { 8 } else { 1 };
    let threads = ((width / per_thread + 31) / 32 * 32).clamp(32, 1024);
    (rows as u32, threads as u32)
}

fn rows_and_width(t: &Tensor) -> (i64, i64) {
    let width = t.size().last().copied().unwrap_or(1).max(1);
    (t.numel() as i64 / width, width)
}

/// The autograd function around the two kernels: logits in, fp32 log-probabilities out, saved for
/// the backward (the logits are not).
struct LogSoftmax {
    kernels: Arc<Kernels>,
    /// The logits' type, which the backward writes.
    logits: Kind,
}

impl Function for LogSoftmax {
    fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let x = &inputs[0];
        let (rows, width) = rows_and_width(x);
        let y = Tensor::empty(x.size(), (Kind::Float, x.device()));
        let (grid, block) = launch_shape(rows, width);
        self.kernels.forward.launch(
            grid,
            block,
            0,
            &[x.into(), (&y).into(), Arg::I32(width as i32)],
        )?;
        ctx.save_for_backward(&[&y])?;
        Ok(vec![y])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let y = ctx.saved()?.remove(0);
        let Some(dy) = &grads[0] else {
            return Ok(vec![None]);
        };
        let dy = dy.to_kind(Kind::Float).contiguous();
        let dx = Tensor::empty(y.size(), (self.logits, y.device()));
        let (rows, width) = rows_and_width(&y);
        let (grid, block) = launch_shape(rows, width);
        self.kernels.backward.launch(
            grid,
            block,
            0,
            &[
                (&dy).into(),
                (&y).into(),
                (&dx).into(),
                Arg::I32(width as i32),
            ],
        )?;
        Ok(vec![Some(dx)])
    }
}
