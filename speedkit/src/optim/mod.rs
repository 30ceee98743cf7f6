//! AdamW with ATen's fused kernel (`_fused_adamw_`) or the multi-tensor (`_foreach_*`) path, as
//! `torch.optim.AdamW(fused=True)` / `(foreach=True, capturable=True)` compute it.
//!
//! The step counts and the learning rate are device tensors, so a step never synchronises with the
//! host and can be captured in a CUDA graph ([`crate::graph`]); [`AdamWOptimizer::set_lr`] writes the
//! new rate into that tensor. With the fused kernel the [`GradScaler`](crate::amp::GradScaler)'s
//! unscale and inf-skip happen inside the same kernel.
//!
//! On the fused path, where speedkit's kernels are on, speedkit's own AdamW kernel takes every
//! contiguous fp32 CUDA parameter instead, in one launch per 48 parameters: the same update,
//! GradScaler handling included. For the parameters whose autocast-type copy speedkit keeps (the
//! weights of [`crate::nn::Linear`] on speedkit's kernels) it also writes the copy in its pass, so
//! the next forward casts no weight. With `kernels: false` ATen's kernel updates every parameter.
//!
//! ```
//! use speedkit::optim::{AdamW, AdamWOptimizer};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layer = nn::linear(vs.root(), 4, 2, Default::default());
//! let mut opt = AdamWOptimizer::new(&vs, AdamW { lr: 1e-2, ..Default::default() }, false)?;
//! let loss = layer.forward(&Tensor::ones([8, 4], (Kind::Float, Device::Cpu))).sum(None);
//! opt.zero_grad()?;
//! loss.backward();
//! opt.step()?;
//! assert_eq!(opt.steps_taken()?, 1);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

mod adamw;
mod checkpoint;
mod config;
mod memory;
mod state;

pub use adamw::AdamWOptimizer;
pub use config::{AdamW, ParamGroup};
pub(crate) use memory::Holdings;
pub use memory::OptimizerMemory;
