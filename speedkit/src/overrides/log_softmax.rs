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
//!
//! The `nll_loss` that follows a classifier's `log_softmax` is fused with it across the two
//! overrides: `nll_loss` of log-probabilities this module wrote hands its gradient to their
//! `log_softmax` node as the targets and a scale, not as the dense [rows, vocabulary] fp32 tensor
//! (zeros but one entry a row) autograd would build, and that node's backward is one pass over the
//! log-probabilities: dx = k · (exp(y) - onehot(target)). The gradient to pass along is an expanded
//! zero (no memory), which marks it; where the log-probabilities also feed something else,
//! autograd adds the gradients into a dense one and the node adds the NLL's part to it. The one
//! thing the fusion changes is the gradient of the log-probabilities themselves: asked for by
//! `Tensor::run_backward(&[loss], &[y], ..)`, it reads as that zero marker. Ask for the logits'
//! gradient (exact), or set `overrides: false`.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use tch::{Device, Kind, Tensor};

use super::{DispatchKey, OperatorOverride, Outcome, OverrideCall};
use crate::cuda::{Arg, CudaKernel, CudaModule, Param};
use crate::error::Result;
use crate::ffi;
use crate::function::{apply, BackwardContext, ForwardContext, Function};
use crate::kernels::KernelOp;

/// The kernels' file name, as NVRTC's messages and the kernel cache name it.
pub(crate) const SOURCE_NAME: &str = "log_softmax.cu";
const SOURCE: &str = include_str!("log_softmax.cu");

/// The overrides: ATen's `log_softmax.int` and `nll_loss` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 2] {
    [
        OperatorOverride::new(
            "aten::log_softmax.int",
            DispatchKey::AutocastCuda,
            log_softmax,
        ),
        OperatorOverride::new("aten::nll_loss", DispatchKey::AutocastCuda, nll_loss),
    ]
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
    let link = Arc::new(Mutex::new(None));
    let function = LogSoftmax {
        kernels,
        logits: x.kind(),
        link: Arc::clone(&link),
    };
    let y = apply(function, &[x])?.remove(0);
    if y.requires_grad() {
        links().push(&y, &link)?;
    }
    Ok(Outcome::Ran(vec![y]))
}

/// `nll_loss` of log-probabilities the `log_softmax` above wrote, fused with it (see the module
/// docs); any other call runs autocast's own path.
fn nll_loss(call: &OverrideCall<'_>) -> Result<Outcome> {
    let (y, target) = (call.tensor("self")?, call.tensor("target")?);
    let reduction = call.int("reduction")?;
    let link = match links().find(y) {
        Some(_) if call.optional_tensor("weight")?.is_some() => {
            return Ok(Outcome::Declined("class weights".into()))
        }
        Some(link) => link,
        None => {
            return Ok(Outcome::Declined(
                "input not from speedkit's log_softmax".into(),
            ))
        }
    };
    let rows = y.size().first().copied().unwrap_or(0);
    if y.dim() != 2 || target.dim() != 1 || target.size() != [rows] || target.kind() != Kind::Int64
    {
        return Ok(Outcome::Declined(format!(
            "input {:?} and target {:?} {:?} (the fusion takes [rows, classes] and [rows] int64)",
            y.size(),
            target.size(),
            target.kind()
        )));
    }
    let reduction = match reduction {
        1 => Reduction::Mean,
        2 => Reduction::Sum,
        _ => return Ok(Outcome::Declined("reduction none".into())),
    };
    let function = Nll {
        link,
        ignore_index: call.int("ignore_index")?,
        reduction,
        input: (Vec::new(), y.device()),
    };
    let loss = apply(function, &[y, target])?.remove(0);
    Ok(Outcome::Ran(vec![loss]))
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
    nll_backward: CudaKernel,
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
            nll_backward: module.kernel(
                &format!("log_softmax_nll_backward_{tag}"),
                &[
                    fp32,
                    Param::Tensor(Kind::Int64),
                    fp32,
                    fp32,
                    x,
                    Param::I32,
                    Param::I64,
                    Param::I32,
                ],
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
    /// Where a fused `nll_loss` leaves its gradient for this node's backward.
    link: Link,
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
        let nll = lock(&self.link).take();
        let Some(dy) = &grads[0] else {
            return Ok(vec![None]);
        };
        let dx = Tensor::empty(y.size(), (self.logits, y.device()));
        let (rows, width) = rows_and_width(&y);
        let (grid, block) = launch_shape(rows, width);
        match nll {
            Some(nll) if is_marker(dy) => self.kernels.nll_backward.launch(
                grid,
                block,
                0,
                &[
                    (&y).into(),
                    (&nll.target).into(),
                    (&nll.grad).into(),
                    (&nll.total_weight).into(),
                    (&dx).into(),
                    Arg::I32(width as i32),
                    Arg::I64(nll.ignore_index),
                    Arg::I32(i32::from(nll.reduction == Reduction::Mean)),
                ],
            )?,
            nll => {
                let mut dy = dy.to_kind(Kind::Float).contiguous();
                if let Some(nll) = nll {
                    dy = dy.f_add(&nll.dense(&y)?)?;
                }
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
                )?
            }
        }
        Ok(vec![Some(dx)])
    }
}

/// How the NLL's loss is reduced over rows (ATen's codes 1 and 2; `none` is not fused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reduction {
    Mean,
    Sum,
}

impl Reduction {
    fn tch(self) -> tch::Reduction {
        match self {
            Reduction::Mean => tch::Reduction::Mean,
            Reduction::Sum => tch::Reduction::Sum,
        }
    }
}

/// A fused `nll_loss`'s gradient, left for its `log_softmax` node: the loss's gradient `grad`
/// (fp32, 0-d), the targets, the count of rows not ignored (for the mean).
struct NllGradient {
    target: Tensor,
    grad: Tensor,
    total_weight: Tensor,
    ignore_index: i64,
    reduction: Reduction,
}

impl NllGradient {
    /// The gradient it stands for at the log-probabilities `y`, dense: -k at each row's target.
    fn dense(&self, y: &Tensor) -> Result<Tensor> {
        let k = match self.reduction {
            Reduction::Mean => &self.grad / &self.total_weight,
            Reduction::Sum => self.grad.shallow_clone(),
        };
        let kept = self.target.f_ne(self.ignore_index)?;
        let values = (kept.to_kind(Kind::Float) * k.neg()).unsqueeze(1);
        let columns = self.target.f_where_scalarother(&kept, 0)?.unsqueeze(1);
        Ok(y.f_zeros_like()?.f_scatter_add(1, &columns, &values)?)
    }
}

type Link = Arc<Mutex<Option<NllGradient>>>;

fn lock(link: &Link) -> MutexGuard<'_, Option<NllGradient>> {
    link.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The gradient a fused `nll_loss` passes to its `log_softmax`: zeros of the log-probabilities'
/// shape, expanded from one element.
fn marker((size, device): &(Vec<i64>, Device)) -> Result<Tensor> {
    Ok(Tensor::f_zeros([1, 1], (Kind::Float, *device))?.f_expand(size.as_slice(), false)?)
}

fn is_marker(dy: &Tensor) -> bool {
    dy.stride().iter().all(|&s| s == 0)
}

/// The `nll_loss` half of the fusion: the loss as ATen computes it (a gather), and in the backward
/// the targets and scale handed to the `log_softmax` node in place of a dense gradient.
struct Nll {
    link: Link,
    ignore_index: i64,
    reduction: Reduction,
    /// The log-probabilities' shape and device, for the gradient handed back.
    input: (Vec<i64>, Device),
}

impl Function for Nll {
    fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let (y, target) = (&inputs[0], &inputs[1]);
        // The operator itself, from inside its override: autocast's own path, with grad mode off.
        let loss = y.f_nll_loss(
            target,
            None::<&Tensor>,
            self.reduction.tch(),
            self.ignore_index,
        )?;
        let total_weight = target.f_ne(self.ignore_index)?.f_sum(Kind::Float)?;
        ctx.save_for_backward(&[target, &total_weight])?;
        self.input = (y.size(), y.device());
        Ok(vec![loss])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let mut saved = ctx.saved()?;
        let total_weight = saved.remove(1);
        let target = saved.remove(0);
        let Some(grad) = &grads[0] else {
            return Ok(vec![None, None]);
        };
        *lock(&self.link) = Some(NllGradient {
            target,
            grad: grad.to_kind(Kind::Float).contiguous(),
            total_weight,
            ignore_index: self.ignore_index,
            reduction: self.reduction,
        });
        Ok(vec![Some(marker(&self.input)?), None])
    }
}

/// The nodes of this module's `log_softmax` that may still get a fused `nll_loss`, by the
/// identity of the node (`grad_fn`) of the log-probabilities they wrote, with their links: how
/// `nll_loss` knows its input is one of them. An entry counts only while its link lives, which the
/// node keeps alive (and a fused `nll_loss` node, which keeps the node alive): a node's identity is
/// not reused while it lives, and a view or an in-place change of the log-probabilities has another
/// node, so nothing else matches.
struct Links(Vec<(u64, Weak<Mutex<Option<NllGradient>>>)>);

fn links() -> MutexGuard<'static, Links> {
    static LINKS: Mutex<Links> = Mutex::new(Links(Vec::new()));
    LINKS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Links {
    /// Records the node that made `y`, forgetting the entries whose node is gone.
    fn push(&mut self, y: &Tensor, link: &Link) -> Result<()> {
        let node = ffi::autograd::grad_fn_identity(y)?;
        self.0.retain(|(_, weak)| weak.strong_count() > 0);
        self.0.push((node, Arc::downgrade(link)));
        Ok(())
    }

    fn find(&self, y: &Tensor) -> Option<Link> {
        let node = ffi::autograd::grad_fn_identity(y).ok()?;
        self.0
            .iter()
            .rev()
            .filter(|(n, _)| node != 0 && *n == node)
            .find_map(|(_, weak)| weak.upgrade())
    }
}
