//! Building blocks for models: attention on `scaled_dot_product_attention` (the backend chosen by
//! PyTorch among those the `sdp_backend` flags allow), drop-in modules on speedkit's fused kernels
//! ([`embedding`], [`LayerNorm`], [`cross_entropy`], [`Linear`] and [`Linear::forward_gelu`]) and on cuBLASLt's GEMM
//! epilogues ([`Mlp`]) that fall back to ATen's composite ops wherever those do not run; [`Linear`]'s
//! GEMMs also run in FP8 where the plan says so (cast by [`quantize_fp8`]).

mod cross_entropy;
mod embedding;
mod fp8;
mod layer_norm;
mod linear;
mod mlp;

pub use cross_entropy::{cross_entropy, cross_entropy_fallback_reason, IGNORE_INDEX};
pub use embedding::{embedding, embedding_fallback_reason};
pub use fp8::{quantize_fp8, quantize_fp8_rowwise, Fp8Format, Fp8Tensor, MAX_AMAX_HISTORY};
pub use layer_norm::{layer_norm, LayerNorm};
pub(crate) use linear::{fp8_gemm, HISTORY_CAPACITY as FP8_HISTORY_CAPACITY};
pub use linear::{Fp8Decision, Fp8Scope, Linear};
pub use mlp::{set_mlp_backward_fusion, Mlp, MlpBackwardFusion};

use serde::Serialize;
use std::fmt;
use tch::{Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::flags::Flag;

/// A scaled-dot-product-attention implementation (`torch.nn.attention.SDPBackend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SdpBackend {
    /// The reference implementation (materialises the attention matrix).
    Math,
    /// FlashAttention-2.
    Flash,
    /// Memory-efficient attention (xFormers-style).
    MemEfficient,
    /// cuDNN's fused attention.
    Cudnn,
    /// A backend registered by an out-of-tree device.
    Overrideable,
}

impl fmt::Display for SdpBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SdpBackend::Math => "math",
            SdpBackend::Flash => "flash",
            SdpBackend::MemEfficient => "mem_efficient",
            SdpBackend::Cudnn => "cudnn",
            SdpBackend::Overrideable => "overrideable",
        })
    }
}

fn enabled_backends() -> Result<Vec<&'static str>> {
    let mut on = Vec::new();
    for (flag, name) in [
        (Flag::SdpFlash, "flash"),
        (Flag::SdpMemEfficient, "mem_efficient"),
        (Flag::SdpMath, "math"),
        (Flag::SdpCudnn, "cudnn"),
    ] {
        if flag.get()?.as_bool() == Some(true) {
            on.push(name);
        }
    }
    Ok(on)
}

/// The backend `attention(q, k, v, causal)` would run (`torch._fused_sdp_choice`), or an error
/// saying why none can.
pub fn attention_backend(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<SdpBackend> {
    let enabled = enabled_backends()?;
    if enabled.is_empty() {
        return Err(SpeedkitError::Unsupported(
            "every SDPA backend is disabled (sdp_backend.flash/mem_efficient/math/cudnn are all false); \
             enable at least one"
                .into(),
        ));
    }
    let choice =
        Tensor::f_internal_fused_sdp_choice(q, k, v, None::<Tensor>, 0.0, causal, None, false)?;
    match choice {
        0 => Ok(SdpBackend::Math),
        1 => Ok(SdpBackend::Flash),
        2 => Ok(SdpBackend::MemEfficient),
        3 => Ok(SdpBackend::Cudnn),
        4 => Ok(SdpBackend::Overrideable),
        _ => Err(SpeedkitError::Unsupported(format!(
            "no enabled SDPA backend ({}) supports these inputs (q {:?} {:?} on {:?}); enable \
             sdp_backend.math, which takes any input",
            enabled.join(", "),
            q.size(),
            q.kind(),
            q.device()
        ))),
    }
}

/// Multi-head attention `softmax(q kᵀ / √d) v` over `[batch, heads, seq, head_dim]` tensors, causal
/// when asked, on PyTorch's fused kernels (FlashAttention on SM ≥ 8.0 in bf16/fp16).
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let q = Tensor::randn([2, 4, 16, 8], (Kind::Float, Device::Cpu));
/// let out = speedkit::nn::attention(&q, &q, &q, true)?;
/// assert_eq!(out.size(), [2, 4, 16, 8]);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    match Tensor::f_scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, causal, None, false)
    {
        Ok(out) => Ok(out),
        // Say which backends were allowed and why none ran, rather than libtorch's terse message.
        Err(e) => Err(match attention_backend(q, k, v, causal) {
            Err(why) => why,
            Ok(_) => SpeedkitError::from(e),
        }),
    }
}

/// A bias's gradient: the sum of `t` over every dimension but the last, accumulated in fp32 and
/// returned in `kind`, as `[t.size(-1)]`. On CUDA it runs speedkit's column-sum kernel (at HBM
/// bandwidth, where ATen's generic reduction reaches about a quarter of it); elsewhere ATen's
/// `sum`. It is an operator of speedkit's own (`speedkit::column_sums`), so a fused step sees it:
/// the fusion engine sums the columns inside the kernel that makes `t`, as it does for a `sum` of
/// ATen's. The `linear` override's backward sums its bias's gradient with it.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let dy = Tensor::ones([3, 5, 4], (Kind::BFloat16, Device::Cpu));
/// let db = speedkit::nn::column_sums(&dy, Kind::Float)?;
/// assert_eq!(db.size(), [4]);
/// assert_eq!(db.kind(), Kind::Float);
/// assert_eq!(db.double_value(&[0]), 15.0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn column_sums(t: &Tensor, kind: Kind) -> Result<Tensor> {
    crate::ffi::column_sums::column_sums(t, kind)
}

/// Whether `tensor` is a 4-d tensor laid out channels-last (NHWC in memory).
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let t = Tensor::zeros([2, 3, 4, 4], (Kind::Float, Device::Cpu));
/// assert!(!speedkit::nn::is_channels_last(&t)?);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn is_channels_last(tensor: &Tensor) -> Result<bool> {
    crate::ffi::optim::is_channels_last(tensor)
}
