//! FP8 fidelity: `linear3`, `mlp_block` and `transformer` (the workloads' models at their bench
//! sizes) trained the same number of steps from the same start on the same batches with bf16 GEMMs
//! and with FP8 GEMMs (`fp8.enabled: true`, `--recipe delayed|dynamic|rowwise`, `--gradient-format
//! e5m2|e4m3`), each step captured as a CUDA graph; prints both loss curves and the gap between the
//! final losses. Needs a GPU with FP8 Tensor Cores (SM 8.9+).
//!
//! Two tasks (`--task`):
//! - `memorise`: the workloads' one random batch, every step. Random targets have nothing to learn
//!   but the batch itself, so the loss falls towards zero, where any rounding is a large share of it.
//! - `learn`: a fresh batch every step from a fixed source the model can learn, whose noise sets a
//!   floor under the loss, as in real training: the regression models fit a random linear teacher
//!   (`target = x A + 0.1 ε`, floor 0.01), the transformer predicts the next token of a random
//!   Markov chain in which every token has 4 successors (floor about ln 4 nats).
//!
//! ```text
//! cargo run --release --example fp8_fidelity -- --steps 200 --task learn --recipe rowwise
//! ```

use anyhow::Context;
use clap::{Parser, ValueEnum};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use speedkit_suite::data;
use speedkit_suite::models::{
    Linear3, Linear3Config, MlpBlock, MlpBlockConfig, Transformer, TransformerConfig,
};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

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
    /// FP8 scaling recipe: `delayed` (amax history), `dynamic` (this step's amax) or `rowwise`
    /// (each row's own amax).
    #[arg(long, default_value = "delayed", value_parser = ["delayed", "dynamic", "rowwise"])]
    recipe: String,
    /// FP8 format of the output gradients in the backward GEMMs (default: the recipe's).
    #[arg(long, value_parser = ["e5m2", "e4m3"])]
    gradient_format: Option<String>,
    /// What the models are trained on.
    #[arg(long, value_enum, default_value_t = Task::Memorise)]
    task: Task,
}

/// What the models are trained on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Task {
    /// The workloads' one random batch, every step.
    Memorise,
    /// A fresh batch every step from a learnable source with a noise floor.
    Learn,
}

/// Which model a run trains.
#[derive(Clone, Copy, Debug)]
enum Model {
    Linear3,
    MlpBlock,
    Transformer,
}

/// Steps averaged at the end of a run, where fresh batches make single steps noisy.
const TAIL: usize = 10;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.steps >= TAIL && args.log_every > 0,
        "--steps must be at least {TAIL} and --log-every > 0"
    );
    let device = Device::Cuda(0);
    anyhow::ensure!(tch::Cuda::is_available(), "fp8_fidelity needs a CUDA GPU");
    let gradients = config(&args, true)?.fp8.gradient_format();
    for model in [Model::Linear3, Model::MlpBlock, Model::Transformer] {
        let bf16 = train(model, false, device, &args)?;
        let fp8 = train(model, true, device, &args)?;
        println!(
            "{model:?}, task {:?}, {} steps, lr {}, {} scaling, {gradients} gradients",
            args.task, args.steps, args.lr, args.recipe
        );
        print_curves(&bf16, &fp8, &args);
    }
    Ok(())
}

fn print_curves(bf16: &[f64], fp8: &[f64], args: &Args) {
    println!("  step   bf16 loss     fp8 loss      fp8 / bf16");
    for (step, (b, f)) in bf16.iter().zip(fp8).enumerate() {
        let step = step + 1;
        if step == 1 || step % args.log_every == 0 || step == args.steps {
            println!("  {step:<5}  {b:<12.6}  {f:<12.6}  {:.4}", f / b);
        }
    }
    let tail_mean =
        |losses: &[f64]| losses[losses.len() - TAIL..].iter().sum::<f64>() / TAIL as f64;
    for (what, b, f) in [
        ("final step", bf16[args.steps - 1], fp8[args.steps - 1]),
        ("mean of the last 10", tail_mean(bf16), tail_mean(fp8)),
    ] {
        let gap = (f - b).abs() / b;
        let verdict = if gap <= 0.01 { "within" } else { "NOT within" };
        println!(
            "  {what}: bf16 {b:.6}, fp8 {f:.6}: relative gap {:.2}% ({verdict} 1%); \
             as a share of the first loss {:.3}%",
            100.0 * gap,
            100.0 * (f - b).abs() / bf16[0]
        );
    }
}

/// A model's loss of (input, target).
type LossFn = Box<dyn Fn(&Tensor, &Tensor) -> speedkit::Result<Tensor>>;

/// bf16 training with FP8 GEMMs (`fp8`) or without, as the command line asks.
fn config(args: &Args, fp8: bool) -> anyhow::Result<SpeedConfig> {
    let gradients = args
        .gradient_format
        .as_ref()
        .map_or(String::new(), |f| format!(", gradient_format: {f}"));
    Ok(SpeedConfig::from_yaml_str(&format!(
        "device: cuda\nprecision: bf16\nfp8: {{enabled: {fp8}, recipe: {}{gradients}}}\n",
        args.recipe
    ))?)
}

/// The loss of every step of one run.
fn train(model: Model, fp8: bool, device: Device, args: &Args) -> anyhow::Result<Vec<f64>> {
    let ctx = SpeedContext::new(&config(args, fp8)?).with_context(|| format!("fp8: {fp8}"))?;
    data::seed();
    let mut vs = VarStore::new(device);
    let (loss_of, source): (LossFn, Source) = match model {
        Model::Linear3 => {
            let c = Linear3Config::bench();
            let m = Linear3::new(&vs.root(), &c);
            let source = Source::regression(args.task, c.batch, c.width, device)?;
            (Box::new(move |x, t| m.loss(x, t)), source)
        }
        Model::MlpBlock => {
            let c = MlpBlockConfig::bench();
            let m = MlpBlock::new(&vs.root(), &c);
            let source = Source::regression(args.task, c.tokens, c.width, device)?;
            (Box::new(move |x, t| m.loss(x, t)), source)
        }
        Model::Transformer => {
            let c = TransformerConfig::bench();
            let m = Transformer::new(&vs.root(), &c)?;
            let source = Source::tokens(args.task, c.batch, c.seq_len, c.vocab, device)?;
            (Box::new(move |x, t| m.loss(x, t)), source)
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
    let mut step = |batch: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| loss_of(&batch[0], &batch[1]))?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let mut graphed = ctx.graphed(&mut step);
    let mut losses = Vec::with_capacity(args.steps);
    for index in 0..args.steps {
        let (x, target) = source.batch(index)?;
        let loss = graphed
            .run(&[&x, &target])?
            .context("the step returns its loss")?;
        losses.push(loss.double_value(&[]));
    }
    Ok(losses)
}

/// Where a run's batches come from.
enum Source {
    /// The same batch every step.
    Fixed(Tensor, Tensor),
    /// Fresh `x` `[batch, width]` every step, `target = x A + 0.1 ε`.
    Teacher { a: Tensor, batch: i64 },
    /// Fresh sequences of a Markov chain: `successors[v]` are the tokens that may follow `v`,
    /// equally likely.
    Markov {
        successors: Tensor,
        batch: i64,
        seq_len: i64,
    },
}

/// The seed of the learnable sources and, plus the step, of each step's fresh batch: both runs of
/// a model see the same batches whatever else drew random numbers.
const SOURCE_SEED: i64 = 1000;

/// Successors of each token in the Markov chain.
const SUCCESSORS: i64 = 4;

impl Source {
    fn regression(task: Task, batch: i64, width: i64, device: Device) -> anyhow::Result<Self> {
        if task == Task::Memorise {
            let (x, t) = data::regression(batch, width, device)?;
            return Ok(Source::Fixed(x, t));
        }
        tch::manual_seed(SOURCE_SEED);
        let a = Tensor::f_randn([width, width], (Kind::Float, device))? / (width as f64).sqrt();
        Ok(Source::Teacher { a, batch })
    }

    fn tokens(
        task: Task,
        batch: i64,
        seq_len: i64,
        vocab: i64,
        device: Device,
    ) -> anyhow::Result<Self> {
        if task == Task::Memorise {
            let (x, t) = data::tokens(batch, seq_len, vocab, device)?;
            return Ok(Source::Fixed(x, t));
        }
        tch::manual_seed(SOURCE_SEED);
        let successors = Tensor::f_randint(vocab, [vocab, SUCCESSORS], (Kind::Int64, device))?;
        Ok(Source::Markov {
            successors,
            batch,
            seq_len,
        })
    }

    /// The batch of step `index`.
    fn batch(&self, index: usize) -> anyhow::Result<(Tensor, Tensor)> {
        tch::manual_seed(SOURCE_SEED + 1 + index as i64);
        match self {
            Source::Fixed(x, t) => Ok((x.shallow_clone(), t.shallow_clone())),
            Source::Teacher { a, batch } => {
                let width = a.size()[0];
                let x = Tensor::f_randn([*batch, width], (Kind::Float, a.device()))?;
                let noise = Tensor::f_randn([*batch, width], (Kind::Float, a.device()))? * 0.1;
                let target = x.f_matmul(a)? + noise;
                Ok((x, target))
            }
            Source::Markov {
                successors,
                batch,
                seq_len,
            } => markov_sequences(successors, *batch, *seq_len),
        }
    }
}

/// `[batch, seq_len]` tokens of the chain and their next tokens (the same sequences shifted by one).
fn markov_sequences(
    successors: &Tensor,
    batch: i64,
    seq_len: i64,
) -> anyhow::Result<(Tensor, Tensor)> {
    let (vocab, device) = (successors.size()[0], successors.device());
    let choices = Tensor::f_randint(SUCCESSORS, [batch, seq_len, 1], (Kind::Int64, device))?;
    let mut current = Tensor::f_randint(vocab, [batch], (Kind::Int64, device))?;
    let mut sequence = vec![current.shallow_clone()];
    for position in 0..seq_len {
        let choice = choices.select(1, position);
        current = successors
            .f_index_select(0, &current)?
            .f_gather(1, &choice, false)?
            .squeeze_dim(1);
        sequence.push(current.shallow_clone());
    }
    let sequence = Tensor::f_stack(&sequence, 1)?;
    Ok((
        sequence.narrow(1, 0, seq_len),
        sequence.narrow(1, 1, seq_len),
    ))
}
