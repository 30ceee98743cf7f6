//! Second derivatives (a gradient penalty) through the overrides: an error or ATen's result.

use crate::common;
use crate::support::hold;
use speedkit::kernels::{KernelOp, NoteMark, Outcome};
use speedkit::overrides::Override;
use tch::{Kind, Tensor};

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
    let _on = common::hold_override(Override::CrossEntropy, true);
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
