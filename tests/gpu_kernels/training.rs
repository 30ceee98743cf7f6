//! Training through the kernels: a graphed step equal to the eager one, fp32 over 200 steps.

use crate::common::{self, cuda_or_skip};
use crate::support::assert_close;
use speedkit::config::{AutoBool, DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::{cross_entropy, embedding, layer_norm, Linear};
use speedkit::optim::AdamW;
use speedkit::SpeedContext;
use speedkit_suite::models::TransformerConfig;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

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

/// `transformer`'s model at a test size.
const SMALL: TransformerConfig = TransformerConfig {
    vocab: 512,
    d_model: 256,
    heads: 4,
    layers: 2,
    seq_len: 128,
    batch: 8,
};

/// [`SMALL`] with a head whose logits the chunked classifier takes in two blocks (16 × 256
/// tokens, a vocabulary of 33000: 258 MiB of bf16 logits).
const LARGE_VOCABULARY: TransformerConfig = TransformerConfig {
    vocab: 33000,
    seq_len: 256,
    batch: 16,
    ..SMALL
};

/// `transformer`'s loss at `dims` over `steps` steps under `config`, from the same initial weights
/// and batch.
fn transformer_losses(
    dims: TransformerConfig,
    config: &SpeedConfig,
    device: Device,
    steps: usize,
) -> Vec<f64> {
    use speedkit_suite::models::Transformer;
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

/// `transformer` at `dims` with speedkit's kernels under bf16 follows fp32 over 200 steps as
/// closely as bf16 on ATen's kernels does, each of `ops` running on speedkit's kernels and none of
/// `not_ops`.
fn follows_fp32_as_closely_as_bf16_over_200_steps(
    dims: TransformerConfig,
    device: Device,
    ops: &[&str],
    not_ops: &[&str],
) {
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
    let reference = transformer_losses(dims, &fp32, device, 200);
    let aten = transformer_losses(dims, &bf16(AutoBool::Off), device, 200);
    let _ = speedkit::kernels::take_ops_run();
    let fused = transformer_losses(dims, &bf16(AutoBool::On), device, 200);
    let ran = speedkit::kernels::take_ops_run();
    for op in ops {
        assert!(ran.contains(op), "{op} did not run on the kernels: {ran:?}");
    }
    for op in not_ops {
        assert!(!ran.contains(op), "{op} ran on the kernels: {ran:?}");
    }
    assert!(
        reference[199] < 0.8 * reference[0],
        "the batch must be learnable"
    );
    let gap_aten = common::largest_relative_gap(&aten, &reference);
    let gap_fused = common::largest_relative_gap(&fused, &reference);
    eprintln!(
        "transformer, vocabulary {}, 200 steps: fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 ATen \
         {gap_aten:.4}, bf16 speedkit kernels {gap_fused:.4}",
        dims.vocab, reference[0], reference[199]
    );
    let tolerance = common::bf16_tolerance(gap_aten);
    assert!(
        gap_fused <= tolerance,
        "kernels {gap_fused} > {tolerance} (ATen {gap_aten})"
    );
}

const EVERY_KERNEL: [&str; 5] = [
    "embedding",
    "layer_norm",
    "cross_entropy",
    "linear",
    "bias_gelu",
];

#[test]
fn transformer_with_the_kernels_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("transformer_with_the_kernels_follows_fp32_as_closely_as_bf16_over_200_steps")
    else {
        return;
    };
    follows_fp32_as_closely_as_bf16_over_200_steps(SMALL, device, &EVERY_KERNEL, &[]);
}

#[test]
fn a_large_vocabulary_on_the_chunked_classifier_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip(
        "a_large_vocabulary_on_the_chunked_classifier_follows_fp32_as_closely_as_bf16_over_200_steps",
    ) else {
        return;
    };
    // The head's loss runs chunked: the cross-entropy kernel of whole logits never runs.
    let ops = ["embedding", "layer_norm", "linear", "bias_gelu"];
    follows_fp32_as_closely_as_bf16_over_200_steps(
        LARGE_VOCABULARY,
        device,
        &ops,
        &["cross_entropy"],
    );
}
