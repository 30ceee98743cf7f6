//! The configuration types: `SpeedConfig`, its sections and the small choice enums.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use serde::de::{self, Unexpected};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ConfigError;

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

/// cuDNN flags (`torch.backends.cudnn.*`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of cuDNN settings"
)]
pub struct CudnnConfig {
    /// `torch.backends.cudnn.enabled` (default `true`).
    pub enabled: bool,
    /// `torch.backends.cudnn.benchmark`: autotune convolution algorithms per input shape.
    pub benchmark: AutoBool,
    /// `torch.backends.cudnn.allow_tf32`: let cuDNN convolutions use TF32.
    pub allow_tf32: AutoBool,
    /// `torch.backends.cudnn.deterministic` (default `false`).
    pub deterministic: bool,
}

impl Default for CudnnConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            benchmark: AutoBool::Auto,
            allow_tf32: AutoBool::Auto,
            deterministic: false,
        }
    }
}

/// Capture of the whole training step as a CUDA graph.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of compile settings"
)]
pub struct CompileConfig {
    /// Whether to capture at all (`auto`: when the runtime judges it safe and useful).
    pub enabled: AutoBool,
    /// How to compile; only [`CompileMode::Graphs`] exists today.
    pub mode: CompileMode,
    /// Size of the bounded cache of captured graphs (one per input shape); at least 1.
    pub max_graphs: u32,
    /// Eager steps on a side stream before capture; at least 1.
    pub warmup_steps: u32,
}

impl Default for CompileConfig {
    fn default() -> Self {
        Self {
            enabled: AutoBool::Auto,
            mode: CompileMode::Graphs,
            max_graphs: 4,
            warmup_steps: 3,
        }
    }
}

/// Optimizer choice and implementation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of optimizer settings"
)]
pub struct OptimizerConfig {
    /// The optimizer; only [`OptimizerName::AdamW`] exists today.
    pub name: OptimizerName,
    /// Use the fused (single-kernel) implementation.
    pub fused: AutoBool,
}

/// Scaled-dot-product-attention backends PyTorch may choose from; at least one must stay enabled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of attention backend switches"
)]
pub struct SdpBackendConfig {
    /// FlashAttention kernels.
    pub flash: bool,
    /// Memory-efficient attention kernels.
    pub mem_efficient: bool,
    /// The reference (math) implementation.
    pub math: bool,
    /// cuDNN attention kernels.
    pub cudnn: bool,
}

impl Default for SdpBackendConfig {
    fn default() -> Self {
        Self {
            flash: true,
            mem_efficient: true,
            math: true,
            cudnn: true,
        }
    }
}

/// Dynamic loss scaling (`torch.amp.GradScaler`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of grad scaler settings"
)]
pub struct GradScalerConfig {
    /// `auto`: on exactly when the precision resolves to fp16.
    pub enabled: AutoBool,
    /// Initial loss scale; finite and > 0 (default 2^16).
    pub init_scale: f64,
    /// Factor the scale grows by after `growth_interval` clean steps; finite and > 1.
    pub growth_factor: f64,
    /// Factor the scale shrinks by after an inf/NaN step; strictly between 0 and 1.
    pub backoff_factor: f64,
    /// Clean steps between growths; at least 1.
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            enabled: AutoBool::Auto,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// FP8 training of `speedkit::nn::Linear` layers: e4m3 activations and weights in the forward GEMM,
/// e5m2 gradients in the backward GEMMs, fp32 master weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "a mapping of fp8 settings")]
pub struct Fp8Config {
    /// `false` (the default): every GEMM in the autocast dtype. `auto`: on for GPUs with FP8
    /// Tensor Cores (SM >= 8.9), and then only for layers whose GEMM is at least
    /// `min_gemm_size`; `true`: every eligible layer (an error without FP8 hardware).
    ///
    /// Off unless asked for because FP8 can cost accuracy that no step time shows: on regression
    /// tasks that a model can learn (a linear teacher with a noise floor), FP8 GEMMs trained to a
    /// converged loss 1.4 to 2.3 times bf16's at 5,000 steps under every recipe and gradient
    /// format, and torchao's FP8 training to 1.26 to 1.83 times, while a language model's loss
    /// stayed within 0.2% (H100 and H200, docs/benchmarks/README.md, "FP8 fidelity"). The
    /// forward's e4m3 operands carry three mantissa bits, and a loss that must fall below that
    /// rounding cannot.
    pub enabled: AutoBool,
    /// How scales are chosen: `dynamic` (from the current tensor's amax), `delayed` (from the
    /// largest amax of the last `amax_history` steps, as Transformer Engine does) or `rowwise` (one
    /// scale per row of each GEMM operand, from the row's current amax).
    pub recipe: Fp8Recipe,
    /// Steps of amax history kept per tensor by the `delayed` recipe; 1 to 1024.
    pub amax_history: u32,
    /// The FP8 format of the output gradients in the backward GEMMs: `e5m2` (Transformer Engine's
    /// "hybrid" format: two mantissa bits, the range of fp16) or `e4m3` (its "E4M3": a third
    /// mantissa bit, the range of the scale). Unset: the recipe's
    /// ([`Fp8Recipe::default_gradient_format`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_format: Option<Fp8GradientFormat>,
    /// Under `enabled: auto`, the smallest GEMM (tokens × in_features × out_features) that runs in
    /// FP8; smaller ones lose more to the casts than FP8 gains. Unset: the recipe's measured
    /// crossover ([`Fp8Recipe::measured_min_gemm_size`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_gemm_size: Option<u64>,
    /// Under `enabled: auto`, how many times the bytes of the FP8 input copy a layer keeps for its
    /// backward (one per input feature and token) its backward's FP8 copies of the output gradient
    /// (one per output feature and token, in each of the two layouts its GEMMs take) may reach; a
    /// layer above it stays in the autocast dtype. Such a layer is a classifier over a vocabulary
    /// much wider than the model, whose backward runs first, at the step's memory peak, where the
    /// copies sit beside the 16-bit gradient. Unset: [`DEFAULT_MAX_GRADIENT_COPY_RATIO`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_gradient_copy_ratio: Option<u32>,
}

/// [`Fp8Config::max_gradient_copy_ratio`] when unset. GPT-2's classifier (50,304 classes from 768
/// features: 131) stays in bf16, as torchtitan's and Megatron-LM's FP8 recipes keep the output
/// layer; a transformer's own layers (at most 8: the MLP's first) and a classifier over 8,192
/// classes from 768 features (21) run in FP8. A ratio, not a size: FP8's one-byte input copies
/// are what lets a large batch fit, and both sides grow with the batch alike.
pub const DEFAULT_MAX_GRADIENT_COPY_RATIO: u32 = 32;

impl Default for Fp8Config {
    fn default() -> Self {
        Self {
            enabled: AutoBool::Off,
            recipe: Fp8Recipe::Delayed,
            amax_history: 16,
            gradient_format: None,
            min_gemm_size: None,
            max_gradient_copy_ratio: None,
        }
    }
}

impl Fp8Config {
    /// The smallest GEMM that runs in FP8 under `enabled: auto`: `min_gemm_size` when set, else the
    /// recipe's measured crossover.
    ///
    /// ```
    /// use speedkit_config::{Fp8Config, Fp8Recipe};
    /// let mut fp8 = Fp8Config::default();
    /// assert_eq!(fp8.min_gemm_size(), Fp8Recipe::Delayed.measured_min_gemm_size());
    /// fp8.min_gemm_size = Some(1 << 20);
    /// assert_eq!(fp8.min_gemm_size(), 1 << 20);
    /// ```
    #[must_use]
    pub fn min_gemm_size(&self) -> u64 {
        self.min_gemm_size
            .unwrap_or_else(|| self.recipe.measured_min_gemm_size())
    }

    /// The output gradients' FP8 format: `gradient_format` when set, else the recipe's.
    ///
    /// ```
    /// use speedkit_config::{Fp8Config, Fp8GradientFormat, Fp8Recipe};
    /// let mut fp8 = Fp8Config::default();
    /// assert_eq!(fp8.gradient_format(), Fp8GradientFormat::E5m2);
    /// fp8.recipe = Fp8Recipe::Rowwise;
    /// assert_eq!(fp8.gradient_format(), Fp8GradientFormat::E4m3);
    /// ```
    #[must_use]
    pub fn gradient_format(&self) -> Fp8GradientFormat {
        self.gradient_format
            .unwrap_or_else(|| self.recipe.default_gradient_format())
    }

    /// The most a layer's FP8 output-gradient copies may outweigh its FP8 input copy under
    /// `enabled: auto`: `max_gradient_copy_ratio` when set, else
    /// [`DEFAULT_MAX_GRADIENT_COPY_RATIO`].
    ///
    /// ```
    /// use speedkit_config::{Fp8Config, DEFAULT_MAX_GRADIENT_COPY_RATIO};
    /// let mut fp8 = Fp8Config::default();
    /// assert_eq!(fp8.max_gradient_copy_ratio(), DEFAULT_MAX_GRADIENT_COPY_RATIO);
    /// fp8.max_gradient_copy_ratio = Some(8);
    /// assert_eq!(fp8.max_gradient_copy_ratio(), 8);
    /// ```
    #[must_use]
    pub fn max_gradient_copy_ratio(&self) -> u32 {
        self.max_gradient_copy_ratio
            .unwrap_or(DEFAULT_MAX_GRADIENT_COPY_RATIO)
    }
}

/// Settings of the benchmark runner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of benchmark settings"
)]
pub struct BenchConfig {
    /// Untimed steps before measuring.
    pub warmup: u32,
    /// Timed steps; at least 1.
    pub steps: u32,
    /// Synchronise the device around every timed step (slower, but timings cannot lie).
    pub paranoid_sync: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            warmup: 10,
            steps: 50,
            paranoid_sync: true,
        }
    }
}

/// Profiling aids (`profile:`).
///
/// ```
/// use speedkit_config::SpeedConfig;
///
/// let cfg = SpeedConfig::from_yaml_str("profile:\n  nvtx: true\n")?;
/// assert!(cfg.profile.nvtx);
/// assert!(!SpeedConfig::default().profile.nvtx);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of profiling settings"
)]
pub struct ProfileConfig {
    /// Mark forward, backward, optimizer step, GradScaler and graph replay as NVTX ranges, so an
    /// `nsys` timeline reads like the training loop (default `false`; costs nothing when off).
    pub nvtx: bool,
}

/// A switch that may be left to the runtime: `auto`, `true` or `false` in files.
///
/// Only the bare booleans and the string `auto` are accepted; a quoted `"true"` is rejected so that
/// a file means the same thing to every YAML reader.
///
/// ```
/// use speedkit_config::AutoBool;
///
/// assert!(AutoBool::Auto.resolve(true));
/// assert!(!AutoBool::Off.resolve(true));
/// assert_eq!(serde_json::to_string(&AutoBool::On).unwrap(), "true");
/// assert_eq!(serde_json::from_str::<AutoBool>("\"auto\"").unwrap(), AutoBool::Auto);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AutoBool {
    /// Let the runtime decide from the hardware and the rest of the config.
    #[default]
    Auto,
    /// Forced on (`true`).
    On,
    /// Forced off (`false`).
    Off,
}

impl AutoBool {
    /// The file spellings, in the order error messages list them.
    pub const VALUES: &'static [&'static str] = &["auto", "true", "false"];

    /// The concrete value: `auto_value` when this is `Auto`, else the forced value.
    #[must_use]
    pub fn resolve(self, auto_value: bool) -> bool {
        match self {
            Self::Auto => auto_value,
            Self::On => true,
            Self::Off => false,
        }
    }

    /// Whether the runtime decides.
    #[must_use]
    pub fn is_auto(self) -> bool {
        self == Self::Auto
    }

    /// The file spelling: `"auto"`, `"true"` or `"false"`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "true",
            Self::Off => "false",
        }
    }
}

impl From<bool> for AutoBool {
    fn from(value: bool) -> Self {
        if value {
            Self::On
        } else {
            Self::Off
        }
    }
}

impl From<Option<bool>> for AutoBool {
    /// `None` is `Auto`.
    fn from(value: Option<bool>) -> Self {
        value.map_or(Self::Auto, Self::from)
    }
}

impl fmt::Display for AutoBool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for AutoBool {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => serializer.serialize_str("auto"),
            Self::On => serializer.serialize_bool(true),
            Self::Off => serializer.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for AutoBool {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = AutoBool;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`auto`, `true` or `false` (booleans without quotes)")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<AutoBool, E> {
                Ok(AutoBool::from(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<AutoBool, E> {
                match v {
                    "auto" => Ok(AutoBool::Auto),
                    // A quoted boolean is a type mistake, not an unknown word.
                    "true" | "false" => Err(E::invalid_type(Unexpected::Str(v), &self)),
                    // `unknown_variant` so that the error lists the allowed spellings.
                    _ => Err(E::unknown_variant(v, AutoBool::VALUES)),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Implements `VALUES`, `as_str`, `Display`, serde and `FromStr` for a unit-variant enum, with
/// the given file spellings.
macro_rules! spelled_enum {
    ($ty:ident, $key:literal, [$($variant:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// The spellings accepted in files, in declaration order.
            pub const VALUES: &'static [&'static str] = &[$($name),+];

            /// The spelling used in files.
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        // By hand rather than derived: a derived enum reports a list or a map given for it with
        // the format's enum jargon (YAML: "expected a YAML tag starting with '!'"), this one
        // with the allowed spellings.
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Visitor;
                impl de::Visitor<'_> for Visitor {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("one of `")?;
                        f.write_str(&$ty::VALUES.join("`, `"))?;
                        f.write_str("`")
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$ty, E> {
                        match v {
                            $($name => Ok($ty::$variant),)+
                            _ => Err(E::unknown_variant(v, $ty::VALUES)),
                        }
                    }
                }
                deserializer.deserialize_str(Visitor)
            }
        }

        impl FromStr for $ty {
            type Err = ConfigError;

            fn from_str(s: &str) -> Result<Self, ConfigError> {
                match s {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(ConfigError::bad_value($key, s, Self::VALUES)),
                }
            }
        }
    };
}

/// Forward-pass precision.
///
/// ```
/// use speedkit_config::Precision;
///
/// assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
/// assert_eq!(Precision::Fp16.as_str(), "fp16");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Left to the runtime (typically bf16 autocast where the GPU supports it, else fp32).
    #[default]
    Auto,
    /// bfloat16 autocast.
    Bf16,
    /// float16 autocast (with a grad scaler unless disabled).
    Fp16,
    /// Plain fp32, no autocast.
    Fp32,
}

spelled_enum!(Precision, "precision", [Auto => "auto", Bf16 => "bf16", Fp16 => "fp16", Fp32 => "fp32"]);

/// The configured fp32 matmul precision, possibly left to the runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MatmulPrecisionChoice {
    /// Left to the runtime (typically `high` on GPUs with TF32, else `highest`).
    #[default]
    Auto,
    /// Full fp32 matmuls.
    Highest,
    /// TF32 (or bf16x3) matmuls.
    High,
    /// bf16 matmuls.
    Medium,
}

spelled_enum!(MatmulPrecisionChoice, "tf32_matmul_precision", [
    Auto => "auto", Highest => "highest", High => "high", Medium => "medium",
]);

impl MatmulPrecisionChoice {
    /// The concrete precision, or `None` for `Auto`.
    #[must_use]
    pub fn concrete(self) -> Option<MatmulPrecision> {
        match self {
            Self::Auto => None,
            Self::Highest => Some(MatmulPrecision::Highest),
            Self::High => Some(MatmulPrecision::High),
            Self::Medium => Some(MatmulPrecision::Medium),
        }
    }
}

impl From<MatmulPrecision> for MatmulPrecisionChoice {
    fn from(value: MatmulPrecision) -> Self {
        match value {
            MatmulPrecision::Highest => Self::Highest,
            MatmulPrecision::High => Self::High,
            MatmulPrecision::Medium => Self::Medium,
        }
    }
}

/// A concrete `torch.set_float32_matmul_precision` value.
///
/// ```
/// use speedkit_config::MatmulPrecision;
///
/// let p: MatmulPrecision = "high".parse().unwrap();
/// assert_eq!(p.as_str(), "high");
/// assert!("auto".parse::<MatmulPrecision>().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulPrecision {
    /// `"highest"`.
    Highest,
    /// `"high"`.
    High,
    /// `"medium"`.
    Medium,
}

spelled_enum!(MatmulPrecision, "tf32_matmul_precision", [
    Highest => "highest", High => "high", Medium => "medium",
]);

/// Data-parallel training: one process per device, gradients averaged across processes.
///
/// ```
/// use speedkit_config::{DistributedBackend, SpeedConfig};
/// let cfg = SpeedConfig::from_yaml_str("distributed: {backend: gloo, bucket_mb: 10}\n")?;
/// assert_eq!(cfg.distributed.backend, DistributedBackend::Gloo);
/// assert_eq!(cfg.distributed.timeout_s, 300);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of distributed settings"
)]
pub struct DistributedConfig {
    /// `auto`: on when the environment says there are several processes (`WORLD_SIZE` > 1), with
    /// NCCL on CUDA and Gloo on the CPU; `nccl`/`gloo` name the backend; `off` trains each process
    /// alone even under a launcher.
    pub backend: DistributedBackend,
    /// Gradient bucket size in MiB for the overlapped all-reduce (PyTorch DDP's default: 25).
    pub bucket_mb: u32,
    /// Size of the first bucket in MiB, the last layers' gradients, sent as early as possible
    /// (PyTorch DDP's default: 1).
    pub first_bucket_mb: u32,
    /// Seconds any rendezvous, store access or collective may take before every rank fails with an
    /// error (a dead or hung rank is reported, never waited on forever).
    pub timeout_s: u32,
    /// How gradients are all-reduced: `auto` (`in_backward` where the step runs as a CUDA graph,
    /// `reducer` otherwise), `reducer`, `in_backward` or `after_backward`.
    pub all_reduce: AllReduce,
    /// The type gradients travel in: `none` (their own) or `bf16` (half the bytes of fp32
    /// gradients; each rank's gradient rounded to bf16 before the average).
    pub compress: GradientCompression,
    /// Every this many optimizer steps, the ranks compare fingerprints of their parameters and
    /// fail together, naming the ranks and the first parameter that differ, if a replica has
    /// drifted from rank 0's (`0`: never). Costs one small all-gather and a host sync per check.
    pub check_replicas_every: u32,
    /// ZeRO-1: each rank keeps the AdamW state of its own 1/N of the parameters, not of all of
    /// them. Gradients are reduce-scattered (each rank receives the average of its part only) and
    /// the updated parameters all-gathered, which together send what one all-reduce sends. Needs
    /// speedkit's all-reduce (`all_reduce` other than `reducer`).
    pub shard_optimizer: bool,
}

/// How gradients are all-reduced (`distributed.all_reduce`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AllReduce {
    /// `in_backward` where the step runs as a CUDA graph, `reducer` otherwise.
    #[default]
    Auto,
    /// c10d's `Reducer`, as PyTorch's `DistributedDataParallel`: bucket by bucket during the
    /// backward pass, from autograd hooks. A CUDA graph cannot capture it.
    Reducer,
    /// speedkit's: each bucket's all-reduce starts during the backward pass as soon as its
    /// gradients are in, on NCCL's stream, overlapping the rest of the backward pass, and is joined
    /// before the optimizer; a CUDA graph captures it with the step.
    InBackward,
    /// speedkit's, after the backward pass, bucket by bucket: no overlap; captured with the step.
    AfterBackward,
}

spelled_enum!(AllReduce, "distributed.all_reduce", [
    Auto => "auto", Reducer => "reducer", InBackward => "in_backward",
    AfterBackward => "after_backward",
]);

/// The type gradients travel in (`distributed.compress`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GradientCompression {
    /// Their own type.
    #[default]
    None,
    /// bf16 (PyTorch DDP's `bf16_compress_hook`).
    Bf16,
}

spelled_enum!(GradientCompression, "distributed.compress", [None => "none", Bf16 => "bf16"]);

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            backend: DistributedBackend::Auto,
            bucket_mb: 25,
            first_bucket_mb: 1,
            timeout_s: 300,
            all_reduce: AllReduce::Auto,
            compress: GradientCompression::None,
            check_replicas_every: 1000,
            shard_optimizer: false,
        }
    }
}

/// Which c10d backend carries the collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DistributedBackend {
    /// On when `WORLD_SIZE` > 1: NCCL on CUDA, Gloo on the CPU.
    #[default]
    Auto,
    /// NVIDIA's collectives (CUDA tensors).
    Nccl,
    /// Gloo (CPU tensors).
    Gloo,
    /// No data parallelism, whatever the environment says.
    Off,
}

spelled_enum!(DistributedBackend, "distributed.backend", [
    Auto => "auto", Nccl => "nccl", Gloo => "gloo", Off => "off",
]);

/// How the training step is compiled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CompileMode {
    /// Capture the whole training step as a CUDA graph.
    #[default]
    Graphs,
}

spelled_enum!(CompileMode, "compile.mode", [Graphs => "graphs"]);

/// The optimizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OptimizerName {
    /// AdamW (decoupled weight decay), spelled `adamw`.
    #[default]
    AdamW,
}

spelled_enum!(OptimizerName, "optimizer.name", [AdamW => "adamw"]);

/// How FP8 scales are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8Recipe {
    /// From the current tensor's amax (one reduction per cast).
    Dynamic,
    /// From the largest amax of the last `amax_history` steps (Transformer Engine's default).
    #[default]
    Delayed,
    /// One scale per row of each GEMM operand, along the axis the GEMM sums over, from that row's
    /// current amax (torchao's "rowwise"): an outlier costs precision in its own row only.
    Rowwise,
}

spelled_enum!(Fp8Recipe, "fp8.recipe", [Dynamic => "dynamic", Delayed => "delayed", Rowwise => "rowwise"]);

impl Fp8Recipe {
    /// The output gradients' FP8 format when `fp8.gradient_format` is unset: e5m2 under a
    /// per-tensor scale, whose range must span the whole gradient (Transformer Engine's "hybrid"
    /// format); e4m3 under row-wise scales, which give each row its own range, so the bit goes to
    /// the mantissa (torchao's row-wise recipe). Measured: e4m3 gradients kept the `learn` losses
    /// of `examples/fp8_fidelity.rs` closer to bf16's in every case (docs/benchmarks/HISTORY.md).
    ///
    /// ```
    /// use speedkit_config::{Fp8GradientFormat, Fp8Recipe};
    /// assert_eq!(Fp8Recipe::Rowwise.default_gradient_format(), Fp8GradientFormat::E4m3);
    /// ```
    #[must_use]
    pub fn default_gradient_format(self) -> Fp8GradientFormat {
        match self {
            Fp8Recipe::Delayed | Fp8Recipe::Dynamic => Fp8GradientFormat::E5m2,
            Fp8Recipe::Rowwise => Fp8GradientFormat::E4m3,
        }
    }

    /// The GEMM size from which FP8 under this recipe was measured faster than bf16.
    ///
    /// The smallest GEMM (tokens × in × out) from which one `speedkit::nn::Linear`'s forward and
    /// backward, graphed, was faster in FP8 under this recipe than in bf16 at every shape measured
    /// on an H200 (`examples/fp8_crossover.rs`, 36 shapes from 512 × 768 × 768 to 16384 × 4096 ×
    /// 16384; docs/benchmarks/HISTORY.md, "FP8"): 16384 × 768 × 3072 (a transformer MLP's) for the
    /// per-tensor recipes, 2^36 for row-wise, which casts every operand along both axes. Below,
    /// the casts cost more than the FP8 GEMMs save; so do they at 512 tokens × 8192 × 8192, where
    /// the weight's cast is large beside the GEMM.
    ///
    /// ```
    /// use speedkit_config::Fp8Recipe;
    /// assert!(Fp8Recipe::Delayed.measured_min_gemm_size() < Fp8Recipe::Rowwise.measured_min_gemm_size());
    /// ```
    #[must_use]
    pub fn measured_min_gemm_size(self) -> u64 {
        match self {
            Fp8Recipe::Delayed | Fp8Recipe::Dynamic => 16384 * 768 * 3072,
            Fp8Recipe::Rowwise => 1 << 36,
        }
    }
}

/// The FP8 format of the output gradients in the backward GEMMs (activations and weights are
/// always e4m3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8GradientFormat {
    /// 5 exponent and 2 mantissa bits: the range of fp16 (Transformer Engine's default).
    #[default]
    E5m2,
    /// 4 exponent and 3 mantissa bits: twice e5m2's precision, the range that the scale gives.
    E4m3,
}

spelled_enum!(Fp8GradientFormat, "fp8.gradient_format", [E5m2 => "e5m2", E4m3 => "e4m3"]);

/// Where to train. Spelled `auto`, `cpu`, `cuda` (= `cuda:0`) or `cuda:N` in files.
///
/// ```
/// use speedkit_config::DeviceChoice;
///
/// assert_eq!("cuda".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(0));
/// assert_eq!("cuda:3".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(3));
/// assert_eq!(DeviceChoice::Cuda(1).to_string(), "cuda:1");
/// assert!("gpu".parse::<DeviceChoice>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceChoice {
    /// `cuda:0` if a GPU is present, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// The CUDA device with this index.
    Cuda(usize),
}

impl DeviceChoice {
    /// The accepted forms, as error messages list them.
    pub const FORMS: &'static [&'static str] = &["auto", "cpu", "cuda", "cuda:N"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "cpu" => Some(Self::Cpu),
            "cuda" => Some(Self::Cuda(0)),
            // Digits only: `usize::from_str` would also take a leading `+`.
            _ => s
                .strip_prefix("cuda:")
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        Self::parse(s).ok_or_else(|| ConfigError::bad_value("device", s, Self::FORMS))
    }
}

impl Serialize for DeviceChoice {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = DeviceChoice;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a device string: `auto`, `cpu`, `cuda` or `cuda:N`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceChoice, E> {
                // `unknown_variant` so that the error lists the accepted forms.
                DeviceChoice::parse(v).ok_or_else(|| E::unknown_variant(v, DeviceChoice::FORMS))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

/// A config section, or the whole config: a mapping, or nothing (`null`, `~`, an empty YAML
/// value, an empty file) for all defaults, so that commenting out every key of a section is
/// fine. Unlike derived struct impls it refuses lists: positional sections (`[true, false]`) in
/// JSON would be unreadable.
pub(crate) struct Section<T>(pub(crate) T);

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for Section<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Default> de::Visitor<'de> for Visitor<T> {
            type Value = Section<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping of settings (`key: value` lines)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Section<T>, E> {
                Ok(Section(T::default()))
            }
            fn visit_none<E: de::Error>(self) -> Result<Section<T>, E> {
                Ok(Section(T::default()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Section<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Section)
            }
        }
        deserializer.deserialize_any(Visitor(PhantomData))
    }
}

fn section<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    deserializer: D,
) -> Result<T, D::Error> {
    Section::deserialize(deserializer).map(|section| section.0)
}
