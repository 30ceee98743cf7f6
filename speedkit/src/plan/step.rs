//! How the training step runs: the AdamW kernel, CUDA graph capture, and the conv weights' layout.

use super::decisions::Decisions;
use crate::config::{AutoBool, CompileConfig};
use crate::error::{Result, SpeedkitError};
use crate::hardware::{GpuInfo, Hardware};

/// Fused AdamW on CUDA: one kernel over every parameter; the CPU has no fused kernel.
pub(super) fn resolve_fused_optimizer(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> bool {
    match (setting, gpu) {
        (AutoBool::Auto, Some(_)) => {
            d.push(
                "optimizer.fused",
                "true",
                "CUDA: one fused AdamW kernel over all parameters",
            );
            true
        }
        (AutoBool::Auto, None) => {
            d.push(
                "optimizer.fused",
                "false",
                "CPU: multi-tensor (foreach) AdamW",
            );
            false
        }
        (v, _) => {
            d.push(
                "optimizer.fused",
                (v == AutoBool::On).to_string(),
                "set in the config",
            );
            v == AutoBool::On
        }
    }
}

/// Whether the step is planned as a CUDA graph, before the all-reduce is known (which may still
/// take it away: [`super::distributed::resolve_graphs_beside_reducer`]).
pub(super) fn resolve_compile_graphs(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    hardware: &Hardware,
    d: &mut Decisions,
) -> Result<bool> {
    match (setting, gpu) {
        (AutoBool::Auto, None) => {
            d.push("compile", "off", "CUDA graphs need a CUDA device");
            Ok(false)
        }
        (AutoBool::Auto, Some(_)) if hardware.is_windows() => {
            d.push("compile", "off", "auto keeps graph capture off on Windows");
            Ok(false)
        }
        (AutoBool::Auto, Some(_)) => {
            d.push(
                "compile",
                "graphs",
                "CUDA: capture the whole training step once and replay it (no launch overhead)",
            );
            Ok(true)
        }
        (AutoBool::On, None) => Err(SpeedkitError::Unsupported(
            "compile.enabled: true needs a CUDA device, and this run is on the CPU; \
             set compile.enabled to auto or false"
                .into(),
        )),
        (AutoBool::On, Some(_)) => {
            d.push("compile", "graphs", "set in the config");
            Ok(true)
        }
        (AutoBool::Off, _) => {
            d.push("compile", "off", "set in the config");
            Ok(false)
        }
    }
}

/// Channels-last conv weights where Tensor Cores run the convolutions, which want NHWC.
pub(super) fn resolve_channels_last(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> bool {
    match (setting, gpu) {
        (AutoBool::Auto, Some(g)) if g.has_tensor_cores() => {
            d.push(
                "channels_last",
                "true",
                "Tensor Core convolutions are fastest in NHWC (applies to 4-d conv weights only; back \
                 to NCHW after the first backward where GroupNorm, which ATen runs in NCHW, reads \
                 channels-last activations)",
            );
            true
        }
        (AutoBool::Auto, _) => {
            d.push("channels_last", "false", "no Tensor Cores: NCHW kept");
            false
        }
        (v, _) => {
            d.push(
                "channels_last",
                (v == AutoBool::On).to_string(),
                "set in the config",
            );
            v == AutoBool::On
        }
    }
}

/// The eager warm-up steps' saved tensors in host memory (`compile.warmup_offload`): by default
/// with fusion, whose captured step saves less than an eager step, so that the warm-up would set
/// the run's peak; without fusion both peak alike and parking would only cost time.
pub(super) fn resolve_warmup_offload(
    compile: &CompileConfig,
    graphs: bool,
    d: &mut Decisions,
) -> bool {
    let (on, why) = match (compile.warmup_offload, graphs) {
        (_, false) => (false, "no graph capture: no warm-up steps"),
        (AutoBool::Auto, true) if compile.fusion => (
            true,
            "fusion: the captured step saves less than an eager warm-up step, which would set the \
             run's peak",
        ),
        (AutoBool::Auto, true) => (
            false,
            "no fusion: the captured step saves what an eager step saves, so parking would only \
             cost time",
        ),
        (v, true) => (v == AutoBool::On, "set in the config"),
    };
    d.push("compile.warmup_offload", on.to_string(), why);
    on
}
