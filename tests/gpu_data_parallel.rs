//! speedkit's gradient all-reduce on one GPU, over a world-size-1 NCCL group: captured with the
//! whole training step in a CUDA graph and replayed, after the backward pass or started during it,
//! it gives what the same step gives eagerly, with the optimizer state whole or sharded (ZeRO-1:
//! gradients reduce-scattered, parameters all-gathered, both inside the graph). A replay that does
//! not finish within the timeout ends the process with a message naming the rank, as c10d's
//! watchdog does. (Two ranks are proven in tests/distributed.rs, on two GPUs.) Skipped, with the
//! reason printed, without a GPU.

mod common;

use std::time::Duration;

use speedkit::dist::{Backend, GradientSync, LaunchEnv, ProcessGroup};
use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn one_rank_nccl_group(device: Device) -> ProcessGroup {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: match device {
            Device::Cuda(i) => i,
            _ => 0,
        },
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    ProcessGroup::init(&env, Backend::Nccl, Duration::from_secs(60)).expect("the group forms")
}

/// How [`train`] runs: the step graphed or eager, the all-reduce started during the backward pass
/// (`overlap`), the wire type, and the optimizer state sharded (ZeRO-1) or whole.
#[derive(Clone, Copy, Debug, Default)]
struct Mode {
    graphed: bool,
    overlap: bool,
    wire: Option<Kind>,
    sharded: bool,
}

/// Trains a small MLP for `steps` steps, its gradients averaged by `GradientSync` (small buckets)
/// as `mode` says; the trained parameters and the last step's gradients.
fn train(group: &ProcessGroup, device: Device, mode: Mode, steps: usize) -> [Vec<Tensor>; 2] {
    let Mode {
        graphed,
        overlap,
        wire,
        sharded,
    } = mode;
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "a", 96, 160, Default::default()))
        .add_fn(|x| x.gelu("tanh"))
        .add(nn::linear(vs.root() / "b", 160, 24, Default::default()));
    // 40 KiB buckets: the gradients travel in several all-reduces; in fp32, a's weight (60 KiB)
    // alone, in place.
    let params = vs.trainable_variables();
    let (sync, mut opt) = if sharded {
        let sync = GradientSync::sharded(group, &params, 40 << 10, wire).unwrap();
        let shard = sync.optimizer_shard().unwrap();
        let fused = ctx.plan().fused_optimizer;
        (
            sync,
            AdamWOptimizer::sharded(shard, AdamW::default(), fused).unwrap(),
        )
    } else {
        let sync = GradientSync::new(group, &params, 40 << 10, wire).unwrap();
        (sync, ctx.adamw(&vs, AdamW::default()).unwrap())
    };
    assert!(sync.buckets() > 1, "{sync:?}");
    let x = Tensor::randn([64, 96], (Kind::Float, device));
    let y = Tensor::randn([64, 24], (Kind::Float, device));
    let step = |_: &[Tensor]| {
        let loss = ctx.autocast(|| net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        opt.zero_grad()?;
        if overlap {
            sync.overlap_next_backward()?;
        }
        ctx.backward(&loss)?;
        sync.run()?;
        ctx.step(&mut opt)?;
        Ok(Some(loss))
    };
    common::run_steps(&ctx, step, graphed, steps);
    let gradients = vs.trainable_variables().iter().map(Tensor::grad).collect();
    [common::trained_parameters(&vs), gradients]
}

#[test]
fn speedkits_all_reduce_is_captured_with_the_step_over_a_world_size_one_nccl_group() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "speedkits_all_reduce_is_captured_with_the_step_over_a_world_size_one_nccl_group",
    ) else {
        return;
    };
    let group = one_rank_nccl_group(device);
    for wire in [Some(Kind::BFloat16), None] {
        let eager = Mode {
            graphed: false,
            overlap: false,
            wire,
            sharded: false,
        };
        let [eager, _] = train(&group, device, eager, 12);
        for overlap in [false, true] {
            let mode = Mode {
                graphed: true,
                overlap,
                wire,
                sharded: false,
            };
            let [graphed, gradients] = train(&group, device, mode, 12);
            for (i, (g, e)) in graphed.iter().zip(&eager).enumerate() {
                let err = common::rel_err(g, e);
                assert!(
                    err < 1e-6,
                    "{wire:?} overlap {overlap}: parameter {i}: relative difference {err:e}"
                );
            }
            if wire.is_some() {
                assert_bf16_averages(&gradients, overlap);
            }
        }
    }
}

#[test]
fn a_sharded_optimizer_is_captured_with_the_step_over_a_world_size_one_nccl_group() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_sharded_optimizer_is_captured_with_the_step_over_a_world_size_one_nccl_group",
    ) else {
        return;
    };
    let group = one_rank_nccl_group(device);
    let [whole, _] = train(&group, device, Mode::default(), 12);
    for (graphed, overlap) in [(false, false), (true, false), (true, true)] {
        let mode = Mode {
            graphed,
            overlap,
            wire: None,
            sharded: true,
        };
        let [sharded, gradients] = train(&group, device, mode, 12);
        for (i, (s, w)) in sharded.iter().zip(&whole).enumerate() {
            let err = common::rel_err(s, w);
            assert!(
                err < 1e-6,
                "{mode:?}: parameter {i}: relative difference {err:e}"
            );
        }
        // The whole gradients are gone: the sharded optimizer stepped from its pieces'.
        assert!(gradients.iter().all(|g| !g.defined()), "{mode:?}");
    }
}

/// The replays ran the all-reduce: each gradient is its bucket's bf16 average, cast back.
fn assert_bf16_averages(gradients: &[Tensor], overlap: bool) {
    for (i, g) in gradients.iter().enumerate() {
        assert_eq!(g.kind(), Kind::Float);
        let rounded = g.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        assert!(
            g.equal(&rounded),
            "overlap {overlap}: gradient {i} did not travel in bf16"
        );
    }
}

/// GPU work of a few seconds on the current stream: fp32 GEMMs, chained.
fn seconds_of_gpu_work(device: Device) {
    let mut a = Tensor::randn([8192, 8192], (Kind::Float, device)) / 90.0;
    let b = Tensor::randn([8192, 8192], (Kind::Float, device)) / 90.0;
    for _ in 0..200 {
        a = a.matmul(&b);
    }
}

/// The watchdog's process: a world-size-1 NCCL group, GPU work watched with the timeout of
/// `SK_TEST_WATCHDOG_MS` (the parent test's child; it must not run on its own).
#[test]
#[ignore = "the child process of a_replay_past_the_timeout_ends_the_process_naming_the_rank"]
fn watchdog_child() {
    let Ok(ms) = std::env::var("SK_TEST_WATCHDOG_MS").map(|v| v.parse::<u64>().unwrap()) else {
        return;
    };
    let device = Device::Cuda(0);
    let group = one_rank_nccl_group(device);
    let vs = nn::VarStore::new(device);
    let _layer = nn::linear(vs.root(), 8, 8, Default::default());
    let sync = GradientSync::new(&group, &vs.trainable_variables(), 1 << 20, None).unwrap();
    seconds_of_gpu_work(device);
    sync.watch_replay(Duration::from_millis(ms), "rank 0 of 1")
        .unwrap();
    tch::Cuda::synchronize(0);
    println!("the watched work finished");
}

fn run_watchdog_child(timeout_ms: u64) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "watchdog_child", "--ignored", "--nocapture"])
        .env("SK_TEST_WATCHDOG_MS", timeout_ms.to_string())
        .output()
        .unwrap()
}

#[test]
fn a_replay_past_the_timeout_ends_the_process_naming_the_rank() {
    let Some(_) =
        common::cuda_or_skip("a_replay_past_the_timeout_ends_the_process_naming_the_rank")
    else {
        return;
    };
    let late = run_watchdog_child(100);
    let stderr = String::from_utf8_lossy(&late.stderr);
    assert_eq!(late.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("speedkit: rank 0 of 1: a replay of the training step's CUDA graph"),
        "{stderr}"
    );
    let in_time = run_watchdog_child(600_000);
    let stdout = String::from_utf8_lossy(&in_time.stdout);
    assert!(in_time.status.success(), "{stdout}");
    assert!(stdout.contains("the watched work finished"), "{stdout}");
}
