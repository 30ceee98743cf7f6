//! The log_softmax override under autocast against ATen's, its declines, a classifier trained on it.

use crate::common;
use speedkit::overrides::Override;
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

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
                let _off = common::hold_override(Override::CrossEntropy, false);
                log_softmax_pass(&x, &dy)
            };
            let _on = common::hold_override(Override::CrossEntropy, true);
            let (y, dx) = log_softmax_pass(&x, &dy);
            let stats = Override::CrossEntropy
                .stats("aten::log_softmax.int")
                .unwrap();
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
    let cases: [(&str, Call<'_>); 4] = [
        (
            "a result type other than fp32 or the logits' own",
            Box::new(|| x.log_softmax(-1, Kind::Half)),
        ),
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
            let _off = common::hold_override(Override::CrossEntropy, false);
            under_autocast(&*call)
        };
        let _on = common::hold_override(Override::CrossEntropy, true);
        let got = under_autocast(&*call);
        assert!(got.equal(&expected), "{why}: autocast's own path ran");
        let stats = Override::CrossEntropy
            .stats("aten::log_softmax.int")
            .unwrap();
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
    assert!(Override::CrossEntropy.is_registered().unwrap());
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
    for op in Override::CrossEntropy.operators() {
        assert!(Override::CrossEntropy.stats(op).unwrap().ran > 0, "{op}");
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
    assert!(!Override::CrossEntropy.is_registered().unwrap());
}
