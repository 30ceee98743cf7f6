//! Data-parallel training over the processes of a launch: whether this process joins a group, the
//! transport, how gradients are all-reduced, whether the optimizer state is sharded, and what that
//! leaves of the step's CUDA graph.

use tch::Device;

use super::decisions::Decisions;
use super::{DistributedSettings, Fp8Plan, ResolvedPrecision};
use crate::config::{
    AllReduce, AutoBool, DistributedBackend, DistributedConfig, GradientCompression, SpeedConfig,
};
use crate::dist::{Backend, LaunchEnv};
use crate::error::{Result, SpeedkitError};
use crate::overrides::Override;

/// The launch this process takes part in, if any.
pub(super) fn group_launch<'l>(
    cfg: &DistributedConfig,
    launch: Option<&'l LaunchEnv>,
) -> Option<&'l LaunchEnv> {
    // A launch of one process joins a group of one only where the backend is named: the
    // data-parallel step on one device, its cost measured alone.
    let named_backend = matches!(
        cfg.backend,
        DistributedBackend::Nccl | DistributedBackend::Gloo
    );
    launch.filter(|env| env.world_size > 1 || named_backend)
}

/// This process's place when it trains data-parallel, which gives it a GPU of its own; `None`
/// when it trains alone (also when a launch's processes are told to, each on the usual device).
pub(super) fn data_parallel_rank<'l>(
    cfg: &DistributedConfig,
    launch: Option<&'l LaunchEnv>,
) -> Option<&'l LaunchEnv> {
    launch.filter(|_| cfg.backend != DistributedBackend::Off)
}

/// Data parallelism for a process of `launch` (from [`group_launch`]), given whether the step is
/// planned as a CUDA graph.
pub(super) fn resolve_distributed(
    config: &SpeedConfig,
    device: Device,
    launch: Option<&LaunchEnv>,
    precision: ResolvedPrecision,
    graphs: bool,
    fit: ModelFit,
    d: &mut Decisions,
) -> Result<Option<DistributedSettings>> {
    let Some(env) = launch else {
        let why = if config.distributed.backend == DistributedBackend::Auto {
            "a single process (WORLD_SIZE unset or 1)"
        } else {
            "a single process (WORLD_SIZE unset or 1): nothing to communicate"
        };
        d.push("distributed", "off", why);
        return Ok(None);
    };
    let Some((backend, why)) = resolve_backend(config.distributed.backend, device, env, d)? else {
        return Ok(None);
    };
    let cfg = &config.distributed;
    d.push(
        "distributed",
        backend.to_string(),
        format!(
            "rank {} of {}: {why}; parameters broadcast from rank 0",
            env.rank, env.world_size
        ),
    );
    let shard_parameters = resolve_shard_parameters(config, env.world_size, precision, fit, d)?;
    let all_reduce = resolve_all_reduce(cfg, graphs, shard_parameters.is_some(), d)?;
    let shard_optimizer =
        shard_parameters.is_some() || resolve_shard_optimizer(cfg, env.world_size, d);
    let overlap_optimizer = resolve_overlap_optimizer(cfg, all_reduce, d);
    let check_replicas_every = if shard_parameters.is_some() {
        d.push(
            "check_replicas_every",
            "0",
            "the parameters are sharded: each rank holds its own part, there are no replicas to \
             compare",
        );
        0
    } else {
        u64::from(cfg.check_replicas_every)
    };
    const MIB: i64 = 1 << 20;
    Ok(Some(DistributedSettings {
        backend,
        env: env.clone(),
        bucket_bytes: i64::from(cfg.bucket_mb) * MIB,
        first_bucket_bytes: i64::from(cfg.first_bucket_mb) * MIB,
        timeout_s: u64::from(cfg.timeout_s),
        all_reduce,
        bf16_gradients: cfg.compress == GradientCompression::Bf16,
        check_replicas_every,
        shard_optimizer,
        shard_parameters,
        overlap_optimizer,
    }))
}

/// What `distributed.shard_parameters: auto` decides from: the model's trainable parameters and
/// the device's memory, where the plan knows them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ModelFit {
    pub parameters: Option<u64>,
    pub device_memory: Option<u64>,
}

/// Bytes a parameter takes in mixed-precision training with AdamW, sharded or not: its fp32
/// value, its gradient, and AdamW's two moments.
const STATE_BYTES_PER_PARAMETER: u64 = 16;

/// `auto` shards the parameters where their state would take more than this share of the
/// device's memory: the rest is for the activations, the gathered blocks and the allocator.
const SHARE_OF_DEVICE_FOR_STATE: f64 = 0.7;

/// Under `distributed.shard_parameters` (ZeRO-3), the type the gathered parameters compute in:
/// bf16 under bf16 precision, as FSDP2's mixed-precision policy, else fp32. `auto` decides from
/// `fit` ([`auto_shards`]).
fn resolve_shard_parameters(
    config: &SpeedConfig,
    world_size: usize,
    precision: ResolvedPrecision,
    fit: ModelFit,
    d: &mut Decisions,
) -> Result<Option<tch::Kind>> {
    let why = match config.distributed.shard_parameters {
        AutoBool::Off => return Ok(None),
        AutoBool::Auto => match auto_shards(config, world_size, precision, fit) {
            Ok(why) => why,
            Err(why) => {
                d.push("parameters", "whole", why);
                return Ok(None);
            }
        },
        AutoBool::On => format!(
            "set in the config (ZeRO-3): each of the {world_size} ranks keeps 1/{world_size} of \
             every block's parameters in fp32 with their AdamW state"
        ),
    };
    let kind = match precision {
        ResolvedPrecision::Bf16 => tch::Kind::BFloat16,
        ResolvedPrecision::Fp32 => tch::Kind::Float,
        ResolvedPrecision::Fp16 => {
            return Err(SpeedkitError::Unsupported(
                "distributed.shard_parameters computes in bf16 or fp32, and the precision is \
                 fp16 (its GradScaler would need the whole gradient on every rank); set \
                 precision to bf16 or fp32, or shard_parameters to false (shard_optimizer \
                 shards the optimizer state with fp16)"
                    .into(),
            ))
        }
    };
    d.push(
        "parameters",
        "sharded",
        format!(
            "{why}; a block is all-gathered in {} where the step first uses it, forward and \
             backward, the next one's gather started ahead, and let go after; gradients \
             reduce-scattered per block",
            if kind == tch::Kind::BFloat16 {
                "bf16"
            } else {
                "fp32"
            }
        ),
    );
    Ok(Some(kind))
}

/// Why `shard_parameters: auto` shards the parameters (`Ok`) or keeps them whole (`Err`).
fn auto_shards(
    config: &SpeedConfig,
    world_size: usize,
    precision: ResolvedPrecision,
    fit: ModelFit,
) -> std::result::Result<String, String> {
    let auto = "distributed.shard_parameters: auto";
    let Some(parameters) = fit.parameters else {
        return Err(format!(
            "{auto}, and the plan does not know the model (apply_speedups and \
             SpeedContext::for_model give it its size)"
        ));
    };
    let Some(memory) = fit.device_memory else {
        return Err(format!("{auto}: no GPU memory to fit"));
    };
    if precision == ResolvedPrecision::Fp16 {
        return Err(format!(
            "{auto}: fp16's GradScaler needs every rank's whole gradient"
        ));
    }
    if config.distributed.all_reduce == AllReduce::Reducer {
        return Err(format!(
            "{auto}: all_reduce is reducer, which all-reduces whole gradients"
        ));
    }
    if config.compile.enabled == AutoBool::On {
        return Err(format!(
            "{auto}: compile.enabled is true, and the sharded step runs eagerly for now"
        ));
    }
    const GIB: f64 = (1u64 << 30) as f64;
    let state = (parameters * STATE_BYTES_PER_PARAMETER) as f64;
    let share = SHARE_OF_DEVICE_FOR_STATE * 100.0;
    let sizes = format!(
        "the model's {:.2} B parameters take {:.1} GiB in fp32 with their gradients and AdamW \
         state, {share:.0}% of the GPU's {:.1} GiB is {:.1}",
        parameters as f64 / 1e9,
        state / GIB,
        memory as f64 / GIB,
        memory as f64 * SHARE_OF_DEVICE_FOR_STATE / GIB
    );
    if state <= memory as f64 * SHARE_OF_DEVICE_FOR_STATE {
        return Err(format!("{auto}: {sizes}; they fit whole"));
    }
    Ok(format!(
        "{auto}: {sizes}; each of the {world_size} ranks keeps 1/{world_size} of every block's \
         parameters in fp32 with their AdamW state ({:.1} GiB)",
        state / world_size as f64 / GIB
    ))
}

/// What ZeRO-3 leaves of the rest of the plan: the step runs eagerly, on ATen's kernels: speedkit's
/// own kernels, its overrides and FP8 read the parameters outside the calls that gather them (an
/// error where the config asked for the step's CUDA graph).
pub(super) fn resolve_beside_sharded_parameters(
    config: &SpeedConfig,
    sharded: bool,
    planned: BesideSharding,
    d: &mut Decisions,
) -> Result<BesideSharding> {
    if !sharded {
        return Ok(planned);
    }
    if config.compile.enabled == AutoBool::On {
        return Err(SpeedkitError::Unsupported(
            "compile.enabled: true cannot be combined with distributed.shard_parameters yet: \
             the sharded parameters are gathered by the eager step; set compile.enabled to auto \
             or false, or shard_parameters to false"
                .into(),
        ));
    }
    let why = "distributed.shard_parameters: the sharded parameters are gathered by the eager \
               step, which runs ATen's kernels on them";
    for (key, on) in [
        ("compile", planned.graphs),
        ("kernels", planned.kernels),
        ("overrides", !planned.overrides.is_empty()),
        ("fp8", planned.fp8.is_some()),
    ] {
        if on {
            d.push(key, "off", why);
        }
    }
    Ok(BesideSharding {
        graphs: false,
        kernels: false,
        overrides: Vec::new(),
        fp8: None,
    })
}

/// The CUDA caching allocator's expandable segments under ZeRO-3: each unit's gathered parameters
/// and gradient buffers are large blocks made and freed many times a step beside the activations,
/// which fragment fixed segments until an allocation no longer fits (PyTorch's advice for FSDP).
pub(super) fn resolve_expandable_segments(
    sharded: bool,
    device: Device,
    d: &mut Decisions,
) -> Option<bool> {
    if !sharded || !device.is_cuda() {
        return None;
    }
    d.push(
        "cuda.expandable_segments",
        "true",
        "distributed.shard_parameters: the gathered blocks and their gradient buffers come and go \
         in large allocations every step; segments that grow in place keep them from fragmenting \
         memory",
    );
    Some(true)
}

/// The parts of a plan that ZeRO-3 turns off (see [`resolve_beside_sharded_parameters`]).
pub(super) struct BesideSharding {
    pub graphs: bool,
    pub kernels: bool,
    pub overrides: Vec<Override>,
    pub fp8: Option<Fp8Plan>,
}

/// The transport and why, or `None` where the config keeps the processes apart (recorded here):
/// speedkit drives NCCL for CUDA tensors and Gloo for CPU ones, nothing else.
fn resolve_backend(
    choice: DistributedBackend,
    device: Device,
    env: &LaunchEnv,
    d: &mut Decisions,
) -> Result<Option<(Backend, &'static str)>> {
    let on_cuda = device.is_cuda();
    Ok(Some(match choice {
        DistributedBackend::Off => {
            d.push(
                "distributed",
                "off",
                format!(
                    "set in the config: each of the {} processes trains alone",
                    env.world_size
                ),
            );
            return Ok(None);
        }
        DistributedBackend::Auto if on_cuda => (
            Backend::Nccl,
            "CUDA tensors: NCCL, its stream at high priority so that collectives beside the \
             backward pass and the optimizer step are scheduled ahead of compute",
        ),
        DistributedBackend::Auto => (Backend::Gloo, "CPU tensors: Gloo"),
        DistributedBackend::Nccl if !on_cuda => {
            return Err(SpeedkitError::Unsupported(
                "distributed.backend is nccl, which needs CUDA tensors, but this run is on the \
                 CPU; set distributed.backend to auto (Gloo on the CPU) or gloo"
                    .into(),
            ))
        }
        DistributedBackend::Nccl => (
            Backend::Nccl,
            "set in the config; its stream at high priority so that collectives beside the \
             backward pass and the optimizer step are scheduled ahead of compute",
        ),
        DistributedBackend::Gloo if on_cuda => {
            return Err(SpeedkitError::Unsupported(
                "distributed.backend is gloo, but this run is on CUDA, where speedkit drives \
                 NCCL; set distributed.backend to auto (or nccl), or `device: cpu`"
                    .into(),
            ))
        }
        DistributedBackend::Gloo => (Backend::Gloo, "set in the config"),
    }))
}

/// Whether the optimizer state is sharded across the ranks (ZeRO-1), and why.
fn resolve_shard_optimizer(cfg: &DistributedConfig, world_size: usize, d: &mut Decisions) -> bool {
    if cfg.shard_optimizer {
        d.push(
            "optimizer_state",
            "sharded",
            format!(
                "set in the config (ZeRO-1): each of the {world_size} ranks keeps the AdamW state \
                 of 1/{world_size} of the parameters; gradients reduce-scattered, updated \
                 parameters all-gathered"
            ),
        );
    }
    cfg.shard_optimizer
}

/// Whether speedkit's AdamW steps each bucket as soon as its average lands, and why: only
/// speedkit's all-reduce lets it wait for one bucket at a time.
fn resolve_overlap_optimizer(
    cfg: &DistributedConfig,
    all_reduce: AllReduce,
    d: &mut Decisions,
) -> bool {
    let (on, why) = if !cfg.overlap_optimizer {
        (
            false,
            "set in the config: the optimizer steps after the last bucket's all-reduce",
        )
    } else if all_reduce == AllReduce::Reducer {
        (
            false,
            "c10d's Reducer joins every bucket before the optimizer step",
        )
    } else if cfg.shard_optimizer {
        (
            true,
            "speedkit's AdamW updates this rank's pieces of each bucket as soon as that bucket's \
             reduce-scatter lands and starts its all-gather right after, beside the update of the \
             next (under a GradScaler, which needs every gradient first, after the last one)",
        )
    } else {
        (
            true,
            "speedkit's AdamW updates each bucket's parameters as soon as that bucket's average \
             lands, beside the all-reduces still running (under a GradScaler, which needs every \
             gradient first, and for other optimizers, after the last one)",
        )
    };
    d.push(
        "optimizer_step",
        if on {
            "as buckets land"
        } else {
            "after all buckets"
        },
        why,
    );
    on
}

/// How gradients are all-reduced, given whether the step is planned as a CUDA graph: speedkit's
/// in-step all-reduce where the graph must capture it (or bf16 gradients or a sharded optimizer
/// ask for it), c10d's Reducer for an eager step.
fn resolve_all_reduce(
    cfg: &DistributedConfig,
    graphs: bool,
    sharded: bool,
    d: &mut Decisions,
) -> Result<AllReduce> {
    let bf16 = cfg.compress == GradientCompression::Bf16;
    let wire = match (bf16, sharded) {
        (true, _) => "sent in bf16",
        (false, true) => "sent in fp32",
        (false, false) => "sent in their own type",
    };
    let buckets = cfg.bucket_mb;
    let (path, reason) = match cfg.all_reduce {
        AllReduce::Reducer if sharded || cfg.shard_optimizer => {
            let setting = if sharded {
                "shard_parameters"
            } else {
                "shard_optimizer"
            };
            return Err(SpeedkitError::Unsupported(format!(
                "distributed.{setting} reduce-scatters gradients through speedkit's all-reduce, \
                 and distributed.all_reduce is reducer (c10d's Reducer all-reduces whole \
                 gradients); set all_reduce to auto, in_backward or after_backward, or {setting} \
                 to false"
            )));
        }
        AllReduce::Reducer if bf16 => {
            return Err(SpeedkitError::Unsupported(
                "distributed.compress: bf16 is done by speedkit's all-reduce, and \
                 distributed.all_reduce is reducer; set all_reduce to auto, in_backward or \
                 after_backward, or compress to none"
                    .into(),
            ))
        }
        AllReduce::Reducer => (
            AllReduce::Reducer,
            format!(
                "set in the config: c10d's Reducer, {buckets} MiB buckets during the backward pass"
            ),
        ),
        AllReduce::InBackward | AllReduce::AfterBackward => (
            cfg.all_reduce,
            format!("set in the config: {buckets} MiB buckets {wire}"),
        ),
        AllReduce::Auto if graphs || bf16 || cfg.shard_optimizer || sharded => (
            AllReduce::InBackward,
            in_step_reason(cfg, graphs, bf16, sharded, wire),
        ),
        AllReduce::Auto => (
            AllReduce::Reducer,
            format!(
                "the step runs eagerly: c10d's Reducer, {buckets} MiB buckets during the backward \
                 pass"
            ),
        ),
    };
    d.push("all_reduce", path.as_str(), reason);
    Ok(path)
}

/// Why `auto` picks speedkit's in-step all-reduce: the first of the graph, bf16 gradients and a
/// sharded optimizer that needs it.
fn in_step_reason(
    cfg: &DistributedConfig,
    graphs: bool,
    bf16: bool,
    sharded: bool,
    wire: &str,
) -> String {
    if sharded {
        return format!(
            "sharded parameters: each block's gradients, {wire}, are reduce-scattered as soon as \
             they are all in, on the collectives' stream beside the rest of the backward pass"
        );
    }
    let buckets = cfg.bucket_mb;
    format!(
        "{}: each {buckets} MiB bucket, {wire}, is {} as soon as its gradients are in, \
         on NCCL's stream beside the rest of the backward pass, and captured with the \
         step (c10d's Reducer hooks cannot be captured)",
        if graphs {
            "the step runs as a CUDA graph"
        } else if bf16 {
            "bf16 gradients"
        } else {
            "a sharded optimizer"
        },
        if cfg.shard_optimizer {
            "reduce-scattered"
        } else {
            "all-reduced"
        }
    )
}

/// Whether the step still runs as a CUDA graph once the all-reduce is known: c10d's Reducer
/// cannot be captured, so under it a planned graph gives way, or is an error where the config
/// asked for it.
pub(super) fn resolve_graphs_beside_reducer(
    compile: AutoBool,
    distributed: Option<&DistributedSettings>,
    graphs: bool,
    d: &mut Decisions,
) -> Result<bool> {
    match (distributed, graphs) {
        (Some(dp), graphs) if dp.all_reduce != AllReduce::Reducer => Ok(graphs),
        (Some(_), true) if compile == AutoBool::On => Err(SpeedkitError::Unsupported(
            "compile.enabled: true cannot be combined with distributed.all_reduce: \
             reducer: the gradient all-reduce hooks of c10d's Reducer cannot be captured \
             into the step's CUDA graph (CUDA: \"operation would make the legacy stream \
             depend on a capturing blocking stream\"); set distributed.all_reduce to \
             auto, in_backward or after_backward, or compile.enabled to auto or false"
                .into(),
        )),
        (Some(_), true) => {
            d.push(
                "compile",
                "off",
                "data parallel with distributed.all_reduce: reducer: the step runs eagerly, \
                 because the gradient all-reduce hooks of c10d's Reducer cannot be captured \
                 into a CUDA graph",
            );
            Ok(false)
        }
        (_, graphs) => Ok(graphs),
    }
}
