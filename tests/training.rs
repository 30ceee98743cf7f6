//! Training fidelity: reduced precision follows the fp32 loss curve; a captured (graphed) step gives
//! the same parameters as the eager step. CPU versions run everywhere; CUDA versions run on the GPU
//! host and print the largest relative gap they saw.

mod common;

use speedkit::config::{AutoBool, DeviceChoice, Precision, SpeedConfig};
use speedkit::optim::AdamW;
use speedkit::SpeedContext;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// A learnable task: labels come from a fixed random "teacher", so the loss really decreases.
struct Task {
    x: Tensor,
    y: Tensor,
}

fn task(device: Device, batch: i64, width: i64, classes: i64) -> Task {
    tch::manual_seed(0);
    let x = Tensor::randn([batch, width], (Kind::Float, device));
    let teacher = Tensor::randn([width, classes], (Kind::Float, device));
    let y = x.matmul(&teacher).argmax(-1, false);
    Task { x, y }
}

fn mlp(vs: &nn::VarStore, width: i64, hidden: i64, classes: i64) -> impl Module {
    let root = vs.root();
    nn::seq()
        .add(nn::linear(&root / "l1", width, hidden, Default::default()))
        .add_fn(|x| x.gelu("tanh"))
        .add(nn::linear(&root / "l2", hidden, hidden, Default::default()))
        .add_fn(|x| x.gelu("tanh"))
        .add(nn::linear(
            &root / "l3",
            hidden,
            classes,
            Default::default(),
        ))
}

struct Run {
    losses: Vec<f64>,
    params: Vec<Tensor>,
}

/// Trains `steps` steps under `config` from the same initial weights (seed 1) and returns the loss
/// curve and final parameters. With `graphed`, the step runs through `SpeedContext::graphed`.
fn train(
    config: &SpeedConfig,
    device: Device,
    steps: usize,
    dims: (i64, i64, i64, i64),
    graphed: bool,
) -> Run {
    let (batch, width, hidden, classes) = dims;
    let data = task(device, batch, width, classes);
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(device);
    let model = mlp(&vs, width, hidden, classes);
    let ctx = SpeedContext::new(config).unwrap();
    ctx.prepare(&mut vs).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-3,
                wd: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
    let step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| model.forward(&data.x).cross_entropy_for_logits(&data.y));
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let losses = common::run_steps(&ctx, step, graphed, steps);
    let params = common::trained_parameters(&vs);
    Run { losses, params }
}

/// Largest |a − b| / |b| over the curves.
fn max_rel_gap(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

fn precision_config(device: DeviceChoice, precision: Precision) -> SpeedConfig {
    let mut c = SpeedConfig {
        device,
        precision,
        ..SpeedConfig::auto()
    };
    c.compile.enabled = AutoBool::Off;
    c
}

#[test]
fn bf16_autocast_on_cpu_follows_the_fp32_loss_curve() {
    let _lock = common::serial();
    let dims = (64, 32, 64, 8);
    let fp32 = train(
        &precision_config(DeviceChoice::Cpu, Precision::Fp32),
        Device::Cpu,
        60,
        dims,
        false,
    );
    let bf16 = train(
        &precision_config(DeviceChoice::Cpu, Precision::Bf16),
        Device::Cpu,
        60,
        dims,
        false,
    );
    assert!(
        fp32.losses[59] < 0.8 * fp32.losses[0],
        "the task must be learnable: {:?}",
        (fp32.losses[0], fp32.losses[59])
    );
    let gap = max_rel_gap(&bf16.losses, &fp32.losses);
    eprintln!("cpu bf16 vs fp32 over 60 steps: largest relative loss gap {gap:.4}");
    // bf16 keeps 8 bits of mantissa: per-step losses differ at the 1e-2 level, not more.
    assert!(gap < 0.05, "bf16 drifted from fp32 by {gap}");
}

const GPU_DIMS: (i64, i64, i64, i64) = (512, 256, 1024, 16);

#[test]
fn cuda_bf16_and_fp16_with_scaler_follow_fp32_over_200_steps() {
    let _lock = common::serial();
    let Some(device) =
        common::cuda_or_skip("cuda_bf16_and_fp16_with_scaler_follow_fp32_over_200_steps")
    else {
        return;
    };
    let cuda = DeviceChoice::Cuda(0);
    let mut strict = SpeedConfig::preset("fp32_strict").unwrap();
    strict.device = cuda;
    let fp32 = train(&strict, device, 200, GPU_DIMS, false);
    let bf16 = train(
        &precision_config(cuda, Precision::Bf16),
        device,
        200,
        GPU_DIMS,
        false,
    );
    let fp16_config = precision_config(cuda, Precision::Fp16);
    let fp16 = train(&fp16_config, device, 200, GPU_DIMS, false);
    assert!(
        fp32.losses[199] < 0.5 * fp32.losses[0],
        "the task must be learnable"
    );
    let (gap_bf16, gap_fp16) = (
        max_rel_gap(&bf16.losses, &fp32.losses),
        max_rel_gap(&fp16.losses, &fp32.losses),
    );
    eprintln!(
        "cuda, 200 steps: loss fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 {gap_bf16:.4}, fp16+GradScaler {gap_fp16:.4}",
        fp32.losses[0], fp32.losses[199]
    );
    assert!(
        gap_bf16 < 0.05 && gap_fp16 < 0.05,
        "bf16 {gap_bf16}, fp16 {gap_fp16}"
    );
}

fn graphed_matches_eager(precision: Precision, scaler: AutoBool) {
    let Some(device) = common::cuda_or_skip("graphed_step_matches_eager") else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), precision);
    config.grad_scaler.enabled = scaler;
    config.optimizer.fused = AutoBool::On;
    let eager = train(&config, device, 100, GPU_DIMS, false);
    config.compile.enabled = AutoBool::On;
    let graphed = train(&config, device, 100, GPU_DIMS, true);
    let worst = eager
        .params
        .iter()
        .zip(&graphed.params)
        .map(|(e, g)| common::rel_err(g, e))
        .fold(0.0, f64::max);
    eprintln!("graphed vs eager after 100 steps ({precision:?}, scaler {scaler:?}): largest parameter rel. error {worst:.2e}; final losses {:.5} / {:.5}", eager.losses[99], graphed.losses[99]);
    assert!(worst < 1e-3, "{worst}");
}

#[test]
fn cuda_graphed_step_matches_eager_without_scaler() {
    let _lock = common::serial();
    graphed_matches_eager(Precision::Bf16, AutoBool::Off);
}

#[test]
fn cuda_graphed_step_matches_eager_with_scaler() {
    let _lock = common::serial();
    graphed_matches_eager(Precision::Fp16, AutoBool::On);
}

#[test]
fn cuda_step_with_host_sync_falls_back_to_eager_and_says_why() {
    let _lock = common::serial();
    let Some(device) =
        common::cuda_or_skip("cuda_step_with_host_sync_falls_back_to_eager_and_says_why")
    else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Bf16);
    config.compile.enabled = AutoBool::On;
    let ctx = SpeedContext::new(&config).unwrap();
    let x = Tensor::randn([64, 64], (Kind::Float, device));
    let mut host_reads = 0;
    let mut g = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let y = x.matmul(&x).sum(None);
        host_reads += 1;
        let _ = y.f_double_value(&[])?; // a host synchronisation: not capturable
        Ok(Some(y))
    });
    for _ in 0..6 {
        g.run(&[]).unwrap();
    }
    assert!(!g.is_graphed());
    assert!(g.fallback_reason().unwrap().contains("cannot be captured"));
    drop(g);
    assert!(
        ctx.audit().notes.iter().any(|n| n.contains("graphs off")),
        "{:?}",
        ctx.audit().notes
    );
}

#[test]
fn cuda_random_numbers_work_after_a_capture_that_fell_back() {
    let _lock = common::serial();
    let Some(device) =
        common::cuda_or_skip("cuda_random_numbers_work_after_a_capture_that_fell_back")
    else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Fp32);
    config.compile.enabled = AutoBool::On;
    config.compile.warmup_steps = 1;
    let ctx = SpeedContext::new(&config).unwrap();
    let x = Tensor::randn([16, 16], (Kind::Float, device));
    let mut g = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        // Dropout draws from the device's generator, which the capture registers.
        let y = x.dropout(0.5, true).sum(None);
        let _ = y.f_double_value(&[])?; // a host synchronisation: the capture fails
        Ok(Some(y))
    });
    for _ in 0..3 {
        g.run(&[]).unwrap();
    }
    assert!(!g.is_graphed());
    drop(g);
    let drawn = Tensor::f_randn([1024], (Kind::Float, device));
    assert!(drawn.is_ok(), "{:?}", drawn.err());
    assert!(x.f_dropout(0.5, true).is_ok());
}

#[test]
fn a_first_optimizer_step_inside_a_capture_falls_back_to_eager_and_makes_the_state_there() {
    let _lock = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_first_optimizer_step_inside_a_capture_falls_back_to_eager_and_makes_the_state_there",
    ) else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Bf16);
    config.compile.enabled = AutoBool::On;
    config.compile.warmup_steps = 1;
    let ctx = SpeedContext::new(&config).unwrap();
    let vs = nn::VarStore::new(device);
    let layer = nn::linear(vs.root(), 32, 32, Default::default());
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let x = Tensor::randn([16, 32], (Kind::Float, device));
    // Gradient accumulation over two calls: the first optimizer step falls on the second call,
    // the one the graph captures.
    let mut calls = 0;
    let mut g = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        calls += 1;
        let loss = ctx
            .autocast(|| layer.forward(&x))
            .square()
            .mean(Kind::Float);
        ctx.backward(&loss)?;
        if calls >= 2 {
            ctx.step(&mut opt)?;
        }
        Ok(Some(loss))
    });
    for _ in 0..2 {
        g.run(&[]).unwrap();
    }
    assert!(!g.is_graphed());
    let reason = g.fallback_reason().unwrap_or_default().to_owned();
    assert!(
        reason.contains("AdamW makes its state at its first step"),
        "{reason}"
    );
    drop(g);
    assert_eq!(
        opt.steps_taken().unwrap(),
        1,
        "the eager re-run stepped once"
    );
    assert!(opt.memory().state >= 2 * opt.memory().parameters);
}

#[test]
fn cuda_new_input_shape_recaptures_and_the_cache_is_bounded() {
    let _lock = common::serial();
    let Some(device) =
        common::cuda_or_skip("cuda_new_input_shape_recaptures_and_the_cache_is_bounded")
    else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Bf16);
    config.compile.enabled = AutoBool::On;
    config.compile.max_graphs = 2;
    config.compile.warmup_steps = 1;
    let ctx = SpeedContext::new(&config).unwrap();
    let w = Tensor::randn([32, 32], (Kind::Float, device));
    let mut g = ctx.graphed(|inputs: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        Ok(Some(inputs[0].matmul(&w).sum(None)))
    });
    for rows in [8, 16, 24, 8] {
        for _ in 0..3 {
            let x = Tensor::randn([rows, 32], (Kind::Float, device));
            let out = g.run(&[&x]).unwrap().unwrap();
            let expect = x.matmul(&w).sum(None);
            assert!(
                common::rel_err(&out, &expect) < 1e-5,
                "replay with fresh inputs must compute on them"
            );
        }
    }
    assert!(g.is_graphed());
    drop(g);
    let notes = ctx.audit().notes;
    assert!(
        notes.iter().filter(|n| n.contains("captured")).count() >= 4,
        "{notes:?}"
    );
    assert!(notes.iter().any(|n| n.contains("evicted")), "{notes:?}");
}

#[test]
fn cuda_graphs_for_two_input_shapes_leave_each_steps_gradients_on_the_parameters() {
    let _lock = common::serial();
    let Some(device) = common::cuda_or_skip(
        "cuda_graphs_for_two_input_shapes_leave_each_steps_gradients_on_the_parameters",
    ) else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Fp32);
    config.compile.enabled = AutoBool::On;
    config.compile.max_graphs = 2;
    config.compile.warmup_steps = 1;
    let ctx = SpeedContext::new(&config).unwrap();
    let vs = nn::VarStore::new(device);
    let w = vs.root().randn("w", &[4, 32], 0.0, 1.0);
    // lr 0: the weights stay put, so each step's gradient depends on its input alone.
    let frozen = AdamW {
        lr: 0.0,
        wd: 0.0,
        ..Default::default()
    };
    let mut opt = ctx.adamw(&vs, frozen).unwrap();
    let mut g = ctx.graphed(|inputs: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = inputs[0].matmul(&w.tr()).sum(None);
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    // Shapes interleaved after both graphs exist: each replay must leave its own gradient.
    for rows in [8, 8, 8, 16, 16, 16, 8, 16, 8, 16] {
        let x = Tensor::randn([rows, 32], (Kind::Float, device));
        g.run(&[&x]).unwrap();
        // d(sum(x·wᵀ))/dw: every row of the gradient is the column sum of x.
        let expected = x.sum_dim_intlist(0, true, None).expand([4, 32], false);
        assert!(
            common::rel_err(&w.grad(), &expected) < 1e-2,
            "gradient after a step on {rows} rows"
        );
    }
    assert!(g.is_graphed(), "{:?}", g.fallback_reason());
}

/// Whether `w` had a gradient when each step began, and whether it had one after each, over
/// `steps` runs of a step that computes one and steps AdamW on it (its gradients zeroed in place
/// where `in_place`, else dropped).
fn gradients_at_start_and_end_of_steps(
    ctx: &SpeedContext,
    device: Device,
    steps: usize,
    in_place: bool,
) -> (Vec<bool>, Vec<bool>) {
    let vs = nn::VarStore::new(device);
    let w = vs.root().randn("w", &[4, 32], 0.0, 1.0);
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    opt.zero_grads_in_place(in_place);
    let x = Tensor::randn([8, 32], (Kind::Float, device));
    let mut at_start = Vec::new();
    let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        if !speedkit::graph::is_capturing() {
            at_start.push(w.grad().defined());
        }
        let loss = x.matmul(&w.tr()).sum(None);
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    let mut at_end = Vec::new();
    for _ in 0..steps {
        step.run(&[]).unwrap();
        at_end.push(w.grad().defined());
    }
    drop(step);
    (at_start, at_end)
}

#[test]
fn an_eager_step_begins_without_the_gradients_its_optimizer_drops_and_ends_with_its_own() {
    let _lock = common::serial();
    let ctx = SpeedContext::new(&precision_config(DeviceChoice::Cpu, Precision::Fp32)).unwrap();
    let (at_start, at_end) = gradients_at_start_and_end_of_steps(&ctx, Device::Cpu, 4, false);
    assert_eq!(
        at_start, [false; 4],
        "the forward passes held the last step's gradients"
    );
    assert_eq!(
        at_end, [true; 4],
        "a step's gradients are on the parameters after it"
    );
}

#[test]
fn a_step_whose_optimizer_zeroes_its_gradients_in_place_begins_with_them() {
    let _lock = common::serial();
    let ctx = SpeedContext::new(&precision_config(DeviceChoice::Cpu, Precision::Fp32)).unwrap();
    let (at_start, _) = gradients_at_start_and_end_of_steps(&ctx, Device::Cpu, 3, true);
    assert_eq!(
        at_start,
        [false, true, true],
        "code that holds its gradients keeps them"
    );
}

#[test]
fn cuda_warm_up_steps_and_the_capture_begin_without_the_gradients_their_optimizer_drops() {
    let _lock = common::serial();
    let Some(device) = common::cuda_or_skip(
        "cuda_warm_up_steps_and_the_capture_begin_without_the_gradients_their_optimizer_drops",
    ) else {
        return;
    };
    let mut config = precision_config(DeviceChoice::Cuda(0), Precision::Fp32);
    config.compile.enabled = AutoBool::On;
    config.compile.warmup_steps = 3;
    let ctx = SpeedContext::new(&config).unwrap();
    // Three warm-up steps, the capture (not seen from inside: it is recorded), two replays.
    let (at_start, at_end) = gradients_at_start_and_end_of_steps(&ctx, device, 6, false);
    assert_eq!(
        at_start, [false; 3],
        "a warm-up's forward held the last step's gradients"
    );
    assert_eq!(
        at_end, [true; 6],
        "a step's gradients are on the parameters after it"
    );
}
