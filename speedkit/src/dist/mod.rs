//! Data-parallel training over several processes through libtorch's c10d — the engine under
//! PyTorch's `torchrun` + `DistributedDataParallel`: a `TCPStore` rendezvous, Gloo (CPU) or NCCL
//! (CUDA) collectives, and the `Reducer` that averages gradients in buckets while the backward pass
//! runs.
//!
//! Start one process per device with `speedkit launch --nproc-per-node N -- <command>` (or torchrun,
//! or SLURM with the same variables). [`SpeedContext`](crate::SpeedContext) reads the environment:
//! with `distributed.backend: auto` and `WORLD_SIZE` > 1 it joins the group, checks that every
//! rank has the same config and model, broadcasts rank 0's parameters, and averages gradients in
//! every [`backward`](crate::SpeedContext::backward). The training loop does not change, except
//! that each rank should read its own part of the data ([`Shard`]) and print only on rank 0
//! ([`SpeedContext::is_main`](crate::SpeedContext::is_main)).
//!
//! Checkpoints: [`SpeedContext::model_state`](crate::SpeedContext::model_state) gives the whole
//! model for one file written on rank 0; [`SpeedContext::save_sharded`](crate::SpeedContext::save_sharded)
//! writes one file per rank (its own part of the model and of AdamW's state, nothing gathered, as
//! PyTorch's `torch.distributed.checkpoint`), which
//! [`SpeedContext::load_sharded`](crate::SpeedContext::load_sharded) reads back on any number of
//! ranks and [`read_sharded_checkpoint`] assembles whole.
//!
//! ```no_run
//! use speedkit::{apply_speedups, dist::Shard, SpeedConfig};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! # fn main() -> speedkit::Result<()> {
//! tch::manual_seed(0);
//! let mut vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 16, 1, Default::default());
//! let ctx = apply_speedups(&mut vs, &SpeedConfig::auto())?;   // joins the group under a launcher
//! let mut opt = ctx.adamw(&vs, Default::default())?;
//! let data = Tensor::randn([1024, 16], (Kind::Float, Device::Cpu));
//! let shard = Shard::from_env(42)?;
//! for epoch in 0..3 {
//!     for batch in shard.batches(1024, 32, epoch) {
//!         let idx = Tensor::from_slice(&batch.iter().map(|&i| i as i64).collect::<Vec<_>>());
//!         let x = data.index_select(0, &idx).to_device(ctx.device());
//!         let loss = ctx.autocast(|| model.forward(&x).square().mean(None));
//!         ctx.backward_step(&loss, &mut opt)?;             // gradients averaged across ranks
//!     }
//!     ctx.print_main(format!("epoch {epoch} done"));
//! }
//! # Ok(()) }
//! ```

mod data_parallel;
mod env;
mod group;
mod optimizer_shard;
mod shard;
mod sharded_checkpoint;
mod throughput;

pub(crate) use data_parallel::AveragingSettings;
pub use data_parallel::{DataParallel, GradientSync};
pub use env::LaunchEnv;
pub use group::{Backend, ProcessGroup};
pub use optimizer_shard::OptimizerShard;
pub use shard::Shard;
pub use sharded_checkpoint::read_sharded_checkpoint;
pub(crate) use sharded_checkpoint::{load as load_sharded, save as save_sharded};
pub use throughput::Throughput;

/// Whether this process is rank 0 (or the only one): the process that should print and save.
/// A malformed launch environment counts as rank 0 here; the context reports it as an error.
///
/// ```
/// if speedkit::dist::is_main_process() {
///     println!("only once per run");
/// }
/// ```
pub fn is_main_process() -> bool {
    LaunchEnv::from_env()
        .ok()
        .flatten()
        .is_none_or(|env| env.is_main())
}

/// Refuses to start when the ranks were given different speed configs (compared by a fingerprint
/// of the whole config, gathered from every rank).
pub(crate) fn check_same_config(
    group: &ProcessGroup,
    config: &crate::SpeedConfig,
) -> crate::Result<()> {
    data_parallel::check_same_config(group, config)
}
