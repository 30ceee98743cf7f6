//! `#[speedkit::accelerate]` end to end on the CPU: the expansion compiles against the real
//! runtime, trains, routes losses through the scaler helpers, and restores every flag on return,
//! on `?` and on panic.

mod common;

use speedkit::flags::FlagState;
use speedkit::forward;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

fn data(device: tch::Device) -> (Tensor, Tensor) {
    let x = Tensor::randn([32, 4], (Kind::Float, device));
    let y = Tensor::zeros([32, 1], (Kind::Float, device));
    (x, y)
}

/// `?`-style entry, named context, `backward_step` routed through the scaler helper.
#[speedkit::accelerate(device = "cpu", deterministic = true, ctx = ctx)]
fn train_backward_step(steps: usize, before: &FlagState) -> anyhow::Result<Vec<f64>> {
    // The flags are applied for the body.
    assert!(
        !FlagState::capture()?.diff(before).is_empty(),
        "deterministic mode should be on"
    );
    let vs = nn::VarStore::new(ctx.device());
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let (x, y) = data(ctx.device());
    let mut losses = Vec::new();
    for _ in 0..steps {
        #[forward]
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        losses.push(loss.double_value(&[]));
    }
    Ok(losses)
}

/// Panicking entry, hidden context, `backward()` then `step()` with a `&mut` parameter.
#[speedkit::accelerate(device = "cpu")]
fn train_backward_then_step(opt: &mut nn::Optimizer, model: &nn::Linear, steps: usize) -> f64 {
    let (x, y) = data(tch::Device::Cpu);
    let mut last = f64::NAN;
    for _ in 0..steps {
        opt.zero_grad();
        #[speedkit::forward]
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        loss.backward();
        opt.step();
        last = loss.double_value(&[]);
    }
    last
}

#[speedkit::accelerate(device = "cpu", deterministic = true)]
fn fails_after_forward(x: &Tensor) -> anyhow::Result<()> {
    #[forward]
    let _y = x * 2;
    anyhow::bail!("stop")
}

#[speedkit::accelerate(device = "cpu", deterministic = true)]
fn panics_in_forward(x: &Tensor) {
    #[forward]
    {
        let _y = x * 2;
        panic!("boom");
    }
}

#[test]
fn backward_step_trains_and_restores_flags() {
    let _serial = common::serial();
    let before = FlagState::capture().unwrap();
    let losses = train_backward_step(20, &before).unwrap();
    assert!(losses[19] < losses[0], "{losses:?}");
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn backward_then_step_trains() {
    let _serial = common::serial();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let first = train_backward_then_step(&mut opt, &model, 1);
    let later = train_backward_then_step(&mut opt, &model, 20);
    assert!(later < first, "{first} -> {later}");
}

#[test]
fn flags_are_restored_on_question_mark_and_on_panic() {
    let _serial = common::serial();
    let before = FlagState::capture().unwrap();
    let x = Tensor::ones([2], (Kind::Float, tch::Device::Cpu));
    assert_eq!(fails_after_forward(&x).unwrap_err().to_string(), "stop");
    assert_eq!(FlagState::capture().unwrap(), before);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| panics_in_forward(&x)));
    assert!(panicked.is_err());
    assert_eq!(FlagState::capture().unwrap(), before);
}
