//! The Linear override under autocast against ATen's, its declines, one kept cast of an input that
//! several linears read, freed when the backward ends.

use crate::common;
use speedkit::memory::MemoryUse;
use speedkit::overrides::Override;
use speedkit::{SpeedConfig, SpeedContext};
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

/// `linear(h, w)` summed over `weights` under CUDA autocast (bf16), where `h = 1.5 · x` is an
/// activation (autograd's result, not a leaf) and `write_between` doubles `h` in place after the
/// first linear; run twice on the same leaves, so that kept weight copies exist before the second
/// run: the output and the gradients of x and every weight, and the bytes the second forward left
/// allocated for the backward.
fn projections_pass(
    x: &Tensor,
    weights: &[Tensor],
    dy: &Tensor,
    write_between: bool,
) -> (Vec<Tensor>, u64) {
    let x = x.detach().set_requires_grad(true);
    let weights: Vec<Tensor> = (weights.iter())
        .map(|w| w.detach().set_requires_grad(true))
        .collect();
    let run = || {
        let before = MemoryUse::now(x.device()).unwrap().allocated;
        let y = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
            let mut h = &x * 1.5;
            let first = h.linear(&weights[0], None::<&Tensor>);
            if write_between {
                let _ = h.g_mul_scalar_(2.0);
            }
            (weights[1..].iter()).fold(first, |y, w| y + h.linear(w, None::<&Tensor>))
        })
        .unwrap();
        let held = MemoryUse::now(x.device()).unwrap().allocated - before;
        (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
        let grads = std::iter::once(&x).chain(&weights).map(Tensor::grad);
        (std::iter::once(y.detach()).chain(grads).collect(), held)
    };
    let _ = run();
    run()
}

/// [`projections_pass`] on the override, then on ATen's path, for `rows` × `d` inputs and three
/// `d` × `d` weights.
fn projections_on_both(
    device: tch::Device,
    rows: i64,
    d: i64,
    write_between: bool,
) -> ((Vec<Tensor>, u64), (Vec<Tensor>, u64)) {
    let x = Tensor::randn([rows, d], (Kind::Float, device));
    let weights: Vec<Tensor> = (0..3)
        .map(|_| Tensor::randn([d, d], (Kind::Float, device)) / (d as f64).sqrt())
        .collect();
    let dy = Tensor::randn([rows, d], (Kind::Float, device));
    let aten = {
        let _off = common::hold_override(Override::Linear, false);
        projections_pass(&x, &weights, &dy, write_between)
    };
    let _on = common::hold_override(Override::Linear, true);
    (projections_pass(&x, &weights, &dy, write_between), aten)
}

/// Each of `got`'s output and gradients within bf16's tolerance of `expected`'s.
fn assert_projections_match(case: &str, got: &[Tensor], expected: &[Tensor]) {
    for (i, name) in ["y", "dx", "dwq", "dwk", "dwv"].iter().enumerate() {
        let err = common::rel_err(&got[i], &expected[i]);
        assert!(err < 1e-2, "{case} {name}: relative error {err}");
    }
}

#[test]
fn linears_reading_one_activation_keep_one_cast_of_it_and_match_aten() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("linears_reading_one_activation_keep_one_cast_of_it_and_match_aten")
    else {
        return;
    };
    // Rows at least the width, so that every weight keeps its copy (linear.cpp) and the bytes
    // held are the activations alone.
    for (rows, d) in [(401, 96), (3072, 512)] {
        let case = format!("q, k and v of {rows}x{d}");
        let ((got, held), (expected, held_aten)) = projections_on_both(device, rows, d, false);
        // Autocast casts the activation for each of the three GEMMs, and each keeps its cast.
        let cast = (rows * d * 2) as u64;
        assert!(
            held + 2 * cast <= held_aten,
            "{case}: the forward kept {held} bytes, ATen's {held_aten}"
        );
        assert_projections_match(&case, &got, &expected);
    }
}

#[test]
fn an_activation_written_in_place_between_two_linears_is_cast_again() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("an_activation_written_in_place_between_two_linears_is_cast_again")
    else {
        return;
    };
    // The later linears read the doubled values: a kept cast of the old ones is half of them.
    let ((got, _), (expected, _)) = projections_on_both(device, 64, 96, true);
    assert_projections_match("doubled between", &got, &expected);
}

#[test]
fn the_kept_cast_of_a_linears_input_is_freed_when_the_contexts_backward_ends() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "the_kept_cast_of_a_linears_input_is_freed_when_the_contexts_backward_ends",
    ) else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let _on = common::hold_override(Override::Linear, true);
    let w = Tensor::randn([256, 256], (Kind::Float, device)) / 16.0;
    // One step on `rows` × 256 inputs; the input (with its gradient) is what it returns.
    let step = |rows: i64| {
        let x = Tensor::randn([rows, 256], (Kind::Float, device)).set_requires_grad(true);
        let y = ctx.autocast(|| (&x * 1.5).linear(&w, None::<&Tensor>));
        ctx.backward(&y.to_kind(Kind::Float).sum(Kind::Float))
            .unwrap();
        x
    };
    // The first step allocates what lasts (cuBLAS's workspace, the weight's kept copy: rows at
    // least the width) and casts 512 rows; the second casts 1024.
    let _first = step(512);
    let before = MemoryUse::now(device).unwrap().allocated;
    let _second = step(1024);
    let after = MemoryUse::now(device).unwrap().allocated;
    // The second input and its gradient, and no cast of either step's activation.
    assert_eq!(after - before, 2 * 1024 * 256 * 4);
}
