//! `SpeedConfig`: speedkit's speed configuration — which PyTorch speed flags (TF32, bf16/fp16
//! autocast, GradScaler, fused AdamW, SDPA backends, CUDA graphs) a training run uses — read
//! from YAML or JSON and validated, with errors that say what to change.
//!
//! The crate is pure Rust without libtorch, global state or output, so that the `speedkit`
//! runtime and the `speedkit-macros` proc macro (at compile time) parse configs with the very
//! same code. `examples/configs/speed.yaml` documents every key.
//!
//! ```
//! use speedkit_config::{AutoBool, ConfigError, Precision, SpeedConfig};
//!
//! let yaml = "
//! precision: bf16
//! cudnn:
//!   benchmark: true
//! ";
//! let cfg = SpeedConfig::from_yaml_str(yaml)?;
//! assert_eq!(cfg.precision, Precision::Bf16);
//! assert!(cfg.cudnn.benchmark.resolve(false));
//!
//! // Typos are reported with their place and the likely intended key.
//! let err = SpeedConfig::from_yaml_str("precison: bf16").unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "unknown key `precison` at line 1, column 1; did you mean `precision`? (valid keys here: \
//!      device, precision, tf32_matmul_precision, reduced_precision_reduction, channels_last, \
//!      deterministic, cudnn, compile, optimizer, sdp_backend, grad_scaler, fp8, kernels, \
//!      overrides, bench, profile, distributed)"
//! );
//! # Ok::<(), ConfigError>(())
//! ```

#![warn(missing_docs)]

mod builder;
mod duplicates;
mod error;
mod nesting;
mod parse;
mod presets;
mod types;
mod validate;

use std::path::Path;

pub use builder::SpeedConfigBuilder;
pub use error::{closest, ConfigError, Format, Location, Problem};
pub use types::{
    AllReduce, AutoBool, BenchConfig, CompileConfig, CompileMode, CudnnConfig, DeviceChoice,
    DistributedBackend, DistributedConfig, Fp8Config, Fp8GradientFormat, Fp8Recipe,
    GradScalerConfig, GradientCompression, MatmulPrecision, MatmulPrecisionChoice, OptimizerConfig,
    OptimizerName, Precision, ProfileConfig, SdpBackendConfig, SpeedConfig,
    DEFAULT_MAX_GRADIENT_COPY_RATIO,
};

impl SpeedConfig {
    /// The recommended config: every choice `auto` (the same as `SpeedConfig::default()`).
    #[must_use]
    pub fn auto() -> Self {
        Self::default()
    }

    /// Reads and validates a YAML file (an empty file is the default config).
    ///
    /// # Errors
    /// [`ConfigError::Io`] (naming the path) if the file cannot be read, else as
    /// [`from_yaml_str`](Self::from_yaml_str).
    pub fn from_yaml(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        Self::from_yaml_str(&read(path.as_ref())?)
    }

    /// Parses and validates YAML text. An empty document (or `~`) is the default config.
    ///
    /// # Errors
    /// [`ConfigError::Syntax`], [`ConfigError::UnknownKey`], [`ConfigError::BadValue`] or
    /// [`ConfigError::WrongType`] for text that does not describe a config (with its location),
    /// [`ConfigError::TooDeep`] for brackets nested more than 32 levels deep (checked before
    /// parsing), [`ConfigError::Invalid`] for a config that breaks [`validate`](Self::validate)'s
    /// rules.
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        let config = parse::yaml(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and validates a JSON file.
    ///
    /// # Errors
    /// [`ConfigError::Io`] (naming the path) if the file cannot be read, else as
    /// [`from_json_str`](Self::from_json_str).
    pub fn from_json(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        Self::from_json_str(&read(path.as_ref())?)
    }

    /// Parses and validates JSON text (an object; `null` is the default config).
    ///
    /// ```
    /// use speedkit_config::{DeviceChoice, SpeedConfig};
    ///
    /// let cfg = SpeedConfig::from_json_str(r#"{"device": "cuda:1", "bench": {"steps": 5}}"#)?;
    /// assert_eq!(cfg.device, DeviceChoice::Cuda(1));
    /// assert_eq!(cfg.bench.steps, 5);
    /// # Ok::<(), speedkit_config::ConfigError>(())
    /// ```
    ///
    /// # Errors
    /// As [`from_yaml_str`](Self::from_yaml_str).
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let config = parse::json(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the rules the types cannot express (value ranges, contradictory settings), and
    /// reports every broken rule at once.
    ///
    /// ```
    /// use speedkit_config::{ConfigError, SpeedConfig};
    ///
    /// let mut cfg = SpeedConfig::default();
    /// cfg.bench.steps = 0;
    /// cfg.compile.max_graphs = 0;
    /// match cfg.validate() {
    ///     Err(ConfigError::Invalid { problems }) => assert_eq!(problems.len(), 2),
    ///     other => panic!("expected two problems, got {other:?}"),
    /// }
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every broken rule.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate::validate(self)
    }

    /// The config as YAML (parses back to an equal config).
    ///
    /// # Errors
    /// [`ConfigError::Serialize`]; not expected for these types.
    pub fn to_yaml_string(&self) -> Result<String, ConfigError> {
        serde_yaml_ng::to_string(self).map_err(|e| ConfigError::Serialize {
            format: Format::Yaml,
            message: e.to_string(),
        })
    }

    /// The config as pretty-printed JSON (parses back to an equal config).
    ///
    /// # Errors
    /// [`ConfigError::Serialize`]; not expected for these types.
    pub fn to_json_string(&self) -> Result<String, ConfigError> {
        serde_json::to_string_pretty(self).map_err(|e| ConfigError::Serialize {
            format: Format::Json,
            message: e.to_string(),
        })
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_owned(),
        source,
    })
}
