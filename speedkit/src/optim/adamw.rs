//! [`AdamWOptimizer`]: making it, its learning rates and gradients, and its step.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tch::{nn::VarStore, Device, Tensor};

use super::config::{param_groups, AdamW, ParamGroup};
use super::memory::{holdings_of, Holdings, OptimizerMemory};
use super::state::{make_buckets, Bucket, BucketState, Group};
use crate::amp::ScaledOptimizer;
use crate::dist::OptimizerShard;
use crate::error::{Result, SpeedkitError};
use crate::ffi::{
    self,
    optim::{AdamWHyper, AdamWLists},
};

/// The AdamW optimizer. See the [module docs](crate::optim).
pub struct AdamWOptimizer {
    holdings: Arc<Holdings>,
    pub(super) groups: Vec<Group>,
    beta1: f64,
    beta2: f64,
    eps: f64,
    fused: bool,
    grads_to_none: bool,
    shard: Option<OptimizerShard>,
    /// Its identity for graph mode's note of who dropped which gradients (crate::graph).
    id: u64,
}

/// The next [`AdamWOptimizer`]'s id.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
        // Under ZeRO-3 the pieces are what this rank holds of the parameters; under ZeRO-1 the
        // whole parameters.
        let held = (!shard.parameters_sharded()).then_some(whole);
        optimizer.holdings = Arc::new(holdings_of(&optimizer.groups, held));
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
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
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
            crate::graph::note_gradients_dropped(self.id);
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

    /// One AdamW step over parameters that have gradients, as they are: no GradScaler and no
    /// gradient synchronisation. In training, [`SpeedContext::backward_step`](crate::SpeedContext::backward_step)
    /// (or [`SpeedContext::step`](crate::SpeedContext::step)) calls this after unscaling, checking for
    /// infinities and reducing across ranks.
    pub fn step(&mut self) -> Result<()> {
        self.step_impl(None, None)
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
    pub(super) fn make_state(&mut self) -> Result<()> {
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
        crate::graph::note_gradients_stepped(self.id, self.params());
        self.make_state()?;
        let scaling = Scaling {
            grad_scale,
            found_inf,
        };
        for g in &self.groups {
            for b in &g.buckets {
                self.update(g, b, |_| true, &scaling)?;
            }
        }
        match &self.shard {
            Some(shard) => shard.gather(),
            None => Ok(()),
        }
    }

    /// [`ScaledOptimizer::step_in_parts`]: each part's parameters updated as soon as `ready` says
    /// their gradients are in, the parameters of no part last. Sharded, the parts are the sync's
    /// buckets: this rank's pieces of each are updated as its reduce-scatter lands, and its
    /// all-gather starts right after, beside the update of the next.
    fn step_parts(
        &mut self,
        parts: &[Vec<Tensor>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        self.make_state()?;
        let part_of = self.part_of_each_parameter(parts);
        let in_part = |want: Option<usize>| {
            let part_of = &part_of;
            move |p: &Tensor| part_of.get(&(p.data_ptr() as usize)).copied() == want
        };
        let scaling = Scaling::default();
        for k in (0..parts.len()).map(Some).chain([None]) {
            if let Some(k) = k {
                ready(k)?;
            }
            for g in &self.groups {
                for b in &g.buckets {
                    self.update(g, b, in_part(k), &scaling)?;
                }
            }
            if let (Some(shard), Some(k)) = (&self.shard, k) {
                shard.gather_bucket(k)?;
            }
        }
        crate::graph::record_gradients(self.params());
        crate::graph::note_gradients_stepped(self.id, self.params());
        match &self.shard {
            Some(shard) => shard.finish_gather(),
            None => Ok(()),
        }
    }

    /// The part of `parts` each of this optimizer's parameters belongs to, keyed by the
    /// parameter's data pointer: its own part, or, sharded, that of the whole parameter a piece
    /// is cut from.
    fn part_of_each_parameter(&self, parts: &[Vec<Tensor>]) -> HashMap<usize, usize> {
        let part_of: HashMap<usize, usize> = parts
            .iter()
            .enumerate()
            .flat_map(|(k, ps)| ps.iter().map(move |p| (p.data_ptr() as usize, k)))
            .collect();
        let Some(shard) = &self.shard else {
            return part_of;
        };
        let whole = shard.parameters();
        shard
            .pieces()
            .iter()
            .filter_map(|(piece, i)| {
                let k = part_of.get(&(whole.get(*i)?.data_ptr() as usize))?;
                Some((piece.data_ptr() as usize, *k))
            })
            .collect()
    }

    /// One AdamW update of the parameters of bucket `b` (of group `g`) that `selected` picks and
    /// that have a gradient (as in PyTorch, the others are skipped).
    fn update(
        &self,
        g: &Group,
        b: &Bucket,
        selected: impl Fn(&Tensor) -> bool,
        scaling: &Scaling,
    ) -> Result<()> {
        let mut idx = Vec::with_capacity(b.params.len());
        let mut grads = Vec::with_capacity(b.params.len());
        for (i, p) in b.params.iter().enumerate() {
            if !selected(p) {
                continue;
            }
            let grad = p.grad();
            if grad.defined() {
                idx.push(i);
                grads.push(grad);
            }
        }
        if grads.is_empty() {
            return Ok(());
        }
        let state = &b.state;
        let pick =
            |v: &[Tensor]| -> Vec<Tensor> { idx.iter().map(|&i| v[i].shallow_clone()).collect() };
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
        if !self.fused {
            return ffi::optim::foreach_adamw_(&lists, &hyper);
        }
        let on_device = |t: Option<&Tensor>| t.map(|t| t.f_to_device(b.lr.device())).transpose();
        let (scale, inf) = (
            on_device(scaling.grad_scale)?,
            on_device(scaling.found_inf)?,
        );
        // With speedkit's kernels on, its AdamW kernel updates every parameter in one launch (the
        // shim decides); with them off, ATen's fused AdamW.
        ffi::optim::fused_adamw_(&lists, &hyper, scale.as_ref(), inf.as_ref())
    }
}

/// The GradScaler's device tensors for a fused step: the scale to divide the gradients by, and
/// the flag that skips the step.
#[derive(Default)]
struct Scaling<'a> {
    grad_scale: Option<&'a Tensor>,
    found_inf: Option<&'a Tensor>,
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
    fn step_in_parts(
        &mut self,
        parts: &[Vec<Tensor>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        self.step_parts(parts, ready)
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
