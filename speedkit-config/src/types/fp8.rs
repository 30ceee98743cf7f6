//! `fp8:`, FP8 GEMMs for speedkit's Linear layers, and the recipe and gradient format they use.

use serde::{Deserialize, Serialize};

use super::AutoBool;

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
