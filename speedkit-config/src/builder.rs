//! `SpeedConfigBuilder`: a `SpeedConfig` from code, checked like a parsed one.

use crate::error::ConfigError;
use crate::types::{AutoBool, DeviceChoice, MatmulPrecisionChoice, Precision};
use crate::SpeedConfig;

/// Builds a [`SpeedConfig`] starting from the defaults; [`build`](Self::build) validates it.
///
/// Switches that may be `auto` take `impl Into<AutoBool>`, so both `true` and `AutoBool::Auto`
/// work. Fields without a method here can be set on the built config directly (then call
/// [`SpeedConfig::validate`]).
///
/// ```
/// use speedkit_config::{AutoBool, DeviceChoice, MatmulPrecisionChoice, Precision, SpeedConfig};
///
/// let cfg = SpeedConfig::builder()
///     .precision(Precision::Bf16)
///     .tf32_matmul_precision(MatmulPrecisionChoice::High)
///     .cudnn_benchmark(true)
///     .fused_optimizer(AutoBool::On)
///     .compile(AutoBool::Off)
///     .sdp_backends(true, true, false, false)
///     .device(DeviceChoice::Cuda(0))
///     .build()?;
/// assert_eq!(cfg.cudnn.benchmark, AutoBool::On);
/// assert!(!cfg.sdp_backend.math);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SpeedConfigBuilder {
    config: SpeedConfig,
}

impl SpeedConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> SpeedConfigBuilder {
        SpeedConfigBuilder::default()
    }
}

impl From<SpeedConfig> for SpeedConfigBuilder {
    /// A builder starting from `config` (e.g. a preset).
    fn from(config: SpeedConfig) -> Self {
        Self { config }
    }
}

impl SpeedConfigBuilder {
    /// Sets `device`.
    pub fn device(mut self, device: DeviceChoice) -> Self {
        self.config.device = device;
        self
    }

    /// Sets `precision`.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.config.precision = precision;
        self
    }

    /// Sets `tf32_matmul_precision`.
    pub fn tf32_matmul_precision(mut self, precision: MatmulPrecisionChoice) -> Self {
        self.config.tf32_matmul_precision = precision;
        self
    }

    /// Sets `reduced_precision_reduction`.
    pub fn reduced_precision_reduction(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.reduced_precision_reduction = value.into();
        self
    }

    /// Sets `channels_last`.
    pub fn channels_last(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.channels_last = value.into();
        self
    }

    /// Sets `kernels` (speedkit's own fused kernels).
    pub fn kernels(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.kernels = value.into();
        self
    }

    /// Sets `deterministic`.
    pub fn deterministic(mut self, value: bool) -> Self {
        self.config.deterministic = value;
        self
    }

    /// Sets `cudnn.benchmark`.
    pub fn cudnn_benchmark(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.cudnn.benchmark = value.into();
        self
    }

    /// Sets `cudnn.allow_tf32`.
    pub fn cudnn_allow_tf32(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.cudnn.allow_tf32 = value.into();
        self
    }

    /// Sets `compile.enabled`.
    pub fn compile(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.compile.enabled = value.into();
        self
    }

    /// Sets `optimizer.fused`.
    pub fn fused_optimizer(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.optimizer.fused = value.into();
        self
    }

    /// Sets `grad_scaler.enabled`.
    pub fn grad_scaler(mut self, value: impl Into<AutoBool>) -> Self {
        self.config.grad_scaler.enabled = value.into();
        self
    }

    /// Sets the four `sdp_backend` switches at once.
    pub fn sdp_backends(
        mut self,
        flash: bool,
        mem_efficient: bool,
        math: bool,
        cudnn: bool,
    ) -> Self {
        self.config.sdp_backend.flash = flash;
        self.config.sdp_backend.mem_efficient = mem_efficient;
        self.config.sdp_backend.math = math;
        self.config.sdp_backend.cudnn = cudnn;
        self
    }

    /// Sets `bench.warmup` and `bench.steps`.
    pub fn bench_steps(mut self, warmup: u32, steps: u32) -> Self {
        self.config.bench.warmup = warmup;
        self.config.bench.steps = steps;
        self
    }

    /// The config, after the same validation a parsed config gets.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every broken rule.
    pub fn build(self) -> Result<SpeedConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
