//! `distributed:`, data-parallel training over several processes.

use serde::{Deserialize, Serialize};

use super::AutoBool;

/// Data-parallel training: one process per device, gradients averaged across processes.
///
/// ```
/// use speedkit_config::{DistributedBackend, SpeedConfig};
/// let cfg = SpeedConfig::from_yaml_str("distributed: {backend: gloo, bucket_mb: 10}\n")?;
/// assert_eq!(cfg.distributed.backend, DistributedBackend::Gloo);
/// assert_eq!(cfg.distributed.timeout_s, 300);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of distributed settings"
)]
pub struct DistributedConfig {
    /// `auto`: on when the environment says there are several processes (`WORLD_SIZE` > 1), with
    /// NCCL on CUDA and Gloo on the CPU; `nccl`/`gloo` name the backend; `off` trains each process
    /// alone even under a launcher.
    pub backend: DistributedBackend,
    /// Gradient bucket size in MiB for the overlapped all-reduce (PyTorch DDP's default: 25).
    pub bucket_mb: u32,
    /// Size of the first bucket in MiB, the last layers' gradients, sent as early as possible
    /// (PyTorch DDP's default: 1).
    pub first_bucket_mb: u32,
    /// Seconds any rendezvous, store access or collective may take before every rank fails with an
    /// error (a dead or hung rank is reported, never waited on forever).
    pub timeout_s: u32,
    /// How gradients are all-reduced: `auto` (`in_backward` where the step runs as a CUDA graph,
    /// `reducer` otherwise), `reducer`, `in_backward` or `after_backward`.
    pub all_reduce: AllReduce,
    /// The type gradients travel in: `none` (their own) or `bf16` (half the bytes of fp32
    /// gradients; each rank's gradient rounded to bf16 before the average).
    pub compress: GradientCompression,
    /// Every this many optimizer steps, the ranks compare fingerprints of their parameters and
    /// fail together, naming the ranks and the first parameter that differ, if a replica has
    /// drifted from rank 0's (`0`: never). Costs one small all-gather and a host sync per check.
    pub check_replicas_every: u32,
    /// ZeRO-1: each rank keeps the AdamW state of its own 1/N of the parameters, not of all of
    /// them. Gradients are reduce-scattered (each rank receives the average of its part only) and
    /// the updated parameters all-gathered, which together send what one all-reduce sends. Needs
    /// speedkit's all-reduce (`all_reduce` other than `reducer`).
    pub shard_optimizer: bool,
    /// ZeRO-3, as PyTorch's FSDP2: the parameters and gradients are sharded too. Each numbered
    /// block of the model (`layers.3.…`, `block3.…`) is one unit, all-gathered where the step
    /// first uses it (in the forward pass, and again in the backward pass), the next unit's gather
    /// started ahead, and let go when the step moves on; the parameters outside the blocks are one
    /// more unit, kept through the step. Each rank keeps its part of every unit in fp32 with its
    /// AdamW state; the parameters compute in bf16 under bf16 precision. Implies
    /// `shard_optimizer`; needs speedkit's all-reduce. The step runs eagerly for now, on ATen's
    /// kernels (without speedkit's kernels, overrides and FP8). `auto` (the default) shards where
    /// the plan knows the model (`apply_speedups`, `SpeedContext::for_model`) and its fp32
    /// weights, gradients and AdamW state (16 bytes a parameter) would take more than 70% of the
    /// GPU's memory; the audit says why either way.
    pub shard_parameters: AutoBool,
    /// speedkit's AdamW steps each bucket's parameters as soon as that bucket's average lands,
    /// beside the all-reduces still running, instead of after the last one (sharded: this rank's
    /// pieces, each bucket's all-gather started right after). Applies to speedkit's all-reduce
    /// (not `reducer`) without a GradScaler, which needs every gradient before any step.
    pub overlap_optimizer: bool,
}

/// How gradients are all-reduced (`distributed.all_reduce`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AllReduce {
    /// `in_backward` where the step runs as a CUDA graph, `reducer` otherwise.
    #[default]
    Auto,
    /// c10d's `Reducer`, as PyTorch's `DistributedDataParallel`: bucket by bucket during the
    /// backward pass, from autograd hooks. A CUDA graph cannot capture it.
    Reducer,
    /// speedkit's: each bucket's all-reduce starts during the backward pass as soon as its
    /// gradients are in, on NCCL's stream, overlapping the rest of the backward pass, and is joined
    /// before the optimizer; a CUDA graph captures it with the step.
    InBackward,
    /// speedkit's, after the backward pass, bucket by bucket: no overlap; captured with the step.
    AfterBackward,
}

spelled_enum!(AllReduce, "distributed.all_reduce", [
    Auto => "auto", Reducer => "reducer", InBackward => "in_backward",
    AfterBackward => "after_backward",
]);

/// The type gradients travel in (`distributed.compress`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GradientCompression {
    /// Their own type.
    #[default]
    None,
    /// bf16 (PyTorch DDP's `bf16_compress_hook`).
    Bf16,
}

spelled_enum!(GradientCompression, "distributed.compress", [None => "none", Bf16 => "bf16"]);

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            backend: DistributedBackend::Auto,
            bucket_mb: 25,
            first_bucket_mb: 1,
            timeout_s: 300,
            all_reduce: AllReduce::Auto,
            compress: GradientCompression::None,
            check_replicas_every: 1000,
            shard_optimizer: false,
            shard_parameters: AutoBool::Auto,
            overlap_optimizer: true,
        }
    }
}

/// Which c10d backend carries the collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DistributedBackend {
    /// On when `WORLD_SIZE` > 1: NCCL on CUDA, Gloo on the CPU.
    #[default]
    Auto,
    /// NVIDIA's collectives (CUDA tensors).
    Nccl,
    /// Gloo (CPU tensors).
    Gloo,
    /// No data parallelism, whatever the environment says.
    Off,
}

spelled_enum!(DistributedBackend, "distributed.backend", [
    Auto => "auto", Nccl => "nccl", Gloo => "gloo", Off => "off",
]);
