//! The op table: each of speedkit's fused ops declared once — its name, its switch, its id in the C
//! ABI (speedkit.h's `sk_op`) and the kernel files it runs — and everything that lists ops
//! generated from it: [`KernelOp`], [`KernelOp::ALL`], the names, the ABI codes and the switches
//! the flag guard holds. `docs/DESIGN.md` ("Adding an op") walks through adding a row; a unit test
//! fails when the table and the header's `sk_op` disagree.

use std::fmt;

use serde::Serialize;

use crate::error::Result;
use crate::ffi::{self, raw};
use crate::flags::{Flag, Switch, SwitchTable};

/// Declares the ops, one row each:
/// `Variant = SK_OP_CODE, "name", "switch_name", [kernel files], doc`.
macro_rules! kernel_ops {
    ($(
        $(#[doc = $doc:literal])*
        $op:ident = $code:ident, $name:literal, $switch:literal, [$($file:literal),*];
    )+) => {
        /// One of speedkit's fused ops, as the kernel switch and the notes name it.
        ///
        /// ```
        /// use speedkit::kernels::KernelOp;
        /// assert_eq!(KernelOp::LayerNorm.name(), "layer_norm");
        /// assert_eq!(KernelOp::LayerNorm.flag().name(), "speedkit.kernels.layer_norm");
        /// ```
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum KernelOp {
            $($(#[doc = $doc])* $op,)+
        }

        impl KernelOp {
            /// Every op, in the table's order (the shim's).
            pub const ALL: [KernelOp; [$(stringify!($op)),+].len()] = [$(KernelOp::$op),+];

            /// The name the audit and the runner show.
            pub const fn name(self) -> &'static str {
                match self {
                    $(KernelOp::$op => $name,)+
                }
            }

            /// The kernel files (in `speedkit/kernels/`) the op runs; none for an op whose work is
            /// done by a library (cuBLASLt, cuDNN) on speedkit's terms.
            pub const fn kernel_files(self) -> &'static [&'static str] {
                match self {
                    $(KernelOp::$op => &[$($file),*],)+
                }
            }

            /// The shim's id (speedkit.h's `sk_op`).
            pub(crate) const fn code(self) -> i32 {
                match self {
                    $(KernelOp::$op => raw::$code,)+
                }
            }

            /// The name of the shim's id in speedkit.h, e.g. `SK_OP_LAYER_NORM`.
            #[cfg(test)]
            const fn abi_name(self) -> &'static str {
                match self {
                    $(KernelOp::$op => stringify!($code),)+
                }
            }
        }

        /// The switch of every op ([`super::flag`]), then one per op in the table's order.
        static SWITCHES: &[Switch] = &[
            Switch {
                name: "speedkit.kernels",
                get: || ffi::kernels::setting_get(raw::SK_OP_ALL),
                set: |on| ffi::kernels::setting_set(raw::SK_OP_ALL, on),
            },
            $(Switch {
                name: concat!("speedkit.kernels.", $switch),
                get: || ffi::kernels::setting_get(raw::$code),
                set: |on| ffi::kernels::setting_set(raw::$code, on),
            },)+
        ];
    };
}

kernel_ops! {
    /// LayerNorm, with the residual add before it ([`crate::nn::LayerNorm`]).
    LayerNorm = SK_OP_LAYER_NORM, "layer_norm", "layer_norm", ["layernorm.cuh"];
    /// The classifier's softmax cross-entropy ([`crate::nn::cross_entropy`]), and `log_softmax`
    /// with `nll_loss` under autocast
    /// ([`Override::CrossEntropy`](crate::overrides::Override::CrossEntropy)).
    CrossEntropy = SK_OP_CROSS_ENTROPY, "cross_entropy", "cross_entropy", ["classifier.cuh"];
    /// Bias + tanh-GELU after a Linear ([`crate::nn::Linear::forward_gelu`]).
    BiasGelu = SK_OP_BIAS_GELU, "bias_gelu", "bias_gelu", ["bias_gelu.cuh"];
    /// Token + position embedding ([`crate::nn::embedding`]), and `embedding` under autocast
    /// ([`Override::Embedding`](crate::overrides::Override::Embedding)).
    Embedding = SK_OP_EMBEDDING, "embedding", "embedding", ["embedding.cuh"];
    /// Linear's cheaper backward ([`crate::nn::Linear`]).
    Linear = SK_OP_LINEAR, "linear", "linear", ["bias_grad.cuh"];
    /// The transformer MLP on cuBLASLt epilogues ([`crate::nn::Mlp`]).
    Mlp = SK_OP_MLP, "mlp", "mlp", [];
    /// AdamW writing the weight copies ([`crate::optim::AdamWOptimizer`]).
    AdamW = SK_OP_ADAMW, "adamw", "adamw", ["adamw.cuh"];
    /// The FP8 casts ([`crate::nn::quantize_fp8`]).
    Fp8Cast = SK_OP_FP8_CAST, "fp8 cast", "fp8_cast", ["fp8_cast.cuh"];
    /// BatchNorm in training mode over channels-last activations
    /// ([`Override::BatchNorm`](crate::overrides::Override::BatchNorm)).
    BatchNorm = SK_OP_BATCH_NORM, "batch_norm", "batch_norm", [];
    /// Convolution under autocast without a kept copy of the weight
    /// ([`Override::Convolution`](crate::overrides::Override::Convolution)): cuDNN's
    /// convolutions, speedkit's handling of the weight's copy, and speedkit's own kernel for a
    /// depthwise convolution's forward and input gradient where it is the faster.
    Convolution = SK_OP_CONVOLUTION, "convolution", "convolution", ["depthwise_conv.cuh"];
    /// The mean squared error's loss without its input's size of memory behind it
    /// ([`Override::MseLoss`](crate::overrides::Override::MseLoss)): ATen's kernel, its result
    /// made compact.
    MseLoss = SK_OP_MSE_LOSS, "mse_loss", "mse_loss", [];
}

inventory::submit! {
    SwitchTable { order: 1, switches: SWITCHES }
}

impl KernelOp {
    /// The switch of this op's kernels, within the switch of every op ([`super::flag`]), as a
    /// flag a [`FlagGuard`](crate::flags::FlagGuard) sets and restores.
    ///
    /// ```
    /// use speedkit::flags::{FlagGuard, FlagSetting, FlagValue};
    /// use speedkit::kernels::KernelOp;
    /// let _off = FlagGuard::apply(&[FlagSetting::new(
    ///     KernelOp::LayerNorm.flag(),
    ///     FlagValue::Bool(false),
    ///     "compare with ATen's LayerNorm",
    /// )])?;
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn flag(self) -> Flag {
        Flag::Switch(&SWITCHES[self as usize + 1])
    }

    pub(super) fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.code() == code)
    }
}

/// The switch of every op's kernels at once (the config's `kernels`), as a flag.
pub(super) fn all_ops_flag() -> Flag {
    Flag::Switch(&SWITCHES[0])
}

/// Reads an op's switch in the shim (`raw::SK_OP_ALL` for every op's).
pub(super) fn switch_on(code: i32) -> Result<bool> {
    ffi::kernels::setting_get(code)
}

impl fmt::Display for KernelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The enumerators of speedkit.h's `enum sk_op`, as (name, value).
    fn header_ops() -> Vec<(String, i32)> {
        let header = include_str!("../../shim/speedkit.h");
        let start = header
            .find("enum sk_op {")
            .expect("speedkit.h declares enum sk_op");
        let body = &header[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
        body.split(',')
            .filter_map(|entry| {
                let (name, value) = entry.trim().split_once('=')?;
                Some((name.trim().to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    }

    #[test]
    fn the_op_table_and_the_header_list_the_same_ops() {
        let mut table: Vec<(String, i32)> = KernelOp::ALL
            .iter()
            .map(|op| (op.abi_name().to_owned(), op.code()))
            .collect();
        table.push(("SK_OP_ALL".into(), raw::SK_OP_ALL));
        table.push(("SK_OP_COUNT".into(), KernelOp::ALL.len() as i32 + 1));
        table.sort();
        let mut header = header_ops();
        header.sort();
        assert_eq!(table, header);
    }

    #[test]
    fn every_op_has_its_own_switch_named_after_it() {
        for op in KernelOp::ALL {
            let name = op.flag().name();
            assert_eq!(
                name.strip_prefix("speedkit.kernels."),
                Some(op.name().replace(' ', "_").as_str())
            );
        }
        assert_eq!(SWITCHES.len(), KernelOp::ALL.len() + 1);
    }
}
