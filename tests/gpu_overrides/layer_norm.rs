//! The LayerNorm override against ATen's: odd shapes, the inputs and widths it leaves to ATen.

use crate::common;
use crate::support::hold;
use speedkit::kernels::{KernelOp, NoteMark, Outcome};
use tch::{Kind, Tensor};

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
