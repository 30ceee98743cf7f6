//! LayerNorm over the last dimension, on speedkit's fused kernels where they run, with an ATen
//! fallback that gives the same result anywhere else.

use std::borrow::Borrow;

use tch::nn::{LayerNormConfig, Module, Path};
use tch::{Device, Kind, Tensor};

use crate::amp::AutocastState;
use crate::{ffi, kernels};

const OP: &str = "layer_norm";

/// LayerNorm over the last dimension, `y = (x − mean) / √(var + eps) · weight + bias`, a drop-in for
/// `tch::nn::layer_norm` (same parameter names, `weight` and `bias`, so checkpoints load either way).
///
/// On a CUDA device of SM ≥ 8.0 with speedkit's kernels on, the forward is one kernel that writes
/// its output directly in the autocast type (bf16 under bf16 autocast, instead of ATen's fp32 and a
/// cast) and keeps mean and 1/std for the backward, which gives dx, dweight and dbias in one pass
/// over the rows plus a small column reduction. Anywhere else — the CPU, kernels off, fp64, a row
/// too wide for the kernel — it runs `Tensor::layer_norm`, and [`crate::kernels::fallbacks`] says
/// why, once.
///
/// ```
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let norm = speedkit::nn::layer_norm(vs.root() / "ln", 64, Default::default());
/// let y = norm.forward(&Tensor::randn([4, 10, 64], (Kind::Float, Device::Cpu)));
/// assert_eq!(y.size(), [4, 10, 64]);
/// assert!(vs.variables().contains_key("ln.weight"));
/// ```
#[derive(Debug)]
pub struct LayerNorm {
    /// The scale, `[width]` (absent without `elementwise_affine`).
    pub weight: Option<Tensor>,
    /// The shift, `[width]` (absent without `elementwise_affine`).
    pub bias: Option<Tensor>,
    /// Added to the variance.
    pub eps: f64,
    width: i64,
}

/// A [`LayerNorm`] over rows of `width`, its parameters created in `path` as tch's would be.
///
/// ```
/// use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let norm = speedkit::nn::layer_norm(vs.root(), 768, nn::LayerNormConfig { eps: 1e-6, ..Default::default() });
/// assert_eq!(norm.width(), 768);
/// ```
pub fn layer_norm<'a, T: Borrow<Path<'a>>>(
    path: T,
    width: i64,
    config: LayerNormConfig,
) -> LayerNorm {
    let path = path.borrow();
    let (weight, bias) = if config.elementwise_affine {
        (
            Some(path.var("weight", &[width], config.ws_init)),
            Some(path.var("bias", &[width], config.bs_init)),
        )
    } else {
        (None, None)
    };
    LayerNorm {
        weight,
        bias,
        eps: config.eps,
        width,
    }
}

impl LayerNorm {
    /// The normalised width (the last dimension of the input).
    ///
    /// ```
    /// use tch::{nn, Device};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// assert_eq!(speedkit::nn::layer_norm(vs.root(), 32, Default::default()).width(), 32);
    /// ```
    pub fn width(&self) -> i64 {
        self.width
    }

    /// The pre-LN residual step: `(LN(x + residual), x + residual)`, the sum computed once and
    /// normalised in the same kernel (one pass fewer than an add followed by a LayerNorm), and its
    /// gradient from both uses added in the backward kernel.
    ///
    /// ```
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let norm = speedkit::nn::layer_norm(vs.root(), 16, Default::default());
    /// let (x, r) = (Tensor::randn([3, 16], (Kind::Float, Device::Cpu)), Tensor::randn([3, 16], (Kind::Float, Device::Cpu)));
    /// let (y, sum) = norm.forward_residual(&x, &r);
    /// assert!(sum.allclose(&(&x + &r), 1e-6, 1e-6, false));
    /// assert_eq!(y.size(), [3, 16]);
    /// ```
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> (Tensor, Tensor) {
        if let Some((y, Some(sum))) = self.on_kernels(x, Some(residual), false) {
            return (y, sum);
        }
        let sum = x + residual;
        (self.aten(&sum), sum)
    }

    /// `(LN(x), x)`, for an input that is used again later, as a pre-LN block's residual stream is:
    /// [`LayerNorm::forward_residual`] without a residual to add. The second output is `x` itself,
    /// passed through the LayerNorm, so that on speedkit's kernels the gradient of its later uses
    /// is added to the LayerNorm's input gradient inside the backward kernel. Otherwise autograd
    /// would add the two in a kernel of its own over the whole stream.
    ///
    /// ```
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let norm = speedkit::nn::layer_norm(vs.root(), 16, Default::default());
    /// let x = Tensor::randn([3, 16], (Kind::Float, Device::Cpu));
    /// let (y, same) = norm.forward_keeping_input(&x);
    /// assert!(same.equal(&x));
    /// assert!(y.allclose(&x.layer_norm([16], None::<Tensor>, None::<Tensor>, 1e-5, false), 1e-5, 1e-5, false));
    /// ```
    pub fn forward_keeping_input(&self, x: &Tensor) -> (Tensor, Tensor) {
        if let Some((y, Some(same))) = self.on_kernels(x, None, true) {
            return (y, same);
        }
        (self.aten(x), x.shallow_clone())
    }

    /// Why a forward of `x` would run ATen's composite instead of speedkit's kernels, or `None`
    /// when it runs the kernels.
    ///
    /// ```
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let norm = speedkit::nn::layer_norm(vs.root(), 8, Default::default());
    /// let why = norm.fallback_reason(&Tensor::zeros([2, 8], (Kind::Float, Device::Cpu)));
    /// assert!(why.is_some_and(|w| w.contains("CUDA")));
    /// ```
    pub fn fallback_reason(&self, x: &Tensor) -> Option<String> {
        self.unsupported(x, None)
    }

    fn aten(&self, x: &Tensor) -> Tensor {
        x.layer_norm(
            [self.width],
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
            true,
        )
    }

    /// The kernels' result, or `None` (after noting why) when this call takes the ATen path.
    fn on_kernels(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        keep_input: bool,
    ) -> Option<(Tensor, Option<Tensor>)> {
        if let Some(reason) = self.unsupported(x, residual) {
            kernels::note_fallback(OP, &reason);
            return None;
        }
        let out_kind = output_kind(x);
        match ffi::layer_norm(
            x,
            residual,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
            out_kind,
            keep_input,
        ) {
            Ok(result) => {
                kernels::note_run(OP);
                Some(result)
            }
            Err(e) => {
                kernels::note_fallback(OP, &format!("the kernel failed ({e})"));
                None
            }
        }
    }

    /// Why the kernels cannot take this input, or `None` when they can.
    fn unsupported(&self, x: &Tensor, residual: Option<&Tensor>) -> Option<String> {
        if let Some(reason) = kernels::unusable_on(x.device()) {
            return Some(reason);
        }
        if !matches!(x.kind(), Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Some(format!(
                "input type {:?} (the kernels take fp32, bf16, fp16)",
                x.kind()
            ));
        }
        let size = x.size();
        if size.last() != Some(&self.width) {
            return Some(format!(
                "input shape {size:?} does not end in the width {}",
                self.width
            ));
        }
        if let Some(r) = residual {
            // An fp32 residual stream may take a bf16/fp16 branch output (autocast's mix).
            let kinds_fit = r.kind() == x.kind()
                || (x.kind() == Kind::Float && matches!(r.kind(), Kind::BFloat16 | Kind::Half));
            if !kinds_fit || r.size() != size || r.device() != x.device() {
                return Some(format!(
                    "residual {:?} {:?} differs from the input {:?} {size:?}",
                    r.kind(),
                    r.size(),
                    x.kind()
                ));
            }
        }
        for p in self.weight.iter().chain(self.bias.iter()) {
            if !matches!(p.kind(), Kind::Float | Kind::BFloat16 | Kind::Half)
                || p.device() != x.device()
            {
                return Some(format!(
                    "parameter of type {:?} on {:?}",
                    p.kind(),
                    p.device()
                ));
            }
        }
        if let (Some(w), Some(b)) = (&self.weight, &self.bias) {
            if w.kind() != b.kind() {
                return Some(format!(
                    "weight {:?} and bias {:?} differ in type",
                    w.kind(),
                    b.kind()
                ));
            }
        }
        let rows = size.iter().rev().skip(1).product::<i64>();
        if self.width > i64::from(i32::MAX) || rows > i64::from(i32::MAX) {
            return Some(format!("shape {size:?} has more than 2³¹ rows or columns"));
        }
        let Device::Cuda(index) = x.device() else {
            return Some("not a CUDA tensor".into());
        };
        match ffi::layer_norm_width_supported(index, self.width) {
            Ok(true) => None,
            Ok(false) => Some(format!(
                "width {} exceeds the shared memory of the backward kernel",
                self.width
            )),
            Err(e) => Some(e.to_string()),
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self.on_kernels(x, None, false) {
            Some((y, _)) => y,
            None => self.aten(x),
        }
    }
}

/// The type a LayerNorm output is written in: the autocast type when autocast is on for the input's
/// device (the next op would cast to it anyway), else the input's own.
fn output_kind(x: &Tensor) -> Kind {
    match AutocastState::current(x.device()) {
        Ok(state) if state.enabled => state.dtype,
        _ => x.kind(),
    }
}
