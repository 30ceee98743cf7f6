//! PyTorch's backend switches (`torch.backends.cudnn.*`, determinism, the SDPA backends): each set
//! only where the config or the hardware gives a reason, so a process's own settings survive.

use super::decisions::Decisions;
use super::SdpBackends;
use crate::config::{AutoBool, SdpBackendConfig, SpeedConfig};
use crate::hardware::GpuInfo;

/// `cudnn.enabled`: on is PyTorch's default, so only turning cuDNN off is applied.
pub(super) fn resolve_cudnn_enabled(enabled: bool, d: &mut Decisions) -> Option<bool> {
    d.default_or_set(
        "cudnn.enabled",
        enabled,
        true,
        "set in the config: cuDNN off (convolutions fall back to slower kernels)",
    )
}

/// `cudnn.benchmark`: autotuning pays off on CUDA, but its pick is not deterministic.
pub(super) fn resolve_cudnn_benchmark(
    config: &SpeedConfig,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> Option<bool> {
    match (config.cudnn.benchmark, gpu) {
        (AutoBool::Auto, _) if config.deterministic || config.cudnn.deterministic => d.set(
            "cudnn.benchmark",
            Some(false),
            "deterministic mode: autotuning picks kernels non-deterministically",
        ),
        (AutoBool::Auto, Some(_)) => d.set(
            "cudnn.benchmark",
            Some(true),
            "CUDA: cuDNN tries its algorithms once per input shape and keeps the fastest",
        ),
        (AutoBool::Auto, None) => d.set("cudnn.benchmark", None, "CPU: cuDNN is not used"),
        (v, _) => d.set(
            "cudnn.benchmark",
            Some(v == AutoBool::On),
            "set in the config",
        ),
    }
}

/// `cudnn.allow_tf32`: made explicit where the GPU has TF32, left alone where it has none.
pub(super) fn resolve_cudnn_allow_tf32(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> Option<bool> {
    match (setting, gpu) {
        (AutoBool::Auto, Some(g)) if g.supports_tf32() => d.set(
            "cudnn.allow_tf32",
            Some(true),
            "TF32 convolutions on Ampere and newer (PyTorch's default, made explicit)",
        ),
        (AutoBool::Auto, _) => d.set(
            "cudnn.allow_tf32",
            None,
            "no TF32 on this device: left as it is",
        ),
        (v, _) => d.set(
            "cudnn.allow_tf32",
            Some(v == AutoBool::On),
            "set in the config",
        ),
    }
}

/// `cudnn.deterministic`: set by either determinism request, otherwise left alone.
pub(super) fn resolve_cudnn_deterministic(config: &SpeedConfig, d: &mut Decisions) -> Option<bool> {
    if config.cudnn.deterministic || config.deterministic {
        d.set(
            "cudnn.deterministic",
            Some(true),
            "deterministic results requested",
        )
    } else {
        d.set("cudnn.deterministic", None, "not requested: left as it is")
    }
}

/// `use_deterministic_algorithms`: off is PyTorch's default, so only turning it on is applied.
pub(super) fn resolve_deterministic_algorithms(
    deterministic: bool,
    d: &mut Decisions,
) -> Option<bool> {
    d.default_or_set(
        "deterministic",
        deterministic,
        false,
        "set in the config: torch.use_deterministic_algorithms(True)",
    )
}

/// The SDPA backends allowed to run, as the config lists them.
pub(super) fn resolve_sdp_backends(config: &SdpBackendConfig, d: &mut Decisions) -> SdpBackends {
    let sdp = SdpBackends {
        flash: config.flash,
        mem_efficient: config.mem_efficient,
        math: config.math,
        cudnn: config.cudnn,
    };
    d.push(
        "sdp_backend",
        format!(
            "flash={} mem_efficient={} math={} cudnn={}",
            sdp.flash, sdp.mem_efficient, sdp.math, sdp.cudnn
        ),
        "PyTorch picks the fastest enabled backend that fits the inputs",
    );
    sdp
}
