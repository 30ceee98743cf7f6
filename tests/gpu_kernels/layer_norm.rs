//! speedkit's LayerNorm against ATen's: plain, residual, keeping its input, under autocast, edges.

use crate::common::{self, cuda_or_skip};
use crate::support::{assert_close, assert_no_fallback, output_tolerance, KINDS, ROWS, WIDTHS};
use speedkit::nn::{layer_norm, LayerNorm};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// A LayerNorm of `width` on `device` with random (not 1/0) fp32 parameters.
fn random_layer_norm(vs: &nn::VarStore, width: i64) -> LayerNorm {
    let norm = layer_norm(vs.root(), width, Default::default());
    tch::no_grad(|| {
        for p in norm.weight.iter().chain(norm.bias.iter()) {
            p.shallow_clone()
                .copy_(&Tensor::randn([width], (Kind::Float, vs.device())));
        }
    });
    norm
}

/// The reference: ATen's LayerNorm in fp32 on copies of the inputs and parameters.
struct Reference {
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
}

fn reference_of(x: &Tensor, norm: &LayerNorm) -> Reference {
    let copy = |t: &Tensor| t.detach().to_kind(Kind::Float).set_requires_grad(true);
    Reference {
        x: copy(x),
        weight: copy(norm.weight.as_ref().expect("affine")),
        bias: copy(norm.bias.as_ref().expect("affine")),
    }
}

fn layer_norm_matches_aten(kind: Kind, device: Device) {
    for rows in ROWS {
        for width in WIDTHS {
            let vs = nn::VarStore::new(device);
            let norm = random_layer_norm(&vs, width);
            let x = (Tensor::randn([rows, width], (Kind::Float, device)) * 2.0 + 0.5)
                .to_kind(kind)
                .set_requires_grad(true);
            assert_eq!(norm.fallback_reason(&x), None, "{kind:?} {rows}×{width}");
            let y = norm.forward(&x);
            assert_no_fallback();
            assert_eq!(y.kind(), kind);
            let dy = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
                .sum(Kind::Float)
                .backward();

            let r = reference_of(&x, &norm);
            let want =
                r.x.layer_norm([width], Some(&r.weight), Some(&r.bias), 1e-5, false);
            (&want * dy.to_kind(Kind::Float))
                .sum(Kind::Float)
                .backward();

            let case = format!("{kind:?} {rows}×{width}");
            let tol = output_tolerance(kind);
            assert_close(&format!("y {case}"), &y, &want, tol);
            if width == 1 {
                // LN of one element is the bias whatever x is: dx is exactly 0. ATen's fp32
                // reference shows rounding noise there (1.2e-5 on an H200), amplified by 1/√eps.
                assert_eq!(x.grad().abs().max().double_value(&[]), 0.0, "dx {case}");
            } else {
                assert_close(&format!("dx {case}"), &x.grad(), &r.x.grad(), tol);
            }
            let (w, b) = (norm.weight.as_ref().unwrap(), norm.bias.as_ref().unwrap());
            assert_close(
                &format!("dweight {case}"),
                &w.grad(),
                &r.weight.grad(),
                1e-4,
            );
            assert_close(&format!("dbias {case}"), &b.grad(), &r.bias.grad(), 1e-4);
        }
    }
}

#[test]
fn layer_norm_fp32_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_fp32_matches_aten_forward_and_backward") else {
        return;
    };
    layer_norm_matches_aten(Kind::Float, device);
}

#[test]
fn layer_norm_bf16_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_bf16_matches_aten_forward_and_backward") else {
        return;
    };
    layer_norm_matches_aten(Kind::BFloat16, device);
}

#[test]
fn layer_norm_fp16_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_fp16_matches_aten_forward_and_backward") else {
        return;
    };
    layer_norm_matches_aten(Kind::Half, device);
}

#[test]
fn residual_layer_norm_matches_add_then_aten() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("residual_layer_norm_matches_add_then_aten") else {
        return;
    };
    for kind in KINDS {
        for (rows, width) in [(7, 33), (1000, 768), (3, 8192)] {
            let vs = nn::VarStore::new(device);
            let norm = random_layer_norm(&vs, width);
            let leaf = |scale: f64| {
                (Tensor::randn([rows, width], (Kind::Float, device)) * scale)
                    .to_kind(kind)
                    .set_requires_grad(true)
            };
            let (x, residual) = (leaf(1.0), leaf(3.0));
            let (y, sum) = norm.forward_residual(&x, &residual);
            assert_no_fallback();
            let dy = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            let dsum = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            let objective = |y: &Tensor, s: &Tensor| {
                (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float)
                    + (s.to_kind(Kind::Float) * dsum.to_kind(Kind::Float)).sum(Kind::Float)
            };
            objective(&y, &sum).backward();

            let want_sum = (&x + &residual).detach();
            let r = reference_of(&want_sum, &norm);
            let want =
                r.x.layer_norm([width], Some(&r.weight), Some(&r.bias), 1e-5, false);
            objective(&want, &r.x).backward();

            let case = format!("{kind:?} {rows}×{width}");
            assert!(
                sum.equal(&want_sum),
                "sum {case}: x + r differs from ATen's add"
            );
            assert_close(&format!("y {case}"), &y, &want, output_tolerance(kind));
            assert_close(
                &format!("dx {case}"),
                &x.grad(),
                &r.x.grad(),
                output_tolerance(kind),
            );
            assert!(
                x.grad().equal(&residual.grad()),
                "dx and dresidual differ ({case})"
            );
        }
    }
}

#[test]
fn layer_norm_keeping_its_input_adds_the_later_uses_gradient_to_dx() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("layer_norm_keeping_its_input_adds_the_later_uses_gradient_to_dx")
    else {
        return;
    };
    for kind in KINDS {
        for (rows, width) in [(7, 33), (1000, 768), (3, 8192)] {
            let vs = nn::VarStore::new(device);
            let norm = random_layer_norm(&vs, width);
            let x = Tensor::randn([rows, width], (Kind::Float, device))
                .to_kind(kind)
                .set_requires_grad(true);
            let (y, same) = norm.forward_keeping_input(&x);
            assert_no_fallback();
            assert!(same.equal(&x));
            let dy = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            let dlater = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            let objective = |y: &Tensor, x: &Tensor| {
                (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float)
                    + (x.to_kind(Kind::Float) * dlater.to_kind(Kind::Float)).sum(Kind::Float)
            };
            objective(&y, &same).backward();

            let r = reference_of(&x, &norm);
            let want =
                r.x.layer_norm([width], Some(&r.weight), Some(&r.bias), 1e-5, false);
            objective(&want, &r.x).backward();
            let case = format!("{kind:?} {rows}×{width}");
            assert_close(&format!("y {case}"), &y, &want, output_tolerance(kind));
            assert_close(
                &format!("dx {case}"),
                &x.grad(),
                &r.x.grad(),
                output_tolerance(kind),
            );
        }
    }
}

#[test]
fn fp32_stream_with_a_half_precision_residual_matches_add_then_aten() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("fp32_stream_with_a_half_precision_residual_matches_add_then_aten")
    else {
        return;
    };
    for branch_kind in [Kind::BFloat16, Kind::Half] {
        let (rows, width) = (999, 768);
        let vs = nn::VarStore::new(device);
        let norm = random_layer_norm(&vs, width);
        let x = Tensor::randn([rows, width], (Kind::Float, device)).set_requires_grad(true);
        let branch = (Tensor::randn([rows, width], (Kind::Float, device)) * 3.0)
            .to_kind(branch_kind)
            .set_requires_grad(true);
        let (y, sum) = norm.forward_residual(&x, &branch);
        assert_no_fallback();
        assert_eq!(sum.kind(), Kind::Float, "the stream stays fp32");
        let dy = Tensor::randn([rows, width], (Kind::Float, device));
        (y.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();

        let want_sum = (&x + &branch).detach();
        let r = reference_of(&want_sum, &norm);
        let want =
            r.x.layer_norm([width], Some(&r.weight), Some(&r.bias), 1e-5, false);
        (&want * &dy).sum(Kind::Float).backward();

        let case = format!("fp32 + {branch_kind:?}");
        assert!(
            sum.equal(&want_sum),
            "sum {case}: differs from ATen's promoting add"
        );
        assert_close(
            &format!("y {case}"),
            &y,
            &want,
            output_tolerance(Kind::Float),
        );
        assert_close(&format!("dx {case}"), &x.grad(), &r.x.grad(), 1e-5);
        assert_eq!(
            branch.grad().kind(),
            branch_kind,
            "the branch's gradient in its own type"
        );
        assert_close(
            &format!("dbranch {case}"),
            &branch.grad(),
            &r.x.grad(),
            output_tolerance(branch_kind),
        );
    }
}

#[test]
fn layer_norm_writes_the_autocast_type() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_writes_the_autocast_type") else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let norm = random_layer_norm(&vs, 768);
    let x = Tensor::randn([64, 768], (Kind::Float, device));
    let y = speedkit::amp::autocast(device, Kind::BFloat16, || norm.forward(&x)).unwrap();
    assert_no_fallback();
    assert_eq!(y.kind(), Kind::BFloat16);
    let r = reference_of(&x, &norm);
    let want =
        r.x.layer_norm([768], Some(&r.weight), Some(&r.bias), 1e-5, false);
    assert_close(
        "y under bf16 autocast",
        &y,
        &want,
        output_tolerance(Kind::BFloat16),
    );
}

#[test]
fn layer_norm_of_a_non_contiguous_input_equals_the_contiguous_one() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("layer_norm_of_a_non_contiguous_input_equals_the_contiguous_one")
    else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let norm = random_layer_norm(&vs, 33);
    let base = Tensor::randn([33, 10], (Kind::Float, device));
    let strided = base.transpose(0, 1);
    assert!(!strided.is_contiguous());
    assert!(norm
        .forward(&strided)
        .equal(&norm.forward(&strided.contiguous())));
}

#[test]
fn layer_norm_of_zero_rows_gives_zero_parameter_gradients() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_of_zero_rows_gives_zero_parameter_gradients")
    else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let norm = random_layer_norm(&vs, 768);
    let x = Tensor::zeros([0, 768], (Kind::BFloat16, device)).set_requires_grad(true);
    let y = norm.forward(&x);
    assert_eq!(y.size(), [0, 768]);
    y.to_kind(Kind::Float).sum(Kind::Float).backward();
    let dweight = norm.weight.as_ref().unwrap().grad();
    assert_eq!(dweight.abs().sum(Kind::Float).double_value(&[]), 0.0);
}

#[test]
fn layer_norm_backward_is_bitwise_reproducible() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("layer_norm_backward_is_bitwise_reproducible") else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let norm = random_layer_norm(&vs, 768);
    let x = Tensor::randn([4096, 768], (Kind::BFloat16, device));
    let dy = Tensor::randn([4096, 768], (Kind::BFloat16, device));
    let dweight = || {
        let w = norm.weight.as_ref().unwrap();
        w.shallow_clone().zero_grad();
        (norm.forward(&x).to_kind(Kind::Float) * dy.to_kind(Kind::Float))
            .sum(Kind::Float)
            .backward();
        w.grad().copy()
    };
    assert!(dweight().equal(&dweight()));
}
