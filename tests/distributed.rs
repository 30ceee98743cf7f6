//! Data parallelism on the CPU over Gloo: two processes started by the launcher train a tiny model;
//! their parameters end equal to each other and to one process trained on the concatenated batches.
//! Faults end every rank with a clear error: a killed rank, different configs, a bad environment.
//! The benchmark runner (over this repository's workloads) and the `toy_transformer` example run
//! under the launcher and report every rank's figures and the total throughput.
//!
//! The ranks are this test executable itself, re-run with `--ignored --exact dist_worker` (and the
//! launcher with `--exact dist_launcher`); `SK_TEST_*` variables tell them what to do.

mod common;
#[path = "../workloads/mod.rs"]
mod workloads;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use speedkit::config::{AllReduce, DeviceChoice, DistributedBackend, SpeedConfig};
use speedkit::dist::LaunchEnv;
use speedkit::flags::FlagState;
use speedkit::optim::AdamW;
use speedkit::{apply_speedups, SpeedkitError};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const PER_RANK_BATCH: i64 = 8;
const STEPS: i64 = 6;
const WORLD: i64 = 2;

fn config(bucket_mb: u32) -> SpeedConfig {
    let mut c = SpeedConfig::auto();
    c.device = DeviceChoice::Cpu;
    c.distributed.backend = DistributedBackend::Gloo;
    c.distributed.timeout_s = 30;
    // Small buckets: the tiny model's gradients travel in several all-reduces.
    c.distributed.bucket_mb = bucket_mb;
    // Replicas compared after every step: equal training must never trip the check.
    c.distributed.check_replicas_every = 1;
    c
}

/// Hidden width: l1's weight is exactly 1 MiB, so with 1 MiB buckets it is a bucket of its own
/// (all-reduced in place) and the other parameters share one.
const HIDDEN: i64 = 32 * 1024;

fn model(vs: &nn::VarStore) -> impl Module {
    nn::seq()
        .add(nn::linear(vs.root() / "l1", 8, HIDDEN, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", HIDDEN, 1, Default::default()))
}

/// The whole data set, the same in every process: STEPS global batches of WORLD × PER_RANK_BATCH.
fn data() -> (Tensor, Tensor) {
    tch::manual_seed(1234);
    let n = STEPS * WORLD * PER_RANK_BATCH;
    let x = Tensor::randn([n, 8], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
    (x, y)
}

fn adamw() -> AdamW {
    AdamW {
        lr: 1e-2,
        ..Default::default()
    }
}

// ----- the processes -----------------------------------------------------------------------------

/// One rank: trains on its half of each global batch and saves its parameters. Model weights are
/// initialised from a per-rank seed, so equal results prove rank 0's broadcast.
#[test]
#[ignore = "a rank of the distributed tests, started by them"]
fn dist_worker() {
    let scenario = std::env::var("SK_TEST_SCENARIO").unwrap_or_default();
    let out = PathBuf::from(std::env::var("SK_TEST_OUT").unwrap_or_default());
    let before = FlagState::capture().unwrap();
    let result = train_rank(&scenario, &out);
    let after = FlagState::capture().unwrap();
    assert_eq!(before.diff(&after), vec![], "flags not restored");
    println!("flags restored");
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn train_rank(scenario: &str, out: &Path) -> Result<(), SpeedkitError> {
    let env = LaunchEnv::from_env()?;
    let rank = env.as_ref().map_or(0, |e| e.rank);
    if scenario == "fail_before_joining" && rank == 1 {
        std::process::exit(3);
    }
    if scenario == "accelerate" {
        return train_accelerated_rank(rank, out);
    }
    if scenario == "bench_runner" || scenario == "bench_runner_peer" {
        return run_bench_rank(out, scenario == "bench_runner_peer");
    }
    if let Some(variant) = scenario.strip_prefix("nccl_") {
        return train_nccl_rank(rank, out, variant);
    }
    let bucket_mb = if scenario == "mismatched_config" && rank == 1 {
        2
    } else {
        1
    };
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let mut config = config(bucket_mb);
    if let Some(all_reduce) = scenario.strip_prefix("train_") {
        config.distributed.all_reduce = match all_reduce {
            "in_backward" => AllReduce::InBackward,
            "sharded" => AllReduce::Auto,
            _ => AllReduce::AfterBackward,
        };
    }
    config.distributed.shard_optimizer = scenario == "train_sharded";
    let ctx = apply_speedups(&mut vs, &config)?;
    ctx.print_main(ctx.audit());
    let mut opt = ctx.adamw(&vs, adamw())?;
    if config.distributed.shard_optimizer {
        // A sharded optimizer covers the attached model only.
        let other = nn::VarStore::new(Device::Cpu);
        let _net = model(&other);
        match ctx.adamw(&other, adamw()) {
            Ok(_) => println!("an optimizer over another model was made"),
            Err(e) => println!("another model: {e}"),
        }
    }
    let steps = if scenario == "train_until_killed" {
        100_000
    } else {
        STEPS
    };
    for step in 0..steps {
        let start = (step % STEPS) * WORLD * PER_RANK_BATCH + rank as i64 * PER_RANK_BATCH;
        let xb = x.narrow(0, start, PER_RANK_BATCH);
        let yb = y.narrow(0, start, PER_RANK_BATCH);
        let loss = ctx.autocast(|| net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean));
        if scenario == "drift" && rank == 1 && step == 3 {
            // An edit outside the step, on one rank only: the next check must catch it.
            let _no_grad = tch::no_grad_guard();
            let _ = vs.variables()["l2.bias"]
                .shallow_clone()
                .f_add_scalar_(1e-3)?;
        }
        if config.distributed.shard_optimizer {
            // Clipping far above the norm multiplies by exactly 1: the same training, and the
            // norm, which each rank must compute over the whole gradient, printed.
            opt.zero_grad()?;
            ctx.backward(&loss)?;
            let norm = opt.clip_grad_norm(1e9)?.f_double_value(&[])?;
            ctx.step(&mut opt)?;
            println!("gradient norm {step}: {norm:e}");
        } else {
            ctx.backward_step(&loss, &mut opt)?;
        }
        if step < STEPS {
            println!("step {step} done");
        }
    }
    let held = opt.memory();
    println!(
        "optimizer holds {} parameter bytes, {} state bytes",
        held.parameters, held.state
    );
    vs.save(out.join(format!("rank{rank}.ot")))
        .map_err(|e| SpeedkitError::Torch(e.to_string()))?;
    Ok(())
}

/// The training of `train_rank` on this rank's GPU over NCCL in fp32, through the graph-mode API,
/// in one of the variants the NCCL test names: `graphs_off` (eager, the Reducer's all-reduce),
/// `graphs_auto` (one CUDA graph with the all-reduce inside, started during the backward pass),
/// `after_backward` (graphed, all-reduced after the backward pass), `reducer` (graphs on auto, the
/// Reducer asked for: eager), `bf16` (graphed, gradients sent in bf16), `sharded` (graphed, the
/// optimizer state sharded: gradients reduce-scattered, parameters all-gathered).
fn train_nccl_rank(rank: usize, out: &Path, variant: &str) -> Result<(), SpeedkitError> {
    use speedkit::config::{AutoBool, GradientCompression, MatmulPrecisionChoice, Precision};
    let mut config = SpeedConfig::auto();
    config.precision = Precision::Fp32;
    config.tf32_matmul_precision = MatmulPrecisionChoice::Highest;
    config.compile.enabled = if variant == "graphs_off" {
        AutoBool::Off
    } else {
        AutoBool::Auto
    };
    config.distributed.all_reduce = match variant {
        "reducer" => AllReduce::Reducer,
        "after_backward" => AllReduce::AfterBackward,
        _ => AllReduce::Auto,
    };
    if variant == "bf16" {
        config.distributed.compress = GradientCompression::Bf16;
    }
    config.distributed.shard_optimizer = variant == "sharded";
    config.distributed.backend = DistributedBackend::Nccl;
    config.distributed.timeout_s = 60;
    config.distributed.bucket_mb = 1;
    // Compared after every step, replays included.
    config.distributed.check_replicas_every = 1;
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let ctx = apply_speedups(&mut vs, &config)?;
    let device = ctx.device();
    let mut opt = ctx.adamw(&vs, adamw())?;
    let mut step = ctx.graphed(|inputs: &[Tensor]| {
        let loss = ctx.autocast(|| {
            net.forward(&inputs[0])
                .mse_loss(&inputs[1], tch::Reduction::Mean)
        });
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    for s in 0..STEPS {
        let start = s * WORLD * PER_RANK_BATCH + rank as i64 * PER_RANK_BATCH;
        let xb = x.narrow(0, start, PER_RANK_BATCH).to_device(device);
        let yb = y.narrow(0, start, PER_RANK_BATCH).to_device(device);
        step.run(&[&xb, &yb])?;
    }
    println!(
        "graphed: {} ({})",
        step.is_graphed(),
        step.fallback_reason().unwrap_or("no fallback")
    );
    drop(step);
    ctx.print_main(ctx.audit());
    vs.set_device(Device::Cpu);
    vs.save(out.join(format!("rank{rank}.ot")))
        .map_err(|e| SpeedkitError::Torch(e.to_string()))
}

/// The same training written as an ordinary `#[accelerate]` function: no distributed code.
#[speedkit::accelerate(device = "cpu")]
fn train_accelerated(
    vs: &nn::VarStore,
    net: &impl Module,
    x: &Tensor,
    y: &Tensor,
) -> speedkit::Result<()> {
    let mut opt = nn::Sgd::default()
        .build(vs, 0.1)
        .map_err(|e| SpeedkitError::Torch(e.to_string()))?;
    for step in 0..STEPS {
        let xb = x.narrow(0, step * PER_RANK_BATCH, PER_RANK_BATCH);
        let yb = y.narrow(0, step * PER_RANK_BATCH, PER_RANK_BATCH);
        #[speedkit::forward]
        let loss = net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn train_accelerated_rank(rank: usize, out: &Path) -> Result<(), SpeedkitError> {
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    // Each rank its own rows.
    let (x, y) = (
        x.narrow(0, rank as i64 * 48, 48),
        y.narrow(0, rank as i64 * 48, 48),
    );
    train_accelerated(&vs, &net, &x, &y)?;
    vs.save(out.join(format!("rank{rank}.ot")))
        .map_err(|e| SpeedkitError::Torch(e.to_string()))
}

/// Two configs on the CPU over Gloo (each a process group of its own, one after the other).
fn write_bench_configs(out: &Path) -> [PathBuf; 2] {
    let gloo = "distributed: {backend: gloo, timeout_s: 60}\n";
    let cpu = out.join("cpu.yaml");
    let bf16 = out.join("cpu_bf16.yaml");
    std::fs::write(&cpu, format!("device: cpu\n{gloo}")).unwrap();
    std::fs::write(&bf16, format!("device: cpu\nprecision: bf16\n{gloo}")).unwrap();
    [cpu, bf16]
}

/// One rank of the benchmark runner: `transformer` and `linear3` at the tiny size under both
/// configs of [`write_bench_configs`]; rank 0 writes `report.json`. With `peer`, also
/// `--peer pytorch` (which a data-parallel run refuses).
fn run_bench_rank(out: &Path, peer: bool) -> Result<(), SpeedkitError> {
    use clap::Parser;
    use speedkit::bench::runner::{main_with, Args};
    use speedkit::bench::Workload;
    let [cpu, bf16] = [out.join("cpu.yaml"), out.join("cpu_bf16.yaml")];
    let json = out.join("report.json");
    let peer_args = if peer {
        &["--peer", "pytorch"][..]
    } else {
        &[]
    };
    let args = Args::try_parse_from(
        [
            "bench",
            "--exact",
            "--filter",
            "transformer",
            "--filter",
            "linear3",
            "--size",
            "tiny",
            "--warmup",
            "1",
            "--steps",
            "3",
            "--config",
            cpu.to_str().unwrap(),
            "--config",
            bf16.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]
        .iter()
        .chain(peer_args),
    )
    .map_err(|e| SpeedkitError::Misuse(e.to_string()))?;
    match main_with(&args, &Workload::all()) {
        0 => Ok(()),
        status => Err(SpeedkitError::Misuse(format!(
            "the runner exited with status {status}"
        ))),
    }
}

/// The launcher, in its own process (it installs signal handlers and spawns the ranks): of this
/// executable's `dist_worker`, or of the command in `SK_TEST_COMMAND` (arguments separated by
/// newlines).
#[test]
#[ignore = "the launcher of the distributed tests, started by them"]
fn dist_launcher() {
    let exe = std::env::current_exe().unwrap().display().to_string();
    let command = match std::env::var("SK_TEST_COMMAND") {
        Ok(c) => c.lines().map(str::to_string).collect(),
        Err(_) => worker_args().into_iter().fold(vec![exe], |mut v, a| {
            v.push(a.to_string());
            v
        }),
    };
    let options = speedkit::launch::LaunchOptions::new(2, command);
    let status = speedkit::launch::launch(&options).unwrap();
    std::process::exit(status);
}

fn worker_args() -> [&'static str; 5] {
    [
        "--exact",
        "dist_worker",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("speedkit-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the launcher for `scenario`; fails the test instead of hanging if it never ends.
fn run_launcher(scenario: &str, out: &Path) -> Output {
    run_launcher_of(scenario, out, None)
}

/// [`run_launcher`], of `command` instead of this executable's `dist_worker` when given.
fn run_launcher_of(scenario: &str, out: &Path, command: Option<&[String]>) -> Output {
    let exe = std::env::current_exe().unwrap();
    let mut launcher = Command::new(exe);
    if let Some(command) = command {
        launcher.env("SK_TEST_COMMAND", command.join("\n"));
    }
    let child = launcher
        .args([
            "--exact",
            "dist_launcher",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SK_TEST_SCENARIO", scenario)
        .env("SK_TEST_OUT", out)
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_bounded(child, Duration::from_secs(120))
}

/// A rank started directly (no launcher) with an explicit environment.
fn spawn_rank(scenario: &str, out: &Path, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut command = Command::new(exe);
    command
        .args(worker_args())
        .env("SK_TEST_SCENARIO", scenario)
        .env("SK_TEST_OUT", out)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in vars {
        command.env(k, v);
    }
    command.spawn().unwrap()
}

fn rank_env(rank: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".into()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
    ]
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Waits for `child` at most `limit` (a guard against hangs, far above the configured collective
/// timeout; not a speed measurement), killing it and failing the test past that.
fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "process still running after {limit:?} (a hang):\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn load(path: &Path) -> Vec<(String, Tensor)> {
    let mut named = Tensor::load_multi(path).unwrap();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

// ----- the tests ---------------------------------------------------------------------------------

#[test]
fn launcher_trains_two_gloo_ranks_to_equal_parameters() {
    let out = scratch("equal");
    let output = run_launcher("train", &out);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("[rank 0] step 5 done"), "{log}");
    assert!(log.contains("[rank 1] step 5 done"), "{log}");
    let (a, b) = (load(&out.join("rank0.ot")), load(&out.join("rank1.ot")));
    assert_eq!(a.len(), 4);
    for ((name, pa), (_, pb)) in a.iter().zip(&b) {
        assert!(pa.equal(pb), "{name} differs between the ranks");
    }
}

#[test]
fn accelerate_functions_train_data_parallel_with_no_code_change() {
    let out = scratch("accelerate");
    let output = run_launcher("accelerate", &out);
    assert!(output.status.success(), "{}", text(&output));
    let (a, b) = (load(&out.join("rank0.ot")), load(&out.join("rank1.ot")));
    for ((name, pa), (_, pb)) in a.iter().zip(&b) {
        assert!(pa.equal(pb), "{name} differs between the ranks");
    }
}

#[test]
fn two_ranks_match_one_process_on_the_concatenated_batches() {
    let single = single_process_reference();
    // The Reducer's all-reduce, and speedkit's during and after the backward pass.
    for (scenario, all_reduce) in [
        ("train", REDUCER),
        ("train_in_backward", "speedkit's all-reduce (in_backward)"),
        (
            "train_after_backward",
            "speedkit's all-reduce (after_backward)",
        ),
    ] {
        let out = scratch(&format!("reference-{scenario}"));
        let output = run_launcher(scenario, &out);
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        assert!(log.contains(all_reduce), "{log}");
        let distributed = load(&out.join("rank0.ot"));
        for ((name, d), (_, s)) in distributed.iter().zip(&single) {
            let err = common::rel_err(d, s);
            assert!(
                err < 1e-5,
                "{scenario}: {name}: relative difference {err:e}"
            );
        }
    }
}

#[test]
fn a_sharded_optimizer_trains_as_one_process_with_half_the_state_on_each_rank() {
    let (single, norms) = single_process_reference_and_norms();
    let out = scratch("sharded");
    let output = run_launcher("train_sharded", &out);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("optimizer state sharded (ZeRO-1)"), "{log}");
    assert_eq!(
        log.matches("another model: the optimizer state is sharded across the ranks")
            .count(),
        2,
        "{log}"
    );
    // Every step's replica check passed; now both ranks' saved parameters against one process.
    for rank in 0..WORLD {
        let distributed = load(&out.join(format!("rank{rank}.ot")));
        for ((name, d), (_, s)) in distributed.iter().zip(&single) {
            let err = common::rel_err(d, s);
            assert!(
                err < 1e-5,
                "rank {rank}: {name}: relative difference {err:e}"
            );
        }
    }
    for (step, reference) in norms.iter().enumerate() {
        for rank in 0..WORLD {
            let (prefix, line) = (format!("[rank {rank}] "), format!("gradient norm {step}: "));
            let norm: f64 = log
                .lines()
                .filter(|l| l.starts_with(&prefix))
                .find_map(|l| l.split_once(&line).map(|(_, norm)| norm))
                .unwrap_or_else(|| panic!("no `{line}` of rank {rank} in {log}"))
                .trim()
                .parse()
                .unwrap();
            assert!(
                (norm - reference).abs() <= 1e-5 * reference,
                "rank {rank}, step {step}: norm {norm} against one process's {reference}"
            );
        }
    }
    // AdamW keeps two moments per parameter: each rank keeps them for its half.
    let whole = single_process_state_bytes();
    for rank in 0..WORLD {
        let held = log
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank {rank}] optimizer holds ")))
            .unwrap_or_else(|| panic!("no memory line of rank {rank} in {log}"));
        let numbers: Vec<u64> = held.split(' ').filter_map(|w| w.parse().ok()).collect();
        let (parameters, state) = (numbers[0], numbers[1]);
        assert_eq!(parameters, whole.parameters, "{held}");
        let half = whole.state / WORLD as u64;
        assert!(
            state.abs_diff(half) < half / 50,
            "rank {rank} keeps {state} state bytes, half the whole is {half}"
        );
    }
}

/// The audit's note on the Reducer's all-reduce.
const REDUCER: &str = "gradients averaged by c10d's Reducer";

/// One process trained on the concatenated batches, from rank 0's initialisation.
fn single_process_reference() -> Vec<(String, Tensor)> {
    single_process_reference_and_norms().0
}

/// What an unsharded AdamW over the model holds once its first step has made its state.
fn single_process_state_bytes() -> speedkit::optim::OptimizerMemory {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let mut opt = speedkit::optim::AdamWOptimizer::new(&vs, adamw(), false).unwrap();
    let (x, y) = data();
    let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
    opt.backward_step(&loss).unwrap();
    opt.memory()
}

/// [`single_process_reference`], with the gradient's norm at each step.
fn single_process_reference_and_norms() -> (Vec<(String, Tensor)>, Vec<f64>) {
    let _lock = common::serial();
    let (x, y) = data();
    tch::manual_seed(100); // rank 0's initialisation, which the ranks broadcast
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let ctx = apply_speedups(&mut vs, &config(1)).unwrap();
    assert_eq!(ctx.world_size(), 1);
    let mut opt = ctx.adamw(&vs, adamw()).unwrap();
    let mut norms = Vec::new();
    for step in 0..STEPS {
        let rows = WORLD * PER_RANK_BATCH;
        let (xb, yb) = (
            x.narrow(0, step * rows, rows),
            y.narrow(0, step * rows, rows),
        );
        let loss = ctx.autocast(|| net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean));
        opt.zero_grad().unwrap();
        ctx.backward(&loss).unwrap();
        norms.push(opt.clip_grad_norm(1e9).unwrap().double_value(&[]));
        ctx.step(&mut opt).unwrap();
    }
    let mut single: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    single.sort_by(|a, b| a.0.cmp(&b.0));
    (single, norms)
}

#[test]
fn nccl_ranks_match_one_process_eager_on_the_reducer_and_graphed_on_speedkits_all_reduce() {
    if tch::Cuda::device_count() < 2 {
        eprintln!(
            "skipped nccl_ranks_match_one_process_eager_on_the_reducer_and_graphed_on_speedkits_\
             all_reduce: needs 2 CUDA devices"
        );
        return;
    }
    let single = single_process_reference();
    // (variant, graphed, the audit's note on the all-reduce, tolerance against one process)
    for (variant, graphed, all_reduce, tolerance) in [
        ("graphs_off", false, REDUCER, 1e-4),
        ("reducer", false, REDUCER, 1e-4),
        (
            "graphs_auto",
            true,
            "speedkit's all-reduce (in_backward)",
            1e-4,
        ),
        (
            "after_backward",
            true,
            "speedkit's all-reduce (after_backward)",
            1e-4,
        ),
        ("bf16", true, "in 1 MiB buckets sent in bf16", 2e-2),
        ("sharded", true, "optimizer state sharded (ZeRO-1)", 1e-4),
    ] {
        let out = scratch(&format!("nccl-{variant}"));
        let output = run_launcher(&format!("nccl_{variant}"), &out);
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        assert!(log.contains("over nccl"), "{log}");
        assert!(log.contains(all_reduce), "{variant}: {log}");
        // (libtest's own "test dist_worker ... " may precede the line: the ranks run --nocapture.)
        assert_eq!(
            log.matches(&format!("graphed: {graphed} (no fallback)"))
                .count(),
            2,
            "{variant}: {log}"
        );
        println!(
            "{variant}: {}",
            log.lines()
                .filter(|l| l.contains("graphed:"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let (a, b) = (load(&out.join("rank0.ot")), load(&out.join("rank1.ot")));
        for (((name, pa), (_, pb)), (_, ps)) in a.iter().zip(&b).zip(&single) {
            assert!(pa.equal(pb), "{variant}: {name} differs between the ranks");
            let err = common::rel_err(pa, ps);
            assert!(
                err < tolerance,
                "{variant}: {name}: relative difference {err:e}"
            );
        }
    }
}

#[test]
fn launcher_prefixes_lines_and_rank_zero_alone_prints_the_audit() {
    let out = scratch("prefix");
    let output = run_launcher("train", &out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        stdout.contains("[rank 0] ") && stdout.contains("data parallel: rank 0 of 2 over gloo")
    );
    assert!(!stdout.contains("data parallel: rank 1 of 2"), "{stdout}");
    let step_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("step 0 done"))
        .collect();
    assert_eq!(step_lines.len(), 2, "{stdout}");
    assert!(
        step_lines.iter().all(|l| l.starts_with("[rank ")),
        "{stdout}"
    );
}

#[test]
fn launcher_stops_all_ranks_and_exits_with_the_failed_ranks_status() {
    let out = scratch("fail");
    let output = run_launcher("fail_before_joining", &out);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(3), "{log}");
    assert!(
        log.contains("[launch] rank 1 exited with status 3; stopping the other ranks"),
        "{log}"
    );
}

#[test]
fn killed_rank_makes_the_other_fail_with_a_clear_error() {
    let out = scratch("killed");
    let port = free_port();
    let rank0 = spawn_rank("train_until_killed", &out, &rank_env(0, port));
    let mut rank1 = spawn_rank("train_until_killed", &out, &rank_env(1, port));
    // Kill rank 1 once training is under way.
    let lines = BufReader::new(rank1.stdout.take().unwrap());
    for line in lines.lines() {
        if line.unwrap().starts_with("step 3 done") {
            break;
        }
    }
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let output = wait_bounded(rank0, Duration::from_secs(90));
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("error: distributed:"), "{log}");
    assert!(log.contains("rank 0 of 2"), "{log}");
    assert!(log.contains("flags restored"), "{log}");
}

#[test]
fn ranks_with_different_configs_are_refused_on_every_rank() {
    let out = scratch("mismatch");
    let port = free_port();
    let ranks = [0, 1].map(|r| spawn_rank("mismatched_config", &out, &rank_env(r, port)));
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = wait_bounded(child, Duration::from_secs(90));
        let log = text(&output);
        assert_eq!(output.status.code(), Some(1), "rank {rank}: {log}");
        assert!(
            log.contains("rank(s) [1] run a different speed config than rank 0"),
            "{log}"
        );
        assert!(log.contains("flags restored"), "{log}");
    }
}

#[test]
fn a_replica_edited_outside_the_step_is_named_on_every_rank() {
    let out = scratch("drift");
    let port = free_port();
    let ranks = [0, 1].map(|r| spawn_rank("drift", &out, &rank_env(r, port)));
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = wait_bounded(child, Duration::from_secs(90));
        let log = text(&output);
        assert_eq!(output.status.code(), Some(1), "rank {rank}: {log}");
        assert!(log.contains("step 2 done"), "rank {rank}: {log}");
        assert!(
            log.contains(
                "replicas diverged after 4 optimizer step(s): rank(s) [1] hold other parameter \
                 values than rank 0 (rank 1: 1 of 4 tensors, first `l2.bias`"
            ),
            "rank {rank}: {log}"
        );
        assert!(log.contains("flags restored"), "rank {rank}: {log}");
    }
}

#[test]
fn rank_beyond_world_size_is_refused_before_anything_starts() {
    let out = scratch("bad-env");
    let mut vars = rank_env(0, free_port());
    vars[0].1 = "2".into();
    let output = wait_bounded(spawn_rank("train", &out, &vars), Duration::from_secs(60));
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("RANK is 2 but WORLD_SIZE is 2"), "{log}");
    assert!(log.contains("flags restored"), "{log}");
}

#[test]
fn world_size_without_master_addr_is_a_clear_error() {
    let vars = [("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")];
    let err = LaunchEnv::from_lookup(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(err.to_string().contains("MASTER_ADDR is not set"), "{err}");
}

#[test]
fn rank_without_world_size_is_a_clear_error() {
    let err = LaunchEnv::from_lookup(|k| (k == "RANK").then(|| "0".to_string())).unwrap_err();
    assert!(
        err.to_string()
            .contains("RANK is set but WORLD_SIZE is not"),
        "{err}"
    );
}

#[test]
fn non_numeric_rank_is_a_clear_error() {
    let vars = [("WORLD_SIZE", "2"), ("RANK", "one")];
    let err = LaunchEnv::from_lookup(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(err.to_string().contains("RANK is `one`"), "{err}");
}

#[test]
fn no_launch_environment_means_a_single_process() {
    assert_eq!(LaunchEnv::from_lookup(|_| None).unwrap(), None);
}

#[test]
fn benchmark_runner_under_the_launcher_reports_every_rank_and_the_total() {
    let out = scratch("runner");
    write_bench_configs(&out);
    let output = run_launcher("bench_runner", &out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    // One table, from rank 0; the data-parallel table names the world size.
    assert_eq!(
        stdout.matches("speedkit benchmarks — size tiny").count(),
        1,
        "{stdout}"
    );
    assert!(!stdout
        .lines()
        .any(|l| l.starts_with("[rank 1] speedkit benchmarks")));
    assert!(
        stdout.contains("[rank 0] data parallel over 2 ranks (gloo)"),
        "{stdout}"
    );
    assert!(stdout.contains("ranks       2 processes"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["world_size"], 2);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "transformer and linear3 under two configs");
    for row in rows {
        let name = format!("{} / {}", row["workload"], row["config"]);
        assert!(row["error"].is_null(), "{name}: {}", row["error"]);
        let dp = &row["data_parallel"];
        assert_eq!(dp["world_size"], 2, "{name}");
        let medians: Vec<f64> = serde_json::from_value(dp["median_ms_per_rank"].clone()).unwrap();
        assert_eq!(medians.len(), 2, "{name}");
        assert!(
            medians.iter().all(|ms| ms.is_finite() && *ms > 0.0),
            "{name}"
        );
        assert_eq!(
            medians[0],
            row["measurement"]["median_ms"].as_f64().unwrap()
        );
        let items = row["measurement"]["items_per_step"][0].as_f64().unwrap();
        let t = &dp["throughput"];
        let per_rank: Vec<f64> = serde_json::from_value(t["per_rank"].clone()).unwrap();
        for (rate, ms) in per_rank.iter().zip(&medians) {
            assert!((rate - items / (ms * 1e-3)).abs() <= 1e-9 * rate, "{name}");
        }
        let total = t["total"].as_f64().unwrap();
        assert!(
            (total - per_rank.iter().sum::<f64>()).abs() <= 1e-9 * total,
            "{name}"
        );
        assert!((t["per_gpu"].as_f64().unwrap() - total / 2.0).abs() <= 1e-9 * total);
        let unit = if row["workload"] == "transformer" {
            "tokens"
        } else {
            "samples"
        };
        assert_eq!(t["unit"], unit, "{name}");
        // The text's data-parallel table gives the same total.
        let line = stdout
            .lines()
            .find(|l| {
                l.contains(&format!("{total:.0} {unit}/s"))
                    && l.split_whitespace().any(|c| row["workload"] == c)
            })
            .unwrap_or_else(|| panic!("{name}: no line with the total {total:.0}\n{stdout}"));
        assert!(line.starts_with("[rank 0]"), "{line}");
    }
}

/// The example binary `name`, built next to this test executable's directory by `cargo test`
/// (which builds every example); `None` when only this test target was built.
fn example_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
}

#[test]
fn toy_transformer_under_the_launcher_reports_tokens_per_gpu_and_in_total() {
    let Some(example) = example_binary("toy_transformer") else {
        eprintln!(
            "skipped toy_transformer_under_the_launcher_reports_tokens_per_gpu_and_in_total: the \
             example is not built (`cargo test` builds it; `cargo test --test distributed` alone \
             does not: run `cargo build --example toy_transformer` first)"
        );
        return;
    };
    let out = scratch("toy");
    let [cpu, _] = write_bench_configs(&out);
    let command: Vec<String> = [
        example.to_str().unwrap(),
        "--config",
        cpu.to_str().unwrap(),
        "--size",
        "tiny",
        "--steps",
        "6",
        "--log-every",
        "2",
    ]
    .map(str::to_string)
    .to_vec();
    let output = run_launcher_of("toy", &out, Some(&command));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    // Rank 0 alone prints the header, the log, the summary and the audit.
    for line in stdout.lines().filter(|l| l.starts_with("[rank ")) {
        assert!(
            line.starts_with("[rank 0]"),
            "a line not from rank 0: {line}\n{stdout}"
        );
    }
    assert_eq!(
        stdout.matches("toy transformer (tiny size)").count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains("data parallel: rank 0 of 2 over gloo"),
        "{stdout}"
    );
    let summary = stdout
        .lines()
        .find(|l| l.contains("[rank 0] data parallel: ") && l.contains("in total over 2 ranks"))
        .unwrap_or_else(|| panic!("no data-parallel summary\n{stdout}"));
    let number = |before: &str| -> f64 {
        let head = &summary[..summary.find(before).unwrap()];
        head.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (total, per_gpu) = (number(" tokens/s in total"), number(" tokens/s per GPU"));
    assert!(
        total > 0.0 && (per_gpu - total / 2.0).abs() <= 1.0,
        "{summary}"
    );
}

#[test]
fn the_single_process_pytorch_peer_is_refused_under_the_launcher_with_its_replacement() {
    let out = scratch("runner-peer");
    write_bench_configs(&out);
    let output = run_launcher("bench_runner_peer", &out);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(
        log.contains("--peer pytorch times single-process PyTorch, not a data-parallel run"),
        "{log}"
    );
    assert!(log.contains("pytorch_reference.py --ddp"), "{log}");
    assert!(
        !out.join("report.json").exists(),
        "nothing is measured or written"
    );
}

#[test]
fn gradient_sync_hooks_are_removed_when_it_drops() {
    use speedkit::dist::{Backend, GradientSync, ProcessGroup};
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: free_port(),
    };
    let group = ProcessGroup::init(&env, Backend::Gloo, Duration::from_secs(30)).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let params = vs.trainable_variables();
    let sync = GradientSync::new(&group, &params, 1 << 20, None).unwrap();
    // While it lives, its hooks hold the parameters: a second one is refused.
    let err = GradientSync::new(&group, &params, 1 << 20, None).unwrap_err();
    assert!(
        err.to_string().contains("post-accumulate-grad hook"),
        "{err}"
    );
    drop(sync);
    // Dropped, it leaves none behind: the parameters take a new one, and train without one.
    drop(GradientSync::new(&group, &params, 1 << 20, None).unwrap());
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    net.forward(&x).sum(Kind::Float).backward();
    assert!(params.iter().all(|p| p.grad().defined()));
}
