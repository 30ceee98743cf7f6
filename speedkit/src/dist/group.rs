//! [`ProcessGroup`]: c10d's process group (rendezvous through a `TCPStore` at rank 0, Gloo or
//! NCCL behind it) with the few blocking collectives that training needs outside the backward pass.

use std::time::Duration;

use serde::Serialize;
use tch::{Kind, Tensor};

use super::LaunchEnv;
use crate::error::{Result, SpeedkitError};
use crate::ffi::distributed::{RawBackend, RawProcessGroup, RawReduceOp, Rendezvous};

/// The transport of the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Gloo: CPU tensors.
    Gloo,
    /// NCCL: CUDA tensors, one device per process.
    Nccl,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        })
    }
}

/// Every rank of a run, joined. Collectives block until every rank has joined them; each is
/// bounded by the group's timeout, after which it fails with an error (a rank that died makes
/// Gloo fail at once; NCCL's watchdog ends the process after the timeout).
///
/// ```no_run
/// use speedkit::dist::{Backend, LaunchEnv, ProcessGroup};
/// use std::time::Duration;
/// let env = LaunchEnv::from_env()?.expect("run under `speedkit launch` or torchrun");
/// let group = ProcessGroup::init(&env, Backend::Gloo, Duration::from_secs(60))?;
/// let x = tch::Tensor::from(group.rank() as f32);
/// group.all_reduce_sum_(&x)?;   // 0 + 1 + ... + (world_size - 1) on every rank
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub struct ProcessGroup {
    raw: RawProcessGroup,
    env: LaunchEnv,
    backend: Backend,
    timeout: Duration,
}

impl ProcessGroup {
    /// Rendezvous with every rank of `env` (rank 0 serves the store and waits for the others) and
    /// builds the group. Fails after `timeout` if some rank never arrives.
    pub fn init(env: &LaunchEnv, backend: Backend, timeout: Duration) -> Result<Self> {
        let raw = RawProcessGroup::init(&Rendezvous {
            backend: match backend {
                Backend::Gloo => RawBackend::Gloo,
                Backend::Nccl => RawBackend::Nccl,
            },
            master_addr: &env.master_addr,
            port: env.master_port,
            rank: env.rank,
            world_size: env.world_size,
            local_rank: env.local_rank,
            timeout_ms: i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX),
        })
        .map_err(|e| {
            collective_error(
                e,
                &format!(
                    "rank {} of {} could not join the {backend} group at {}:{} within {} s",
                    env.rank,
                    env.world_size,
                    env.master_addr,
                    env.master_port,
                    timeout.as_secs()
                ),
            )
        })?;
        Ok(Self {
            raw,
            env: env.clone(),
            backend,
            timeout,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// The launch environment the group was built from.
    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// The transport.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The bound on every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Overwrites `tensors` on every rank with rank `root`'s values.
    pub fn broadcast_(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        self.raw
            .broadcast_(tensors, root)
            .map_err(|e| self.failed(e, "broadcast"))
    }

    /// `tensor` ← the sum over ranks, in place.
    pub fn all_reduce_sum_(&self, tensor: &Tensor) -> Result<()> {
        self.raw
            .all_reduce_(tensor, RawReduceOp::Sum)
            .map_err(|e| self.failed(e, "all-reduce (sum)"))
    }

    /// `tensor` ← the element-wise maximum over ranks, in place.
    pub fn all_reduce_max_(&self, tensor: &Tensor) -> Result<()> {
        self.raw
            .all_reduce_(tensor, RawReduceOp::Max)
            .map_err(|e| self.failed(e, "all-reduce (max)"))
    }

    /// Every rank's `tensor`, stacked in rank order along a new first dimension.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.raw
            .all_gather(tensor)
            .map_err(|e| self.failed(e, "all-gather"))
    }

    /// Returns when every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.raw.barrier().map_err(|e| self.failed(e, "barrier"))
    }

    /// Every rank's `value` (rank order), through an all-gather of one int64 each.
    pub fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        let device = self.collective_device();
        // The bits of the u64 travel unchanged through an int64 tensor.
        let mine = Tensor::from_slice(&[value as i64]).to_device(device);
        let all = self.all_gather(&mine)?.f_to_device(tch::Device::Cpu)?;
        let values: Vec<i64> = Vec::<i64>::try_from(all.f_flatten(0, -1)?.f_to_kind(Kind::Int64)?)?;
        Ok(values.into_iter().map(|v| v as u64).collect())
    }

    /// Every rank's `value` (rank order), bit for bit (NaN and infinities included).
    pub fn all_gather_f64(&self, value: f64) -> Result<Vec<f64>> {
        Ok(self
            .all_gather_u64(value.to_bits())?
            .into_iter()
            .map(f64::from_bits)
            .collect())
    }

    /// Where this group's tensors must live: the CPU for Gloo, this rank's GPU for NCCL.
    pub fn collective_device(&self) -> tch::Device {
        match self.backend {
            Backend::Gloo => tch::Device::Cpu,
            Backend::Nccl => tch::Device::Cuda(self.env.local_rank),
        }
    }

    pub(crate) fn raw(&self) -> &RawProcessGroup {
        &self.raw
    }

    /// Which ranks are lost, in a sentence, from their heartbeats in the rendezvous store: those
    /// that stopped beating, or rank 0 when its store does not answer. Takes about 3 s (three
    /// beats), so only failures ask it.
    pub fn lost_ranks(&self) -> String {
        self.raw
            .lost_ranks()
            .unwrap_or_else(|e| format!("the lost ranks could not be told ({e})"))
    }

    fn failed(&self, e: SpeedkitError, what: &str) -> SpeedkitError {
        collective_error(
            e,
            &format!(
                "{what} on rank {} of {} failed (a rank died, hung past the {} s timeout, or \
                 called a different collective; {})",
                self.env.rank,
                self.env.world_size,
                self.timeout.as_secs(),
                self.lost_ranks()
            ),
        )
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("env", &self.env)
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// `context: cause`, keeping libtorch's first line as the cause.
fn collective_error(e: SpeedkitError, context: &str) -> SpeedkitError {
    let cause = match e {
        SpeedkitError::Torch(m) => m,
        other => other.to_string(),
    };
    SpeedkitError::Distributed(format!("{context}: {cause}"))
}
