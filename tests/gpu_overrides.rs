//! The operator overrides' kernels against ATen's, forward and backward, on odd shapes in fp32,
//! bf16 and fp16; inputs they do not take run ATen's kernel and are noted; an unchanged tch model
//! trains on them under autocast and in a whole-step CUDA graph. Skipped, with the reason printed,
//! without a GPU.

mod common;

use speedkit::kernels::{KernelOp, NoteMark, Outcome};
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
        for shape in [vec![3, 7, 129], vec![1000, 768], vec![5, 2, 3, 4096]] {
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
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last}");
    drop(step);
    drop(ctx);
    assert!(!Override::LayerNorm.is_registered().unwrap());
}
