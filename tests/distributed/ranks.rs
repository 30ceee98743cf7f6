//! What one rank runs for each scenario: Gloo or NCCL training, `#[accelerate]`, the runner.

use std::path::{Path, PathBuf};

use crate::fixture::{
    adamw, blocks_model, config, data, model, rows_of, GLOBAL_BATCH, STEPS, WORLD,
};
use speedkit::config::{AllReduce, DistributedBackend, SpeedConfig};
use speedkit::dist::LaunchEnv;
use speedkit::{apply_speedups, SpeedkitError};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

pub fn train_rank(scenario: &str, out: &Path) -> Result<(), SpeedkitError> {
    let env = LaunchEnv::from_env()?;
    let rank = env.as_ref().map_or(0, |e| e.rank);
    let world = env.as_ref().map_or(1, |e| e.world_size) as i64;
    if scenario == "fail_before_joining" && rank == 1 {
        std::process::exit(3);
    }
    if scenario == "accelerate" {
        return train_accelerated_rank(rank, out);
    }
    if scenario == "bench_runner" || scenario == "bench_runner_peer" {
        return run_bench_rank(out, scenario == "bench_runner_peer");
    }
    if scenario == "resume_sharded_parameters" {
        return resume_sharded_parameters_rank(rank, world, out);
    }
    if let Some(variant) = scenario.strip_prefix("nccl_") {
        return train_nccl_rank(rank, world, out, variant);
    }
    let bucket_mb = if scenario == "mismatched_config" && rank == 1 {
        2
    } else {
        1
    };
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let sharded_parameters = scenario == "train_sharded_parameters";
    let net: Box<dyn Module> = if sharded_parameters {
        Box::new(blocks_model(&vs))
    } else {
        Box::new(model(&vs))
    };
    let mut config = config(bucket_mb);
    if let Some(all_reduce) = scenario.strip_prefix("train_") {
        config.distributed.all_reduce = match all_reduce {
            "in_backward" => AllReduce::InBackward,
            "sharded" | "sharded_landing" | "sharded_parameters" => AllReduce::Auto,
            _ => AllReduce::AfterBackward,
        };
    }
    config.distributed.shard_optimizer = scenario.starts_with("train_sharded");
    config.distributed.shard_parameters = sharded_parameters.into();
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
        let xb = rows_of(&x, step % STEPS, rank as i64, world);
        let yb = rows_of(&y, step % STEPS, rank as i64, world);
        let loss = ctx.autocast(|| net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean));
        if scenario == "drift" && rank == 1 && step == 3 {
            // An edit outside the step, on one rank only: the next check must catch it.
            let _no_grad = tch::no_grad_guard();
            let _ = vs.variables()["l2.bias"]
                .shallow_clone()
                .f_add_scalar_(1e-3)?;
        }
        if scenario == "train_sharded" {
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
        if let Some(bytes) = ctx.resident_parameter_bytes()? {
            println!("resident parameter bytes after step {step}: {bytes}");
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
    // Gathered from every rank's part where the parameters are sharded.
    save_model_state(&ctx, &vs, &out.join(format!("rank{rank}.ot")))?;
    if config.distributed.shard_optimizer {
        // Each rank writes the pieces it owns, which no rank gathers.
        ctx.save_sharded(&vs, Some(&opt), out.join("sharded"))?;
    }
    if sharded_parameters {
        // A load into the sharded parameters, as `VarStore::copy` does it (every rank, the same
        // order): each unit is gathered, written, and this rank's part taken back.
        let _no_grad = tch::no_grad_guard();
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (i, (_, p)) in named.iter().enumerate() {
            let _filled = p.shallow_clone().f_fill_(i as f64)?;
        }
        save_model_state(&ctx, &vs, &out.join(format!("loaded{rank}.ot")))?;
        // The optimizer (which shares the shard) outlives the context: this thread's calls run
        // as before, and the parameters are empty.
        drop(ctx);
        let two = Tensor::ones([2], (tch::Kind::Float, Device::Cpu)).f_sum(tch::Kind::Float)?;
        println!(
            "after the context: {}, a parameter of {} elements",
            two.f_double_value(&[])?,
            vs.trainable_variables()[0].numel()
        );
    }
    Ok(())
}

/// ZeRO-3 resuming from the sharded checkpoint one process wrote halfway through the training
/// (`out/one`, model and AdamW state): the second half of the steps, then this rank's model
/// gathered into `rank{R}.ot`.
fn resume_sharded_parameters_rank(
    rank: usize,
    world: i64,
    out: &Path,
) -> Result<(), SpeedkitError> {
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = blocks_model(&vs);
    let mut config = config(1);
    config.distributed.shard_parameters = true.into();
    let ctx = apply_speedups(&mut vs, &config)?;
    let mut opt = ctx.adamw(&vs, adamw())?;
    ctx.load_sharded(&vs, Some(&mut opt), out.join("one"))?;
    for step in STEPS / 2..STEPS {
        let xb = rows_of(&x, step, rank as i64, world);
        let yb = rows_of(&y, step, rank as i64, world);
        let loss = ctx.autocast(|| net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean));
        ctx.backward_step(&loss, &mut opt)?;
    }
    save_model_state(&ctx, &vs, &out.join(format!("rank{rank}.ot")))
}

/// The training of `train_rank` on this rank's GPU over NCCL in fp32, through the graph-mode API,
/// in one of the variants the NCCL test names: `graphs_off` (eager, the Reducer's all-reduce),
/// `graphs_auto` (one CUDA graph with the all-reduce inside, started during the backward pass),
/// `after_backward` (graphed, all-reduced after the backward pass), `reducer` (graphs on auto, the
/// Reducer asked for: eager), `bf16` (graphed, gradients sent in bf16), `sharded` (graphed, the
/// optimizer state sharded: gradients reduce-scattered, parameters all-gathered),
/// `sharded_parameters` (ZeRO-3 on [`blocks_model`], eager), `until_killed`
/// (graphed, replayed until the test kills a rank).
fn train_nccl_rank(
    rank: usize,
    world: i64,
    out: &Path,
    variant: &str,
) -> Result<(), SpeedkitError> {
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
    // `until_killed`: replays until the test kills a rank; only the replay watchdog waits then.
    let until_killed = variant == "until_killed";
    if until_killed {
        config.distributed.timeout_s = 10;
        config.distributed.check_replicas_every = 0;
    }
    let sharded_parameters = variant == "sharded_parameters";
    config.distributed.shard_parameters = sharded_parameters.into();
    let (x, y) = data();
    tch::manual_seed(100 + rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net: Box<dyn Module> = if sharded_parameters {
        Box::new(blocks_model(&vs))
    } else {
        Box::new(model(&vs))
    };
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
    for s in 0..if until_killed { 100_000 } else { STEPS } {
        let xb = rows_of(&x, s % STEPS, rank as i64, world).to_device(device);
        let yb = rows_of(&y, s % STEPS, rank as i64, world).to_device(device);
        step.run(&[&xb, &yb])?;
        if until_killed && s < STEPS {
            println!("step {s} done");
        }
    }
    println!(
        "graphed: {} ({})",
        step.is_graphed(),
        step.fallback_reason().unwrap_or("no fallback")
    );
    drop(step);
    ctx.print_main(ctx.audit());
    save_model_state(&ctx, &vs, &out.join(format!("rank{rank}.ot")))?;
    if sharded_parameters {
        // Written from the GPU's fp32 parts, read back into them: the gathered model unchanged.
        let dir = out.join("sharded");
        ctx.save_sharded(&vs, Some(&opt), &dir)?;
        ctx.load_sharded(&vs, Some(&mut opt), &dir)?;
        save_model_state(&ctx, &vs, &out.join(format!("reloaded{rank}.ot")))?;
    }
    Ok(())
}

/// The model's state (gathered where the parameters are sharded), on the CPU, into `path`.
fn save_model_state(
    ctx: &speedkit::SpeedContext,
    vs: &nn::VarStore,
    path: &Path,
) -> Result<(), SpeedkitError> {
    let state = ctx
        .model_state(vs)?
        .into_iter()
        .map(|(name, t)| (name, t.to_device(Device::Cpu)))
        .collect::<Vec<_>>();
    Tensor::save_multi(&state, path).map_err(|e| SpeedkitError::Torch(e.to_string()))
}

/// The same training written as an ordinary `#[accelerate]` function: no distributed code. It
/// prints how its plan decided the sharding of the parameters.
#[speedkit::accelerate(device = "cpu", ctx = ctx)]
fn train_accelerated(
    vs: &nn::VarStore,
    net: &impl Module,
    x: &Tensor,
    y: &Tensor,
) -> speedkit::Result<()> {
    if let Some(d) = ctx.plan().decision("parameters") {
        println!("parameters: {}: {}", d.value, d.reason);
    }
    let mut opt = nn::Sgd::default()
        .build(vs, 0.1)
        .map_err(|e| SpeedkitError::Torch(e.to_string()))?;
    for step in 0..STEPS {
        let rows = GLOBAL_BATCH / WORLD;
        let xb = x.narrow(0, step * rows, rows);
        let yb = y.narrow(0, step * rows, rows);
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
pub fn write_bench_configs(out: &Path) -> [PathBuf; 2] {
    let gloo = "distributed: {backend: gloo, timeout_s: 60}\n";
    let cpu = out.join("cpu.yaml");
    let bf16 = out.join("cpu_bf16.yaml");
    std::fs::write(&cpu, format!("device: cpu\n{gloo}")).unwrap();
    std::fs::write(&bf16, format!("device: cpu\nprecision: bf16\n{gloo}")).unwrap();
    [cpu, bf16]
}

/// One NCCL config, on each rank's own GPU.
pub fn write_nccl_bench_config(out: &Path) -> PathBuf {
    let nccl = out.join("nccl.yaml");
    std::fs::write(&nccl, "distributed: {backend: nccl, timeout_s: 60}\n").unwrap();
    nccl
}

/// One rank of the benchmark runner: `transformer` and `linear3` at the tiny size under every
/// config in `out` (`*.yaml`, by name: [`write_bench_configs`] or [`write_nccl_bench_config`]);
/// rank 0 writes `report.json`. With `peer`, also `--peer pytorch` (which a data-parallel run
/// refuses).
fn run_bench_rank(out: &Path, peer: bool) -> Result<(), SpeedkitError> {
    use clap::Parser;
    use speedkit::bench::runner::{main_with, Args};
    use speedkit::bench::Workload;
    let mut configs: Vec<PathBuf> = std::fs::read_dir(out)
        .map_err(|e| SpeedkitError::Misuse(format!("{}: {e}", out.display())))?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    configs.sort();
    let config_args = configs
        .iter()
        .flat_map(|c| ["--config".to_string(), c.display().to_string()]);
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
            "--json",
            json.to_str().unwrap(),
        ]
        .iter()
        .chain(peer_args)
        .map(|a| a.to_string())
        .chain(config_args),
    )
    .map_err(|e| SpeedkitError::Misuse(e.to_string()))?;
    match main_with(&args, &Workload::all()) {
        0 => Ok(()),
        status => Err(SpeedkitError::Misuse(format!(
            "the runner exited with status {status}"
        ))),
    }
}
