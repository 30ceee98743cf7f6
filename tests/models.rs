//! The reference models: output shapes, finite losses and a learning step at the tiny size, and the
//! FLOP formulas of `docs/workloads.md` at the bench size (computed from the configs alone:
//! no bench-size model is built).

use speedkit_suite::data;
use speedkit_suite::models::resnet::channels_last;
use speedkit_suite::models::{
    ConvnextConfig, ConvnextTch, Linear3, Linear3Config, LlamaConfig, LlamaTch, Mlp, MlpConfig,
    ResNet, ResNetConfig, Transformer, TransformerConfig, UnetConfig, UnetTch, VitConfig, VitTch,
};
use std::sync::{Mutex, MutexGuard};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// libtorch's random generator is process-global and the harness runs tests on several threads:
/// tests that draw random numbers hold this lock, so that seeded batches are reproducible.
static RNG: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    let guard = RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // Each test draws from the same stream, whatever ran before it in this process.
    tch::manual_seed(0);
    guard
}

fn close(actual: f64, expected: f64, rel: f64) -> bool {
    ((actual - expected) / expected).abs() <= rel
}

#[test]
fn linear3_flops_match_the_seed_benchmark() {
    let flops = Linear3Config::bench().flops_per_step();
    assert_eq!(flops, 3.0 * 3.0 * 2.0 * 512.0 * 8192.0 * 8192.0);
    assert!(close(flops, 618.5e9, 1e-3), "{flops}");
}

#[test]
fn mlp_flops_match_the_reference() {
    let flops = MlpConfig::bench().flops_per_step();
    assert_eq!(flops, 6.0 * 256.0 * (512.0 * 1024.0 + 1024.0 * 10.0));
    assert!(close(flops, 0.82e9, 0.01), "{flops}");
}

#[test]
fn transformer_flops_match_the_reference() {
    let config = TransformerConfig::bench();
    assert_eq!(config.matmul_params(), 6 * 7_077_888 + 6_291_456);
    let flops = config.flops_per_step();
    let expected = 6.0 * 32.0 * 512.0 * (6.0 * 7_077_888.0 + 6_291_456.0)
        + 3.0 * 6.0 * 2.0 * 32.0 * 512.0f64.powi(2) * 768.0;
    assert_eq!(flops, expected);
    assert!(close(flops, 5.02e12, 0.002), "{flops}");
    assert_eq!(config.tokens_per_step(), 16_384);
    assert_eq!(config.head_dim(), 64);
}

#[test]
fn transformer_flops_generalise_with_the_dimensions() {
    let base = TransformerConfig::tiny();
    let f = |c: TransformerConfig| c.flops_per_step();
    // Linear in the batch.
    assert_eq!(
        f(TransformerConfig {
            batch: 2 * base.batch,
            ..base
        }),
        2.0 * f(base)
    );
    // The attention term grows with T², the rest with T.
    let long = TransformerConfig {
        seq_len: 2 * base.seq_len,
        ..base
    };
    let (b, t, d, l) = (
        base.batch as f64,
        base.seq_len as f64,
        base.d_model as f64,
        base.layers as f64,
    );
    let attention = 6.0 * l * b * t * t * d;
    assert_eq!(f(long), 2.0 * (f(base) - attention) + 4.0 * attention);
}

#[test]
fn resnet18_flops_are_those_of_a_cifar_resnet18() {
    // ResNet-18 on 32×32 CIFAR images is ≈ 0.56 GMAC per image forward.
    let per_image_forward = ResNetConfig {
        batch: 1,
        ..ResNetConfig::bench()
    }
    .flops_per_step()
        / 3.0
        / 2.0;
    assert!(
        close(per_image_forward, 0.556e9, 0.01),
        "{per_image_forward}"
    );
    let config = ResNetConfig::bench();
    assert_eq!(
        config.flops_per_step(),
        256.0 * 3.0 * 2.0 * per_image_forward
    );
}

#[test]
fn linear3_maps_width_to_width_and_learns() {
    let _rng = serial();
    let config = Linear3Config::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = Linear3::new(&vs.root(), &config);
    let (x, target) = data::regression(config.batch, config.width, CPU).unwrap();
    assert_eq!(
        model.forward(&x).unwrap().size(),
        [config.batch, config.width]
    );
    assert_eq!(
        vs.trainable_variables().len(),
        6,
        "three weights and three biases"
    );
    assert_learns(&vs, || model.loss(&x, &target).unwrap());
}

#[test]
fn mlp_gives_class_logits_and_learns() {
    let _rng = serial();
    let config = MlpConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = Mlp::new(&vs.root(), &config);
    let (x, labels) =
        data::classification(config.batch, config.input, config.classes, CPU).unwrap();
    assert_eq!(
        model.forward(&x).unwrap().size(),
        [config.batch, config.classes]
    );
    assert!(labels.min().int64_value(&[]) >= 0 && labels.max().int64_value(&[]) < config.classes);
    assert_learns(&vs, || model.loss(&x, &labels).unwrap());
}

#[test]
fn transformer_gives_vocab_logits_per_position_and_learns() {
    let _rng = serial();
    let config = TransformerConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = Transformer::new(&vs.root(), &config).unwrap();
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, CPU).unwrap();
    assert_eq!(
        model.forward(&tokens).unwrap().size(),
        [config.batch, config.seq_len, config.vocab]
    );
    // Shorter sequences use the first rows of the position table.
    assert_eq!(
        model.forward(&tokens.narrow(1, 0, 5)).unwrap().size(),
        [config.batch, 5, config.vocab]
    );
    // Random targets over the vocabulary: the loss starts a little above ln(vocab) (the logits of
    // an untrained head are not all equal).
    let initial = model.loss(&tokens, &targets).unwrap().double_value(&[]);
    let uniform = (config.vocab as f64).ln();
    assert!(
        initial > uniform && initial < uniform + 1.5,
        "{initial} vs ln(vocab) = {uniform}"
    );
    assert_learns(&vs, || model.loss(&tokens, &targets).unwrap());
}

#[test]
fn transformer_is_causal() {
    let _rng = serial();
    let config = TransformerConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = Transformer::new(&vs.root(), &config).unwrap();
    assert_causal(config.seq_len, config.vocab, |t| model.forward(t).unwrap());
}

/// Changing the last token of a sequence changes the logits at the last position only.
fn assert_causal(seq_len: i64, vocab: i64, forward: impl Fn(&Tensor) -> Tensor) {
    let (tokens, _) = data::tokens(1, seq_len, vocab, CPU).unwrap();
    let last = seq_len - 1;
    let changed = tokens.copy();
    // Another token at the last position only.
    changed
        .narrow(1, last, 1)
        .copy_(&(tokens.narrow(1, last, 1) + 1).remainder(vocab));
    let (a, b) = (forward(&tokens), forward(&changed));
    let head = |t: &Tensor| t.narrow(1, 0, last);
    assert!(
        !a.narrow(1, last, 1)
            .allclose(&b.narrow(1, last, 1), 1e-5, 1e-6, false),
        "the last position sees its token"
    );
    assert!(
        head(&a).allclose(&head(&b), 1e-5, 1e-6, false),
        "earlier positions must not see the last token"
    );
}

#[test]
fn transformer_rejects_bad_dimensions_and_long_inputs() {
    let _rng = serial();
    let vs = nn::VarStore::new(CPU);
    let bad = TransformerConfig {
        heads: 3,
        ..TransformerConfig::tiny()
    };
    assert!(Transformer::new(&vs.root(), &bad)
        .unwrap_err()
        .to_string()
        .contains("divisible"));
    let config = TransformerConfig::tiny();
    let model = Transformer::new(&(vs.root() / "ok"), &config).unwrap();
    let too_long = Tensor::zeros([1, config.seq_len + 1], (Kind::Int64, CPU));
    assert!(model
        .forward(&too_long)
        .unwrap_err()
        .to_string()
        .contains("longer"));
}

#[test]
fn resnet_classifies_images_in_both_layouts_and_learns() {
    let _rng = serial();
    let config = ResNetConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = ResNet::new(&vs.root(), &config);
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, CPU).unwrap();
    let nchw = model.forward(&images, false).unwrap();
    assert_eq!(nchw.size(), [config.batch, config.classes]);
    let nhwc_images = channels_last(&images).unwrap();
    assert_eq!(nhwc_images.size(), images.size());
    assert!(speedkit::nn::is_channels_last(&nhwc_images).unwrap());
    assert!(!speedkit::nn::is_channels_last(&images).unwrap());
    let nhwc = model.forward(&nhwc_images, false).unwrap();
    assert!(
        nchw.allclose(&nhwc, 1e-4, 1e-5, false),
        "the layout must not change the result"
    );
    // CIFAR-sized images work too: the network ends in global average pooling.
    let cifar = Tensor::randn([2, 3, 32, 32], (Kind::Float, CPU));
    assert_eq!(
        model.forward(&cifar, true).unwrap().size(),
        [2, config.classes]
    );
    assert_learns(&vs, || model.loss(&images, &labels).unwrap());
}

#[test]
fn random_batches_are_made_with_seed_zero() {
    let _rng = serial();
    let (a, _) = data::regression(4, 8, CPU).unwrap();
    let _ = Tensor::randn([100], (Kind::Float, CPU)); // draws in between do not matter
    let (b, _) = data::regression(4, 8, CPU).unwrap();
    assert!(a.equal(&b));
    tch::manual_seed(0);
    assert!(a.equal(&Tensor::randn([4, 8], (Kind::Float, CPU))));
}

// ----- the unchanged-idiom models of other families: llama_tch, unet_tch and convnext_tch --------

/// Trainable parameters of `vs`.
fn parameter_count(vs: &nn::VarStore) -> i64 {
    vs.trainable_variables()
        .iter()
        .map(Tensor::numel)
        .sum::<usize>() as i64
}

#[test]
fn llama_flops_match_the_reference() {
    // pytorch_reference.py's Llama.flops at the bench size.
    assert_eq!(LlamaConfig::bench().flops_per_step(), 7_073_811_136_512.0);
}

#[test]
fn unet_flops_match_the_reference() {
    // pytorch_reference.py's Unet.flops at the bench size.
    assert_eq!(UnetConfig::bench().flops_per_step(), 1_413_111_349_248.0);
}

#[test]
fn llama_has_its_pytorch_twins_parameters_and_learns() {
    let _rng = serial();
    let config = LlamaConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = LlamaTch::new(&vs.root(), &config).unwrap();
    // pytorch_reference.py's Llama at the tiny size holds 33,440.
    assert_eq!(parameter_count(&vs), 33_440);
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, CPU).unwrap();
    assert_eq!(
        model.forward(&tokens).unwrap().size(),
        [config.batch, config.seq_len, config.vocab]
    );
    let initial = model.loss(&tokens, &targets).unwrap().double_value(&[]);
    let uniform = (config.vocab as f64).ln();
    assert!(
        initial > uniform - 0.5 && initial < uniform + 1.5,
        "{initial} vs ln(vocab) = {uniform}"
    );
    assert_learns(&vs, || model.loss(&tokens, &targets).unwrap());
}

#[test]
fn llama_is_causal() {
    let _rng = serial();
    let config = LlamaConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = LlamaTch::new(&vs.root(), &config).unwrap();
    assert_causal(config.seq_len, config.vocab, |t| model.forward(t).unwrap());
}

#[test]
fn llama_rejects_heads_of_odd_width_and_long_inputs() {
    let _rng = serial();
    let vs = nn::VarStore::new(CPU);
    let odd = LlamaConfig {
        d_model: 30,
        heads: 2,
        ..LlamaConfig::tiny()
    };
    let err = LlamaTch::new(&vs.root(), &odd).unwrap_err().to_string();
    assert!(err.contains("even width"), "{err}");
    let config = LlamaConfig::tiny();
    let model = LlamaTch::new(&(vs.root() / "ok"), &config).unwrap();
    let too_long = Tensor::zeros([1, config.seq_len + 1], (Kind::Int64, CPU));
    let err = model.forward(&too_long).unwrap_err().to_string();
    assert!(err.contains("at most 16"), "{err}");
}

#[test]
fn unet_has_its_pytorch_twins_parameters_predicts_an_image_and_learns() {
    let _rng = serial();
    let config = UnetConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = UnetTch::new(&vs.root(), &config).unwrap();
    // pytorch_reference.py's Unet at the tiny size holds 65,707.
    assert_eq!(parameter_count(&vs), 65_707);
    let shape = [
        config.batch,
        config.channels,
        config.image_size,
        config.image_size,
    ];
    let images = Tensor::randn(shape, (Kind::Float, CPU));
    let noise = Tensor::randn(shape, (Kind::Float, CPU));
    assert_eq!(model.forward(&images).unwrap().size(), shape);
    assert_learns(&vs, || model.loss(&images, &noise).unwrap());
}

#[test]
fn unet_rejects_widths_the_groups_do_not_divide_and_wrong_images() {
    let _rng = serial();
    let vs = nn::VarStore::new(CPU);
    let bad = UnetConfig {
        base: 6,
        ..UnetConfig::tiny()
    };
    let err = UnetTch::new(&vs.root(), &bad).unwrap_err().to_string();
    assert!(err.contains("divisible by the groups"), "{err}");
    let config = UnetConfig::tiny();
    let model = UnetTch::new(&(vs.root() / "ok"), &config).unwrap();
    let err = model
        .forward(&Tensor::zeros([1, 3, 8, 8], (Kind::Float, CPU)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("images must be [batch, 3, 16, 16]"), "{err}");
}

#[test]
fn convnext_flops_match_the_reference() {
    // pytorch_reference.py's Convnext.flops at the bench size.
    assert_eq!(
        ConvnextConfig::bench().flops_per_step(),
        1_117_735_354_368.0
    );
}

#[test]
fn convnext_has_its_pytorch_twins_parameters_classifies_and_learns() {
    let _rng = serial();
    let config = ConvnextConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = ConvnextTch::new(&vs.root(), &config).unwrap();
    // pytorch_reference.py's Convnext at the tiny size holds 62,642.
    assert_eq!(parameter_count(&vs), 62_642);
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, CPU).unwrap();
    assert_eq!(
        model.forward(&images).unwrap().size(),
        [config.batch, config.classes]
    );
    assert_learns(&vs, || model.loss(&images, &labels).unwrap());
}

#[test]
fn convnext_rejects_an_image_side_it_cannot_halve_and_wrong_images() {
    let _rng = serial();
    let vs = nn::VarStore::new(CPU);
    let bad = ConvnextConfig {
        image_size: 48,
        ..ConvnextConfig::tiny()
    };
    let err = ConvnextTch::new(&vs.root(), &bad).unwrap_err().to_string();
    assert!(err.contains("divisible by 32"), "{err}");
    let model = ConvnextTch::new(&(vs.root() / "ok"), &ConvnextConfig::tiny()).unwrap();
    let err = model
        .forward(&Tensor::zeros([1, 3, 30, 30], (Kind::Float, CPU)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("images must be [batch, 3, 32, 32]"), "{err}");
}

#[test]
fn vit_flops_match_the_reference() {
    // pytorch_reference.py's Vit.flops at the bench size.
    assert_eq!(VitConfig::bench().flops_per_step(), 3_531_941_609_472.0);
}

#[test]
fn vit_has_its_pytorch_twins_parameters_classifies_and_learns() {
    let _rng = serial();
    let config = VitConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = VitTch::new(&vs.root(), &config).unwrap();
    // pytorch_reference.py's Vit at the tiny size holds 32,554.
    assert_eq!(parameter_count(&vs), 32_554);
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, CPU).unwrap();
    let logits = model.forward(&images).unwrap();
    assert_eq!(logits.size(), [config.batch, config.classes]);
    // Training: every forward draws its own dropout masks.
    assert!(!model.forward(&images).unwrap().equal(&logits));
    assert_learns(&vs, || model.loss(&images, &labels).unwrap());
}

#[test]
fn vit_rejects_a_patch_that_does_not_tile_the_image_and_wrong_images() {
    let _rng = serial();
    let vs = nn::VarStore::new(CPU);
    let bad = VitConfig {
        patch: 7,
        ..VitConfig::tiny()
    };
    let err = VitTch::new(&vs.root(), &bad).unwrap_err().to_string();
    assert!(err.contains("divisible by the patch"), "{err}");
    let model = VitTch::new(&(vs.root() / "ok"), &VitConfig::tiny()).unwrap();
    let err = model
        .forward(&Tensor::zeros([1, 3, 30, 30], (Kind::Float, CPU)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("images must be [batch, 3, 32, 32]"), "{err}");
}

/// A few AdamW steps lower the loss.
fn assert_learns(vs: &nn::VarStore, loss: impl Fn() -> Tensor) {
    let mut opt = nn::Adam::default().build(vs, 1e-2).unwrap();
    let first = loss().double_value(&[]);
    assert!(first.is_finite());
    for _ in 0..10 {
        opt.backward_step(&loss());
    }
    let last = loss().double_value(&[]);
    assert!(last < first, "loss went from {first} to {last}");
}
