//! Shared test helpers.
#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard};
use tch::Device;

static GLOBAL_FLAGS: Mutex<()> = Mutex::new(());

/// PyTorch's flags are process-global and the test harness runs tests on several threads: every
/// test that applies flags or reads them for a before/after comparison holds this lock.
pub fn serial() -> MutexGuard<'static, ()> {
    GLOBAL_FLAGS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The first CUDA device, or `None` after printing why the calling GPU test is skipped.
pub fn cuda_or_skip(test: &str) -> Option<Device> {
    if tch::Cuda::is_available() {
        Some(Device::Cuda(0))
    } else {
        eprintln!("skipped {test}: no CUDA device visible (GPU tests run on the GPU host)");
        None
    }
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_err(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    let a = a.to_kind(tch::Kind::Double).to_device(Device::Cpu);
    let b = b.to_kind(tch::Kind::Double).to_device(Device::Cpu);
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

/// The losses of `steps` runs of a training `step`: through a whole-step CUDA graph when `graphed`
/// (the capture must take), eagerly otherwise. The tests comparing the two share this loop.
pub fn run_steps<F>(ctx: &speedkit::SpeedContext, step: F, graphed: bool, steps: usize) -> Vec<f64>
where
    F: FnMut(&[tch::Tensor]) -> speedkit::Result<Option<tch::Tensor>>,
{
    let loss_of = |loss: speedkit::Result<Option<tch::Tensor>>| {
        loss.expect("the step runs")
            .expect("the step returns its loss")
            .double_value(&[])
    };
    if !graphed {
        let mut step = step;
        return (0..steps).map(|_| loss_of(step(&[]))).collect();
    }
    let mut g = ctx.graphed(step);
    let losses = (0..steps).map(|_| loss_of(g.run(&[]))).collect();
    assert!(
        g.is_graphed(),
        "expected a captured graph: {:?}",
        g.fallback_reason()
    );
    losses
}

/// Copies of a VarStore's trainable parameters, in its order.
pub fn trained_parameters(vs: &tch::nn::VarStore) -> Vec<tch::Tensor> {
    vs.trainable_variables()
        .iter()
        .map(|p| p.detach().copy())
        .collect()
}

/// Holds speedkit's override of `o` registered (`on`) or removed while the guard lives.
#[allow(dead_code)] // not every test file uses it
pub fn hold_override(o: speedkit::overrides::Override, on: bool) -> speedkit::flags::FlagGuard {
    use speedkit::flags::{FlagGuard, FlagSetting, FlagValue};
    FlagGuard::apply(&[FlagSetting::new(o.flag(), FlagValue::Bool(on), "test")])
        .expect("the override registers")
}

/// The largest relative gap, step by step, between a run's losses and the `reference` run's.
pub fn largest_relative_gap(run: &[f64], reference: &[f64]) -> f64 {
    run.iter()
        .zip(reference)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// How far a bf16 run on speedkit's kernels may stray from fp32 ([`largest_relative_gap`]) where
/// bf16 on ATen's kernels strays `gap_aten`: tests/training.rs's 5%, or ATen's own gap where a
/// memorised batch's small late losses make it larger, with a quarter of slack for the kernels'
/// other summation order.
pub fn bf16_tolerance(gap_aten: f64) -> f64 {
    0.05f64.max(1.25 * gap_aten)
}

/// y = exp(x), saving a detached alias of y; its backward records what `may_overwrite` said of
/// it and then writes the gradient into it where allowed.
pub struct ExpInPlace(pub std::sync::Arc<std::sync::Mutex<Option<bool>>>);

impl speedkit::function::Function for ExpInPlace {
    fn forward(
        &mut self,
        ctx: &mut speedkit::function::ForwardContext<'_>,
        inputs: &[tch::Tensor],
    ) -> speedkit::Result<Vec<tch::Tensor>> {
        let y = inputs[0].exp();
        ctx.save_for_backward(&[&y.detach()])?;
        Ok(vec![y])
    }

    fn backward(
        &mut self,
        ctx: &mut speedkit::function::BackwardContext<'_>,
        grads: &[Option<tch::Tensor>],
    ) -> speedkit::Result<Vec<Option<tch::Tensor>>> {
        let y = ctx.saved()?.remove(0);
        let g = grads[0].as_ref().expect("materialized");
        let reuse = ctx.may_overwrite(&y)?;
        *self.0.lock().unwrap() = Some(reuse);
        let dx = if reuse {
            y.shallow_clone().f_mul_(g)?
        } else {
            g * &y
        };
        Ok(vec![Some(dx)])
    }
}

/// y = x + b over x's rows, whose backward sums b's gradient as speedkit's `linear` does: the
/// output's gradient cast to `dy_kind` (the GEMMs' type), then `speedkit::nn::column_sums` into
/// b's type.
pub struct BiasAdd {
    pub dy_kind: tch::Kind,
}

impl speedkit::function::Function for BiasAdd {
    fn forward(
        &mut self,
        _ctx: &mut speedkit::function::ForwardContext<'_>,
        inputs: &[tch::Tensor],
    ) -> speedkit::Result<Vec<tch::Tensor>> {
        let (x, b) = (&inputs[0], &inputs[1]);
        Ok(vec![x + b.to_kind(x.kind())])
    }

    fn backward(
        &mut self,
        _ctx: &mut speedkit::function::BackwardContext<'_>,
        grads: &[Option<tch::Tensor>],
    ) -> speedkit::Result<Vec<Option<tch::Tensor>>> {
        let g = grads[0].as_ref().expect("materialized");
        let dy = g.to_kind(self.dy_kind);
        let db = speedkit::nn::column_sums(&dy, tch::Kind::Float)?;
        Ok(vec![Some(g.shallow_clone()), Some(db)])
    }
}

/// [`BiasAdd`]'s output for `x` and `b`.
pub fn bias_add(x: &tch::Tensor, b: &tch::Tensor, dy_kind: tch::Kind) -> tch::Tensor {
    speedkit::function::apply(BiasAdd { dy_kind }, &[x, b])
        .expect("bias add")
        .remove(0)
}
