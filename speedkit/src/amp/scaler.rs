//! Gradient scaling for fp16 training, with `torch.amp.GradScaler`'s semantics and defaults.
//!
//! The scale and the growth tracker live on the device and are updated by ATen's own ops
//! (`_amp_foreach_non_finite_check_and_unscale_`, `_amp_update_scale_`), so a step costs no host
//! synchronisation with optimizers that take the scaler's tensors (speedkit's [`AdamW`]); with other
//! optimizers (`tch::nn::Optimizer`) the skip decision reads `found_inf` on the host, as PyTorch does
//! for non-fused optimizers. A disabled scaler passes everything through at no cost.
//!
//! A step is `scale(loss).backward()` → optionally `unscale(opt)` (to clip gradients) → `step(opt)`
//! (skipped when any gradient is inf/NaN) → `update()` (back off on inf/NaN, grow after
//! `growth_interval` clean steps).
//!
//! [`AdamW`]: crate::optim::AdamW

use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

use crate::dist::ProcessGroup;
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::plan::ScalerSettings;

/// An optimizer a [`GradScaler`] can drive.
pub trait ScaledOptimizer {
    /// The defined gradients of the parameters this optimizer updates.
    fn gradients(&self) -> Vec<Tensor>;
    /// Zeroes the gradients.
    fn zero_gradients(&mut self) -> Result<()>;
    /// One plain optimizer step.
    fn optimizer_step(&mut self) -> Result<()>;
    /// One plain step (no GradScaler) over the parameters, whose gradients become ready in
    /// `parts`, in order: `ready(k)` must be called before any parameter of part `k` is read, and
    /// may be called as late as that. The default waits for every part, then steps; an optimizer
    /// that updates parameters in groups can step each part as it lands.
    fn step_in_parts(
        &mut self,
        parts: &[Vec<Tensor>],
        ready: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        (0..parts.len()).try_for_each(&mut *ready)?;
        self.optimizer_step()
    }
    /// Whether [`step_with_device_scaling`](Self::step_with_device_scaling) is supported: the
    /// optimizer unscales by `grad_scale` and skips on `found_inf` on the device.
    fn supports_device_scaling(&self) -> bool {
        false
    }
    /// A step that unscales by `grad_scale` (when given) and is skipped where `found_inf != 0`,
    /// entirely on the device.
    fn step_with_device_scaling(
        &mut self,
        grad_scale: Option<&Tensor>,
        found_inf: &Tensor,
    ) -> Result<()> {
        let _ = (grad_scale, found_inf);
        Err(SpeedkitError::Misuse(
            "this optimizer cannot take the scaler's device tensors".into(),
        ))
    }
}

impl ScaledOptimizer for tch::nn::Optimizer {
    fn gradients(&self) -> Vec<Tensor> {
        self.trainable_variables()
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect()
    }
    // tch's optimizer reports libtorch errors by panicking; there is no fallible variant to call.
    fn zero_gradients(&mut self) -> Result<()> {
        self.zero_grad();
        Ok(())
    }
    fn optimizer_step(&mut self) -> Result<()> {
        self.step();
        Ok(())
    }
}

/// The scaler's state, for checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// Current scale.
    pub scale: f64,
    /// Consecutive clean steps since the last growth or back-off.
    pub growth_tracker: i64,
    /// Growth factor.
    pub growth_factor: f64,
    /// Back-off factor.
    pub backoff_factor: f64,
    /// Growth interval.
    pub growth_interval: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// Per-step bookkeeping, keyed by optimizer identity (as PyTorch keys by `id(optimizer)`).
#[derive(Default)]
struct StepState {
    optimizers: Vec<(usize, Stage, Tensor)>,
}

struct Enabled {
    settings: ScalerSettings,
    scale: Tensor,
    growth_tracker: Tensor,
}

/// Dynamic loss scaling. See the [module docs](self).
///
/// ```
/// use speedkit::{amp::GradScaler, plan::ScalerSettings};
/// use tch::{Device, Kind, Tensor};
/// let settings = ScalerSettings { init_scale: 1024.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 };
/// let scaler = GradScaler::new(Some(settings), Device::Cpu)?;
/// let loss = Tensor::from(3.0f32);
/// assert_eq!(scaler.scale(&loss)?.double_value(&[]), 3072.0);
/// assert_eq!(GradScaler::disabled().scale(&loss)?.double_value(&[]), 3.0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub struct GradScaler {
    enabled: Option<Enabled>,
    device: Device,
    step: RefCell<StepState>,
    // Under data parallelism: found_inf is agreed across ranks, so that every rank skips the same
    // steps and the replicas stay identical.
    group: Option<Rc<ProcessGroup>>,
}

fn optimizer_id<O: ?Sized>(opt: &O) -> usize {
    opt as *const O as *const () as usize
}

impl GradScaler {
    /// A scaler on `device`, enabled when `settings` is `Some`.
    pub fn new(settings: Option<ScalerSettings>, device: Device) -> Result<Self> {
        let enabled = match settings {
            None => None,
            Some(s) => Some(Enabled {
                scale: Tensor::f_full([] as [i64; 0], s.init_scale, (Kind::Float, device))?,
                growth_tracker: Tensor::f_full([] as [i64; 0], 0, (Kind::Int, device))?,
                settings: s,
            }),
        };
        Ok(Self {
            enabled,
            device,
            step: RefCell::new(StepState::default()),
            group: None,
        })
    }

    /// Makes every inf/NaN check an agreement of all ranks of `group` (all-reduce max).
    pub(crate) fn agree_across(&mut self, group: Rc<ProcessGroup>) {
        self.group = Some(group);
    }

    /// A pass-through scaler.
    pub fn disabled() -> Self {
        Self {
            enabled: None,
            device: Device::Cpu,
            step: RefCell::new(StepState::default()),
            group: None,
        }
    }

    /// Whether the scaler scales.
    pub fn is_enabled(&self) -> bool {
        self.enabled.is_some()
    }

    /// `loss × scale` (a shallow copy of `loss` when disabled).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        match &self.enabled {
            None => Ok(loss.shallow_clone()),
            Some(e) => Ok(loss.f_mul(&e.scale.f_to_device(loss.device())?)?),
        }
    }

    /// The scale tensor on the device (for optimizers that unscale themselves), if enabled.
    pub fn scale_tensor(&self) -> Option<&Tensor> {
        self.enabled.as_ref().map(|e| &e.scale)
    }

    /// Divides `opt`'s gradients by the scale in place and records whether any is inf/NaN. Call it
    /// between backward and step to clip or inspect true gradients; at most once per step.
    pub fn unscale<O: ScaledOptimizer + ?Sized>(&self, opt: &O) -> Result<()> {
        let Some(e) = &self.enabled else {
            return Ok(());
        };
        let id = optimizer_id(opt);
        let mut st = self.step.borrow_mut();
        if let Some((_, stage, _)) = st.optimizers.iter().find(|(i, ..)| *i == id) {
            return Err(SpeedkitError::Misuse(match stage {
                Stage::Unscaled => {
                    "unscale() was already called on this optimizer since the last update()".into()
                }
                Stage::Stepped => {
                    "unscale() is being called after step(); call update() first".into()
                }
            }));
        }
        let inv_scale = e
            .scale
            .f_to_kind(Kind::Double)?
            .f_reciprocal()?
            .f_to_kind(Kind::Float)?;
        let found_inf = self.check_and_unscale(&opt.gradients(), &inv_scale)?;
        st.optimizers.push((id, Stage::Unscaled, found_inf));
        Ok(())
    }

    /// `_amp_foreach_non_finite_check_and_unscale_` over `grads`, grouped by device and dtype as
    /// the op requires; returns the combined found-inf flag (0-dim float on the scaler's device).
    fn check_and_unscale(&self, grads: &[Tensor], inv_scale: &Tensor) -> Result<Tensor> {
        let mut found_inf = Tensor::f_zeros([] as [i64; 0], (Kind::Float, self.device))?;
        let mut groups: Vec<((Device, Kind), Vec<Tensor>)> = Vec::new();
        for g in grads {
            let key = (g.device(), g.kind());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(g.shallow_clone()),
                None => groups.push((key, vec![g.shallow_clone()])),
            }
        }
        for ((device, _), list) in &groups {
            if *device == self.device {
                ffi::amp::unscale_(list, &found_inf, inv_scale)?;
            } else {
                let local = Tensor::f_zeros([] as [i64; 0], (Kind::Float, *device))?;
                ffi::amp::unscale_(list, &local, &inv_scale.f_to_device(*device)?)?;
                let _ = found_inf.f_add_(&local.f_to_device(self.device)?)?;
            }
        }
        if let Some(group) = &self.group {
            group.all_reduce_max_(&found_inf)?;
        }
        Ok(found_inf)
    }

    /// Steps `opt` unless a gradient is inf/NaN: on the device for optimizers that support it, else by
    /// reading `found_inf` on the host (as PyTorch does for non-fused optimizers).
    pub fn step<O: ScaledOptimizer + ?Sized>(&self, opt: &mut O) -> Result<()> {
        let Some(e) = &self.enabled else {
            return opt.optimizer_step();
        };
        let id = optimizer_id(opt);
        let stage = self
            .step
            .borrow()
            .optimizers
            .iter()
            .find(|(i, ..)| *i == id)
            .map(|(_, s, _)| *s);
        if stage == Some(Stage::Stepped) {
            return Err(SpeedkitError::Misuse(
                "step() was already called on this optimizer since the last update()".into(),
            ));
        }
        if opt.supports_device_scaling() {
            // As PyTorch for fused optimizers: check (without unscaling) unless unscale() already ran,
            // then let the kernel unscale by grad_scale and skip on found_inf.
            let (found_inf, grad_scale) = match stage {
                Some(Stage::Unscaled) => (self.found_inf_of(id)?, None),
                _ => {
                    let one = Tensor::f_ones([] as [i64; 0], (Kind::Float, self.device))?;
                    (
                        self.check_and_unscale(&opt.gradients(), &one)?,
                        Some(&e.scale),
                    )
                }
            };
            opt.step_with_device_scaling(grad_scale, &found_inf)?;
            self.set_stage(id, Stage::Stepped, found_inf);
            return Ok(());
        }
        if stage.is_none() {
            self.unscale(&*opt)?;
        }
        let found_inf = self.found_inf_of(id)?;
        if found_inf.f_double_value(&[])? == 0.0 {
            opt.optimizer_step()?;
        }
        self.set_stage(id, Stage::Stepped, found_inf);
        Ok(())
    }

    fn found_inf_of(&self, id: usize) -> Result<Tensor> {
        self.step
            .borrow()
            .optimizers
            .iter()
            .find(|(i, ..)| *i == id)
            .map(|(.., t)| t.shallow_clone())
            .ok_or_else(|| SpeedkitError::Misuse("no inf check recorded for this optimizer".into()))
    }

    fn set_stage(&self, id: usize, stage: Stage, found_inf: Tensor) {
        let mut st = self.step.borrow_mut();
        st.optimizers.retain(|(i, ..)| *i != id);
        st.optimizers.push((id, stage, found_inf));
    }

    /// Updates the scale from this step's inf checks: × `backoff_factor` if any optimizer saw inf/NaN,
    /// × `growth_factor` after `growth_interval` clean steps. On the device, no synchronisation.
    pub fn update(&self) -> Result<()> {
        let Some(e) = &self.enabled else {
            return Ok(());
        };
        let mut st = self.step.borrow_mut();
        if st.optimizers.is_empty() {
            return Err(SpeedkitError::Misuse(
                "update() found no inf checks: call step() (or unscale()) before update()".into(),
            ));
        }
        let mut found = st.optimizers[0].2.shallow_clone();
        for (.., other) in &st.optimizers[1..] {
            found = found.f_add(other)?;
        }
        let mut scale = e.scale.shallow_clone();
        let _ = scale.f_internal_amp_update_scale_(
            &e.growth_tracker,
            &found,
            e.settings.growth_factor,
            e.settings.backoff_factor,
            i64::from(e.settings.growth_interval),
        )?;
        st.optimizers.clear();
        Ok(())
    }

    /// Forgets this step's unscale/step records (after a failed graph capture left them half-done).
    pub(crate) fn reset_step_state(&self) {
        self.step.borrow_mut().optimizers.clear();
    }

    /// The current scale (reads the device: a synchronisation). 1.0 when disabled.
    pub fn scale_value(&self) -> Result<f64> {
        match &self.enabled {
            None => Ok(1.0),
            Some(e) => Ok(e.scale.f_double_value(&[])?),
        }
    }

    /// Whether the last `step()` was skipped for inf/NaN gradients (a synchronisation), until the
    /// next `update()`.
    pub fn found_inf(&self) -> Result<bool> {
        let st = self.step.borrow();
        for (.., t) in &st.optimizers {
            if t.f_double_value(&[])? != 0.0 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The state to checkpoint; `None` when disabled.
    pub fn state(&self) -> Result<Option<GradScalerState>> {
        let Some(e) = &self.enabled else {
            return Ok(None);
        };
        Ok(Some(GradScalerState {
            scale: e.scale.f_double_value(&[])?,
            growth_tracker: e.growth_tracker.f_int64_value(&[])?,
            growth_factor: e.settings.growth_factor,
            backoff_factor: e.settings.backoff_factor,
            growth_interval: e.settings.growth_interval,
        }))
    }

    /// Restores a checkpointed state.
    pub fn load_state(&mut self, state: &GradScalerState) -> Result<()> {
        let Some(e) = &mut self.enabled else {
            return Err(SpeedkitError::Misuse(
                "cannot load state into a disabled GradScaler".into(),
            ));
        };
        let _ = e.scale.f_fill_(state.scale)?;
        let _ = e.growth_tracker.f_fill_(state.growth_tracker)?;
        e.settings.growth_factor = state.growth_factor;
        e.settings.backoff_factor = state.backoff_factor;
        e.settings.growth_interval = state.growth_interval;
        Ok(())
    }
}

impl std::fmt::Debug for GradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("enabled", &self.is_enabled())
            .field("settings", &self.enabled.as_ref().map(|e| &e.settings))
            .finish()
    }
}
