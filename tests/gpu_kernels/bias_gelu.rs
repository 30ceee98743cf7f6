//! `Linear::forward_gelu` (the bias-GELU kernel) against ATen's GEMM, bias and GELU.

use crate::common::{self, cuda_or_skip};
use crate::support::{
    assert_close, context_for, forward_backward, output_tolerance, rounded_leaf, store_in,
};
use speedkit::nn::Linear;
use tch::nn;
use tch::{Device, Kind, Tensor};

/// `Linear::forward_gelu` against `gelu(x Wᵀ + b)` in fp32 on the same rounded values (x, W, b and
/// the GEMM's output x Wᵀ in `kind`), forward and backward (dx, dW, db), with the layer's parameters
/// and input in `kind`, or with
/// fp32 parameters under bf16 autocast (`autocast: true`: the bias stays fp32, the GEMM's output
/// is bf16).
fn bias_gelu_matches_aten(kind: Kind, autocast: bool, device: Device) {
    let ctx = context_for(autocast);
    for rows in [0, 1, 7, 1000] {
        for width in [1, 33, 1000, 3072] {
            let mut vs = nn::VarStore::new(device);
            let fc = Linear::new(&(vs.root() / "fc"), 48, width, true);
            tch::no_grad(|| {
                let bias = fc.bs.as_ref().expect("bias");
                bias.shallow_clone()
                    .copy_(&Tensor::randn([width], (Kind::Float, device)));
            });
            store_in(&mut vs, kind, autocast);
            let (x, y, dy) =
                forward_backward(&ctx, [rows, 48], width, kind, |x| fc.forward_gelu(x));
            let copy = |t: &Tensor| rounded_leaf(t, kind);
            let (rx, rw, rb) = (copy(&x), copy(&fc.ws), copy(fc.bs.as_ref().unwrap()));
            let rb_exact = fc
                .bs
                .as_ref()
                .unwrap()
                .detach()
                .to_kind(Kind::Float)
                .set_requires_grad(true);
            let rb = if autocast { rb_exact } else { rb };
            // The GEMM's output is stored in `kind` before the bias and GELU, on ATen's path as on
            // the kernel's; the reference rounds it the same way (its gradient passes through).
            let h = rx
                .linear::<Tensor>(&rw, None)
                .to_kind(kind)
                .to_kind(Kind::Float);
            let want = (h + &rb).gelu("tanh");
            (&want * dy.to_kind(Kind::Float))
                .sum(Kind::Float)
                .backward();

            let case = format!("{kind:?} autocast {autocast} {rows}×{width}");
            let tol = output_tolerance(kind);
            assert_close(&format!("y {case}"), &y, &want, tol);
            assert_close(&format!("dx {case}"), &x.grad(), &rx.grad(), tol);
            assert_close(
                &format!("dW {case}"),
                &fc.ws.grad(),
                &rw.grad(),
                tol.max(1e-4),
            );
            let db = fc.bs.as_ref().unwrap().grad();
            assert_close(&format!("db {case}"), &db, &rb.grad(), tol.max(1e-4));
        }
    }
    assert!(speedkit::kernels::take_ops_run().contains(&"bias_gelu"));
}

#[test]
fn bias_gelu_fp32_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("bias_gelu_fp32_matches_aten_forward_and_backward") else {
        return;
    };
    bias_gelu_matches_aten(Kind::Float, false, device);
}

#[test]
fn bias_gelu_bf16_and_fp16_match_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("bias_gelu_bf16_and_fp16_match_aten_forward_and_backward")
    else {
        return;
    };
    bias_gelu_matches_aten(Kind::BFloat16, false, device);
    bias_gelu_matches_aten(Kind::Half, false, device);
}

#[test]
fn bias_gelu_under_bf16_autocast_keeps_the_fp32_bias_and_matches_aten() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("bias_gelu_under_bf16_autocast_keeps_the_fp32_bias_and_matches_aten")
    else {
        return;
    };
    bias_gelu_matches_aten(Kind::BFloat16, true, device);
}

#[test]
fn bias_gelu_of_a_non_contiguous_input_equals_the_contiguous_one() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("bias_gelu_of_a_non_contiguous_input_equals_the_contiguous_one")
    else {
        return;
    };
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 40, 24, true);
    let wide = Tensor::randn([40, 70], (Kind::Float, device));
    let x = wide.tr(); // [70, 40], strided
    assert!(!x.is_contiguous());
    let y = fc.forward_gelu(&x).unwrap();
    assert!(y.equal(&fc.forward_gelu(&x.contiguous()).unwrap()));
}
