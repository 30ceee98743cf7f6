//! Unchanged tch models training on the overrides: in a graph, and against fp32 over 200 steps.

use crate::common;
use speedkit::overrides::Override;
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

#[test]
fn an_unchanged_tch_model_trains_on_the_overrides_under_autocast_and_in_a_graph() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "an_unchanged_tch_model_trains_on_the_overrides_under_autocast_and_in_a_graph",
    ) else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    assert!(Override::LayerNorm.is_registered().unwrap());
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::layer_norm(
            vs.root() / "ln1",
            vec![768],
            Default::default(),
        ))
        .add(nn::linear(vs.root() / "fc", 768, 768, Default::default()))
        .add(nn::layer_norm(
            vs.root() / "ln2",
            vec![768],
            Default::default(),
        ));
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([333, 768], (Kind::Float, device));
    let target = Tensor::randn([333, 768], (Kind::Float, device));
    let _ = speedkit::kernels::take_ops_run();
    let mut losses = Vec::new();
    let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| {
            (model.forward(&x).to_kind(Kind::Float) - &target)
                .square()
                .mean(Kind::Float)
        });
        opt.zero_grad();
        loss.backward();
        opt.step();
        Ok(Some(loss))
    });
    for _ in 0..30 {
        if let Some(loss) = step.run(&[]).unwrap() {
            losses.push(loss.double_value(&[]));
        }
    }
    assert!(speedkit::kernels::take_ops_run().contains(&"layer_norm"));
    assert!(Override::Linear.stats("aten::linear").unwrap().ran > 0);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last}");
    drop(step);
    drop(ctx);
    assert!(!Override::LayerNorm.is_registered().unwrap());
}

/// An unchanged tch model and the batch it memorises, for the 200-step comparisons below.
#[derive(Clone, Copy, Debug)]
enum TchModel {
    /// `transformer_tch`'s model (tch's own modules), at a test size.
    Transformer,
    /// `resnet`'s model (`nn::batch_norm2d`, ReLU, residual adds), at a test size.
    ResNet,
    /// `transformer_tch`'s model with a head whose logits the chunked classifier takes in two
    /// blocks (16 × 256 tokens, a vocabulary of 33000: 258 MiB of bf16 logits).
    LargeVocabulary,
}

/// The training loss of `model` over `steps` AdamW steps under `config`, from the same initial
/// weights and batch, and the calls each of the `watched` overrides ran (read before the context,
/// which holds their registrations, drops).
fn tch_model_losses(
    model: TchModel,
    config: &SpeedConfig,
    steps: usize,
    watched: &[(Override, &str)],
) -> (Vec<f64>, Vec<u64>) {
    use speedkit_suite::models::resnet::{self, ResNet, ResNetConfig};
    use speedkit_suite::models::{TchTransformer, TransformerConfig};
    let device = tch::Device::Cuda(0);
    let mut vs = nn::VarStore::new(device);
    tch::manual_seed(1);
    let loss: Box<dyn Fn(&SpeedContext) -> Tensor> = match model {
        TchModel::Transformer | TchModel::LargeVocabulary => {
            let large = matches!(model, TchModel::LargeVocabulary);
            let dims = TransformerConfig {
                vocab: if large { 33000 } else { 512 },
                d_model: 256,
                heads: 4,
                layers: 2,
                seq_len: if large { 256 } else { 128 },
                batch: if large { 16 } else { 8 },
            };
            let model = TchTransformer::new(&vs.root(), &dims).unwrap();
            let (tokens, targets) =
                speedkit_suite::data::tokens(dims.batch, dims.seq_len, dims.vocab, device).unwrap();
            Box::new(move |_| model.loss(&tokens, &targets).unwrap())
        }
        TchModel::ResNet => {
            let dims = ResNetConfig {
                widths: [16, 32, 64, 128],
                blocks: [1, 1, 1, 1],
                image_size: 16,
                classes: 10,
                batch: 16,
            };
            let model = ResNet::new(&vs.root(), &dims);
            let (images, labels) =
                speedkit_suite::data::images(dims.batch, dims.image_size, dims.classes, device)
                    .unwrap();
            Box::new(move |ctx| {
                let images = if ctx.plan().channels_last {
                    resnet::channels_last(&images).unwrap()
                } else {
                    images.shallow_clone()
                };
                model.loss(&images, &labels).unwrap()
            })
        }
    };
    let ctx = speedkit::apply_speedups(&mut vs, config).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            speedkit::optim::AdamW {
                lr: 3e-4,
                ..Default::default()
            },
        )
        .unwrap();
    let losses = (0..steps)
        .map(|_| {
            let loss = ctx.autocast(|| loss(&ctx));
            ctx.backward_step(&loss, &mut opt).unwrap();
            loss.double_value(&[])
        })
        .collect();
    let ran = watched
        .iter()
        .map(|(group, op)| group.stats(op).map_or(0, |s| s.ran))
        .collect();
    (losses, ran)
}

/// `model` under bf16 with the overrides follows fp32 over 200 steps as closely as bf16 on ATen's
/// kernels does (the tolerance of the `transformer` kernels' test in gpu_kernels/training.rs);
/// each of the `groups`' operators ran on speedkit's kernels in every step.
fn follows_fp32_as_closely_as_bf16_over_200_steps(model: TchModel, groups: &[(Override, &str)]) {
    use speedkit::config::{AutoBool, DeviceChoice, Precision};
    let mut fp32 = SpeedConfig::preset("fp32_strict").unwrap();
    fp32.device = DeviceChoice::Cuda(0);
    let bf16 = |overrides| {
        let mut c = SpeedConfig {
            device: DeviceChoice::Cuda(0),
            precision: Precision::Bf16,
            overrides,
            ..SpeedConfig::auto()
        };
        c.fp8.enabled = AutoBool::Off;
        c
    };
    let (reference, _) = tch_model_losses(model, &fp32, 200, &[]);
    let (aten, _) = tch_model_losses(model, &bf16(AutoBool::Off), 200, &[]);
    let (fused, ran) = tch_model_losses(model, &bf16(AutoBool::On), 200, groups);
    for ((_, op), ran) in groups.iter().zip(&ran) {
        assert!(
            *ran >= 200,
            "{model:?}: {op} ran {ran} calls on speedkit's kernels"
        );
    }
    let gap_aten = common::largest_relative_gap(&aten, &reference);
    let gap_fused = common::largest_relative_gap(&fused, &reference);
    eprintln!(
        "{model:?}, 200 steps: fp32 {:.4} -> {:.4}; largest relative gap vs fp32: bf16 ATen \
         {gap_aten:.4}, bf16 overrides {gap_fused:.4}",
        reference[0], reference[199]
    );
    assert!(
        reference[199] < 0.8 * reference[0],
        "{model:?}: the batch must be learnable"
    );
    let tolerance = common::bf16_tolerance(gap_aten);
    assert!(
        gap_fused <= tolerance,
        "{model:?}: overrides {gap_fused} > {tolerance} (ATen {gap_aten})"
    );
}

#[test]
fn transformer_tch_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "transformer_tch_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps",
    )
    .is_none()
    {
        return;
    }
    follows_fp32_as_closely_as_bf16_over_200_steps(
        TchModel::Transformer,
        &[
            (Override::Linear, "aten::linear"),
            (Override::CrossEntropy, "aten::nll_loss"),
        ],
    );
}

#[test]
fn resnet_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "resnet_with_the_overrides_follows_fp32_as_closely_as_bf16_over_200_steps",
    )
    .is_none()
    {
        return;
    }
    follows_fp32_as_closely_as_bf16_over_200_steps(
        TchModel::ResNet,
        &[
            (Override::BatchNorm, "aten::native_batch_norm"),
            (Override::Convolution, "aten::conv2d"),
        ],
    );
}

#[test]
fn a_large_vocabulary_on_the_chunked_classifier_follows_fp32_as_closely_as_bf16_over_200_steps() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "a_large_vocabulary_on_the_chunked_classifier_follows_fp32_as_closely_as_bf16_over_200_steps",
    )
    .is_none()
    {
        return;
    }
    follows_fp32_as_closely_as_bf16_over_200_steps(
        TchModel::LargeVocabulary,
        &[
            (Override::Linear, "aten::linear"),
            (Override::CrossEntropy, "aten::nll_loss"),
        ],
    );
}
