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
use speedkit::nn::{cross_entropy, cross_entropy_fallback_reason, layer_norm, LayerNorm, Linear};
use speedkit::optim::AdamW;
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

/// `Linear::forward_gelu` against `gelu(x Wᵀ + b)` in fp32 on the same rounded values (x, W, b and
/// the GEMM's output x Wᵀ in `kind`), forward and backward (dx, dW, db), with the layer's parameters
/// and input in `kind`, or with
/// fp32 parameters under bf16 autocast (`autocast: true`: the bias stays fp32, the GEMM's output
/// is bf16).
fn bias_gelu_matches_aten(kind: Kind, autocast: bool, device: Device) {
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: if autocast {
            Precision::Bf16
        } else {
            Precision::Fp32
        },
        ..SpeedConfig::auto()
    })
    .unwrap();
    for rows in [0, 1, 7, 1000] {
        for width in [1, 33, 1000, 3072] {
            let mut vs = nn::VarStore::new(device);
            let fc = Linear::new(&(vs.root() / "fc"), 48, width, true);
            tch::no_grad(|| {
                let bias = fc.bs.as_ref().expect("bias");
                bias.shallow_clone()
                    .copy_(&Tensor::randn([width], (Kind::Float, device)));
            });
            if !autocast {
                match kind {
                    Kind::BFloat16 => vs.bfloat16(),
                    Kind::Half => vs.half(),
                    _ => {}
                }
            }
            let x = Tensor::randn([rows, 48], (Kind::Float, device))
                .to_kind(kind)
                .set_requires_grad(true);
            let y = ctx.autocast(|| fc.forward_gelu(&x)).unwrap();
            assert_no_fallback();
            assert_eq!(y.kind(), kind);
            let dy = Tensor::randn([rows, width], (Kind::Float, device)).to_kind(kind);
            (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
                .sum(Kind::Float)
                .backward();

            let copy = |t: &Tensor| {
                t.detach()
                    .to_kind(kind)
                    .to_kind(Kind::Float)
                    .set_requires_grad(true)
            };
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

/// linear → residual LayerNorm → linear → fused cross-entropy, trained with bf16 autocast.
fn train_through_kernels(graphed: bool, device: Device, steps: usize) -> (Vec<f64>, Vec<Tensor>) {
    let (batch, width, classes) = (256, 768, 1000);
    tch::manual_seed(0);
    let x = Tensor::randn([batch, width], (Kind::Float, device));
    let y = Tensor::randint(classes, [batch], (Kind::Int64, device));
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(device);
    let root = vs.root();
    let first = nn::linear(&root / "first", width, width, Default::default());
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
        let loss = ctx.autocast(|| {
            // The residual stream stays fp32; the branch's bf16 output joins it in fp32.
            let (h, _) = norm.forward_residual(&x, &first.forward(&x).to_kind(Kind::Float));
            cross_entropy(&head.forward(&h), &y)
        });
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
    assert!(
        ran.contains(&"layer_norm") && ran.contains(&"cross_entropy"),
        "{ran:?}"
    );
    assert!(
        reference[199] < 0.8 * reference[0],
        "the batch must be learnable"
    );
    let gap = |run: &[f64]| {
        run.iter()
            .zip(&reference)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
            .fold(0.0, f64::max)
    };
    let (gap_aten, gap_fused) = (gap(&aten), gap(&fused));
    eprintln!(
        "transformer, 200 steps: fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 ATen \
         {gap_aten:.4}, bf16 speedkit kernels {gap_fused:.4}",
        reference[0], reference[199]
    );
    // The tolerance bf16 autocast meets against fp32 on ATen's kernels: tests/training.rs's 5%, or
    // this run's own gap where the memorised batch's small late losses make it larger, with a
    // quarter of slack for the kernels' other summation order.
    let tolerance = 0.05f64.max(1.25 * gap_aten);
    assert!(
        gap_fused <= tolerance,
        "kernels {gap_fused} > {tolerance} (ATen {gap_aten})"
    );
}
