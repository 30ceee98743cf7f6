//! # speedkit-suite
//!
//! The models, data and FLOP formulas behind speedkit's reference workloads
//! (`../shared/workloads.md`), shared by the registered benchmark workloads (`workloads/`), the
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
