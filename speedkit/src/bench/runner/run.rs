//! The run loop: selects the workloads, runs each under every configuration on a [`Bencher`], and
//! assembles the [`RunReport`], the peer run and the baseline comparison; then the exit status.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::cli::{self, Args, NamedConfig};
use super::largest;
use super::output::{self, Progress};
use super::report::{DataParallelRow, Row, RunReport, REPORT_SCHEMA_VERSION};
use crate::bench::baseline::{self, Baseline};
use crate::bench::peer::{self, PeerReport};
use crate::bench::{percentile, Bencher, Protocol, Size, Workload, LARGE_TAG};
use crate::dist::LaunchEnv;
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::hardware::Hardware;
use crate::memory::{MemoryHistory, DEFAULT_HISTORY_EVENTS};
use crate::SpeedContext;

/// Measures the dense bf16 matmul rate of `device` (8192³, median of 20 after 5 warm-ups).
pub fn measure_matmul_peak(device: Device) -> Result<f64> {
    let Device::Cuda(index) = device else {
        return Err(SpeedkitError::Unsupported(
            "peak measurement needs a CUDA device".into(),
        ));
    };
    let n = 8192i64;
    let a = Tensor::f_randn([n, n], (Kind::BFloat16, device))?;
    let b = Tensor::f_randn([n, n], (Kind::BFloat16, device))?;
    let mut times = Vec::new();
    for i in 0..25 {
        let (start, end) = (
            ffi::device::CudaEvent::new()?,
            ffi::device::CudaEvent::new()?,
        );
        start.record()?;
        let _c = a.f_matmul(&b)?;
        end.record()?;
        ffi::device::cuda_synchronize(index)?;
        if i >= 5 {
            times.push(start.elapsed_ms(&end)?);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / (percentile(&times, 50.0) * 1e-3) / 1e12)
}

/// Runs `workloads` as `args` say, printing errors; returns the exit status (see the module docs).
pub fn main_with(args: &Args, workloads: &[&Workload]) -> u8 {
    match run_with(args, workloads) {
        Ok(report) => exit_status(args, &report),
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

/// 1 when a row failed or is slower than the baseline beyond `--fail-above` (each said on
/// stderr), 0 otherwise.
pub fn exit_status(args: &Args, report: &RunReport) -> u8 {
    let mut status = 0;
    if report.rows.iter().any(|r| r.error.is_some()) {
        status = 1;
    }
    if let (Some(pct), Some(comparison)) = (args.fail_above, &report.baseline) {
        for (r, c) in comparison.slower_beyond(pct) {
            eprintln!(
                "regression: {} / {} takes {:.3}x the baseline's time (95% CI {:.3}-{:.3}), \
                 slower beyond --fail-above {pct}%",
                r.workload, r.config, c.ratio, c.low, c.high
            );
            status = 1;
        }
    }
    status
}

/// Runs every registered workload `args` selects and prints/writes the results.
pub fn run(args: &Args) -> Result<RunReport> {
    run_with(args, &Workload::all())
}

/// Runs those of `workloads` that `args` selects and prints/writes the results.
pub fn run_with(args: &Args, workloads: &[&Workload]) -> Result<RunReport> {
    let selected = select(workloads, &args.filters, args.exact)?;
    let hardware = Hardware::detect()?;
    let launch = LaunchEnv::from_env()?;
    let main = launch.as_ref().is_none_or(LaunchEnv::is_main);
    if args.list {
        if main {
            output::print_list(&selected);
        }
        return Ok(RunReport::empty(hardware));
    }
    if args.largest_batch {
        let found = largest::largest_batches(args, &selected, hardware.clone())?;
        if main {
            println!("{}", largest::render(&found));
            if let Some(path) = &args.json {
                output::write_json(path, &found)?;
            }
        }
        return Ok(RunReport::empty(hardware));
    }
    let report = measure_report(args, &selected, hardware, launch.as_ref())?;
    // Every rank has the same rows; one copy of the tables and files is enough.
    if main {
        println!("{}", output::render_text(&report));
        output::write_outputs(args, &report)?;
    }
    Ok(report)
}

/// Measures `selected` under the configurations of `args`, then runs the peer and compares with
/// the baseline when asked: the whole report of a run that is not `--list`.
fn measure_report(
    args: &Args,
    selected: &[&Workload],
    hardware: Hardware,
    launch: Option<&LaunchEnv>,
) -> Result<RunReport> {
    let world_size = launch.map_or(1, |e| e.world_size);
    cli::check_peer(args, world_size)?;
    let configs = cli::configs_of(args)?;
    // Bad baseline arguments fail before anything is measured.
    let baseline = args.baseline.as_deref().map(Baseline::load).transpose()?;
    if let Some(name) = &args.save_baseline {
        baseline::path_for(name)?;
    }
    let on_gpu = !hardware.gpus.is_empty();
    let size = cli::size_of(args, on_gpu);
    let protocol = cli::protocol_of(args, &configs[0].config);
    let (peak_tflops, peak_source) = device_peak(args, on_gpu, launch)?;
    let rows = measure_all(
        selected,
        &configs,
        size,
        &protocol,
        peak_tflops,
        on_gpu,
        args,
    );
    let peer = args
        .peer
        .as_ref()
        .map(|name| run_peer(name, args, &rows, size, &protocol));
    let comparison = baseline.map(|b| {
        baseline::compare(
            &b,
            &rows,
            &hardware,
            &protocol,
            args.noise_threshold / 100.0,
        )
    });
    Ok(RunReport {
        schema_version: REPORT_SCHEMA_VERSION,
        environment: hardware,
        world_size,
        peak_tflops,
        peak_source,
        protocol,
        configs,
        rows,
        baseline: comparison,
        peer,
    })
}

/// The workloads matching any of `filters` (all when there is none; with `exact`, by whole name
/// only); no workload at all, or none matching, is an error that says how to fix it.
pub fn select<'w>(
    workloads: &[&'w Workload],
    filters: &[String],
    exact: bool,
) -> Result<Vec<&'w Workload>> {
    if workloads.is_empty() {
        return Err(SpeedkitError::Misuse(
            "no workloads are registered in this benchmark runner: it runs the \
             `#[speedkit::bench]` functions of the crate it names, so write \
             `speedkit::bench_main!(your_crate);` with the crate that defines them (a dependency \
             of this bench target)"
                .into(),
        ));
    }
    let selected: Vec<&Workload> = workloads
        .iter()
        .copied()
        .filter(|w| {
            filters.is_empty()
                || filters.iter().any(|f| match exact {
                    true => w.matches_exactly(f),
                    false => w.matches(f),
                })
        })
        .collect();
    if selected.is_empty() {
        let names: Vec<&str> = workloads.iter().map(|w| w.name).collect();
        return Err(SpeedkitError::Misuse(format!(
            "--filter {} matches no workload: a filter is part of a name or a whole tag; the \
             workloads are {} (see --list)",
            filters.join(" --filter "),
            names.join(", ")
        )));
    }
    Ok(selected)
}

/// The peak for "% of peak". Under a launcher only rank 0 (which prints) measures it, on its own
/// device: the other ranks' devices are busy with nothing else yet, but they print no table.
fn device_peak(
    args: &Args,
    on_gpu: bool,
    launch: Option<&LaunchEnv>,
) -> Result<(Option<f64>, String)> {
    Ok(match (args.peak_tflops, on_gpu, launch) {
        (Some(p), _, _) => (Some(p), "given with --peak-tflops".to_string()),
        (None, true, Some(env)) if !env.is_main() => (None, "measured by rank 0".to_string()),
        (None, true, _) => (
            Some(measure_matmul_peak(Device::Cuda(
                launch.map_or(0, |env| env.local_rank),
            ))?),
            "measured: 8192^3 bf16 matmul, median of 20".to_string(),
        ),
        (None, false, _) => (None, "no GPU: no peak".to_string()),
    })
}

fn measure_all(
    workloads: &[&Workload],
    configs: &[NamedConfig],
    size: Size,
    protocol: &Protocol,
    peak_tflops: Option<f64>,
    on_gpu: bool,
    args: &Args,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let main = crate::dist::is_main_process();
    settle_workspaces(on_gpu);
    for w in workloads {
        let skip = if w.cuda_only && !on_gpu {
            Some("needs a CUDA device".to_string())
        } else if !w.sizes.contains(&size) {
            Some(format!("no {size} size"))
        } else if size == Size::Bench && w.tags.contains(&LARGE_TAG) && !named(w, args) {
            Some(format!(
                "tagged `{LARGE_TAG}`: too large for one GPU, it runs only where named (`--filter \
                 {}`), under `speedkit launch` with its parameters sharded \
                 (examples/configs/dp_zero3.yaml)",
                w.name
            ))
        } else {
            None
        };
        if let Some(why) = skip {
            if main {
                eprintln!("skip {}: {why}", w.name);
            }
            continue;
        }
        let mut first_median: Option<f64> = None;
        for nc in configs {
            let row = run_one(w, nc, size, protocol, peak_tflops, args);
            if let Some(m) = &row.measurement {
                let base = *first_median.get_or_insert(m.median_ms);
                rows.push(Row {
                    speedup: Some(base / m.median_ms),
                    ..row
                });
            } else {
                eprintln!(
                    "error: {} under {}: {}",
                    w.name,
                    nc.name,
                    row.error.as_deref().unwrap_or("?")
                );
                rows.push(row);
            }
        }
    }
    rows
}

/// Whether a filter of the run names `w` whole.
fn named(w: &Workload, args: &Args) -> bool {
    args.filters.iter().any(|f| w.matches_exactly(f))
}

/// Before the first workload (see [`crate::bench::settle_library_workspaces`]); a failure only
/// costs the figures their isolation, so it is said and the run goes on.
pub(super) fn settle_workspaces(on_gpu: bool) {
    if !on_gpu {
        return;
    }
    let device = crate::dist::LaunchEnv::from_env()
        .ok()
        .flatten()
        .map_or(0, |env| env.local_rank);
    if let Err(e) = crate::bench::settle_library_workspaces(device) {
        eprintln!("warning: cuBLAS's workspaces could not be made up front ({e}): later rows may count earlier ones' memory");
    }
}

/// Runs the peer on the workloads that produced rows; when it cannot run, says why in one line.
fn run_peer(name: &str, args: &Args, rows: &[Row], size: Size, protocol: &Protocol) -> PeerReport {
    let mut workloads: Vec<String> = Vec::new();
    for r in rows.iter().filter(|r| r.measurement.is_some()) {
        if !workloads.contains(&r.workload) {
            workloads.push(r.workload.clone());
        }
    }
    if workloads.is_empty() {
        return PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some("no speedkit row was measured, so there is nothing to compare".into()),
        };
    }
    let python = peer::find_python(args.python.as_deref());
    eprintln!(
        "running the PyTorch peer with {} on {} ...",
        python.display(),
        workloads.join(", ")
    );
    match peer::run_pytorch(&python, &workloads, &size.to_string(), protocol) {
        Ok(run) if run.rows.is_empty() => PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some(format!(
                "the reference has no PyTorch version of {} (it has {})",
                workloads.join(", "),
                peer::REFERENCE_WORKLOADS.join(", ")
            )),
        },
        Ok(run) => PeerReport {
            peer: name.to_string(),
            run: Some(run),
            not_run: None,
        },
        Err(why) => PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some(why),
        },
    }
}

/// Runs workload `w` under `nc` with a progress bar: its row, measured or with the error.
fn run_one(
    w: &Workload,
    nc: &NamedConfig,
    size: Size,
    protocol: &Protocol,
    peak: Option<f64>,
    args: &Args,
) -> Row {
    let mut row = Row::pending(w.name, &nc.name, size);
    let ctx = match SpeedContext::new(&nc.config) {
        Ok(c) => c,
        Err(e) => {
            row.error = Some(e.to_string());
            return row;
        }
    };
    row.precision = ctx.plan().precision.to_string();
    let bar = Progress::new(
        ctx.is_main(),
        protocol.warmup + protocol.steps,
        format!("{} / {}", w.name, nc.name),
    );
    let tick = || bar.tick();
    let mut b = Bencher::new(size, &ctx, protocol.clone())
        .with_progress(&tick)
        .with_profile(args.profile)
        .with_fusion_plan(args.fusion_plan)
        .with_batch(args.batch);
    let _ = crate::kernels::take_ops_run();
    let (history, mut history_note) = start_memory_history(args);
    let outcome = (w.run)(&mut b);
    if let (Some(h), Some(dir)) = (history, &args.memory_history) {
        history_note = Some(finish_memory_history(h, dir, w.name, &nc.name));
    }
    row.kernels = crate::kernels::take_ops_run()
        .into_iter()
        .map(String::from)
        .collect();
    bar.finish();
    let profile = b.take_profile();
    if let Some(plan) = b.take_fusion_plan().filter(|_| ctx.is_main()) {
        println!("{} / {}: {plan}", w.name, nc.name);
    }
    let measurement = b.take_measurement();
    if let Some(group) = ctx.process_group() {
        match DataParallelRow::gather(group, measurement.as_ref()) {
            Ok(d) => row.data_parallel = Some(d),
            Err(e) => row.error = Some(e.to_string()),
        }
    }
    record_audit(&mut row, &ctx);
    row.notes.extend(history_note);
    if let Some(why) = measurement.as_ref().and_then(|m| m.clocks_unread.as_ref()) {
        row.notes
            .push(format!("GPU clock and power not read: {why}"));
    }
    if let Some(p) = profile {
        if let Err(e) = output::write_profile(&p, w.name, &nc.name) {
            row.notes.push(format!("profile not written: {e}"));
        }
    }
    match (outcome, measurement) {
        (Err(e), _) => row.error = Some(e.to_string()),
        (Ok(()), None) => row.error = Some("the workload never called Bencher::run".into()),
        // The gather across ranks failed (already in `row.error`).
        (Ok(()), Some(_)) if row.error.is_some() => {}
        (Ok(()), Some(m)) => {
            row.percent_of_peak = match (m.tflops, peak) {
                (Some(t), Some(p)) => Some(100.0 * t / p),
                _ => None,
            };
            row.measurement = Some(m);
        }
    }
    row
}

/// The allocator's history recording where `--memory-history` asks for one, else `None`; the note
/// saying why where it cannot record.
fn start_memory_history(args: &Args) -> (Option<MemoryHistory>, Option<String>) {
    if args.memory_history.is_none() {
        return (None, None);
    }
    match MemoryHistory::record(DEFAULT_HISTORY_EVENTS) {
        Ok(h) => (Some(h), None),
        Err(e) => (None, Some(format!("memory history not recorded: {e}"))),
    }
}

/// Writes the history `history` recorded over the run of `workload` under `config` into `dir` and
/// stops the recording (where it started it): the note saying where it went.
fn finish_memory_history(
    history: MemoryHistory,
    dir: &Path,
    workload: &str,
    config: &str,
) -> String {
    match output::write_memory_history(&history, dir, workload, config) {
        Ok(path) => format!("memory history written to {}", path.display()),
        Err(e) => format!("memory history not written: {e}"),
    }
}

/// The flags the context changed (name = value) and its notes, into `row`.
fn record_audit(row: &mut Row, ctx: &SpeedContext) {
    let audit = ctx.audit();
    row.flags = audit
        .flag_changes
        .iter()
        .filter(|c| c.changed())
        .map(|c| format!("{} = {}", c.name, c.after))
        .collect();
    row.notes = audit.notes;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SpeedConfig;
    use crate::kernels::KernelOp;
    use crate::overrides::{DispatchKey, OperatorOverride, Reply};

    /// An override at the CPU key on an operator no other test calls, noted as `op`, that
    /// declines every call (`ran: false`) or computes it.
    fn erfinv_override(op: KernelOp, ran: bool) -> crate::overrides::OverrideRegistration {
        OperatorOverride::new("aten::erfinv", DispatchKey::Cpu, move |call| {
            Ok(if ran {
                Reply::Ran(vec![call.tensor("self")?.f_erfinv()?])
            } else {
                Reply::Declined("the runner test declines it".into())
            })
        })
        .noted_as(op)
        .register()
        .expect("aten::erfinv takes a CPU kernel")
    }

    #[test]
    fn a_rust_built_override_lands_in_the_kernel_notes_the_audit_and_the_runner_json() {
        let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap();
        let mut row = Row::pending("overridden", "auto", Size::Tiny);
        let _ = crate::kernels::take_ops_run();
        let x = Tensor::from_slice(&[0.25f32, -0.5]);
        let declining = erfinv_override(KernelOp::BatchNorm, false);
        let _ = x.erfinv();
        drop(declining);
        let running = erfinv_override(KernelOp::CrossEntropy, true);
        let _ = x.erfinv();
        drop(running);
        row.kernels = crate::kernels::take_ops_run()
            .into_iter()
            .map(String::from)
            .collect();
        record_audit(&mut row, &ctx);

        let declined = "batch_norm: aten::erfinv: the runner test declines it";
        assert!(
            ctx.audit().notes.iter().any(|n| n.contains(declined)),
            "{:?}",
            ctx.audit().notes
        );
        let json = serde_json::to_string(&row).unwrap();
        assert!(json.contains(declined), "{json}");
        assert!(row.kernels.iter().any(|k| k == "cross_entropy"), "{json}");
        assert!(!row.kernels.iter().any(|k| k == "batch_norm"), "{json}");
    }
}
