//! [`Mlp`]: the transformer's feed-forward block, `fc2(gelu_tanh(fc1(x)))`, with its bias adds, GELU,
//! GELU derivative and bias gradients inside cuBLASLt's GEMM epilogues where they run, and ATen's
//! composite anywhere else.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::amp::AutocastState;
use crate::error::{Result, SpeedkitError};
use crate::{ffi, kernels};

const OP: &str = "mlp";

/// cuBLASLt's epilogues want 16-byte rows of bf16/fp16 and a GELU buffer whose leading dimension is
/// a multiple of 8: every width must be a multiple of this.
const WIDTH_MULTIPLE: i64 = 8;

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
/// [`crate::kernels::fallbacks`] says why, once.
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
        let result = match self.unsupported(x) {
            Ok(compute) => match self.fused(x, compute) {
                Ok(y) => {
                    kernels::note_run(OP);
                    Some(y)
                }
                Err(e) => {
                    kernels::note_fallback(OP, &format!("the fused MLP failed ({e})"));
                    None
                }
            },
            Err(reason) => {
                kernels::note_fallback(OP, &reason);
                None
            }
        };
        // GEMMs the fused path ran on ATen (cuBLASLt had no algorithm): the audit says which.
        for line in ffi::mlp_take_notes() {
            kernels::note_fallback(OP, &line);
        }
        match result {
            Some(y) => Ok(y),
            None => self.aten(x),
        }
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
        self.unsupported(x).err()
    }

    /// ATen's composite: what the fused path computes, anywhere.
    fn aten(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.fc1.ws, self.fc1.bs.as_ref())?
            .f_gelu("tanh")?
            .f_linear(&self.fc2.ws, self.fc2.bs.as_ref())?)
    }

    fn fused(&self, x: &Tensor, compute: Kind) -> Result<Tensor> {
        let (Some(b1), Some(b2)) = (&self.fc1.bs, &self.fc2.bs) else {
            return Err(SpeedkitError::Unsupported(
                "the fused MLP needs both biases".into(),
            ));
        };
        ffi::mlp(x, (&self.fc1.ws, b1), (&self.fc2.ws, b2), compute)
    }

    /// The compute type (the autocast type) when the fused path can take `x`, else why not.
    fn unsupported(&self, x: &Tensor) -> std::result::Result<Kind, String> {
        if let Some(reason) = kernels::unusable_on(x.device()) {
            return Err(reason);
        }
        let compute = match AutocastState::current(x.device()) {
            Ok(state) if state.enabled && matches!(state.dtype, Kind::BFloat16 | Kind::Half) => {
                state.dtype
            }
            Ok(_) => return Err("not inside a bf16 or fp16 autocast".into()),
            Err(e) => return Err(e.to_string()),
        };
        let floating = |k: Kind| matches!(k, Kind::Float | Kind::BFloat16 | Kind::Half);
        if !floating(x.kind()) {
            return Err(format!(
                "input type {:?} (the fused MLP takes fp32, bf16, fp16)",
                x.kind()
            ));
        }
        let (Some(b1), Some(b2)) = (&self.fc1.bs, &self.fc2.bs) else {
            return Err("a layer has no bias".into());
        };
        for p in [&self.fc1.ws, b1, &self.fc2.ws, b2] {
            if !floating(p.kind()) || p.device() != x.device() {
                return Err(format!(
                    "parameter of type {:?} on {:?}",
                    p.kind(),
                    p.device()
                ));
            }
        }
        self.shape_supported(&x.size())?;
        Ok(compute)
    }

    fn shape_supported(&self, size: &[i64]) -> std::result::Result<(), String> {
        let (w1, w2) = (self.fc1.ws.size(), self.fc2.ws.size());
        let (&[hidden, in_features], &[out_features, hidden2]) = (&w1[..], &w2[..]) else {
            return Err(format!("weights {w1:?} and {w2:?} are not 2-d"));
        };
        if hidden != hidden2 || size.last() != Some(&in_features) {
            return Err(format!(
                "input {size:?}, fc1 {w1:?} and fc2 {w2:?} do not chain"
            ));
        }
        if [in_features, hidden, out_features]
            .iter()
            .any(|&w| w <= 0 || w % WIDTH_MULTIPLE != 0)
        {
            return Err(format!(
                "widths {in_features} → {hidden} → {out_features}: cuBLASLt's epilogues need \
                 positive multiples of {WIDTH_MULTIPLE}"
            ));
        }
        Ok(())
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
    /// workload's shape (docs/benchmarks/2026-11-23-h200/mlp-timings.log).
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
    Ok(MlpBackwardFusion::from_mask(ffi::mlp_set_backward_fusion(
        fusion.mask(),
    )?))
}
