//! [`Override::CrossEntropy`](super::Override::CrossEntropy): `log_softmax` of bf16/fp16 logits under
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
//! `cross_entropy_for_logits` and `log_softmax(-1, Kind::Float)` call. `cross_entropy_loss` (tch's
//! `Tensor::cross_entropy_loss`, PyTorch's `F.cross_entropy`) asks `log_softmax` for the logits'
//! own type instead, and autocast's `nll_loss` then casts that result to an fp32 copy: three
//! [rows, vocabulary] tensors (2 GB at 8 × 1024 tokens of a 32k vocabulary in bf16) where the
//! fused loss below keeps the logits alone. The kernels take that call too, rounding the
//! log-probabilities to the logits' type wherever they are read.
//!
//! The `nll_loss` that follows a classifier's `log_softmax` is fused with it into one
//! cross-entropy node: `nll_loss` of log-probabilities this module made computes the loss from the
//! logits and the per-row log-sum-exp the forward kept (loss = lse - x[target] per row), its node
//! takes the logits themselves as input, and its backward is one pass over the logits:
//! dx = k · (exp(x - lse) - onehot(target)), written over the logits themselves where nothing else
//! holds them any more ([`BackwardContext::may_overwrite`]), as llm.c does, so that the loss's
//! backward holds one [rows, classes] tensor where it would hold two. Neither the NLL's dense fp32
//! gradient nor, in the usual case, the fp32 log-probabilities (1.6 GB at GPT-2's size) are ever
//! written: where the result will carry a gradient, the forward computes only the log-sum-exp and
//! returns the log-probabilities *deferred* ([`crate::deferred`]): they get their memory and
//! values only if an operator other than `nll_loss` reads them, at that read, so every other use
//! sees exactly what ATen's kernel would have written. A shape whose deferred result was read is written in the
//! one-pass forward from then on (`Deferrals`), so a step that reads its log-probabilities beside
//! the loss pays no extra read of the logits. Where the log-probabilities also feed something
//! else, that use reaches the logits through the `log_softmax` node as usual and autograd adds the
//! two gradients. In autograd's graph the loss then does not depend on the log-probabilities, only on
//! the logits: their own gradient, asked for by `Tensor::run_backward(&[loss], &[y], ..)`, is
//! undefined (and a hook on them does not see the loss's part), while the logits' is exact. Set
//! `overrides: false` where that matters.

use std::mem::size_of;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use tch::{Device, Kind, Tensor};

use super::{chunked_classifier, DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::cuda::{type_tag, CudaModule, DevicePtr, KernelParams, TypedKernel};
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::function::{apply, BackwardContext, ForwardContext, Function};
use crate::kernels::KernelOp;

/// The kernels' file name, as NVRTC's messages and the kernel cache name it.
const SOURCE_NAME: &str = "log_softmax.cuh";

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

fn log_softmax(call: &OverrideCall<'_>) -> Result<Reply> {
    let x = call.tensor("self")?;
    let result = result_kind(x, call.kind("dtype"));
    // Logits a classifier head left pending: the loss after this computes them block by block.
    let head = chunked_classifier::head_of(x)?;
    if let Some(why) = unsupported(x, call.int("dim")?, result, head.is_some()) {
        return Ok(Reply::Declined(why));
    }
    let kernels = Kernels::get(x.device(), x.kind())?;
    let (rows, _) = rows_and_width(x);
    let lse = Tensor::f_empty([rows], (Kind::Float, x.device()))?;
    // Deferred where the result will carry a gradient (then a fused nll_loss is its likely
    // reader), unless the last deferred result of this shape was read by something else.
    let defer = if x.requires_grad() && ffi::autograd::grad_mode_enabled()? {
        deferrals().next(x.device(), &x.size())
    } else {
        None
    };
    let source = Arc::new(Source {
        kernels,
        tensors: Mutex::new((x.shallow_clone(), lse)),
        head: head.filter(|_| defer.is_some()),
    });
    let function = LogSoftmax {
        source: Arc::clone(&source),
        defer,
        result: result.unwrap_or(Kind::Float),
    };
    let y = apply(function, &[x])?.remove(0);
    if y.requires_grad() {
        links().push(&y, &source)?;
    }
    Ok(Reply::Ran(vec![y]))
}

/// The type of the log-probabilities a call asks for, where the kernels can give it: fp32 (no
/// `dtype`, or fp32), or the logits' own type (`cross_entropy_loss` asks for that: its
/// `log_softmax` runs in the logits' type, which autocast leaves alone, and autocast's `nll_loss`
/// then casts the result to fp32). `None` for any other.
fn result_kind(x: &Tensor, dtype: Result<Option<Kind>>) -> Option<Kind> {
    match dtype {
        Ok(None | Some(Kind::Float)) => Some(Kind::Float),
        Ok(Some(kind)) if kind == x.kind() => Some(kind),
        _ => None,
    }
}

/// `nll_loss` of log-probabilities the `log_softmax` above wrote, fused with it into one
/// cross-entropy node over the logits (see the module docs); any other call runs autocast's own
/// path.
fn nll_loss(call: &OverrideCall<'_>) -> Result<Reply> {
    let (y, target) = (call.tensor("self")?, call.tensor("target")?);
    let reduction = call.int("reduction")?;
    let source = match links().find(y) {
        Some(_) if call.optional_tensor("weight")?.is_some() => {
            return Ok(Reply::Declined("class weights".into()))
        }
        Some(source) => source,
        None => {
            return Ok(Reply::Declined(
                "input not from speedkit's log_softmax".into(),
            ))
        }
    };
    let rows = y.size().first().copied().unwrap_or(0);
    if y.dim() != 2 || target.dim() != 1 || target.size() != [rows] || target.kind() != Kind::Int64
    {
        return Ok(Reply::Declined(format!(
            "input {:?} and target {:?} {:?} (the fusion takes [rows, classes] and [rows] int64)",
            y.size(),
            target.size(),
            target.kind()
        )));
    }
    let reduction = match reduction {
        1 => Reduction::Mean,
        2 => Reduction::Sum,
        _ => return Ok(Reply::Declined("reduction none".into())),
    };
    let (logits, lse) = source.logits_and_lse();
    if let Some(head) = &source.head {
        if crate::deferred::is_pending(&logits)? {
            let mean = reduction == Reduction::Mean;
            let loss = head.loss(target, call.int("ignore_index")?, mean)?;
            return Ok(Reply::Ran(vec![loss]));
        }
        // Written since (a read, or a write to the head's operands): the loss reads them.
        source.lse(&logits, &lse)?;
    }
    let function = CrossEntropy {
        lse,
        kernels: Arc::clone(&source.kernels),
        ignore_index: call.int("ignore_index")?,
        reduction,
    };
    let loss = apply(function, &[&logits, target])?.remove(0);
    Ok(Reply::Ran(vec![loss]))
}

/// Why the kernels cannot take this call (`result`: the type it asks for, if they can give it;
/// `pending`: logits with no memory yet, which the allocator will align), or `None`.
fn unsupported(x: &Tensor, dim: i64, result: Option<Kind>, pending: bool) -> Option<String> {
    let kind = x.kind();
    if !matches!(kind, Kind::BFloat16 | Kind::Half) {
        return Some(format!("{kind:?} logits (the kernels read bf16 and fp16)"));
    }
    if result.is_none() {
        return Some("a result type other than fp32 or the logits' own".into());
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
    if !x.is_contiguous() || (!pending && width % 8 == 0 && x.data_ptr() as usize % 16 != 0) {
        return Some("logits that are not contiguous and 16-byte aligned".into());
    }
    if !crate::kernels::op_enabled(KernelOp::CrossEntropy) {
        return Some("speedkit's kernels are switched off".into());
    }
    crate::kernels::unavailable_reason(x.device()).unwrap_or_else(|e| Some(e.to_string()))
}

/// The forward and backward kernels for one logits type on one device.
struct Kernels {
    /// The logits' type, which the kernels read.
    kind: Kind,
    forward: TypedKernel<Forward<'static>>,
    /// The forward's first pass alone: the log-sum-exp.
    lse: TypedKernel<Lse<'static>>,
    /// The forward's second pass from a kept log-sum-exp: the log-probabilities.
    write: TypedKernel<Write<'static>>,
    backward: TypedKernel<Backward<'static>>,
    nll_backward: TypedKernel<NllBackward<'static>>,
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
        let tag = type_tag(kind).ok_or_else(|| {
            SpeedkitError::Misuse(format!("log_softmax's kernels take no {kind:?} logits"))
        })?;
        let module = CudaModule::built_in(SOURCE_NAME)?;
        let kernels = Arc::new(Kernels {
            kind,
            forward: load(&module, tag, device)?,
            lse: load(&module, tag, device)?,
            write: load(&module, tag, device)?,
            backward: load(&module, tag, device)?,
            nll_backward: load(&module, tag, device)?,
        });
        loaded.push(((device, kind), Arc::clone(&kernels)));
        Ok(kernels)
    }
}

/// The entry point of `P`'s kernel for logits of type `tag`.
fn load<P: Entry>(module: &CudaModule, tag: &str, device: Device) -> Result<TypedKernel<P>> {
    module.typed_kernel(&format!("{}_{tag}", P::NAME), device)
}

/// A params struct's entry points' common name (the source's `SK_KERNEL_ENTRY`), to which the
/// loader appends the logits' type tag.
trait Entry: KernelParams {
    const NAME: &'static str;
}

// The kernels' params structs, `speedkit/kernels/log_softmax.cuh`'s `sk::kernels::log_softmax`,
// mirrored field for field (`#[repr(C)]`, 8-byte fields first, the sizes asserted here as the
// source asserts them).

/// `Forward`: the log-probabilities and the log-sum-exp in one pass.
#[repr(C)]
#[derive(Clone, Copy)]
struct Forward<'t> {
    x: DevicePtr<'t>,
    y: DevicePtr<'t>,
    lse: DevicePtr<'t>,
    width: i32,
}

// SAFETY: `#[repr(C)]`, the source's `Forward` field for field.
unsafe impl KernelParams for Forward<'_> {}
impl Entry for Forward<'_> {
    const NAME: &'static str = "log_softmax_forward";
}
const _: () = assert!(size_of::<Forward>() == 32);

/// `Lse`: the forward's first pass alone.
#[repr(C)]
#[derive(Clone, Copy)]
struct Lse<'t> {
    x: DevicePtr<'t>,
    lse: DevicePtr<'t>,
    width: i32,
}

// SAFETY: `#[repr(C)]`, the source's `Lse` field for field.
unsafe impl KernelParams for Lse<'_> {}
impl Entry for Lse<'_> {
    const NAME: &'static str = "log_softmax_lse";
}
const _: () = assert!(size_of::<Lse>() == 24);

/// `Write`: the forward's second pass from a kept log-sum-exp.
#[repr(C)]
#[derive(Clone, Copy)]
struct Write<'t> {
    x: DevicePtr<'t>,
    lse: DevicePtr<'t>,
    y: DevicePtr<'t>,
    width: i32,
}

// SAFETY: `#[repr(C)]`, the source's `Write` field for field.
unsafe impl KernelParams for Write<'_> {}
impl Entry for Write<'_> {
    const NAME: &'static str = "log_softmax_write";
}
const _: () = assert!(size_of::<Write>() == 32);

/// `Backward`: the logits' gradient from the log-probabilities'.
#[repr(C)]
#[derive(Clone, Copy)]
struct Backward<'t> {
    dy: DevicePtr<'t>,
    x: DevicePtr<'t>,
    lse: DevicePtr<'t>,
    dx: DevicePtr<'t>,
    width: i32,
}

// SAFETY: `#[repr(C)]`, the source's `Backward` field for field.
unsafe impl KernelParams for Backward<'_> {}
impl Entry for Backward<'_> {
    const NAME: &'static str = "log_softmax_backward";
}
const _: () = assert!(size_of::<Backward>() == 40);

/// `NllBackward`: the fused cross-entropy's backward.
#[repr(C)]
#[derive(Clone, Copy)]
struct NllBackward<'t> {
    x: DevicePtr<'t>,
    lse: DevicePtr<'t>,
    targets: DevicePtr<'t>,
    grad: DevicePtr<'t>,
    total_weight: DevicePtr<'t>,
    dx: DevicePtr<'t>,
    ignore_index: i64,
    width: i32,
    mean: i32,
}

// SAFETY: `#[repr(C)]`, the source's `NllBackward` field for field.
unsafe impl KernelParams for NllBackward<'_> {}
impl Entry for NllBackward<'_> {
    const NAME: &'static str = "log_softmax_nll_backward";
}
const _: () = assert!(size_of::<NllBackward>() == 64);

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

/// What a `log_softmax` call leaves for a fused `nll_loss` of its result: the logits, their
/// per-row log-sum-exp (written by the forward), and the kernels.
struct Source {
    kernels: Arc<Kernels>,
    /// The logits and their log-sum-exp (a `Mutex` only to share tensors, which are not `Sync`).
    tensors: Mutex<(Tensor, Tensor)>,
    /// The head whose pending logits they are, where the loss computes them block by block: the
    /// log-sum-exp is then written only where the log-probabilities are ([`Source::lse`]).
    head: Option<Arc<chunked_classifier::Head>>,
}

impl Source {
    fn logits_and_lse(&self) -> (Tensor, Tensor) {
        let tensors = self.tensors.lock().unwrap_or_else(PoisonError::into_inner);
        (tensors.0.shallow_clone(), tensors.1.shallow_clone())
    }

    /// The log-probabilities into `y` from the logits and the kept log-sum-exp: what the one-pass
    /// forward writes, bit for bit (in fp32, then rounded where `y` is of the logits' type).
    fn write_log_probs(&self, y: &Tensor) -> Result<()> {
        if y.kind() != Kind::Float {
            let fp32 = Tensor::f_empty(y.size(), (Kind::Float, y.device()))?;
            self.write_log_probs(&fp32)?;
            y.shallow_clone().f_copy_(&fp32)?;
            return Ok(());
        }
        let (x, lse) = self.logits_and_lse();
        if self.head.is_some() {
            self.lse(&x, &lse)?;
        }
        let (rows, width) = rows_and_width(&x);
        let (grid, block) = launch_shape(rows, width);
        let kernel = &self.kernels.write;
        kernel.launch(
            grid,
            block,
            0,
            &Write {
                x: kernel.ptr(&x, self.kernels.kind)?,
                lse: kernel.ptr(&lse, Kind::Float)?,
                y: kernel.ptr(y, Kind::Float)?,
                width: width as i32,
            },
        )
    }

    /// The log-sum-exp of each row of `x` into `lse`.
    fn lse(&self, x: &Tensor, lse: &Tensor) -> Result<()> {
        let (rows, width) = rows_and_width(x);
        let (grid, block) = launch_shape(rows, width);
        let kernel = &self.kernels.lse;
        kernel.launch(
            grid,
            block,
            0,
            &Lse {
                x: kernel.ptr(x, self.kernels.kind)?,
                lse: kernel.ptr(lse, Kind::Float)?,
                width: width as i32,
            },
        )
    }
}

/// The autograd function around the kernels: logits in, log-probabilities out in `result` (fp32
/// or the logits' type; deferred where `defer` is given, which the writer sets if anything reads
/// them: only their log-sum-exp is computed now). The backward reads the logits and their
/// log-sum-exp, saved in place of the result.
struct LogSoftmax {
    source: Arc<Source>,
    defer: Option<Arc<AtomicBool>>,
    result: Kind,
}

impl Function for LogSoftmax {
    /// The backward launches speedkit's kernels: a second derivative through it is an error.
    fn once_differentiable(&self) -> bool {
        true
    }

    fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let x = &inputs[0];
        let (_, lse) = self.source.logits_and_lse();
        let lse = &lse;
        let (rows, width) = rows_and_width(x);
        let (grid, block) = launch_shape(rows, width);
        let kernels = &self.source.kernels;
        let y = if let Some(read) = &self.defer {
            // A head's pending logits are not read here: the loss computes them block by block.
            if self.source.head.is_none() {
                self.source.lse(x, lse)?;
            }
            let (source, read) = (Arc::clone(&self.source), Arc::clone(read));
            let y = crate::deferred::tensor(
                &x.size(),
                self.result,
                x.device(),
                // `nll_loss_nd` (`cross_entropy_loss`'s) passes [rows, classes] on to `nll_loss`.
                &["aten::nll_loss", "aten::nll_loss_nd"],
                move |y| {
                    read.store(true, Ordering::Relaxed);
                    source.write_log_probs(y)
                },
            )?;
            crate::deferred::computed_from(&y, &[x])?;
            y
        } else {
            let y = Tensor::f_empty(x.size(), (Kind::Float, x.device()))?;
            let kernel = &kernels.forward;
            kernel.launch(
                grid,
                block,
                0,
                &Forward {
                    x: kernel.ptr(x, kernels.kind)?,
                    y: kernel.ptr(&y, Kind::Float)?,
                    lse: kernel.ptr(lse, Kind::Float)?,
                    width: width as i32,
                },
            )?;
            y.f_to_kind(self.result)?
        };
        ctx.save_for_backward(&[x, lse])?;
        Ok(vec![y])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let mut saved = ctx.saved()?;
        let lse = saved.remove(1);
        let x = saved.remove(0);
        let Some(dy) = &grads[0] else {
            return Ok(vec![None]);
        };
        // A head's logits get their log-sum-exp where the log-probabilities are written, which a
        // gradient of them implies; written again, in case a read wrote them otherwise.
        if self.source.head.is_some() {
            self.source.lse(&x, &lse)?;
        }
        let dy = dy.f_to_kind(Kind::Float)?.f_contiguous()?;
        let dx = Tensor::f_empty(x.size(), (x.kind(), x.device()))?;
        let (rows, width) = rows_and_width(&x);
        let (grid, block) = launch_shape(rows, width);
        let kernel = &self.source.kernels.backward;
        kernel.launch(
            grid,
            block,
            0,
            &Backward {
                dy: kernel.ptr(&dy, Kind::Float)?,
                x: kernel.ptr(&x, self.source.kernels.kind)?,
                lse: kernel.ptr(&lse, Kind::Float)?,
                dx: kernel.ptr(&dx, self.source.kernels.kind)?,
                width: width as i32,
            },
        )?;
        Ok(vec![Some(dx)])
    }
}

/// How the NLL's loss is reduced over rows (ATen's codes 1 and 2; `none` is not fused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reduction {
    Mean,
    Sum,
}

/// `nll_loss(log_softmax(x))` as one node over the logits `x`: the loss from the logits and their
/// log-sum-exp (never reading the log-probabilities); the backward from the same in one kernel.
struct CrossEntropy {
    lse: Tensor,
    kernels: Arc<Kernels>,
    ignore_index: i64,
    reduction: Reduction,
}

impl Function for CrossEntropy {
    /// The backward launches speedkit's kernels: a second derivative through it is an error.
    fn once_differentiable(&self) -> bool {
        true
    }

    fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let (x, target) = (&inputs[0], &inputs[1]);
        // Per row -y[target] = lse - x[target]: ATen's operands, so the same float per row. An
        // ignored row picks class 0 and counts 0 (by `where`, which a -inf logit cannot turn NaN).
        let kept = target.f_ne(self.ignore_index)?;
        let picked = x
            .f_gather(
                1,
                &target.f_where_scalarother(&kept, 0)?.f_unsqueeze(1)?,
                false,
            )?
            .f_squeeze_dim(1)?
            .f_to_kind(Kind::Float)?;
        let per_row = self.lse.f_sub(&picked)?.f_where_scalarother(&kept, 0.0)?;
        let total = per_row.f_sum(Kind::Float)?;
        let total_weight = kept.f_sum(Kind::Float)?;
        let loss = match self.reduction {
            Reduction::Mean => total.f_div(&total_weight)?,
            Reduction::Sum => total,
        };
        // A detached alias: one that keeps no view or base of the user's logits alive, so that
        // once the user drops them the backward may write the gradient over them.
        ctx.save_for_backward(&[&x.f_detach()?, &self.lse, target, &total_weight])?;
        Ok(vec![loss])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let Some(grad) = &grads[0] else {
            return Ok(vec![None, None]);
        };
        let [x, lse, target, total_weight]: [Tensor; 4] =
            ctx.saved()?.try_into().map_err(|_| {
                crate::error::SpeedkitError::Misuse(
                    "the fused cross-entropy lost its saved tensors".into(),
                )
            })?;
        let grad = grad.f_to_kind(Kind::Float)?.f_contiguous()?;
        // Each element of the gradient is computed from the same element of the logits alone, so
        // where nothing else can read the logits any more the gradient takes their memory, as
        // llm.c's classifier does: the step's peak then holds one [rows, classes] tensor, not two.
        let dx = if ctx.may_overwrite(&x)? {
            x.shallow_clone()
        } else {
            Tensor::f_empty(x.size(), (x.kind(), x.device()))?
        };
        let (rows, width) = rows_and_width(&x);
        let (grid, block) = launch_shape(rows, width);
        let kernel = &self.kernels.nll_backward;
        kernel.launch(
            grid,
            block,
            0,
            &NllBackward {
                x: kernel.ptr(&x, self.kernels.kind)?,
                lse: kernel.ptr(&lse, Kind::Float)?,
                targets: kernel.ptr(&target, Kind::Int64)?,
                grad: kernel.ptr(&grad, Kind::Float)?,
                total_weight: kernel.ptr(&total_weight, Kind::Float)?,
                dx: kernel.ptr(&dx, self.kernels.kind)?,
                ignore_index: self.ignore_index,
                width: width as i32,
                mean: i32::from(self.reduction == Reduction::Mean),
            },
        )?;
        Ok(vec![Some(dx), None])
    }
}

/// The `log_softmax` calls whose result may still meet a fused `nll_loss`, by the identity of
/// the node (`grad_fn`) of the log-probabilities they wrote: how `nll_loss` knows its input is
/// one of them. An entry counts only while its source lives, which the node keeps alive: a node's
/// identity is not reused while it lives, and a view or an in-place change of the
/// log-probabilities has another node, so nothing else matches.
struct Links(Vec<(u64, Weak<Source>)>);

fn links() -> MutexGuard<'static, Links> {
    static LINKS: Mutex<Links> = Mutex::new(Links(Vec::new()));
    LINKS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Links {
    /// Records the node that made `y`, forgetting the entries whose node is gone.
    fn push(&mut self, y: &Tensor, source: &Arc<Source>) -> Result<()> {
        let node = ffi::autograd::grad_fn_identity(y)?;
        self.0.retain(|(_, weak)| weak.strong_count() > 0);
        self.0.push((node, Arc::downgrade(source)));
        Ok(())
    }

    fn find(&self, y: &Tensor) -> Option<Arc<Source>> {
        let node = ffi::autograd::grad_fn_identity(y).ok()?;
        self.0
            .iter()
            .rev()
            .filter(|(n, _)| node != 0 && *n == node)
            .find_map(|(_, weak)| weak.upgrade())
    }
}

/// Whether deferring pays, per logits shape: a deferred result that something besides the fused
/// loss reads costs one more read of the logits than the one-pass forward (the log-sum-exp pass,
/// then the write at the read). A training step reads the same way every step, so once a deferred
/// result of a shape has been read, that shape's calls write in one pass, deferring again every
/// `RETRY`-th call in case the step changed. In a CUDA graph, the warm-up steps decide what the
/// capture records.
pub(super) struct Deferrals(Vec<Deferral>);

struct Deferral {
    device: Device,
    shape: Vec<i64>,
    /// Set by the last deferred result's writer, if it ran.
    last_read: Arc<AtomicBool>,
    one_pass_calls: u32,
}

fn deferrals() -> MutexGuard<'static, Deferrals> {
    static DEFERRALS: Mutex<Deferrals> = Mutex::new(Deferrals::new());
    DEFERRALS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Deferrals {
    /// Calls of a shape that was read between two tries of deferring it again.
    const RETRY: u32 = 64;
    /// Shapes remembered (the oldest forgotten first).
    const SHAPES: usize = 16;

    /// No shape seen yet.
    pub(super) const fn new() -> Self {
        Deferrals(Vec::new())
    }

    /// The flag for the next result of `shape` to defer, or `None` to write it in one pass.
    pub(super) fn next(&mut self, device: Device, shape: &[i64]) -> Option<Arc<AtomicBool>> {
        let found = self
            .0
            .iter()
            .position(|d| d.device == device && d.shape == shape);
        let index = match found {
            Some(i) => i,
            None => {
                if self.0.len() == Self::SHAPES {
                    self.0.remove(0);
                }
                self.0.push(Deferral {
                    device,
                    shape: shape.to_vec(),
                    last_read: Arc::new(AtomicBool::new(false)),
                    one_pass_calls: 0,
                });
                self.0.len() - 1
            }
        };
        let entry = &mut self.0[index];
        if entry.last_read.load(Ordering::Relaxed) {
            entry.one_pass_calls += 1;
            if entry.one_pass_calls % Self::RETRY != 0 {
                return None;
            }
        }
        entry.last_read = Arc::new(AtomicBool::new(false));
        Some(Arc::clone(&entry.last_read))
    }
}
