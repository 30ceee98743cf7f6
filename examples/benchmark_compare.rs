//! The seed benchmark, baseline against speedkit, in one process: `linear3` under `fp32_strict`
//! (fp32, TF32 off, no autotuning, unfused AdamW, no graphs) and under `auto` (what speedkit picks
//! for this machine), with the speedup, every global flag each config changed (before → after,
//! read back from libtorch) and a check that all flags were put back afterwards.
//!
//! ```text
//! cargo run --release --example benchmark_compare
//! cargo run --release --example benchmark_compare -- --size bench --steps 100
//! cargo run --release --example benchmark_compare -- --workload transformer --config tf32
//! ```
//!
//! Options: `--workload NAME` (default `linear3`), `--config NAME|FILE` (repeatable; default
//! `fp32_strict` then `auto`; the first is the baseline), `--size tiny|bench` (default: bench on a
//! GPU, tiny on a CPU), `--warmup N` (10), `--steps N` (50). Timings follow `docs/workloads.md`:
//! warm-up, then every step timed with a device synchronisation after it; median, p10, p90.

use anyhow::{bail, Context as _};
use clap::Parser;
use speedkit::bench::runner::resolve_config;
use speedkit::bench::{format_tflops, Bencher, Measurement, Protocol, Size, Workload};
use speedkit::flags::{FlagChange, FlagState};
use speedkit::report::table;
use speedkit::SpeedContext;

#[path = "../workloads/mod.rs"]
mod workloads;

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "Compare a workload under a baseline and speedkit's configs, in one process")]
struct Args {
    /// The registered workload to run.
    #[arg(long, default_value = "linear3")]
    workload: String,
    /// Configs to compare: preset (fp32_strict, tf32, auto), bf16, fp16, or a YAML/JSON file [default: fp32_strict, auto].
    #[arg(long = "config", value_name = "NAME|FILE")]
    configs: Vec<String>,
    /// Problem size [default: bench on a GPU, tiny on a CPU].
    #[arg(long, value_parser = ["tiny", "bench"])]
    size: Option<String>,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 50)]
    steps: usize,
}

/// One config's run.
struct Outcome {
    name: String,
    precision: String,
    measurement: Measurement,
    changes: Vec<FlagChange>,
    notes: Vec<String>,
    /// Flags that differ after the context dropped from before it was made: must be empty.
    leaked: Vec<String>,
    compared: usize,
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
    if workload.cuda_only && !on_gpu {
        bail!("`{}` needs a CUDA device", workload.name);
    }
    let size = match args.size.as_deref() {
        Some(s) => Size::parse(s).with_context(|| format!("--size {s}: expected tiny or bench"))?,
        None if on_gpu => Size::Bench,
        None => Size::Tiny,
    };
    let names = if args.configs.is_empty() {
        vec!["fp32_strict".into(), "auto".into()]
    } else {
        args.configs.clone()
    };
    let protocol = Protocol {
        warmup: args.warmup,
        steps: args.steps.max(1),
        paranoid_sync: true,
    };
    println!(
        "{} at the {size} size: {} warm-up + {} timed steps per config, device synchronised after every step",
        workload.name, protocol.warmup, protocol.steps
    );

    let mut outcomes = Vec::new();
    for name in &names {
        outcomes.push(run(workload, name, size, &protocol)?);
    }

    let base = outcomes[0].measurement.median_ms;
    let rows: Vec<Vec<String>> = outcomes
        .iter()
        .map(|o| {
            let m = &o.measurement;
            vec![
                o.name.clone(),
                o.precision.clone(),
                format!("{:.3}", m.median_ms),
                format!("{:.3}", m.p10_ms),
                format!("{:.3}", m.p90_ms),
                m.tflops.map_or("-".into(), format_tflops),
                format!("{:.2}x", base / m.median_ms),
                m.final_loss.map_or("-".into(), |l| format!("{l:.4}")),
            ]
        })
        .collect();
    println!();
    print!(
        "{}",
        table(
            &[
                "config",
                "precision",
                "ms/step (median)",
                "p10",
                "p90",
                "TFLOP/s",
                "speedup",
                "final loss"
            ],
            &rows
        )
    );

    let mut all_restored = true;
    for o in &outcomes {
        println!("\n{}: state changes", o.name);
        let changed: Vec<&FlagChange> = o.changes.iter().filter(|c| c.changed()).collect();
        if changed.is_empty() {
            println!("  no global flag changed (every setting already had the planned value or was left alone)");
        }
        for c in changed {
            println!("  {}: {} -> {}  ({})", c.name, c.before, c.after, c.reason);
        }
        for n in &o.notes {
            println!("  note: {n}");
        }
        if o.leaked.is_empty() {
            println!(
                "  restored: all {} flags read back equal to their values before the run",
                o.compared
            );
        } else {
            all_restored = false;
            println!("  NOT restored: {}", o.leaked.join(", "));
        }
    }
    if !all_restored {
        bail!("some flags were not restored");
    }
    Ok(())
}

/// Runs `workload` under the config `name` in a fresh context, and checks the flags afterwards.
fn run(
    workload: &Workload,
    name: &str,
    size: Size,
    protocol: &Protocol,
) -> anyhow::Result<Outcome> {
    let named = resolve_config(name)?;
    let before = FlagState::capture()?;
    let (measurement, precision, audit) = {
        let ctx = SpeedContext::new(&named.config).with_context(|| format!("config {name}"))?;
        let mut b = Bencher::new(size, &ctx, protocol.clone());
        (workload.run)(&mut b).with_context(|| format!("{} under {name}", workload.name))?;
        let m = b.take_measurement().context("the workload did not run")?;
        (m, ctx.plan().precision.to_string(), ctx.audit())
        // `ctx` drops here: every flag it set goes back.
    };
    let after = FlagState::capture()?;
    let leaked = before
        .diff(&after)
        .iter()
        .map(|(f, was, now)| format!("{f}: {was} -> {now}"))
        .collect();
    Ok(Outcome {
        name: named.name,
        precision,
        measurement,
        changes: audit.flag_changes,
        notes: audit.notes,
        leaked,
        compared: after.iter().count(),
    })
}
