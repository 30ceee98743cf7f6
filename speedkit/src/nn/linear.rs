//! [`Linear`]: `tch::nn::Linear`'s parameters under tch's names (`weight`, `bias`), with its GEMMs in
//! FP8 where the plan says so.
//!
//! FP8 follows the plan the way autocast does: inside a [`SpeedContext`](crate::SpeedContext)'s
//! autocast scope (`ctx.autocast(..)`, `#[speedkit::forward]`), each `Linear` decides per call whether
//! its GEMM runs in FP8 — the plan has FP8, the input is on a CUDA device, every dimension is a
//! multiple of 16 (what `_scaled_mm` accepts), and the GEMM (tokens × in × out) is at least
//! `fp8.min_gemm_size` — and otherwise runs the ordinary `x Wᵀ + b` under autocast. The first
//! decision of each layer is recorded for the context's audit.
//!
//! Outside FP8, where speedkit's kernels run (see [`crate::kernels`]), that `x Wᵀ + b` is the same
//! GEMMs as ATen's `linear` with a cheaper backward: the fp32 weight gradient comes out of its GEMM
//! in fp32 (no cast kernel), the bias gradient from speedkit's column-sum kernel, and the weight's
//! copy in the autocast type is kept from one step to the next (speedkit's AdamW writes it in its
//! update pass; a weight changed in place anywhere else is cast again at its next use). This path is
//! differentiable once: a second derivative through it is an error. Anywhere else it is ATen's
//! `linear`.
//!
//! ```
//! use speedkit::nn::Linear;
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layer = Linear::new(&(vs.root() / "proj"), 64, 32, true);
//! let y = layer.forward(&Tensor::randn([8, 64], (Kind::Float, Device::Cpu)));
//! assert_eq!(y.size(), [8, 32]);
//! assert!(vs.variables().contains_key("proj.weight"));   // tch's names: checkpoints load either way
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;
use tch::{nn, Device, Kind, Tensor};

use crate::amp::AutocastState;
use crate::config::{Fp8GradientFormat, Fp8Recipe};
use crate::ffi;
use crate::kernels::KernelOp;
use crate::overrides::chunked_classifier;
use crate::plan::Fp8Plan;

/// Longest amax history a layer keeps (the `fp8.amax_history` limit); the plan uses its first N.
pub(crate) const HISTORY_CAPACITY: i64 = 1024;

/// A linear layer, `y = x Wᵀ + b`, whose GEMMs run in FP8 inside a context scope whose plan has FP8.
#[derive(Debug)]
pub struct Linear {
    /// `weight`, `[out, in]`, fp32 master weights.
    pub ws: Tensor,
    /// `bias`, `[out]`.
    pub bs: Option<Tensor>,
    /// `fp8_amax_history`, `[3, 1024]`: the delayed recipe's amax of x, W and the output gradient,
    /// newest first; saved with the checkpoint, not trained.
    amax_history: Tensor,
    name: String,
}

impl Linear {
    /// A layer under `path` with tch's initialisation (Kaiming-uniform weight, uniform bias).
    pub fn new(path: &nn::Path, in_features: i64, out_features: i64, bias: bool) -> Self {
        let tch_layer = nn::linear(
            path,
            in_features,
            out_features,
            nn::LinearConfig {
                bias,
                ..Default::default()
            },
        );
        Self {
            ws: tch_layer.ws,
            bs: tch_layer.bs,
            amax_history: path.zeros_no_train("fp8_amax_history", &[3, HISTORY_CAPACITY]),
            name: path.components().collect::<Vec<_>>().join("."),
        }
    }

    /// The layer's path in its VarStore (e.g. `blocks.0.fc1`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `x Wᵀ + b`, in FP8 where the active plan allows it for this call's shapes.
    ///
    /// An input whose last dimension is not the layer's input width is a
    /// [`SpeedkitError::Misuse`](crate::SpeedkitError::Misuse) naming the layer and both shapes.
    pub fn forward_t(&self, x: &Tensor) -> crate::Result<Tensor> {
        self.check_input(x)?;
        if let Some(logits) = self.deferred_logits(x)? {
            return Ok(logits);
        }
        self.project(x, self.bs.as_ref())
    }

    /// `x Wᵀ + b` as `chunks` equal blocks of its last dimension: `forward_t(x)?.split(out /
    /// chunks, -1)`, for a projection whose output is used in parts, as q, k and v of attention.
    ///
    /// Where speedkit's kernels run, the backward puts the blocks' gradients side by side in the
    /// same pass that sums the bias gradient, instead of a cat kernel (the split's backward) and a
    /// second read for the bias. Elsewhere, and for a layer in FP8, it is the forward and a split.
    ///
    /// # Errors
    /// [`SpeedkitError::Misuse`](crate::SpeedkitError::Misuse) when the output features do not
    /// split into `chunks` equal parts, or as [`Linear::forward_t`].
    ///
    /// ```
    /// use speedkit::nn::Linear;
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let qkv = Linear::new(&(vs.root() / "qkv"), 16, 48, true);
    /// let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
    /// let [q, k, v] = &qkv.forward_chunks(&x, 3)?[..] else { unreachable!() };
    /// assert_eq!(q.size(), [2, 5, 16]);
    /// assert!(v.equal(&qkv.forward_t(&x)?.narrow(-1, 32, 16)));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn forward_chunks(&self, x: &Tensor, chunks: usize) -> crate::Result<Vec<Tensor>> {
        let out_features = self.ws.size().first().copied().unwrap_or(0);
        if chunks == 0 || out_features % chunks as i64 != 0 {
            return Err(crate::SpeedkitError::Misuse(format!(
                "speedkit::nn::Linear {}: its {out_features} output features do not split into \
                 {chunks} equal chunks",
                self.name
            )));
        }
        self.check_input(x)?;
        let bias = self.bs.as_ref();
        if let Some((plan, _)) = Fp8Scope::active() {
            match self.fp8_gemm(x, &plan) {
                Ok(_) => {
                    return Ok(self
                        .project(x, bias)?
                        .f_split(out_features / chunks as i64, -1)?)
                }
                Err(reason) => Fp8Scope::record(&self.name, false, &reason),
            }
        }
        ffi::linear::linear_chunks(x, &self.ws, bias, chunks)
    }

    /// `gelu_tanh(x Wᵀ + b)`: the first half of a transformer MLP.
    ///
    /// Where speedkit's kernels run (see [`crate::kernels`]), the GEMM runs without its bias and one
    /// kernel adds the bias and applies GELU; its backward yields the bias gradient from the
    /// GELU-backward pass, instead of a separate column reduction over the layer's whole output.
    /// Anywhere else (not CUDA, kernels off) it is ATen's `gelu(h + b)` after the same GEMM, and
    /// [`crate::kernels::notes`] say why.
    ///
    /// ```
    /// use speedkit::nn::Linear;
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let fc1 = Linear::new(&(vs.root() / "fc1"), 16, 64, true);
    /// let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
    /// let y = fc1.forward_gelu(&x)?;
    /// assert!(y.allclose(&x.linear(&fc1.ws, fc1.bs.as_ref()).gelu("tanh"), 1e-6, 1e-6, false));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn forward_gelu(&self, x: &Tensor) -> crate::Result<Tensor> {
        let Some(bias) = &self.bs else {
            return Ok(self.forward_t(x)?.f_gelu("tanh")?);
        };
        ffi::bias_gelu::bias_gelu(&self.project(x, None)?, bias)
    }

    /// `x Wᵀ (+ bias)`, in FP8 where the active plan allows it for this call's shapes.
    fn project(&self, x: &Tensor, bias: Option<&Tensor>) -> crate::Result<Tensor> {
        self.check_input(x)?;
        let Some((plan, out)) = Fp8Scope::active() else {
            return self.project_in_autocast_type(x, bias);
        };
        match self.fp8_gemm(x, &plan) {
            Ok(gemm) => {
                Fp8Scope::record(&self.name, true, &gemm);
                let histories = self.histories(&plan);
                let h = histories.as_ref().map(|[a, b, c]| [a, b, c]);
                let options = ffi::fp8::Fp8LinearOptions {
                    rowwise: plan.recipe == Fp8Recipe::Rowwise,
                    e4m3_gradients: plan.gradient_format == Fp8GradientFormat::E4m3,
                };
                ffi::fp8::linear(x, &self.ws, bias, h, ffi::scalar_type_code(out)?, options)
            }
            Err(reason) => {
                Fp8Scope::record(&self.name, false, &reason);
                self.project_in_autocast_type(x, bias)
            }
        }
    }

    /// `x Wᵀ (+ bias)` in the autocast type: on speedkit's kernels where they run (the weight
    /// gradient straight from its GEMM in fp32, the bias gradient from `bias_grad`), else ATen's
    /// `linear`, with the reason in the notes.
    fn project_in_autocast_type(&self, x: &Tensor, bias: Option<&Tensor>) -> crate::Result<Tensor> {
        ffi::linear::linear(x, &self.ws, bias)
    }

    /// A classifier head's logits, deferred, where [`cross_entropy`](super::cross_entropy) can take
    /// them from the head a block of rows at a time (the chunked classifier of
    /// `crate::overrides`): a step that trains, outside FP8, on speedkit's kernels, logits large
    /// enough. Any other read of them writes them, as this layer would.
    fn deferred_logits(&self, x: &Tensor) -> crate::Result<Option<Tensor>> {
        if Fp8Scope::active().is_some() {
            return Ok(None);
        }
        let Some(kind) = chunked_head_type(x)? else {
            return Ok(None);
        };
        let reader = chunked_classifier::HeadReader::SpeedkitCrossEntropy;
        chunked_classifier::deferred_logits(x, &self.ws, self.bs.as_ref(), kind, reader)
    }

    /// An input whose last dimension is not the layer's input width is the caller's mistake, on
    /// every path: an error naming the layer and both shapes.
    fn check_input(&self, x: &Tensor) -> crate::Result<()> {
        let in_features = self.ws.size().last().copied();
        if x.size().last().copied() == in_features {
            return Ok(());
        }
        Err(crate::SpeedkitError::Misuse(format!(
            "speedkit::nn::Linear {}: the input of shape {:?} must end in the layer's {} input \
             features (its weight is {:?})",
            self.name,
            x.size(),
            in_features.unwrap_or(0),
            self.ws.size()
        )))
    }

    /// This call's GEMM, if it can run in FP8 under `plan`; otherwise why not.
    fn fp8_gemm(&self, x: &Tensor, plan: &Fp8Plan) -> Result<String, String> {
        fp8_gemm(x, &self.ws, plan)
    }

    /// The delayed recipe's histories, each narrowed to the plan's length; none for the others.
    fn histories(&self, plan: &Fp8Plan) -> Option<[Tensor; 3]> {
        if plan.recipe != Fp8Recipe::Delayed {
            return None;
        }
        let len = (plan.amax_history as i64).clamp(1, HISTORY_CAPACITY);
        Some([0, 1, 2].map(|row| self.amax_history.get(row).narrow(0, 0, len)))
    }
}

/// The GEMMs' type of a chunked classifier head taking `x`: autocast's, where autocast is on for
/// `x`'s CUDA device and speedkit's linear and cross-entropy kernels run there; `None` otherwise.
fn chunked_head_type(x: &Tensor) -> crate::Result<Option<Kind>> {
    let ops = [KernelOp::Linear, KernelOp::CrossEntropy];
    if !ops.into_iter().all(crate::kernels::op_enabled) || !x.is_floating_point() {
        return Ok(None);
    }
    if crate::kernels::unavailable_reason(x.device())?.is_some() {
        return Ok(None);
    }
    let autocast = AutocastState::current(x.device())?;
    Ok(autocast.enabled.then_some(autocast.dtype))
}

/// The GEMM of `x Wᵀ` for `weight`, if it can run in FP8 under `plan` (on CUDA, every dimension a
/// multiple of 16, at least the plan's `min_gemm_size`); otherwise why not.
pub(crate) fn fp8_gemm(x: &Tensor, weight: &Tensor, plan: &Fp8Plan) -> Result<String, String> {
    let [out_features, in_features] = weight.size()[..] else {
        return Err("the weight is not 2-d".into());
    };
    if !matches!(x.device(), Device::Cuda(_)) {
        return Err("the input is not on a CUDA device".into());
    }
    let tokens = x.numel() as i64 / in_features.max(1);
    fp8_gemm_of_shape(tokens, in_features, out_features, plan)
}

/// [`fp8_gemm`] for a GEMM of `tokens` rows through an `[out_features, in_features]` weight.
fn fp8_gemm_of_shape(
    tokens: i64,
    in_features: i64,
    out_features: i64,
    plan: &Fp8Plan,
) -> Result<String, String> {
    let gemm = format!("GEMM {tokens} × {in_features} × {out_features}");
    if [tokens, in_features, out_features]
        .iter()
        .any(|d| d % 16 != 0)
    {
        return Err(format!(
            "{gemm}: FP8 GEMMs need every dimension a multiple of 16"
        ));
    }
    let size = (tokens as u64) * (in_features as u64) * (out_features as u64);
    if size < plan.min_gemm_size {
        return Err(format!(
            "{gemm} = {size}, below fp8.min_gemm_size {}: the casts would cost more than FP8 gains",
            plan.min_gemm_size
        ));
    }
    // The backward casts the output gradient to one byte per element in both layouts its GEMMs
    // take, beside the 16-bit gradient, where the forward kept its input in one byte: for the
    // first layer of the backward (the classifier), at the step's memory peak.
    let ratio = 2 * out_features as u64 / (in_features as u64).max(1);
    if ratio > u64::from(plan.max_gradient_copy_ratio) {
        return Err(format!(
            "{gemm}: its backward's FP8 copies of the output gradient would outweigh the FP8 \
             input copy it keeps {ratio}-fold, above fp8.max_gradient_copy_ratio {}",
            plan.max_gradient_copy_ratio
        ));
    }
    Ok(gemm)
}

impl nn::Module for Linear {
    /// Panics on a libtorch error, as tch's own modules do; [`Linear::forward_t`] returns it instead.
    fn forward(&self, xs: &Tensor) -> Tensor {
        match self.forward_t(xs) {
            Ok(y) => y,
            Err(e) => panic!("speedkit::nn::Linear {}: {e}", self.name),
        }
    }
}

/// One layer's FP8 decision, as the audit shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Decision {
    /// The layer's path.
    pub layer: String,
    /// Whether its GEMMs run in FP8.
    pub fp8: bool,
    /// Why (the GEMM shape, or what keeps it in the autocast dtype).
    pub reason: String,
}

struct ActiveScope {
    plan: Option<Fp8Plan>,
    out: Kind,
    decisions: Vec<Fp8Decision>,
}

thread_local! {
    static SCOPES: RefCell<Vec<ActiveScope>> = const { RefCell::new(Vec::new()) };
}

/// Puts an FP8 plan in force for [`Linear`] layers on this thread until dropped, and collects each
/// layer's first decision. [`SpeedContext::autocast_scope`](crate::SpeedContext::autocast_scope)
/// enters one with the plan's FP8 settings; nested scopes shadow outer ones.
#[must_use = "the plan is in force until the scope drops"]
pub struct Fp8Scope {
    _not_send: PhantomData<*const ()>,
}

impl Fp8Scope {
    /// Enters `plan` (`None`: no FP8 in this scope) with FP8 layers returning `out`.
    pub fn enter(plan: Option<Fp8Plan>, out: Kind) -> Self {
        SCOPES.with(|s| {
            s.borrow_mut().push(ActiveScope {
                plan,
                out,
                decisions: Vec::new(),
            })
        });
        Self {
            _not_send: PhantomData,
        }
    }

    /// Leaves the scope, returning the decisions its layers made.
    pub fn exit(self) -> Vec<Fp8Decision> {
        let decisions = SCOPES.with(|s| {
            s.borrow_mut()
                .last_mut()
                .map(|scope| std::mem::take(&mut scope.decisions))
        });
        drop(self);
        decisions.unwrap_or_default()
    }

    pub(crate) fn active() -> Option<(Fp8Plan, Kind)> {
        SCOPES.with(|s| {
            s.borrow()
                .last()
                .and_then(|scope| scope.plan.map(|p| (p, scope.out)))
        })
    }

    pub(crate) fn record(layer: &str, fp8: bool, reason: &str) {
        SCOPES.with(|s| {
            if let Some(scope) = s.borrow_mut().last_mut() {
                if !scope.decisions.iter().any(|d| d.layer == layer) {
                    scope.decisions.push(Fp8Decision {
                        layer: layer.to_owned(),
                        fp8,
                        reason: reason.to_owned(),
                    });
                }
            }
        });
    }
}

impl Drop for Fp8Scope {
    fn drop(&mut self) {
        SCOPES.with(|s| s.borrow_mut().pop());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use speedkit_config::{Fp8GradientFormat, Fp8Recipe};

    fn plan(min_gemm_size: u64, max_gradient_copy_ratio: u32) -> Fp8Plan {
        Fp8Plan {
            recipe: Fp8Recipe::Delayed,
            gradient_format: Fp8GradientFormat::E5m2,
            amax_history: 16,
            min_gemm_size,
            max_gradient_copy_ratio,
        }
    }

    #[test]
    fn a_classifier_over_a_wide_vocabulary_stays_in_the_autocast_dtype() {
        let limit = speedkit_config::Fp8Config::default().max_gradient_copy_ratio();
        let why = fp8_gemm_of_shape(8192, 768, 50304, &plan(0, limit)).unwrap_err();
        assert!(why.contains("131-fold"), "{why}");
        assert!(why.contains("fp8.max_gradient_copy_ratio 32"), "{why}");
    }

    #[test]
    fn the_decision_does_not_change_with_the_batch() {
        let limit = speedkit_config::Fp8Config::default().max_gradient_copy_ratio();
        for tokens in [16384, 360448] {
            assert!(fp8_gemm_of_shape(tokens, 768, 3072, &plan(0, limit)).is_ok());
            assert!(fp8_gemm_of_shape(tokens, 768, 8192, &plan(0, limit)).is_ok());
            assert!(fp8_gemm_of_shape(tokens, 768, 50304, &plan(0, limit)).is_err());
        }
    }

    #[test]
    fn a_gemm_below_the_size_threshold_stays_in_the_autocast_dtype() {
        let why = fp8_gemm_of_shape(16, 16, 16, &plan(1 << 20, u32::MAX)).unwrap_err();
        assert!(why.contains("below fp8.min_gemm_size"), "{why}");
    }
}
