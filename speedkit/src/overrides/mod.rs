//! Operator overrides: speedkit's kernels registered as the CUDA implementations of the ATen
//! operators they beat, so that a model written with tch's own modules (`nn::layer_norm`, ...) runs
//! them with no change. PyTorch's dispatcher picks the kernel of every operator call; speedkit
//! registers its own there (what `torch.library.Library("aten", "IMPL")` does) while a
//! [`SpeedContext`](crate::SpeedContext) lives, and removes it when the context drops, which brings
//! ATen's kernel back.
//!
//! An override is held like a flag ([`Override::flag`]): in
//! the plan with its reason (the config's `overrides`), in the audit with its before and after,
//! stacked and restored by the flag guard on every exit path, panics included, and under the same
//! thread rule. A call whose inputs the kernel does not take (a dtype, a layout, a width) runs
//! ATen's own CUDA kernel, and the kernel layer's notes count it ([`crate::kernels`]); CPU tensors
//! never reach an override. `kernels: false` (or `overrides: false`) registers nothing.
//!
//! Your own kernels take the same path: [`OperatorOverride`] registers a Rust function as an
//! operator's implementation under a dispatch key, held by a context
//! ([`SpeedContext::override_operator`](crate::SpeedContext::override_operator)) or by its own
//! registration.
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

mod batch_norm;
pub(crate) mod chunked_classifier;
mod convolution;
mod custom;
mod embedding;
mod linear;
mod log_softmax;
mod mse_loss;
mod producers;

pub use convolution::{choose_depthwise, CudnnPlans, DepthwiseChoice, DepthwiseChoiceGuard};
pub use custom::{
    DispatchKey, OperatorOverride, OverrideCall, OverrideRecord, OverrideRegistration,
    OverrideStats, Reply, Value,
};

use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::Serialize;

use crate::error::Result;
use crate::ffi::{self, raw};
use crate::flags::{Flag, Switch, SwitchTable};
use crate::kernels::KernelOp;

/// Declares the groups, one row each: `Variant = "name", the kernel op whose switch also turns it
/// off and under which its calls are noted, where it is registered (`shim(SK_OVERRIDE_...)` for a
/// group registered in C++, `rust(module)` for one built on [`OperatorOverride`] in that module),
/// and the ATen operators it takes.
macro_rules! override_groups {
    ($(
        $(#[doc = $doc:literal])*
        $group:ident = $name:literal, KernelOp::$op:ident, $home:ident($where:ident), [$($operator:literal),+ $(,)?];
    )+) => {
        /// A group of ATen operators speedkit takes over together.
        ///
        /// ```
        /// use speedkit::overrides::Override;
        /// assert_eq!(Override::LayerNorm.operators(), ["aten::native_layer_norm", "aten::native_layer_norm_backward"]);
        /// ```
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Override {
            $($(#[doc = $doc])* $group,)+
        }

        impl Override {
            /// Every group, in the order the plan registers them.
            pub const ALL: [Override; [$($name),+].len()] = [$(Override::$group),+];

            /// The name the audit and the flags show.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Override::$group => $name,)+
                }
            }

            /// The ATen operators it registers a kernel for.
            pub const fn operators(self) -> &'static [&'static str] {
                match self {
                    $(Override::$group => &[$($operator),+],)+
                }
            }

            /// The kernels it runs, whose switch ([`crate::kernels`]) also turns it off.
            pub const fn kernel_op(self) -> KernelOp {
                match self {
                    $(Override::$group => KernelOp::$op,)+
                }
            }

            /// The shim's id (speedkit.h's `sk_override`) of a group registered in C++; `None`
            /// for one built in Rust on [`OperatorOverride`].
            const fn shim_code(self) -> Option<i32> {
                match self {
                    $(Override::$group => override_groups!(@shim_code $home($where)),)+
                }
            }

            /// The operator overrides of a group built in Rust.
            fn built_in_rust(self) -> Vec<OperatorOverride> {
                match self {
                    $(Override::$group => override_groups!(@built $home($where)),)+
                }
            }
        }

        /// One switch per group, in the table's order: registered or not.
        static SWITCHES: &[Switch] = &[
            $(Switch {
                name: concat!("speedkit.overrides.", $name),
                get: || Override::$group.is_registered(),
                set: |on| Override::$group.set_registered(on),
            },)+
        ];
    };
    (@shim_code shim($code:ident)) => { Some(raw::$code) };
    (@shim_code rust($module:ident)) => { None };
    (@built shim($code:ident)) => { Vec::new() };
    (@built rust($module:ident)) => { $module::operator_overrides().into() };
}

override_groups! {
    /// LayerNorm's forward and backward (`nn::layer_norm`, `Tensor::layer_norm`) on speedkit's
    /// LayerNorm kernels: one pass each way, the parameters' gradients in the same pass.
    LayerNorm = "layer_norm", KernelOp::LayerNorm, shim(SK_OVERRIDE_LAYER_NORM), ["aten::native_layer_norm", "aten::native_layer_norm_backward"];
    /// `log_softmax` of bf16/fp16 logits under autocast (`log_softmax(-1, Kind::Float)`,
    /// `cross_entropy_for_logits`) on speedkit's kernels: fp32 log-probabilities straight from the
    /// logits and the gradient straight back in their type, where autocast makes an fp32 copy of
    /// the logits and casts the gradient back. Built on the public layer ([`OperatorOverride`],
    /// [`crate::function`], [`crate::cuda`]), as a user would build it.
    CrossEntropy = "cross_entropy", KernelOp::CrossEntropy, rust(log_softmax), ["aten::log_softmax.int", "aten::nll_loss"];
    /// `linear` under autocast (`nn::linear`, `Tensor::linear`) on speedkit's Linear, the one
    /// behind `speedkit::nn::Linear`: the weight's and bias's copies in the autocast type kept
    /// across steps (written by speedkit's AdamW) instead of a cast of every weight in every
    /// forward, the weight gradient in fp32 straight from its GEMM, the bias gradient on
    /// speedkit's column-sum kernel.
    Linear = "linear", KernelOp::Linear, rust(linear), ["aten::linear"];
    /// BatchNorm in training mode (`nn::batch_norm2d`, `Tensor::batch_norm`) over channels-last
    /// activations on speedkit's kernels: the statistics, the normalisation and the two backward
    /// passes each read their inputs once at close to the memory's bandwidth, where ATen's
    /// channels-last kernels reach a fifth to a half of it. The normalised output is written only
    /// when read: a `relu` of it, or of its sum with a residual (`add`), runs in the normalisation's
    /// own pass. Built on the public layer, as [`CrossEntropy`](Override::CrossEntropy).
    BatchNorm = "batch_norm", KernelOp::BatchNorm, rust(batch_norm), [
        "aten::native_batch_norm",
        "aten::native_batch_norm_backward",
        "aten::cudnn_batch_norm",
        "aten::cudnn_batch_norm_backward",
        "aten::relu",
        "aten::add.Tensor",
    ];
    /// `conv1d`, `conv2d` and `conv3d` under autocast (`nn::conv2d`, `Tensor::conv2d`) without
    /// the weight's copy in the autocast type kept for the backward: the backward casts the fp32
    /// weight again, so no layer's copy is alive at the end of the forward, the memory peak of a
    /// convolutional network. The convolutions are ATen's (cuDNN) on autocast's operands.
    Convolution = "convolution", KernelOp::Convolution, rust(convolution), ["aten::conv1d", "aten::conv2d", "aten::conv3d"];
    /// `mse_loss` with a reduction (`Tensor::mse_loss`) returning its loss in memory of its own
    /// size: ATen's CUDA kernel leaves the reduced loss on storage the size of its input (its
    /// elementwise output, resized), which stays alive as long as the loss, through the backward
    /// and in a graphed step for good (0.25 GiB for the mlp_block workload). The loss is ATen's.
    MseLoss = "mse_loss", KernelOp::MseLoss, rust(mse_loss), ["aten::mse_loss"];
    /// `embedding` under autocast (`nn::embedding`, `Tensor::embedding`) on speedkit's embedding,
    /// the one behind `speedkit::nn::embedding`: the same gather, and a deterministic backward
    /// that sorts only the bits a token can have and writes each row of the table's gradient
    /// once, where ATen's zeroes the gradient, sorts 64-bit keys and runs four kernels.
    Embedding = "embedding", KernelOp::Embedding, rust(embedding), ["aten::embedding"];
}

inventory::submit! {
    SwitchTable { order: 2, switches: SWITCHES }
}

impl Override {
    /// Its registration as a flag a [`FlagGuard`](crate::flags::FlagGuard) sets and restores:
    /// `true` while registered.
    ///
    /// ```
    /// use speedkit::overrides::Override;
    /// assert_eq!(Override::LayerNorm.flag().name(), "speedkit.overrides.layer_norm");
    /// ```
    pub fn flag(self) -> Flag {
        Flag::Switch(&SWITCHES[self as usize])
    }

    /// Whether it is registered with the dispatcher now.
    pub fn is_registered(self) -> Result<bool> {
        match self.shim_code() {
            Some(code) => ffi::overrides::get(code),
            None => Ok(held().iter().any(|(o, _)| *o == self)),
        }
    }

    /// Registers it (`on`) or removes it: the raw setter of
    /// [`Override::flag`], which a context's flag guard
    /// calls and restores.
    pub(crate) fn set_registered(self, on: bool) -> Result<()> {
        if let Some(code) = self.shim_code() {
            return ffi::overrides::set(code, on);
        }
        let mut held = held();
        let index = held.iter().position(|(o, _)| *o == self);
        match (on, index) {
            (true, None) => {
                let registrations = self.registered_in_rust()?;
                held.push((self, registrations));
            }
            (false, Some(index)) => {
                // A write like a flag's, which a fault test can make fail before anything changes.
                ffi::flags::count_write()?;
                for registration in held.remove(index).1 {
                    registration.remove()?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Its registrations, made whole or not at all (one that fails drops, which removes, those
    /// made before it).
    fn registered_in_rust(self) -> Result<Vec<OverrideRegistration>> {
        self.built_in_rust()
            .into_iter()
            .map(|o| {
                let noted = o.noted_as(self.kernel_op());
                if self.passes_through(noted.operator()) {
                    noted.declines_unnoted().register()
                } else {
                    noted.register()
                }
            })
            .collect()
    }

    /// Whether `operator` is one the group takes only where it reads the group's own pending
    /// output (BatchNorm's `relu` and residual `add`): every other call passes through to ATen,
    /// which is routing, not a fallback, and is not noted.
    fn passes_through(self, operator: &str) -> bool {
        self == Override::BatchNorm && matches!(operator, "aten::relu" | "aten::add.Tensor")
    }

    /// The calls of `operator` (one of [`operators`](Override::operators)) so far, while this
    /// group, built in Rust, is registered.
    ///
    /// ```
    /// use speedkit::overrides::Override;
    /// assert_eq!(Override::CrossEntropy.stats("aten::nll_loss"), None); // not registered
    /// ```
    pub fn stats(self, operator: &str) -> Option<OverrideStats> {
        held()
            .iter()
            .filter(|(o, _)| *o == self)
            .flat_map(|(_, registrations)| registrations)
            .find(|r| r.operator() == operator)
            .map(OverrideRegistration::stats)
    }
}

type Held = Vec<(Override, Vec<OverrideRegistration>)>;

/// The groups built in Rust that are registered now, with their registrations.
fn held() -> MutexGuard<'static, Held> {
    static HELD: Mutex<Held> = Mutex::new(Vec::new());
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
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
