//! speedkit's Linear against ATen's: types, chunks, strides, and the weights it computes with.

use crate::common::{self, cuda_or_skip};
use crate::support::{
    assert_close, assert_linear_uses_current_weights, assert_no_fallback, context_for,
    forward_backward, output_tolerance, rounded_leaf, store_in,
};
use speedkit::config::{DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::Linear;
use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::SpeedContext;
use tch::nn;
use tch::{Device, Kind, Tensor};

/// `Linear::forward_t` on speedkit's path against `x Wᵀ + b` in fp32 on the same rounded values,
/// forward and backward, with the layer in `kind` (`autocast: false`) or fp32 under bf16
/// autocast; `bias` says whether the layer has one. Shapes cover the bias-gradient kernel's
/// scalar path (widths not a multiple of 8), partial column tiles and zero rows.
fn linear_matches_aten(kind: Kind, autocast: bool, bias: bool, device: Device) {
    let ctx = context_for(autocast);
    for rows in [0, 1, 7, 1000] {
        for (inputs, outputs) in [(13, 1), (48, 7), (40, 264), (768, 2304)] {
            let mut vs = nn::VarStore::new(device);
            let fc = Linear::new(&(vs.root() / "fc"), inputs, outputs, bias);
            store_in(&mut vs, kind, autocast);
            let (x, y, dy) =
                forward_backward(&ctx, [rows, inputs], outputs, kind, |x| fc.forward_t(x));
            let copy = |t: &Tensor| rounded_leaf(t, kind);
            let (rx, rw) = (copy(&x), copy(&fc.ws));
            let rb = fc.bs.as_ref().map(copy);
            let want = rx.linear(&rw, rb.as_ref());
            (&want * dy.to_kind(Kind::Float))
                .sum(Kind::Float)
                .backward();

            let case =
                format!("{kind:?} autocast {autocast} bias {bias} {rows}×{inputs}→{outputs}");
            let tol = output_tolerance(kind);
            assert_close(&format!("y {case}"), &y, &want, tol);
            assert_close(&format!("dx {case}"), &x.grad(), &rx.grad(), tol);
            // The parameters' gradients come back in their own type; under autocast that is fp32,
            // straight from the GEMM's fp32 accumulator, so they meet the fp32 tolerance.
            let param_tol = if autocast { 1e-4 } else { tol.max(1e-4) };
            assert_eq!(fc.ws.grad().kind(), fc.ws.kind(), "dW's type, {case}");
            assert_close(&format!("dW {case}"), &fc.ws.grad(), &rw.grad(), param_tol);
            if let (Some(b), Some(rb)) = (&fc.bs, &rb) {
                assert_eq!(b.grad().kind(), b.kind(), "db's type, {case}");
                assert_close(&format!("db {case}"), &b.grad(), &rb.grad(), param_tol);
            }
        }
    }
    assert!(speedkit::kernels::take_ops_run().contains(&"linear"));
}

#[test]
fn linear_fp32_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_fp32_matches_aten_forward_and_backward") else {
        return;
    };
    linear_matches_aten(Kind::Float, false, true, device);
    linear_matches_aten(Kind::Float, false, false, device);
}

#[test]
fn linear_bf16_and_fp16_match_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_bf16_and_fp16_match_aten_forward_and_backward") else {
        return;
    };
    linear_matches_aten(Kind::BFloat16, false, true, device);
    linear_matches_aten(Kind::Half, false, true, device);
}

#[test]
fn linear_under_bf16_autocast_gives_fp32_gradients_from_the_gemm() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("linear_under_bf16_autocast_gives_fp32_gradients_from_the_gemm")
    else {
        return;
    };
    linear_matches_aten(Kind::BFloat16, true, true, device);
    linear_matches_aten(Kind::BFloat16, true, false, device);
}

/// `Linear::forward_chunks` against `(x Wᵀ + b).split(..)` in fp32 on the same rounded values,
/// each chunk given its own gradient; the chunk counts cover the fused concatenation (up to 4
/// chunks, vector and scalar widths) and the cat it falls back to beyond that.
fn linear_chunks_match_aten(kind: Kind, autocast: bool, bias: bool, device: Device) {
    let ctx = context_for(autocast);
    for rows in [0, 1, 7, 1000] {
        for (inputs, outputs, chunks) in [
            (13, 3, 3),
            (48, 21, 3),
            (40, 264, 2),
            (768, 2304, 3),
            (32, 40, 5),
        ] {
            let mut vs = nn::VarStore::new(device);
            let fc = Linear::new(&(vs.root() / "fc"), inputs, outputs, bias);
            store_in(&mut vs, kind, autocast);
            let x = Tensor::randn([rows, inputs], (Kind::Float, device))
                .to_kind(kind)
                .set_requires_grad(true);
            let parts = ctx.autocast(|| fc.forward_chunks(&x, chunks)).unwrap();
            assert_no_fallback();
            assert_eq!(parts.len(), chunks);
            let width = outputs / chunks as i64;
            let grads: Vec<Tensor> = (0..chunks)
                .map(|_| Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind))
                .collect();
            let loss = |parts: &[Tensor]| {
                parts
                    .iter()
                    .zip(&grads)
                    .map(|(p, g)| {
                        (p.to_kind(Kind::Float) * g.to_kind(Kind::Float)).sum(Kind::Float)
                    })
                    .fold(Tensor::zeros([], (Kind::Float, device)), |a, b| a + b)
            };
            loss(&parts).backward();
            let copy = |t: &Tensor| rounded_leaf(t, kind);
            let (rx, rw) = (copy(&x), copy(&fc.ws));
            let rb = fc.bs.as_ref().map(copy);
            let want = rx.linear(&rw, rb.as_ref()).split(width, -1);
            loss(&want).backward();

            let case = format!(
                "{kind:?} autocast {autocast} bias {bias} {rows}×{inputs}→{chunks}×{width}"
            );
            let tol = output_tolerance(kind);
            for (i, (got, want)) in parts.iter().zip(&want).enumerate() {
                assert_eq!(got.kind(), kind, "chunk {i}'s type, {case}");
                assert_close(&format!("chunk {i} {case}"), got, want, tol);
            }
            assert_close(&format!("dx {case}"), &x.grad(), &rx.grad(), tol);
            let param_tol = if autocast { 1e-4 } else { tol.max(1e-4) };
            assert_close(&format!("dW {case}"), &fc.ws.grad(), &rw.grad(), param_tol);
            if let (Some(b), Some(rb)) = (&fc.bs, &rb) {
                assert_close(&format!("db {case}"), &b.grad(), &rb.grad(), param_tol);
            }
        }
    }
    assert!(speedkit::kernels::take_ops_run().contains(&"linear"));
}

#[test]
fn linear_chunks_match_the_split_of_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_chunks_match_the_split_of_aten_forward_and_backward")
    else {
        return;
    };
    for bias in [true, false] {
        linear_chunks_match_aten(Kind::Float, false, bias, device);
        linear_chunks_match_aten(Kind::Half, false, bias, device);
        linear_chunks_match_aten(Kind::BFloat16, true, bias, device);
    }
}

#[test]
fn linear_of_a_non_contiguous_input_equals_the_contiguous_one() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_of_a_non_contiguous_input_equals_the_contiguous_one")
    else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 40, 24, true);
    let wide = Tensor::randn([40, 70], (Kind::Float, device));
    let x = wide.tr(); // [70, 40], strided
    assert!(!x.is_contiguous());
    let y = fc.forward_t(&x).unwrap();
    // The GEMM reads the strided operand in place, so only its summation order may differ.
    assert_close(
        "strided input",
        &y,
        &fc.forward_t(&x.contiguous()).unwrap(),
        1e-5,
    );
    assert_no_fallback();
}

#[test]
fn linear_keeps_the_leading_dimensions_of_its_input() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_keeps_the_leading_dimensions_of_its_input") else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 16, 24, true);
    let x = Tensor::randn([3, 5, 16], (Kind::Float, device));
    let y = fc.forward_t(&x).unwrap();
    assert_eq!(y.size(), [3, 5, 24]);
    assert_close("3-d input", &y, &x.linear(&fc.ws, fc.bs.as_ref()), 1e-5);
}

/// A bf16-autocast context with the kernels on, a speedkit `Linear` in it and its fused AdamW.
fn linear_in_a_context(device: Device) -> (SpeedContext, nn::VarStore, Linear, AdamWOptimizer) {
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 64, 48, true);
    let opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-2,
                ..Default::default()
            },
        )
        .unwrap();
    (ctx, vs, fc, opt)
}

#[test]
fn linear_after_optimizer_steps_computes_with_the_updated_weights() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("linear_after_optimizer_steps_computes_with_the_updated_weights")
    else {
        return;
    };
    let (ctx, _vs, fc, mut opt) = linear_in_a_context(device);
    let x = Tensor::randn([32, 64], (Kind::Float, device));
    for step in 0..3 {
        assert_linear_uses_current_weights(&ctx, &fc, &x, &format!("before step {step}"));
        let loss = ctx.autocast(|| fc.forward_t(&x).unwrap().square().mean(Kind::Float));
        ctx.backward_step(&loss, &mut opt).unwrap();
    }
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after 3 steps");
    assert_no_fallback();
}

#[test]
fn linear_sees_a_weight_changed_in_place_outside_the_optimizer() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("linear_sees_a_weight_changed_in_place_outside_the_optimizer")
    else {
        return;
    };
    let (ctx, _vs, fc, _opt) = linear_in_a_context(device);
    let x = Tensor::randn([32, 64], (Kind::Float, device));
    assert_linear_uses_current_weights(&ctx, &fc, &x, "first use");
    tch::no_grad(|| {
        fc.ws
            .shallow_clone()
            .copy_(&Tensor::randn([48, 64], (Kind::Float, device)));
        let _ = fc.bs.as_ref().unwrap().shallow_clone().fill_(3.0);
    });
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after an in-place change");
    // set_data swaps the data without a new version counter.
    let mut weight = fc.ws.shallow_clone();
    weight.set_data(&Tensor::randn([48, 64], (Kind::Float, device)));
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after set_data");
}
