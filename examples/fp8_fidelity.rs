//! FP8 fidelity: `linear3`, `mlp_block` and `transformer` (the workloads' models at their bench
//! sizes) trained the same number of steps from the same start on the same batches with bf16 GEMMs
//! and with FP8 GEMMs under each asked-for recipe and gradient format (`fp8.enabled: true`), each
//! step captured as a CUDA graph; prints the loss curves and, per FP8 variant, the converged loss
//! against bf16's. Needs a GPU with FP8 Tensor Cores (SM 8.9+). `docs/benchmarks/fp8_fidelity.py`
//! is its PyTorch twin (bf16 and torchao's FP8 recipes on the same tasks).
//!
//! Two tasks (`--task`):
//! - `memorise`: the workloads' one random batch, every step. Random targets have nothing to learn
//!   but the batch itself, so the loss falls towards zero, where any rounding is a large share of it.
//! - `learn`: a fresh batch every step from a fixed source the model can learn, whose noise sets a
//!   floor under the loss, as in real training: the regression models fit a random linear teacher
//!   (`target = x A + 0.1 ε`, floor 0.01), the transformer predicts the next token of a random
//!   Markov chain in which every token has 4 successors (floor about ln 4 nats).
//!
//! The converged loss is the mean over the last 1% of the steps (at least 10), where fresh batches
//! make single steps noisy. Five thousand steps of every recipe and both gradient formats on the
//! regression models (docs/benchmarks/README.md, "FP8 fidelity"):
//!
//! ```text
//! cargo run --release --example fp8_fidelity -- --task learn --steps 5000 \
//!     --workloads linear3,mlp_block --fp8 delayed,delayed:e4m3,dynamic,dynamic:e4m3,rowwise,rowwise:e5m2
//! ```

use anyhow::Context;
use clap::{Parser, ValueEnum};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use speedkit_suite::data;
use speedkit_suite::models::{
    Linear3, Linear3Config, MlpBlock, MlpBlockConfig, Transformer, TransformerConfig,
};
use std::fmt::Write as _;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Loss curves of bf16 and FP8 training on linear3, mlp_block and transformer")]
struct Args {
    /// Training steps of each run.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Print the losses every N steps (default: eight rows a run).
    #[arg(long)]
    log_every: Option<usize>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// The FP8 variants trained beside bf16, comma-separated: a recipe (`delayed`, `dynamic`,
    /// `rowwise`), optionally with the output gradients' format (`delayed:e4m3`, `rowwise:e5m2`).
    #[arg(long, value_delimiter = ',', default_value = "delayed")]
    fp8: Vec<Variant>,
    /// The models trained, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "linear3,mlp_block,transformer"
    )]
    workloads: Vec<Model>,
    /// What the models are trained on.
    #[arg(long, value_enum, default_value_t = Task::Memorise)]
    task: Task,
    /// Also write every run's summary as JSON lines to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Model {
    Linear3,
    #[value(name = "mlp_block", alias = "mlp-block")]
    MlpBlock,
    Transformer,
}

impl Model {
    /// The workload's name.
    fn name(self) -> &'static str {
        match self {
            Model::Linear3 => "linear3",
            Model::MlpBlock => "mlp_block",
            Model::Transformer => "transformer",
        }
    }
}

/// One FP8 configuration: a recipe and, unless the recipe's own, the gradients' format.
#[derive(Clone, Debug)]
struct Variant {
    recipe: String,
    gradient_format: Option<String>,
}

impl std::str::FromStr for Variant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (recipe, format) = match s.split_once(':') {
            Some((r, f)) => (r, Some(f)),
            None => (s, None),
        };
        if !["delayed", "dynamic", "rowwise"].contains(&recipe) {
            return Err(format!(
                "unknown recipe {recipe:?}: delayed, dynamic or rowwise"
            ));
        }
        if let Some(f) = format.filter(|f| !["e5m2", "e4m3"].contains(f)) {
            return Err(format!("unknown gradient format {f:?}: e5m2 or e4m3"));
        }
        Ok(Variant {
            recipe: recipe.to_owned(),
            gradient_format: format.map(str::to_owned),
        })
    }
}

impl Variant {
    /// The config of this variant's runs: bf16 autocast with FP8 on every eligible layer.
    fn config(&self) -> anyhow::Result<SpeedConfig> {
        let format = self
            .gradient_format
            .as_ref()
            .map_or(String::new(), |f| format!(", gradient_format: {f}"));
        Ok(SpeedConfig::from_yaml_str(&format!(
            "device: cuda\nprecision: bf16\nfp8: {{enabled: true, recipe: {}{format}}}\n",
            self.recipe
        ))?)
    }

    /// `recipe/format`, the format resolved as the plan resolves it.
    fn label(&self) -> anyhow::Result<String> {
        let config = self.config()?;
        Ok(format!(
            "{}/{}",
            self.recipe,
            config.fp8.gradient_format().as_str()
        ))
    }
}

/// The bf16 reference's config: FP8 off.
fn bf16_config() -> anyhow::Result<SpeedConfig> {
    Ok(SpeedConfig::from_yaml_str(
        "device: cuda\nprecision: bf16\nfp8: {enabled: false}\n",
    )?)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.steps >= 10, "--steps must be at least 10");
    anyhow::ensure!(args.log_every != Some(0), "--log-every must be positive");
    anyhow::ensure!(tch::Cuda::is_available(), "fp8_fidelity needs a CUDA GPU");
    let device = Device::Cuda(0);
    let mut json = match &args.json {
        Some(path) => Some(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        ),
        None => None,
    };
    for &model in &args.workloads {
        let started = std::time::Instant::now();
        println!(
            "{}, task {:?}, {} steps, lr {}",
            model.name(),
            args.task,
            args.steps,
            args.lr
        );
        let mut runs = vec![(
            "bf16".to_owned(),
            train(model, &bf16_config()?, device, &args)?,
        )];
        report(model, &runs, &args, json.as_mut())?;
        for variant in &args.fp8 {
            runs.push((
                variant.label()?,
                train(model, &variant.config()?, device, &args)?,
            ));
            report(model, &runs, &args, json.as_mut())?;
        }
        print!("{}", curves(&runs, &args));
        println!("  ({:.0} s)", started.elapsed().as_secs_f64());
    }
    Ok(())
}

/// Prints, and writes as a JSON line, the summary of the latest of `runs` (the first is bf16's),
/// as soon as it is trained: a long run cut short keeps what it finished.
fn report(
    model: Model,
    runs: &[(String, Vec<f64>)],
    args: &Args,
    json: Option<&mut std::fs::File>,
) -> anyhow::Result<()> {
    let Some(summary) = summaries(model, runs, args).pop() else {
        return Ok(());
    };
    println!("  {}", summary.line());
    if let Some(file) = json {
        use std::io::Write as _;
        writeln!(file, "{}", summary.json())?;
        file.flush()?;
    }
    Ok(())
}

/// The loss curves side by side, every `log_every` steps.
fn curves(runs: &[(String, Vec<f64>)], args: &Args) -> String {
    let every = args.log_every.unwrap_or((args.steps / 8).max(1));
    let mut out = format!("  {:<6}", "step");
    for (label, _) in runs {
        let _ = write!(out, "  {label:<13}");
    }
    out.push('\n');
    for step in 1..=args.steps {
        if step == 1 || step % every == 0 || step == args.steps {
            let _ = write!(out, "  {step:<6}");
            for (_, losses) in runs {
                let _ = write!(out, "  {:<13.6}", losses[step - 1]);
            }
            out.push('\n');
        }
    }
    out
}

/// One run's converged loss against bf16's.
struct Summary {
    model: Model,
    task: Task,
    steps: usize,
    variant: String,
    final_loss: f64,
    converged: f64,
    bf16_converged: f64,
    tail: usize,
}

impl Summary {
    fn ratio(&self) -> f64 {
        self.converged / self.bf16_converged
    }

    fn line(&self) -> String {
        let gap = (self.ratio() - 1.0).abs();
        format!(
            "{:<14} final {:<10.6} converged (last {}) {:<10.6} / bf16 {:.4}  ({} 1%)",
            self.variant,
            self.final_loss,
            self.tail,
            self.converged,
            self.ratio(),
            if gap <= 0.01 { "within" } else { "NOT within" }
        )
    }

    fn json(&self) -> String {
        serde_json::json!({
            "workload": self.model.name(),
            "task": format!("{:?}", self.task).to_lowercase(),
            "steps": self.steps,
            "variant": self.variant,
            "final_loss": self.final_loss,
            "converged_loss": self.converged,
            "converged_over_steps": self.tail,
            "ratio_to_bf16": self.ratio(),
        })
        .to_string()
    }
}

/// Every run's summary; the first run is bf16's.
fn summaries(model: Model, runs: &[(String, Vec<f64>)], args: &Args) -> Vec<Summary> {
    let tail = (args.steps / 100).max(10);
    let converged =
        |losses: &[f64]| losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64;
    let bf16_converged = converged(&runs[0].1);
    runs.iter()
        .map(|(variant, losses)| Summary {
            model,
            task: args.task,
            steps: args.steps,
            variant: variant.clone(),
            final_loss: losses[args.steps - 1],
            converged: converged(losses),
            bf16_converged,
            tail,
        })
        .collect()
}

/// A model's loss of (input, target).
type LossFn = Box<dyn Fn(&Tensor, &Tensor) -> speedkit::Result<Tensor>>;

/// The loss of every step of one run.
fn train(
    model: Model,
    config: &SpeedConfig,
    device: Device,
    args: &Args,
) -> anyhow::Result<Vec<f64>> {
    let ctx = SpeedContext::new(config).with_context(|| format!("{:?}", config.fp8))?;
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
            let source =
                Source::tokens(args.task, args.steps, c.batch, c.seq_len, c.vocab, device)?;
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
    /// Sequences of a Markov chain in which `successors[v]` are the tokens that may follow `v`,
    /// equally likely: `[steps × batch, seq_len + 1]`, made at once, step `i` reading rows
    /// `i × batch ..`.
    Markov { sequences: Tensor, batch: i64 },
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
        steps: usize,
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
        let sequences = markov_sequences(&successors, steps as i64 * batch, seq_len)?;
        Ok(Source::Markov { sequences, batch })
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
            Source::Markov { sequences, batch } => {
                let rows = sequences.narrow(0, index as i64 * batch, *batch);
                let seq_len = rows.size()[1] - 1;
                Ok((
                    rows.narrow(1, 0, seq_len).contiguous(),
                    rows.narrow(1, 1, seq_len).contiguous(),
                ))
            }
        }
    }
}

/// `[rows, seq_len + 1]` tokens of the chain, each row from a uniformly drawn first token: one
/// pass of `seq_len` gathers over every row, so a long run's batches cost seconds, not a loop per
/// step.
fn markov_sequences(successors: &Tensor, rows: i64, seq_len: i64) -> anyhow::Result<Tensor> {
    let (vocab, device) = (successors.size()[0], successors.device());
    let choices = Tensor::f_randint(SUCCESSORS, [rows, seq_len, 1], (Kind::Int64, device))?;
    let mut current = Tensor::f_randint(vocab, [rows], (Kind::Int64, device))?;
    let mut sequence = vec![current.shallow_clone()];
    for position in 0..seq_len {
        let choice = choices.select(1, position);
        current = successors
            .f_index_select(0, &current)?
            .f_gather(1, &choice, false)?
            .squeeze_dim(1);
        sequence.push(current.shallow_clone());
    }
    Ok(Tensor::f_stack(&sequence, 1)?)
}
