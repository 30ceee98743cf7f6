//! The BatchNorm override against ATen's: odd shapes, the fused ReLU and residual sum, declines.

use crate::common;
use crate::support::channels_last;
use speedkit::overrides::Override;
use tch::{Kind, Tensor};

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
