//! Train the `transformer` reference workload (a GPT-style decoder on fixed random tokens) with
//! speedkit, logging loss, ms/step and tokens/s, then print what speedkit changed and why.
//!
//! ```text
//! cargo run --release --example toy_transformer                          # examples/configs/speed.yaml
//! cargo run --release --example toy_transformer -- --config examples/configs/baseline.yaml
//! cargo run --release --example toy_transformer -- --size bench --steps 200
//! ```
//!
//! Options: `--config FILE` (YAML, or JSON by extension), `--steps N` (default 30 at the tiny
//! size, 200 at the bench size), `--size tiny|bench` (default: bench on a GPU, tiny on a CPU),
//! `--log-every N`.
//!
//! # Two ways to hold a speed context
//!
//! * **Without `--config`**, [`train`] runs: `#[speedkit::accelerate(config = "…", ctx = ctx)]`
//!   reads and validates `examples/configs/speed.yaml` **at compile time** (a typo in it is a
//!   compile error), applies its flags on entry and restores them when the function returns; the
//!   `#[speedkit::forward]` statement runs the forward pass and loss under the plan's autocast.
//! * **With `--config FILE`**, the file is only known at run time, which an attribute cannot
//!   read, so [`train_with_config`] builds the same context explicitly:
//!   `SpeedContext::new(&SpeedConfig::from_yaml(path)?)`, and wraps the forward in
//!   `ctx.autocast(|| …)`. Flags are restored when `ctx` drops, exactly as with the attribute.
//!
//! Both run the same step — forward + loss under autocast, then `ctx.backward_step` (zero_grad,
//! loss scaling when the plan uses fp16, backward, AdamW step) — through `ctx.graphed`, which
//! replays it as one CUDA graph when the plan enables graphs and simply calls it otherwise.
//!
//! Under `speedkit launch --nproc-per-node N -- <this example>` every rank trains a replica on its
//! own device, data-parallel (the same fixed batch on each; gradients averaged across ranks), rank
//! 0 alone prints, and the summary gives tokens/s per GPU and in total.

use anyhow::Context as _;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use speedkit::bench::Size;
use speedkit::dist::Throughput;
use speedkit::graph::GraphedStep;
use speedkit::profile::DEFAULT_OUTPUT_DIR;
use speedkit::{SpeedConfig, SpeedContext};
use speedkit_suite::data;
use speedkit_suite::models::{Transformer, TransformerConfig};
use speedkit_suite::REFERENCE_ADAMW;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::nn::VarStore;
use tch::Tensor;

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Train the toy transformer with speedkit and print the audit")]
struct Args {
    /// A speed config (YAML, or JSON by extension) read at run time [default: examples/configs/speed.yaml, built in].
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Training steps [default: 30 tiny, 200 bench].
    #[arg(long)]
    steps: Option<usize>,
    /// Model and batch size [default: bench on a GPU, tiny on a CPU].
    #[arg(long, value_parser = ["tiny", "bench"])]
    size: Option<String>,
    /// Log every N steps [default: a tenth of the steps].
    #[arg(long, value_name = "N")]
    log_every: Option<usize>,
    /// After training, profile STEPS more steps [default: 3]: kernel table printed, JSON and Chrome
    /// trace in speedkit-profile/; then the model audit with the backward graph's anatomy.
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "3")]
    profile: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let summary = match &args.config {
        None => train(&args)?,
        Some(path) => train_with_config(&args, path)?,
    };
    if speedkit::dist::is_main_process() {
        println!("{summary}");
    }
    Ok(())
}

/// Trains with the config built in at compile time (see the header).
#[speedkit::accelerate(config = "examples/configs/speed.yaml", ctx = ctx)]
fn train(args: &Args) -> anyhow::Result<Summary> {
    let run = Run::new(&ctx, args)?;
    let mut opt = ctx.adamw(&run.vs, REFERENCE_ADAMW)?;
    let log = Log::new(&run, "examples/configs/speed.yaml (built in)");
    let step = ctx.graphed(|batch: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        #[speedkit::forward]
        let loss = run.model.loss(&batch[0], &batch[1])?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    train_loop(&ctx, &run, step, log, args)
}

/// Trains with a config file chosen at run time (see the header).
fn train_with_config(args: &Args, path: &Path) -> anyhow::Result<Summary> {
    let config = if path.extension().is_some_and(|e| e == "json") {
        SpeedConfig::from_json(path)?
    } else {
        SpeedConfig::from_yaml(path)?
    };
    let ctx = SpeedContext::new(&config).with_context(|| format!("applying {}", path.display()))?;
    let run = Run::new(&ctx, args)?;
    let mut opt = ctx.adamw(&run.vs, REFERENCE_ADAMW)?;
    let log = Log::new(&run, &path.display().to_string());
    let step = ctx.graphed(|batch: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| run.model.loss(&batch[0], &batch[1]))?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    train_loop(&ctx, &run, step, log, args)
}

/// What both entry points do with their graphed step: `run.steps` logged steps, then the optional
/// profile and the model audit, then the summary gathered over the ranks and the context's audit.
fn train_loop<F>(
    ctx: &SpeedContext,
    run: &Run,
    mut step: GraphedStep<'_, F>,
    mut log: Log,
    args: &Args,
) -> anyhow::Result<Summary>
where
    F: FnMut(&[Tensor]) -> speedkit::Result<Option<Tensor>>,
{
    for i in 0..run.steps {
        let loss = step.run(&[&run.tokens, &run.targets])?;
        log.step(i, loss.as_ref())?;
    }
    if let Some(steps) = args.profile {
        let profile = ctx.profile(steps, || step.run(&[&run.tokens, &run.targets]))?;
        profile.print_and_write(
            "toy_transformer",
            Path::new(DEFAULT_OUTPUT_DIR),
            "toy_transformer",
        )?;
        // An eager forward for the backward graph's anatomy (a replayed step's loss has none).
        let loss = ctx.autocast(|| run.model.loss(&run.tokens, &run.targets))?;
        println!(
            "{}",
            speedkit::audit(&run.vs).with_backward(&loss, &run.vs)?
        );
    }
    drop(step);
    let summary = log.finish().gather(ctx)?;
    ctx.print_main(ctx.audit());
    Ok(summary)
}

/// The model and the fixed batch of the `transformer` workload, on the context's device.
struct Run {
    vs: VarStore,
    model: Transformer,
    config: TransformerConfig,
    size: Size,
    tokens: Tensor,
    targets: Tensor,
    steps: usize,
    log_every: usize,
}

impl Run {
    fn new(ctx: &SpeedContext, args: &Args) -> anyhow::Result<Self> {
        let device = ctx.device();
        let size = match args.size.as_deref() {
            Some(s) => {
                Size::parse(s).with_context(|| format!("--size {s}: expected tiny or bench"))?
            }
            None if device.is_cuda() => Size::Bench,
            None => Size::Tiny,
        };
        let config = size.pick(TransformerConfig::tiny(), TransformerConfig::bench());
        data::seed();
        let vs = VarStore::new(device);
        let model = Transformer::new(&vs.root(), &config)?;
        // Under a launcher: rank 0's weights everywhere, gradients averaged in every backward.
        ctx.data_parallel(&vs)?;
        let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, device)?;
        let steps = args.steps.unwrap_or(size.pick(30, 200));
        let log_every = args.log_every.unwrap_or(steps / 10).max(1);
        Ok(Self {
            vs,
            model,
            config,
            size,
            tokens,
            targets,
            steps,
            log_every,
        })
    }
}

/// Progress bar and periodic log lines. Reading the loss is a host synchronisation, so it
/// happens only on log steps; the time of a log window therefore covers finished device work.
struct Log {
    bar: ProgressBar,
    /// Rank 0 (or the only process): the one that prints.
    main: bool,
    tokens_per_step: f64,
    log_every: usize,
    steps: usize,
    window_start: Instant,
    /// Steps since `window_start`.
    window_steps: usize,
    first_loss: Option<f64>,
    last_loss: f64,
    /// ms/step of every window after the first (which includes warm-up and graph capture).
    steady_ms: Vec<f64>,
}

impl Log {
    fn new(run: &Run, config_name: &str) -> Self {
        let c = &run.config;
        // Under a launcher, rank 0 alone prints; the others measure the same way, silently.
        let main = speedkit::dist::is_main_process();
        let header = format!(
            "toy transformer ({} size): {} layers, d {}, {} heads, vocab {}, batch {}×{} tokens, {} parameters; config {config_name}",
            run.size,
            c.layers,
            c.d_model,
            c.heads,
            c.vocab,
            c.batch,
            c.seq_len,
            count(run.vs.trainable_variables().iter().map(|t| t.numel()).sum::<usize>()),
        );
        let bar = if main {
            println!("{header}");
            ProgressBar::new(run.steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} steps {elapsed_precise} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        Self {
            bar,
            main,
            tokens_per_step: c.tokens_per_step() as f64,
            log_every: run.log_every,
            steps: run.steps,
            window_start: Instant::now(),
            window_steps: 0,
            first_loss: None,
            last_loss: f64::NAN,
            steady_ms: Vec::new(),
        }
    }

    fn step(&mut self, i: usize, loss: Option<&Tensor>) -> anyhow::Result<()> {
        self.bar.inc(1);
        let done = i + 1;
        self.window_steps += 1;
        if self.window_steps < self.log_every && done != self.steps {
            return Ok(());
        }
        let loss = loss
            .context("the training step returned no loss")?
            .f_double_value(&[])?;
        let ms = self.window_start.elapsed().as_secs_f64() * 1e3 / self.window_steps as f64;
        self.window_start = Instant::now();
        self.window_steps = 0;
        if self.first_loss.is_none() {
            self.first_loss = Some(loss);
        } else {
            self.steady_ms.push(ms);
        }
        self.last_loss = loss;
        let tokens_per_s = self.tokens_per_step / (ms * 1e-3);
        self.bar.set_message(format!("loss {loss:.4}"));
        if !self.main {
            return Ok(());
        }
        self.bar.suspend(|| {
            println!(
                "step {done:>5}  loss {loss:.4}  {ms:>9.2} ms/step  {tokens_per_s:>12.0} tokens/s"
            )
        });
        Ok(())
    }

    fn finish(self) -> Summary {
        self.bar.finish_and_clear();
        let mut ms = self.steady_ms;
        ms.sort_by(f64::total_cmp);
        let median_ms = ms.get(ms.len() / 2).copied();
        Summary {
            steps: self.steps,
            first_loss: self.first_loss.unwrap_or(f64::NAN),
            last_loss: self.last_loss,
            median_ms,
            tokens_per_step: self.tokens_per_step,
            throughput: None,
        }
    }
}

/// `1234567` → `1.23M`.
fn count(n: usize) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        _ => format!("{:.2}M", n as f64 / 1e6),
    }
}

/// What the run achieved.
struct Summary {
    steps: usize,
    first_loss: f64,
    last_loss: f64,
    /// Median ms/step over the log windows after the first, if there were any.
    median_ms: Option<f64>,
    tokens_per_step: f64,
    /// Every rank's steady-state tokens/s, when several ranks trained together.
    throughput: Option<Throughput>,
}

impl Summary {
    /// Gathers every rank's steady-state rate (a collective: every rank calls it; NaN where too
    /// few log windows gave none); kept for the display under a launcher.
    fn gather(mut self, ctx: &SpeedContext) -> anyhow::Result<Self> {
        if let Some(group) = ctx.process_group() {
            let mine = self
                .median_ms
                .map_or(f64::NAN, |ms| self.tokens_per_step / (ms * 1e-3));
            self.throughput = Some(Throughput::gather(Some(group), mine, "tokens")?);
        }
        Ok(self)
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trained {} steps: loss {:.4} (first log) -> {:.4}",
            self.steps, self.first_loss, self.last_loss
        )?;
        match self.median_ms {
            Some(ms) => write!(
                f,
                "; steady state {ms:.2} ms/step, {:.0} tokens/s",
                self.tokens_per_step / (ms * 1e-3)
            ),
            None => write!(
                f,
                "; too few log windows for a steady-state rate (raise --steps)"
            ),
        }?;
        match &self.throughput {
            Some(t) => write!(f, "\ndata parallel: {t}"),
            None => Ok(()),
        }
    }
}
