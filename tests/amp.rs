//! Autocast scopes and the GradScaler, on the CPU (PyTorch's CPU kernels of the same ATen ops).

mod common;

use speedkit::amp::{autocast, AutocastGuard, AutocastState, GradScaler};
use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::plan::ScalerSettings;
use tch::{nn, Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn settings(init_scale: f64, growth_interval: u32) -> ScalerSettings {
    ScalerSettings {
        init_scale,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval,
    }
}

#[test]
fn autocast_runs_matmuls_in_the_requested_dtype() {
    let a = Tensor::randn([8, 8], (Kind::Float, CPU));
    assert_eq!(
        autocast(CPU, Kind::BFloat16, || a.matmul(&a))
            .unwrap()
            .kind(),
        Kind::BFloat16
    );
    assert_eq!(a.matmul(&a).kind(), Kind::Float);
}

#[test]
fn nested_autocast_restores_enabled_state_and_dtype_at_each_level() {
    let outside = AutocastState::current(CPU).unwrap();
    {
        let _outer = AutocastGuard::enter(CPU, Kind::BFloat16).unwrap();
        let in_outer = AutocastState::current(CPU).unwrap();
        assert_eq!(
            in_outer,
            AutocastState {
                enabled: true,
                dtype: Kind::BFloat16
            }
        );
        {
            let _inner = AutocastGuard::enter(CPU, Kind::Half).unwrap();
            assert_eq!(
                AutocastState::current(CPU).unwrap(),
                AutocastState {
                    enabled: true,
                    dtype: Kind::Half
                }
            );
        }
        assert_eq!(
            AutocastState::current(CPU).unwrap(),
            in_outer,
            "inner exit restores dtype too"
        );
    }
    assert_eq!(AutocastState::current(CPU).unwrap(), outside);
}

#[test]
fn autocast_state_is_restored_when_the_body_panics() {
    let outside = AutocastState::current(CPU).unwrap();
    let result =
        std::panic::catch_unwind(|| autocast(CPU, Kind::BFloat16, || panic!("forward failed")));
    assert!(result.is_err());
    assert_eq!(AutocastState::current(CPU).unwrap(), outside);
}

#[test]
fn a_disabled_scope_changes_nothing() {
    let before = AutocastState::current(CPU).unwrap();
    let guard = AutocastGuard::disabled();
    assert!(!guard.is_active());
    assert_eq!(AutocastState::current(CPU).unwrap(), before);
}

#[test]
fn autocast_rejects_non_float16_dtypes() {
    assert!(AutocastGuard::enter(CPU, Kind::Int64).is_err());
}

/// A one-parameter model whose gradient we control: loss = sum(w * g) ⇒ ∂loss/∂w = g.
fn model_with_gradient(g: &Tensor, fused: bool) -> (nn::VarStore, Tensor, AdamWOptimizer, Tensor) {
    let vs = nn::VarStore::new(CPU);
    let w = vs.root().randn("w", &[4], 0.0, 1.0);
    let opt = AdamWOptimizer::new(
        &vs,
        AdamW {
            lr: 0.1,
            ..Default::default()
        },
        fused,
    )
    .unwrap();
    let loss = (&w * g).sum(None);
    (vs, w, opt, loss)
}

fn scaler_skips_inf_step_and_halves_the_scale(fused: bool) {
    let scaler = GradScaler::new(Some(settings(1024.0, 2000)), CPU).unwrap();
    let g = Tensor::from_slice(&[1.0f32, f32::INFINITY, 0.0, 2.0]);
    let (_vs, w, mut opt, loss) = model_with_gradient(&g, fused);
    let before = w.copy();
    scaler.scale(&loss).unwrap().backward();
    scaler.step(&mut opt).unwrap();
    assert!(scaler.found_inf().unwrap());
    scaler.update().unwrap();
    assert_eq!(w, before, "an inf gradient must skip the step");
    assert_eq!(scaler.scale_value().unwrap(), 512.0);
    assert_eq!(
        opt.steps_taken().unwrap(),
        0,
        "a skipped step does not count"
    );
}

#[test]
fn scaler_skips_the_step_and_halves_the_scale_on_inf_foreach() {
    scaler_skips_inf_step_and_halves_the_scale(false);
}

#[test]
fn scaler_skips_the_step_and_halves_the_scale_on_inf_fused() {
    scaler_skips_inf_step_and_halves_the_scale(true);
}

#[test]
fn scaler_grows_the_scale_after_growth_interval_clean_steps() {
    let scaler = GradScaler::new(Some(settings(8.0, 3)), CPU).unwrap();
    let g = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
    let vs = nn::VarStore::new(CPU);
    let w = vs.root().randn("w", &[4], 0.0, 1.0);
    let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    let mut scales = Vec::new();
    for _ in 0..4 {
        opt.zero_grad().unwrap();
        scaler.scale(&(&w * &g).sum(None)).unwrap().backward();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        scales.push(scaler.scale_value().unwrap());
    }
    assert_eq!(scales, [8.0, 8.0, 16.0, 16.0]);
    assert_eq!(opt.steps_taken().unwrap(), 4);
}

#[test]
fn unscale_gives_the_true_gradient_for_clipping() {
    let scaler = GradScaler::new(Some(settings(1024.0, 2000)), CPU).unwrap();
    let g = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 4.0]);
    let (_vs, w, mut opt, loss) = model_with_gradient(&g, false);
    scaler.scale(&loss).unwrap().backward();
    assert_eq!(w.grad(), &g * 1024.0);
    scaler.unscale(&opt).unwrap();
    assert_eq!(w.grad(), g);
    let norm = opt.clip_grad_norm(1.0).unwrap();
    assert!((norm.double_value(&[]) - g.norm().double_value(&[])).abs() < 1e-5);
    assert!((w.grad().norm().double_value(&[]) - 1.0).abs() < 1e-4);
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    assert_eq!(opt.steps_taken().unwrap(), 1);
}

#[test]
fn unscaling_twice_in_one_step_is_refused() {
    let scaler = GradScaler::new(Some(settings(2.0, 10)), CPU).unwrap();
    let (_vs, _w, opt, loss) = model_with_gradient(&Tensor::ones([4], (Kind::Float, CPU)), false);
    scaler.scale(&loss).unwrap().backward();
    scaler.unscale(&opt).unwrap();
    let err = scaler.unscale(&opt).unwrap_err().to_string();
    assert!(err.contains("already"), "{err}");
}

#[test]
fn update_without_a_step_is_refused() {
    let scaler = GradScaler::new(Some(settings(2.0, 10)), CPU).unwrap();
    assert!(scaler.update().unwrap_err().to_string().contains("step()"));
}

#[test]
fn a_disabled_scaler_passes_through() {
    let scaler = GradScaler::disabled();
    let (_vs, w, mut opt, loss) =
        model_with_gradient(&Tensor::ones([4], (Kind::Float, CPU)), false);
    let before = w.copy();
    assert_eq!(scaler.scale(&loss).unwrap(), loss);
    loss.backward();
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    assert_ne!(w, before);
    assert_eq!(scaler.state().unwrap(), None);
}

#[test]
fn scaler_state_round_trips_through_a_checkpoint() {
    let mut scaler = GradScaler::new(Some(settings(4096.0, 7)), CPU).unwrap();
    let mut state = scaler.state().unwrap().unwrap();
    assert_eq!(
        (state.scale, state.growth_tracker, state.growth_interval),
        (4096.0, 0, 7)
    );
    state.scale = 128.0;
    state.growth_tracker = 5;
    scaler.load_state(&state).unwrap();
    assert_eq!(scaler.state().unwrap().unwrap(), state);
}
