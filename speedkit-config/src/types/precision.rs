//! `precision:` and `tf32_matmul_precision:`, the forward pass's and fp32 matmuls' precision.

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
