//! [`Override::Linear`](super::Override::Linear): `aten::linear` under CUDA autocast
//! (`nn::linear`, `Tensor::linear`) on speedkit's Linear, the one behind `speedkit::nn::Linear`.
//!
//! Autocast's `linear` casts every fp32 weight and bias to bf16/fp16 in each forward, and its
//! backward writes the weight's gradient in bf16 and casts it to fp32 in a second kernel. speedkit's
//! Linear takes the copies it keeps across steps (speedkit's AdamW writes them in its update pass,
//! so no cast kernel runs at all), writes the weight gradient in fp32 straight from its GEMM, and
//! sums the bias gradient on its own kernel. The GEMMs are the same cuBLAS calls on the same bf16
//! operands; the weight gradient is rounded once (to fp32) where autocast rounds it to bf16 first.

use tch::{Device, Kind};

use super::{DispatchKey, OperatorOverride, Outcome, OverrideCall};
use crate::amp::AutocastState;
use crate::error::Result;
use crate::ffi;
use crate::kernels::KernelOp;

/// The override: ATen's `linear` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 1] {
    [OperatorOverride::new(
        "aten::linear",
        DispatchKey::AutocastCuda,
        linear,
    )]
}

fn linear(call: &OverrideCall<'_>) -> Result<Outcome> {
    let (x, weight) = (call.tensor("input")?, call.tensor("weight")?);
    let bias = call.optional_tensor("bias")?;
    // Autocast's type, read while its key is excluded (as the override runs): the type is kept.
    let kind = AutocastState::current(x.device())?.dtype;
    let operands = [Some(x), Some(weight), bias];
    if let Some(why) = unsupported(operands.iter().flatten().copied(), x.device()) {
        return Ok(Outcome::Declined(why));
    }
    let y = ffi::linear::linear_in(x, weight, bias, kind)?;
    Ok(Outcome::Ran(vec![y]))
}

/// Why speedkit's Linear cannot take these operands, or `None`. Autocast casts only fp32, fp16
/// and bf16 CUDA tensors (fp64 stays fp64), so anything else runs autocast's own path.
fn unsupported<'a>(
    operands: impl Iterator<Item = &'a tch::Tensor>,
    device: Device,
) -> Option<String> {
    for t in operands {
        if !matches!(t.kind(), Kind::Float | Kind::Half | Kind::BFloat16) {
            return Some(format!(
                "{:?} operands (autocast casts fp32, fp16, bf16)",
                t.kind()
            ));
        }
        if t.device() != device {
            return Some("operands on different devices".into());
        }
    }
    if !crate::kernels::op_enabled(KernelOp::Linear) {
        return Some("speedkit's kernels are switched off".into());
    }
    crate::kernels::unavailable_reason(device).unwrap_or_else(|e| Some(e.to_string()))
}
