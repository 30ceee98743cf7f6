//! Named presets.

use crate::error::{closest, excerpt, ConfigError};
use crate::types::{AutoBool, MatmulPrecisionChoice, Precision};
use crate::SpeedConfig;

impl SpeedConfig {
    /// Names accepted by [`SpeedConfig::preset`].
    pub const PRESETS: &'static [&'static str] =
        &["fp32_strict", "tf32", "auto", "auto_fp8", "fp8"];

    /// A named preset:
    ///
    /// - `"fp32_strict"`: the baseline every speed-up is measured against — fp32 everywhere, no
    ///   TF32, no cuDNN autotuning, no reduced-precision reductions, unfused optimizer, no graph
    ///   capture, no grad scaler, none of speedkit's own kernels (`examples/configs/baseline.yaml`).
    /// - `"tf32"`: like `fp32_strict`, but matmuls and cuDNN convolutions may use TF32.
    /// - `"auto"`: the defaults, every choice left to the runtime (`examples/configs/auto_speed.yaml`).
    /// - `"auto_fp8"`: `auto` with `fp8.enabled: auto`: on GPUs with FP8 Tensor Cores, every
    ///   `speedkit::nn::Linear` whose GEMM reaches the recipe's measured crossover runs in FP8
    ///   (`fp8.min_gemm_size`); FP8 is off in `auto`, since it can cost converged loss
    ///   ([`Fp8Config::enabled`](crate::Fp8Config::enabled)).
    /// - `"fp8"`: `auto` with `fp8.enabled: true`: every `speedkit::nn::Linear` whose shapes allow
    ///   it runs its GEMMs in FP8, whatever their size (an error without FP8 hardware).
    ///
    /// ```
    /// use speedkit_config::{Precision, SpeedConfig};
    ///
    /// assert_eq!(SpeedConfig::preset("fp32_strict")?.precision, Precision::Fp32);
    /// assert_eq!(SpeedConfig::preset("auto")?, SpeedConfig::default());
    /// assert!(SpeedConfig::preset("fp32strict").unwrap_err().to_string().contains("`fp32_strict`"));
    /// # Ok::<(), speedkit_config::ConfigError>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::UnknownPreset`] for any other name, with the closest preset name.
    pub fn preset(name: &str) -> Result<SpeedConfig, ConfigError> {
        match name {
            "fp32_strict" => Ok(fp32_strict()),
            "tf32" => {
                let mut config = fp32_strict();
                config.tf32_matmul_precision = MatmulPrecisionChoice::High;
                config.cudnn.allow_tf32 = AutoBool::On;
                Ok(config)
            }
            "auto" => Ok(SpeedConfig::default()),
            "auto_fp8" => {
                let mut config = SpeedConfig::default();
                config.fp8.enabled = AutoBool::Auto;
                Ok(config)
            }
            "fp8" => {
                let mut config = SpeedConfig::default();
                config.fp8.enabled = AutoBool::On;
                Ok(config)
            }
            _ => Err(ConfigError::UnknownPreset {
                name: excerpt(name),
                suggestion: closest(name, Self::PRESETS.iter().copied()),
                presets: Self::PRESETS.iter().map(|p| (*p).to_owned()).collect(),
            }),
        }
    }
}

fn fp32_strict() -> SpeedConfig {
    let mut config = SpeedConfig {
        precision: Precision::Fp32,
        tf32_matmul_precision: MatmulPrecisionChoice::Highest,
        reduced_precision_reduction: AutoBool::Off,
        ..SpeedConfig::default()
    };
    config.cudnn.benchmark = AutoBool::Off;
    config.cudnn.allow_tf32 = AutoBool::Off;
    config.optimizer.fused = AutoBool::Off;
    config.compile.enabled = AutoBool::Off;
    config.grad_scaler.enabled = AutoBool::Off;
    config.kernels = AutoBool::Off;
    config
}
