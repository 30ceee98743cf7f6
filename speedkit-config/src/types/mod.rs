//! The configuration types: [`SpeedConfig`], one module per section of it, and the small choice
//! enums.

#[macro_use]
mod spelled;

mod auto_bool;
mod bench;
mod compile;
mod cudnn;
mod device;
mod distributed;
mod fp8;
mod grad_scaler;
mod optimizer;
mod precision;
mod profile;
mod sdp_backend;
mod section;

use serde::{Deserialize, Serialize};

pub use auto_bool::AutoBool;
pub use bench::BenchConfig;
pub use compile::{CompileConfig, CompileMode};
pub use cudnn::CudnnConfig;
pub use device::DeviceChoice;
pub use distributed::{AllReduce, DistributedBackend, DistributedConfig, GradientCompression};
pub use fp8::{Fp8Config, Fp8GradientFormat, Fp8Recipe, DEFAULT_MAX_GRADIENT_COPY_RATIO};
pub use grad_scaler::GradScalerConfig;
pub use optimizer::{OptimizerConfig, OptimizerName};
pub use precision::{MatmulPrecision, MatmulPrecisionChoice, Precision};
pub use profile::ProfileConfig;
pub use sdp_backend::SdpBackendConfig;
use section::section;
pub(crate) use section::Section;

/// The user's speed configuration: which PyTorch speed flags to apply to a training run.
///
/// Every key is optional; a missing key takes its default (see `examples/configs/speed.yaml`).
/// `auto` values are resolved later by the runtime from the detected hardware, so the same file
/// works on a CPU-only laptop and on a GPU server.
///
/// ```
/// use speedkit_config::{AutoBool, Precision, SpeedConfig};
///
/// let cfg = SpeedConfig::from_yaml_str("precision: bf16\ncudnn:\n  benchmark: true\n")?;
/// assert_eq!(cfg.precision, Precision::Bf16);
/// assert_eq!(cfg.cudnn.benchmark, AutoBool::On);
/// // Everything not mentioned keeps its default.
/// assert_eq!(cfg.bench, SpeedConfig::default().bench);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of speed settings (see examples/configs/speed.yaml)"
)]
pub struct SpeedConfig {
    /// Where to train: `auto` (first GPU if present, else CPU), `cpu`, `cuda` or `cuda:N`.
    pub device: DeviceChoice,
    /// Storage/compute precision of the forward pass (autocast dtype).
    pub precision: Precision,
    /// `torch.set_float32_matmul_precision`: whether fp32 matmuls may use TF32/bf16 internally.
    pub tf32_matmul_precision: MatmulPrecisionChoice,
    /// cuBLAS reduced-precision reductions for fp16/bf16 matmuls.
    pub reduced_precision_reduction: AutoBool,
    /// Keep convolution weights and inputs in channels-last memory format.
    pub channels_last: AutoBool,
    /// `torch.use_deterministic_algorithms`.
    pub deterministic: bool,
    /// cuDNN flags.
    #[serde(deserialize_with = "section")]
    pub cudnn: CudnnConfig,
    /// Whole-step CUDA graph capture.
    #[serde(deserialize_with = "section")]
    pub compile: CompileConfig,
    /// Optimizer choice and implementation.
    #[serde(deserialize_with = "section")]
    pub optimizer: OptimizerConfig,
    /// Which scaled-dot-product-attention backends PyTorch may pick from.
    #[serde(deserialize_with = "section")]
    pub sdp_backend: SdpBackendConfig,
    /// Dynamic loss scaling for fp16 training.
    #[serde(deserialize_with = "section")]
    pub grad_scaler: GradScalerConfig,
    /// FP8 GEMMs for `speedkit::nn::Linear` layers on Hopper/Ada GPUs.
    #[serde(deserialize_with = "section")]
    pub fp8: Fp8Config,
    /// speedkit's own fused CUDA kernels behind `speedkit::nn`'s modules (LayerNorm with the
    /// residual add, the cross-entropy classifier): `auto` uses them on GPUs of SM 8.0 or newer where
    /// NVRTC and the CUDA driver library are found; `false` runs ATen's composite ops everywhere;
    /// `true` asks for them and is an error where they cannot run.
    pub kernels: AutoBool,
    /// speedkit's kernels as the CUDA implementations of the ATen operators they beat (LayerNorm's
    /// forward and backward), so that unchanged tch models run them too, registered with PyTorch's
    /// dispatcher while the context lives: `auto` wherever `kernels` is on; `false` registers
    /// nothing; `true` asks for them and is an error where the kernels cannot run.
    pub overrides: AutoBool,
    /// Settings of the built-in benchmark runner.
    #[serde(deserialize_with = "section")]
    pub bench: BenchConfig,
    /// Profiling aids for the training loop.
    #[serde(deserialize_with = "section")]
    pub profile: ProfileConfig,
    /// Data-parallel training over several processes (torchrun's environment).
    #[serde(deserialize_with = "section")]
    pub distributed: DistributedConfig,
}
