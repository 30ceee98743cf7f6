//! [`SpeedContext`]: what a training loop holds while speedkit's settings are in force.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use tch::{nn::VarStore, Device, Tensor};

use crate::amp::{AutocastGuard, GradScaler, ScaledOptimizer};
use crate::channels_last::ChannelsLastProbe;
use crate::config::{AutoBool, SpeedConfig};
use crate::dist::{AveragingSettings, DataParallel, LaunchEnv, ProcessGroup};
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::flags::{FlagGuard, FlagState};
use crate::graph::{GraphHost, GraphSettings, GraphedStep};
use crate::hardware::Hardware;
use crate::kernels;
use crate::nn::Fp8Scope;
use crate::nvtx::NvtxRange;
use crate::optim::{AdamW, AdamWOptimizer};
use crate::overrides::{OperatorOverride, OverrideRegistration};
use crate::plan::Plan;
use crate::report::Audit;

/// Detects the hardware, resolves `config` into a [`Plan`], applies its flags (restored when the
/// returned context drops), and prepares the model's parameters: moved to the plan's device, conv
/// weights in channels-last when the plan says so.
///
/// ```
/// use speedkit::{apply_speedups, optim::AdamW, SpeedConfig};
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// let mut vs = nn::VarStore::new(Device::Cpu);
/// let model = nn::linear(vs.root(), 8, 4, Default::default());
/// let config = SpeedConfig::from_yaml_str("device: cpu\nprecision: bf16\n")?;
/// let ctx = apply_speedups(&mut vs, &config)?;
/// let mut opt = ctx.adamw(&vs, AdamW { lr: 3e-4, wd: 0.1, ..Default::default() })?;
/// let x = Tensor::randn([16, 8], (Kind::Float, ctx.device()));
/// let loss = ctx.autocast(|| model.forward(&x).square().mean(None));
/// ctx.backward_step(&loss, &mut opt)?;
/// println!("{}", ctx.audit());
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn apply_speedups(vs: &mut VarStore, config: &SpeedConfig) -> Result<SpeedContext> {
    let ctx = SpeedContext::for_model(config, vs)?;
    ctx.prepare(vs)?;
    Ok(ctx)
}

/// How many trainable parameters `stores` hold: the model's size, as the plan takes it.
pub(crate) fn trainable_parameters(stores: &[&VarStore]) -> u64 {
    stores
        .iter()
        .flat_map(|vs| vs.trainable_variables())
        .map(|t| t.numel() as u64)
        .sum()
}

/// Owns the [`FlagGuard`] (flags restored when the context drops, also during a panic), the resolved
/// [`Plan`] with its reasons, the autocast dtype and the [`GradScaler`]. Not `Send`: PyTorch's flags
/// are process-global and autocast state is per thread (see [`crate::flags`]).
pub struct SpeedContext {
    config: SpeedConfig,
    hardware: Hardware,
    plan: Plan,
    scaler: GradScaler,
    notes: RefCell<Vec<String>>,
    /// The optimizers this context made, counted by [`SpeedContext::optimizer_memory`] while alive.
    optimizers: RefCell<Vec<std::sync::Weak<crate::optim::Holdings>>>,
    // Dropped before the group it reduces over.
    data_parallel: RefCell<Option<DataParallel>>,
    group: Option<Rc<ProcessGroup>>,
    /// The kernel layer's notes when the context began: the audit shows what came after.
    kernel_notes: kernels::NoteMark,
    conv_plans: crate::overrides::CudnnPlans,
    /// Operator overrides the user registered, with their reasons; removed before the flags.
    operator_overrides: RefCell<Vec<(OverrideRegistration, String)>>,
    /// Under `channels_last: auto`, the census of the first backward that decides whether the conv
    /// weights `prepare` laid out channels-last stay so.
    channels_last_probe: RefCell<Option<ChannelsLastProbe>>,
    _release: ReleaseOnDrop,
    // Declared last so it drops last: everything above may still use the flags while dropping.
    guard: FlagGuard,
}

impl SpeedContext {
    /// Detects this machine and applies `config` (no model preparation; see [`apply_speedups`]).
    /// Under a launcher (`WORLD_SIZE` > 1) with `distributed.backend` on, also joins the process
    /// group and checks that every rank runs the same config.
    pub fn new(config: &SpeedConfig) -> Result<Self> {
        Self::with_hardware(config, Hardware::detect()?)
    }

    /// As [`new`](Self::new), planned knowing the model: `distributed.shard_parameters: auto`
    /// decides from its trainable parameters ([`Plan::resolve_for_model`]).
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::{nn, Device};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root(), 64, 64, Default::default());
    /// let ctx = SpeedContext::for_model(&SpeedConfig::from_yaml_str("device: cpu")?, &vs)?;
    /// assert_eq!(ctx.device(), Device::Cpu);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_model(config: &SpeedConfig, vs: &VarStore) -> Result<Self> {
        Self::planned(
            config,
            Hardware::detect()?,
            Some(trainable_parameters(&[vs])),
        )
    }

    /// Applies `config` as planned for `hardware` (a detected or simulated snapshot) and the
    /// launch environment of this process.
    pub fn with_hardware(config: &SpeedConfig, hardware: Hardware) -> Result<Self> {
        Self::planned(config, hardware, None)
    }

    /// The context of `config` on `hardware` for a model of `parameters` trainable parameters,
    /// where known.
    pub(crate) fn planned(
        config: &SpeedConfig,
        hardware: Hardware,
        parameters: Option<u64>,
    ) -> Result<Self> {
        let launch = LaunchEnv::from_env()?;
        let plan = Plan::resolve_for_model(config, &hardware, launch.as_ref(), parameters)?;
        // The group first: a rank that cannot join fails before any flag changes.
        let group = match &plan.distributed {
            None => None,
            Some(d) => {
                let timeout = Duration::from_secs(d.timeout_s);
                let group = ProcessGroup::init(&d.env, d.backend, timeout)?;
                crate::dist::check_same_config(&group, config)?;
                Some(Rc::new(group))
            }
        };
        let guard = FlagGuard::apply(&plan.flag_settings())?;
        let mut scaler = GradScaler::new(plan.grad_scaler.clone(), plan.device)?;
        if let Some(group) = &group {
            scaler.agree_across(Rc::clone(group));
        }
        Ok(Self {
            config: config.clone(),
            hardware,
            plan,
            scaler,
            notes: RefCell::default(),
            data_parallel: RefCell::default(),
            optimizers: RefCell::default(),
            group,
            kernel_notes: kernels::NoteMark::now(),
            conv_plans: crate::overrides::CudnnPlans::now(),
            operator_overrides: RefCell::default(),
            channels_last_probe: RefCell::new(None),
            _release: ReleaseOnDrop,
            guard,
        })
    }

    /// Moves `vs` to the plan's device and lays conv weights out channels-last if the plan says so.
    pub fn prepare(&self, vs: &mut VarStore) -> Result<()> {
        if vs.device() != self.plan.device {
            vs.set_device(self.plan.device);
            self.note(format!(
                "parameters moved to {}",
                crate::plan::device_name(self.plan.device)
            ));
        }
        if self.plan.channels_last {
            let conv_weights: Vec<Tensor> = vs
                .trainable_variables()
                .into_iter()
                .filter(|t| t.dim() == 4)
                .collect();
            for w in &conv_weights {
                ffi::optim::to_channels_last_(w)?;
            }
            if !conv_weights.is_empty() {
                let count = conv_weights.len();
                let probe = (self.config.channels_last == AutoBool::Auto)
                    .then(|| ChannelsLastProbe::start(conv_weights))
                    .transpose()?;
                let paused = match probe.as_ref().is_some_and(|p| p.pauses_autotuning()) {
                    true => {
                        "; until the first backward decides whether they stay, convolutions run \
                         the plans an earlier run kept, else cuDNN runs its heuristics, instead \
                         of autotuning"
                    }
                    false => "",
                };
                self.note(format!(
                    "{count} conv weight(s) laid out channels-last{paused}"
                ));
                *self.channels_last_probe.borrow_mut() = probe;
            }
        }
        self.data_parallel(vs)
    }

    /// Under data parallelism: checks that every rank has the same variables (names, shapes,
    /// dtypes), overwrites them with rank 0's values, and averages the gradients of `vs`'s
    /// trainable variables across ranks in every [`backward`](Self::backward) from now on.
    /// Does nothing in a single process. [`prepare`](Self::prepare) calls it; call it yourself
    /// only for a model that `prepare` did not see (it replaces the previous one).
    pub fn data_parallel(&self, vs: &VarStore) -> Result<()> {
        let (Some(group), Some(settings)) = (&self.group, &self.plan.distributed) else {
            return Ok(());
        };
        // The old reducer goes first: two reducers would both hook the same parameters.
        self.data_parallel.borrow_mut().take();
        let dp = DataParallel::attach(
            group,
            vs,
            AveragingSettings {
                bucket_bytes: settings.bucket_bytes,
                first_bucket_bytes: settings.first_bucket_bytes,
                all_reduce: settings.all_reduce,
                bf16_gradients: settings.bf16_gradients,
                check_replicas_every: settings.check_replicas_every,
                shard_optimizer: settings.shard_optimizer,
                shard_parameters: settings.shard_parameters,
                overlap_optimizer: settings.overlap_optimizer,
            },
        )?;
        let how = if dp.in_step() {
            format!(
                "by speedkit's all-reduce ({}), as work of the step, in {} MiB buckets{}",
                settings.all_reduce,
                settings.bucket_bytes >> 20,
                if settings.bf16_gradients {
                    " sent in bf16"
                } else {
                    ""
                }
            )
        } else {
            format!(
                "by c10d's Reducer in {} MiB buckets during backward",
                settings.bucket_bytes >> 20
            )
        };
        let sharded = if settings.shard_parameters.is_some() {
            format!(
                "; parameters sharded (ZeRO-3): each rank keeps 1/{} of every block in fp32 with \
                 its AdamW state, blocks gathered where the step uses them, gradients \
                 reduce-scattered per block",
                group.world_size()
            )
        } else if settings.shard_optimizer {
            format!(
                "; optimizer state sharded (ZeRO-1): gradients reduce-scattered, each rank's AdamW \
                 state 1/{} of the parameters, updated parameters all-gathered",
                group.world_size()
            )
        } else {
            String::new()
        };
        self.note(format!(
            "data parallel: rank {} of {} over {}; {} parameter tensors ({:.1} MiB) broadcast \
             from rank 0; gradients averaged {how}{sharded}",
            group.rank(),
            group.world_size(),
            group.backend(),
            dp.parameters(),
            dp.parameter_bytes() as f64 / (1 << 20) as f64,
        ));
        *self.data_parallel.borrow_mut() = Some(dp);
        Ok(())
    }

    /// After a replay of a CUDA graph of this context's step: under data parallelism, bounds the
    /// replay's collectives by the group's timeout, and counts the step that the replay made
    /// towards the next [replica check](Self::check_replicas).
    pub(crate) fn after_graph_replay(&self) -> Result<()> {
        self.with_data_parallel(|group, dp| {
            dp.after_replay(group)?;
            dp.after_optimizer_step(group)
        })
    }

    /// `f` with the process group and the attached model, under data parallelism; nothing in a
    /// single process.
    fn with_data_parallel(
        &self,
        f: impl FnOnce(&ProcessGroup, &DataParallel) -> Result<()>,
    ) -> Result<()> {
        match (&self.group, self.data_parallel.borrow().as_ref()) {
            (Some(group), Some(dp)) => f(group, dp),
            _ => Ok(()),
        }
    }

    /// The attached model's optimizer shard, under `distributed.shard_optimizer`.
    fn optimizer_shard(&self) -> Result<Option<crate::dist::OptimizerShard>> {
        match self.data_parallel.borrow().as_ref() {
            Some(dp) => dp.optimizer_shard(),
            None => Ok(None),
        }
    }

    /// Every variable of `vs` by name, in name order, with its whole value: under
    /// `distributed.shard_parameters` (ZeRO-3) the trainable ones are gathered from every rank's
    /// part in fp32 (a collective: every rank calls it, every rank receives them); otherwise they
    /// are the variables themselves. What a checkpoint of the model saves, on rank 0:
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::{nn, Device};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root() / "layer", 4, 2, Default::default());
    /// let state = ctx.model_state(&vs)?;
    /// assert_eq!(state.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["layer.bias", "layer.weight"]);
    /// if ctx.is_main() {
    ///     tch::Tensor::save_multi(&state, std::env::temp_dir().join("model.ot"))?;
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn model_state(&self, vs: &VarStore) -> Result<Vec<(String, Tensor)>> {
        let mut state: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        state.sort_by(|a, b| a.0.cmp(&b.0));
        let gathered = match self.data_parallel.borrow().as_ref() {
            Some(dp) => dp.gather_parameters()?,
            None => None,
        };
        for (name, value) in gathered.into_iter().flatten() {
            if let Some(entry) = state.iter_mut().find(|(n, _)| *n == name) {
                entry.1 = value;
            }
        }
        Ok(state)
    }

    /// Writes a sharded checkpoint of `vs` (and of `optimizer`'s state) into the directory `dir`:
    /// every rank its own file, at the same time, with no rank gathering the model (a collective:
    /// every rank calls it, and it returns once every rank's file is written). Under sharded
    /// parameters or a sharded optimizer each rank writes the pieces it owns; otherwise each
    /// writes its N-th of every variable. [`load_sharded`](Self::load_sharded) reads it back, on
    /// any number of ranks, and [`read_sharded_checkpoint`](crate::dist::read_sharded_checkpoint)
    /// assembles the whole model from it (see [`crate::dist`] on checkpoints).
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::{nn, Device};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root() / "layer", 4, 2, Default::default());
    /// let opt = ctx.adamw(&vs, Default::default())?;
    /// let dir = std::env::temp_dir().join("speedkit-doc-save-sharded");
    /// ctx.save_sharded(&vs, Some(&opt), &dir)?;
    /// assert!(dir.join("rank00000-of-00001.safetensors").exists());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn save_sharded(
        &self,
        vs: &VarStore,
        optimizer: Option<&AdamWOptimizer>,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        let dp = self.data_parallel.borrow();
        crate::dist::save_sharded(
            dp.as_ref(),
            self.rank(),
            self.world_size(),
            vs,
            optimizer,
            dir.as_ref(),
        )?;
        match &self.group {
            Some(group) => group.barrier(),
            None => Ok(()),
        }
    }

    /// Reads a checkpoint [`save_sharded`](Self::save_sharded) wrote, by any number of ranks, into
    /// `vs` (and `optimizer`'s state and learning rates): each rank reads only the stretches of the
    /// files its own part needs (under sharded parameters, its pieces; otherwise the whole model).
    /// No collective. The model's variables and the checkpoint's must be the same names and
    /// shapes; a checkpoint missing a rank's file, or the optimizer's state where an optimizer is
    /// given, is an error that names what is missing.
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::{nn, Device, Kind};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let layer = nn::linear(vs.root() / "layer", 4, 2, Default::default());
    /// let dir = std::env::temp_dir().join("speedkit-doc-load-sharded");
    /// ctx.save_sharded(&vs, None, &dir)?;
    /// let saved = layer.ws.copy();
    /// tch::no_grad(|| layer.ws.shallow_clone().fill_(0.0));
    /// ctx.load_sharded(&vs, None, &dir)?;
    /// assert!(layer.ws.allclose(&saved, 0.0, 0.0, false));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load_sharded(
        &self,
        vs: &VarStore,
        optimizer: Option<&mut AdamWOptimizer>,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<()> {
        let dp = self.data_parallel.borrow();
        crate::dist::load_sharded(dp.as_ref(), vs, optimizer, dir.as_ref())
    }

    /// Under `distributed.shard_parameters` (ZeRO-3), the bytes of parameters this rank holds
    /// now: its fp32 part of every unit and the units gathered at the moment (none between
    /// steps). `None` where the parameters are not sharded.
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// assert_eq!(ctx.resident_parameter_bytes()?, None);   // one process: nothing sharded
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn resident_parameter_bytes(&self) -> Result<Option<i64>> {
        match self.data_parallel.borrow().as_ref() {
            Some(dp) => dp.resident_parameter_bytes(),
            None => Ok(None),
        }
    }

    /// Under data parallelism, compares every rank's trainable parameters with rank 0's and fails
    /// on every rank, naming the ranks and the first parameter that differ, if a replica drifted
    /// (a collective: every rank must call it). The context does it by itself every
    /// `distributed.check_replicas_every` steps; call it before saving a checkpoint, for
    /// instance. Does nothing in a single process.
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// ctx.check_replicas()?;   // one process: nothing to compare
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_replicas(&self) -> Result<()> {
        self.with_data_parallel(|group, dp| dp.check_replicas(group))
    }

    /// The process group, under data parallelism.
    pub fn process_group(&self) -> Option<&ProcessGroup> {
        self.group.as_deref()
    }

    /// This process's rank (0 in a single process).
    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.rank())
    }

    /// Number of processes training together (1 in a single process).
    pub fn world_size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.world_size())
    }

    /// Whether this is rank 0 (or the only process): the one that prints and saves.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// Prints `text` on rank 0 only.
    pub fn print_main(&self, text: impl std::fmt::Display) {
        if self.is_main() {
            println!("{text}");
        }
    }

    /// The configuration this context was built from.
    pub fn config(&self) -> &SpeedConfig {
        &self.config
    }

    /// The hardware snapshot it planned for.
    pub fn hardware(&self) -> &Hardware {
        &self.hardware
    }

    /// The resolved plan, each decision with its reason.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Where training runs.
    pub fn device(&self) -> Device {
        self.plan.device
    }

    /// The GradScaler (pass-through unless the plan uses fp16 or the config enables it).
    pub fn grad_scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// The forward pass's scope: autocast in the plan's dtype on the plan's device (nothing for fp32
    /// plans), and the plan's FP8 settings for [`crate::nn::Linear`] layers. Each layer's FP8
    /// decision goes to the audit when the scope drops.
    pub fn autocast_scope(&self) -> ForwardScope<'_> {
        let range = self.nvtx_range(c"speedkit/forward");
        let kind = self.plan.precision.autocast_kind();
        let autocast = match kind {
            None => AutocastGuard::disabled(),
            Some(kind) => match AutocastGuard::enter(self.plan.device, kind) {
                Ok(guard) => guard,
                Err(e) => {
                    // The dtype and device were validated when planning; this is a libtorch fault.
                    self.note(format!("autocast could not be entered, ran in fp32: {e}"));
                    AutocastGuard::disabled()
                }
            },
        };
        ForwardScope {
            ctx: self,
            fp8: Some(Fp8Scope::enter(
                self.plan.fp8,
                kind.unwrap_or(tch::Kind::Float),
            )),
            _autocast: autocast.with_nvtx(range),
        }
    }

    /// Runs `f` (the forward pass and loss) under autocast; restores the autocast state afterwards,
    /// also if `f` panics.
    pub fn autocast<T>(&self, f: impl FnOnce() -> T) -> T {
        let _scope = self.autocast_scope();
        f()
    }

    /// AdamW over `vs`'s trainable variables, fused or multi-tensor as the plan says. Under
    /// `distributed.shard_optimizer` it covers this rank's part of the attached model only
    /// ([`AdamWOptimizer::sharded`]), and `vs` must be that model.
    pub fn adamw(&self, vs: &VarStore, config: AdamW) -> Result<AdamWOptimizer> {
        let fused = self.plan.fused_optimizer;
        let optimizer = match self.optimizer_shard()? {
            Some(shard) if !shard.covers(&vs.trainable_variables()) => {
                return Err(SpeedkitError::Misuse(
                    "the optimizer state is sharded across the ranks (distributed.shard_optimizer), \
                     and this VarStore is not the model attached for data parallelism: pass the \
                     attached VarStore, or attach this one first (`ctx.data_parallel(&vs)`)"
                        .into(),
                ))
            }
            Some(shard) => AdamWOptimizer::sharded(shard, config, fused)?,
            None => AdamWOptimizer::new(vs, config, fused)?,
        };
        let mut optimizers = self.optimizers.borrow_mut();
        optimizers.retain(|o| o.strong_count() > 0);
        optimizers.push(optimizer.holdings());
        Ok(optimizer)
    }

    /// What the optimizers this context made ([`adamw`](Self::adamw)) and that are still alive
    /// hold: parameters, allocated gradients and state, in bytes (the runner's memory breakdown).
    ///
    /// ```
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::{nn, Device};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root(), 8, 8, Default::default());
    /// let opt = ctx.adamw(&vs, Default::default())?;
    /// assert_eq!(ctx.optimizer_memory().parameters, 4 * (8 * 8 + 8));
    /// drop(opt);
    /// assert_eq!(ctx.optimizer_memory().parameters, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn optimizer_memory(&self) -> crate::optim::OptimizerMemory {
        self.optimizers
            .borrow()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .map(|h| h.memory())
            .fold(Default::default(), |a, b| a + b)
    }

    /// `loss.backward()`, scaled by the GradScaler when the plan has one. Under data parallelism
    /// the gradients are averaged across ranks when it returns.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.backward_joining(loss, true)
    }

    /// [`backward`](Self::backward); under speedkit's all-reduce, with every bucket joined
    /// (`join`) or only started, for [`step_as_buckets_land`](Self::step_as_buckets_land).
    fn backward_joining(&self, loss: &Tensor, join: bool) -> Result<()> {
        let _range = self.nvtx_range(c"speedkit/backward");
        if self.group.is_some() {
            match self.data_parallel.borrow().as_ref() {
                Some(dp) => dp.before_backward()?,
                None => {
                    return Err(SpeedkitError::Misuse(
                        "this process is one rank of a data-parallel run, but no model was \
                         attached, so its gradients would not be averaged: create the context \
                         with `apply_speedups(&mut vs, ..)` or call `ctx.data_parallel(&vs)` \
                         (an #[accelerate] function needs a `&VarStore` argument)"
                            .into(),
                    ))
                }
            }
        }
        let result = self.scaler.scale(loss)?.f_backward().map_err(Into::into);
        // Linears share one cast of an input within a forward; kept past the backward, the casts
        // would only hold memory until this thread's next linear.
        let result = result.and_then(|()| ffi::linear::forget_input_casts());
        let result = result.and_then(|()| self.settle_channels_last());
        let result = result.and_then(|()| match self.data_parallel.borrow().as_ref() {
            Some(dp) => dp.after_backward(join),
            None => Ok(()),
        });
        result.map_err(|e| self.collective_failure("backward", e))
    }

    /// `e`, from `what` (a pass whose gradients are all-reduced), as the error a data-parallel
    /// rank reports: its rank, the timeout, and the ranks that are lost (by their heartbeats).
    fn collective_failure(&self, what: &str, e: SpeedkitError) -> SpeedkitError {
        match &self.group {
            Some(g) => SpeedkitError::Distributed(format!(
                "{what} on rank {} of {} (gradients are all-reduced during it; a rank that died \
                 or hung past the {} s timeout fails it; {}): {e}",
                g.rank(),
                g.world_size(),
                g.timeout().as_secs(),
                g.lost_ranks()
            )),
            None => e,
        }
    }

    /// After the first backward under `channels_last: auto`: the conv weights go back to NCHW
    /// when GroupNorm read channels-last activations, which ATen copies to NCHW ([`ChannelsLastProbe`]).
    fn settle_channels_last(&self) -> Result<()> {
        let Some(mut probe) = self.channels_last_probe.borrow_mut().take() else {
            return Ok(());
        };
        let calls = probe.stop()?;
        if calls == 0 {
            return Ok(());
        }
        let why = format!(
            "{calls} GroupNorm call(s) of the first step read channels-last activations, which ATen \
             copies to NCHW first"
        );
        if self.group.is_some() || crate::graph::is_capturing() {
            self.note(format!(
                "channels_last kept although {why}: the gradient buckets (data parallel) or the \
                 graph being captured hold the layout; `channels_last: false` lays them out NCHW"
            ));
            return Ok(());
        }
        probe.revert()?;
        self.note(format!(
            "{} conv weight(s) laid out NCHW again after the first backward: {why}",
            probe.len()
        ));
        Ok(())
    }

    /// The optimizer step through the GradScaler (skipped on inf/NaN gradients), then the scale update.
    pub fn step<O: ScaledOptimizer + ?Sized>(&self, opt: &mut O) -> Result<()> {
        {
            let _range = self.nvtx_range(if self.scaler.is_enabled() {
                c"speedkit/optimizer step (GradScaler: unscale, inf check, step)"
            } else {
                c"speedkit/optimizer step"
            });
            self.scaler.step(opt)?;
        }
        {
            let _range = if self.scaler.is_enabled() {
                self.nvtx_range(c"speedkit/GradScaler update")
            } else {
                NvtxRange::none()
            };
            self.scaler.update()?;
        }
        self.count_optimizer_step()
    }

    /// Counts an optimizer step for the replicas' check; a captured step counts when its graph
    /// replays (`after_graph_replay`).
    fn count_optimizer_step(&self) -> Result<()> {
        if crate::graph::is_capturing() {
            return Ok(());
        }
        self.with_data_parallel(|group, dp| dp.after_optimizer_step(group))
    }

    /// Whether [`backward_step`](Self::backward_step) leaves the buckets to the optimizer step
    /// (`distributed.overlap_optimizer`): under speedkit's all-reduce, whole or sharded, with no
    /// GradScaler (which needs every gradient before any step).
    fn steps_as_buckets_land(&self) -> bool {
        !self.scaler.is_enabled()
            && self
                .data_parallel
                .borrow()
                .as_ref()
                .is_some_and(|dp| dp.landing().is_some())
    }

    /// The optimizer step after [`backward_joining`](Self::backward_joining) left the buckets
    /// started: the optimizer waits for each bucket just before it updates that bucket's
    /// parameters, so the all-reduces still running overlap the update of those that landed.
    fn step_as_buckets_land<O: ScaledOptimizer + ?Sized>(&self, opt: &mut O) -> Result<()> {
        {
            let _range = self.nvtx_range(c"speedkit/optimizer step (as buckets land)");
            let dp = self.data_parallel.borrow();
            let Some(sync) = dp.as_ref().and_then(DataParallel::landing) else {
                return Err(SpeedkitError::Misuse(
                    "no gradient all-reduce to step beside".into(),
                ));
            };
            let stepped = opt.step_in_parts(sync.bucket_params(), &mut |k| sync.join_bucket(k));
            // Whatever the optimizer did not wait for (also where it failed): no all-reduce may
            // outlive the step unjoined.
            let joined = sync.join_all();
            stepped
                .and(joined)
                .map_err(|e| self.collective_failure("optimizer step as the buckets land", e))?;
        }
        self.count_optimizer_step()
    }

    /// zero_grad → scale → backward → unscale/inf-check → step → update; with the parameters
    /// sharded (`distributed.shard_parameters`), the gradients are dropped again once the step used
    /// them, so that the next forward pass does not hold them beside its activations. Under speedkit's
    /// data-parallel all-reduce without a GradScaler, the optimizer updates each gradient bucket's
    /// parameters as soon as that bucket's average lands (`distributed.overlap_optimizer`), which
    /// [`backward`](Self::backward) then [`step`](Self::step) cannot: code between them may read
    /// any gradient.
    pub fn backward_step<O: ScaledOptimizer + ?Sized>(
        &self,
        loss: &Tensor,
        opt: &mut O,
    ) -> Result<()> {
        {
            let _range = self.nvtx_range(c"speedkit/zero_grad");
            opt.zero_gradients()?;
        }
        if self.steps_as_buckets_land() {
            self.backward_joining(loss, false)?;
            self.step_as_buckets_land(opt)?;
        } else {
            self.backward(loss)?;
            self.step(opt)?;
        }
        if self.shards_parameters() {
            // The step used them: the next forward pass does not hold them beside its activations.
            let _range = self.nvtx_range(c"speedkit/zero_grad");
            opt.zero_gradients()?;
        }
        Ok(())
    }

    /// Whether the plan shards the parameters (ZeRO-3) over the ranks of a data-parallel run.
    fn shards_parameters(&self) -> bool {
        self.plan
            .distributed
            .as_ref()
            .is_some_and(|d| d.shard_parameters.is_some())
    }

    /// Registers your kernel as an operator's implementation ([`OperatorOverride`]) while this
    /// context lives: listed in the [`audit`](SpeedContext::audit) with `reason` and its calls,
    /// removed when the context drops (panics included), which brings back the kernel it
    /// replaced. A kernel that cannot be registered is an error, and nothing changes.
    ///
    /// ```
    /// use speedkit::overrides::{DispatchKey, OperatorOverride, Reply};
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// use tch::Tensor;
    ///
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu")?)?;
    /// // tanh-GELU wherever the model asks for exact GELU on the CPU (a cheaper approximation).
    /// ctx.override_operator(
    ///     OperatorOverride::new("aten::gelu", DispatchKey::Cpu, |call| {
    ///         if call.str("approximate")? != "none" {
    ///             return Ok(Reply::Declined("already approximate".into()));
    ///         }
    ///         Ok(Reply::Ran(vec![call.tensor("self")?.gelu("tanh")]))
    ///     }),
    ///     "the tanh form is within 1e-3 of the exact one and cheaper",
    /// )?;
    /// let _ = Tensor::from_slice(&[0.5f32]).gelu("none");
    /// assert_eq!(ctx.audit().operator_overrides[0].stats.ran, 1);
    /// drop(ctx); // ATen's GELU again
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn override_operator(
        &self,
        kernel: OperatorOverride,
        reason: impl Into<String>,
    ) -> Result<()> {
        let registration = kernel.register()?;
        self.operator_overrides
            .borrow_mut()
            .push((registration, reason.into()));
        Ok(())
    }

    /// What speedkit decided and changed, with reasons.
    pub fn audit(&self) -> Audit {
        Audit {
            hardware: self.hardware.clone(),
            decisions: self.plan.decisions.clone(),
            flag_changes: self.guard.changes().to_vec(),
            operator_overrides: self
                .operator_overrides
                .borrow()
                .iter()
                .map(|(registration, reason)| registration.record(reason))
                .collect(),
            notes: self
                .notes
                .borrow()
                .iter()
                .cloned()
                // One channel for every op, the shim's and the overrides built in Rust: what ran
                // on speedkit's kernels and what ATen ran instead, and why. With the kernels off
                // by the plan, no op is noted: the plan says why.
                .chain(
                    self.kernel_notes
                        .since()
                        .into_iter()
                        .map(|n| format!("kernels: {n}")),
                )
                .chain(crate::overrides::CudnnPlans::note_since(&self.conv_plans))
                .collect(),
        }
    }

    /// An NVTX range named `name` when the config turns NVTX on (`profile.nvtx`), else nothing.
    pub(crate) fn nvtx_range(&self, name: &'static std::ffi::CStr) -> NvtxRange {
        NvtxRange::push(self.config.profile.nvtx, name)
    }

    /// Records something speedkit did that the audit should show.
    pub(crate) fn note(&self, text: impl Into<String>) {
        self.notes.borrow_mut().push(text.into());
    }

    /// Restores the flags now and returns the state read back (equal to the state before).
    pub fn restore(self) -> Result<FlagState> {
        let SpeedContext { guard, .. } = self;
        guard.restore()
    }
}

/// Frees, when the context drops, what its training left that nothing uses any more: the weight
/// copies and FP8 amax histories of models dropped meanwhile.
struct ReleaseOnDrop;

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        // Best effort: a failure here only keeps memory until the next insertion.
        let _ = ffi::weight_casts::release_expired();
        let _ = ffi::fp8::release_weight_histories(false);
    }
}

/// What [`SpeedContext::autocast_scope`] returns: autocast and the plan's FP8 layers, until dropped.
#[must_use = "autocast ends when the scope drops"]
pub struct ForwardScope<'ctx> {
    ctx: &'ctx SpeedContext,
    fp8: Option<Fp8Scope>,
    _autocast: AutocastGuard,
}

impl Drop for ForwardScope<'_> {
    fn drop(&mut self) {
        let Some(scope) = self.fp8.take() else {
            return;
        };
        for d in scope.exit() {
            let layer = format!("fp8: layer {} ", d.layer);
            let mut notes = self.ctx.notes.borrow_mut();
            if !notes.iter().any(|n| n.starts_with(&layer)) {
                let verdict = if d.fp8 {
                    "runs in FP8"
                } else {
                    "stays in the autocast dtype"
                };
                notes.push(format!("{layer}{verdict}: {}", d.reason));
            }
        }
    }
}

impl std::fmt::Debug for SpeedContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpeedContext")
            .field("plan", &self.plan)
            .field("guard", &self.guard)
            .finish()
    }
}

impl SpeedContext {
    /// Wraps a training step for graph mode: see [`GraphedStep`]. `step` gets the static copies of
    /// the inputs passed to [`GraphedStep::run`] and returns the loss.
    pub fn graphed<'c, F>(&'c self, step: F) -> GraphedStep<'c, F>
    where
        F: FnMut(&[Tensor]) -> Result<Option<Tensor>>,
    {
        GraphedStep::new(self, step)
    }
}

impl GraphHost for SpeedContext {
    fn graph_settings(&self) -> GraphSettings {
        let plan = self.plan();
        GraphSettings {
            device_index: plan.cuda_index().filter(|_| plan.compile_graphs),
            warmup_steps: plan.graph_warmup_steps,
            max_graphs: plan.max_graphs,
            fusion: plan.graph_fusion,
            warmup_offload: plan.graph_warmup_offload,
            nvtx: self.config().profile.nvtx,
        }
    }

    fn note(&self, text: String) {
        SpeedContext::note(self, text);
    }

    fn after_graph_replay(&self) -> Result<()> {
        SpeedContext::after_graph_replay(self)
    }

    fn discard_step(&self) {
        self.grad_scaler().reset_step_state();
    }
}
