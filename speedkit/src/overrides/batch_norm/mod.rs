//! [`Override::BatchNorm`](super::Override::BatchNorm): BatchNorm in training mode
//! (`nn::batch_norm2d`, `Tensor::batch_norm`) over channels-last activations on speedkit's
//! kernels, built on the public layer a user has: the kernels through [`crate::cuda`], the
//! registration through [`OperatorOverride`].
//!
//! ATen's `batch_norm` runs cuDNN's operator (`cudnn_batch_norm`) for fp32 and fp16 activations
//! with both parameters, and its own (`native_batch_norm`) otherwise, bf16 under autocast
//! included; both pairs are overridden under the CUDA key, below autograd. Autograd records the
//! operator's own node and calls its backward with what it saved (the input, the weight, the
//! batch's mean and inverse standard deviation), so the overrides only compute the values, the
//! same as ATen's and cuDNN's kernels up to rounding. The activations are read as a matrix of
//! rows × channels, which is what channels-last memory is (and `[N, C]`): a call whose input is
//! laid out otherwise, is in eval mode, or has parameters in a type other than fp32 runs ATen's
//! kernel, counted in the override's statistics.
//!
//! The kernels (`speedkit/kernels/batch_norm.cuh`) read each input once per pass: the statistics one read of `x`,
//! the normalisation one read and one write, the backward one read of the gradient and `x` for
//! the parameters' gradients and the sums, and one more for the input's gradient. ATen's
//! channels-last kernels need the same passes but reach a fifth to a half of the bandwidth at a
//! ResNet's shapes.
//!
//! The normalised output is *deferred* ([`crate::deferred`]): written at its first read, by the
//! same pass the forward would have run. Where that reader is a `relu` (conv → BatchNorm → ReLU),
//! or an `add` of a residual whose sum a `relu` reads (BatchNorm → + shortcut → ReLU, the shortcut
//! a tensor or another BatchNorm's pending output), the `relu` computes its result from the inputs
//! and the coefficients in one pass, and neither the normalised tensor nor the sum is ever written:
//! about 0.9 GB less memory traffic in a ResNet-18 step at batch 256. The input (and a residual)
//! must not change in place between the BatchNorm and that read, as for any deferred tensor.
//!
//! The modules: [`schema`] reads the ATen operators' calls into the forward and backward passes,
//! [`fusion`] holds the pending outputs and the `relu` and `add` that consume them, [`launch`] the
//! layout, launch geometry and kernel loading, and [`params`] the kernels' params structs.

mod fusion;
mod launch;
mod params;
mod schema;

use super::{DispatchKey, OperatorOverride};

/// The overrides, on CUDA: ATen's `native_batch_norm` and cuDNN's `cudnn_batch_norm` (which ATen's
/// `batch_norm` calls for fp32 and fp16 activations) with their backwards, and the `relu` and
/// `add` that fuse with their pending output.
pub(crate) fn operator_overrides() -> [OperatorOverride; 6] {
    [
        OperatorOverride::new(
            "aten::native_batch_norm",
            DispatchKey::Cuda,
            schema::native_forward,
        ),
        OperatorOverride::new(
            "aten::native_batch_norm_backward",
            DispatchKey::Cuda,
            schema::native_backward,
        ),
        OperatorOverride::new(
            "aten::cudnn_batch_norm",
            DispatchKey::Cuda,
            schema::cudnn_forward,
        ),
        OperatorOverride::new(
            "aten::cudnn_batch_norm_backward",
            DispatchKey::Cuda,
            schema::cudnn_backward,
        ),
        OperatorOverride::new("aten::relu", DispatchKey::Cuda, fusion::relu),
        OperatorOverride::new("aten::add.Tensor", DispatchKey::Cuda, fusion::add),
    ]
}
