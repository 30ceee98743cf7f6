//! The optimisation ladder: one workload (default `transformer`) timed under a sequence of
//! configs, each adding one speed-up to the one before, so that every rung's gain shows on its own:
//!
//! | rung | adds |
//! |---|---|
//! | `fp32` | the `fp32_strict` preset: fp32, TF32 off, unfused AdamW, eager |
//! | `+tf32` | the `tf32` preset: fp32 matmuls and convolutions on TF32 Tensor Cores |
//! | `+bf16 autocast` | bf16 autocast, attention on the math SDPA backend only |
//! | `+sdpa fused` | the fused attention kernels enabled (PyTorch picks FlashAttention or cuDNN attention) |
//! | `+fused adamw` | the single-kernel AdamW step |
//! | `+cuda graphs` | the whole step captured once and replayed |
//! | `+speedkit kernels` | speedkit's fused kernels (LayerNorm with the residual add, cross-entropy) |
//! | `+fp8` | FP8 GEMMs in every `speedkit::nn::Linear` whose shapes allow it (SM 8.9 or newer) |
//!
//! ```text
//! cargo run --release --example ladder
//! cargo run --release --example ladder -- --size bench --json ladder.json
//! ```
//!
//! Options: `--workload NAME`, `--size tiny|bench` (default: bench on a GPU, tiny on a CPU),
//! `--warmup N` (10), `--steps N` (50), `--json FILE`. Every rung runs through the benchmark
//! machinery (`SpeedContext::new` + `Bencher` + the registered workload), in this one process, as
//! `docs/workloads.md` requires for a comparison. On a CPU, rungs that need CUDA are skipped with
//! the reason, and the CUDA-only switches (TF32, fused attention) run but change nothing on CPU kernels.

use anyhow::Context as _;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use speedkit::bench::{format_tflops, Bencher, Measurement, Protocol, Size, Workload};
use speedkit::config::{AutoBool, Precision, SdpBackendConfig, SpeedConfigBuilder};
use speedkit::flags::FlagState;
use speedkit::profile::DEFAULT_OUTPUT_DIR;
use speedkit::report::table;
use speedkit::{SpeedConfig, SpeedContext};
use std::path::{Path, PathBuf};

#[path = "../workloads/mod.rs"]
mod workloads;

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Time a workload under cumulative speed-ups and show the gain of each")]
struct Args {
    /// The registered workload to climb the ladder with.
    #[arg(long, default_value = "transformer")]
    workload: String,
    /// Problem size [default: bench on a GPU, tiny on a CPU].
    #[arg(long, value_parser = ["tiny", "bench"])]
    size: Option<String>,
    /// Untimed warm-up steps per rung (graph capture happens here).
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Timed steps per rung.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Write the rungs and their timings as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// After each rung's timing, profile STEPS more steps [default: 3] and print its kernel table
    /// (JSON and Chrome trace in speedkit-profile/).
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "3")]
    profile: Option<usize>,
}

/// One rung: a config that adds one thing to the previous rung's.
struct Rung {
    name: &'static str,
    adds: &'static str,
    config: SpeedConfig,
    needs_cuda: bool,
}

/// The rungs, each built from the one before.
fn rungs() -> anyhow::Result<Vec<Rung>> {
    let fp32 = SpeedConfig::preset("fp32_strict")?;
    let tf32 = SpeedConfig::preset("tf32")?;
    // Math-only attention, so that this rung measures autocast and the next one the kernel.
    let bf16 = SpeedConfigBuilder::from(tf32.clone())
        .precision(Precision::Bf16)
        .fused_optimizer(false)
        .compile(false)
        .sdp_backends(false, false, true, false)
        .build()?;
    // FP8 waits for its own rung.
    let mut bf16 = bf16;
    bf16.fp8.enabled = AutoBool::Off;
    // Every fused kernel allowed: PyTorch picks the fastest that fits (FlashAttention on Ampere,
    // cuDNN attention on Hopper), as `auto` does.
    let fused_sdpa = SpeedConfig {
        sdp_backend: SdpBackendConfig {
            flash: true,
            mem_efficient: true,
            math: true,
            cudnn: true,
        },
        ..bf16.clone()
    };
    fused_sdpa.validate()?;
    let fused = SpeedConfigBuilder::from(fused_sdpa.clone())
        .fused_optimizer(AutoBool::On)
        .build()?;
    let graphs = SpeedConfigBuilder::from(fused.clone())
        .compile(AutoBool::On)
        .build()?;
    let kernels = SpeedConfigBuilder::from(graphs.clone())
        .kernels(AutoBool::Auto)
        .build()?;
    let mut fp8 = kernels.clone();
    fp8.fp8.enabled = AutoBool::On;
    let rung = |name, adds, config, needs_cuda| Rung {
        name,
        adds,
        config,
        needs_cuda,
    };
    Ok(vec![
        rung(
            "fp32",
            "fp32_strict: fp32, TF32 off, unfused AdamW, eager",
            fp32,
            false,
        ),
        rung("+tf32", "fp32 matmuls on TF32 Tensor Cores", tf32, false),
        rung(
            "+bf16 autocast",
            "bf16 autocast (SDPA: math backend only)",
            bf16,
            false,
        ),
        rung(
            "+sdpa fused",
            "fused SDPA kernels (FlashAttention / cuDNN attention)",
            fused_sdpa,
            false,
        ),
        rung("+fused adamw", "single-kernel AdamW", fused, false),
        rung(
            "+cuda graphs",
            "whole step captured and replayed",
            graphs,
            true,
        ),
        rung(
            "+speedkit kernels",
            "fused LayerNorm + residual, fused cross-entropy",
            kernels,
            true,
        ),
        rung(
            "+fp8",
            "FP8 GEMMs in every speedkit::nn::Linear (SM 8.9+)",
            fp8,
            true,
        ),
    ])
}

/// What one rung gave.
enum Outcome {
    Ran {
        m: Box<Measurement>,
        notes: Vec<String>,
    },
    Skipped(String),
    Failed(String),
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let workload = Workload::named(&args.workload).with_context(|| {
        format!(
            "no workload `{}` (try `cargo run --example bench -- --list`)",
            args.workload
        )
    })?;
    let on_gpu = tch::Cuda::is_available();
    let size = match args.size.as_deref() {
        Some(s) => Size::parse(s).with_context(|| format!("--size {s}: expected tiny or bench"))?,
        None if on_gpu => Size::Bench,
        None => Size::Tiny,
    };
    let protocol = Protocol {
        warmup: args.warmup,
        steps: args.steps.max(1),
        paranoid_sync: true,
    };
    let rungs = rungs()?;
    println!(
        "optimisation ladder: {} at the {size} size, {} warm-up + {} timed steps per rung, device synchronised after every step",
        workload.name, protocol.warmup, protocol.steps
    );

    let before = FlagState::capture()?;
    let mut outcomes = Vec::new();
    for rung in &rungs {
        let outcome = if rung.needs_cuda && !on_gpu {
            Outcome::Skipped("needs a CUDA device".into())
        } else if workload.cuda_only && !on_gpu {
            Outcome::Skipped(format!("{} needs a CUDA device", workload.name))
        } else {
            match run(workload, rung, size, &protocol, args.profile) {
                Ok((m, notes)) => Outcome::Ran {
                    m: Box::new(m),
                    notes,
                },
                Err(e) => Outcome::Failed(format!("{e:#}")),
            }
        };
        if let Outcome::Failed(why) = &outcome {
            eprintln!("{} failed: {why}", rung.name);
        }
        outcomes.push(outcome);
    }
    let leaked = before.diff(&FlagState::capture()?);

    // Gains against the previous rung that ran and against the first.
    let mut rows = Vec::new();
    let mut records = Vec::new();
    let mut remarks = Vec::new();
    let (mut first, mut previous) = (None::<f64>, None::<f64>);
    for (rung, outcome) in rungs.iter().zip(&outcomes) {
        let mut row = vec![rung.name.to_string(), rung.adds.to_string()];
        match outcome {
            Outcome::Ran { m, notes } => {
                let vs_prev = previous.map(|p| p / m.median_ms);
                let vs_first = first.map(|f| f / m.median_ms);
                first.get_or_insert(m.median_ms);
                previous = Some(m.median_ms);
                row.extend([
                    format!("{:.3}", m.median_ms),
                    format!("{:.3}", m.p10_ms),
                    format!("{:.3}", m.p90_ms),
                    m.tflops.map_or("-".into(), format_tflops),
                    vs_prev.map_or("-".into(), |s| format!("{s:.2}x")),
                    vs_first.map_or("1.00x".into(), |s| format!("{s:.2}x")),
                    if m.graphed { "yes".into() } else { "no".into() },
                ]);
                records.push(json!({
                    "rung": rung.name, "adds": rung.adds, "status": "ran",
                    "median_ms": m.median_ms, "p10_ms": m.p10_ms, "p90_ms": m.p90_ms,
                    "tflops": m.tflops, "memory": m.memory, "graphed": m.graphed,
                    "speedup_vs_previous": vs_prev, "speedup_vs_fp32": vs_first.unwrap_or(1.0),
                    "final_loss": m.final_loss, "notes": notes, "times_ms": m.times_ms,
                }));
            }
            Outcome::Skipped(why) | Outcome::Failed(why) => {
                let status = if matches!(outcome, Outcome::Skipped(_)) {
                    "skipped"
                } else {
                    "FAILED"
                };
                row.extend(std::iter::repeat_n("-".to_string(), 7));
                remarks.push(format!("  {}: {status}: {why}", rung.name));
                records.push(json!({ "rung": rung.name, "adds": rung.adds, "status": status, "reason": why }));
            }
        }
        rows.push(row);
    }
    println!();
    print!(
        "{}",
        table(
            &[
                "rung",
                "adds",
                "median ms",
                "p10",
                "p90",
                "TFLOP/s",
                "vs previous",
                "vs fp32",
                "graph"
            ],
            &rows
        )
    );
    for remark in &remarks {
        println!("{remark}");
    }
    for (rung, outcome) in rungs.iter().zip(&outcomes) {
        if let Outcome::Ran { notes, .. } = outcome {
            for n in notes {
                println!("  {}: note: {n}", rung.name);
            }
        }
    }
    if leaked.is_empty() {
        println!("  every global flag read back as before the ladder");
    } else {
        let list: Vec<String> = leaked
            .iter()
            .map(|(f, was, now)| format!("{f}: {was} -> {now}"))
            .collect();
        anyhow::bail!("flags not restored after the ladder: {}", list.join(", "));
    }

    if let Some(path) = &args.json {
        let doc = json!({
            "workload": workload.name, "size": size.to_string(), "protocol": protocol,
            "device": if on_gpu { "cuda" } else { "cpu" }, "rungs": records,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("  wrote {}", path.display());
    }
    if outcomes.iter().any(|o| matches!(o, Outcome::Failed(_))) {
        anyhow::bail!("some rungs failed");
    }
    Ok(())
}

/// Runs the workload under one rung's config in a fresh context (flags restored when it drops).
fn run(
    workload: &Workload,
    rung: &Rung,
    size: Size,
    protocol: &Protocol,
    profile: Option<usize>,
) -> anyhow::Result<(Measurement, Vec<String>)> {
    let ctx = SpeedContext::new(&rung.config)?;
    let bar = ProgressBar::new((protocol.warmup + protocol.steps) as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(rung.name);
    let tick = || bar.inc(1);
    let mut b = Bencher::new(size, &ctx, protocol.clone())
        .with_progress(&tick)
        .with_profile(profile);
    let outcome = (workload.run)(&mut b);
    bar.finish_and_clear();
    outcome?;
    if let Some(p) = b.take_profile() {
        let stem = format!("ladder-{}-{}", workload.name, rung.name);
        p.print_and_write(rung.name, Path::new(DEFAULT_OUTPUT_DIR), &stem)?;
    }
    let m = b
        .take_measurement()
        .context("the workload never called Bencher::run")?;
    Ok((m, ctx.audit().notes))
}
