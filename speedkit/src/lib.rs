//! # speedkit
//!
//! Run tch-rs (libtorch) training at the speed the GPU allows, without rewriting the training code.
//!
//! speedkit finds the fast paths a GPU offers — TF32, bf16/fp16 autocast with a GradScaler, fused
//! AdamW, the SDPA attention backends, cuDNN autotuning, CUDA graph capture — and applies them
//! **auditably** (every global flag change is recorded with its before/after value and reason) and
//! **reversibly** (restored when the context drops, also during a panic).
//!
//! ```
//! use speedkit::{apply_speedups, optim::AdamW, SpeedConfig};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let mut vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 32, 8, Default::default());
//! let config = SpeedConfig::auto();                      // or SpeedConfig::from_yaml("speed.yaml")?
//! let ctx = apply_speedups(&mut vs, &config)?;           // detect, plan, apply flags
//! let mut opt = ctx.adamw(&vs, AdamW { lr: 3e-4, wd: 0.1, ..Default::default() })?;
//! let (x, y) = (Tensor::randn([64, 32], (Kind::Float, ctx.device())), Tensor::zeros([64], (Kind::Int64, ctx.device())));
//! let loss = ctx.autocast(|| model.forward(&x).cross_entropy_for_logits(&y));
//! ctx.backward_step(&loss, &mut opt)?;                   // scale → backward → unscale/inf-check → step → update
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```
//!
//! Modules by concept: [`hardware`] (what the machine offers), [`config`] (the `SpeedConfig`),
//! [`plan`] (config × hardware → settings with reasons), [`flags`] (the global flag registry and the
//! restoring guard), [`amp`] (autocast, GradScaler), [`optim`] (AdamW), [`nn`] (attention),
//! [`kernels`] (speedkit's own fused CUDA kernels), [`graph`] (CUDA graph capture of a whole step), [`bench`] (workloads and the runner),
//! [`report`] (audit and report).

#![warn(missing_docs)]

mod advice;
pub mod amp;
pub mod bench;
mod context;
pub mod error;
mod ffi;
pub mod flags;
pub mod graph;
pub mod hardware;
pub mod kernels;
pub mod nn;
pub mod optim;
pub mod plan;
pub mod report;

/// The speed configuration (re-exported from `speedkit-config`, which the macros also use to check
/// configs at compile time).
pub mod config {
    pub use speedkit_config::*;
}

pub use advice::{audit, audit_tensors, Advice, ModelAudit};
pub use config::SpeedConfig;
pub use context::{apply_speedups, SpeedContext};
pub use error::{Result, SpeedkitError};
pub use speedkit_macros::{accelerate, bench, forward};

/// Support for macro expansions. Not a public API: no stability promise.
#[doc(hidden)]
pub mod __private;
