//! [`Override::Linear`](super::Override::Linear): `aten::linear` under CUDA autocast
//! (`nn::linear`, `Tensor::linear`) on speedkit's Linear, the one behind `speedkit::nn::Linear`.
//!
//! Autocast's `linear` casts every fp32 weight and bias to bf16/fp16 in each forward, and its
//! backward writes the weight's gradient in bf16 and casts it to fp32 in a second kernel. speedkit's
//! Linear takes the copies it keeps across steps (speedkit's AdamW writes them in its update pass,
//! so no cast kernel runs at all), writes the weight gradient in fp32 straight from its GEMM, and
//! sums the bias gradient on its own kernel. The GEMMs are the same cuBLAS calls on the same bf16
//! operands; the weight gradient is rounded once (to fp32) where autocast rounds it to bf16 first.
//!
//! Where the context's plan puts GEMMs of this size in FP8 (`fp8`), the layer runs on speedkit's
//! FP8 Linear as `speedkit::nn::Linear` does, under the plan's recipe. A tch layer has no module to
//! keep the delayed recipe's amax histories in, so the shim keeps them per weight, for as long as
//! the weight lives: each cast then scales from the history and records its amax in the same pass,
//! where the dynamic recipe reads each operand once more for its amax. The audit lists each
//! shape's decision.

use tch::{Device, Kind, Tensor};

use super::chunked_classifier::{self, HeadReader};
use super::{DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::amp::AutocastState;
use crate::config::{Fp8GradientFormat, Fp8Recipe};
use crate::error::Result;
use crate::ffi;
use crate::kernels::KernelOp;
use crate::nn::Fp8Scope;

/// The override: ATen's `linear` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 1] {
    [OperatorOverride::new(
        "aten::linear",
        DispatchKey::AutocastCuda,
        linear,
    )]
}

fn linear(call: &OverrideCall<'_>) -> Result<Reply> {
    let (x, weight) = (call.tensor("input")?, call.tensor("weight")?);
    let bias = call.optional_tensor("bias")?;
    // Autocast's type, read while its key is excluded (as the override runs): the type is kept.
    let kind = AutocastState::current(x.device())?.dtype;
    let operands = [Some(x), Some(weight), bias];
    if let Some(why) = unsupported(operands.iter().flatten().copied(), x.device()) {
        return Ok(Reply::Declined(why));
    }
    if let Some(y) = fp8_linear(x, weight, bias)? {
        return Ok(Reply::Ran(vec![y]));
    }
    if Fp8Scope::active().is_none() {
        if let Some(logits) = chunked_classifier::deferred_logits(
            x,
            weight,
            bias,
            kind,
            HeadReader::LogSoftmaxOverride,
        )? {
            return Ok(Reply::Ran(vec![logits]));
        }
    }
    let y = ffi::linear::linear_in(x, weight, bias, kind)?;
    Ok(Reply::Ran(vec![y]))
}

/// `x Wᵀ + b` in FP8 where an FP8 plan is in force on this thread and allows this GEMM, recording
/// the decision for the audit; `None` where the GEMM stays in the autocast type.
fn fp8_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let Some((plan, out)) = Fp8Scope::active() else {
        return Ok(None);
    };
    let layer = format!("tch linear {:?}", weight.size());
    let gemm = match crate::nn::fp8_gemm(x, weight, &plan) {
        Ok(gemm) => gemm,
        Err(reason) => {
            Fp8Scope::record(&layer, false, &reason);
            return Ok(None);
        }
    };
    let rowwise = plan.recipe == Fp8Recipe::Rowwise;
    let histories = match plan.recipe {
        Fp8Recipe::Delayed => {
            let length = (plan.amax_history as i64).clamp(1, crate::nn::FP8_HISTORY_CAPACITY);
            Some(ffi::fp8::weight_histories(weight, length)?)
        }
        Fp8Recipe::Dynamic | Fp8Recipe::Rowwise => None,
    };
    let scaling = match plan.recipe {
        Fp8Recipe::Rowwise => "row-wise scales".to_string(),
        Fp8Recipe::Dynamic => "scales from the call".to_string(),
        Fp8Recipe::Delayed => format!(
            "delayed scales, {} steps of amax history kept for the weight",
            plan.amax_history
        ),
    };
    Fp8Scope::record(&layer, true, &format!("{gemm}, {scaling}"));
    let options = ffi::fp8::Fp8LinearOptions {
        rowwise,
        e4m3_gradients: plan.gradient_format == Fp8GradientFormat::E4m3,
    };
    let out = ffi::scalar_type_code(out)?;
    let rows = histories.as_ref().map(|h| [0, 1, 2].map(|row| h.get(row)));
    let rows = rows.as_ref().map(|[hx, hw, hg]| [hx, hw, hg]);
    ffi::fp8::linear(x, weight, bias, rows, out, options).map(Some)
}

/// Why speedkit's Linear cannot take these operands, or `None`. Autocast casts only fp32, fp16
/// and bf16 CUDA tensors (fp64 stays fp64), so anything else runs autocast's own path.
fn unsupported<'a>(operands: impl Iterator<Item = &'a Tensor>, device: Device) -> Option<String> {
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
