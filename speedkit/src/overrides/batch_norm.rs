//! [`Override::BatchNorm`](super::Override::BatchNorm): BatchNorm in training mode
//! (`nn::batch_norm2d`, `Tensor::batch_norm`) over channels-last activations on speedkit's
//! kernels, built on the public layer a user has: the kernels through [`crate::cuda`], the
//! registration through [`OperatorOverride`].
//!
//! ATen's `batch_norm` runs cuDNN's operator (`cudnn_batch_norm`) for fp32 and fp16 activations
//! with both parameters, and its own (`native_batch_norm`) otherwise, bf16 under autocast
//! included; both pairs are overridden under the CUDA key, below autograd. Autograd records the
//! operator's own node and calls its backward with what it saved (the input, the weight, the
//! batch's mean and inverse standard deviation), so the overrides only compute the values, the
//! same as ATen's and cuDNN's kernels up to rounding. The activations are read as a matrix of
//! rows × channels, which is what channels-last memory is (and `[N, C]`): a call whose input is
//! laid out otherwise, is in eval mode, or has parameters in a type other than fp32 runs ATen's
//! kernel, counted in the override's statistics.
//!
//! The kernels (`batch_norm.cu`) read each input once per pass: the statistics one read of `x`,
//! the normalisation one read and one write, the backward one read of the gradient and `x` for
//! the parameters' gradients and the sums, and one more for the input's gradient. ATen's
//! channels-last kernels need the same passes but reach a fifth to a half of the bandwidth at a
//! ResNet's shapes.
//!
//! The normalised output is *deferred* ([`crate::deferred`]): written at its first read, by the
//! same pass the forward would have run. Where that reader is a `relu` (conv → BatchNorm → ReLU),
//! or an `add` of a residual whose sum a `relu` reads (BatchNorm → + shortcut → ReLU, the shortcut
//! a tensor or another BatchNorm's pending output), the `relu` computes its result from the inputs
//! and the coefficients in one pass, and neither the normalised tensor nor the sum is ever written:
//! about 0.9 GB less memory traffic in a ResNet-18 step at batch 256. The input (and a residual)
//! must not change in place between the BatchNorm and that read, as for any deferred tensor.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use tch::{Device, Kind, Tensor};

use super::{DispatchKey, OperatorOverride, Outcome, OverrideCall};
use crate::cuda::{Arg, CudaKernel, CudaModule, Param};
use crate::error::Result;
use crate::ffi;
use crate::kernels::KernelOp;

/// The kernels' file name, as NVRTC's messages and the kernel cache name it.
pub(crate) const SOURCE_NAME: &str = "batch_norm.cu";
const SOURCE: &str = include_str!("batch_norm.cu");

/// Threads per block of the row passes (`kThreads` in the source).
const THREADS: i64 = 256;
/// Threads per side of the finishing passes' square blocks (`kFinish`).
const FINISH: u32 = 32;
/// The kernels' flags for the optional tensors (the source's `kWeight`, ...).
const WEIGHT: i32 = 1;
const BIAS: i32 = 2;
const RUNNING: i32 = 4;
const GRAD_WEIGHT: i32 = 8;
const GRAD_BIAS: i32 = 16;

/// `bit` where `present`, else no flag.
fn flag(present: bool, bit: i32) -> i32 {
    if present {
        bit
    } else {
        0
    }
}

/// The overrides, on CUDA: ATen's `native_batch_norm` and cuDNN's `cudnn_batch_norm` (which ATen's
/// `batch_norm` calls for fp32 and fp16 activations) with their backwards, and the `relu` and
/// `add` that fuse with their pending output.
pub(crate) fn operator_overrides() -> [OperatorOverride; 6] {
    [
        OperatorOverride::new("aten::native_batch_norm", DispatchKey::Cuda, native_forward),
        OperatorOverride::new(
            "aten::native_batch_norm_backward",
            DispatchKey::Cuda,
            native_backward,
        ),
        OperatorOverride::new("aten::cudnn_batch_norm", DispatchKey::Cuda, cudnn_forward),
        OperatorOverride::new(
            "aten::cudnn_batch_norm_backward",
            DispatchKey::Cuda,
            cudnn_backward,
        ),
        OperatorOverride::new("aten::relu", DispatchKey::Cuda, relu),
        OperatorOverride::new("aten::add.Tensor", DispatchKey::Cuda, add),
    ]
}

/// Registers the kernels' source with the kernel layer (without compiling it).
pub(crate) fn register_source() -> Result<()> {
    CudaModule::new(SOURCE_NAME, SOURCE).map(|_| ())
}

/// A call's result, or why the kernels do not take it.
type Computed<const N: usize> = std::result::Result<[Tensor; N], String>;

/// The override's answer for a computed call (with `extra`, a last result, appended).
fn outcome<const N: usize>(computed: Computed<N>, extra: Option<Tensor>) -> Outcome {
    match computed {
        Ok(results) => Outcome::Ran(results.into_iter().chain(extra).collect()),
        Err(why) => Outcome::Declined(why),
    }
}

/// `native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)`
/// → (output, save_mean, save_invstd).
fn native_forward(call: &OverrideCall<'_>) -> Result<Outcome> {
    let args = ForwardArgs {
        x: call.tensor("input")?,
        weight: call.optional_tensor("weight")?,
        bias: call.optional_tensor("bias")?,
        running_mean: call.optional_tensor("running_mean")?,
        running_var: call.optional_tensor("running_var")?,
        training: call.bool("training")?,
        momentum: call.double("momentum")?,
        eps: call.double("eps")?,
    };
    Ok(outcome(args.run()?, None))
}

/// `cudnn_batch_norm(input, weight, bias, running_mean, running_var, training,
/// exponential_average_factor, epsilon)` → (output, save_mean, save_invstd, reserve): the same
/// values, and an empty reserve (the backward below needs none).
fn cudnn_forward(call: &OverrideCall<'_>) -> Result<Outcome> {
    let x = call.tensor("input")?;
    let args = ForwardArgs {
        x,
        weight: Some(call.tensor("weight")?),
        bias: call.optional_tensor("bias")?,
        running_mean: call.optional_tensor("running_mean")?,
        running_var: call.optional_tensor("running_var")?,
        training: call.bool("training")?,
        momentum: call.double("exponential_average_factor")?,
        eps: call.double("epsilon")?,
    };
    let reserve = Tensor::f_empty([0], (Kind::Uint8, x.device()))?;
    Ok(outcome(args.run()?, Some(reserve)))
}

/// `native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
/// save_invstd, train, eps, output_mask)` → (grad_input, grad_weight, grad_bias). A call that
/// does not ask for the input's gradient runs ATen's kernel.
fn native_backward(call: &OverrideCall<'_>) -> Result<Outcome> {
    if !call.bool("train")? {
        return Ok(Outcome::Declined("eval mode".into()));
    }
    if !call.bools("output_mask")?.first().copied().unwrap_or(false) {
        return Ok(Outcome::Declined("no input gradient asked for".into()));
    }
    let args = BackwardArgs {
        dy: call.tensor("grad_out")?,
        x: call.tensor("input")?,
        weight: call.optional_tensor("weight")?,
        save_mean: call.optional_tensor("save_mean")?,
        save_invstd: call.optional_tensor("save_invstd")?,
    };
    Ok(outcome(args.run()?, None))
}

/// `cudnn_batch_norm_backward(input, grad_output, weight, running_mean, running_var, save_mean,
/// save_var, epsilon, reserveSpace)` → (grad_input, grad_weight, grad_bias); cuDNN's `save_var`
/// is the inverse standard deviation.
fn cudnn_backward(call: &OverrideCall<'_>) -> Result<Outcome> {
    let args = BackwardArgs {
        dy: call.tensor("grad_output")?,
        x: call.tensor("input")?,
        weight: Some(call.tensor("weight")?),
        save_mean: call.optional_tensor("save_mean")?,
        save_invstd: call.optional_tensor("save_var")?,
    };
    Ok(outcome(args.run()?, None))
}

/// A forward call's arguments.
struct ForwardArgs<'a> {
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    bias: Option<&'a Tensor>,
    running_mean: Option<&'a Tensor>,
    running_var: Option<&'a Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
}

impl ForwardArgs<'_> {
    /// (output, save_mean, save_invstd): the batch's statistics (updating the running ones),
    /// then the normalisation.
    fn run(&self) -> Result<Computed<3>> {
        let x = self.x;
        if !self.training {
            return Ok(Err("eval mode (the running statistics normalise)".into()));
        }
        if self.running_mean.is_some() != self.running_var.is_some() {
            return Ok(Err("one running statistic without the other".into()));
        }
        let params = [self.weight, self.bias, self.running_mean, self.running_var];
        let Some(layout) = Layout::of(x, params.iter().flatten().copied())? else {
            return Ok(Err(Layout::declined(x)));
        };
        let stand_in = Tensor::f_empty([1], (Kind::Float, x.device()))?;
        let or_stand_in =
            |t: Option<&Tensor>| t.map_or(stand_in.shallow_clone(), Tensor::shallow_clone);
        let flags = flag(self.weight.is_some(), WEIGHT)
            | flag(self.bias.is_some(), BIAS)
            | flag(self.running_mean.is_some(), RUNNING);
        let channels = layout.channels;
        let options = (Kind::Float, x.device());
        let (save_mean, save_invstd) = (
            Tensor::f_empty([channels], options)?,
            Tensor::f_empty([channels], options)?,
        );
        let coefficients = Tensor::f_empty([3, channels], options)?;
        let xm = layout.matrix(x)?;
        let partials = layout.sums(&layout.kernels.stats_partials, &[&xm])?;
        layout.kernels.stats_finish.launch(
            layout.finish_grid(),
            (FINISH, FINISH),
            0,
            &[
                (&partials.sums).into(),
                (&xm).into(),
                (&or_stand_in(self.weight)).into(),
                (&or_stand_in(self.bias)).into(),
                (&save_mean).into(),
                (&save_invstd).into(),
                (&or_stand_in(self.running_mean)).into(),
                (&or_stand_in(self.running_var)).into(),
                (&coefficients).into(),
                Arg::I32(partials.strips as i32),
                Arg::I32(channels as i32),
                Arg::I64(layout.rows),
                Arg::F32(self.eps as f32),
                Arg::F32(self.momentum as f32),
                Arg::I32(flags),
            ],
        )?;
        let y = Pointwise::output(Normalized {
            layout,
            tensors: Mutex::new((xm, coefficients)),
        })?;
        Ok(Ok([y, save_mean, save_invstd]))
    }
}

/// `relu` of a pending output of the forward above (or of an `add` below): the normalisation, the
/// addition and the ReLU in one pass over the inputs, the normalised tensor and the sum never
/// written. Any other call runs ATen's kernel.
fn relu(call: &OverrideCall<'_>) -> Result<Outcome> {
    let y = call.tensor("self")?;
    let Some(pointwise) = Pointwise::of(y)? else {
        return Ok(Outcome::Declined(
            "input not a pending BatchNorm output".into(),
        ));
    };
    if !pointwise.normalized.layout.is_whole(y) {
        return Ok(Outcome::Declined("a view of a BatchNorm output".into()));
    }
    Ok(Outcome::Ran(vec![pointwise.write(true)?]))
}

/// `add(self, other, alpha=1)` where one side is a pending BatchNorm output and the other a tensor
/// laid out as it, or another pending BatchNorm output (a residual block's sum): the sum pending
/// too, for the `relu` that usually follows. Any other call runs ATen's kernel.
fn add(call: &OverrideCall<'_>) -> Result<Outcome> {
    let (a, b) = (call.tensor("self")?, call.tensor("other")?);
    let (first, other) = match (Pointwise::of(a)?, Pointwise::of(b)?) {
        (Some(p), _) if p.addend.is_none() => (p, b),
        (_, Some(p)) if p.addend.is_none() => (p, a),
        _ => {
            return Ok(Outcome::Declined(
                "no side a pending BatchNorm output".into(),
            ))
        }
    };
    let layout = &first.normalized.layout;
    if call.double("alpha")? != 1.0 || !layout.is_whole(a) || !layout.is_whole(b) {
        return Ok(Outcome::Declined(
            "a scaled sum, or sides in other shapes, types or layouts".into(),
        ));
    }
    let addend = match Pointwise::of(other)? {
        Some(p) if p.addend.is_none() => Addend::Normalized(Arc::clone(&p.normalized)),
        Some(_) => return Ok(Outcome::Declined("a side that is a pending sum".into())),
        None => Addend::Tensor(Mutex::new(other.shallow_clone())),
    };
    let sum = Arc::new(Pointwise {
        normalized: Arc::clone(&first.normalized),
        addend: Some(addend),
    });
    Ok(Outcome::Ran(vec![sum.deferred()?]))
}

/// A training-mode forward's input and normalisation coefficients.
struct Normalized {
    layout: Layout,
    /// The input as a matrix and the coefficients [3, C] (a `Mutex` only to share tensors, which
    /// are not `Sync`).
    tensors: Mutex<(Tensor, Tensor)>,
}

impl Normalized {
    fn matrix_and_coefficients(&self) -> (Tensor, Tensor) {
        let tensors = self.tensors.lock().unwrap_or_else(PoisonError::into_inner);
        (tensors.0.shallow_clone(), tensors.1.shallow_clone())
    }
}

/// What a pending output is computed from: a normalisation, plus what an `add` added to it.
struct Pointwise {
    normalized: Arc<Normalized>,
    addend: Option<Addend>,
}

/// The other side of a fused `add`.
enum Addend {
    /// A tensor laid out as the normalised input.
    Tensor(Mutex<Tensor>),
    /// Another normalisation.
    Normalized(Arc<Normalized>),
}

impl Pointwise {
    /// The pending output of a forward: deferred (see [`Pointwise::deferred`]).
    fn output(normalized: Normalized) -> Result<Tensor> {
        Arc::new(Pointwise {
            normalized: Arc::new(normalized),
            addend: None,
        })
        .deferred()
    }

    /// What the pending output `t` computes from, where it is one of these.
    fn of(t: &Tensor) -> Result<Option<Arc<Pointwise>>> {
        Ok(crate::deferred::tag(t)?.and_then(|tag| pending().find(tag)))
    }

    /// The result, deferred ([`crate::deferred`]): written at its first read, unless that read is
    /// a fused consumer (a `relu`; an `add` of a bare normalisation), which computes from this
    /// instead. Written now where the thread cannot defer (RecordFunction off).
    fn deferred(self: &Arc<Self>) -> Result<Tensor> {
        let layout = &self.normalized.layout;
        let consumers: &[&str] = match self.addend {
            None => &["aten::relu", "aten::add"],
            Some(_) => &["aten::relu"],
        };
        let tag = pending().insert(self);
        let source = Arc::clone(self);
        let deferred = crate::deferred::tagged(
            &[layout.rows, layout.channels],
            layout.kind,
            layout.device,
            consumers,
            tag,
            move |ym| source.launch(ym, false),
        );
        match deferred {
            Ok(ym) => layout.unmatrix(&ym),
            Err(_) => self.write(false),
        }
    }

    /// The result (with `relu`, its ReLU) in a new tensor laid out as the input.
    fn write(&self, relu: bool) -> Result<Tensor> {
        let layout = &self.normalized.layout;
        let ym = Tensor::f_empty([layout.rows, layout.channels], (layout.kind, layout.device))?;
        self.launch(&ym, relu)?;
        layout.unmatrix(&ym)
    }

    /// Writes the result matrix [rows, C] into `ym`.
    fn launch(&self, ym: &Tensor, relu: bool) -> Result<()> {
        let layout = &self.normalized.layout;
        let (xm, coefficients) = self.normalized.matrix_and_coefficients();
        let (add, other, other_coefficients) = match &self.addend {
            None => (0, xm.shallow_clone(), coefficients.shallow_clone()),
            Some(Addend::Tensor(t)) => {
                let t = t.lock().unwrap_or_else(PoisonError::into_inner);
                (1, layout.matrix(&t)?, coefficients.shallow_clone())
            }
            Some(Addend::Normalized(n)) => {
                let (other, other_coefficients) = n.matrix_and_coefficients();
                (2, other, other_coefficients)
            }
        };
        layout.kernels.normalize[usize::from(relu)][add].launch(
            layout.elementwise_grid(),
            layout.block(),
            0,
            &[
                (&xm).into(),
                (&coefficients).into(),
                (&other).into(),
                (&other_coefficients).into(),
                ym.into(),
                Arg::I64(layout.rows),
                Arg::I32(layout.channels as i32),
            ],
        )
    }
}

/// The pending outputs by tag, held weakly (each output's writer holds its [`Pointwise`], so an
/// entry lives exactly as long as its output is pending).
struct Pending {
    next_tag: u64,
    entries: Vec<(u64, Weak<Pointwise>)>,
}

fn pending() -> MutexGuard<'static, Pending> {
    static PENDING: Mutex<Pending> = Mutex::new(Pending {
        next_tag: 1,
        entries: Vec::new(),
    });
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Pending {
    /// Records `pointwise` under a new tag, forgetting the entries whose outputs are gone.
    fn insert(&mut self, pointwise: &Arc<Pointwise>) -> u64 {
        self.entries.retain(|(_, weak)| weak.strong_count() > 0);
        let tag = self.next_tag;
        self.next_tag += 1;
        self.entries.push((tag, Arc::downgrade(pointwise)));
        tag
    }

    fn find(&self, tag: u64) -> Option<Arc<Pointwise>> {
        self.entries
            .iter()
            .find(|(t, _)| *t == tag)
            .and_then(|(_, weak)| weak.upgrade())
    }
}

/// A backward call's arguments (training mode).
struct BackwardArgs<'a> {
    dy: &'a Tensor,
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    save_mean: Option<&'a Tensor>,
    save_invstd: Option<&'a Tensor>,
}

impl BackwardArgs<'_> {
    /// (grad_input, grad_weight, grad_bias). The parameters' gradients come from the pass that
    /// the input's needs anyway, so they are returned also where the call's mask leaves them out
    /// (autograd reads only what it asked for).
    fn run(&self) -> Result<Computed<3>> {
        let (dy, x) = (self.dy, self.x);
        let (Some(save_mean), Some(save_invstd)) = (self.save_mean, self.save_invstd) else {
            return Ok(Err("no saved statistics".into()));
        };
        let saved = [Some(save_mean), Some(save_invstd), self.weight];
        let Some(layout) = Layout::of(x, saved.iter().flatten().copied())? else {
            return Ok(Err(Layout::declined(x)));
        };
        if dy.kind() != x.kind() || dy.size() != x.size() || !layout.fits(dy) {
            return Ok(Err(format!(
                "a gradient of {:?} {:?} with strides {:?}, not laid out as the input",
                dy.kind(),
                dy.size(),
                dy.stride()
            )));
        }
        let channels = layout.channels;
        let options = (Kind::Float, x.device());
        let (dym, xm) = (layout.matrix(dy)?, layout.matrix(x)?);
        let partials = layout.sums(&layout.kernels.backward_partials, &[&dym, &xm, save_mean])?;
        let (grad_weight, grad_bias) = (
            Tensor::f_empty([channels], options)?,
            Tensor::f_empty([channels], options)?,
        );
        let coefficients = Tensor::f_empty([4, channels], options)?;
        let flags = GRAD_WEIGHT | GRAD_BIAS | flag(self.weight.is_some(), WEIGHT);
        layout.kernels.backward_finish.launch(
            layout.finish_grid(),
            (FINISH, FINISH),
            0,
            &[
                (&partials.sums).into(),
                save_mean.into(),
                save_invstd.into(),
                self.weight.unwrap_or(save_mean).into(),
                (&grad_weight).into(),
                (&grad_bias).into(),
                (&coefficients).into(),
                Arg::I32(partials.strips as i32),
                Arg::I32(channels as i32),
                Arg::I64(layout.rows),
                Arg::I32(flags),
            ],
        )?;
        let dxm = Tensor::f_empty(xm.size(), (x.kind(), x.device()))?;
        layout.kernels.backward_input.launch(
            layout.elementwise_grid(),
            layout.block(),
            0,
            &[
                (&dym).into(),
                (&xm).into(),
                (&coefficients).into(),
                (&dxm).into(),
                Arg::I64(layout.rows),
                Arg::I32(channels as i32),
            ],
        )?;
        Ok(Ok([layout.unmatrix(&dxm)?, grad_weight, grad_bias]))
    }
}

/// How a call's activations are read: as a matrix [rows, channels] through the permutation that
/// moves the channel dimension last, which must be contiguous (channels-last memory, or `[N, C]`);
/// with the kernels for their type and the launch shape.
struct Layout {
    /// The input's sizes, type and device.
    shape: Vec<i64>,
    kind: Kind,
    device: Device,
    /// The dimensions in matrix order: 0, 2, 3, ..., 1.
    order: Vec<i64>,
    rows: i64,
    channels: i64,
    kernels: Arc<Kernels>,
    /// Channels per thread: 8 (16-byte loads) or 1.
    vec: i64,
    multiprocessors: i64,
}

/// A reduction's partial sums, [strips, 2, channels], and how many strips.
struct Partials {
    sums: Tensor,
    strips: i64,
}

impl Layout {
    /// The layout of `x` with the parameters `params`, or `None` where the kernels do not take it
    /// (see [`Layout::declined`] for why).
    fn of<'t>(x: &Tensor, params: impl Iterator<Item = &'t Tensor>) -> Result<Option<Layout>> {
        let device = x.device();
        let kinds_fit = matches!(x.kind(), Kind::Float | Kind::BFloat16 | Kind::Half);
        let mut params_fit = true;
        for p in params {
            params_fit &= p.kind() == Kind::Float && p.device() == device && p.is_contiguous();
        }
        if !kinds_fit || !params_fit || x.dim() < 2 || !enabled(device)? {
            return Ok(None);
        }
        let mut order: Vec<i64> = (0..x.dim() as i64).filter(|&d| d != 1).collect();
        order.push(1);
        let size = x.size();
        let channels = size[1];
        let rows = if channels == 0 {
            0
        } else {
            x.numel() as i64 / channels
        };
        if rows < 2 || channels > i64::from(i32::MAX) || !x.f_permute(&order)?.is_contiguous() {
            return Ok(None);
        }
        // The kernels read x through a raw pointer: a deferred x gets its values (and address) now.
        crate::deferred::materialize(x)?;
        let vec = if channels % 8 == 0 && aligned(x) {
            8
        } else {
            1
        };
        let Device::Cuda(index) = device else {
            return Ok(None);
        };
        Ok(Some(Layout {
            shape: size,
            kind: x.kind(),
            device,
            order,
            rows,
            channels,
            kernels: Kernels::get(device, x.kind(), vec)?,
            vec,
            multiprocessors: i64::from(
                ffi::device::cuda_device_props(index)?
                    .multiprocessors
                    .max(1),
            ),
        }))
    }

    /// Why [`Layout::of`] found no layout for `x`.
    fn declined(x: &Tensor) -> String {
        format!(
            "a {:?} input {:?} with strides {:?} on {:?} (the kernels take fp32, bf16 and fp16 \
             activations in channels-last memory with at least two rows, fp32 parameters, and \
             speedkit's kernels switched on)",
            x.kind(),
            x.size(),
            x.stride(),
            x.device()
        )
    }

    /// Whether `t` is laid out as the input (its matrix view contiguous and, where the kernels
    /// load 16 bytes at a time, aligned).
    fn fits(&self, t: &Tensor) -> bool {
        let contiguous = t
            .f_permute(&self.order)
            .map(|m| m.is_contiguous())
            .unwrap_or(false);
        let readable = crate::deferred::materialize(t).is_ok();
        contiguous && readable && (self.vec == 1 || aligned(t))
    }

    /// `t` as the matrix [rows, channels] (a view of the same memory).
    fn matrix(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.f_permute(&self.order)?
            .f_reshape([self.rows, self.channels])?)
    }

    /// Whether `t` has the input's type, shape and strides (and the alignment the kernels load at):
    /// a whole output of this layout, or a tensor that can stand beside it.
    fn is_whole(&self, t: &Tensor) -> bool {
        t.kind() == self.kind
            && t.device() == self.device
            && t.size() == self.shape
            && t.stride() == self.strides()
            && (self.vec == 1 || aligned(t))
    }

    /// The input's strides: those of its matrix, contiguous, read back through the permutation.
    fn strides(&self) -> Vec<i64> {
        let mut strides = vec![0i64; self.order.len()];
        let mut stride = 1;
        for &dim in self.order.iter().rev() {
            strides[dim as usize] = stride;
            stride *= self.shape[dim as usize];
        }
        strides
    }

    /// The matrix `m` back in the input's shape and strides (a view).
    fn unmatrix(&self, m: &Tensor) -> Result<Tensor> {
        let permuted: Vec<i64> = self.order.iter().map(|&d| self.shape[d as usize]).collect();
        let mut inverse = vec![0i64; self.order.len()];
        for (position, &dim) in self.order.iter().enumerate() {
            inverse[dim as usize] = position as i64;
        }
        Ok(m.f_view(permuted.as_slice())?.f_permute(&inverse)?)
    }

    /// Column groups per block row and block rows: `ct` × `256 / ct`, `ct` the power of two that
    /// covers the channels' groups, at most 32.
    fn block(&self) -> (u32, u32) {
        let groups = (self.channels + self.vec - 1) / self.vec;
        let ct = (groups.min(32) as u64).next_power_of_two() as i64;
        (ct as u32, (THREADS / ct) as u32)
    }

    fn grid_x(&self) -> i64 {
        let groups = (self.channels + self.vec - 1) / self.vec;
        let (ct, _) = self.block();
        (groups + i64::from(ct) - 1) / i64::from(ct)
    }

    /// Strips of rows for a pass: enough blocks to fill the GPU eight times over, at least four
    /// rows per thread, at most 65535 (the grid's y).
    fn strips(&self) -> (i64, i64) {
        let rows_per_pass = i64::from(self.block().1);
        let wanted = (8 * self.multiprocessors / self.grid_x()).max(1);
        let most = ((self.rows + 4 * rows_per_pass - 1) / (4 * rows_per_pass)).clamp(1, 65535);
        let strips = wanted.min(most);
        let strip_rows = (self.rows + strips - 1) / strips;
        let strip_rows = (strip_rows + rows_per_pass - 1) / rows_per_pass * rows_per_pass;
        ((self.rows + strip_rows - 1) / strip_rows, strip_rows)
    }

    fn elementwise_grid(&self) -> (u32, u32) {
        (self.grid_x() as u32, self.strips().0 as u32)
    }

    fn finish_grid(&self) -> u32 {
        ((self.channels + i64::from(FINISH) - 1) / i64::from(FINISH)) as u32
    }

    /// Runs a partials pass (`inputs` then the partials, rows, channels, strip rows).
    fn sums(&self, kernel: &CudaKernel, inputs: &[&Tensor]) -> Result<Partials> {
        let (strips, strip_rows) = self.strips();
        let sums = Tensor::f_empty(
            [strips, 2, self.channels],
            (Kind::Float, inputs[0].device()),
        )?;
        let mut args: Vec<Arg<'_>> = inputs.iter().map(|&t| t.into()).collect();
        args.extend([
            (&sums).into(),
            Arg::I64(self.rows),
            Arg::I32(self.channels as i32),
            Arg::I64(strip_rows),
        ]);
        kernel.launch(
            (self.grid_x() as u32, strips as u32),
            self.block(),
            0,
            &args,
        )?;
        Ok(Partials { sums, strips })
    }
}

/// Whether `t`'s data starts on a 16-byte boundary (the kernels' vector loads). A pending deferred
/// tensor has no address yet: the callers that ask about one ask about a whole output of this
/// module, whose memory will come from the allocator, aligned.
fn aligned(t: &Tensor) -> bool {
    match crate::deferred::is_pending(t) {
        Ok(true) => true,
        _ => t.data_ptr() as usize % 16 == 0,
    }
}

/// Whether speedkit's kernels run on `device` with BatchNorm's switched on.
fn enabled(device: Device) -> Result<bool> {
    Ok(crate::kernels::op_enabled(KernelOp::BatchNorm)
        && crate::kernels::unavailable_reason(device)?.is_none())
}

/// The kernels for one activation type and column group width on one device.
struct Kernels {
    stats_partials: CudaKernel,
    stats_finish: CudaKernel,
    /// The normalisation, by [ReLU or not][what it adds: nothing, a tensor, a normalisation].
    normalize: [[CudaKernel; 3]; 2],
    backward_partials: CudaKernel,
    backward_finish: CudaKernel,
    backward_input: CudaKernel,
}

impl Kernels {
    /// Compiled and loaded once per (device, type, width): the first call compiles with NVRTC (or
    /// reads the on-disk cache), later ones are a lookup.
    fn get(device: Device, kind: Kind, vec: i64) -> Result<Arc<Kernels>> {
        type Loaded = Mutex<Vec<((Device, Kind, i64), Arc<Kernels>)>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let mut loaded = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let key = (device, kind, vec);
        if let Some((_, k)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(k));
        }
        let tag = match kind {
            Kind::BFloat16 => "bf16",
            Kind::Half => "f16",
            _ => "f32",
        };
        let module = CudaModule::new(SOURCE_NAME, SOURCE)?;
        let (t, f) = (Param::Tensor(kind), Param::Tensor(Kind::Float));
        let (i32_, i64_) = (Param::I32, Param::I64);
        let kernel = |name: &str, params: &[Param]| module.kernel(name, params, device);
        let normalize = |relu: u8, add: u8| {
            kernel(
                &format!("batch_norm_normalize_{tag}_v{vec}_r{relu}_a{add}"),
                &[t, f, t, f, t, i64_, i32_],
            )
        };
        let kernels = Arc::new(Kernels {
            stats_partials: kernel(
                &format!("batch_norm_stats_partials_{tag}_v{vec}"),
                &[t, f, i64_, i32_, i64_],
            )?,
            stats_finish: kernel(
                &format!("batch_norm_stats_finish_{tag}"),
                &[
                    f,
                    t,
                    f,
                    f,
                    f,
                    f,
                    f,
                    f,
                    f,
                    i32_,
                    i32_,
                    i64_,
                    Param::F32,
                    Param::F32,
                    i32_,
                ],
            )?,
            normalize: [
                [normalize(0, 0)?, normalize(0, 1)?, normalize(0, 2)?],
                [normalize(1, 0)?, normalize(1, 1)?, normalize(1, 2)?],
            ],
            backward_partials: kernel(
                &format!("batch_norm_backward_partials_{tag}_v{vec}"),
                &[t, t, f, f, i64_, i32_, i64_],
            )?,
            backward_finish: kernel(
                "batch_norm_backward_finish",
                &[f, f, f, f, f, f, f, i32_, i32_, i64_, i32_],
            )?,
            backward_input: kernel(
                &format!("batch_norm_backward_input_{tag}_v{vec}"),
                &[t, t, f, t, i64_, i32_],
            )?,
        });
        loaded.push((key, Arc::clone(&kernels)));
        Ok(kernels)
    }
}
