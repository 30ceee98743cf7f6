//! LayerNorm over the last dimension, on speedkit's fused kernels where they run, with an ATen
//! fallback that gives the same result anywhere else.

use std::borrow::Borrow;

use tch::nn::{LayerNormConfig, Module, Path};
use tch::Tensor;

use crate::ffi;

/// LayerNorm over the last dimension, `y = (x − mean) / √(var + eps) · weight + bias`, a drop-in for
/// `tch::nn::layer_norm` (same parameter names, `weight` and `bias`, so checkpoints load either way).
///
/// On a CUDA device of SM ≥ 8.0 with speedkit's kernels on, the forward is one kernel that writes
/// its output directly in the autocast type (bf16 under bf16 autocast, instead of ATen's fp32 and a
/// cast) and keeps mean and 1/std for the backward, which gives dx, dweight and dbias in one pass
/// over the rows plus a small column reduction. Anywhere else — the CPU, kernels off, fp64, a row
/// too wide for the kernel — it runs `Tensor::layer_norm`, and [`crate::kernels::notes`] say why.
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
        let (y, sum) = self.run(x, Some(residual), false);
        (y, sum.unwrap_or_else(|| x + residual))
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
        let (y, same) = self.run(x, None, true);
        (y, same.unwrap_or_else(|| x.shallow_clone()))
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
        if let Err(e) = self.check_width(x) {
            return Some(e);
        }
        ffi::layernorm::unsupported(x, None, self.weight.as_ref(), self.bias.as_ref())
            .unwrap_or_else(|e| Some(e.to_string()))
    }

    /// The forward on speedkit's kernels where they take the input, else ATen's; panics on a
    /// libtorch error, as tch's own modules do.
    fn run(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        keep_input: bool,
    ) -> (Tensor, Option<Tensor>) {
        let result = self
            .check_width(x)
            .map_err(crate::SpeedkitError::Misuse)
            .and_then(|()| {
                ffi::layernorm::layer_norm(
                    x,
                    residual,
                    self.weight.as_ref(),
                    self.bias.as_ref(),
                    self.eps,
                    keep_input,
                )
            });
        match result {
            Ok(out) => out,
            Err(e) => panic!("speedkit::nn::LayerNorm: {e}"),
        }
    }

    /// An input whose last dimension is not the normalised width is the caller's mistake.
    fn check_width(&self, x: &Tensor) -> Result<(), String> {
        let size = x.size();
        if size.last() == Some(&self.width) {
            return Ok(());
        }
        Err(format!(
            "input shape {size:?} does not end in the width {}",
            self.width
        ))
    }
}

impl Module for LayerNorm {
    /// Panics on a libtorch error, as tch's own modules do.
    fn forward(&self, x: &Tensor) -> Tensor {
        self.run(x, None, false).0
    }
}
