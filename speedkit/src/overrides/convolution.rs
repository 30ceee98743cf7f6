//! [`Override::Convolution`](super::Override::Convolution): `aten::conv1d`, `conv2d` and `conv3d`
//! under CUDA autocast (`nn::conv2d`, `Tensor::conv2d`) without a kept copy of the weight.
//!
//! Autocast casts each fp32 weight to bf16/fp16 in the forward, and ATen's convolution node keeps
//! that copy for the layer's backward, so at the end of the forward, a convolutional network's
//! memory peak, every layer's copy is alive (about 21 MiB for a CIFAR ResNet-18). speedkit's convolution saves
//! the fp32 weight instead, which the model holds anyway, and casts it again in the backward: one
//! more pass over each weight per step, what torch.compile's partitioner chooses for the same
//! graph. The convolutions themselves are ATen's, on the operands autocast would give them.

use tch::{Kind, Tensor};

use super::{DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::amp::AutocastState;
use crate::error::Result;
use crate::ffi::{self, convolution::ConvolutionParams};
use crate::kernels::KernelOp;

/// The overrides: ATen's `conv1d`, `conv2d` and `conv3d` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 3] {
    ["aten::conv1d", "aten::conv2d", "aten::conv3d"]
        .map(|op| OperatorOverride::new(op, DispatchKey::AutocastCuda, convolution))
}

fn convolution(call: &OverrideCall<'_>) -> Result<Reply> {
    let (x, weight) = (call.tensor("input")?, call.tensor("weight")?);
    let bias = call.optional_tensor("bias")?;
    // Autocast's type, read while its key is excluded (as the override runs): the type is kept.
    let kind = AutocastState::current(x.device())?.dtype;
    if let Some(why) = unsupported([Some(x), Some(weight), bias].into_iter().flatten(), x) {
        return Ok(Reply::Declined(why));
    }
    let params = ConvolutionParams {
        stride: call.ints("stride")?,
        padding: call.ints("padding")?,
        dilation: call.ints("dilation")?,
        groups: call.int("groups")?,
    };
    let y = ffi::convolution::convolution(x, weight, bias, &params, kind)?;
    Ok(Reply::Ran(vec![y]))
}

/// Why speedkit's convolution does not take these operands, or `None`: autocast casts only fp32,
/// fp16 and bf16 CUDA tensors, and ATen's own checks (shapes, a batch-less input) give the
/// clearest errors, so anything else runs autocast's path.
fn unsupported<'a>(operands: impl Iterator<Item = &'a Tensor>, x: &Tensor) -> Option<String> {
    for t in operands {
        if !matches!(t.kind(), Kind::Float | Kind::Half | Kind::BFloat16) {
            return Some(format!(
                "{:?} operands (autocast casts fp32, fp16, bf16)",
                t.kind()
            ));
        }
        if t.device() != x.device() || t.dim() != x.dim() && t.dim() != 1 {
            return Some("operands on different devices or of different ranks".into());
        }
    }
    if !crate::kernels::op_enabled(KernelOp::Convolution) {
        return Some("speedkit's kernels are switched off".into());
    }
    crate::kernels::unavailable_reason(x.device()).unwrap_or_else(|e| Some(e.to_string()))
}
