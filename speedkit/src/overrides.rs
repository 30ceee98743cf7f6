//! Operator overrides: speedkit's kernels registered as the CUDA implementations of the ATen
//! operators they beat, so that a model written with tch's own modules (`nn::layer_norm`, ...) runs
//! them with no change. PyTorch's dispatcher picks the kernel of every operator call; speedkit
//! registers its own there (what `torch.library.Library("aten", "IMPL")` does) while a
//! [`SpeedContext`](crate::SpeedContext) lives, and removes it when the context drops, which brings
//! ATen's kernel back.
//!
//! An override is held like a flag ([`Flag::AtenOverride`](crate::flags::Flag::AtenOverride)): in
//! the plan with its reason (the config's `overrides`), in the audit with its before and after,
//! stacked and restored by the flag guard on every exit path, panics included, and under the same
//! thread rule. A call whose inputs the kernel does not take (a dtype, a layout, a width) runs
//! ATen's own CUDA kernel, and the kernel layer's notes count it ([`crate::kernels`]); CPU tensors
//! never reach an override. `kernels: false` (or `overrides: false`) registers nothing.
//!
//! ```no_run
//! use speedkit::overrides::{dispatcher_table, Override};
//! use speedkit::{SpeedConfig, SpeedContext};
//!
//! let ctx = SpeedContext::new(&SpeedConfig::auto())?; // on a GPU: the overrides are registered
//! assert!(Override::LayerNorm.is_registered()?);
//! assert!(dispatcher_table("aten::native_layer_norm")?.contains("overrides.cpp"));
//! drop(ctx); // ATen's kernels again
//! assert!(!Override::LayerNorm.is_registered()?);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use serde::Serialize;

use crate::error::Result;
use crate::ffi::{self, raw};
use crate::kernels::KernelOp;

/// A group of ATen operators speedkit takes over together.
///
/// ```
/// use speedkit::overrides::Override;
/// assert_eq!(Override::LayerNorm.operators(), ["aten::native_layer_norm", "aten::native_layer_norm_backward"]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Override {
    /// LayerNorm's forward and backward (`nn::layer_norm`, `Tensor::layer_norm`) on speedkit's
    /// LayerNorm kernels: one pass each way, the parameters' gradients in the same pass.
    LayerNorm,
}

impl Override {
    /// Every group, in the shim's order.
    pub const ALL: [Override; 1] = [Override::LayerNorm];

    /// The name the audit and the flags show.
    pub const fn name(self) -> &'static str {
        match self {
            Override::LayerNorm => "layer_norm",
        }
    }

    /// The ATen operators it registers a CUDA kernel for.
    pub const fn operators(self) -> &'static [&'static str] {
        match self {
            Override::LayerNorm => &[
                "aten::native_layer_norm",
                "aten::native_layer_norm_backward",
            ],
        }
    }

    /// The kernels it runs, whose switch ([`crate::kernels`]) also turns it off and whose notes
    /// count its calls.
    pub const fn kernel_op(self) -> KernelOp {
        match self {
            Override::LayerNorm => KernelOp::LayerNorm,
        }
    }

    /// Whether it is registered with the dispatcher now.
    pub fn is_registered(self) -> Result<bool> {
        ffi::overrides::get(self.code())
    }

    /// The shim's id (speedkit.h's `sk_override`).
    pub(crate) const fn code(self) -> i32 {
        match self {
            Override::LayerNorm => raw::SK_OVERRIDE_LAYER_NORM,
        }
    }
}

/// The dispatcher's table of an ATen operator (`"aten::native_layer_norm"`; an overload after a
/// dot, `"aten::add.Tensor"`): which kernel each dispatch key runs and where it was registered. A
/// speedkit override shows as registered at `speedkit/shim/overrides.cpp`.
///
/// ```
/// let table = speedkit::overrides::dispatcher_table("aten::native_layer_norm")?;
/// assert!(table.contains("CPU"));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn dispatcher_table(operator: &str) -> Result<String> {
    let (name, overload) = operator.split_once('.').unwrap_or((operator, ""));
    ffi::overrides::dispatcher_table(name, overload)
}
