//! Does `#[speedkit::accelerate]` cost anything? The `transformer` workload trained through the
//! attribute (with `#[speedkit::forward]` and the rewritten `opt.backward_step(&loss)`), and the same
//! loop written by hand with a `SpeedContext`, alternated in one process under one plan (auto, graphs
//! off, so both run the same eager kernels).
//!
//! ```sh
//! cargo run --release --example macro_overhead -- [--size tiny|bench] [--steps N] [--rounds R]
//! ```
//! Prints ms/step of each form per round and the median ratio; rounds alternate so drift in clocks or
//! temperature hits both forms alike.

use anyhow::Result;
use clap::Parser;
use speedkit::config::{AutoBool, SpeedConfig};
use speedkit::SpeedContext;
use speedkit_suite::data;
use speedkit_suite::models::{Transformer, TransformerConfig};
use speedkit_suite::REFERENCE_ADAMW;
use std::time::Instant;
use tch::nn::VarStore;
use tch::{Device, Tensor};

#[derive(Parser)]
struct Args {
    /// tiny (default on a CPU) or bench (default on a GPU).
    #[arg(long)]
    size: Option<String>,
    /// Timed steps per round.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Rounds of each form.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// The attribute form: exactly what a user writes.
#[speedkit::accelerate(ctx = ctx, compile(enabled = false))]
fn train_accelerated(
    vs: &VarStore,
    model: &Transformer,
    batch: &(Tensor, Tensor),
    steps: usize,
) -> Result<f64> {
    let mut opt = ctx.adamw(vs, REFERENCE_ADAMW)?;
    let (tokens, targets) = batch;
    let mut run = |n: usize| -> Result<f64> {
        sync(ctx.device());
        let start = Instant::now();
        for _ in 0..n {
            #[speedkit::forward]
            let loss = model.loss(tokens, targets)?;
            opt.backward_step(&loss);
        }
        sync(ctx.device());
        Ok(start.elapsed().as_secs_f64() * 1e3 / n as f64)
    };
    run(5)?; // warm-up: autotuning, allocator
    run(steps)
}

/// The same loop by hand.
fn train_by_hand(
    vs: &VarStore,
    model: &Transformer,
    batch: &(Tensor, Tensor),
    steps: usize,
) -> Result<f64> {
    let mut config = SpeedConfig::auto();
    config.compile.enabled = AutoBool::Off;
    let ctx = SpeedContext::new(&config)?;
    let mut opt = ctx.adamw(vs, REFERENCE_ADAMW)?;
    let (tokens, targets) = batch;
    let mut run = |n: usize| -> Result<f64> {
        sync(ctx.device());
        let start = Instant::now();
        for _ in 0..n {
            let loss = ctx.autocast(|| model.loss(tokens, targets))?;
            ctx.backward_step(&loss, &mut opt)?;
        }
        sync(ctx.device());
        Ok(start.elapsed().as_secs_f64() * 1e3 / n as f64)
    };
    run(5)?;
    run(steps)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = Device::cuda_if_available();
    let bench = match args.size.as_deref() {
        Some("bench") => true,
        Some("tiny") => false,
        Some(other) => anyhow::bail!("--size takes tiny or bench, not {other}"),
        None => device != Device::Cpu,
    };
    let config = if bench {
        TransformerConfig::bench()
    } else {
        TransformerConfig::tiny()
    };
    data::seed();
    let vs = VarStore::new(device);
    let model = Transformer::new(&vs.root(), &config)?;
    let batch = data::tokens(config.batch, config.seq_len, config.vocab, device)?;

    let (mut macro_ms, mut hand_ms) = (Vec::new(), Vec::new());
    println!("round  #[accelerate] ms/step  by hand ms/step");
    for round in 0..args.rounds {
        macro_ms.push(train_accelerated(&vs, &model, &batch, args.steps)?);
        hand_ms.push(train_by_hand(&vs, &model, &batch, args.steps)?);
        println!(
            "{round:>5}  {:>21.3}  {:>15.3}",
            macro_ms[round], hand_ms[round]
        );
    }
    let spread = |v: &[f64]| {
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        (hi - lo) / median(v.to_vec()) * 100.0
    };
    let (m, h) = (median(macro_ms.clone()), median(hand_ms.clone()));
    println!(
        "median: #[accelerate] {m:.3} ms/step, by hand {h:.3} ms/step, ratio {:.4} (round-to-round spread: {:.1}% / {:.1}%)",
        m / h,
        spread(&macro_ms),
        spread(&hand_ms)
    );
    Ok(())
}
