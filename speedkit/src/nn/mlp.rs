//! [`Mlp`]: the transformer's feed-forward block, `fc2(gelu_tanh(fc1(x)))`, with its bias adds, GELU,
//! GELU derivative and bias gradients inside cuBLASLt's GEMM epilogues where they run, and ATen's
//! composite anywhere else.

use tch::nn::{self, Module};
use tch::Tensor;

use crate::error::Result;
use crate::ffi;

/// The pre-LN transformer's MLP, `fc2(gelu_tanh(fc1(x)))`, a drop-in for two `tch::nn::Linear`
/// layers around a GELU, with tch's parameter names (`fc1.weight`, `fc1.bias`, `fc2.weight`,
/// `fc2.bias` under its path), so checkpoints load either way.
///
/// On a CUDA device with speedkit's kernels on, inside a bf16 or fp16 autocast and with every width
/// a multiple of 8, it is one autograd function whose GEMMs run on cuBLASLt with epilogues: fc1
/// adds the bias and applies the GELU while writing its output (keeping the pre-activation for the
/// backward), fc2 adds its bias; the backward computes fc2's bias gradient in its weight-gradient
/// GEMM and the GELU derivative (and, if [`set_mlp_backward_fusion`] asks, fc1's bias gradient) in
/// its input-gradient GEMM. The fp32 master
/// weights are cast to the autocast type once per call (as autocast does) and their gradients come
/// back in fp32. Anywhere else it runs `x.linear(w1, b1).gelu("tanh").linear(w2, b2)`, and
/// [`crate::kernels::notes`] say why.
///
/// ```
/// use tch::{nn, Device, Kind, Tensor};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mlp = speedkit::nn::Mlp::new(&(vs.root() / "mlp"), 64, 256, 64);
/// let y = mlp.forward_t(&Tensor::randn([4, 10, 64], (Kind::Float, Device::Cpu)))?;
/// assert_eq!(y.size(), [4, 10, 64]);
/// assert!(vs.variables().contains_key("mlp.fc1.weight"));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Debug)]
pub struct Mlp {
    /// `fc1`: `[hidden, in]` weight and `[hidden]` bias.
    pub fc1: nn::Linear,
    /// `fc2`: `[out, hidden]` weight and `[out]` bias.
    pub fc2: nn::Linear,
}

impl Mlp {
    /// An MLP `in_features → hidden → out_features` under `path`, its layers `fc1` and `fc2`
    /// initialised as tch's `nn::linear` (Kaiming-uniform weights, uniform biases).
    ///
    /// ```
    /// use tch::{nn, Device};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mlp = speedkit::nn::Mlp::new(&vs.root(), 768, 3072, 768);
    /// assert_eq!(mlp.fc1.ws.size(), [3072, 768]);
    /// ```
    pub fn new(path: &nn::Path, in_features: i64, hidden: i64, out_features: i64) -> Self {
        Self {
            fc1: nn::linear(path / "fc1", in_features, hidden, Default::default()),
            fc2: nn::linear(path / "fc2", hidden, out_features, Default::default()),
        }
    }

    /// `fc2(gelu_tanh(fc1(x)))` over the last dimension of `x`, on cuBLASLt's fused GEMMs where
    /// they run (see [`Mlp`]), else on ATen's composite. Errors are libtorch's, e.g. for an input
    /// whose last dimension is not the MLP's input width.
    ///
    /// ```
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mlp = speedkit::nn::Mlp::new(&vs.root(), 8, 32, 8);
    /// assert!(mlp.forward_t(&Tensor::zeros([3, 9], (Kind::Float, Device::Cpu))).is_err());
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn forward_t(&self, x: &Tensor) -> Result<Tensor> {
        ffi::mlp::mlp(x, self.fc1_parts(), self.fc2_parts())
    }

    /// Why a forward of `x` would run ATen's composite instead of the fused GEMMs, or `None` when
    /// it runs them.
    ///
    /// ```
    /// use tch::{nn, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mlp = speedkit::nn::Mlp::new(&vs.root(), 8, 32, 8);
    /// let why = mlp.fallback_reason(&Tensor::zeros([2, 8], (Kind::Float, Device::Cpu)));
    /// assert!(why.is_some_and(|w| w.contains("CUDA")));
    /// ```
    pub fn fallback_reason(&self, x: &Tensor) -> Option<String> {
        ffi::mlp::unsupported(x, self.fc1_parts(), self.fc2_parts())
            .unwrap_or_else(|e| Some(e.to_string()))
    }

    fn fc1_parts(&self) -> (&Tensor, Option<&Tensor>) {
        (&self.fc1.ws, self.fc1.bs.as_ref())
    }

    fn fc2_parts(&self) -> (&Tensor, Option<&Tensor>) {
        (&self.fc2.ws, self.fc2.bs.as_ref())
    }
}

impl Module for Mlp {
    /// Panics on a libtorch error, as tch's own modules do; [`Mlp::forward_t`] returns it instead.
    fn forward(&self, xs: &Tensor) -> Tensor {
        match self.forward_t(xs) {
            Ok(y) => y,
            Err(e) => panic!("speedkit::nn::Mlp: {e}"),
        }
    }
}

/// Which parts of [`Mlp`]'s backward run inside cuBLASLt's GEMMs; each one switched off runs as
/// ATen's separate pass instead (same result within rounding). Process-wide, like the `kernels`
/// switch: an epilogue is not faster than the pass it replaces on every GPU and shape, so this
/// lets a benchmark compare them.
///
/// ```
/// use speedkit::nn::MlpBackwardFusion;
/// assert!(MlpBackwardFusion::ALL.fc1_bias_grad);
/// assert!(!MlpBackwardFusion::DEFAULT.fc1_bias_grad);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpBackwardFusion {
    /// The weight-gradient GEMMs write fp32 directly (else bf16/fp16 and a cast).
    pub fp32_weight_grads: bool,
    /// fc2's bias gradient in its weight-gradient GEMM (BGRADB).
    pub fc2_bias_grad: bool,
    /// The GELU derivative in fc2's input-gradient GEMM (DGELU).
    pub gelu_grad: bool,
    /// fc1's bias gradient in that same GEMM (DGELU_BGRAD; only with `gelu_grad`).
    pub fc1_bias_grad: bool,
}

impl MlpBackwardFusion {
    /// Every epilogue on.
    pub const ALL: Self = Self {
        fp32_weight_grads: true,
        fc2_bias_grad: true,
        gelu_grad: true,
        fc1_bias_grad: true,
    };
    /// The setting in force until changed: every epilogue but fc1's bias gradient, which ATen's
    /// column sum computes faster than cuBLASLt's DGELU_BGRAD on an H200 at the `transformer`
    /// workload's shape (docs/benchmarks/data/2026-11-23-h200-mlp-timings.log).
    pub const DEFAULT: Self = Self {
        fp32_weight_grads: true,
        fc2_bias_grad: true,
        gelu_grad: true,
        fc1_bias_grad: false,
    };
    /// Plain GEMMs on cuBLASLt, everything else on ATen.
    pub const NONE: Self = Self {
        fp32_weight_grads: false,
        fc2_bias_grad: false,
        gelu_grad: false,
        fc1_bias_grad: false,
    };

    fn mask(self) -> i32 {
        i32::from(self.fp32_weight_grads)
            | i32::from(self.fc2_bias_grad) << 1
            | i32::from(self.gelu_grad) << 2
            | i32::from(self.fc1_bias_grad) << 3
    }

    fn from_mask(mask: i32) -> Self {
        Self {
            fp32_weight_grads: mask & 1 != 0,
            fc2_bias_grad: mask & 2 != 0,
            gelu_grad: mask & 4 != 0,
            fc1_bias_grad: mask & 8 != 0,
        }
    }
}

/// Sets which parts of every [`Mlp`]'s backward run in cuBLASLt's epilogues and returns the
/// previous setting (put it back when done). An error where speedkit was built without CUDA.
///
/// ```no_run
/// use speedkit::nn::{set_mlp_backward_fusion, MlpBackwardFusion};
/// let before = set_mlp_backward_fusion(MlpBackwardFusion::NONE)?;
/// // ... time the backward with ATen's separate passes ...
/// set_mlp_backward_fusion(before)?;
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn set_mlp_backward_fusion(fusion: MlpBackwardFusion) -> Result<MlpBackwardFusion> {
    Ok(MlpBackwardFusion::from_mask(ffi::mlp::set_backward_fusion(
        fusion.mask(),
    )?))
}
