//! # speedkit-suite
//!
//! The models, data and FLOP formulas behind speedkit's reference workloads
//! (`docs/workloads.md`), shared by the registered benchmark workloads (`workloads/`), the
//! examples and the tests of this package.
//!
//! - [`models`]: `Linear3` (the seed benchmark), `Mlp`, a GPT-style `Transformer` and a CIFAR
//!   `ResNet`, each with a config struct that has a `bench()` and a `tiny()` size and a
//!   `flops_per_step()` formula.
//! - [`data`]: the fixed random inputs every workload trains on (made once on the device, seed 0),
//!   and a reader for CIFAR-10's binary format.
//!
//! Every forward pass returns a [`speedkit::Result`]: libtorch errors (a shape mismatch, an
//! attention backend that cannot run) come back as values instead of panics.

#![warn(missing_docs)]

pub mod data;
pub mod models;

/// The optimizer of every reference workload (`docs/workloads.md`): AdamW, lr 3e-4, weight decay
/// 0.1, PyTorch's betas and eps.
///
/// ```
/// assert_eq!(speedkit_suite::REFERENCE_ADAMW.lr, 3e-4);
/// ```
pub const REFERENCE_ADAMW: speedkit::optim::AdamW = speedkit::optim::AdamW {
    lr: 3e-4,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    wd: 0.1,
    exclude_from_decay: false,
};
