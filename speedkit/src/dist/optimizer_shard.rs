//! [`OptimizerShard`]: ZeRO-1, the optimizer state sharded across the ranks. A sharded
//! [`GradientSync`](super::GradientSync) reduce-scatters each gradient bucket, so that each rank
//! receives the average of its own contiguous part of the bucket only; those parts, cut along the
//! parameters, are the pieces this rank's optimizer updates and keeps AdamW state for. After the
//! update every rank's pieces are all-gathered back into the whole parameters, so each rank holds
//! the whole model again for the next forward pass. A reduce-scatter and an all-gather send what
//! one all-reduce sends, so the sharding costs no communication, and the optimizer state (AdamW:
//! twice the parameters in fp32) shrinks by the number of ranks.

use tch::{Device, Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::ffi::distributed::{RawGradientSync, RawOptimizerShard, RawReduceOp};

/// This rank's part of a model's parameters under ZeRO-1, and the collectives that keep the
/// parts together: what [`AdamWOptimizer::sharded`](crate::optim::AdamWOptimizer::sharded)
/// updates. [`SpeedContext::adamw`](crate::SpeedContext::adamw) makes one by itself under
/// `distributed.shard_optimizer: true`; by hand, from a [`GradientSync::sharded`](super::GradientSync::sharded):
///
/// ```no_run
/// use speedkit::dist::{Backend, GradientSync, LaunchEnv, ProcessGroup};
/// use speedkit::optim::{AdamW, AdamWOptimizer};
/// use std::time::Duration;
/// use tch::{nn, Device};
/// let env = LaunchEnv::from_env()?.expect("run under `speedkit launch` or torchrun");
/// let group = ProcessGroup::init(&env, Backend::Nccl, Duration::from_secs(60))?;
/// let vs = nn::VarStore::new(Device::Cuda(env.local_rank));
/// let layer = nn::linear(vs.root(), 64, 64, Default::default());
/// let sync = GradientSync::sharded(&group, &vs.trainable_variables(), 25 << 20, None)?;
/// let mut opt = AdamWOptimizer::sharded(sync.optimizer_shard()?, AdamW::default(), true)?;
/// // ... loss.backward(); sync.run()?; opt.step()?;   (every rank: the same parameters)
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub struct OptimizerShard {
    raw: RawOptimizerShard,
    params: Vec<Tensor>,
    pieces: Vec<(Tensor, usize)>,
    /// Each piece's first element in its parameter's flattened values.
    offsets: Vec<i64>,
    world_size: usize,
    parameters_sharded: bool,
}

impl OptimizerShard {
    /// The shard of `sync` (made sharded over `params`, in that order, by `world_size` ranks;
    /// `parameters_sharded`: ZeRO-3's).
    pub(crate) fn of(
        sync: &RawGradientSync,
        params: &[Tensor],
        world_size: usize,
        parameters_sharded: bool,
    ) -> Result<Self> {
        let raw = RawOptimizerShard::new(sync).map_err(failed)?;
        let (pieces, offsets) = raw
            .pieces()
            .map_err(failed)?
            .into_iter()
            .map(|(piece, param, offset)| ((piece, param), offset))
            .unzip();
        Ok(Self {
            raw,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            pieces,
            offsets,
            world_size,
            parameters_sharded,
        })
    }

    /// This rank's pieces: flat views of stretches of the parameters, each with the index of its
    /// parameter in [`parameters`](Self::parameters). Their gradients are the averaged gradients
    /// of those stretches after each run of the sync.
    pub fn pieces(&self) -> &[(Tensor, usize)] {
        &self.pieces
    }

    /// Where each of [`pieces`](Self::pieces) starts in its parameter's flattened values: piece
    /// `i` is elements `offsets[i]..offsets[i] + pieces[i].numel()` of it.
    pub fn piece_offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// The whole parameters the shard is part of.
    pub fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// Whether the parameters are sharded too (ZeRO-3): the pieces, in fp32, are then all this rank
    /// holds of them between steps.
    pub fn parameters_sharded(&self) -> bool {
        self.parameters_sharded
    }

    /// How many ranks share the parameters.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether `params` are this shard's parameters (the same tensors, in any order: same data
    /// and shape).
    pub fn covers(&self, params: &[Tensor]) -> bool {
        params.len() == self.params.len()
            && params.iter().all(|p| {
                self.params
                    .iter()
                    .any(|q| q.data_ptr() == p.data_ptr() && q.size() == p.size())
            })
    }

    /// Every rank's updated pieces, all-gathered into the parameters (a collective: every rank
    /// calls it, after its optimizer step; capturable in a CUDA graph).
    pub(crate) fn gather(&self) -> Result<()> {
        self.raw.gather().map_err(failed)
    }

    /// Starts the all-gather of the sync's bucket `k` alone, once this rank updated its pieces of
    /// it; [`finish_gather`](Self::finish_gather) joins them. Every rank must start the same
    /// buckets in the same order.
    pub(crate) fn gather_bucket(&self, k: usize) -> Result<()> {
        self.raw.gather_bucket(k).map_err(failed)
    }

    /// Joins the all-gathers [`gather_bucket`](Self::gather_bucket) started.
    pub(crate) fn finish_gather(&self) -> Result<()> {
        self.raw.finish_gather().map_err(failed)
    }

    /// The 2-norm of the whole gradient, from each rank's `local` norm of its pieces' gradients
    /// (a collective).
    pub(crate) fn global_norm(&self, local: Option<Tensor>) -> Result<Tensor> {
        let device = self.params.first().map_or(Device::Cpu, Tensor::device);
        let squared = match local {
            Some(norm) => norm.f_to_kind(Kind::Float)?.f_square()?,
            None => Tensor::f_zeros([] as [i64; 0], (Kind::Float, device))?,
        };
        self.raw
            .all_reduce_(&squared, RawReduceOp::Sum)
            .map_err(failed)?;
        Ok(squared.f_sqrt()?)
    }
}

impl std::fmt::Debug for OptimizerShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OptimizerShard")
            .field("parameters", &self.params.len())
            .field("pieces", &self.pieces.len())
            .field("world_size", &self.world_size)
            .finish()
    }
}

fn failed(e: SpeedkitError) -> SpeedkitError {
    SpeedkitError::Distributed(format!("sharded optimizer: {e}"))
}
