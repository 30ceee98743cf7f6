//! FP8 fidelity: `linear3`, `mlp_block` and `transformer` (the workloads' models at their bench sizes) trained the
//! same number of steps from the same start with bf16 GEMMs and with FP8 GEMMs (`fp8.enabled:
//! true`, the delayed recipe unless `--recipe dynamic`), each step captured as a CUDA graph; prints both loss curves
//! and the gap between the final losses. Needs a GPU with FP8 Tensor Cores (SM 8.9+).
//!
//! ```text
//! cargo run --release --example fp8_fidelity -- --steps 200
//! ```

use anyhow::Context;
use clap::Parser;
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use speedkit_suite::data;
use speedkit_suite::models::{
    Linear3, Linear3Config, MlpBlock, MlpBlockConfig, Transformer, TransformerConfig,
};
use tch::nn::VarStore;
use tch::{Device, Tensor};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Loss curves of bf16 and FP8 training on linear3, mlp_block and transformer")]
struct Args {
    /// Training steps of each run.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Print the loss every N steps.
    #[arg(long, default_value_t = 25)]
    log_every: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// FP8 scaling recipe: `delayed` (amax history) or `dynamic` (this step's amax).
    #[arg(long, default_value = "delayed", value_parser = ["delayed", "dynamic"])]
    recipe: String,
}

/// Which model a run trains.
#[derive(Clone, Copy, Debug)]
enum Model {
    Linear3,
    MlpBlock,
    Transformer,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.steps > 0 && args.log_every > 0,
        "--steps and --log-every must be > 0"
    );
    let device = Device::Cuda(0);
    anyhow::ensure!(tch::Cuda::is_available(), "fp8_fidelity needs a CUDA GPU");
    for model in [Model::Linear3, Model::MlpBlock, Model::Transformer] {
        let bf16 = train(model, false, device, &args)?;
        let fp8 = train(model, true, device, &args)?;
        println!(
            "{model:?}, {} steps, lr {}, {} scaling",
            args.steps, args.lr, args.recipe
        );
        println!("  step   bf16 loss     fp8 loss      fp8 / bf16");
        for (step, (b, f)) in bf16.iter().zip(&fp8).enumerate() {
            let step = step + 1;
            if step == 1 || step % args.log_every == 0 || step == args.steps {
                println!("  {step:<5}  {b:<12.6}  {f:<12.6}  {:.4}", f / b);
            }
        }
        let (b, f) = (bf16[args.steps - 1], fp8[args.steps - 1]);
        let gap = (f - b).abs() / b;
        let verdict = if gap <= 0.01 { "within" } else { "NOT within" };
        println!(
            "  final: bf16 {b:.6}, fp8 {f:.6}: relative gap {:.2}% ({verdict} 1%); \
             as a share of the first loss {:.3}%",
            100.0 * gap,
            100.0 * (f - b).abs() / bf16[0]
        );
    }
    Ok(())
}

/// A model's loss of (input, target).
type LossFn = Box<dyn Fn(&Tensor, &Tensor) -> speedkit::Result<Tensor>>;

/// The loss of every step of one run.
fn train(model: Model, fp8: bool, device: Device, args: &Args) -> anyhow::Result<Vec<f64>> {
    let config = SpeedConfig::from_yaml_str(&format!(
        "device: cuda\nprecision: bf16\nfp8: {{enabled: {fp8}, recipe: {}}}\n",
        args.recipe
    ))?;
    let ctx = SpeedContext::new(&config).with_context(|| format!("fp8: {fp8}"))?;
    data::seed();
    let mut vs = VarStore::new(device);
    let (loss_of, x, target): (LossFn, _, _) = match model {
        Model::Linear3 => {
            let c = Linear3Config::bench();
            let m = Linear3::new(&vs.root(), &c);
            let (x, t) = data::regression(c.batch, c.width, device)?;
            (Box::new(move |x, t| m.loss(x, t)), x, t)
        }
        Model::MlpBlock => {
            let c = MlpBlockConfig::bench();
            let m = MlpBlock::new(&vs.root(), &c);
            let (x, t) = data::regression(c.tokens, c.width, device)?;
            (Box::new(move |x, t| m.loss(x, t)), x, t)
        }
        Model::Transformer => {
            let c = TransformerConfig::bench();
            let m = Transformer::new(&vs.root(), &c)?;
            let (x, t) = data::tokens(c.batch, c.seq_len, c.vocab, device)?;
            (Box::new(move |x, t| m.loss(x, t)), x, t)
        }
    };
    ctx.prepare(&mut vs)?;
    let mut opt = ctx.adamw(
        &vs,
        AdamW {
            lr: args.lr,
            ..Default::default()
        },
    )?;
    let mut step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| loss_of(&x, &target))?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let mut graphed = ctx.graphed(&mut step);
    let mut losses = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let loss = graphed.run(&[])?.context("the step returns its loss")?;
        losses.push(loss.double_value(&[]));
    }
    Ok(losses)
}
