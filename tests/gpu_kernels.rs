//! speedkit's fused kernels against ATen's composites on the GPU: forward and backward on odd
//! shapes in fp32, bf16 and fp16, and a graphed training step through them equal to the eager one.
//! Each test is skipped, with the reason printed, where no CUDA device is visible.
//!
//! Tolerances (‖got − want‖ ≤ tol · max(‖want‖, 1), the reference computed in fp32 from the same
//! rounded inputs): outputs stored in fp32 1e-5, fp16 2e-3, bf16 1e-2 (a few units of each type's
//! rounding); fp32 parameter gradients and losses 1e-4 (only the summation order differs).

mod common;

use common::cuda_or_skip;
use speedkit::config::{AutoBool, DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::{
    cross_entropy, cross_entropy_fallback_reason, embedding, embedding_fallback_reason, layer_norm,
    LayerNorm, Linear,
};
use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::SpeedContext;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const ROWS: [i64; 3] = [1, 7, 1000];
const WIDTHS: [i64; 5] = [1, 33, 768, 1023, 8192];
const KINDS: [Kind; 3] = [Kind::Float, Kind::BFloat16, Kind::Half];

fn output_tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 1e-2,
        Kind::Half => 2e-3,
        _ => 1e-5,
    }
}

/// The kernels ran: no op has taken the ATen path (the message says why one did).
fn assert_no_fallback() {
    let notes = speedkit::kernels::fallbacks();
    assert!(notes.is_empty(), "ATen fallbacks: {notes:?}");
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shapes differ");
    let got = got.to_kind(Kind::Double).to_device(Device::Cpu);
    let want = want.to_kind(Kind::Double).to_device(Device::Cpu);
    let gap = (&got - &want).norm().double_value(&[]);
    let scale = want.norm().double_value(&[]).max(1.0);
    assert!(
        gap <= tol * scale,
        "{what}: ‖got − want‖ = {gap:.3e} > {tol:.0e} · {scale:.3e}"
    );
}

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

/// A context on the first GPU computing in fp32, or under bf16 autocast when `autocast`.
/// The embedding's forward equals ATen's lookup plus positions bit for bit, and its gradients
/// equal the fp32 reference's, for `tokens` [batch, seq] over a table of `vocab` rows.
fn embedding_matches_aten(kind: Kind, tokens: &Tensor, vocab: i64, width: i64, positions: bool) {
    let device = tokens.device();
    let seq = tokens.size()[1];
    let table = Tensor::randn([vocab, width], (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let position_table = Tensor::randn([seq + 3, width], (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let positions_arg = positions.then_some(&position_table);
    assert_eq!(
        embedding_fallback_reason(tokens, &table, positions_arg),
        None
    );
    let x = embedding(tokens, &table, positions_arg).unwrap();
    assert_no_fallback();
    let copy = |t: &Tensor| t.detach().set_requires_grad(true);
    let (t, p) = (copy(&table), copy(&position_table));
    let lookup_plus_positions = |table: &Tensor, positions_table: &Tensor| {
        let lookup = Tensor::embedding(table, tokens, -1, false, false);
        if positions {
            lookup + positions_table.narrow(0, 0, seq)
        } else {
            lookup
        }
    };
    let want = lookup_plus_positions(&t, &p);
    let case = format!("{kind:?} {:?} over {vocab}×{width}", tokens.size());
    assert!(x.equal(&want), "forward {case}");

    let dy = Tensor::randn(x.size(), (Kind::Float, device)).to_kind(kind);
    (x.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    let (t32, p32) = (copy(&t.to_kind(Kind::Float)), copy(&p.to_kind(Kind::Float)));
    (lookup_plus_positions(&t32, &p32) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    let tol = output_tolerance(kind);
    assert_close(&format!("dtable {case}"), &table.grad(), &t32.grad(), tol);
    if positions {
        assert_close(
            &format!("dpositions {case}"),
            &position_table.grad(),
            &p32.grad(),
            tol,
        );
    }
}

#[test]
fn embedding_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_matches_aten_forward_and_backward") else {
        return;
    };
    for kind in KINDS {
        for width in [1, 7, 33, 768, 1027, 2050] {
            for (batch, seq, vocab) in [(1, 1, 5), (3, 17, 40), (32, 128, 8192)] {
                // Few tokens over a large vocabulary leave most rows without a gradient; many over a
                // small one repeat each token dozens of times.
                let tokens = Tensor::randint(vocab, [batch, seq], (Kind::Int64, device));
                for positions in [false, true] {
                    embedding_matches_aten(kind, &tokens, vocab, width, positions);
                }
            }
        }
    }
}

#[test]
fn embedding_of_one_token_everywhere_sums_every_row_in_order() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_one_token_everywhere_sums_every_row_in_order")
    else {
        return;
    };
    let tokens = Tensor::full([64, 256], 7, (Kind::Int64, device));
    embedding_matches_aten(Kind::Float, &tokens, 10, 768, true);
}

#[test]
fn embedding_of_strided_tokens_equals_that_of_contiguous_ones() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_strided_tokens_equals_that_of_contiguous_ones")
    else {
        return;
    };
    let table = Tensor::randn([100, 64], (Kind::Float, device));
    let positions = Tensor::randn([16, 64], (Kind::Float, device));
    let tokens = Tensor::randint(100, [16, 4], (Kind::Int64, device)).transpose(0, 1);
    assert!(!tokens.is_contiguous());
    let strided = embedding(&tokens, &table, Some(&positions)).unwrap();
    let contiguous = embedding(&tokens.contiguous(), &table, Some(&positions)).unwrap();
    assert!(strided.equal(&contiguous));
}

#[test]
fn embedding_of_an_empty_batch_gives_zero_gradients() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_an_empty_batch_gives_zero_gradients") else {
        return;
    };
    let table = Tensor::randn([10, 8], (Kind::Float, device)).set_requires_grad(true);
    let positions = Tensor::randn([4, 8], (Kind::Float, device)).set_requires_grad(true);
    let tokens = Tensor::zeros([0, 4], (Kind::Int64, device));
    let x = embedding(&tokens, &table, Some(&positions)).unwrap();
    assert_eq!(x.size(), [0, 4, 8]);
    x.sum(Kind::Float).backward();
    assert_eq!(table.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    assert_eq!(
        positions.grad().abs().sum(Kind::Float).double_value(&[]),
        0.0
    );
}

#[test]
fn embedding_backward_is_bitwise_reproducible() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_backward_is_bitwise_reproducible") else {
        return;
    };
    let table = Tensor::randn([512, 768], (Kind::Float, device)).set_requires_grad(true);
    let positions = Tensor::randn([256, 768], (Kind::Float, device)).set_requires_grad(true);
    let tokens = Tensor::randint(512, [32, 256], (Kind::Int64, device));
    let dy = Tensor::randn([32, 256, 768], (Kind::Float, device));
    let grads = || {
        table.shallow_clone().zero_grad();
        positions.shallow_clone().zero_grad();
        (embedding(&tokens, &table, Some(&positions)).unwrap() * &dy)
            .sum(Kind::Float)
            .backward();
        (table.grad().copy(), positions.grad().copy())
    };
    let (first, second) = (grads(), grads());
    assert!(first.0.equal(&second.0) && first.1.equal(&second.1));
}

fn context_for(autocast: bool) -> SpeedContext {
    SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: if autocast {
            Precision::Bf16
        } else {
            Precision::Fp32
        },
        ..SpeedConfig::auto()
    })
    .unwrap()
}

/// Puts the parameters of `vs` in `kind`, unless autocast keeps them in fp32.
fn store_in(vs: &mut nn::VarStore, kind: Kind, autocast: bool) {
    match kind {
        _ if autocast => {}
        Kind::BFloat16 => vs.bfloat16(),
        Kind::Half => vs.half(),
        _ => {}
    }
}

/// Runs `forward` inside `ctx` on a random input of shape `input` in `kind`, checks that the
/// kernels ran and that the output is in `kind`, and backpropagates a random `outputs`-wide
/// gradient. Returns the input, the output and that gradient.
fn forward_backward(
    ctx: &SpeedContext,
    input: [i64; 2],
    outputs: i64,
    kind: Kind,
    forward: impl Fn(&Tensor) -> speedkit::Result<Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let device = Device::Cuda(0);
    let x = Tensor::randn(input, (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let y = ctx.autocast(|| forward(&x)).unwrap();
    assert_no_fallback();
    assert_eq!(y.kind(), kind);
    let dy = Tensor::randn([input[0], outputs], (Kind::Float, device)).to_kind(kind);
    (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    (x, y, dy)
}

/// `t`'s value rounded to `kind`, as an fp32 leaf of the reference computation.
fn rounded_leaf(t: &Tensor, kind: Kind) -> Tensor {
    t.detach()
        .to_kind(kind)
        .to_kind(Kind::Float)
        .set_requires_grad(true)
}

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

/// The layer's output on speedkit's path equals ATen's `linear` on the weights as they are now.
fn assert_linear_uses_current_weights(ctx: &SpeedContext, fc: &Linear, x: &Tensor, what: &str) {
    let y = ctx.autocast(|| fc.forward_t(x)).unwrap();
    let want = ctx.autocast(|| x.linear(&fc.ws, fc.bs.as_ref()));
    assert_close(what, &y, &want, 1e-6);
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

/// Five AdamW steps (weight decay on) from the same weights and gradients: `with_copies`'s weights
/// have kept bf16 copies (a forward on the kernels made them), so speedkit's AdamW kernel updates
/// them and writes the copies; `without`'s have none, so ATen's `_fused_adamw_` updates them.
/// torch.optim.AdamW's update of `p` for gradient `g`, in fp64, `steps` times with the same
/// gradients as `grads` gives; the reference for speedkit's AdamW kernel.
fn adamw_reference(p: &Tensor, grads: &[Tensor], config: &AdamW) -> Tensor {
    let mut p = p.to_kind(Kind::Double);
    let mut m = p.zeros_like();
    let mut v = p.zeros_like();
    for (step, g) in grads.iter().enumerate() {
        let g = g.to_kind(Kind::Double);
        let t = (step + 1) as i32;
        p = &p * (1.0 - config.lr * config.wd);
        m = &m * config.beta1 + &g * (1.0 - config.beta1);
        v = &v * config.beta2 + &g * &g * (1.0 - config.beta2);
        let step_size = config.lr / (1.0 - config.beta1.powi(t));
        let denom = v.sqrt() / (1.0 - config.beta2.powi(t)).sqrt() + config.eps;
        p -= (&m / denom) * step_size;
    }
    p
}

#[test]
fn adamw_kernel_matches_the_adamw_update_with_and_without_weight_copies() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("adamw_kernel_matches_the_adamw_update_with_and_without_weight_copies")
    else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let config = AdamW {
        lr: 1e-2,
        wd: 0.1,
        ..Default::default()
    };
    // The weight gets a bf16 copy from the forward; the bias, used outside the layer, and the
    // embedding table keep none.
    let vs = nn::VarStore::new(device);
    let layer = Linear::new(&(vs.root() / "fc"), 64, 48, false);
    let bias = vs.root().randn("bias", &[48], 0.0, 1.0);
    let table = vs.root().randn("table", &[100, 64], 0.0, 1.0);
    // As many rows as the layer has outputs: a narrower batch keeps no copy (linear.cpp).
    let x = Tensor::randn([48, 64], (Kind::Float, device));
    let _ = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    let initial: Vec<Tensor> = [&layer.ws, &bias, &table]
        .iter()
        .map(|t| t.copy())
        .collect();
    let mut opt = ctx.adamw(&vs, config.clone()).unwrap();
    let randn = |size: &[i64]| Tensor::randn(size, (Kind::Float, device));
    let grads: Vec<[Tensor; 3]> = (0..5)
        .map(|_| [randn(&[48, 64]), randn(&[48]), randn(&[100, 64])])
        .collect();
    for [dw, db, dt] in &grads {
        opt.zero_grad().unwrap();
        let loss = (&layer.ws * dw).sum(Kind::Float)
            + (&bias * db).sum(Kind::Float)
            + (&table * dt).sum(Kind::Float);
        loss.backward();
        opt.step().unwrap();
    }
    for (i, (param, name)) in [(&layer.ws, "weight"), (&bias, "bias"), (&table, "table")]
        .into_iter()
        .enumerate()
    {
        let own: Vec<Tensor> = grads.iter().map(|g| g[i].shallow_clone()).collect();
        let want = adamw_reference(&initial[i], &own, &config);
        assert_close(&format!("{name} after 5 steps"), param, &want, 1e-6);
    }
    assert_linear_uses_current_weights(&ctx, &layer, &x, "the copies after 5 steps");
    assert_no_fallback();
}

#[test]
fn adamw_writing_the_weight_copies_skips_the_step_the_grad_scaler_finds_inf_in() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("adamw_writing_the_weight_copies_skips_the_step_the_grad_scaler_finds_inf_in")
    else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Fp16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 64, 48, true);
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let x = Tensor::randn([32, 64], (Kind::Float, device));
    let before = fc.ws.copy();
    let overflow = ctx.autocast(|| fc.forward_t(&x).unwrap().sum(Kind::Float) * f64::INFINITY);
    ctx.backward_step(&overflow, &mut opt).unwrap();
    assert!(
        fc.ws.equal(&before),
        "a step with inf gradients changed the weights"
    );
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after the skipped step");
    let loss = ctx.autocast(|| fc.forward_t(&x).unwrap().square().mean(Kind::Float));
    ctx.backward_step(&loss, &mut opt).unwrap();
    assert!(
        !fc.ws.equal(&before),
        "a finite step must change the weights"
    );
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after a finite step");
}

/// token and position embedding → linear → residual LayerNorm → linear → fused cross-entropy,
/// trained with bf16 autocast.
fn train_through_kernels(graphed: bool, device: Device, steps: usize) -> (Vec<f64>, Vec<Tensor>) {
    let (batch, seq, width, classes) = (8, 32, 768, 1000);
    tch::manual_seed(0);
    let tokens = Tensor::randint(classes, [batch, seq], (Kind::Int64, device));
    let y = Tensor::randint(classes, [batch * seq], (Kind::Int64, device));
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(device);
    let root = vs.root();
    let table = root.randn("table", &[classes, width], 0.0, 0.02);
    let positions = root.randn("positions", &[seq, width], 0.0, 0.02);
    let first = Linear::new(&(&root / "first"), width, width, true);
    let norm = layer_norm(&root / "norm", width, Default::default());
    let head = nn::linear(&root / "head", width, classes, Default::default());
    let mut config = SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    config.compile.enabled = if graphed { AutoBool::On } else { AutoBool::Off };
    let ctx = SpeedContext::new(&config).unwrap();
    ctx.prepare(&mut vs).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap();
    let step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| -> speedkit::Result<Tensor> {
            let x = embedding(&tokens, &table, Some(&positions))?.view([batch * seq, width]);
            // The residual stream stays fp32; the branch's bf16 output joins it in fp32.
            let (h, _) = norm.forward_residual(&x, &first.forward(&x).to_kind(Kind::Float));
            Ok(cross_entropy(&head.forward(&h), &y))
        })?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let losses = common::run_steps(&ctx, step, graphed, steps);
    (losses, common::trained_parameters(&vs))
}

#[test]
fn a_graphed_step_through_the_kernels_equals_the_eager_step() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("a_graphed_step_through_the_kernels_equals_the_eager_step")
    else {
        return;
    };
    let (eager_losses, eager) = train_through_kernels(false, device, 30);
    let (_, graphed) = train_through_kernels(true, device, 30);
    assert!(
        eager_losses[29] < eager_losses[0],
        "the loss falls: {eager_losses:?}"
    );
    for (e, g) in eager.iter().zip(&graphed) {
        assert_close("parameter after 30 steps", g, e, 1e-5);
    }
    assert!(
        speedkit::kernels::fallbacks().is_empty(),
        "{:?}",
        speedkit::kernels::fallbacks()
    );
}

/// `transformer`'s loss over `steps` steps under `config`, from the same initial weights and batch.
fn transformer_losses(config: &SpeedConfig, device: Device, steps: usize) -> Vec<f64> {
    use speedkit_suite::models::{Transformer, TransformerConfig};
    let dims = TransformerConfig {
        vocab: 512,
        d_model: 256,
        heads: 4,
        layers: 2,
        seq_len: 128,
        batch: 8,
    };
    let mut vs = nn::VarStore::new(device);
    tch::manual_seed(1);
    let model = Transformer::new(&vs.root(), &dims).unwrap();
    let (tokens, targets) =
        speedkit_suite::data::tokens(dims.batch, dims.seq_len, dims.vocab, device).unwrap();
    let ctx = speedkit::apply_speedups(&mut vs, config).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 3e-4,
                ..Default::default()
            },
        )
        .unwrap();
    (0..steps)
        .map(|_| {
            let loss = ctx.autocast(|| model.loss(&tokens, &targets)).unwrap();
            ctx.backward_step(&loss, &mut opt).unwrap();
            loss.double_value(&[])
        })
        .collect()
}

#[test]
fn transformer_with_the_kernels_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("transformer_with_the_kernels_follows_fp32_as_closely_as_bf16_over_200_steps")
    else {
        return;
    };
    let mut fp32 = SpeedConfig::preset("fp32_strict").unwrap();
    fp32.device = DeviceChoice::Cuda(0);
    let bf16 = |kernels| {
        let mut c = SpeedConfig {
            device: DeviceChoice::Cuda(0),
            precision: Precision::Bf16,
            kernels,
            ..SpeedConfig::auto()
        };
        c.fp8.enabled = AutoBool::Off;
        c
    };
    let reference = transformer_losses(&fp32, device, 200);
    let aten = transformer_losses(&bf16(AutoBool::Off), device, 200);
    let _ = speedkit::kernels::take_ops_run();
    let fused = transformer_losses(&bf16(AutoBool::On), device, 200);
    let ran = speedkit::kernels::take_ops_run();
    for op in [
        "embedding",
        "layer_norm",
        "cross_entropy",
        "linear",
        "bias_gelu",
    ] {
        assert!(
            ran.contains(&op),
            "{op} did not run on the kernels: {ran:?}"
        );
    }
    assert!(
        reference[199] < 0.8 * reference[0],
        "the batch must be learnable"
    );
    let gap_aten = common::largest_relative_gap(&aten, &reference);
    let gap_fused = common::largest_relative_gap(&fused, &reference);
    eprintln!(
        "transformer, 200 steps: fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 ATen \
         {gap_aten:.4}, bf16 speedkit kernels {gap_fused:.4}",
        reference[0], reference[199]
    );
    let tolerance = common::bf16_tolerance(gap_aten);
    assert!(
        gap_fused <= tolerance,
        "kernels {gap_fused} > {tolerance} (ATen {gap_aten})"
    );
}
