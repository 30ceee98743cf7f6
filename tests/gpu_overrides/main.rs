//! The operator overrides' kernels against ATen's, forward and backward, on odd shapes in fp32,
//! bf16 and fp16; inputs they do not take run ATen's kernel and are noted; an unchanged tch model
//! trains on them under autocast and in a whole-step CUDA graph. Skipped, with the reason printed,
//! without a GPU.

#[path = "../common/mod.rs"]
mod common;

mod batch_norm;
mod chunked_classifier;
mod convolution;
mod cross_entropy;
mod embedding;
mod layer_norm;
mod linear;
mod log_softmax;
mod second_derivative;
mod support;
mod tch_models;
