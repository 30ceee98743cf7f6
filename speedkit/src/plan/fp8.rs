//! FP8 GEMMs for `speedkit::nn::Linear`: where the hardware has them, which layers, and why they
//! stay off unless asked for.

use super::decisions::Decisions;
use super::{Fp8Plan, ResolvedPrecision};
use crate::config::{AutoBool, Fp8Config};
use crate::error::{Result, SpeedkitError};
use crate::hardware::GpuInfo;

/// FP8 for `speedkit::nn::Linear`: needs FP8 Tensor Cores and an autocast dtype to return.
pub(super) fn resolve_fp8(
    config: &Fp8Config,
    gpu: Option<&GpuInfo>,
    precision: ResolvedPrecision,
    d: &mut Decisions,
) -> Result<Option<Fp8Plan>> {
    let plan = |min_gemm_size, max_gradient_copy_ratio| Fp8Plan {
        recipe: config.recipe,
        gradient_format: config.gradient_format(),
        amax_history: config.amax_history as usize,
        min_gemm_size,
        max_gradient_copy_ratio,
    };
    let capable = gpu.filter(|g| g.supports_fp8());
    let (value, reason) = match (config.enabled, capable, precision) {
        (AutoBool::On, None, _) => {
            let machine = gpu.map_or("this run is on the CPU".to_owned(), |g| {
                format!("{} is SM {}", g.name, g.compute_capability)
            });
            return Err(SpeedkitError::Unsupported(format!(
                "fp8.enabled: true needs FP8 Tensor Cores (SM 8.9 or newer: Ada, Hopper), and \
                 {machine}; set fp8.enabled to auto or false"
            )));
        }
        (AutoBool::On, Some(_), _) => (Some(plan(0, u32::MAX)), "set in the config".to_owned()),
        (AutoBool::Auto | AutoBool::Off, None, _) => (
            None,
            match gpu {
                Some(g) => format!(
                    "SM {} has no FP8 Tensor Cores (SM 8.9+)",
                    g.compute_capability
                ),
                None => "CPU: FP8 GEMMs are a CUDA Tensor Core feature".to_owned(),
            },
        ),
        (AutoBool::Auto | AutoBool::Off, Some(_), ResolvedPrecision::Fp32) => (
            None,
            "fp32 training: FP8 layers would return the autocast dtype, and there is none"
                .to_owned(),
        ),
        (AutoBool::Off, Some(g), _) => (None, fp8_opt_in_reason(config, g)),
        (AutoBool::Auto, Some(g), _) => (
            Some(plan(
                config.min_gemm_size(),
                config.max_gradient_copy_ratio(),
            )),
            fp8_auto_reason(config, g),
        ),
    };
    let shown = value.map_or("off".to_owned(), |p: Fp8Plan| p.recipe.as_str().to_owned());
    d.push("fp8", shown, reason);
    Ok(value)
}

/// What `auto` runs in FP8 on hardware that has it, and why the rest stays in the autocast dtype.
fn fp8_auto_reason(config: &Fp8Config, g: &GpuInfo) -> String {
    format!(
        "SM {} has FP8 Tensor Cores: Linear GEMMs of at least {} (tokens × in × out{}) \
         run in FP8 ({} scaling, {} gradients); smaller ones stay in the autocast dtype, \
         as do layers whose FP8 output-gradient copies would outweigh their FP8 input \
         copy more than {}-fold (a classifier over a wide vocabulary)",
        g.compute_capability,
        config.min_gemm_size(),
        if config.min_gemm_size.is_none() {
            ", where this recipe's FP8 was measured faster than bf16"
        } else {
            ""
        },
        config.recipe.as_str(),
        config.gradient_format().as_str(),
        config.max_gradient_copy_ratio()
    )
}

/// Why FP8 is off on hardware that has it, what it would take and gain, and how to turn it on.
///
/// `fp8.enabled` is `false` unless the user asks: FP8 can cost converged loss that no step time
/// shows ([`Fp8Config::enabled`]). The figures are measured (docs/benchmarks/README.md, "FP8
/// fidelity"): `mlp_block`'s step under `auto_fp8` against `auto` on an H100, and the converged
/// losses of `examples/fp8_fidelity.rs` and its torchao twin at 5,000 steps.
fn fp8_opt_in_reason(config: &Fp8Config, gpu: &GpuInfo) -> String {
    format!(
        "off unless asked for: SM {} has FP8 Tensor Cores, and fp8.enabled: auto would run \
         speedkit::nn::Linear GEMMs of at least {} (tokens × in × out) in FP8 ({} scaling, {} \
         gradients; mlp_block's step measured 1.53× faster on an H100), but on regression tasks \
         FP8 trained to a converged loss 1.4 to 2.3 times bf16's at 5,000 steps (torchao's FP8: \
         1.26 to 1.83 times; a language model's within 0.2%, docs/benchmarks/README.md, \"FP8 \
         fidelity\"); set fp8.enabled: auto to take it",
        gpu.compute_capability,
        config.min_gemm_size(),
        config.recipe.as_str(),
        config.gradient_format().as_str(),
    )
}
