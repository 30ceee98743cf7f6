//! The operator overrides' kernels against ATen's, forward and backward, on odd shapes in fp32,
//! bf16 and fp16; inputs they do not take run ATen's kernel and are noted; an unchanged tch model
//! trains on them under autocast and in a whole-step CUDA graph. Skipped, with the reason printed,
//! without a GPU.

mod common;

use speedkit::kernels::{KernelOp, NoteMark, Outcome};
use speedkit::memory::MemoryUse;
use speedkit::overrides::Override;
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

fn hold(on: bool) -> speedkit::flags::FlagGuard {
    common::hold_override(Override::LayerNorm, on)
}

/// y, dx, dweight, dbias of a LayerNorm over the last dimension, for a fixed upstream gradient.
fn layer_norm_pass(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, dy: &Tensor) -> Vec<Tensor> {
    let x = x.detach().set_requires_grad(true);
    let w = w.map(|t| t.detach().set_requires_grad(true));
    let b = b.map(|t| t.detach().set_requires_grad(true));
    let width = x.size().last().copied().unwrap();
    let y = x.layer_norm([width], w.as_ref(), b.as_ref(), 1e-5, false);
    // The gradient arriving at y is dy.
    (&y * dy).sum(Kind::Float).backward();
    let grad = |t: Option<&Tensor>| {
        t.map_or_else(
            || Tensor::zeros([1], (Kind::Float, x.device())),
            Tensor::grad,
        )
    };
    vec![y.detach(), x.grad(), grad(w.as_ref()), grad(b.as_ref())]
}

#[test]
fn layer_norm_matches_aten_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("layer_norm_matches_aten_forward_and_backward_on_odd_shapes")
    else {
        return;
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let tolerance = if kind == Kind::Float { 1e-5 } else { 2e-2 };
        for shape in [
            vec![3, 7, 129],
            vec![1000, 768],
            vec![5, 2, 3, 1000],
            vec![64, 1024],
        ] {
            let width = *shape.last().unwrap();
            let x = Tensor::randn(shape.as_slice(), (kind, device)) * 3.0 + 1.0;
            let dy = Tensor::randn(shape.as_slice(), (kind, device));
            let w = Tensor::randn([width], (kind, device));
            let b = Tensor::randn([width], (kind, device));
            for (w, b) in [(Some(&w), Some(&b)), (Some(&w), None), (None, None)] {
                let aten = {
                    let _off = hold(false);
                    layer_norm_pass(&x, w, b, &dy)
                };
                let mark = NoteMark::now();
                let ours = {
                    let _on = hold(true);
                    layer_norm_pass(&x, w, b, &dy)
                };
                let ran: u64 = mark
                    .since()
                    .iter()
                    .filter(|n| n.op == KernelOp::LayerNorm && n.outcome == Outcome::Ran)
                    .map(|n| n.count)
                    .sum();
                assert_eq!(
                    ran, 2,
                    "{kind:?} {shape:?}: forward and backward on the kernels"
                );
                for (name, (a, o)) in ["y", "dx", "dweight", "dbias"]
                    .iter()
                    .zip(aten.iter().zip(&ours))
                {
                    let err = common::rel_err(o, a);
                    assert!(
                        err < tolerance,
                        "{kind:?} {shape:?} {name}: relative error {err}"
                    );
                }
            }
        }
    }
}

#[test]
fn an_input_the_kernels_do_not_take_runs_atens_kernel_and_is_noted() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("an_input_the_kernels_do_not_take_runs_atens_kernel_and_is_noted")
    else {
        return;
    };
    let x = Tensor::randn([4, 6, 10], (Kind::Float, device));
    let expected = x.layer_norm([6, 10], None::<&Tensor>, None::<&Tensor>, 1e-5, false);
    let mark = NoteMark::now();
    let got = {
        let _on = hold(true);
        x.layer_norm([6, 10], None::<&Tensor>, None::<&Tensor>, 1e-5, false)
    };
    assert!(got.equal(&expected), "ATen's own kernel ran");
    let fallbacks = mark.fallbacks_since();
    assert!(
        fallbacks
            .iter()
            .any(|f| f.contains("normalised over 2 dimensions")),
        "{fallbacks:?}"
    );
}

#[test]
fn layer_norm_where_atens_kernels_are_faster_runs_them_and_is_noted() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("layer_norm_where_atens_kernels_are_faster_runs_them_and_is_noted")
    else {
        return;
    };
    let _on = hold(true);
    // Past 1024 columns.
    let wide = Tensor::randn([16, 4096], (Kind::Float, device)).set_requires_grad(true);
    let mark = NoteMark::now();
    let y = wide.layer_norm([4096], None::<&Tensor>, None::<&Tensor>, 1e-5, false);
    y.sum(Kind::Float).backward();
    let fell_back: u64 = mark
        .since()
        .iter()
        .filter(|n| matches!(&n.outcome, Outcome::FellBack(why) if why.contains("width 4096")))
        .map(|n| n.count)
        .sum();
    assert_eq!(
        fell_back,
        2,
        "forward and backward: {:?}",
        mark.fallbacks_since()
    );
    // The parameters' gradients alone (the input needs none).
    let x = Tensor::randn([16, 768], (Kind::Float, device));
    let w = Tensor::ones([768], (Kind::Float, device)).set_requires_grad(true);
    let mark = NoteMark::now();
    let y = x.layer_norm([768], Some(&w), None::<&Tensor>, 1e-5, false);
    (y * 2.0).sum(Kind::Float).backward();
    let fallbacks = mark.fallbacks_since();
    assert!(
        fallbacks.iter().any(|f| f.contains("no input gradient")),
        "{fallbacks:?}"
    );
    assert!(w.grad().defined());
}

#[test]
fn an_unchanged_tch_model_trains_on_the_overrides_under_autocast_and_in_a_graph() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "an_unchanged_tch_model_trains_on_the_overrides_under_autocast_and_in_a_graph",
    ) else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    assert!(Override::LayerNorm.is_registered().unwrap());
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::layer_norm(
            vs.root() / "ln1",
            vec![768],
            Default::default(),
        ))
        .add(nn::linear(vs.root() / "fc", 768, 768, Default::default()))
        .add(nn::layer_norm(
            vs.root() / "ln2",
            vec![768],
            Default::default(),
        ));
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([333, 768], (Kind::Float, device));
    let target = Tensor::randn([333, 768], (Kind::Float, device));
    let _ = speedkit::kernels::take_ops_run();
    let mut losses = Vec::new();
    let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| {
            (model.forward(&x).to_kind(Kind::Float) - &target)
                .square()
                .mean(Kind::Float)
        });
        opt.zero_grad();
        loss.backward();
        opt.step();
        Ok(Some(loss))
    });
    for _ in 0..30 {
        if let Some(loss) = step.run(&[]).unwrap() {
            losses.push(loss.double_value(&[]));
        }
    }
    assert!(speedkit::kernels::take_ops_run().contains(&"layer_norm"));
    assert!(Override::Linear.stats("aten::linear").unwrap().ran > 0);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last}");
    drop(step);
    drop(ctx);
    assert!(!Override::LayerNorm.is_registered().unwrap());
}

/// A training-mode BatchNorm of `x` with optional affine parameters and running statistics, and
/// its gradients for the upstream gradient `dy`: y, dx, dweight, dbias, running mean and variance
/// after the call (zeros of one element where absent).
fn batch_norm_pass(x: &Tensor, affine: bool, running: bool, dy: &Tensor) -> Vec<Tensor> {
    let device = x.device();
    let channels = x.size()[1];
    let x = x.detach().set_requires_grad(true);
    let param = |seed: f64| (Tensor::arange(channels, (Kind::Float, device)) * seed).sin() + 1.0;
    let w = affine.then(|| param(0.7).set_requires_grad(true));
    let b = affine.then(|| (param(1.3) - 1.0).set_requires_grad(true));
    let running_mean = running.then(|| param(0.3) - 1.0);
    let running_var = running.then(|| param(0.9));
    let y = x.batch_norm(
        w.as_ref(),
        b.as_ref(),
        running_mean.as_ref(),
        running_var.as_ref(),
        true,
        0.1,
        1e-5,
        true,
    );
    (&y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
    let or_none =
        |t: Option<Tensor>| t.unwrap_or_else(|| Tensor::zeros([1], (Kind::Float, device)));
    vec![
        y.detach(),
        x.grad(),
        or_none(w.as_ref().map(Tensor::grad)),
        or_none(b.as_ref().map(Tensor::grad)),
        or_none(running_mean),
        or_none(running_var),
    ]
}

/// (ran, declined) of the batch-norm overrides' forward and backward calls so far, whether ATen's
/// `batch_norm` reached them through its own kernel or cuDNN's.
fn batch_norm_calls() -> [(u64, u64); 2] {
    let count = |ops: [&str; 2]| {
        ops.iter().fold((0, 0), |(ran, declined), op| {
            let stats = Override::BatchNorm.stats(op).unwrap();
            (ran + stats.ran, declined + stats.declined)
        })
    };
    [
        count(["aten::native_batch_norm", "aten::cudnn_batch_norm"]),
        count([
            "aten::native_batch_norm_backward",
            "aten::cudnn_batch_norm_backward",
        ]),
    ]
}

/// The relative error allowed between speedkit's BatchNorm results in `kind` and ATen's: one
/// rounding of a 16-bit result apart at most, fp32 to the rounding of the sums.
fn batch_norm_tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Float => 1e-4,
        Kind::Half => 2e-3,
        _ => 1e-2,
    }
}

/// `t` [N, C, ...] with channels-last strides (the channel dimension moved last in memory).
fn channels_last(t: &Tensor) -> Tensor {
    let mut order: Vec<i64> = (0..t.dim() as i64).filter(|&d| d != 1).collect();
    order.push(1);
    let mut inverse = vec![0i64; order.len()];
    for (position, &dim) in order.iter().enumerate() {
        inverse[dim as usize] = position as i64;
    }
    t.permute(&order).contiguous().permute(&inverse)
}

#[test]
fn batch_norm_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("batch_norm_matches_atens_forward_and_backward_on_odd_shapes")
    else {
        return;
    };
    let names = ["y", "dx", "dweight", "dbias", "running mean", "running var"];
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (shape, affine, running) in [
            (vec![6, 24, 7, 5], true, true),
            (vec![3, 13, 5, 5], true, true),
            (vec![37, 40], true, true),
            (vec![4, 64, 9, 9], false, true),
            (vec![5, 16, 3, 3, 3], true, false),
            (vec![2, 3, 1, 2], true, true),
        ] {
            // Mean far from zero against the spread: the statistics must not cancel.
            let x = channels_last(
                &(Tensor::randn(shape.as_slice(), (Kind::Float, device)) * 2.0 + 30.0),
            )
            .to_kind(kind);
            // Laid out as the activations, as a network's gradients are.
            let dy = channels_last(&Tensor::randn(shape.as_slice(), (Kind::Float, device)));
            let aten = {
                let _off = common::hold_override(Override::BatchNorm, false);
                batch_norm_pass(&x, affine, running, &dy)
            };
            let _on = common::hold_override(Override::BatchNorm, true);
            let ours = batch_norm_pass(&x, affine, running, &dy);
            // ATen's batch_norm calls cuDNN's for fp32 and fp16 with both parameters, its own
            // kernel otherwise: one of the two ran, on speedkit's kernels, each way.
            assert_eq!(batch_norm_calls(), [(1, 0), (1, 0)], "{kind:?} {shape:?}");
            assert_eq!(
                ours[0].stride(),
                aten[0].stride(),
                "{kind:?} {shape:?}: y's layout"
            );
            assert_eq!(
                ours[1].stride(),
                aten[1].stride(),
                "{kind:?} {shape:?}: dx's layout"
            );
            for ((name, a), b) in names.iter().zip(&ours).zip(&aten) {
                let tolerance = match *name {
                    // fp32 whatever the activations' type.
                    "running mean" | "running var" => batch_norm_tolerance(Kind::Float),
                    _ => batch_norm_tolerance(kind),
                };
                let err = common::rel_err(a, b);
                assert!(
                    err < tolerance,
                    "{kind:?} {shape:?} {name}: relative error {err}"
                );
            }
        }
    }
}

#[test]
fn relu_of_a_batch_norm_output_runs_in_its_normalisation_pass_and_matches_aten() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "relu_of_a_batch_norm_output_runs_in_its_normalisation_pass_and_matches_aten",
    ) else {
        return;
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let x = channels_last(&Tensor::randn([8, 48, 5, 7], (Kind::Float, device))).to_kind(kind);
        let w = (Tensor::arange(48, (Kind::Float, device)) * 0.1).cos();
        let pass = |x: &Tensor| {
            let x = x.detach().set_requires_grad(true);
            let y = x.batch_norm(
                Some(&w),
                None::<&Tensor>,
                None::<&Tensor>,
                None::<&Tensor>,
                true,
                0.1,
                1e-5,
                true,
            );
            let r = y.relu();
            (&r * &r).sum(Kind::Float).backward();
            (r.detach(), x.grad())
        };
        let (r_aten, dx_aten) = {
            let _off = common::hold_override(Override::BatchNorm, false);
            pass(&x)
        };
        let _on = common::hold_override(Override::BatchNorm, true);
        let (r, dx) = pass(&x);
        let relu = Override::BatchNorm.stats("aten::relu").unwrap();
        assert_eq!((relu.ran, relu.declined), (1, 0), "{kind:?}: {relu:?}");
        assert_eq!(r.stride(), r_aten.stride(), "{kind:?}");
        let tolerance = batch_norm_tolerance(kind);
        for (name, a, b) in [("relu", &r, &r_aten), ("dx", &dx, &dx_aten)] {
            let err = common::rel_err(a, b);
            assert!(err < tolerance, "{kind:?} {name}: relative error {err}");
        }
        // A ReLU of anything else is ATen's.
        let other = Tensor::randn([5], (kind, device));
        assert!(other.relu().equal(&other.clamp_min(0.0)));
        let relu = Override::BatchNorm.stats("aten::relu").unwrap();
        assert_eq!(relu.declined, 1, "{kind:?}: {relu:?}");
    }
}

#[test]
fn a_residual_sum_and_its_relu_run_in_the_normalisation_pass_and_match_aten() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_residual_sum_and_its_relu_run_in_the_normalisation_pass_and_match_aten",
    ) else {
        return;
    };
    // Odd widths (no 16-byte loads) in fp16, a multiple of 8 channels in bf16 and fp32.
    for (kind, shape) in [
        (Kind::BFloat16, [6, 40, 7, 5]),
        (Kind::Float, [3, 16, 9, 3]),
        (Kind::Half, [5, 13, 4, 3]),
    ] {
        residual_sum_and_relu_match_aten(device, kind, shape);
    }
}

fn residual_sum_and_relu_match_aten(device: tch::Device, kind: Kind, shape: [i64; 4]) {
    let input = |seed: i64| {
        tch::manual_seed(seed);
        channels_last(&Tensor::randn(shape, (Kind::Float, device))).to_kind(kind)
    };
    let (a, b) = (input(1), input(2));
    let bn = |x: &Tensor| {
        x.batch_norm(
            None::<&Tensor>,
            None::<&Tensor>,
            None::<&Tensor>,
            None::<&Tensor>,
            true,
            0.1,
            1e-5,
            true,
        )
    };
    // relu(bn(a) + b), as a basic block with an identity shortcut; relu(bn(a) + bn(b)), as one
    // with a projection.
    for projected in [false, true] {
        let pass = || {
            let (a, b) = (
                a.detach().set_requires_grad(true),
                b.detach().set_requires_grad(true),
            );
            let skip = if projected { bn(&b) } else { b.shallow_clone() };
            let r = (bn(&a) + skip).relu();
            (&r * &r).sum(Kind::Float).backward();
            (r.detach(), a.grad(), b.grad())
        };
        let aten = {
            let _off = common::hold_override(Override::BatchNorm, false);
            pass()
        };
        let _on = common::hold_override(Override::BatchNorm, true);
        let ours = pass();
        let stats = |op| {
            let s = Override::BatchNorm.stats(op).unwrap();
            (s.ran, s.declined)
        };
        let what = format!("{kind:?} {shape:?} projected {projected}");
        assert_eq!(stats("aten::add.Tensor").0, 1, "{what}");
        assert_eq!(stats("aten::relu"), (1, 0), "{what}");
        let tolerance = batch_norm_tolerance(kind);
        for (name, x, y) in [
            ("relu", &ours.0, &aten.0),
            ("da", &ours.1, &aten.1),
            ("db", &ours.2, &aten.2),
        ] {
            let err = common::rel_err(x, y);
            assert!(err < tolerance, "{what} {name}: relative error {err}");
        }
    }
}

#[test]
fn a_batch_norm_output_read_by_another_operator_is_written_at_that_read() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_batch_norm_output_read_by_another_operator_is_written_at_that_read",
    ) else {
        return;
    };
    let x = channels_last(&Tensor::randn([4, 32, 6, 6], (Kind::BFloat16, device)));
    let forward = |x: &Tensor| {
        x.batch_norm(
            None::<&Tensor>,
            None::<&Tensor>,
            None::<&Tensor>,
            None::<&Tensor>,
            true,
            0.1,
            1e-5,
            true,
        )
    };
    let expected = {
        let _off = common::hold_override(Override::BatchNorm, false);
        forward(&x)
    };
    let _on = common::hold_override(Override::BatchNorm, true);
    let y = forward(&x);
    assert!(
        speedkit::deferred::is_pending(&y).unwrap(),
        "the normalisation waits for its reader"
    );
    // A ReLU in place is not the fused out-of-place one: the read writes y first.
    let _ = y.shallow_clone().relu_();
    assert!(!speedkit::deferred::is_pending(&y).unwrap());
    let err = common::rel_err(&y, &expected.relu());
    assert!(err < 1e-2, "relative error {err}");
}

#[test]
fn batch_norm_calls_its_kernels_do_not_take_run_atens_kernel_and_are_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "batch_norm_calls_its_kernels_do_not_take_run_atens_kernel_and_are_counted",
    ) else {
        return;
    };
    let x = channels_last(&Tensor::randn([4, 16, 6, 6], (Kind::BFloat16, device)));
    let (w, b) = (
        Tensor::ones([16], (Kind::Float, device)),
        Tensor::zeros([16], (Kind::Float, device)),
    );
    let (mean, var) = (
        Tensor::zeros([16], (Kind::Float, device)),
        Tensor::ones([16], (Kind::Float, device)),
    );
    let w16 = w.to_kind(Kind::BFloat16);
    type Call<'a> = Box<dyn Fn() -> Tensor + 'a>;
    let cases: [(&str, Call<'_>); 3] = [
        (
            "strides",
            Box::new(|| {
                x.contiguous().batch_norm(
                    Some(&w),
                    Some(&b),
                    Some(&mean),
                    Some(&var),
                    true,
                    0.1,
                    1e-5,
                    true,
                )
            }),
        ),
        (
            "eval mode",
            Box::new(|| {
                x.batch_norm(
                    Some(&w),
                    Some(&b),
                    Some(&mean),
                    Some(&var),
                    false,
                    0.1,
                    1e-5,
                    true,
                )
            }),
        ),
        (
            "fp32 parameters",
            Box::new(|| {
                x.batch_norm(
                    Some(&w16),
                    Some(&b.to_kind(Kind::BFloat16)),
                    None::<&Tensor>,
                    None::<&Tensor>,
                    true,
                    0.1,
                    1e-5,
                    true,
                )
            }),
        ),
    ];
    for (why, call) in cases {
        let expected = {
            let _off = common::hold_override(Override::BatchNorm, false);
            call()
        };
        let _on = common::hold_override(Override::BatchNorm, true);
        let got = call();
        assert!(got.equal(&expected), "{why}: ATen's kernel ran");
        let stats = Override::BatchNorm
            .stats("aten::native_batch_norm")
            .unwrap();
        assert_eq!((stats.ran, stats.declined), (0, 1), "{why}: {stats:?}");
        let last = stats.last_declined.unwrap_or_default();
        assert!(last.contains(why), "{why}: declined for {last}");
    }
}

/// `log_softmax(-1, Float)` of `x` under CUDA autocast and its gradient for the upstream gradient
/// `dy`: what tch's `cross_entropy_for_logits` runs on a classifier's logits.
fn log_softmax_pass(x: &Tensor, dy: &Tensor) -> (Tensor, Tensor) {
    let x = x.detach().set_requires_grad(true);
    let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        x.log_softmax(-1, Kind::Float)
    })
    .unwrap();
    (&y * dy).sum(Kind::Float).backward();
    (y.detach(), x.grad())
}

#[test]
fn log_softmax_under_autocast_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "log_softmax_under_autocast_matches_atens_forward_and_backward_on_odd_shapes",
    ) else {
        return;
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        for shape in [
            vec![7, 50257],
            vec![3, 5, 1000],
            vec![64, 8192],
            vec![5, 13],
            vec![2, 8],
        ] {
            let x = (Tensor::randn(shape.as_slice(), (Kind::Float, device)) * 4.0).to_kind(kind);
            let dy = Tensor::randn(shape.as_slice(), (Kind::Float, device));
            let (y_aten, dx_aten) = {
                let _off = common::hold_override(Override::LogSoftmax, false);
                log_softmax_pass(&x, &dy)
            };
            let _on = common::hold_override(Override::LogSoftmax, true);
            let (y, dx) = log_softmax_pass(&x, &dy);
            let stats = Override::LogSoftmax.stats("aten::log_softmax.int").unwrap();
            assert_eq!(
                (stats.ran, stats.declined),
                (1, 0),
                "{kind:?} {shape:?}: {stats:?}"
            );
            assert_eq!((y.kind(), dx.kind()), (Kind::Float, kind));
            let y_err = common::rel_err(&y, &y_aten);
            assert!(y_err < 1e-5, "{kind:?} {shape:?} y: relative error {y_err}");
            // Both round the same fp32 gradient to the logits' type: a last-bit difference at most.
            let dx_err = common::rel_err(&dx, &dx_aten);
            let tolerance = if kind == Kind::Half { 2e-3 } else { 1e-2 };
            assert!(
                dx_err < tolerance,
                "{kind:?} {shape:?} dx: relative error {dx_err}"
            );
        }
    }
}

#[test]
fn log_softmax_calls_its_kernels_do_not_take_run_autocasts_path_and_are_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "log_softmax_calls_its_kernels_do_not_take_run_autocasts_path_and_are_counted",
    ) else {
        return;
    };
    let x = Tensor::randn([6, 300], (Kind::BFloat16, device));
    let under_autocast =
        |f: &dyn Fn() -> Tensor| speedkit::amp::autocast(device, Kind::BFloat16, f).unwrap();
    type Call<'a> = Box<dyn Fn() -> Tensor + 'a>;
    let cases: [(&str, Call<'_>); 3] = [
        (
            "over dimension 0",
            Box::new(|| x.log_softmax(0, Kind::Float)),
        ),
        (
            "Float logits",
            Box::new(|| x.to_kind(Kind::Float).log_softmax(-1, None::<Kind>)),
        ),
        (
            "not contiguous",
            Box::new(|| x.tr().log_softmax(-1, Kind::Float)),
        ),
    ];
    for (why, call) in cases {
        let expected = {
            let _off = common::hold_override(Override::LogSoftmax, false);
            under_autocast(&*call)
        };
        let _on = common::hold_override(Override::LogSoftmax, true);
        let got = under_autocast(&*call);
        assert!(got.equal(&expected), "{why}: autocast's own path ran");
        let stats = Override::LogSoftmax.stats("aten::log_softmax.int").unwrap();
        assert_eq!((stats.ran, stats.declined), (0, 1), "{why}: {stats:?}");
        let last = stats.last_declined.unwrap_or_default();
        assert!(last.contains(why), "{why}: declined for {last}");
    }
}

#[test]
fn an_unchanged_tch_classifier_trains_on_the_log_softmax_override_in_a_graph() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "an_unchanged_tch_classifier_trains_on_the_log_softmax_override_in_a_graph",
    ) else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    assert!(Override::LogSoftmax.is_registered().unwrap());
    let vs = nn::VarStore::new(device);
    let model = nn::linear(vs.root() / "head", 256, 5000, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([333, 256], (Kind::Float, device));
    let targets = Tensor::randint(5000, [333], (Kind::Int64, device));
    let mut losses = Vec::new();
    let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| model.forward(&x).cross_entropy_for_logits(&targets));
        opt.zero_grad();
        loss.backward();
        opt.step();
        Ok(Some(loss))
    });
    for _ in 0..30 {
        if let Some(loss) = step.run(&[]).unwrap() {
            losses.push(loss.double_value(&[]));
        }
    }
    for op in Override::LogSoftmax.operators() {
        assert!(Override::LogSoftmax.stats(op).unwrap().ran > 0, "{op}");
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last}");
    let audit = ctx.audit().to_string();
    assert!(
        audit.contains("kernels: cross_entropy: ran on speedkit's kernel"),
        "{audit}"
    );
    drop(step);
    drop(ctx);
    assert!(!Override::LogSoftmax.is_registered().unwrap());
}

/// The loss `nll_loss(log_softmax(x))` under CUDA autocast, as tch's `cross_entropy_for_logits`
/// computes it with `reduction` and `ignore_index`, and the logits' gradient; `also` adds a second
/// use of the log-probabilities to the loss.
fn cross_entropy_pass(
    x: &Tensor,
    target: &Tensor,
    reduction: tch::Reduction,
    also: bool,
) -> (Tensor, Tensor) {
    let x = x.detach().set_requires_grad(true);
    let loss = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        let y = x.log_softmax(-1, Kind::Float);
        let nll = y.g_nll_loss(target, None::<&Tensor>, reduction, -100);
        if also {
            nll + y.exp().square().mean(Kind::Float)
        } else {
            nll
        }
    })
    .unwrap();
    loss.backward();
    (loss.detach(), x.grad())
}

#[test]
fn nll_loss_after_log_softmax_is_fused_and_matches_aten_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("nll_loss_after_log_softmax_is_fused_and_matches_aten_on_odd_shapes")
    else {
        return;
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, classes) in [(7, 50257), (64, 8192), (5, 13), (3, 8)] {
            for reduction in [tch::Reduction::Mean, tch::Reduction::Sum] {
                let x = (Tensor::randn([rows, classes], (Kind::Float, device)) * 4.0).to_kind(kind);
                // Every third row ignored (ATen's default ignore_index).
                let target = Tensor::randint(classes, [rows], (Kind::Int64, device)).index_fill(
                    0,
                    &Tensor::arange_start_step(0, rows, 3, (Kind::Int64, device)),
                    -100,
                );
                let case = format!("{kind:?} {rows}x{classes} {reduction:?}");
                let (loss_aten, dx_aten) = {
                    let _off = common::hold_override(Override::LogSoftmax, false);
                    cross_entropy_pass(&x, &target, reduction, false)
                };
                let _on = common::hold_override(Override::LogSoftmax, true);
                let (loss, dx) = cross_entropy_pass(&x, &target, reduction, false);
                let stats = Override::LogSoftmax.stats("aten::nll_loss").unwrap();
                assert_eq!((stats.ran, stats.declined), (1, 0), "{case}: {stats:?}");
                let loss_err = common::rel_err(&loss, &loss_aten);
                assert!(loss_err < 1e-5, "{case} loss: relative error {loss_err}");
                let dx_err = common::rel_err(&dx, &dx_aten);
                let tolerance = if kind == Kind::Half { 2e-3 } else { 1e-2 };
                assert!(dx_err < tolerance, "{case} dx: relative error {dx_err}");
            }
        }
    }
}

#[test]
fn log_probabilities_used_beside_the_nll_get_both_gradients() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("log_probabilities_used_beside_the_nll_get_both_gradients")
    else {
        return;
    };
    let x = Tensor::randn([9, 1000], (Kind::BFloat16, device));
    let target = Tensor::randint(1000, [9], (Kind::Int64, device));
    let (loss_aten, dx_aten) = {
        let _off = common::hold_override(Override::LogSoftmax, false);
        cross_entropy_pass(&x, &target, tch::Reduction::Mean, true)
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let (loss, dx) = cross_entropy_pass(&x, &target, tch::Reduction::Mean, true);
    assert_eq!(Override::LogSoftmax.stats("aten::nll_loss").unwrap().ran, 1);
    assert!(common::rel_err(&loss, &loss_aten) < 1e-5);
    let dx_err = common::rel_err(&dx, &dx_aten);
    assert!(dx_err < 1e-2, "dx: relative error {dx_err}");
}

#[test]
fn nll_loss_of_other_log_probabilities_runs_autocasts_path() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("nll_loss_of_other_log_probabilities_runs_autocasts_path")
    else {
        return;
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let x = Tensor::randn([4, 6, 10], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(10, [24], (Kind::Int64, device));
    let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
        // A view of speedkit's log-probabilities is not theirs: its node is the view's.
        x.log_softmax(-1, Kind::Float)
            .view([24, 10])
            .nll_loss(&target)
    })
    .unwrap();
    loss.backward();
    let stats = Override::LogSoftmax.stats("aten::nll_loss").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    let expected = {
        let x = x.detach().to_kind(Kind::Float).set_requires_grad(true);
        x.log_softmax(-1, Kind::Float)
            .view([24, 10])
            .nll_loss(&target)
            .backward();
        x.grad()
    };
    assert!(common::rel_err(&x.grad(), &expected) < 1e-2);
}

#[test]
fn the_fused_cross_entropy_keeps_no_fp32_log_probabilities_for_the_backward() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "the_fused_cross_entropy_keeps_no_fp32_log_probabilities_for_the_backward",
    ) else {
        return;
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let (rows, classes) = (512, 32768);
    let x = Tensor::randn([rows, classes], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let allocated = || MemoryUse::now(device).unwrap().allocated;
    let before = allocated();
    let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
        x.cross_entropy_for_logits(&target)
    })
    .unwrap();
    let held = allocated() - before;
    assert_eq!(Override::LogSoftmax.stats("aten::nll_loss").unwrap().ran, 1);
    // The log-probabilities alone would be rows × classes × 4 bytes (64 MiB); what the loss keeps
    // is per row (log-sum-exp, targets' count) and the loss itself.
    let log_probs = (rows * classes * 4) as u64;
    assert!(
        held < log_probs / 16,
        "the loss holds {held} bytes (the fp32 log-probabilities are {log_probs})"
    );
    loss.backward();
    assert_eq!(x.grad().kind(), Kind::BFloat16);
}

#[test]
fn the_fused_cross_entropy_never_writes_the_fp32_log_probabilities() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("the_fused_cross_entropy_never_writes_the_fp32_log_probabilities")
    else {
        return;
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let (rows, classes) = (512, 32768);
    let x = Tensor::randn([rows, classes], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let base = MemoryUse::now(device).unwrap().allocated;
    speedkit::memory::reset_peaks(device).unwrap();
    let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
        x.cross_entropy_for_logits(&target)
    })
    .unwrap();
    let peak = MemoryUse::now(device).unwrap().peak_allocated - base;
    // Deferred, never read but by the fused loss: the 64 MiB of log-probabilities never existed.
    let log_probs = (rows * classes * 4) as u64;
    assert!(
        peak < log_probs / 16,
        "the forward peaked {peak} bytes above its inputs (the log-probabilities are {log_probs})"
    );
    assert_eq!(speedkit::deferred::pending().unwrap().0, 0);
    loss.backward();
    assert_eq!(x.grad().kind(), Kind::BFloat16);
}

/// A classifier's loss over `h` [rows, d] and `w` [classes, d] under CUDA autocast (logits
/// `h.linear(w)`, viewed as [rows, classes] as a model's `[B, T, classes]` would be), its
/// gradients, and how far the backward's peak rose above what was allocated when it began;
/// `hold_logits` keeps the user's handle on the logits through the backward.
fn classifier_backward(
    h: &Tensor,
    w: &Tensor,
    target: &Tensor,
    hold_logits: bool,
) -> (Tensor, Tensor, u64) {
    let (h, w) = (
        h.detach().set_requires_grad(true),
        w.detach().set_requires_grad(true),
    );
    let device = h.device();
    let (loss, logits) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        let logits = h.linear(&w, None::<&Tensor>).view([1, -1, w.size()[0]]);
        (
            logits
                .view([-1, w.size()[0]])
                .cross_entropy_for_logits(target),
            logits,
        )
    })
    .unwrap();
    let logits = hold_logits.then_some(logits);
    let base = MemoryUse::now(device).unwrap().allocated;
    speedkit::memory::reset_peaks(device).unwrap();
    loss.backward();
    let rise = MemoryUse::now(device).unwrap().peak_allocated - base;
    drop(logits);
    (h.grad(), w.grad(), rise)
}

#[test]
fn the_logits_gradient_takes_the_logits_memory_once_nothing_else_holds_them() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "the_logits_gradient_takes_the_logits_memory_once_nothing_else_holds_them",
    ) else {
        return;
    };
    let _log_softmax = common::hold_override(Override::LogSoftmax, true);
    let (rows, d, classes) = (2048, 32, 32771);
    let h = Tensor::randn([rows, d], (Kind::Float, device));
    let w = Tensor::randn([classes, d], (Kind::Float, device)) * 0.1;
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let logits = (rows * classes * 2) as u64;
    // Through ATen's linear (autocast's casts) and speedkit's (tch's `nn::linear` on the override).
    for linear_override in [false, true] {
        let _linear = common::hold_override(Override::Linear, linear_override);
        let (dh_held, dw_held, rise_held) = classifier_backward(&h, &w, &target, true);
        let (dh, dw, rise) = classifier_backward(&h, &w, &target, false);
        // The same kernel writes the same values, wherever it writes them.
        assert_eq!(common::rel_err(&dh, &dh_held), 0.0);
        assert_eq!(common::rel_err(&dw, &dw_held), 0.0);
        assert!(
            rise_held >= logits,
            "with the logits held, the gradient is a tensor of its own: {rise_held} bytes"
        );
        assert!(
            rise < logits / 2,
            "linear override {linear_override}: the backward rose {rise} bytes above its start (the \
             bf16 logits are {logits})"
        );
    }
}

#[test]
fn log_probabilities_read_before_the_fused_loss_are_atens_at_that_read() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("log_probabilities_read_before_the_fused_loss_are_atens_at_that_read")
    else {
        return;
    };
    let x = Tensor::randn([37, 5003], (Kind::BFloat16, device)) * 3.0;
    let target = Tensor::randint(5003, [37], (Kind::Int64, device));
    let run = || {
        let x = x.detach().set_requires_grad(true);
        let (y, first_row, loss) = speedkit::amp::autocast(device, Kind::BFloat16, || {
            let y = x.log_softmax(-1, Kind::Float);
            // A view read before the loss: written at this read, whole.
            let first_row = y.narrow(0, 0, 1).copy();
            let loss = y.nll_loss(&target);
            (y, first_row, loss)
        })
        .unwrap();
        loss.backward();
        (y.detach(), first_row, loss.detach(), x.grad())
    };
    let aten = {
        let _off = common::hold_override(Override::LogSoftmax, false);
        run()
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let ours = run();
    assert_eq!(Override::LogSoftmax.stats("aten::nll_loss").unwrap().ran, 1);
    assert!(!speedkit::deferred::is_pending(&ours.0).unwrap());
    assert!(
        common::rel_err(&ours.0, &aten.0) < 1e-5,
        "log-probabilities"
    );
    assert!(
        common::rel_err(&ours.1, &aten.1) < 1e-5,
        "the row read first"
    );
    assert!(common::rel_err(&ours.2, &aten.2) < 1e-5, "loss");
    assert!(common::rel_err(&ours.3, &aten.3) < 1e-2, "logits' gradient");
}

#[test]
fn log_probabilities_read_beside_the_loss_every_step_are_written_in_one_pass_after_the_first() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "log_probabilities_read_beside_the_loss_every_step_are_written_in_one_pass_after_the_first",
    ) else {
        return;
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    // A shape no other test uses: the choice is remembered per shape.
    let x = Tensor::randn([23, 4099], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(4099, [23], (Kind::Int64, device));
    let mut deferred = Vec::new();
    for _ in 0..3 {
        let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
            let y = x.log_softmax(-1, Kind::Float);
            deferred.push(speedkit::deferred::is_pending(&y).unwrap());
            // Label smoothing: the log-probabilities are read beside the loss.
            y.nll_loss(&target) - y.mean(Kind::Float) * 0.1
        })
        .unwrap();
        loss.backward();
    }
    assert_eq!(deferred, [true, false, false]);
}

#[test]
fn under_the_fusion_the_log_probabilities_own_gradient_is_undefined_and_the_logits_exact() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "under_the_fusion_the_log_probabilities_own_gradient_is_undefined_and_the_logits_exact",
    ) else {
        return;
    };
    let x = Tensor::randn([9, 1000], (Kind::BFloat16, device));
    let target = Tensor::randint(1000, [9], (Kind::Int64, device));
    let (_, dx_aten) = {
        let _off = common::hold_override(Override::LogSoftmax, false);
        cross_entropy_pass(&x, &target, tch::Reduction::Mean, false)
    };
    let _on = common::hold_override(Override::LogSoftmax, true);
    let x = x.set_requires_grad(true);
    let (loss, y) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        let y = x.log_softmax(-1, Kind::Float);
        (y.nll_loss(&target), y)
    })
    .unwrap();
    let grads = Tensor::run_backward(&[&loss], &[&y, &x], false, false);
    assert!(
        !grads[0].defined(),
        "the loss reaches the logits, not the log-probabilities, in autograd's graph"
    );
    let dx_err = common::rel_err(&grads[1], &dx_aten);
    assert!(dx_err < 1e-2, "dx: relative error {dx_err}");
}

/// y, dx, dweight, dbias of `linear` under CUDA autocast (bf16) for a fixed upstream gradient.
fn linear_pass(x: &Tensor, w: &Tensor, b: Option<&Tensor>, dy: &Tensor) -> Vec<Tensor> {
    let x = x.detach().set_requires_grad(true);
    let w = w.detach().set_requires_grad(true);
    let b = b.map(|t| t.detach().set_requires_grad(true));
    let y =
        speedkit::amp::autocast(x.device(), Kind::BFloat16, || x.linear(&w, b.as_ref())).unwrap();
    (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
    let db = b.as_ref().map_or_else(
        || Tensor::zeros([1], (Kind::Float, x.device())),
        Tensor::grad,
    );
    vec![y.detach(), x.grad(), w.grad(), db]
}

#[test]
fn linear_under_autocast_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "linear_under_autocast_matches_atens_forward_and_backward_on_odd_shapes",
    ) else {
        return;
    };
    for x_kind in [Kind::Float, Kind::BFloat16] {
        for (x_shape, out) in [
            (vec![7, 33, 96], 50),
            (vec![5, 13], 7),
            (vec![256, 768], 2304),
        ] {
            for with_bias in [true, false] {
                let case = format!("{x_kind:?} {x_shape:?} -> {out} bias {with_bias}");
                let input = *x_shape.last().unwrap();
                let x = Tensor::randn(x_shape.as_slice(), (Kind::Float, device)).to_kind(x_kind);
                let w = Tensor::randn([out, input], (Kind::Float, device)) / (input as f64).sqrt();
                let b = with_bias.then(|| Tensor::randn([out], (Kind::Float, device)));
                let mut y_shape = x_shape.clone();
                *y_shape.last_mut().unwrap() = out;
                let dy = Tensor::randn(y_shape.as_slice(), (Kind::Float, device));
                let expected = {
                    let _off = common::hold_override(Override::Linear, false);
                    linear_pass(&x, &w, b.as_ref(), &dy)
                };
                let _on = common::hold_override(Override::Linear, true);
                let got = linear_pass(&x, &w, b.as_ref(), &dy);
                let stats = Override::Linear.stats("aten::linear").unwrap();
                assert_eq!((stats.ran, stats.declined), (1, 0), "{case}: {stats:?}");
                let kinds: Vec<Kind> = got.iter().map(Tensor::kind).collect();
                let expected_kinds: Vec<Kind> = expected.iter().map(Tensor::kind).collect();
                assert_eq!(kinds, expected_kinds, "{case}: the types autocast gives");
                // The same GEMMs on the same bf16 operands; the parameters' gradients are rounded
                // once (to fp32) where autocast rounds them to bf16 first.
                for (name, g, e) in [("y", 0, 0), ("dx", 1, 1), ("dw", 2, 2), ("db", 3, 3)] {
                    let err = common::rel_err(&got[g], &expected[e]);
                    assert!(err < 1e-2, "{case} {name}: relative error {err}");
                }
            }
        }
    }
}

#[test]
fn linear_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "linear_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted",
    ) else {
        return;
    };
    let x = Tensor::randn([6, 32], (Kind::Double, device));
    let w = Tensor::randn([8, 32], (Kind::Double, device));
    let expected =
        speedkit::amp::autocast(device, Kind::BFloat16, || x.linear(&w, None::<&Tensor>)).unwrap();
    let _on = common::hold_override(Override::Linear, true);
    let got =
        speedkit::amp::autocast(device, Kind::BFloat16, || x.linear(&w, None::<&Tensor>)).unwrap();
    assert_eq!(got.kind(), Kind::Double);
    assert!(got.equal(&expected), "autocast's own path ran");
    let stats = Override::Linear.stats("aten::linear").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    let last = stats.last_declined.unwrap_or_default();
    assert!(last.contains("Double operands"), "declined for {last}");
}

/// An MLP `fc2(gelu(fc1(x)))` under CUDA autocast (bf16), run twice on the same leaves (so that
/// kept weight copies exist before the second run): the output and the gradients of x and both
/// weights (summed over the two runs) for the upstream gradient `dy`, and the bytes the second
/// forward left allocated for the backward.
fn gelu_mlp_pass(
    x: &Tensor,
    w1: &Tensor,
    w2: &Tensor,
    dy: &Tensor,
    approximate: &str,
) -> (Vec<Tensor>, u64) {
    let [x, w1, w2] = [x, w1, w2].map(|t| t.detach().set_requires_grad(true));
    let run = || {
        let before = MemoryUse::now(x.device()).unwrap().allocated;
        let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
            x.linear(&w1, None::<&Tensor>)
                .gelu(approximate)
                .linear(&w2, None::<&Tensor>)
        })
        .unwrap();
        let held = MemoryUse::now(x.device()).unwrap().allocated - before;
        (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
        (vec![y.detach(), x.grad(), w1.grad(), w2.grad()], held)
    };
    let _ = run();
    run()
}

#[test]
fn a_linear_of_a_gelu_keeps_the_gelus_input_not_its_output_and_matches_aten() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_linear_of_a_gelu_keeps_the_gelus_input_not_its_output_and_matches_aten",
    ) else {
        return;
    };
    for approximate in ["none", "tanh"] {
        // Rows at least 4·d where the memory counts, so that both weights keep their copies
        // (linear.cpp) and the bytes held are the activations alone.
        for (rows, d) in [(401, 96), (5, 13), (3072, 768)] {
            let case = format!("gelu {approximate} {rows}x{d}");
            let x = Tensor::randn([rows, d], (Kind::Float, device));
            let w1 = Tensor::randn([4 * d, d], (Kind::Float, device)) / (d as f64).sqrt();
            let w2 = Tensor::randn([d, 4 * d], (Kind::Float, device)) / (4.0 * d as f64).sqrt();
            let dy = Tensor::randn([rows, d], (Kind::Float, device));
            let (expected, held_aten) = {
                let _off = common::hold_override(Override::Linear, false);
                gelu_mlp_pass(&x, &w1, &w2, &dy, approximate)
            };
            let _on = common::hold_override(Override::Linear, true);
            let (got, held) = gelu_mlp_pass(&x, &w1, &w2, &dy, approximate);
            // ATen's path keeps the GELU's bf16 output (and the weights' casts) for the backward.
            let gelu_output = (rows * 4 * d * 2) as u64;
            assert!(
                held + gelu_output <= held_aten,
                "{case}: the forward kept {held} bytes, ATen's {held_aten}"
            );
            for (name, g, e) in [("y", 0, 0), ("dx", 1, 1), ("dw1", 2, 2), ("dw2", 3, 3)] {
                let err = common::rel_err(&got[g], &expected[e]);
                assert!(err < 1e-2, "{case} {name}: relative error {err}");
            }
        }
    }
}

/// `f(x)`'s gradient with respect to `x`, itself differentiable (create_graph), under CUDA
/// autocast (bf16); then the backward of its squared sum, a gradient penalty: its error, if any.
fn gradient_penalty(x: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Result<Tensor, tch::TchError> {
    let x = x.detach().set_requires_grad(true);
    let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || f(&x)).unwrap();
    let g = Tensor::f_run_backward(
        &[y.to_kind(Kind::Float).sum(Kind::Float)],
        &[&x],
        true,
        true,
    )?
    .remove(0);
    g.to_kind(Kind::Float)
        .square()
        .sum(Kind::Float)
        .f_backward()?;
    Ok(x.grad())
}

#[test]
fn a_second_derivative_through_the_linear_and_cross_entropy_overrides_is_an_error_naming_them() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_second_derivative_through_the_linear_and_cross_entropy_overrides_is_an_error_naming_them",
    ) else {
        return;
    };
    let x = Tensor::randn([9, 64], (Kind::Float, device));
    let w = Tensor::randn([48, 64], (Kind::Float, device)) / 8.0;
    let target = Tensor::randint(48, [9], (Kind::Int64, device));
    let layer = |x: &Tensor| x.linear(&w, None::<&Tensor>).tanh();
    // bf16 logits, the ones the log_softmax override takes.
    let cross_entropy = |x: &Tensor| {
        x.to_kind(Kind::BFloat16)
            .log_softmax(-1, Kind::Float)
            .nll_loss(&target)
    };
    let through_aten = {
        let _off = common::hold_override(Override::Linear, false);
        gradient_penalty(&x, layer)
    };
    assert!(through_aten.is_ok(), "ATen's linear: {through_aten:?}");
    {
        let _on = common::hold_override(Override::Linear, true);
        let err = gradient_penalty(&x, layer).unwrap_err().to_string();
        assert!(
            err.contains("speedkit's fused Linear is differentiable once"),
            "{err}"
        );
        assert!(err.contains("kernels: false"), "{err}");
    }
    let _on = common::hold_override(Override::LogSoftmax, true);
    let err = gradient_penalty(&x, cross_entropy).unwrap_err().to_string();
    assert!(err.contains("CrossEntropy is differentiable once"), "{err}");
}

#[test]
fn a_second_derivative_through_the_layer_norm_override_equals_atens() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("a_second_derivative_through_the_layer_norm_override_equals_atens")
    else {
        return;
    };
    let x = Tensor::randn([7, 33, 96], (Kind::Float, device));
    let w = Tensor::randn([96], (Kind::Float, device));
    let layer_norm = |x: &Tensor| {
        x.layer_norm([96], Some(&w), None::<&Tensor>, 1e-5, false)
            .tanh()
    };
    let expected = {
        let _off = hold(false);
        gradient_penalty(&x, layer_norm).unwrap()
    };
    let mark = NoteMark::now();
    let got = {
        let _on = hold(true);
        gradient_penalty(&x, layer_norm).unwrap()
    };
    let ran = mark
        .since()
        .iter()
        .any(|n| n.op == KernelOp::LayerNorm && n.outcome == Outcome::Ran);
    assert!(ran, "the override's kernels ran");
    let err = common::rel_err(&got, &expected);
    assert!(err < 1e-2, "relative error {err}");
}

// ----- convolution under autocast ----------------------------------------------------------------

/// One convolution case: input and weight shapes, stride, padding, dilation (one value per spatial
/// dimension) and groups.
struct ConvCase {
    x: &'static [i64],
    w: &'static [i64],
    stride: &'static [i64],
    padding: &'static [i64],
    dilation: &'static [i64],
    groups: i64,
}

/// The convolution of `case` as tch's modules call it: `conv1d`, `conv2d` or `conv3d` by rank.
fn conv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, case: &ConvCase) -> Tensor {
    let (s, p, d, g) = (case.stride, case.padding, case.dilation, case.groups);
    match case.w.len() {
        3 => x.conv1d(w, b, s, p, d, g),
        4 => x.conv2d(w, b, s, p, d, g),
        _ => x.conv3d(w, b, s, p, d, g),
    }
}

/// y, dx, dweight, dbias of `case`'s convolution under CUDA autocast (bf16) for the upstream
/// gradient `dy`, and the bytes the forward left allocated besides `y`.
fn conv_pass(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    case: &ConvCase,
) -> (Vec<Tensor>, u64) {
    let x = x.detach().set_requires_grad(true);
    let w = w.detach().set_requires_grad(true);
    let b = b.map(|t| t.detach().set_requires_grad(true));
    let before = MemoryUse::now(x.device()).unwrap().allocated;
    let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        conv(&x, &w, b.as_ref(), case)
    })
    .unwrap();
    let held = MemoryUse::now(x.device()).unwrap().allocated - before;
    (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
    let db = b.as_ref().map_or_else(
        || Tensor::zeros([1], (Kind::Float, x.device())),
        Tensor::grad,
    );
    (vec![y.detach(), x.grad(), w.grad(), db], held)
}

#[test]
fn convolution_under_autocast_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "convolution_under_autocast_matches_atens_forward_and_backward_on_odd_shapes",
    ) else {
        return;
    };
    let cases = [
        ConvCase {
            x: &[3, 5, 17],
            w: &[7, 5, 3],
            stride: &[2],
            padding: &[1],
            dilation: &[1],
            groups: 1,
        },
        ConvCase {
            x: &[2, 6, 11, 9],
            w: &[10, 3, 3, 5],
            stride: &[1, 2],
            padding: &[1, 2],
            dilation: &[2, 1],
            groups: 2,
        },
        ConvCase {
            x: &[4, 16, 13, 13],
            w: &[33, 16, 3, 3],
            stride: &[1, 1],
            padding: &[1, 1],
            dilation: &[1, 1],
            groups: 1,
        },
        ConvCase {
            x: &[2, 3, 5, 6, 7],
            w: &[4, 3, 2, 3, 3],
            stride: &[1, 1, 2],
            padding: &[0, 1, 1],
            dilation: &[1, 1, 1],
            groups: 1,
        },
    ];
    for case in &cases {
        for (x_kind, last) in [
            (Kind::Float, false),
            (Kind::BFloat16, false),
            (Kind::Float, true),
        ] {
            for with_bias in [true, false] {
                let name = format!(
                    "x {:?} w {:?} {x_kind:?} channels-last {last} bias {with_bias}",
                    case.x, case.w
                );
                let fan_in: i64 = case.w[1..].iter().product();
                let mut x = Tensor::randn(case.x, (Kind::Float, device)).to_kind(x_kind);
                let mut w = Tensor::randn(case.w, (Kind::Float, device)) / (fan_in as f64).sqrt();
                if last {
                    x = channels_last(&x);
                    w = channels_last(&w);
                }
                let b = with_bias.then(|| Tensor::randn([case.w[0]], (Kind::Float, device)));
                let y_shape = {
                    let _off = common::hold_override(Override::Convolution, false);
                    conv(&x.to_kind(Kind::Float), &w, b.as_ref(), case).size()
                };
                let dy = Tensor::randn(y_shape.as_slice(), (Kind::Float, device));
                let (expected, _) = {
                    let _off = common::hold_override(Override::Convolution, false);
                    conv_pass(&x, &w, b.as_ref(), &dy, case)
                };
                let _on = common::hold_override(Override::Convolution, true);
                let (got, _) = conv_pass(&x, &w, b.as_ref(), &dy, case);
                let op = ["aten::conv1d", "aten::conv2d", "aten::conv3d"][case.w.len() - 3];
                let stats = Override::Convolution.stats(op).unwrap();
                assert_eq!((stats.ran, stats.declined), (1, 0), "{name}: {stats:?}");
                let kinds: Vec<Kind> = got.iter().map(Tensor::kind).collect();
                let expected_kinds: Vec<Kind> = expected.iter().map(Tensor::kind).collect();
                assert_eq!(kinds, expected_kinds, "{name}: the types autocast gives");
                // ATen's convolutions on the same bf16 operands; the weight is cast again in the
                // backward, to the same bf16 values.
                for (what, i) in [("y", 0), ("dx", 1), ("dw", 2), ("db", 3)] {
                    let err = common::rel_err(&got[i], &expected[i]);
                    assert!(err < 1e-2, "{name} {what}: relative error {err}");
                }
            }
        }
    }
}

#[test]
fn a_convolution_under_autocast_keeps_no_copy_of_its_weight_for_the_backward() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_convolution_under_autocast_keeps_no_copy_of_its_weight_for_the_backward",
    ) else {
        return;
    };
    // A wide weight over a small image: the weight's bf16 copy (4.5 MiB) outweighs the
    // activations that both paths keep.
    let case = ConvCase {
        x: &[2, 512, 6, 6],
        w: &[512, 512, 3, 3],
        stride: &[1, 1],
        padding: &[1, 1],
        dilation: &[1, 1],
        groups: 1,
    };
    let x = Tensor::randn(case.x, (Kind::Float, device));
    let w = Tensor::randn(case.w, (Kind::Float, device)) / 48.0;
    let dy = Tensor::randn([2, 512, 6, 6], (Kind::Float, device));
    let copy = (w.numel() * 2) as u64;
    let held_aten = {
        let _off = common::hold_override(Override::Convolution, false);
        conv_pass(&x, &w, None, &dy, &case);
        conv_pass(&x, &w, None, &dy, &case).1
    };
    let _on = common::hold_override(Override::Convolution, true);
    conv_pass(&x, &w, None, &dy, &case);
    let held = conv_pass(&x, &w, None, &dy, &case).1;
    assert!(
        held_aten >= copy,
        "autocast keeps the copy: {held_aten} bytes held"
    );
    assert!(
        held + copy <= held_aten,
        "the forward kept {held} bytes, autocast's {held_aten}"
    );
}

#[test]
fn convolution_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "convolution_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted",
    ) else {
        return;
    };
    let x = Tensor::randn([2, 3, 8, 8], (Kind::Double, device));
    let w = Tensor::randn([4, 3, 3, 3], (Kind::Double, device));
    let run = || {
        speedkit::amp::autocast(device, Kind::BFloat16, || {
            x.conv2d(&w, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1)
        })
        .unwrap()
    };
    let expected = run();
    let _on = common::hold_override(Override::Convolution, true);
    let got = run();
    assert_eq!(got.kind(), Kind::Double);
    assert!(got.equal(&expected), "autocast's own path ran");
    let stats = Override::Convolution.stats("aten::conv2d").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    let last = stats.last_declined.unwrap_or_default();
    assert!(last.contains("Double operands"), "declined for {last}");
}

// ----- unchanged tch models over 200 steps: the overrides against fp32 -----------------------------

/// An unchanged tch model and the batch it memorises, for the 200-step comparisons below.
#[derive(Clone, Copy, Debug)]
enum TchModel {
    /// `transformer_tch`'s model (tch's own modules), at a test size.
    Transformer,
    /// `resnet`'s model (`nn::batch_norm2d`, ReLU, residual adds), at a test size.
    ResNet,
}

/// The training loss of `model` over `steps` AdamW steps under `config`, from the same initial
/// weights and batch, and the calls each of the `watched` overrides ran (read before the context,
/// which holds their registrations, drops).
fn tch_model_losses(
    model: TchModel,
    config: &SpeedConfig,
    steps: usize,
    watched: &[(Override, &str)],
) -> (Vec<f64>, Vec<u64>) {
    use speedkit_suite::models::resnet::{self, ResNet, ResNetConfig};
    use speedkit_suite::models::{TchTransformer, TransformerConfig};
    let device = tch::Device::Cuda(0);
    let mut vs = nn::VarStore::new(device);
    tch::manual_seed(1);
    let loss: Box<dyn Fn(&SpeedContext) -> Tensor> = match model {
        TchModel::Transformer => {
            let dims = TransformerConfig {
                vocab: 512,
                d_model: 256,
                heads: 4,
                layers: 2,
                seq_len: 128,
                batch: 8,
            };
            let model = TchTransformer::new(&vs.root(), &dims).unwrap();
            let (tokens, targets) =
                speedkit_suite::data::tokens(dims.batch, dims.seq_len, dims.vocab, device).unwrap();
            Box::new(move |_| model.loss(&tokens, &targets).unwrap())
        }
        TchModel::ResNet => {
            let dims = ResNetConfig {
                widths: [16, 32, 64, 128],
                blocks: [1, 1, 1, 1],
                image_size: 16,
                classes: 10,
                batch: 16,
            };
            let model = ResNet::new(&vs.root(), &dims);
            let (images, labels) =
                speedkit_suite::data::images(dims.batch, dims.image_size, dims.classes, device)
                    .unwrap();
            Box::new(move |ctx| {
                let images = if ctx.plan().channels_last {
                    resnet::channels_last(&images).unwrap()
                } else {
                    images.shallow_clone()
                };
                model.loss(&images, &labels).unwrap()
            })
        }
    };
    let ctx = speedkit::apply_speedups(&mut vs, config).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            speedkit::optim::AdamW {
                lr: 3e-4,
                ..Default::default()
            },
        )
        .unwrap();
    let losses = (0..steps)
        .map(|_| {
            let loss = ctx.autocast(|| loss(&ctx));
            ctx.backward_step(&loss, &mut opt).unwrap();
            loss.double_value(&[])
        })
        .collect();
    let ran = watched
        .iter()
        .map(|(group, op)| group.stats(op).map_or(0, |s| s.ran))
        .collect();
    (losses, ran)
}

/// `model` under bf16 with the overrides follows fp32 over 200 steps as closely as bf16 on ATen's
/// kernels does (the tolerance of the `transformer` kernels' test in gpu_kernels.rs); each of the
/// `groups`' operators ran on speedkit's kernels in every step.
fn follows_fp32_as_closely_as_bf16_over_200_steps(model: TchModel, groups: &[(Override, &str)]) {
    use speedkit::config::{AutoBool, DeviceChoice, Precision};
    let mut fp32 = SpeedConfig::preset("fp32_strict").unwrap();
    fp32.device = DeviceChoice::Cuda(0);
    let bf16 = |overrides| {
        let mut c = SpeedConfig {
            device: DeviceChoice::Cuda(0),
            precision: Precision::Bf16,
            overrides,
            ..SpeedConfig::auto()
        };
        c.fp8.enabled = AutoBool::Off;
        c
    };
    let (reference, _) = tch_model_losses(model, &fp32, 200, &[]);
    let (aten, _) = tch_model_losses(model, &bf16(AutoBool::Off), 200, &[]);
    let (fused, ran) = tch_model_losses(model, &bf16(AutoBool::On), 200, groups);
    for ((_, op), ran) in groups.iter().zip(&ran) {
        assert!(
            *ran >= 200,
            "{model:?}: {op} ran {ran} calls on speedkit's kernels"
        );
    }
    assert!(
        reference[199] < 0.8 * reference[0],
        "{model:?}: the batch must be learnable"
    );
    let gap_aten = common::largest_relative_gap(&aten, &reference);
    let gap_fused = common::largest_relative_gap(&fused, &reference);
    eprintln!(
        "{model:?}, 200 steps: fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 ATen \
         {gap_aten:.4}, bf16 overrides {gap_fused:.4}",
        reference[0], reference[199]
    );
    let tolerance = common::bf16_tolerance(gap_aten);
    assert!(
        gap_fused <= tolerance,
        "{model:?}: overrides {gap_fused} > {tolerance} (ATen {gap_aten})"
    );
}

#[test]
fn transformer_tch_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "transformer_tch_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps",
    )
    .is_none()
    {
        return;
    }
    follows_fp32_as_closely_as_bf16_over_200_steps(
        TchModel::Transformer,
        &[
            (Override::Linear, "aten::linear"),
            (Override::LogSoftmax, "aten::nll_loss"),
        ],
    );
}

#[test]
fn resnet_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "resnet_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps",
    )
    .is_none()
    {
        return;
    }
    follows_fp32_as_closely_as_bf16_over_200_steps(
        TchModel::ResNet,
        &[
            (Override::BatchNorm, "aten::native_batch_norm"),
            (Override::Convolution, "aten::conv2d"),
        ],
    );
}
