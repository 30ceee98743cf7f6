//! From a [`SpeedConfig`] and a [`Hardware`] snapshot to a [`Plan`]: every setting resolved, each with
//! the reason it was chosen. A pure function — no libtorch calls — so every row of the `auto` table is
//! tested on a CPU with simulated hardware.
//!
//! | hardware            | precision        | TF32 matmul | GradScaler | fused AdamW | graphs (`compile`) |
//! |---------------------|------------------|-------------|------------|-------------|--------------------|
//! | SM ≥ 8.0            | bf16 autocast    | `high`      | off        | on          | on (not Windows)   |
//! | SM 7.x              | fp16 autocast    | `highest`   | on         | on          | on (not Windows)   |
//! | older GPU           | fp32             | `highest`   | off        | on          | on (not Windows)   |
//! | CPU                 | fp32             | unchanged   | off        | off (foreach) | off              |
//!
//! ```
//! use speedkit::{hardware::Hardware, plan::{Plan, ResolvedPrecision}, SpeedConfig};
//! let plan = Plan::resolve(&SpeedConfig::auto(), &Hardware::simulated_gpu("H100", 9, 0))?;
//! assert_eq!(plan.precision, ResolvedPrecision::Bf16);
//! assert!(plan.grad_scaler.is_none());
//! let cpu = Plan::resolve(&SpeedConfig::auto(), &Hardware::cpu_only())?;
//! assert_eq!(cpu.precision, ResolvedPrecision::Fp32);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use serde::Serialize;
use std::fmt;
use tch::{Device, Kind};

use crate::config::{
    AllReduce, Fp8GradientFormat, Fp8Recipe, GradScalerConfig, MatmulPrecision, SpeedConfig,
};
use crate::dist::{Backend, LaunchEnv};
use crate::error::Result;
use crate::hardware::Hardware;
use crate::overrides::Override;

// One module per concept, one `resolve_*` function per decision. Each records its decision as it
// takes it, so `resolve_launched` calls them in the order `Plan::decisions` lists them.
mod backends;
mod decisions;
mod device;
mod distributed;
mod flags;
mod fp8;
mod fused_kernels;
mod precision;
mod step;

use backends::{
    resolve_cudnn_allow_tf32, resolve_cudnn_benchmark, resolve_cudnn_deterministic,
    resolve_cudnn_enabled, resolve_deterministic_algorithms, resolve_sdp_backends,
};
use decisions::Decisions;
use device::{resolve_device, resolve_rank_device};
use distributed::{
    data_parallel_rank, group_launch, resolve_beside_sharded_parameters, resolve_distributed,
    resolve_expandable_segments, resolve_graphs_beside_reducer, BesideSharding, ModelFit,
};
use fp8::resolve_fp8;
use fused_kernels::{resolve_kernels, resolve_overrides};
use precision::{
    resolve_grad_scaler, resolve_matmul_precision, resolve_precision,
    resolve_reduced_precision_reduction,
};
use step::{
    resolve_channels_last, resolve_compile_graphs, resolve_fused_optimizer, resolve_warmup_offload,
};

/// The precision training runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResolvedPrecision {
    /// bf16 autocast: fp32 weights, bf16 matmuls/convs.
    Bf16,
    /// fp16 autocast, normally with a GradScaler.
    Fp16,
    /// Plain fp32.
    Fp32,
}

impl ResolvedPrecision {
    /// The autocast dtype, if any.
    pub fn autocast_kind(self) -> Option<Kind> {
        match self {
            ResolvedPrecision::Bf16 => Some(Kind::BFloat16),
            ResolvedPrecision::Fp16 => Some(Kind::Half),
            ResolvedPrecision::Fp32 => None,
        }
    }
}

impl fmt::Display for ResolvedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResolvedPrecision::Bf16 => "bf16",
            ResolvedPrecision::Fp16 => "fp16",
            ResolvedPrecision::Fp32 => "fp32",
        })
    }
}

/// One resolved setting and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// The config key, e.g. `precision`.
    pub key: &'static str,
    /// What it resolved to.
    pub value: String,
    /// Why.
    pub reason: String,
}

/// GradScaler parameters, when the plan uses one.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScalerSettings {
    /// Initial scale (PyTorch: 2^16).
    pub init_scale: f64,
    /// Growth factor after `growth_interval` clean steps (2.0).
    pub growth_factor: f64,
    /// Back-off factor on inf/NaN (0.5).
    pub backoff_factor: f64,
    /// Clean steps between growths (2000).
    pub growth_interval: u32,
}

impl From<&GradScalerConfig> for ScalerSettings {
    fn from(c: &GradScalerConfig) -> Self {
        Self {
            init_scale: c.init_scale,
            growth_factor: c.growth_factor,
            backoff_factor: c.backoff_factor,
            growth_interval: c.growth_interval,
        }
    }
}

/// Which SDPA backends may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SdpBackends {
    /// FlashAttention.
    pub flash: bool,
    /// Memory-efficient attention.
    pub mem_efficient: bool,
    /// The math (reference) implementation.
    pub math: bool,
    /// cuDNN attention.
    pub cudnn: bool,
}

/// How `speedkit::nn::Linear` layers run their GEMMs in FP8.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Fp8Plan {
    /// How scales are chosen.
    #[serde(serialize_with = "serialize_recipe")]
    pub recipe: Fp8Recipe,
    /// The output gradients' FP8 format in the backward GEMMs.
    #[serde(serialize_with = "serialize_gradient_format")]
    pub gradient_format: Fp8GradientFormat,
    /// Steps of amax history (delayed recipe).
    pub amax_history: usize,
    /// Layers whose GEMM (tokens × in × out) is smaller stay in the autocast dtype; 0 under
    /// `enabled: true` (every layer whose shapes allow FP8).
    pub min_gemm_size: u64,
    /// Layers whose backward's FP8 output-gradient copies would outweigh the FP8 input copy they
    /// keep more than this many times stay in the autocast dtype; `u32::MAX` under
    /// `enabled: true`.
    pub max_gradient_copy_ratio: u32,
}

fn serialize_recipe<S: serde::Serializer>(r: &Fp8Recipe, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

fn serialize_gradient_format<S: serde::Serializer>(
    f: &Fp8GradientFormat,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(f.as_str())
}

/// Everything speedkit will do, resolved for one machine.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Where training runs.
    #[serde(serialize_with = "serialize_device")]
    pub device: Device,
    /// Training precision.
    pub precision: ResolvedPrecision,
    /// float32 matmul precision; `None` leaves PyTorch's as it is.
    pub matmul_precision: Option<MatmulPrecision>,
    /// cuBLAS reduced-precision reductions for fp16/bf16 GEMMs; `None` leaves them as they are.
    pub reduced_precision_reduction: Option<bool>,
    /// `cudnn.enabled`; `None` leaves it.
    pub cudnn_enabled: Option<bool>,
    /// `cudnn.benchmark`; `None` leaves it.
    pub cudnn_benchmark: Option<bool>,
    /// `cudnn.allow_tf32`; `None` leaves it.
    pub cudnn_allow_tf32: Option<bool>,
    /// `cudnn.deterministic`; `None` leaves it.
    pub cudnn_deterministic: Option<bool>,
    /// `use_deterministic_algorithms`; `None` leaves it.
    pub deterministic_algorithms: Option<bool>,
    /// SDPA backends.
    pub sdp: SdpBackends,
    /// The GradScaler, if used.
    pub grad_scaler: Option<ScalerSettings>,
    /// Fused AdamW (`_fused_adamw_`) rather than the multi-tensor path.
    pub fused_optimizer: bool,
    /// Capture the training step as a CUDA graph.
    pub compile_graphs: bool,
    /// Maximum number of captured graphs kept (one per input shape).
    pub max_graphs: usize,
    /// Eager warm-up steps before capture.
    pub graph_warmup_steps: usize,
    /// Generated kernels for the captured step's pointwise chains (`compile.fusion`).
    pub graph_fusion: bool,
    /// Saved activations of the eager warm-up steps kept in host memory until the backward reads
    /// them (`compile.warmup_offload`).
    pub graph_warmup_offload: bool,
    /// Conv weights in channels-last.
    pub channels_last: bool,
    /// FP8 GEMMs for `speedkit::nn::Linear`, if the plan uses them.
    pub fp8: Option<Fp8Plan>,
    /// speedkit's own fused kernels for [`crate::nn`]'s modules ([`crate::kernels`]).
    pub kernels: bool,
    /// The ATen operators whose CUDA kernels speedkit's replace while the context lives
    /// ([`crate::overrides`]); empty without the kernels.
    pub overrides: Vec<Override>,
    /// Data-parallel training over several processes, when on.
    pub distributed: Option<DistributedSettings>,
    /// The CUDA caching allocator's expandable segments (`None` = left as they are): on under
    /// sharded parameters, whose gathers and gradient buffers come and go in large blocks.
    pub cuda_expandable_segments: Option<bool>,
    /// Every decision with its reason, in config-key order.
    pub decisions: Vec<Decision>,
}

/// How this process takes part in data-parallel training.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DistributedSettings {
    /// The transport.
    pub backend: Backend,
    /// This process's place in the run.
    pub env: LaunchEnv,
    /// Gradient bucket size in bytes.
    pub bucket_bytes: i64,
    /// First (last layers') bucket size in bytes.
    pub first_bucket_bytes: i64,
    /// Bound on the rendezvous and every collective, in seconds.
    pub timeout_s: u64,
    /// How gradients are all-reduced (never `Auto` here): speedkit's in-step all-reduce
    /// (`InBackward`, `AfterBackward`), which a CUDA graph captures with the step, or c10d's
    /// `Reducer`, which it cannot.
    pub all_reduce: AllReduce,
    /// Whether gradients travel in bf16 (half the bytes of fp32 gradients).
    pub bf16_gradients: bool,
    /// Optimizer steps between two comparisons of the ranks' parameters (`0`: none).
    pub check_replicas_every: u64,
    /// ZeRO-1: gradients reduce-scattered, each rank's AdamW state covering its part of the
    /// parameters only, and the updated parameters all-gathered.
    pub shard_optimizer: bool,
    /// ZeRO-3: the parameters sharded too, in units gathered where the step uses them, computing
    /// in this type (bf16 under bf16 precision, else fp32).
    #[serde(serialize_with = "serialize_kind")]
    pub shard_parameters: Option<tch::Kind>,
    /// speedkit's AdamW steps each bucket's parameters as soon as that bucket's average lands
    /// (speedkit's all-reduce of whole gradients, no GradScaler).
    pub overlap_optimizer: bool,
}

fn serialize_kind<S: serde::Serializer>(k: &Option<tch::Kind>, s: S) -> Result<S::Ok, S::Error> {
    match k {
        Some(kind) => s.serialize_str(&format!("{kind:?}")),
        None => s.serialize_none(),
    }
}

fn serialize_device<S: serde::Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&device_name(*d))
}

/// `cpu` or `cuda:N`.
pub fn device_name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

impl Plan {
    /// Resolves `config` for `hardware`. Impossible requests (a GPU the machine lacks, bf16 on a GPU
    /// without it, graphs on a CPU) are errors that say what to change.
    pub fn resolve(config: &SpeedConfig, hardware: &Hardware) -> Result<Plan> {
        Self::resolve_launched(config, hardware, None)
    }

    /// [`resolve`](Self::resolve) for a process of a multi-process run (`launch`, from
    /// [`LaunchEnv::from_env`]; `None` for a single process). `distributed.backend: auto` turns
    /// data parallelism on when `WORLD_SIZE` > 1; the device becomes `cuda:LOCAL_RANK`.
    ///
    /// ```
    /// use speedkit::{dist::{Backend, LaunchEnv}, hardware::Hardware, plan::Plan, SpeedConfig};
    /// let env = LaunchEnv { rank: 1, world_size: 2, local_rank: 1,
    ///                       master_addr: "127.0.0.1".into(), master_port: 29500 };
    /// let mut hw = Hardware::simulated_gpu("H200", 9, 0);
    /// let second = speedkit::hardware::GpuInfo { index: 1, ..hw.gpus[0].clone() };
    /// hw.gpus.push(second);
    /// let plan = Plan::resolve_launched(&SpeedConfig::auto(), &hw, Some(&env))?;
    /// assert_eq!(plan.device, tch::Device::Cuda(1));
    /// assert_eq!(plan.distributed.map(|d| d.backend), Some(Backend::Nccl));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn resolve_launched(
        config: &SpeedConfig,
        hardware: &Hardware,
        launch: Option<&LaunchEnv>,
    ) -> Result<Plan> {
        Self::resolve_for_model(config, hardware, launch, None)
    }

    /// [`resolve_launched`](Self::resolve_launched) for a model of `parameters` trainable
    /// parameters, where it is known: `distributed.shard_parameters: auto` shards them (ZeRO-3)
    /// where their fp32 values, gradients and AdamW state would take more than 70% of the GPU.
    ///
    /// ```
    /// use speedkit::{dist::LaunchEnv, hardware::Hardware, plan::Plan, SpeedConfig};
    /// let env = LaunchEnv { rank: 0, world_size: 2, local_rank: 0,
    ///                       master_addr: "127.0.0.1".into(), master_port: 29500 };
    /// let mut hw = Hardware::simulated_gpu("H100", 9, 0);
    /// hw.gpus[0].total_memory_bytes = 80 << 30;
    /// let second = speedkit::hardware::GpuInfo { index: 1, ..hw.gpus[0].clone() };
    /// hw.gpus.push(second);
    /// // Llama 2 7B's 6.74 B parameters: 100 GiB of state, which no 80 GB GPU holds.
    /// let plan = Plan::resolve_for_model(&SpeedConfig::auto(), &hw, Some(&env), Some(6_740_000_000))?;
    /// assert!(plan.distributed.unwrap().shard_parameters.is_some());
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn resolve_for_model(
        config: &SpeedConfig,
        hardware: &Hardware,
        launch: Option<&LaunchEnv>,
        parameters: Option<u64>,
    ) -> Result<Plan> {
        config.validate()?;
        let mut d = Decisions::default();

        let launch = group_launch(&config.distributed, launch);
        let (device, gpu) = match data_parallel_rank(&config.distributed, launch) {
            Some(env) => resolve_rank_device(config.device, hardware, env, &mut d)?,
            None => resolve_device(config.device, hardware, &mut d)?,
        };
        let precision = resolve_precision(config.precision, gpu, &mut d)?;
        let matmul_precision = resolve_matmul_precision(config.tf32_matmul_precision, gpu, &mut d);
        let reduced_precision_reduction =
            resolve_reduced_precision_reduction(config.reduced_precision_reduction, &mut d);

        let cudnn_enabled = resolve_cudnn_enabled(config.cudnn.enabled, &mut d);
        let cudnn_benchmark = resolve_cudnn_benchmark(config, gpu, &mut d);
        let cudnn_allow_tf32 = resolve_cudnn_allow_tf32(config.cudnn.allow_tf32, gpu, &mut d);
        let cudnn_deterministic = resolve_cudnn_deterministic(config, &mut d);
        let deterministic_algorithms =
            resolve_deterministic_algorithms(config.deterministic, &mut d);
        let sdp = resolve_sdp_backends(&config.sdp_backend, &mut d);

        let grad_scaler = resolve_grad_scaler(&config.grad_scaler, precision, &mut d);
        let fused_optimizer = resolve_fused_optimizer(config.optimizer.fused, gpu, &mut d);
        let compile_graphs = resolve_compile_graphs(config.compile.enabled, gpu, hardware, &mut d)?;
        let fp8 = resolve_fp8(&config.fp8, gpu, precision, &mut d)?;
        let kernels = resolve_kernels(config.kernels, gpu, hardware, &mut d)?;
        let overrides = resolve_overrides(config.overrides, kernels, &mut d)?;
        let channels_last = resolve_channels_last(config.channels_last, gpu, &mut d);

        // The all-reduce is chosen for the step as planned, and may then take its graph away.
        let fit = ModelFit {
            parameters,
            // A simulated GPU's memory is 0: unknown.
            device_memory: gpu.map(|g| g.total_memory_bytes).filter(|&bytes| bytes > 0),
        };
        let distributed = resolve_distributed(
            config,
            device,
            launch,
            precision,
            compile_graphs,
            fit,
            &mut d,
        )?;
        let compile_graphs = resolve_graphs_beside_reducer(
            config.compile.enabled,
            distributed.as_ref(),
            compile_graphs,
            &mut d,
        )?;
        let sharded = distributed
            .as_ref()
            .is_some_and(|dp| dp.shard_parameters.is_some());
        let cuda_expandable_segments = resolve_expandable_segments(sharded, device, &mut d);
        let BesideSharding {
            graphs: compile_graphs,
            kernels,
            overrides,
            fp8,
        } = resolve_beside_sharded_parameters(
            config,
            sharded,
            BesideSharding {
                graphs: compile_graphs,
                kernels,
                overrides,
                fp8,
            },
            &mut d,
        )?;

        Ok(Plan {
            device,
            precision,
            matmul_precision,
            reduced_precision_reduction,
            cudnn_enabled,
            cudnn_benchmark,
            cudnn_allow_tf32,
            cudnn_deterministic,
            deterministic_algorithms,
            sdp,
            grad_scaler,
            fused_optimizer,
            compile_graphs,
            max_graphs: config.compile.max_graphs as usize,
            graph_warmup_steps: config.compile.warmup_steps as usize,
            graph_fusion: compile_graphs && config.compile.fusion,
            graph_warmup_offload: resolve_warmup_offload(&config.compile, compile_graphs, &mut d),
            channels_last,
            fp8,
            kernels,
            overrides,
            distributed,
            cuda_expandable_segments,
            decisions: d.0,
        })
    }

    /// The decision recorded for a config key.
    pub fn decision(&self, key: &str) -> Option<&Decision> {
        self.decisions.iter().find(|d| d.key == key)
    }

    /// The CUDA device index, if the plan runs on CUDA.
    pub fn cuda_index(&self) -> Option<usize> {
        match self.device {
            Device::Cuda(i) => Some(i),
            _ => None,
        }
    }
}
