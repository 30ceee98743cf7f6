//! speedkit's fused kernels against ATen's composites on the GPU: forward and backward on odd
//! shapes in fp32, bf16 and fp16, and a graphed training step through them equal to the eager one.
//! Each test is skipped, with the reason printed, where no CUDA device is visible.
//!
//! Tolerances (‖got − want‖ ≤ tol · max(‖want‖, 1), the reference computed in fp32 from the same
//! rounded inputs): outputs stored in fp32 1e-5, fp16 2e-3, bf16 1e-2 (a few units of each type's
//! rounding); fp32 parameter gradients and losses 1e-4 (only the summation order differs).

#[path = "../common/mod.rs"]
mod common;

mod adamw;
mod bias_gelu;
mod classifier_head;
mod cross_entropy;
mod embedding;
mod layer_norm;
mod linear;
mod support;
mod training;
