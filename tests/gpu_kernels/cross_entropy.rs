//! speedkit's fused cross-entropy against ATen's, ignored rows included.

use crate::common::{self, cuda_or_skip};
use crate::support::{assert_close, assert_no_fallback, output_tolerance, ROWS};
use speedkit::nn::{cross_entropy, cross_entropy_fallback_reason};
use tch::{Device, Kind, Tensor};

fn cross_entropy_matches_aten(kind: Kind, device: Device) {
    for rows in ROWS {
        for vocab in [1, 33, 1023, 8192] {
            let logits = (Tensor::randn([rows, vocab], (Kind::Float, device)) * 3.0)
                .to_kind(kind)
                .set_requires_grad(true);
            let targets = Tensor::randint(vocab, [rows], (Kind::Int64, device));
            // Every third row ignored (not the only row, so the mean stays defined).
            let ignored = Tensor::arange(rows, (Kind::Int64, device))
                .remainder(3)
                .eq(2);
            let targets = targets.masked_fill(&ignored, speedkit::nn::IGNORE_INDEX);
            assert_eq!(cross_entropy_fallback_reason(&logits, &targets), None);
            let loss = cross_entropy(&logits, &targets);
            assert_no_fallback();
            assert_eq!(loss.kind(), Kind::Float);
            (&loss * 3.0).backward();

            let reference = logits.detach().to_kind(Kind::Float).set_requires_grad(true);
            let want = reference.cross_entropy_for_logits(&targets);
            (&want * 3.0).backward();

            let case = format!("{kind:?} {rows}×{vocab}");
            assert_close(&format!("loss {case}"), &loss, &want, 1e-4);
            assert_eq!(logits.grad().kind(), kind);
            assert_close(
                &format!("dlogits {case}"),
                &logits.grad(),
                &reference.grad(),
                output_tolerance(kind),
            );
        }
    }
}

#[test]
fn cross_entropy_fp32_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("cross_entropy_fp32_matches_aten_forward_and_backward") else {
        return;
    };
    cross_entropy_matches_aten(Kind::Float, device);
}

#[test]
fn cross_entropy_bf16_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("cross_entropy_bf16_matches_aten_forward_and_backward") else {
        return;
    };
    cross_entropy_matches_aten(Kind::BFloat16, device);
}

#[test]
fn cross_entropy_fp16_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("cross_entropy_fp16_matches_aten_forward_and_backward") else {
        return;
    };
    cross_entropy_matches_aten(Kind::Half, device);
}

#[test]
fn cross_entropy_with_every_row_ignored_is_nan_like_aten() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("cross_entropy_with_every_row_ignored_is_nan_like_aten") else {
        return;
    };
    let logits = Tensor::randn([4, 10], (Kind::BFloat16, device));
    let targets = Tensor::full([4], speedkit::nn::IGNORE_INDEX, (Kind::Int64, device));
    assert!(cross_entropy(&logits, &targets).double_value(&[]).is_nan());
    assert!(logits
        .cross_entropy_for_logits(&targets)
        .double_value(&[])
        .is_nan());
}
