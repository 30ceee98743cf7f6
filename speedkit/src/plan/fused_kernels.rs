//! speedkit's own CUDA kernels: whether [`crate::nn`]'s modules run them, and which ATen operators
//! they take over for unchanged tch models.

use super::decisions::Decisions;
use crate::config::AutoBool;
use crate::error::{Result, SpeedkitError};
use crate::hardware::{GpuInfo, Hardware};
use crate::overrides::Override;

/// Whether [`crate::nn`]'s modules run speedkit's kernels: on a GPU of SM ≥ 8.0 whose toolchain
/// (NVRTC, the CUDA headers, the driver library) was found.
pub(super) fn resolve_kernels(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    hardware: &Hardware,
    d: &mut Decisions,
) -> Result<bool> {
    let missing = match gpu {
        None => Some("this run is on the CPU".to_owned()),
        Some(g) if g.compute_capability.major < 8 => Some(format!(
            "{} is SM {} and the kernels need SM 8.0 or newer",
            g.name, g.compute_capability
        )),
        Some(_) => hardware.kernels_unavailable.clone(),
    };
    let (on, reason) = match (setting, missing) {
        (AutoBool::Off, _) => (
            false,
            "set in the config: speedkit::nn modules run ATen's composite ops".to_owned(),
        ),
        (AutoBool::On, Some(why)) => {
            return Err(SpeedkitError::Unsupported(format!(
                "kernels: true needs a CUDA GPU of SM 8.0 or newer with NVRTC and the CUDA driver \
                 library, and {why}; set kernels to auto or false"
            )))
        }
        (AutoBool::Auto, Some(why)) => (
            false,
            format!("{why}: speedkit::nn modules run ATen's composite ops"),
        ),
        (setting, None) => (
            true,
            format!(
                "{}speedkit::nn's LayerNorm (with the residual add) and cross-entropy run \
                 speedkit's fused kernels, compiled by NVRTC for this GPU",
                if setting == AutoBool::On {
                    "set in the config: "
                } else {
                    ""
                }
            ),
        ),
    };
    d.push("kernels", if on { "on" } else { "off" }, reason);
    Ok(on)
}

/// Which ATen operators speedkit's kernels take over: every group wherever the kernels run, unless
/// the config says `overrides: false`.
pub(super) fn resolve_overrides(
    setting: AutoBool,
    kernels: bool,
    d: &mut Decisions,
) -> Result<Vec<Override>> {
    let (on, reason) = match (setting, kernels) {
        (AutoBool::Off, _) => (
            false,
            "set in the config: tch's modules run ATen's kernels".to_owned(),
        ),
        (AutoBool::On, false) => {
            return Err(SpeedkitError::Unsupported(
                "overrides: true registers speedkit's kernels, which this run does not have \
                 (see the `kernels` decision); set overrides to auto or false"
                    .into(),
            ))
        }
        (AutoBool::Auto, false) => (
            false,
            "without speedkit's kernels there is nothing to register".to_owned(),
        ),
        (setting, true) => {
            let names: Vec<String> = Override::ALL
                .iter()
                .flat_map(|o| o.operators())
                .map(|op| op.to_string())
                .collect();
            let reason = format!(
                "{}speedkit's kernels registered as the CUDA kernels of {} while the context \
                 lives: unchanged tch models (nn::layer_norm, nn::linear, nn::embedding, nn::conv2d and \
                 log_softmax under autocast, nn::batch_norm in training, mse_loss) run them",
                if setting == AutoBool::On {
                    "set in the config: "
                } else {
                    ""
                },
                names.join(", ")
            );
            (true, reason)
        }
    };
    d.push("overrides", if on { "on" } else { "off" }, reason);
    Ok(if on {
        Override::ALL.to_vec()
    } else {
        Vec::new()
    })
}
