//! The Linear override under autocast against ATen's, its declines, a GELU MLP's kept memory.

use crate::common;
use speedkit::memory::MemoryUse;
use speedkit::overrides::Override;
use tch::{Kind, Tensor};

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

/// A SwiGLU MLP `w2(silu(w1 x) · w3 x)` under CUDA autocast (bf16), run twice as
/// [`gelu_mlp_pass`] runs its MLP: the output and the gradients of x and the three weights, and
/// the bytes the second forward left allocated for the backward.
fn swiglu_pass(x: &Tensor, w: [&Tensor; 3], dy: &Tensor) -> (Vec<Tensor>, u64) {
    let x = x.detach().set_requires_grad(true);
    let [w1, w3, w2] = w.map(|t| t.detach().set_requires_grad(true));
    let run = || {
        let before = MemoryUse::now(x.device()).unwrap().allocated;
        let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
            let gate = x.linear(&w1, None::<&Tensor>).silu();
            (gate * x.linear(&w3, None::<&Tensor>)).linear(&w2, None::<&Tensor>)
        })
        .unwrap();
        let held = MemoryUse::now(x.device()).unwrap().allocated - before;
        (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
        let grads = [&x, &w1, &w3, &w2].map(Tensor::grad);
        (std::iter::once(y.detach()).chain(grads).collect(), held)
    };
    let _ = run();
    run()
}

#[test]
fn a_linear_of_a_product_keeps_the_factors_not_the_product_and_matches_aten() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_linear_of_a_product_keeps_the_factors_not_the_product_and_matches_aten",
    ) else {
        return;
    };
    // Rows at least the hidden width, so that every weight keeps its copy (linear.cpp) and the
    // bytes held are the activations alone.
    for (rows, d, hidden) in [(401, 96, 256), (3072, 512, 1408)] {
        let case = format!("swiglu {rows}x{d}, hidden {hidden}");
        let x = Tensor::randn([rows, d], (Kind::Float, device));
        let scaled = |out: i64, input: i64| {
            Tensor::randn([out, input], (Kind::Float, device)) / (input as f64).sqrt()
        };
        let (w1, w3, w2) = (scaled(hidden, d), scaled(hidden, d), scaled(d, hidden));
        let dy = Tensor::randn([rows, d], (Kind::Float, device));
        let (expected, held_aten) = {
            let _off = common::hold_override(Override::Linear, false);
            swiglu_pass(&x, [&w1, &w3, &w2], &dy)
        };
        let _on = common::hold_override(Override::Linear, true);
        let (got, held) = swiglu_pass(&x, [&w1, &w3, &w2], &dy);
        // ATen's path keeps the product's bf16 values for the down projection's backward.
        let product = (rows * hidden * 2) as u64;
        assert!(
            held + product <= held_aten,
            "{case}: the forward kept {held} bytes, ATen's {held_aten}"
        );
        let names = ["y", "dx", "dw1", "dw3", "dw2"];
        for (i, name) in names.iter().enumerate() {
            let err = common::rel_err(&got[i], &expected[i]);
            assert!(err < 1e-2, "{case} {name}: relative error {err}");
        }
    }
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
