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
    AllReduce, AutoBool, DeviceChoice, DistributedBackend, DistributedConfig, Fp8Config,
    Fp8GradientFormat, Fp8Recipe, GradScalerConfig, GradientCompression, MatmulPrecision,
    MatmulPrecisionChoice, Precision, SpeedConfig,
};
use crate::dist::{Backend, LaunchEnv};
use crate::error::{Result, SpeedkitError};
use crate::flags::{Flag, FlagSetting, FlagValue};
use crate::hardware::{GpuInfo, Hardware};
use crate::overrides::Override;

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
        config.validate()?;
        let mut d = Decisions::default();

        // A launch of one process joins a group of one only where the backend is named: the
        // data-parallel step on one device, its cost measured alone.
        let named_backend = matches!(
            config.distributed.backend,
            DistributedBackend::Nccl | DistributedBackend::Gloo
        );
        let launch = launch.filter(|env| env.world_size > 1 || named_backend);
        let data_parallel =
            launch.is_some() && config.distributed.backend != DistributedBackend::Off;
        let (device, gpu) = match launch.filter(|_| data_parallel) {
            Some(env) => resolve_rank_device(config.device, hardware, env, &mut d)?,
            None => resolve_device(config.device, hardware, &mut d)?,
        };
        let precision = resolve_precision(config.precision, gpu, &mut d)?;

        let matmul_precision = match (config.tf32_matmul_precision, gpu) {
            (MatmulPrecisionChoice::Auto, Some(g)) if g.supports_tf32() => d.set(
                "tf32_matmul_precision",
                Some(MatmulPrecision::High),
                format!("SM {} has TF32 Tensor Cores: fp32 matmuls run as TF32 (10-bit mantissa, fp32 range)", g.compute_capability),
            ),
            (MatmulPrecisionChoice::Auto, Some(g)) => d.set(
                "tf32_matmul_precision",
                Some(MatmulPrecision::Highest),
                format!("SM {} has no TF32: full fp32 matmuls", g.compute_capability),
            ),
            (MatmulPrecisionChoice::Auto, None) => d.set(
                "tf32_matmul_precision",
                None,
                "CPU: left as it is (TF32 is a CUDA Tensor Core mode)",
            ),
            (explicit, _) => {
                let p = match explicit {
                    MatmulPrecisionChoice::Highest => MatmulPrecision::Highest,
                    MatmulPrecisionChoice::High => MatmulPrecision::High,
                    _ => MatmulPrecision::Medium,
                };
                d.set("tf32_matmul_precision", Some(p), "set in the config")
            }
        };

        let reduced_precision_reduction = explicit_only(
            &mut d,
            "reduced_precision_reduction",
            config.reduced_precision_reduction,
            "auto: PyTorch's default (allowed) is kept",
        );

        let cudnn_enabled = d.default_or_set(
            "cudnn.enabled",
            config.cudnn.enabled,
            true,
            "set in the config: cuDNN off (convolutions fall back to slower kernels)",
        );
        let deterministic = config.deterministic;
        let cudnn_benchmark = match (config.cudnn.benchmark, gpu) {
            (AutoBool::Auto, _) if deterministic || config.cudnn.deterministic => d.set(
                "cudnn.benchmark",
                Some(false),
                "deterministic mode: autotuning picks kernels non-deterministically",
            ),
            (AutoBool::Auto, Some(_)) => d.set(
                "cudnn.benchmark",
                Some(true),
                "CUDA: cuDNN tries its algorithms once per input shape and keeps the fastest",
            ),
            (AutoBool::Auto, None) => d.set("cudnn.benchmark", None, "CPU: cuDNN is not used"),
            (v, _) => d.set(
                "cudnn.benchmark",
                Some(v == AutoBool::On),
                "set in the config",
            ),
        };
        let cudnn_allow_tf32 = match (config.cudnn.allow_tf32, gpu) {
            (AutoBool::Auto, Some(g)) if g.supports_tf32() => d.set(
                "cudnn.allow_tf32",
                Some(true),
                "TF32 convolutions on Ampere and newer (PyTorch's default, made explicit)",
            ),
            (AutoBool::Auto, _) => d.set(
                "cudnn.allow_tf32",
                None,
                "no TF32 on this device: left as it is",
            ),
            (v, _) => d.set(
                "cudnn.allow_tf32",
                Some(v == AutoBool::On),
                "set in the config",
            ),
        };
        let cudnn_deterministic = if config.cudnn.deterministic || deterministic {
            d.set(
                "cudnn.deterministic",
                Some(true),
                "deterministic results requested",
            )
        } else {
            d.set("cudnn.deterministic", None, "not requested: left as it is")
        };
        let deterministic_algorithms = d.default_or_set(
            "deterministic",
            deterministic,
            false,
            "set in the config: torch.use_deterministic_algorithms(True)",
        );

        let sdp = SdpBackends {
            flash: config.sdp_backend.flash,
            mem_efficient: config.sdp_backend.mem_efficient,
            math: config.sdp_backend.math,
            cudnn: config.sdp_backend.cudnn,
        };
        d.push(
            "sdp_backend",
            format!(
                "flash={} mem_efficient={} math={} cudnn={}",
                sdp.flash, sdp.mem_efficient, sdp.math, sdp.cudnn
            ),
            "PyTorch picks the fastest enabled backend that fits the inputs",
        );

        let grad_scaler = match config.grad_scaler.enabled {
            AutoBool::Auto if precision == ResolvedPrecision::Fp16 => {
                d.push("grad_scaler", "on", "fp16 has a narrow range: scale the loss so small gradients do not flush to zero");
                Some(ScalerSettings::from(&config.grad_scaler))
            }
            AutoBool::Auto => {
                d.push(
                    "grad_scaler",
                    "off",
                    format!("{precision}: no loss scaling needed"),
                );
                None
            }
            AutoBool::On => {
                d.push("grad_scaler", "on", "set in the config");
                Some(ScalerSettings::from(&config.grad_scaler))
            }
            AutoBool::Off => {
                let why = if precision == ResolvedPrecision::Fp16 {
                    "set in the config (warning: fp16 without loss scaling can underflow small gradients)"
                } else {
                    "set in the config"
                };
                d.push("grad_scaler", "off", why);
                None
            }
        };

        let fused_optimizer = match (config.optimizer.fused, gpu) {
            (AutoBool::Auto, Some(_)) => {
                d.push(
                    "optimizer.fused",
                    "true",
                    "CUDA: one fused AdamW kernel over all parameters",
                );
                true
            }
            (AutoBool::Auto, None) => {
                d.push(
                    "optimizer.fused",
                    "false",
                    "CPU: multi-tensor (foreach) AdamW",
                );
                false
            }
            (v, _) => {
                d.push(
                    "optimizer.fused",
                    (v == AutoBool::On).to_string(),
                    "set in the config",
                );
                v == AutoBool::On
            }
        };

        let compile_graphs = match (config.compile.enabled, gpu) {
            (AutoBool::Auto, None) => {
                d.push("compile", "off", "CUDA graphs need a CUDA device");
                false
            }
            (AutoBool::Auto, Some(_)) if hardware.is_windows() => {
                d.push("compile", "off", "auto keeps graph capture off on Windows");
                false
            }
            (AutoBool::Auto, Some(_)) => {
                d.push(
                    "compile",
                    "graphs",
                    "CUDA: capture the whole training step once and replay it (no launch overhead)",
                );
                true
            }
            (AutoBool::On, None) => {
                return Err(SpeedkitError::Unsupported(
                    "compile.enabled: true needs a CUDA device, and this run is on the CPU; \
                     set compile.enabled to auto or false"
                        .into(),
                ))
            }
            (AutoBool::On, Some(_)) => {
                d.push("compile", "graphs", "set in the config");
                true
            }
            (AutoBool::Off, _) => {
                d.push("compile", "off", "set in the config");
                false
            }
        };

        let fp8 = resolve_fp8(&config.fp8, gpu, precision, &mut d)?;
        let kernels = resolve_kernels(config.kernels, gpu, hardware, &mut d)?;
        let overrides = resolve_overrides(config.overrides, kernels, &mut d)?;

        let channels_last = match (config.channels_last, gpu) {
            (AutoBool::Auto, Some(g)) if g.has_tensor_cores() => {
                d.push("channels_last", "true", "Tensor Core convolutions are fastest in NHWC (applies to 4-d conv weights only)");
                true
            }
            (AutoBool::Auto, _) => {
                d.push("channels_last", "false", "no Tensor Cores: NCHW kept");
                false
            }
            (v, _) => {
                d.push(
                    "channels_last",
                    (v == AutoBool::On).to_string(),
                    "set in the config",
                );
                v == AutoBool::On
            }
        };

        let distributed = resolve_distributed(config, device, launch, compile_graphs, &mut d)?;
        let compile_graphs = match (&distributed, compile_graphs) {
            (Some(dp), graphs) if dp.all_reduce != AllReduce::Reducer => graphs,
            (Some(_), true) if config.compile.enabled == AutoBool::On => {
                return Err(SpeedkitError::Unsupported(
                    "compile.enabled: true cannot be combined with distributed.all_reduce: \
                     reducer: the gradient all-reduce hooks of c10d's Reducer cannot be captured \
                     into the step's CUDA graph (CUDA: \"operation would make the legacy stream \
                     depend on a capturing blocking stream\"); set distributed.all_reduce to \
                     auto, in_backward or after_backward, or compile.enabled to auto or false"
                        .into(),
                ))
            }
            (Some(_), true) => {
                d.push(
                    "compile",
                    "off",
                    "data parallel with distributed.all_reduce: reducer: the step runs eagerly, \
                     because the gradient all-reduce hooks of c10d's Reducer cannot be captured \
                     into a CUDA graph",
                );
                false
            }
            (_, graphs) => graphs,
        };

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
            channels_last,
            fp8,
            kernels,
            overrides,
            distributed,
            decisions: d.0,
        })
    }

    /// The global flags this plan sets, each with its reason, in the order they are applied.
    pub fn flag_settings(&self) -> Vec<FlagSetting> {
        let mut out = Vec::new();
        let reason = |key: &str| {
            self.decisions
                .iter()
                .find(|d| d.key == key)
                .map_or_else(String::new, |d| d.reason.clone())
        };
        let mut push_bool = |flag: Flag, value: Option<bool>, key: &str| {
            if let Some(v) = value {
                out.push(FlagSetting::new(flag, FlagValue::Bool(v), reason(key)));
            }
        };
        push_bool(Flag::CudnnEnabled, self.cudnn_enabled, "cudnn.enabled");
        push_bool(
            Flag::CudnnBenchmark,
            self.cudnn_benchmark,
            "cudnn.benchmark",
        );
        push_bool(
            Flag::CudnnAllowTf32,
            self.cudnn_allow_tf32,
            "cudnn.allow_tf32",
        );
        push_bool(
            Flag::CudnnDeterministic,
            self.cudnn_deterministic,
            "cudnn.deterministic",
        );
        push_bool(
            Flag::DeterministicAlgorithms,
            self.deterministic_algorithms,
            "deterministic",
        );
        let rpr = self.reduced_precision_reduction;
        push_bool(
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction,
            rpr,
            "reduced_precision_reduction",
        );
        push_bool(
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction,
            rpr,
            "reduced_precision_reduction",
        );
        // Only backends the config turns off are touched: PyTorch enables all of them by default.
        let sdp = [
            (Flag::SdpFlash, self.sdp.flash),
            (Flag::SdpMemEfficient, self.sdp.mem_efficient),
            (Flag::SdpMath, self.sdp.math),
            (Flag::SdpCudnn, self.sdp.cudnn),
        ];
        for (flag, enabled) in sdp {
            if !enabled {
                push_bool(flag, Some(false), "sdp_backend");
            }
        }
        if let Some(p) = self.matmul_precision {
            // One setter, as `torch.set_float32_matmul_precision` does: it moves the legacy field and
            // the CUDA and oneDNN matmul entries together, and `allow_tf32` (a view of the CUDA entry)
            // follows. Setting `allow_tf32` as well would write the legacy field a second time and, with
            // `medium`, leave the two APIs disagreeing, which PyTorch's getters refuse.
            out.push(FlagSetting::new(
                Flag::Float32MatmulPrecision,
                FlagValue::MatmulPrecision(p),
                reason("tf32_matmul_precision"),
            ));
        }
        // Always set, also to its default: a context on another thread that runs the other setting
        // is then refused by the thread rule instead of switching the kernels under this one.
        out.push(FlagSetting::new(
            Flag::SpeedkitKernels,
            FlagValue::Bool(self.kernels),
            reason("kernels"),
        ));
        // Always set too, for the same reason: off is a registration removed (or none made).
        for o in Override::ALL {
            out.push(FlagSetting::new(
                Flag::AtenOverride(o),
                FlagValue::Bool(self.overrides.contains(&o)),
                reason("overrides"),
            ));
        }
        out
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

fn resolve_device<'h>(
    choice: DeviceChoice,
    hw: &'h Hardware,
    d: &mut Decisions,
) -> Result<(Device, Option<&'h GpuInfo>)> {
    match choice {
        DeviceChoice::Auto => match hw.primary_gpu() {
            Some(g) => {
                d.push("device", "cuda:0", format!("{} is visible", g.name));
                Ok((Device::Cuda(0), Some(g)))
            }
            None => {
                d.push("device", "cpu", "no CUDA device is visible");
                Ok((Device::Cpu, None))
            }
        },
        DeviceChoice::Cpu => {
            d.push("device", "cpu", "set in the config");
            Ok((Device::Cpu, None))
        }
        DeviceChoice::Cuda(i) => match hw.gpu(i) {
            Some(g) => {
                d.push(
                    "device",
                    format!("cuda:{i}"),
                    format!("set in the config ({})", g.name),
                );
                Ok((Device::Cuda(i), Some(g)))
            }
            None => Err(SpeedkitError::Unsupported(format!(
                "the config asks for device cuda:{i}, but {}; set `device: auto` (or `cpu`)",
                match hw.gpus.len() {
                    0 if !hw.built_with_cuda && hw.detected => {
                        "this libtorch/speedkit build has no CUDA support".to_string()
                    }
                    0 => "no CUDA device is visible".to_string(),
                    n => format!("only {n} CUDA device(s) are visible"),
                }
            ))),
        },
    }
}

/// Under a launcher: `auto` and `cuda` mean this rank's GPU (`cuda:LOCAL_RANK`), one per process.
fn resolve_rank_device<'h>(
    choice: DeviceChoice,
    hw: &'h Hardware,
    env: &LaunchEnv,
    d: &mut Decisions,
) -> Result<(Device, Option<&'h GpuInfo>)> {
    let local = env.local_rank;
    match choice {
        DeviceChoice::Cpu => resolve_device(choice, hw, d),
        DeviceChoice::Auto if hw.gpus.is_empty() => resolve_device(choice, hw, d),
        DeviceChoice::Cuda(i) if i != local => Err(SpeedkitError::Unsupported(format!(
            "the config asks for device cuda:{i}, but this is rank {} with LOCAL_RANK {local}: \
             data-parallel ranks each use their own GPU, cuda:LOCAL_RANK; set `device: auto`",
            env.rank
        ))),
        _ => match hw.gpu(local) {
            Some(g) => {
                d.push(
                    "device",
                    format!("cuda:{local}"),
                    format!("{}: LOCAL_RANK {local} of a data-parallel run", g.name),
                );
                Ok((Device::Cuda(local), Some(g)))
            }
            None => Err(SpeedkitError::Unsupported(format!(
                "LOCAL_RANK is {local}, but only {} CUDA device(s) are visible: start at most \
                 one process per GPU (`speedkit launch --nproc-per-node {}`)",
                hw.gpus.len(),
                hw.gpus.len()
            ))),
        },
    }
}

fn resolve_distributed(
    config: &SpeedConfig,
    device: Device,
    launch: Option<&LaunchEnv>,
    graphs: bool,
    d: &mut Decisions,
) -> Result<Option<DistributedSettings>> {
    let choice = config.distributed.backend;
    let Some(env) = launch else {
        let why = if choice == DistributedBackend::Auto {
            "a single process (WORLD_SIZE unset or 1)"
        } else {
            "a single process (WORLD_SIZE unset or 1): nothing to communicate"
        };
        d.push("distributed", "off", why);
        return Ok(None);
    };
    let on_cuda = device.is_cuda();
    let (backend, why) =
        match choice {
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
            DistributedBackend::Auto if on_cuda => (Backend::Nccl, "CUDA tensors: NCCL"),
            DistributedBackend::Auto => (Backend::Gloo, "CPU tensors: Gloo"),
            DistributedBackend::Nccl if !on_cuda => return Err(SpeedkitError::Unsupported(
                "distributed.backend is nccl, which needs CUDA tensors, but this run is on the \
                 CPU; set distributed.backend to auto (Gloo on the CPU) or gloo"
                    .into(),
            )),
            DistributedBackend::Nccl => (Backend::Nccl, "set in the config"),
            DistributedBackend::Gloo if on_cuda => {
                return Err(SpeedkitError::Unsupported(
                    "distributed.backend is gloo, but this run is on CUDA, where speedkit drives \
                 NCCL; set distributed.backend to auto (or nccl), or `device: cpu`"
                        .into(),
                ))
            }
            DistributedBackend::Gloo => (Backend::Gloo, "set in the config"),
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
    let all_reduce = resolve_all_reduce(cfg, graphs, d)?;
    const MIB: i64 = 1 << 20;
    Ok(Some(DistributedSettings {
        backend,
        env: env.clone(),
        bucket_bytes: i64::from(cfg.bucket_mb) * MIB,
        first_bucket_bytes: i64::from(cfg.first_bucket_mb) * MIB,
        timeout_s: u64::from(cfg.timeout_s),
        all_reduce,
        bf16_gradients: cfg.compress == GradientCompression::Bf16,
        check_replicas_every: u64::from(cfg.check_replicas_every),
        shard_optimizer: resolve_shard_optimizer(cfg, env.world_size, d),
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

/// How gradients are all-reduced, given whether the step is planned as a CUDA graph: speedkit's
/// in-step all-reduce where the graph must capture it (or bf16 gradients or a sharded optimizer
/// ask for it), c10d's Reducer for an eager step.
fn resolve_all_reduce(
    cfg: &DistributedConfig,
    graphs: bool,
    d: &mut Decisions,
) -> Result<AllReduce> {
    let bf16 = cfg.compress == GradientCompression::Bf16;
    let wire = if bf16 {
        "sent in bf16"
    } else {
        "sent in their own type"
    };
    let buckets = cfg.bucket_mb;
    let (path, reason) =
        match cfg.all_reduce {
            AllReduce::Reducer if cfg.shard_optimizer => {
                return Err(SpeedkitError::Unsupported(
                    "distributed.shard_optimizer reduce-scatters gradients through speedkit's \
                 all-reduce, and distributed.all_reduce is reducer (c10d's Reducer all-reduces \
                 whole gradients); set all_reduce to auto, in_backward or after_backward, or \
                 shard_optimizer to false"
                        .into(),
                ))
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
            AllReduce::Auto if graphs || bf16 || cfg.shard_optimizer => (
                AllReduce::InBackward,
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
                if cfg.shard_optimizer { "reduce-scattered" } else { "all-reduced" }
            ),
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

fn resolve_precision(
    choice: Precision,
    gpu: Option<&GpuInfo>,
    d: &mut Decisions,
) -> Result<ResolvedPrecision> {
    let (p, reason) = match (choice, gpu) {
        (Precision::Auto, None) => (
            ResolvedPrecision::Fp32,
            "CPU: fp32 (reduced-precision autocast rarely pays off on CPUs)".to_string(),
        ),
        (Precision::Auto, Some(g)) if g.supports_bf16() => (
            ResolvedPrecision::Bf16,
            format!("SM {} has bf16 Tensor Cores: bf16 autocast keeps fp32's range, so no loss scaling", g.compute_capability),
        ),
        (Precision::Auto, Some(g)) if g.supports_fp16_tensor_cores() => (
            ResolvedPrecision::Fp16,
            format!("SM {} has fp16 but no bf16 Tensor Cores: fp16 autocast with a GradScaler", g.compute_capability),
        ),
        (Precision::Auto, Some(g)) => (
            ResolvedPrecision::Fp32,
            format!("SM {} has no Tensor Cores: fp32", g.compute_capability),
        ),
        (Precision::Bf16, Some(g)) if !g.supports_bf16() => {
            return Err(SpeedkitError::Unsupported(format!(
                "precision: bf16 needs SM 8.0 or newer, and {} is SM {}; use precision: fp16 (with the GradScaler) or auto",
                g.name, g.compute_capability
            )))
        }
        (Precision::Bf16, None) => (ResolvedPrecision::Bf16, "set in the config: bf16 autocast on the CPU".into()),
        (Precision::Bf16, Some(_)) => (ResolvedPrecision::Bf16, "set in the config".into()),
        (Precision::Fp16, None) => (ResolvedPrecision::Fp16, "set in the config: fp16 autocast on the CPU".into()),
        (Precision::Fp16, Some(_)) => (ResolvedPrecision::Fp16, "set in the config".into()),
        (Precision::Fp32, _) => (ResolvedPrecision::Fp32, "set in the config".into()),
    };
    d.push("precision", p.to_string(), reason);
    Ok(p)
}

fn resolve_fp8(
    config: &Fp8Config,
    gpu: Option<&GpuInfo>,
    precision: ResolvedPrecision,
    d: &mut Decisions,
) -> Result<Option<Fp8Plan>> {
    let plan = |min_gemm_size, max_gradient_copy_ratio| Fp8Plan {
        recipe: config.recipe,
        gradient_format: config.gradient_format(),
        amax_history: config.amax_history as usize,
        min_gemm_size,
        max_gradient_copy_ratio,
    };
    let capable = gpu.filter(|g| g.supports_fp8());
    let (value, reason) = match (config.enabled, capable, precision) {
        (AutoBool::On, None, _) => {
            let machine = gpu.map_or("this run is on the CPU".to_owned(), |g| {
                format!("{} is SM {}", g.name, g.compute_capability)
            });
            return Err(SpeedkitError::Unsupported(format!(
                "fp8.enabled: true needs FP8 Tensor Cores (SM 8.9 or newer: Ada, Hopper), and \
                 {machine}; set fp8.enabled to auto or false"
            )));
        }
        (AutoBool::On, Some(_), _) => (Some(plan(0, u32::MAX)), "set in the config".to_owned()),
        (AutoBool::Auto | AutoBool::Off, None, _) => (
            None,
            match gpu {
                Some(g) => format!(
                    "SM {} has no FP8 Tensor Cores (SM 8.9+)",
                    g.compute_capability
                ),
                None => "CPU: FP8 GEMMs are a CUDA Tensor Core feature".to_owned(),
            },
        ),
        (AutoBool::Auto | AutoBool::Off, Some(_), ResolvedPrecision::Fp32) => (
            None,
            "fp32 training: FP8 layers would return the autocast dtype, and there is none"
                .to_owned(),
        ),
        (AutoBool::Off, Some(g), _) => (None, fp8_opt_in_reason(config, g)),
        (AutoBool::Auto, Some(g), _) => (
            Some(plan(
                config.min_gemm_size(),
                config.max_gradient_copy_ratio(),
            )),
            format!(
                "SM {} has FP8 Tensor Cores: Linear GEMMs of at least {} (tokens × in × out{}) \
                 run in FP8 ({} scaling, {} gradients); smaller ones stay in the autocast dtype, \
                 as do layers whose FP8 output-gradient copies would outweigh their FP8 input \
                 copy more than {}-fold (a classifier over a wide vocabulary)",
                g.compute_capability,
                config.min_gemm_size(),
                if config.min_gemm_size.is_none() {
                    ", where this recipe's FP8 was measured faster than bf16"
                } else {
                    ""
                },
                config.recipe.as_str(),
                config.gradient_format().as_str(),
                config.max_gradient_copy_ratio()
            ),
        ),
    };
    let shown = value.map_or("off".to_owned(), |p: Fp8Plan| p.recipe.as_str().to_owned());
    d.push("fp8", shown, reason);
    Ok(value)
}

/// Why FP8 is off on hardware that has it, what it would take and gain, and how to turn it on.
///
/// `fp8.enabled` is `false` unless the user asks: FP8 can cost converged loss that no step time
/// shows ([`Fp8Config::enabled`]). The figures are measured (docs/benchmarks/README.md, "FP8
/// fidelity"): `mlp_block`'s step under `auto_fp8` against `auto` on an H100, and the converged
/// losses of `examples/fp8_fidelity.rs` and its torchao twin at 5,000 steps.
fn fp8_opt_in_reason(config: &Fp8Config, gpu: &GpuInfo) -> String {
    format!(
        "off unless asked for: SM {} has FP8 Tensor Cores, and fp8.enabled: auto would run \
         speedkit::nn::Linear GEMMs of at least {} (tokens × in × out) in FP8 ({} scaling, {} \
         gradients; mlp_block's step measured 1.53× faster on an H100), but on regression tasks \
         FP8 trained to a converged loss 1.4 to 2.3 times bf16's at 5,000 steps (torchao's FP8: \
         1.26 to 1.83 times; a language model's within 0.2%, docs/benchmarks/README.md, \"FP8 \
         fidelity\"); set fp8.enabled: auto to take it",
        gpu.compute_capability,
        config.min_gemm_size(),
        config.recipe.as_str(),
        config.gradient_format().as_str(),
    )
}

/// Whether [`crate::nn`]'s modules run speedkit's kernels: on a GPU of SM ≥ 8.0 whose toolchain
/// (NVRTC, the CUDA headers, the driver library) was found.
fn resolve_kernels(
    setting: AutoBool,
    gpu: Option<&GpuInfo>,
    hardware: &Hardware,
    d: &mut Decisions,
) -> Result<bool> {
    let missing = match gpu {
        None => Some("this run is on the CPU".to_owned()),
        Some(g) if g.compute_capability.major < 8 => Some(format!(
            "{} is SM {} and the kernels need SM 8.0 or newer",
            g.name, g.compute_capability
        )),
        Some(_) => hardware.kernels_unavailable.clone(),
    };
    let (on, reason) = match (setting, missing) {
        (AutoBool::Off, _) => (
            false,
            "set in the config: speedkit::nn modules run ATen's composite ops".to_owned(),
        ),
        (AutoBool::On, Some(why)) => {
            return Err(SpeedkitError::Unsupported(format!(
                "kernels: true needs a CUDA GPU of SM 8.0 or newer with NVRTC and the CUDA driver \
                 library, and {why}; set kernels to auto or false"
            )))
        }
        (AutoBool::Auto, Some(why)) => (
            false,
            format!("{why}: speedkit::nn modules run ATen's composite ops"),
        ),
        (setting, None) => (
            true,
            format!(
                "{}speedkit::nn's LayerNorm (with the residual add) and cross-entropy run \
                 speedkit's fused kernels, compiled by NVRTC for this GPU",
                if setting == AutoBool::On {
                    "set in the config: "
                } else {
                    ""
                }
            ),
        ),
    };
    d.push("kernels", if on { "on" } else { "off" }, reason);
    Ok(on)
}

/// Which ATen operators speedkit's kernels take over: every group wherever the kernels run, unless
/// the config says `overrides: false`.
fn resolve_overrides(setting: AutoBool, kernels: bool, d: &mut Decisions) -> Result<Vec<Override>> {
    let (on, reason) = match (setting, kernels) {
        (AutoBool::Off, _) => (
            false,
            "set in the config: tch's modules run ATen's kernels".to_owned(),
        ),
        (AutoBool::On, false) => {
            return Err(SpeedkitError::Unsupported(
                "overrides: true registers speedkit's kernels, which this run does not have \
                 (see the `kernels` decision); set overrides to auto or false"
                    .into(),
            ))
        }
        (AutoBool::Auto, false) => (
            false,
            "without speedkit's kernels there is nothing to register".to_owned(),
        ),
        (setting, true) => {
            let names: Vec<String> = Override::ALL
                .iter()
                .flat_map(|o| o.operators())
                .map(|op| op.to_string())
                .collect();
            let reason = format!(
                "{}speedkit's kernels registered as the CUDA kernels of {} while the context \
                 lives: unchanged tch models (nn::layer_norm, nn::linear, nn::conv2d and \
                 log_softmax under autocast, nn::batch_norm in training) run them",
                if setting == AutoBool::On {
                    "set in the config: "
                } else {
                    ""
                },
                names.join(", ")
            );
            (true, reason)
        }
    };
    d.push("overrides", if on { "on" } else { "off" }, reason);
    Ok(if on {
        Override::ALL.to_vec()
    } else {
        Vec::new()
    })
}

fn explicit_only(
    d: &mut Decisions,
    key: &'static str,
    v: AutoBool,
    auto_reason: &str,
) -> Option<bool> {
    match v {
        AutoBool::Auto => d.set(key, None, auto_reason),
        v => d.set(key, Some(v == AutoBool::On), "set in the config"),
    }
}

#[derive(Default)]
struct Decisions(Vec<Decision>);

impl Decisions {
    fn push(&mut self, key: &'static str, value: impl Into<String>, reason: impl Into<String>) {
        self.0.push(Decision {
            key,
            value: value.into(),
            reason: reason.into(),
        });
    }

    /// Records an optional setting (`None` = "left as it is") and returns it.
    fn set<T: fmt::Display + Copy>(
        &mut self,
        key: &'static str,
        v: Option<T>,
        reason: impl Into<String>,
    ) -> Option<T> {
        self.push(
            key,
            v.map_or_else(|| "unchanged".to_string(), |v| v.to_string()),
            reason,
        );
        v
    }

    /// A plain bool key: PyTorch's default value means "leave the flag as it is" (so a config does not
    /// undo what the process set elsewhere); any other value is applied.
    fn default_or_set(
        &mut self,
        key: &'static str,
        v: bool,
        pytorch_default: bool,
        reason: &str,
    ) -> Option<bool> {
        if v == pytorch_default {
            self.set(key, None, "PyTorch's default: left as it is")
        } else {
            self.set(key, Some(v), reason)
        }
    }
}
