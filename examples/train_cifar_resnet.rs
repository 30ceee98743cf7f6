//! Train a CIFAR ResNet with speedkit: channels-last convolution weights and inputs, cuDNN
//! autotuning, bf16 autocast and fused AdamW on a GPU, as the plan decides (printed at the end).
//!
//! ```text
//! cargo run --release --example train_cifar_resnet                             # generated data
//! cargo run --release --example train_cifar_resnet -- --data ~/data/cifar-10-batches-bin --epochs 5
//! ```
//!
//! `--data DIR` reads the binary version of CIFAR-10 (`data_batch_1.bin` … `data_batch_5.bin`,
//! and `test_batch.bin` for the accuracy, from <https://www.cs.toronto.edu/~kriz/cifar.html>);
//! nothing is downloaded. Without it the example trains on generated CIFAR-shaped images (a fixed
//! pattern per class plus noise), so it runs anywhere and still has something to learn.
//!
//! Options: `--size tiny|bench` (ResNet-18 at 64..512 channels, batch 256, or 8..64 channels with
//! one block per stage, batch 32; default: bench on a GPU, tiny on a CPU), `--epochs N` (1),
//! `--max-steps N` (stop early), `--batch N`, `--images N` (generated training images; 1024 tiny,
//! 50000 bench), `--config FILE` (default `examples/configs/speed.yaml`).

use anyhow::Context as _;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use speedkit::bench::Size;
use speedkit::optim::AdamW;
use speedkit::{apply_speedups, SpeedConfig, SpeedContext};
use speedkit_suite::data::cifar::{Cifar10, Split};
use speedkit_suite::models::resnet::{channels_last, ResNet, ResNetConfig};
use std::path::PathBuf;
use std::time::Instant;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Train a CIFAR-10 ResNet with speedkit")]
struct Args {
    /// The `cifar-10-batches-bin` directory [default: generated CIFAR-shaped data].
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Speed config (YAML).
    #[arg(long, value_name = "FILE", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/configs/speed.yaml"))]
    config: PathBuf,
    /// Model and batch size [default: bench on a GPU, tiny on a CPU].
    #[arg(long, value_parser = ["tiny", "bench"])]
    size: Option<String>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Stop after this many steps in total.
    #[arg(long)]
    max_steps: Option<usize>,
    /// Images per step [default: 32 tiny, 256 bench].
    #[arg(long)]
    batch: Option<i64>,
    /// Generated training images when no --data is given [default: 1024 tiny, 50000 bench].
    #[arg(long)]
    images: Option<i64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = SpeedConfig::from_yaml(&args.config)?;

    let size = match args.size.as_deref() {
        Some(s) => Size::parse(s).with_context(|| format!("--size {s}: expected tiny or bench"))?,
        None if tch::Cuda::is_available() => Size::Bench,
        None => Size::Tiny,
    };
    let model_config = ResNetConfig {
        image_size: 32,
        batch: args.batch.unwrap_or(size.pick(32, 256)),
        ..size.pick(ResNetConfig::tiny(), ResNetConfig::bench())
    };
    anyhow::ensure!(model_config.batch > 0, "--batch must be positive");

    tch::manual_seed(0);
    let mut vs = VarStore::new(Device::Cpu);
    let model = ResNet::new(&vs.root(), &model_config);
    // Detect, plan, set the flags; move the parameters to the plan's device and lay the conv
    // weights out channels-last when the plan says so.
    let ctx = apply_speedups(&mut vs, &config)?;
    let device = ctx.device();
    let mut opt = ctx.adamw(
        &vs,
        AdamW {
            lr: 1e-3,
            wd: 5e-4,
            ..Default::default()
        },
    )?;

    let (train, test) = load(&args, size)?;
    println!(
        "ResNet ({size} size: widths {:?}, blocks {:?}) on {} training images ({}), batch {}, device {:?}",
        model_config.widths,
        model_config.blocks,
        train.len(),
        if args.data.is_some() { "CIFAR-10" } else { "generated" },
        model_config.batch,
        device
    );
    let (train, test) = (train.to_device(device)?, test.to_device(device)?);

    let steps_per_epoch = (train.len() / model_config.batch) as usize;
    anyhow::ensure!(
        steps_per_epoch > 0,
        "fewer training images ({}) than one batch",
        train.len()
    );
    let total = (steps_per_epoch * args.epochs).min(args.max_steps.unwrap_or(usize::MAX));
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let mut step = 0;
    for epoch in 1..=args.epochs {
        if step == total {
            break;
        }
        // A new order every epoch; the last partial batch is dropped (static shapes).
        let order = Tensor::f_randperm(train.len(), (Kind::Int64, device))?;
        let mut epoch_loss = Tensor::f_zeros([], (Kind::Float, device))?;
        let steps = steps_per_epoch.min(total - step);
        for i in 0..steps {
            let indices = order.f_narrow(0, i as i64 * model_config.batch, model_config.batch)?;
            let (images, labels) = train.batch(&indices)?;
            let images = layout(&ctx, images)?;
            let loss = ctx.autocast(|| model.loss(&images, &labels))?;
            ctx.backward_step(&loss, &mut opt)?;
            // Accumulated on the device: no host synchronisation inside the epoch.
            epoch_loss = epoch_loss.f_add(&loss.f_detach()?.f_to_kind(Kind::Float)?)?;
            bar.inc(1);
        }
        step += steps;
        let mean = epoch_loss.f_double_value(&[])? / steps as f64;
        bar.suspend(|| println!("epoch {epoch}: mean loss {mean:.4} over {steps} steps"));
    }
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "{step} steps in {elapsed:.1} s: {:.0} images/s (including cuDNN autotuning on the first steps)",
        (step as f64 * model_config.batch as f64) / elapsed
    );
    println!(
        "test accuracy: {:.1}% on {} images",
        100.0 * accuracy(&ctx, &model, &test, model_config.batch)?,
        test.len()
    );
    println!("\n{}", ctx.audit());
    Ok(())
}

/// The training set and a held-out set: CIFAR-10's files, or generated data split 10:1.
fn load(args: &Args, size: Size) -> anyhow::Result<(Cifar10, Cifar10)> {
    match &args.data {
        Some(dir) => Ok((
            Cifar10::load(dir, Split::Train)?,
            Cifar10::load(dir, Split::Test)?,
        )),
        None => {
            let n = args.images.unwrap_or(size.pick(1024, 50_000));
            Ok((
                Cifar10::synthetic(n, 1)?,
                Cifar10::synthetic((n / 10).max(1), 2)?,
            ))
        }
    }
}

/// Inputs channels-last when the weights are (a layout mismatch would make cuDNN convert every
/// activation).
fn layout(ctx: &SpeedContext, images: Tensor) -> anyhow::Result<Tensor> {
    Ok(if ctx.plan().channels_last {
        channels_last(&images)?
    } else {
        images
    })
}

/// Top-1 accuracy with the running BatchNorm statistics.
fn accuracy(ctx: &SpeedContext, model: &ResNet, set: &Cifar10, batch: i64) -> anyhow::Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let mut correct = 0i64;
    let mut start = 0;
    while start < set.len() {
        let n = batch.min(set.len() - start);
        let indices = Tensor::f_arange_start(start, start + n, (Kind::Int64, ctx.device()))?;
        let (images, labels) = set.batch(&indices)?;
        let images = layout(ctx, images)?;
        let logits = ctx.autocast(|| model.forward(&images, false))?;
        correct += logits
            .f_argmax(-1, false)?
            .f_eq_tensor(&labels)?
            .f_sum(Kind::Int64)?
            .f_int64_value(&[])?;
        start += n;
    }
    Ok(correct as f64 / set.len().max(1) as f64)
}
