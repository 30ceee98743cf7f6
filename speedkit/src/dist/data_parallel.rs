//! [`DataParallel`]: one model replica per process kept identical. At attach, every rank checks
//! that all ranks run the same speed config and the same parameter shapes, and takes rank 0's
//! parameter values. Gradients are then averaged across ranks by one of two engines, which the
//! plan picks (`distributed.all_reduce`) and names:
//! - **`reducer`**: during each backward pass, c10d's `Reducer` (the engine of PyTorch's
//!   `DistributedDataParallel`) all-reduces gradients bucket by bucket as they become ready, from
//!   autograd hooks, so communication overlaps the rest of the backward pass. A CUDA graph cannot
//!   capture its hooks, so the step runs eagerly.
//! - **speedkit's** ([`GradientSync`]): the all-reduce is stream work of the step, which a
//!   whole-step CUDA graph captures with the forward, backward and optimizer, optionally in bf16:
//!   `in_backward` starts each bucket as soon as its gradients are in, beside the rest of the
//!   backward pass; `after_backward` runs them all after it.
//!
//! Every `distributed.check_replicas_every` optimizer steps the ranks compare fingerprints of
//! their parameters ([`DataParallel::check_replicas`]), so a replica that drifted from rank 0's is
//! named rather than silently trained on.

use std::cell::Cell;

use tch::{nn::VarStore, Kind, Tensor};

use super::{OptimizerShard, ProcessGroup};
use crate::config::{AllReduce, SpeedConfig};
use crate::error::{Result, SpeedkitError};
use crate::ffi::distributed::{RawGradientSync, RawReducer, RawSharding};

/// How a [`DataParallel`] averages gradients.
enum Averaging {
    Reducer(RawReducer),
    InStep {
        sync: GradientSync,
        overlap: bool,
        overlap_optimizer: bool,
    },
}

/// The gradient-averaging state of one model (see the module docs). Made by
/// [`SpeedContext::prepare`](crate::SpeedContext::prepare) under a launcher.
pub struct DataParallel {
    averaging: Averaging,
    /// The trainable variables, by name (the order every rank shares).
    trainable: Vec<(String, Tensor)>,
    /// Their names in the order the gradient sync was given them.
    sync_names: Vec<String>,
    parameter_bytes: i64,
    check_replicas_every: u64,
    steps: Cell<u64>,
    /// ZeRO-3: the optimizer steps counted when the parameters were last gathered for their values.
    gathered_at: Cell<Option<u64>>,
}

/// The pieces of the parameters one rank owns under ZeRO-1 or ZeRO-3 ([`DataParallel::owned_pieces`]).
pub(crate) struct OwnedPieces {
    pub shard: OptimizerShard,
    /// The parameters' names, as indexed by the shard's pieces.
    pub names: Vec<String>,
    /// ZeRO-3: the pieces are the only values of the parameters this rank holds between steps.
    pub parameters_sharded: bool,
}

/// Where and how a [`DataParallel`] averages gradients (the plan's `distributed` settings).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AveragingSettings {
    pub bucket_bytes: i64,
    pub first_bucket_bytes: i64,
    pub all_reduce: AllReduce,
    pub bf16_gradients: bool,
    pub check_replicas_every: u64,
    pub shard_optimizer: bool,
    /// ZeRO-3: the parameters sharded too, gathered in this type where the step uses them.
    pub shard_parameters: Option<Kind>,
    pub overlap_optimizer: bool,
}

impl DataParallel {
    /// Checks agreement, broadcasts rank 0's variables, and sets up the averaging of `vs`'s
    /// trainable variables' gradients.
    pub(crate) fn attach(
        group: &ProcessGroup,
        vs: &VarStore,
        settings: AveragingSettings,
    ) -> Result<Self> {
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        check_same_variables(group, &variables)?;

        // Detached views share the parameters' storage: the broadcast writes the values in place
        // without autograd seeing an in-place update of a leaf.
        let storage: Vec<Tensor> = variables.iter().map(|(_, t)| t.detach()).collect();
        group.broadcast_(&storage, 0)?;

        let trainable = vs.trainable_variables();
        let parameter_bytes = trainable
            .iter()
            .map(|t| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64)
            .sum();
        let names = names_of(&trainable, &variables);
        let named_trainable = variables
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        let sync_names = names.clone();
        let averaging = if settings.all_reduce != AllReduce::Reducer {
            let wire = settings.bf16_gradients.then_some(Kind::BFloat16);
            let sync = if let Some(compute) = settings.shard_parameters {
                GradientSync::sharded_parameters(group, &trainable, &names, compute, wire)?
            } else if settings.shard_optimizer {
                GradientSync::sharded(group, &trainable, settings.bucket_bytes, wire)?
            } else {
                GradientSync::new(group, &trainable, settings.bucket_bytes, wire)?
            };
            Averaging::InStep {
                overlap_optimizer: settings.overlap_optimizer,
                sync,
                overlap: settings.all_reduce == AllReduce::InBackward,
            }
        } else {
            Averaging::Reducer(
                RawReducer::new(
                    group.raw(),
                    &trainable,
                    settings.bucket_bytes,
                    settings.first_bucket_bytes,
                )
                .map_err(failed("gradient reducer"))?,
            )
        };
        Ok(Self {
            averaging,
            trainable: named_trainable,
            sync_names,
            parameter_bytes,
            check_replicas_every: settings.check_replicas_every,
            steps: Cell::new(0),
            gathered_at: Cell::new(None),
        })
    }

    /// Counts an optimizer step that ran (eagerly or by a graph's replay) and, every
    /// `check_replicas_every` of them, [checks the replicas](Self::check_replicas).
    pub(crate) fn after_optimizer_step(&self, group: &ProcessGroup) -> Result<()> {
        let steps = self.steps.get() + 1;
        self.steps.set(steps);
        if self.check_replicas_every == 0 || steps % self.check_replicas_every != 0 {
            return Ok(());
        }
        self.check_replicas(group)
    }

    /// Compares every rank's trainable parameters with rank 0's (a collective: every rank calls
    /// it), through a fingerprint of each tensor: its sum and its 2-norm, compared
    /// bit for bit. Averaged gradients and the same optimizer keep replicas equal to the bit, so
    /// any difference means a rank changed its parameters outside the step (a load, an in-place
    /// edit, a skipped step) or a device computed wrongly; every rank then gets the same error,
    /// naming the ranks and the first parameter that differ.
    pub fn check_replicas(&self, group: &ProcessGroup) -> Result<()> {
        let mine = self.fingerprints(group.collective_device())?;
        let all = group.all_gather(&mine)?.f_to_device(tch::Device::Cpu)?;
        let world = group.world_size();
        let rows: Vec<f64> = Vec::<f64>::try_from(all.f_flatten(0, -1)?)?;
        let per_rank = rows.len() / world.max(1);
        let differs =
            |rank: usize, i: usize| rows[rank * per_rank + i].to_bits() != rows[i].to_bits();
        let bad: Vec<usize> = (1..world)
            .filter(|&r| (0..per_rank).any(|i| differs(r, i)))
            .collect();
        let Some(&first_bad) = bad.first() else {
            return Ok(());
        };
        let drifted = (0..self.trainable.len())
            .filter(|&p| differs(first_bad, 2 * p) || differs(first_bad, 2 * p + 1))
            .collect::<Vec<_>>();
        Err(SpeedkitError::Distributed(format!(
            "replicas diverged after {} optimizer step(s): rank(s) {bad:?} hold other parameter \
             values than rank 0 (rank {first_bad}: {} of {} tensors, first `{}`; this is rank {}). \
             Data parallelism keeps replicas equal only while every rank changes its parameters \
             through the step alone: look for a load, an in-place edit or a skipped step on those \
             ranks, or a faulty device, and resume from a checkpoint",
            self.steps.get(),
            drifted.len(),
            self.trainable.len(),
            drifted
                .first()
                .map_or("?", |&p| self.trainable[p].0.as_str()),
            group.rank(),
        )))
    }

    /// `[sum, 2-norm]` of each trainable tensor as one f64 tensor on `device`. Two reductions per
    /// tensor, in fp32 accumulation, make no copy of a parameter (a cast to f64 would make one the
    /// size of the largest, twice over); ATen's reductions are deterministic, so equal replicas
    /// give equal bits.
    fn fingerprints(&self, device: tch::Device) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let mut parts = Vec::with_capacity(self.trainable.len());
        for (_, t) in &self.trainable {
            parts.push(t.f_sum(Kind::Float)?);
            parts.push(t.f_norm()?.f_to_kind(Kind::Float)?);
        }
        Ok(Tensor::f_stack(&parts, 0)?
            .f_to_kind(Kind::Double)?
            .f_to_device(device)?)
    }

    /// Arms the gradient hooks for the next backward pass; called right before it.
    pub(crate) fn before_backward(&self) -> Result<()> {
        match &self.averaging {
            Averaging::Reducer(reducer) => reducer.prepare().map_err(failed("gradient reducer")),
            Averaging::InStep {
                sync,
                overlap: true,
                ..
            } => sync.overlap_next_backward(),
            Averaging::InStep { overlap: false, .. } => Ok(()),
        }
    }

    /// Finishes the averaging of speedkit's all-reduce; called right after the backward pass.
    /// After the backward pass: every gradient averaged (`join`), or the all-reduces started and
    /// left for [`landing`](Self::landing)'s optimizer step to join bucket by bucket.
    pub(crate) fn after_backward(&self, join: bool) -> Result<()> {
        match &self.averaging {
            Averaging::Reducer(_) => Ok(()),
            Averaging::InStep { sync, .. } if join => sync.run(),
            Averaging::InStep { sync, .. } => sync.start_rest(),
        }
    }

    /// The gradient all-reduce whose buckets an optimizer may step one by one as they land
    /// (`distributed.overlap_optimizer`): speedkit's, of whole or sharded gradients.
    pub(crate) fn landing(&self) -> Option<&GradientSync> {
        match &self.averaging {
            Averaging::InStep {
                sync,
                overlap_optimizer: true,
                ..
            } => Some(sync),
            _ => None,
        }
    }

    /// After a replay of a CUDA graph that captured the step: bounds it by the group's timeout (see
    /// [`GradientSync::watch_replay`]).
    pub(crate) fn after_replay(&self, group: &ProcessGroup) -> Result<()> {
        match &self.averaging {
            Averaging::Reducer(_) => Ok(()),
            Averaging::InStep { sync, .. } => sync.watch_replay(
                group.timeout(),
                &format!("rank {} of {}", group.rank(), group.world_size()),
            ),
        }
    }

    /// Under `distributed.shard_optimizer`, this rank's part of the model for a sharded optimizer
    /// (each call makes a new handle on the same pieces); `None` otherwise.
    pub fn optimizer_shard(&self) -> Result<Option<OptimizerShard>> {
        match &self.averaging {
            Averaging::InStep { sync, .. } if sync.is_sharded() => sync.optimizer_shard().map(Some),
            _ => Ok(None),
        }
    }

    /// Under ZeRO-3 (`distributed.shard_parameters`), the bytes of parameters this rank holds now:
    /// its fp32 part of each unit and the units gathered at the moment (none between steps).
    /// `None` otherwise.
    pub fn resident_parameter_bytes(&self) -> Result<Option<i64>> {
        match &self.averaging {
            Averaging::InStep { sync, .. } => sync.resident_parameter_bytes(),
            Averaging::Reducer(_) => Ok(None),
        }
    }

    /// Under ZeRO-3, every trainable parameter's whole fp32 value, by name (a collective: every
    /// rank calls it, and every rank receives them), for a checkpoint; `None` otherwise, where the
    /// parameters themselves are whole.
    pub fn gather_parameters(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        match &self.averaging {
            Averaging::InStep { sync, .. } if sync.shards_parameters() => {
                let gathered = sync.gather_parameters()?;
                self.gathered_at.set(Some(self.steps.get()));
                Ok(Some(gathered))
            }
            _ => Ok(None),
        }
    }

    /// Under a sharded optimizer (ZeRO-1) or sharded parameters (ZeRO-3), the pieces of the
    /// parameters this rank owns, with the parameters' names; `None` where every rank holds the
    /// whole model.
    pub(crate) fn owned_pieces(&self) -> Result<Option<OwnedPieces>> {
        match &self.averaging {
            Averaging::InStep { sync, .. } if sync.is_sharded() => Ok(Some(OwnedPieces {
                shard: sync.optimizer_shard()?,
                names: self.sync_names.clone(),
                parameters_sharded: sync.shards_parameters(),
            })),
            _ => Ok(None),
        }
    }

    /// Under ZeRO-3, lets every gathered unit go without taking its values back, so that the
    /// step gathers what this rank's fp32 parts hold now (after a checkpoint was read into them).
    pub(crate) fn refresh_parameters(&self) -> Result<()> {
        match &self.averaging {
            Averaging::InStep { sync, .. } if sync.shards_parameters() => sync
                .raw
                .refresh_parameters()
                .map_err(failed("sharded parameters")),
            _ => Ok(()),
        }
    }

    /// Whether gradients are averaged by speedkit's all-reduce, as stream work of the step that a
    /// CUDA graph captures, rather than by the Reducer's hooks.
    pub fn in_step(&self) -> bool {
        matches!(self.averaging, Averaging::InStep { .. })
    }

    /// Number of trainable tensors whose gradients are averaged.
    pub fn parameters(&self) -> usize {
        self.trainable.len()
    }

    /// Their total size in bytes (what each step all-reduces).
    pub fn parameter_bytes(&self) -> i64 {
        self.parameter_bytes
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        let sharded =
            matches!(&self.averaging, Averaging::InStep { sync, .. } if sync.shards_parameters());
        if sharded && self.steps.get() > 0 && self.gathered_at.get() != Some(self.steps.get()) {
            eprintln!(
                "speedkit: the parameters were sharded across the ranks (distributed.shard_parameters) \
                 and are empty now that the context has ended; to keep the trained values, take \
                 them with `ctx.model_state(&vs)` (every rank) before it ends"
            );
        }
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("in_step", &self.in_step())
            .field("parameters", &self.trainable.len())
            .field("parameter_bytes", &self.parameter_bytes)
            .finish()
    }
}

/// The gradient all-reduce as stream work of the step, which a CUDA graph captures with it
/// ([`GraphedStep`](crate::graph::GraphedStep)): NCCL collectives replay with the graph. Each bucket
/// of gradients (at most the bucket size, the last layers' first) lives in one flat buffer in the
/// wire type; it is all-reduced and averaged in place, and the parameters' gradients become views
/// of the result (cast back where the wire type differs), so the gradients take no memory beside
/// their buckets.
///
/// - After [`overlap_next_backward`](Self::overlap_next_backward), the backward pass moves each
///   gradient into its bucket as autograd produces it, and each bucket's all-reduce starts as soon
///   as the bucket is full (in bucket order on every rank), on NCCL's stream beside the rest of the
///   backward pass; [`run`](Self::run) starts what is left and joins them.
/// - Otherwise [`run`](Self::run) copies every gradient into its bucket after the backward pass
///   and all-reduces them bucket by bucket.
///
/// A parameter without a gradient on this rank gets the average of the others'. Each parameter
/// carries a post-accumulate-grad hook while the `GradientSync` lives (one that already has such a
/// hook is an error); dropping it removes them.
///
/// [`DataParallel`] uses it unless the plan says `all_reduce: reducer`; it can also be driven by
/// hand over any [`ProcessGroup`]:
///
/// ```no_run
/// use speedkit::dist::{Backend, GradientSync, LaunchEnv, ProcessGroup};
/// use std::time::Duration;
/// use tch::{nn, Device, Kind};
/// let env = LaunchEnv::from_env()?.expect("run under `speedkit launch` or torchrun");
/// let group = ProcessGroup::init(&env, Backend::Nccl, Duration::from_secs(60))?;
/// let vs = nn::VarStore::new(Device::Cuda(env.local_rank));
/// let layer = nn::linear(vs.root(), 64, 64, Default::default());
/// let sync = GradientSync::new(&group, &vs.trainable_variables(), 25 << 20, Some(Kind::BFloat16))?;
/// sync.overlap_next_backward()?;
/// // ... loss.backward() ...
/// sync.run()?;   // every rank now holds the average of the ranks' gradients
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub struct GradientSync {
    raw: RawGradientSync,
    /// Each bucket's parameters, in the order the buckets start.
    bucket_params: Vec<Vec<Tensor>>,
    buckets: i64,
    wire_bytes: i64,
    /// Sharded: the parameters, in order, and the number of ranks.
    sharded: Option<(Vec<Tensor>, usize)>,
    /// ZeRO-3: the parameters' names, in order.
    sharded_names: Option<Vec<String>>,
}

impl GradientSync {
    /// Buckets of at most `bucket_bytes` over `params`, whose gradients travel in `wire` (`None`:
    /// their own type; `Some(Kind::BFloat16)` halves the bytes of fp32 gradients).
    pub fn new(
        group: &ProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        wire: Option<Kind>,
    ) -> Result<Self> {
        Self::build(group, params, bucket_bytes, wire, RawSharding::None)
    }

    /// As [`new`](Self::new), for ZeRO-1: each bucket is reduce-scattered rather than all-reduced,
    /// so that after a [`run`](Self::run) this rank holds the average of its own part of the
    /// gradients only, as the gradients of the pieces of its
    /// [`optimizer_shard`](Self::optimizer_shard) (the whole parameters' gradients are dropped:
    /// they are this rank's own, not the average). Each bucket's parameters move into one flat
    /// buffer (`set_data`: their values, shapes and autograd identity stay), into which the
    /// updated parameters are all-gathered in place.
    pub fn sharded(
        group: &ProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        wire: Option<Kind>,
    ) -> Result<Self> {
        Self::build(group, params, bucket_bytes, wire, RawSharding::Optimizer)
    }

    /// ZeRO-3, as PyTorch's FSDP2: the parameters are sharded too. Each unit of parameters (the
    /// parameters of one numbered block, `layers.3.…` or `block3.…`, by `names`; those outside any block form
    /// one more unit, kept gathered through the step) becomes one flat buffer in `compute` whose
    /// memory exists only while the step uses it: it is all-gathered where a call first takes one
    /// of its parameters, in the forward and again in the backward pass, the next unit's gather
    /// started ahead, and let go when the step moves on. This rank keeps its part of each unit in
    /// fp32, the pieces of its [`optimizer_shard`](Self::optimizer_shard); the gradients of a
    /// unit are reduce-scattered (in `wire`, fp32 where `None`) as soon as they are all in. The
    /// parameters stay the same tensors, of the same shapes, in `compute`.
    ///
    /// Every rank must then run the same calls on the parameters, in the same order (each gather
    /// is a collective); for their values, use [`gather_parameters`](Self::gather_parameters)
    /// while the sync lives: dropping it leaves the parameters empty (a collective in a drop
    /// would hang a rank that drops it on an error path).
    ///
    /// ```no_run
    /// use speedkit::dist::{Backend, GradientSync, LaunchEnv, ProcessGroup};
    /// use speedkit::optim::{AdamW, AdamWOptimizer};
    /// use std::time::Duration;
    /// use tch::{nn, Device, Kind};
    /// let env = LaunchEnv::from_env()?.expect("run under `speedkit launch` or torchrun");
    /// let group = ProcessGroup::init(&env, Backend::Nccl, Duration::from_secs(60))?;
    /// let vs = nn::VarStore::new(Device::Cuda(env.local_rank));
    /// let _a = nn::linear(vs.root() / "blocks" / 0, 64, 64, Default::default());
    /// let _b = nn::linear(vs.root() / "blocks" / 1, 64, 64, Default::default());
    /// let names = ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]
    ///     .map(String::from);
    /// let sync = GradientSync::sharded_parameters(
    ///     &group, &vs.trainable_variables(), &names, Kind::BFloat16, None)?;
    /// let mut opt = AdamWOptimizer::sharded(sync.optimizer_shard()?, AdamW::default(), true)?;
    /// // ... autocast forward, loss.backward(); sync.run()?; opt.step()?;
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn sharded_parameters(
        group: &ProcessGroup,
        params: &[Tensor],
        names: &[String],
        compute: Kind,
        wire: Option<Kind>,
    ) -> Result<Self> {
        let units = units_of(names);
        let sharding = RawSharding::Parameters {
            units,
            compute: Some(compute),
        };
        let mut sync = Self::build(
            group,
            params,
            i64::MAX,
            Some(wire.unwrap_or(Kind::Float)),
            sharding,
        )?;
        sync.sharded_names = Some(names.to_vec());
        Ok(sync)
    }

    fn build(
        group: &ProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        wire: Option<Kind>,
        sharding: RawSharding,
    ) -> Result<Self> {
        let shard = !matches!(sharding, RawSharding::None);
        let raw = RawGradientSync::new(group.raw(), params, bucket_bytes.max(1), wire, &sharding)
            .map_err(failed("gradient all-reduce"))?;
        let (buckets, wire_bytes) = raw.shape()?;
        let bucket_params = (0..usize::try_from(buckets).unwrap_or(0))
            .map(|k| {
                raw.bucket_members(k)?
                    .into_iter()
                    .map(|i| {
                        params.get(i).map(Tensor::shallow_clone).ok_or_else(|| {
                            SpeedkitError::Distributed(format!(
                                "gradient bucket {k} names parameter {i} of {}",
                                params.len()
                            ))
                        })
                    })
                    .collect()
            })
            .collect::<Result<Vec<Vec<Tensor>>>>()?;
        let sharded = shard.then(|| {
            let params = params.iter().map(Tensor::shallow_clone).collect();
            (params, group.world_size())
        });
        Ok(Self {
            raw,
            bucket_params,
            buckets,
            wire_bytes,
            sharded,
            sharded_names: None,
        })
    }

    /// Whether it was made [`sharded_parameters`](Self::sharded_parameters) (ZeRO-3).
    pub fn shards_parameters(&self) -> bool {
        self.sharded_names.is_some()
    }

    /// Under ZeRO-3, the bytes of parameters this rank holds now (see
    /// [`DataParallel::resident_parameter_bytes`]); `None` otherwise.
    pub fn resident_parameter_bytes(&self) -> Result<Option<i64>> {
        if !self.shards_parameters() {
            return Ok(None);
        }
        self.raw
            .resident_bytes()
            .map(Some)
            .map_err(failed("sharded parameters"))
    }

    /// Under ZeRO-3, every parameter's whole fp32 value, by name (a collective); an error for a
    /// sync that does not shard the parameters.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(names) = &self.sharded_names else {
            return Err(SpeedkitError::Misuse(
                "gather_parameters() needs a GradientSync made by GradientSync::sharded_parameters"
                    .into(),
            ));
        };
        let values = self
            .raw
            .gather_parameters(names.len())
            .map_err(failed("sharded parameters"))?;
        Ok(names.iter().cloned().zip(values).collect())
    }

    /// Whether it was made [`sharded`](Self::sharded).
    pub fn is_sharded(&self) -> bool {
        self.sharded.is_some()
    }

    /// This rank's part of the parameters, for
    /// [`AdamWOptimizer::sharded`](crate::optim::AdamWOptimizer::sharded); an error unless the sync
    /// is [`sharded`](Self::sharded).
    pub fn optimizer_shard(&self) -> Result<OptimizerShard> {
        let Some((params, world_size)) = &self.sharded else {
            return Err(SpeedkitError::Misuse(
                "optimizer_shard() needs a GradientSync made by GradientSync::sharded".into(),
            ));
        };
        OptimizerShard::of(&self.raw, params, *world_size, self.shards_parameters())
    }

    /// Makes the next backward pass start each bucket's all-reduce as soon as the bucket is full;
    /// [`run`](Self::run) after it finishes them.
    pub fn overlap_next_backward(&self) -> Result<()> {
        self.raw.arm().map_err(failed("gradient all-reduce"))
    }

    /// Averages the parameters' gradients across the ranks (a collective: every rank calls it).
    pub fn run(&self) -> Result<()> {
        self.raw.run().map_err(failed("gradient all-reduce"))
    }

    /// [`run`](Self::run)'s first half: starts every all-reduce not started yet, and joins none,
    /// so that work can go between [`join_bucket`](Self::join_bucket)s.
    pub fn start_rest(&self) -> Result<()> {
        self.raw.start().map_err(failed("gradient all-reduce"))
    }

    /// Makes the current stream wait for bucket `k`'s all-reduce and finishes its average: its
    /// parameters' gradients are then the average across the ranks. Nothing for a bucket joined
    /// already.
    pub fn join_bucket(&self, k: usize) -> Result<()> {
        self.raw
            .join(Some(k))
            .map_err(failed("gradient all-reduce"))
    }

    /// [`join_bucket`](Self::join_bucket) for every bucket not joined yet.
    pub fn join_all(&self) -> Result<()> {
        self.raw.join(None).map_err(failed("gradient all-reduce"))
    }

    /// Each bucket's parameters, in the order the buckets start and land (the backward pass's:
    /// the last layers first).
    pub fn bucket_params(&self) -> &[Vec<Tensor>] {
        &self.bucket_params
    }

    /// After each replay of a CUDA graph that captured [`run`](Self::run) (the caller's duty;
    /// [`GraphedStep`](crate::graph::GraphedStep) does it under data parallelism): c10d's watchdog
    /// follows only the collectives it launched, not those a graph replays, so this one does. If
    /// the replay's work is not done within `timeout` (a peer died or hangs), the process prints
    /// why, naming `rank`, aborts NCCL's communicators and exits with status 1, as c10d's watchdog
    /// does for its own collectives.
    pub fn watch_replay(&self, timeout: std::time::Duration, rank: &str) -> Result<()> {
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        self.raw
            .watch_replay(ms, rank)
            .map_err(failed("gradient all-reduce"))
    }

    /// How many all-reduces a run makes.
    pub fn buckets(&self) -> i64 {
        self.buckets
    }

    /// The bytes a run sends from each rank (before the collective's own traffic).
    pub fn wire_bytes(&self) -> i64 {
        self.wire_bytes
    }
}

impl Drop for GradientSync {
    fn drop(&mut self) {
        if self.shards_parameters() {
            // No collective here: a rank that drops the sync on an error path would wait for
            // peers that never come. The parameters become empty, which a later use reports,
            // never views of memory that is gone.
            let _ = self.raw.unshard(false);
        }
    }
}

impl std::fmt::Debug for GradientSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientSync")
            .field("buckets", &self.buckets)
            .field("wire_bytes", &self.wire_bytes)
            .finish()
    }
}

/// A shim error of `what` as a distributed-training error naming it.
fn failed(what: &'static str) -> impl Fn(SpeedkitError) -> SpeedkitError {
    move |e| SpeedkitError::Distributed(format!("{what}: {e}"))
}

/// Each parameter's unit under ZeRO-3, from its name: the name through its first part that holds a
/// number (`layers.3.attn.q.weight` → `layers.3`, `block3.ln1.weight` → `block3`), numbered in
/// order of first appearance; `-1` for names with none (embeddings, a final norm, the head), the
/// unit kept gathered through the step.
fn units_of(names: &[String]) -> Vec<i64> {
    let mut seen: Vec<String> = Vec::new();
    names
        .iter()
        .map(|name| {
            let parts: Vec<&str> = name.split('.').collect();
            let Some(at) = parts
                .iter()
                .position(|p| p.bytes().any(|b| b.is_ascii_digit()))
            else {
                return -1;
            };
            let block = parts[..=at].join(".");
            let id = seen.iter().position(|b| *b == block).unwrap_or_else(|| {
                seen.push(block);
                seen.len() - 1
            });
            id as i64
        })
        .collect()
}

/// The names of `params` among `variables` (the same tensors: same data and shape).
fn names_of(params: &[Tensor], variables: &[(String, Tensor)]) -> Vec<String> {
    params
        .iter()
        .map(|p| {
            variables
                .iter()
                .find(|(_, v)| v.data_ptr() == p.data_ptr() && v.size() == p.size())
                .map_or_else(String::new, |(name, _)| name.clone())
        })
        .collect()
}

/// Ranks whose fingerprint differs from rank 0's.
fn differing_ranks(group: &ProcessGroup, fingerprint_of_mine: u64) -> Result<Vec<usize>> {
    let all = group.all_gather_u64(fingerprint_of_mine)?;
    Ok((0..all.len()).filter(|&r| all[r] != all[0]).collect())
}

/// See [`super::check_same_config`]. Ranks with different configs would plan differently (one
/// with a GradScaler, one without; different buckets) and deadlock or diverge.
pub(super) fn check_same_config(group: &ProcessGroup, config: &SpeedConfig) -> Result<()> {
    let text = serde_json::to_string(config)
        .map_err(|e| SpeedkitError::Distributed(format!("cannot fingerprint the config: {e}")))?;
    let bad = differing_ranks(group, fingerprint(text.as_bytes()))?;
    if bad.is_empty() {
        return Ok(());
    }
    Err(SpeedkitError::Distributed(format!(
        "rank(s) {bad:?} run a different speed config than rank 0 (this is rank {}); every rank \
         must load the same config",
        group.rank()
    )))
}

/// Refuses to train when ranks disagree on the model's variables (names, shapes, dtypes): their
/// gradients could not be averaged meaningfully, and the Reducer would otherwise fail later with a
/// less helpful message, or hang on mismatched bucket sizes.
fn check_same_variables(group: &ProcessGroup, variables: &[(String, Tensor)]) -> Result<()> {
    let mut shapes = String::new();
    for (name, t) in variables {
        shapes.push_str(&format!("{name}:{:?}:{:?};", t.size(), t.kind()));
    }
    let bad_models = differing_ranks(group, fingerprint(shapes.as_bytes()))?;
    if !bad_models.is_empty() {
        return Err(SpeedkitError::Distributed(format!(
            "rank(s) {bad_models:?} have different parameter names, shapes or dtypes than rank 0 \
             (this is rank {}, {} variables); every rank must build the same model",
            group.rank(),
            variables.len()
        )));
    }
    Ok(())
}

/// FNV-1a, 64-bit: the same bytes give the same value in every process and build.
fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
