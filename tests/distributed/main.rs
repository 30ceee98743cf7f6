//! Data parallelism on the CPU over Gloo: two processes started by the launcher train a tiny model;
//! their parameters end equal to each other and to one process trained on the concatenated batches.
//! Faults end every rank with a clear error: a killed rank, different configs, a bad environment.
//! The benchmark runner (over this repository's workloads) and the `toy_transformer` example run
//! under the launcher and report every rank's figures and the total throughput.
//!
//! The ranks are this test executable itself, re-run with `--ignored --exact dist_worker` (and the
//! launcher with `--exact dist_launcher`); `SK_TEST_*` variables tell them what to do.

#[path = "../common/mod.rs"]
mod common;
#[path = "../../workloads/mod.rs"]
mod workloads;

mod benchmarks;
mod checkpoints;
mod faults;
mod fixture;
mod gradient_sync;
mod launch_env;
mod launcher;
mod processes;
mod ranks;
mod training;

use std::path::PathBuf;

use processes::worker_args;
use ranks::train_rank;
use speedkit::flags::FlagState;

// ----- the processes -----------------------------------------------------------------------------
// (At the crate's root: `--exact dist_worker` and `--exact dist_launcher` name them.)

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
    let ranks = std::env::var("SK_TEST_NPROC").map_or(2, |n| n.parse().unwrap());
    let mut options = speedkit::launcher::LaunchOptions::new(ranks, command);
    // One launcher per machine, one rank each (`processes::run_node_launchers`).
    if let Ok(nodes) = std::env::var("SK_TEST_NNODES") {
        let var = |name: &str| std::env::var(name).unwrap().parse::<usize>().unwrap();
        options.nproc_per_node = 1;
        options.nnodes = nodes.parse().unwrap();
        options.node_rank = var("SK_TEST_NODE_RANK");
        options.master_port = Some(var("SK_TEST_MASTER_PORT") as u16);
    }
    let status = speedkit::launcher::run(&options).unwrap();
    std::process::exit(status);
}
