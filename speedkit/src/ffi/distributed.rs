//! c10d process groups and DDP's Reducer (`shim/distributed.cpp`).

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use tch::{Kind, Tensor};

use super::{c_string, check, handle, handles, owned, raw, raw::distributed as abi, text, Result};
use crate::error::SpeedkitError;

/// Which c10d backend carries the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawBackend {
    Gloo,
    Nccl,
}

/// Reduction of [`RawProcessGroup::all_reduce_`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawReduceOp {
    Sum,
    Max,
}

impl RawReduceOp {
    /// The shim's `sk_reduce_op` code.
    fn code(self) -> c_int {
        match self {
            RawReduceOp::Sum => raw::SK_REDUCE_SUM,
            RawReduceOp::Max => raw::SK_REDUCE_MAX,
        }
    }
}

/// Where and how to rendezvous (see `sk_dist_init`).
pub(crate) struct Rendezvous<'a> {
    pub backend: RawBackend,
    pub master_addr: &'a str,
    pub port: u16,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub timeout_ms: i64,
}

/// A c10d `ProcessGroup` with its `TCPStore`; shut down and freed on drop.
pub(crate) struct RawProcessGroup(*mut c_void);

impl RawProcessGroup {
    pub(crate) fn init(r: &Rendezvous<'_>) -> Result<Self> {
        let addr = c_string(r.master_addr)?;
        let backend = match r.backend {
            RawBackend::Gloo => raw::SK_DIST_GLOO,
            RawBackend::Nccl => raw::SK_DIST_NCCL,
        };
        let mut group = ptr::null_mut();
        // SAFETY: valid C string and out-pointer for the call; `group` receives a Group we own.
        check(unsafe {
            abi::sk_dist_init(
                backend,
                addr.as_ptr(),
                c_int::from(r.port),
                r.rank as c_int,
                r.world_size as c_int,
                r.local_rank as c_int,
                r.timeout_ms,
                &mut group,
            )
        })?;
        Ok(Self(group))
    }

    /// Which ranks are lost, in a sentence (their heartbeats stopped); takes about 3 s.
    pub(crate) fn lost_ranks(&self) -> Result<String> {
        let mut out: *const c_char = ptr::null();
        // SAFETY: live group; valid out-pointer to the shim's per-thread string, copied at once.
        check(unsafe { abi::sk_dist_lost_ranks(self.0, &mut out) })?;
        // SAFETY: NUL-terminated, alive until this thread's next call.
        Ok(unsafe { text(out) }.unwrap_or_default())
    }

    pub(crate) fn broadcast_(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        let t = handles(tensors);
        // SAFETY: live group and handles for the call.
        check(unsafe { abi::sk_dist_broadcast_(self.0, t.as_ptr(), t.len() as i64, root as c_int) })
    }

    pub(crate) fn all_reduce_(&self, tensor: &Tensor, op: RawReduceOp) -> Result<()> {
        // SAFETY: live group and handle for the call.
        check(unsafe { abi::sk_dist_all_reduce_(self.0, handle(tensor), op.code()) })
    }

    pub(crate) fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let mut out = ptr::null_mut();
        // SAFETY: live group and handle; `out` receives a fresh tensor that we wrap and own.
        check(unsafe { abi::sk_dist_all_gather(self.0, handle(tensor), &mut out) })?;
        // SAFETY: a fresh tensor from the shim.
        Ok(unsafe { owned(out) })
    }

    pub(crate) fn barrier(&self) -> Result<()> {
        // SAFETY: live group.
        check(unsafe { abi::sk_dist_barrier(self.0) })
    }
}

impl Drop for RawProcessGroup {
    fn drop(&mut self) {
        // SAFETY: created by sk_dist_init, freed exactly once.
        unsafe { abi::sk_dist_free(self.0) }
    }
}

/// c10d's `Reducer`: bucketed gradient all-reduce from autograd hooks, averaged by the world size.
/// Holds its own reference to the process group, so it may outlive a [`RawProcessGroup`] handle.
pub(crate) struct RawReducer(*mut c_void);

impl RawReducer {
    pub(crate) fn new(
        group: &RawProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        first_bucket_bytes: i64,
    ) -> Result<Self> {
        let p = handles(params);
        let mut reducer = ptr::null_mut();
        // SAFETY: live group and handles; `reducer` receives a Reducer we own.
        check(unsafe {
            abi::sk_reducer_new(
                group.0,
                p.as_ptr(),
                p.len() as i64,
                bucket_bytes,
                first_bucket_bytes,
                &mut reducer,
            )
        })?;
        Ok(Self(reducer))
    }

    /// Arms the hooks for the next backward pass.
    pub(crate) fn prepare(&self) -> Result<()> {
        // SAFETY: live reducer.
        check(unsafe { abi::sk_reducer_prepare(self.0) })
    }
}

impl Drop for RawReducer {
    fn drop(&mut self) {
        // SAFETY: created by sk_reducer_new, freed exactly once.
        unsafe { abi::sk_reducer_free(self.0) }
    }
}

/// The gradient all-reduce as ordinary stream work (capturable in a CUDA graph): flat buckets in a
/// wire type, filled during the backward pass where armed, averaged in place; afterwards the
/// gradients are views of them. Holds its own reference to the process group and a hook on each
/// parameter, removed when dropped.
pub(crate) struct RawGradientSync(*mut c_void);

impl RawGradientSync {
    /// Buckets of at most `bucket_bytes` over `params` (the last ones first), sent in `wire`
    /// (`None`: the parameters' own type); sharded as `shard` says.
    pub(crate) fn new(
        group: &RawProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        wire: Option<Kind>,
        shard: &RawSharding,
    ) -> Result<Self> {
        let p = handles(params);
        let code = |kind: Option<Kind>| match kind {
            Some(kind) => super::scalar_type_code(kind),
            None => Ok(-1),
        };
        let (level, units, compute) = match shard {
            RawSharding::None => (0, None, None),
            RawSharding::Optimizer => (1, None, None),
            RawSharding::Parameters { units, compute } => (2, Some(units.as_slice()), *compute),
        };
        if units.is_some_and(|u| u.len() != params.len()) {
            return Err(SpeedkitError::Misuse(
                "one unit per parameter is needed to shard the parameters".into(),
            ));
        }
        let mut sync = ptr::null_mut();
        // SAFETY: live group and handles; `units`, where given, holds one entry per parameter;
        // `sync` receives an object we own.
        check(unsafe {
            abi::sk_grad_sync_new(
                group.0,
                p.as_ptr(),
                p.len() as i64,
                units.map_or(ptr::null(), <[i64]>::as_ptr),
                bucket_bytes,
                code(wire)?,
                level,
                code(compute)?,
                &mut sync,
            )
        })?;
        Ok(Self(sync))
    }

    /// Before a backward pass: bucket its gradients as they come and start each full bucket.
    pub(crate) fn arm(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_arm(self.0) })
    }

    /// Averages the gradients across the ranks, on the current stream.
    pub(crate) fn run(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_run(self.0) })
    }

    /// [`run`](Self::run)'s first half: starts the all-reduces not started, joins none.
    pub(crate) fn start(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_start(self.0) })
    }

    /// Joins bucket `bucket` into the current stream (every bucket where `None`), its average
    /// finished; a bucket joined already is left as it is.
    pub(crate) fn join(&self, bucket: Option<usize>) -> Result<()> {
        let bucket = bucket.map_or(-1, |b| b as i64);
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_join(self.0, bucket) })
    }

    /// The parameters of bucket `bucket`, as indices into the list the sync was made over.
    pub(crate) fn bucket_members(&self, bucket: usize) -> Result<Vec<usize>> {
        let mut count = 0i64;
        // SAFETY: a live object; capacity 0 writes nothing but the count.
        check(unsafe {
            abi::sk_grad_sync_bucket_members(self.0, bucket as i64, ptr::null_mut(), 0, &mut count)
        })?;
        let mut members = vec![0i64; usize::try_from(count).unwrap_or(0)];
        // SAFETY: the buffer holds `members.len()` entries, the capacity passed.
        check(unsafe {
            abi::sk_grad_sync_bucket_members(
                self.0,
                bucket as i64,
                members.as_mut_ptr(),
                members.len() as i64,
                &mut count,
            )
        })?;
        Ok(members
            .into_iter()
            .map(|i| usize::try_from(i).unwrap_or(0))
            .collect())
    }

    /// After a graph replay: the process ends, naming `rank`, if the replay is not done within
    /// `timeout_ms`.
    pub(crate) fn watch_replay(&self, timeout_ms: i64, rank: &str) -> Result<()> {
        let rank = c_string(rank)?;
        // SAFETY: live object and string for the call (the shim copies the string).
        check(unsafe { abi::sk_grad_sync_watch_replay(self.0, timeout_ms, rank.as_ptr()) })
    }

    /// The number of buckets and the bytes a run sends.
    pub(crate) fn shape(&self) -> Result<(i64, i64)> {
        let (mut buckets, mut bytes) = (0, 0);
        // SAFETY: live object; two out-parameters.
        check(unsafe { abi::sk_grad_sync_shape(self.0, &mut buckets, &mut bytes) })?;
        Ok((buckets, bytes))
    }
}

impl RawGradientSync {
    /// ZeRO-3: the bytes of parameters this rank holds now.
    pub(crate) fn resident_bytes(&self) -> Result<i64> {
        let mut bytes = 0;
        // SAFETY: live object; one out-parameter.
        check(unsafe { abi::sk_grad_sync_resident_bytes(self.0, &mut bytes) })?;
        Ok(bytes)
    }

    /// ZeRO-3: every parameter's whole fp32 value (a collective), one per parameter of the `n`
    /// the sync was made over, in that order.
    pub(crate) fn gather_parameters(&self, n: usize) -> Result<Vec<Tensor>> {
        let mut out = vec![ptr::null_mut(); n];
        // SAFETY: a live object; the buffer holds `n` entries, the capacity passed.
        check(unsafe { abi::sk_grad_sync_gather_parameters(self.0, out.as_mut_ptr(), n as i64) })?;
        if out.iter().any(|t| t.is_null()) {
            return Err(SpeedkitError::Distributed(
                "the gathered parameters miss one".into(),
            ));
        }
        // SAFETY: fresh tensors from the shim, one per entry.
        Ok(out.into_iter().map(|t| unsafe { owned(t) }).collect())
    }

    /// ZeRO-3: lets every gathered unit go, its values not taken back: the next use gathers what
    /// the fp32 parts hold now.
    pub(crate) fn refresh_parameters(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_refresh_parameters(self.0) })
    }

    /// ZeRO-3: ends the sharding (`gather`: the parameters' whole values back, a collective;
    /// otherwise empty parameters).
    pub(crate) fn unshard(&self, gather: bool) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_grad_sync_unshard(self.0, c_int::from(gather)) })
    }
}

/// How a [`RawGradientSync`] shards: not at all (all-reduced), the optimizer's state (ZeRO-1:
/// reduce-scattered), or the parameters too (ZeRO-3: one unit id per parameter, negative for the
/// unit kept gathered through the step, and the type the parameters compute in).
pub(crate) enum RawSharding {
    None,
    Optimizer,
    Parameters {
        units: Vec<i64>,
        compute: Option<Kind>,
    },
}

impl Drop for RawGradientSync {
    fn drop(&mut self) {
        // SAFETY: created by sk_grad_sync_new, freed exactly once.
        unsafe { abi::sk_grad_sync_free(self.0) }
    }
}

/// The optimizer's side of a sharded [`RawGradientSync`]: this rank's pieces of the parameters and
/// the all-gather of their updates (see `sk_optimizer_shard_new`).
pub(crate) struct RawOptimizerShard(*mut c_void);

// SAFETY: the shim object has no thread affinity (c10d collectives may be issued from any thread);
// `&mut`/owned access through the optimizer that holds it keeps its use to one thread at a time.
unsafe impl Send for RawOptimizerShard {}

impl RawOptimizerShard {
    pub(crate) fn new(sync: &RawGradientSync) -> Result<Self> {
        let mut shard = ptr::null_mut();
        // SAFETY: a live sync; `shard` receives an object we own.
        check(unsafe { abi::sk_optimizer_shard_new(sync.0, &mut shard) })?;
        Ok(Self(shard))
    }

    /// This rank's pieces, each with the index of its parameter in the list the sync was made over
    /// and the place of its first element in that parameter's flattened values.
    pub(crate) fn pieces(&self) -> Result<Vec<(Tensor, usize, i64)>> {
        let mut count = 0i64;
        // SAFETY: a live object; capacity 0 writes nothing but the count.
        check(unsafe {
            abi::sk_optimizer_shard_pieces(
                self.0,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
                0,
                &mut count,
            )
        })?;
        let n = usize::try_from(count).unwrap_or(0);
        let mut pieces = vec![ptr::null_mut(); n];
        let mut params = vec![0i64; n];
        let mut offsets = vec![0i64; n];
        // SAFETY: the three buffers hold `n` entries, the capacity passed.
        check(unsafe {
            abi::sk_optimizer_shard_pieces(
                self.0,
                pieces.as_mut_ptr(),
                params.as_mut_ptr(),
                offsets.as_mut_ptr(),
                n as i64,
                &mut count,
            )
        })?;
        Ok(pieces
            .into_iter()
            .zip(params)
            .zip(offsets)
            // SAFETY: fresh tensors from the shim, one per entry.
            .map(|((t, p), o)| (unsafe { owned(t) }, usize::try_from(p).unwrap_or(0), o))
            .collect())
    }

    /// All-gathers every rank's updated pieces into the parameters.
    pub(crate) fn gather(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_optimizer_shard_gather(self.0) })
    }
    /// Starts the all-gather of bucket `bucket`'s parameters alone (see
    /// [`finish_gather`](Self::finish_gather)).
    pub(crate) fn gather_bucket(&self, bucket: usize) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_optimizer_shard_gather_bucket(self.0, bucket as i64) })
    }

    /// Joins the all-gathers [`gather_bucket`](Self::gather_bucket) started and refreshes the
    /// parameters' autocast copies.
    pub(crate) fn finish_gather(&self) -> Result<()> {
        // SAFETY: live object.
        check(unsafe { abi::sk_optimizer_shard_finish_gather(self.0) })
    }

    /// `tensor` reduced in place across the ranks.
    pub(crate) fn all_reduce_(&self, tensor: &Tensor, op: RawReduceOp) -> Result<()> {
        // SAFETY: live object and handle for the call.
        check(unsafe { abi::sk_optimizer_shard_all_reduce_(self.0, handle(tensor), op.code()) })
    }
}

impl Drop for RawOptimizerShard {
    fn drop(&mut self) {
        // SAFETY: created by sk_optimizer_shard_new, freed exactly once.
        unsafe { abi::sk_optimizer_shard_free(self.0) }
    }
}
