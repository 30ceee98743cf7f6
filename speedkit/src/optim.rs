//! AdamW with ATen's fused kernel (`_fused_adamw_`) or the multi-tensor (`_foreach_*`) path, as
//! `torch.optim.AdamW(fused=True)` / `(foreach=True, capturable=True)` compute it.
//!
//! The step counts and the learning rate are device tensors, so a step never synchronises with the
//! host and can be captured in a CUDA graph ([`crate::graph`]); [`AdamWOptimizer::set_lr`] writes the
//! new rate into that tensor. With the fused kernel the [`GradScaler`](crate::amp::GradScaler)'s
//! unscale and inf-skip happen inside the same kernel.
//!
//! On the fused path, where speedkit's kernels are on, speedkit's own AdamW kernel takes every
//! contiguous fp32 CUDA parameter instead, in one launch per 48 parameters: the same update,
//! GradScaler handling included. For the parameters whose autocast-type copy speedkit keeps (the
//! weights of [`crate::nn::Linear`] on speedkit's kernels) it also writes the copy in its pass, so
//! the next forward casts no weight. With `kernels: false` ATen's kernel updates every parameter.
//!
//! ```
//! use speedkit::optim::{AdamW, AdamWOptimizer};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layer = nn::linear(vs.root(), 4, 2, Default::default());
//! let mut opt = AdamWOptimizer::new(&vs, AdamW { lr: 1e-2, ..Default::default() }, false)?;
//! let loss = layer.forward(&Tensor::ones([8, 4], (Kind::Float, Device::Cpu))).sum(None);
//! opt.backward_step(&loss)?;
//! assert_eq!(opt.steps_taken()?, 1);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use serde::{Deserialize, Serialize};
use tch::{nn::VarStore, Device, Kind, Tensor};

use crate::amp::ScaledOptimizer;
use crate::dist::OptimizerShard;
use crate::error::{Result, SpeedkitError};
use crate::ffi::{
    self,
    optim::{AdamWHyper, AdamWLists},
};

/// AdamW hyper-parameters (PyTorch's defaults). Pass to [`crate::SpeedContext::adamw`] or
/// [`AdamWOptimizer::new`].
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Denominator epsilon (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub wd: f64,
    /// Exclude biases and norm weights (every parameter with fewer than 2 dimensions) from weight
    /// decay, as GPT-style recipes do. Off by default, as in PyTorch.
    pub exclude_from_decay: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            wd: 0.01,
            exclude_from_decay: false,
        }
    }
}

/// Parameters sharing a learning rate and weight decay.
#[derive(Debug)]
pub struct ParamGroup {
    /// The parameters (tensors that require grad).
    pub params: Vec<Tensor>,
    /// Learning rate of this group.
    pub lr: f64,
    /// Weight decay of this group.
    pub weight_decay: f64,
}

/// Parameters of one device and dtype with their state: what one kernel launch updates.
struct Bucket {
    params: Vec<Tensor>,
    /// Empty until the first step makes it ([`AdamWOptimizer::make_state`]), as torch.optim makes
    /// its state: the first forward and backward, which allocate every gradient anew and cuDNN's
    /// autotuning workspaces, then run without two fp32 copies of the parameters beside them.
    state: BucketState,
    lr: Tensor,
}

impl Bucket {
    fn has_state(&self) -> bool {
        self.state.steps.len() == self.params.len()
    }
}

/// AdamW's state of one bucket's parameters: both moments and the step count of each.
#[derive(Default)]
struct BucketState {
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
    steps: Vec<Tensor>,
}

impl BucketState {
    /// The state `params` start from: zeros.
    fn zeros(params: &[Tensor]) -> Result<Self> {
        let mut state = BucketState {
            exp_avgs: Vec::with_capacity(params.len()),
            exp_avg_sqs: Vec::with_capacity(params.len()),
            steps: Vec::with_capacity(params.len()),
        };
        for p in params {
            state.exp_avgs.push(Tensor::f_zeros_like(p)?);
            state.exp_avg_sqs.push(Tensor::f_zeros_like(p)?);
            // PyTorch keeps step counts as float32 device tensors for the fused and capturable paths.
            state
                .steps
                .push(Tensor::f_zeros([] as [i64; 0], (Kind::Float, p.device()))?);
        }
        Ok(state)
    }

    fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.exp_avgs
            .iter()
            .chain(&self.exp_avg_sqs)
            .chain(&self.steps)
    }
}

struct Group {
    lr: f64,
    weight_decay: f64,
    buckets: Vec<Bucket>,
}

/// What an optimizer holds, in bytes: its parameters, their gradients (those allocated now) and
/// its state (AdamW's two moments and step counts, made at the first step, and learning rates).
///
/// ```
/// use speedkit::optim::{AdamW, AdamWOptimizer};
/// use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _layer = nn::linear(vs.root(), 256, 256, Default::default());
/// let opt = AdamWOptimizer::new(&vs, AdamW::default(), false)?;
/// let held = opt.memory();
/// assert_eq!(held.parameters, 4 * (256 * 256 + 256));
/// assert_eq!(held.gradients, 0); // no backward yet
/// assert_eq!(held.state, 4); // the learning rate: the first step makes the rest
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerMemory {
    /// The parameters' bytes.
    pub parameters: u64,
    /// The bytes of the parameters' gradients that are allocated.
    pub gradients: u64,
    /// The optimizer state's bytes.
    pub state: u64,
}

impl std::ops::Add for OptimizerMemory {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            parameters: self.parameters + other.parameters,
            gradients: self.gradients + other.gradients,
            state: self.state + other.state,
        }
    }
}

/// An optimizer's tensors (shallow handles to the same storage), shared with the context that made
/// it: the context counts them for as long as the optimizer lives, through a [`Weak`], and not a
/// moment longer. (In a mutex only so that the optimizer stays `Send`: a tensor is not `Sync`.)
pub(crate) struct Holdings(Mutex<HeldTensors>);

struct HeldTensors {
    params: Vec<Tensor>,
    /// The tensors whose gradients the optimizer reads: `params`, or a sharded optimizer's pieces.
    stepped: Vec<Tensor>,
    state: Vec<Tensor>,
}

impl Holdings {
    pub(crate) fn memory(&self) -> OptimizerMemory {
        self.held().memory()
    }

    /// Counts `state` as the optimizer's state from now on.
    fn count_state<'a>(&self, state: impl Iterator<Item = &'a Tensor>) {
        self.held().state.extend(state.map(Tensor::shallow_clone));
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HeldTensors> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl HeldTensors {
    fn memory(&self) -> OptimizerMemory {
        let bytes = |t: &Tensor| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        OptimizerMemory {
            parameters: self.params.iter().map(bytes).sum(),
            gradients: self
                .stepped
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .map(|g| bytes(&g))
                .sum(),
            state: self.state.iter().map(bytes).sum(),
        }
    }
}

/// The AdamW optimizer. See the [module docs](self).
pub struct AdamWOptimizer {
    holdings: Arc<Holdings>,
    groups: Vec<Group>,
    beta1: f64,
    beta2: f64,
    eps: f64,
    fused: bool,
    grads_to_none: bool,
    shard: Option<OptimizerShard>,
}

impl AdamWOptimizer {
    /// Optimizes every trainable variable of `vs`; `fused` picks `_fused_adamw_` over the foreach path.
    pub fn new(vs: &VarStore, config: AdamW, fused: bool) -> Result<Self> {
        let vars = vs
            .trainable_variables()
            .into_iter()
            .map(|t| {
                let matrix = t.dim() >= 2;
                (t, matrix)
            })
            .collect();
        Self::with_groups(param_groups(vars, &config), &config, fused)
    }

    /// ZeRO-1: AdamW over this rank's pieces of the parameters only (see [`OptimizerShard`]), so
    /// its state is the parameters' divided by the number of ranks. Each
    /// [`step`](Self::step) updates the pieces from their averaged gradients, then all-gathers
    /// every rank's pieces into the whole parameters: a collective, which every rank must call
    /// (as the gradient sync before it). Weight decay follows the whole parameters' shapes;
    /// [`clip_grad_norm`](Self::clip_grad_norm) clips by the whole gradient's norm. Each rank's
    /// [`save`](Self::save) writes its own part of the state.
    pub fn sharded(shard: OptimizerShard, config: AdamW, fused: bool) -> Result<Self> {
        let whole = shard.parameters();
        let pieces = shard
            .pieces()
            .iter()
            .map(|(piece, i)| (piece.shallow_clone(), whole[*i].dim() >= 2))
            .collect();
        let mut optimizer = Self::with_groups(param_groups(pieces, &config), &config, fused)?;
        optimizer.holdings = Arc::new(holdings_of(&optimizer.groups, Some(whole)));
        optimizer.shard = Some(shard);
        Ok(optimizer)
    }

    /// Optimizes explicit parameter groups; `config`'s betas and eps apply to all of them.
    pub fn with_groups(groups: Vec<ParamGroup>, config: &AdamW, fused: bool) -> Result<Self> {
        if !(0.0..1.0).contains(&config.beta1) || !(0.0..1.0).contains(&config.beta2) {
            return Err(SpeedkitError::Misuse(format!(
                "AdamW betas must be in [0, 1), got ({}, {})",
                config.beta1, config.beta2
            )));
        }
        if config.lr < 0.0 || config.eps < 0.0 || config.wd < 0.0 {
            return Err(SpeedkitError::Misuse(
                "AdamW lr, eps and wd must be non-negative".into(),
            ));
        }
        let groups = groups
            .into_iter()
            .map(|g| {
                Ok(Group {
                    lr: g.lr,
                    weight_decay: g.weight_decay,
                    buckets: make_buckets(g.params, g.lr)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            holdings: Arc::new(holdings_of(&groups, None)),
            groups,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            fused,
            grads_to_none: true,
            shard: None,
        })
    }

    /// What this optimizer holds now: parameters, allocated gradients, state.
    pub fn memory(&self) -> OptimizerMemory {
        self.holdings.memory()
    }

    /// A handle to count this optimizer's memory by while it lives.
    pub(crate) fn holdings(&self) -> Weak<Holdings> {
        Arc::downgrade(&self.holdings)
    }

    /// Whether this optimizer runs the fused kernel.
    pub fn is_fused(&self) -> bool {
        self.fused
    }

    /// Sets the learning rate of every group (written into the device tensor: capture-safe).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        for i in 0..self.groups.len() {
            self.set_group_lr(i, lr)?;
        }
        Ok(())
    }

    /// Sets the learning rate of one group.
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        let g = self
            .groups
            .get_mut(group)
            .ok_or_else(|| SpeedkitError::Misuse(format!("no parameter group {group}")))?;
        g.lr = lr;
        for b in &mut g.buckets {
            let _ = b.lr.f_fill_(lr)?;
        }
        Ok(())
    }

    /// The learning rate of each group.
    pub fn lrs(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }

    /// Resets the gradients before the next backward: drops them (`param.grad = None`, PyTorch's
    /// `zero_grad(set_to_none=True)` and its default) or, after
    /// [`zero_grads_in_place(true)`](Self::zero_grads_in_place), fills them with zeros.
    ///
    /// ```
    /// use speedkit::optim::{AdamW, AdamWOptimizer};
    /// use tch::{nn, Device, Kind};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
    /// let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), false)?;
    /// (&w * 2.0).sum(Kind::Float).backward();
    /// opt.zero_grad()?;
    /// assert!(!w.grad().defined());
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn zero_grad(&mut self) -> Result<()> {
        if self.grads_to_none {
            let with_grads: Vec<Tensor> = self
                .params()
                .filter(|p| p.grad().defined())
                .map(Tensor::shallow_clone)
                .collect();
            return ffi::optim::clear_grads(&with_grads);
        }
        let grads = self.gradients();
        if !grads.is_empty() {
            ffi::optim::foreach_zero_(&grads)?;
        }
        Ok(())
    }

    /// Makes [`zero_grad`](Self::zero_grad) fill gradients with zeros instead of dropping them,
    /// for code that holds on to the gradient tensors between steps.
    ///
    /// Dropping is faster: the next backward writes the gradients instead of adding them to zeros.
    /// It is also safe in a CUDA graph, which keeps the gradients it allocated (see
    /// [`crate::graph`], "Gradients").
    pub fn zero_grads_in_place(&mut self, in_place: bool) -> &mut Self {
        self.grads_to_none = !in_place;
        self
    }

    fn params(&self) -> impl Iterator<Item = &Tensor> {
        self.groups
            .iter()
            .flat_map(|g| &g.buckets)
            .flat_map(|b| &b.params)
    }

    /// One AdamW step over parameters that have gradients.
    pub fn step(&mut self) -> Result<()> {
        self.step_impl(None, None)
    }

    /// `zero_grad` → `loss.backward()` → `step`, as `tch::nn::Optimizer::backward_step`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad()?;
        loss.f_backward()?;
        self.step()
    }

    /// Scales all gradients so their global 2-norm is at most `max_norm`; returns the norm before
    /// clipping (a device tensor: no synchronisation). [Sharded](Self::sharded), the norm is the
    /// whole gradient's, agreed by every rank (a collective).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let grads = self.gradients();
        let local = if grads.is_empty() {
            None
        } else {
            Some(ffi::optim::foreach_total_norm(&grads, 2.0)?)
        };
        let total = match (&self.shard, local) {
            (Some(shard), local) => shard.global_norm(local)?,
            (None, Some(local)) => local,
            (None, None) => return Ok(Tensor::from(0.0f32)),
        };
        if grads.is_empty() {
            return Ok(total);
        }
        let coef = (total.f_add_scalar(1e-6)?.f_reciprocal()? * max_norm).f_clamp_max(1.0)?;
        let mut by_device: Vec<(Device, Vec<Tensor>)> = Vec::new();
        for g in grads {
            match by_device.iter_mut().find(|(d, _)| *d == g.device()) {
                Some((_, list)) => list.push(g),
                None => by_device.push((g.device(), vec![g])),
            }
        }
        for (device, list) in by_device {
            ffi::optim::foreach_mul_(&list, &coef.f_to_device(device)?)?;
        }
        Ok(total)
    }

    /// Steps taken by the first parameter (a synchronisation; for logs and tests).
    pub fn steps_taken(&self) -> Result<i64> {
        let first = self
            .groups
            .iter()
            .flat_map(|g| &g.buckets)
            .flat_map(|b| &b.state.steps)
            .next();
        match first {
            Some(s) => Ok(s.f_double_value(&[])? as i64),
            None => Ok(0),
        }
    }

    /// Makes the state of the buckets that have none yet (zeros, what torch.optim's first step
    /// starts from), counted in the holdings from then on.
    ///
    /// On a GPU the caching allocator's unused blocks go back to the driver first (a device
    /// synchronisation, once): the first step's activations have just been freed into them, and
    /// state carved out of their segments would keep each of those segments from ever being given
    /// back, which a CUDA graph capture (its own pool) or a later, larger step then lacks.
    /// Making the state allocates, so it must not happen inside a capture, whose replays would
    /// zero it again.
    fn make_state(&mut self) -> Result<()> {
        let buckets = || self.groups.iter().flat_map(|g| &g.buckets);
        if buckets().all(Bucket::has_state) {
            return Ok(());
        }
        if crate::graph::is_capturing() {
            return Err(SpeedkitError::Graph(
                "AdamW makes its state at its first step, and that step is being captured in a \
                 CUDA graph, whose replays would zero the state again: run at least one step \
                 eagerly before capturing (compile.warmup_steps >= 1 does)"
                    .into(),
            ));
        }
        if buckets().any(|b| b.lr.device().is_cuda()) {
            ffi::device::cuda_empty_cache()?;
        }
        for b in self.groups.iter_mut().flat_map(|g| &mut g.buckets) {
            if !b.has_state() {
                b.state = BucketState::zeros(&b.params)?;
                self.holdings.count_state(b.state.tensors());
            }
        }
        Ok(())
    }

    fn step_impl(&mut self, grad_scale: Option<&Tensor>, found_inf: Option<&Tensor>) -> Result<()> {
        // In-place updates of leaf parameters: as torch.optim's step, outside autograd.
        let _no_grad = tch::no_grad_guard();
        crate::graph::record_gradients(self.params());
        self.make_state()?;
        for g in &self.groups {
            for b in &g.buckets {
                // Parameters without a gradient this step are skipped, as in PyTorch.
                let mut idx = Vec::with_capacity(b.params.len());
                let mut grads = Vec::with_capacity(b.params.len());
                for (i, p) in b.params.iter().enumerate() {
                    let grad = p.grad();
                    if grad.defined() {
                        idx.push(i);
                        grads.push(grad);
                    }
                }
                if grads.is_empty() {
                    continue;
                }
                let state = &b.state;
                let pick = |v: &[Tensor]| -> Vec<Tensor> {
                    idx.iter().map(|&i| v[i].shallow_clone()).collect()
                };
                let (params, m, v, s);
                let lists = if idx.len() == b.params.len() {
                    AdamWLists {
                        params: &b.params,
                        grads: &grads,
                        exp_avgs: &state.exp_avgs,
                        exp_avg_sqs: &state.exp_avg_sqs,
                        steps: &state.steps,
                    }
                } else {
                    params = pick(&b.params);
                    m = pick(&state.exp_avgs);
                    v = pick(&state.exp_avg_sqs);
                    s = pick(&state.steps);
                    AdamWLists {
                        params: &params,
                        grads: &grads,
                        exp_avgs: &m,
                        exp_avg_sqs: &v,
                        steps: &s,
                    }
                };
                let hyper = AdamWHyper {
                    lr: &b.lr,
                    beta1: self.beta1,
                    beta2: self.beta2,
                    weight_decay: g.weight_decay,
                    eps: self.eps,
                };
                if self.fused {
                    let scale = grad_scale
                        .map(|t| t.f_to_device(b.lr.device()))
                        .transpose()?;
                    let inf = found_inf
                        .map(|t| t.f_to_device(b.lr.device()))
                        .transpose()?;
                    // With speedkit's kernels on, its AdamW kernel updates every parameter in one
                    // launch (the shim decides); with them off, ATen's fused AdamW.
                    ffi::optim::fused_adamw_(&lists, &hyper, scale.as_ref(), inf.as_ref())?;
                } else {
                    ffi::optim::foreach_adamw_(&lists, &hyper)?;
                }
            }
        }
        match &self.shard {
            Some(shard) => shard.gather(),
            None => Ok(()),
        }
    }

    /// The optimizer state as named tensors (exp_avg, exp_avg_sq, step per parameter; lr per
    /// group). Before the first step, which makes the state, its moments and steps are fresh zeros:
    /// what that step starts from.
    ///
    /// ```
    /// use speedkit::optim::{AdamW, AdamWOptimizer};
    /// use tch::{nn, Device};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root(), 4, 2, Default::default());
    /// let opt = AdamWOptimizer::new(&vs, AdamW::default(), false)?;
    /// let state = opt.state_tensors()?;
    /// // A learning rate, and three tensors for each of the weight and the bias.
    /// assert_eq!(state.len(), 1 + 2 * 3);
    /// assert_eq!(opt.memory().state, 4, "only the learning rate is allocated yet");
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (gi, g) in self.groups.iter().enumerate() {
            for (bi, b) in g.buckets.iter().enumerate() {
                out.push((format!("group{gi}.bucket{bi}.lr"), b.lr.shallow_clone()));
                let made;
                let state = if b.has_state() {
                    &b.state
                } else {
                    made = BucketState::zeros(&b.params)?;
                    &made
                };
                for i in 0..b.params.len() {
                    let prefix = format!("group{gi}.bucket{bi}.param{i}");
                    for (name, t) in [
                        ("exp_avg", &state.exp_avgs[i]),
                        ("exp_avg_sq", &state.exp_avg_sqs[i]),
                        ("step", &state.steps[i]),
                    ] {
                        out.push((format!("{prefix}.{name}"), t.shallow_clone()));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Writes the state to `path` (libtorch's format, as `Tensor::save_multi`).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let named = self.state_tensors()?;
        let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::save_multi(&refs, path.as_ref())?;
        Ok(())
    }

    /// Reads a state written by [`save`](Self::save) for an optimizer over the same parameters.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let loaded = Tensor::load_multi(path.as_ref())?;
        // The state the file's values go into, made now where no step has made it yet.
        self.make_state()?;
        let mine = self.state_tensors()?;
        if loaded.len() != mine.len() {
            return Err(SpeedkitError::Misuse(format!(
                "optimizer state in {} has {} tensors, this optimizer has {}: not the same parameters",
                path.as_ref().display(),
                loaded.len(),
                mine.len()
            )));
        }
        for (name, mut dst) in mine {
            let src = loaded
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| SpeedkitError::Misuse(format!("optimizer state lacks `{name}`")))?;
            tch::no_grad(|| dst.f_copy_(src))?;
        }
        self.groups.iter_mut().try_for_each(|g| -> Result<()> {
            if let Some(b) = g.buckets.first() {
                g.lr = b.lr.f_double_value(&[])?;
            }
            Ok(())
        })
    }
}

/// `params` (each with whether it is a matrix) in one group, or two where biases and norm weights
/// are excluded from weight decay.
fn param_groups(params: Vec<(Tensor, bool)>, config: &AdamW) -> Vec<ParamGroup> {
    let group = |params: Vec<(Tensor, bool)>, weight_decay| ParamGroup {
        params: params.into_iter().map(|(t, _)| t).collect(),
        lr: config.lr,
        weight_decay,
    };
    if !config.exclude_from_decay {
        return vec![group(params, config.wd)];
    }
    let (decay, no_decay): (Vec<_>, Vec<_>) = params.into_iter().partition(|(_, matrix)| *matrix);
    vec![group(decay, config.wd), group(no_decay, 0.0)]
}

/// What an optimizer over `groups` holds; `whole`: the parameters a sharded optimizer's pieces
/// belong to (counted as its parameters).
fn holdings_of(groups: &[Group], whole: Option<&[Tensor]>) -> Holdings {
    let buckets = || groups.iter().flat_map(|g| &g.buckets);
    let stepped: Vec<Tensor> = buckets()
        .flat_map(|b| &b.params)
        .map(Tensor::shallow_clone)
        .collect();
    Holdings(Mutex::new(HeldTensors {
        params: match whole {
            Some(whole) => whole.iter().map(Tensor::shallow_clone).collect(),
            None => stepped.iter().map(Tensor::shallow_clone).collect(),
        },
        stepped,
        state: buckets()
            .flat_map(|b| b.state.tensors().chain([&b.lr]))
            .map(Tensor::shallow_clone)
            .collect(),
    }))
}

fn make_buckets(params: Vec<Tensor>, lr: f64) -> Result<Vec<Bucket>> {
    let mut buckets: Vec<((Device, Kind), Bucket)> = Vec::new();
    for p in params {
        let key = (p.device(), p.kind());
        match buckets.iter_mut().find(|(k, _)| *k == key) {
            Some((_, b)) => b.params.push(p),
            None => {
                let lr_t = Tensor::f_full([] as [i64; 0], lr, (Kind::Float, key.0))?;
                buckets.push((
                    key,
                    Bucket {
                        params: vec![p],
                        state: BucketState::default(),
                        lr: lr_t,
                    },
                ));
            }
        }
    }
    Ok(buckets.into_iter().map(|(_, b)| b).collect())
}

impl ScaledOptimizer for AdamWOptimizer {
    fn gradients(&self) -> Vec<Tensor> {
        self.params()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect()
    }
    fn zero_gradients(&mut self) -> Result<()> {
        self.zero_grad()
    }
    fn optimizer_step(&mut self) -> Result<()> {
        self.step()
    }
    fn supports_device_scaling(&self) -> bool {
        self.fused
    }
    fn step_with_device_scaling(
        &mut self,
        grad_scale: Option<&Tensor>,
        found_inf: &Tensor,
    ) -> Result<()> {
        self.step_impl(grad_scale, Some(found_inf))
    }
}

impl std::fmt::Debug for AdamWOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamWOptimizer")
            .field("fused", &self.fused)
            .field("sharded", &self.shard.is_some())
            .field("groups", &self.groups.len())
            .field("lrs", &self.lrs())
            .finish()
    }
}
