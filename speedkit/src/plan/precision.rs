//! The numeric format training runs in: autocast dtype, TF32 matmuls, reduced-precision GEMM
//! reductions, and the loss scaling fp16 needs.

use super::decisions::Decisions;
use super::{ResolvedPrecision, ScalerSettings};
use crate::config::{
    AutoBool, GradScalerConfig, MatmulPrecision, MatmulPrecisionChoice, Precision,
};
use crate::error::{Result, SpeedkitError};
use crate::hardware::GpuInfo;

/// The autocast dtype: the narrowest the GPU's Tensor Cores run, bf16 before fp16 for its range.
pub(super) fn resolve_precision(
    choice: Precision,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> Result<ResolvedPrecision> {
    let (p, reason) = match (choice, gpu) {
        (Precision::Auto, None) => (
            ResolvedPrecision::Fp32,
            "CPU: fp32 (reduced-precision autocast rarely pays off on CPUs)".to_string(),
        ),
        (Precision::Auto, Some(g)) if g.supports_bf16() => (
            ResolvedPrecision::Bf16,
            format!("SM {} has bf16 Tensor Cores: bf16 autocast keeps fp32's range, so no loss scaling", g.compute_capability),
        ),
        (Precision::Auto, Some(g)) if g.supports_fp16_tensor_cores() => (
            ResolvedPrecision::Fp16,
            format!("SM {} has fp16 but no bf16 Tensor Cores: fp16 autocast with a GradScaler", g.compute_capability),
        ),
        (Precision::Auto, Some(g)) => (
            ResolvedPrecision::Fp32,
            format!("SM {} has no Tensor Cores: fp32", g.compute_capability),
        ),
        (Precision::Bf16, Some(g)) if !g.supports_bf16() => {
            return Err(SpeedkitError::Unsupported(format!(
                "precision: bf16 needs SM 8.0 or newer, and {} is SM {}; use precision: fp16 (with the GradScaler) or auto",
                g.name, g.compute_capability
            )))
        }
        (Precision::Bf16, None) => (ResolvedPrecision::Bf16, "set in the config: bf16 autocast on the CPU".into()),
        (Precision::Bf16, Some(_)) => (ResolvedPrecision::Bf16, "set in the config".into()),
        (Precision::Fp16, None) => (ResolvedPrecision::Fp16, "set in the config: fp16 autocast on the CPU".into()),
        (Precision::Fp16, Some(_)) => (ResolvedPrecision::Fp16, "set in the config".into()),
        (Precision::Fp32, _) => (ResolvedPrecision::Fp32, "set in the config".into()),
    };
    d.push("precision", p.to_string(), reason);
    Ok(p)
}

/// float32 matmul precision: TF32 where the Tensor Cores have it, since it keeps fp32's range.
pub(super) fn resolve_matmul_precision(
    choice: MatmulPrecisionChoice,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> Option<MatmulPrecision> {
    match (choice, gpu) {
        (MatmulPrecisionChoice::Auto, Some(g)) if g.supports_tf32() => d.set(
            "tf32_matmul_precision",
            Some(MatmulPrecision::High),
            format!("SM {} has TF32 Tensor Cores: fp32 matmuls run as TF32 (10-bit mantissa, fp32 range)", g.compute_capability),
        ),
        (MatmulPrecisionChoice::Auto, Some(g)) => d.set(
            "tf32_matmul_precision",
            Some(MatmulPrecision::Highest),
            format!("SM {} has no TF32: full fp32 matmuls", g.compute_capability),
        ),
        (MatmulPrecisionChoice::Auto, None) => d.set(
            "tf32_matmul_precision",
            None,
            "CPU: left as it is (TF32 is a CUDA Tensor Core mode)",
        ),
        (explicit, _) => {
            let p = match explicit {
                MatmulPrecisionChoice::Highest => MatmulPrecision::Highest,
                MatmulPrecisionChoice::High => MatmulPrecision::High,
                _ => MatmulPrecision::Medium,
            };
            d.set("tf32_matmul_precision", Some(p), "set in the config")
        }
    }
}

/// cuBLAS reduced-precision reductions in fp16/bf16 GEMMs: only a config changes PyTorch's default.
pub(super) fn resolve_reduced_precision_reduction(
    setting: AutoBool,
    d: &mut Decisions,
) -> Option<bool> {
    d.explicit_only(
        "reduced_precision_reduction",
        setting,
        "auto: PyTorch's default (allowed) is kept",
    )
}

/// The GradScaler: fp16 needs it for its narrow range; bf16 and fp32 do not.
pub(super) fn resolve_grad_scaler(
    config: &GradScalerConfig,
    precision: ResolvedPrecision,
    d: &mut Decisions,
) -> Option<ScalerSettings> {
    match config.enabled {
        AutoBool::Auto if precision == ResolvedPrecision::Fp16 => {
            d.push(
                "grad_scaler",
                "on",
                "fp16 has a narrow range: scale the loss so small gradients do not flush to zero",
            );
            Some(ScalerSettings::from(config))
        }
        AutoBool::Auto => {
            d.push(
                "grad_scaler",
                "off",
                format!("{precision}: no loss scaling needed"),
            );
            None
        }
        AutoBool::On => {
            d.push("grad_scaler", "on", "set in the config");
            Some(ScalerSettings::from(config))
        }
        AutoBool::Off => {
            let why = if precision == ResolvedPrecision::Fp16 {
                "set in the config (warning: fp16 without loss scaling can underflow small gradients)"
            } else {
                "set in the config"
            };
            d.push("grad_scaler", "off", why);
            None
        }
    }
}
