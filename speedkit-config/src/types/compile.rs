//! `compile:`, capturing the training step as a CUDA graph.

use serde::{Deserialize, Serialize};

use super::AutoBool;

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
    /// Whether the captured step runs generated kernels for its chains of pointwise operators
    /// (traced during the last warm-up step) in place of ATen's, one kernel per chain.
    pub fusion: bool,
    /// Whether the eager warm-up steps keep the tensors autograd saves for the backward in host
    /// memory until the backward reads them (`speedkit::offload`): a warm-up step then peaks near
    /// the captured step instead of at a whole eager step's activations. `auto`: with `fusion`,
    /// whose captured step saves less than an eager one (without it, the two peak alike and
    /// parking would only cost time).
    pub warmup_offload: AutoBool,
}

impl Default for CompileConfig {
    fn default() -> Self {
        Self {
            enabled: AutoBool::Auto,
            mode: CompileMode::Graphs,
            max_graphs: 4,
            warmup_steps: 3,
            fusion: false,
            warmup_offload: AutoBool::Auto,
        }
    }
}

/// How the training step is compiled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CompileMode {
    /// Capture the whole training step as a CUDA graph.
    #[default]
    Graphs,
}

spelled_enum!(CompileMode, "compile.mode", [Graphs => "graphs"]);
