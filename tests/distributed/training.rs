//! Ranks train to equal parameters, equal to one process's, over Gloo and NCCL, sharded or not.

use crate::common;
use crate::fixture::{adamw, blocks_model, config, data, model, GLOBAL_BATCH, STEPS, WORLD};
use crate::processes::{
    load, run_launcher, run_launcher_of_ranks, run_node_launchers, scratch, text,
};
use speedkit::apply_speedups;
use tch::nn::{self, Module};
use tch::{Device, Tensor};

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
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    // The plan knew the model of the VarStore argument: only the device's memory was missing.
    assert!(
        log.contains("parameters: whole: distributed.shard_parameters: auto: no GPU memory to fit"),
        "{log}"
    );
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
fn two_launchers_of_one_rank_each_train_as_one_process() {
    let single = single_process_reference();
    let out = scratch("two-nodes");
    let outputs = run_node_launchers("train", &out, WORLD as usize, &[], |_| Vec::new());
    for (node, output) in outputs.iter().enumerate() {
        let log = text(output);
        assert!(output.status.success(), "node {node}: {log}");
        assert!(log.contains(&format!("[rank {node}] step 5 done")), "{log}");
    }
    assert_every_rank_matches(&out, WORLD, &single, 1e-5);
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
    assert_every_rank_matches(&out, WORLD, &single, 1e-5);
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
    assert_each_rank_holds_its_share_of_the_state(&log, WORLD);
}

#[test]
fn a_sharded_optimizer_stepping_each_bucket_as_it_lands_trains_as_one_process() {
    let single = single_process_reference();
    let out = scratch("sharded-landing");
    let output = run_launcher("train_sharded_landing", &out);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("optimizer state sharded (ZeRO-1)"), "{log}");
    assert!(
        log.contains("reduce-scatter lands and starts its all-gather"),
        "{log}"
    );
    // Two buckets (l1's weight alone, the rest together): the pieces of the first are updated and
    // gathered while the second's reduce-scatter may still run.
    assert_every_rank_matches(&out, WORLD, &single, 1e-5);
    assert_each_rank_holds_its_share_of_the_state(&log, WORLD);
}

#[test]
fn four_ranks_train_as_one_process_with_a_quarter_of_the_state_each() {
    let single = single_process_reference();
    let out = scratch("four-sharded");
    let output = run_launcher_of_ranks("train_sharded", &out, 4);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("rank 0 of 4 over gloo"), "{log}");
    assert!(log.contains("optimizer state sharded (ZeRO-1)"), "{log}");
    // Each rank trained on a quarter of the global batch the one process trained on.
    assert_every_rank_matches(&out, 4, &single, 1e-5);
    assert_each_rank_holds_its_share_of_the_state(&log, 4);
}

#[test]
fn sharded_parameters_train_as_one_process_with_half_the_parameters_on_each_rank() {
    let (single, _) = single_process_reference_of(|vs| Box::new(blocks_model(vs)));
    let out = scratch("sharded-parameters");
    let output = run_launcher("train_sharded_parameters", &out);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("parameters sharded (ZeRO-3)"), "{log}");
    // Gathered from both ranks' parts for the save.
    assert_every_rank_matches(&out, WORLD, &single, 1e-5);
    assert_each_rank_holds_its_share_of_the_parameters(&log, WORLD, &single);
}

#[test]
fn four_ranks_with_sharded_parameters_train_as_one_process_with_a_quarter_each() {
    let (single, _) = single_process_reference_of(|vs| Box::new(blocks_model(vs)));
    let out = scratch("four-sharded-parameters");
    let output = run_launcher_of_ranks("train_sharded_parameters", &out, 4);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("rank 0 of 4 over gloo"), "{log}");
    assert_every_rank_matches(&out, 4, &single, 1e-5);
    assert_each_rank_holds_its_share_of_the_parameters(&log, 4, &single);
}

/// Between steps each of `ranks` ranks holds its 1/`ranks` of every unit of [`blocks_model`], in
/// fp32, and nothing gathered, as its log's last `resident parameter bytes` line says.
fn assert_each_rank_holds_its_share_of_the_parameters(
    log: &str,
    ranks: i64,
    single: &[(String, Tensor)],
) {
    let whole: i64 = single.iter().map(|(_, t)| 4 * t.numel() as i64).sum();
    for rank in 0..ranks {
        let line = format!(
            "[rank {rank}] resident parameter bytes after step {}: ",
            STEPS - 1
        );
        let held: i64 = log
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no `{line}` in {log}"))
            .trim()
            .parse()
            .unwrap();
        // Each of the 3 units is padded to a multiple of the ranks: fewer than `ranks` elements.
        assert!(
            (held - whole / ranks).abs() <= 4 * 3 * (ranks - 1),
            "rank {rank} holds {held} parameter bytes of {whole}"
        );
        // The optimizer's memory (the runner's `params` column) counts that part, not the
        // parameters' whole shapes.
        let counted: i64 = log
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank {rank}] optimizer holds ")))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no memory line of rank {rank} in {log}"));
        assert!(
            (counted - whole / ranks).abs() <= 4 * 3 * (ranks - 1),
            "rank {rank}'s optimizer counts {counted} parameter bytes of {whole}"
        );
    }
}

#[test]
fn a_load_into_sharded_parameters_reaches_every_ranks_part() {
    let out = scratch("sharded-parameters-load");
    let output = run_launcher("train_sharded_parameters", &out);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(
        log.contains("[rank 1] after the context: 2, a parameter of 0 elements"),
        "{log}"
    );
    // Each variable was filled with its index in name order, which `load` returns them in.
    for rank in 0..WORLD {
        let loaded = load(&out.join(format!("loaded{rank}.ot")));
        assert_eq!(loaded.len(), 8);
        for (index, (name, value)) in loaded.into_iter().enumerate() {
            let index = index as f64;
            let (min, max) = (value.min().double_value(&[]), value.max().double_value(&[]));
            assert!(
                min == index && max == index,
                "rank {rank}: {name} holds [{min}, {max}], not {index}"
            );
        }
    }
}

/// AdamW keeps two moments per parameter: each of `ranks` sharded ranks keeps them for its
/// 1/`ranks` of the parameters, and every parameter, as its log's memory line says.
fn assert_each_rank_holds_its_share_of_the_state(log: &str, ranks: i64) {
    let whole = single_process_state_bytes();
    let share = whole.state / ranks as u64;
    for rank in 0..ranks {
        let held = log
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank {rank}] optimizer holds ")))
            .unwrap_or_else(|| panic!("no memory line of rank {rank} in {log}"));
        let numbers: Vec<u64> = held.split(' ').filter_map(|w| w.parse().ok()).collect();
        let (parameters, state) = (numbers[0], numbers[1]);
        assert_eq!(parameters, whole.parameters, "{held}");
        assert!(
            state.abs_diff(share) < share / 25,
            "rank {rank} keeps {state} state bytes, 1/{ranks} of the whole is {share}"
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
    opt.zero_grad().unwrap();
    loss.backward();
    opt.step().unwrap();
    opt.memory()
}

/// [`single_process_reference`], with the gradient's norm at each step.
fn single_process_reference_and_norms() -> (Vec<(String, Tensor)>, Vec<f64>) {
    single_process_reference_of(|vs| Box::new(model(vs)))
}

/// [`single_process_reference_and_norms`] of the model `build` makes.
fn single_process_reference_of(
    build: fn(&nn::VarStore) -> Box<dyn Module>,
) -> (Vec<(String, Tensor)>, Vec<f64>) {
    let _lock = common::serial();
    let (x, y) = data();
    tch::manual_seed(100); // rank 0's initialisation, which the ranks broadcast
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = build(&vs);
    let ctx = apply_speedups(&mut vs, &config(1)).unwrap();
    assert_eq!(ctx.world_size(), 1);
    let mut opt = ctx.adamw(&vs, adamw()).unwrap();
    let mut norms = Vec::new();
    for step in 0..STEPS {
        let rows = GLOBAL_BATCH;
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
fn two_launchers_of_one_gpu_each_train_as_one_process_over_nccl_sockets() {
    if tch::Cuda::device_count() < 2 {
        eprintln!(
            "skipped two_launchers_of_one_gpu_each_train_as_one_process_over_nccl_sockets: \
             needs 2 CUDA devices"
        );
        return;
    }
    let single = single_process_reference();
    let out = scratch("two-nodes-nccl");
    // NCCL as between two machines: no peer-to-peer or shared-memory transport, only sockets.
    let sockets = [
        ("NCCL_P2P_DISABLE", "1"),
        ("NCCL_SHM_DISABLE", "1"),
        ("NCCL_IB_DISABLE", "1"),
        ("NCCL_DEBUG", "INFO"),
    ];
    let one_gpu_each = |node: usize| vec![("CUDA_VISIBLE_DEVICES", node.to_string())];
    let outputs = run_node_launchers("nccl_graphs_auto", &out, 2, &sockets, one_gpu_each);
    for (node, output) in outputs.iter().enumerate() {
        let log = text(output);
        assert!(output.status.success(), "node {node}: {log}");
        // Rank 0 alone prints the audit.
        assert!(node == 1 || log.contains("over nccl"), "{log}");
        assert!(
            log.contains("via NET/Socket"),
            "node {node} did not use sockets: {log}"
        );
        assert!(log.contains("graphed: true (no fallback)"), "{log}");
    }
    assert_every_rank_matches(&out, WORLD, &single, 1e-4);
}

/// Every CUDA device of the machine trains as one rank (as many as divide the global batch).
pub fn nccl_ranks() -> i64 {
    let devices = tch::Cuda::device_count();
    (2..=devices)
        .rev()
        .find(|n| GLOBAL_BATCH % n == 0)
        .unwrap_or(0)
}

#[test]
fn nccl_ranks_match_one_process_eager_on_the_reducer_and_graphed_on_speedkits_all_reduce() {
    let ranks = nccl_ranks();
    if ranks < 2 {
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
        let output = run_launcher_of_ranks(&format!("nccl_{variant}"), &out, ranks as usize);
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        assert!(log.contains("over nccl"), "{log}");
        assert!(
            log.contains(&format!("rank 0 of {ranks}")),
            "{variant}: {log}"
        );
        assert!(log.contains(all_reduce), "{variant}: {log}");
        // (libtest's own "test dist_worker ... " may precede the line: the ranks run --nocapture.)
        assert_eq!(
            log.matches(&format!("graphed: {graphed} (no fallback)"))
                .count(),
            ranks as usize,
            "{variant}: {log}"
        );
        println!(
            "{variant} on {ranks} ranks: {}",
            log.lines()
                .filter(|l| l.contains("graphed:"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let first = load(&out.join("rank0.ot"));
        for rank in 1..ranks {
            let other = load(&out.join(format!("rank{rank}.ot")));
            for ((name, a), (_, b)) in first.iter().zip(&other) {
                assert!(
                    a.equal(b),
                    "{variant}: {name} differs between ranks 0 and {rank}"
                );
            }
        }
        assert_every_rank_matches(&out, ranks, &single, tolerance);
    }
}

#[test]
fn nccl_ranks_with_sharded_parameters_match_one_process() {
    let ranks = nccl_ranks();
    if ranks < 2 {
        eprintln!(
            "skipped nccl_ranks_with_sharded_parameters_match_one_process: needs 2 CUDA devices"
        );
        return;
    }
    let (single, _) = single_process_reference_of(|vs| Box::new(blocks_model(vs)));
    let out = scratch("nccl-sharded-parameters");
    let output = run_launcher_of_ranks("nccl_sharded_parameters", &out, ranks as usize);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("parameters sharded (ZeRO-3)"), "{log}");
    assert_every_rank_matches(&out, ranks, &single, 1e-4);
    // The sharded checkpoint the ranks wrote from their GPUs: whole, it is the model they
    // trained, and read back into the ranks it changes nothing.
    let trained = load(&out.join("rank0.ot"));
    let mut assembled = speedkit::dist::read_sharded_checkpoint(out.join("sharded")).unwrap();
    assembled.sort_by(|a, b| a.0.cmp(&b.0));
    for rank in 0..ranks {
        let reloaded = load(&out.join(format!("reloaded{rank}.ot")));
        for (((name, t), (_, a)), (_, r)) in trained.iter().zip(&assembled).zip(&reloaded) {
            assert!(t.equal(a) && t.equal(r), "rank {rank}: {name} differs");
        }
    }
}

/// Every rank's saved parameters (`rank<R>.ot` in `out`) within `tolerance` of one process's.
fn assert_every_rank_matches(
    out: &std::path::Path,
    ranks: i64,
    single: &[(String, Tensor)],
    tolerance: f64,
) {
    for rank in 0..ranks {
        let distributed = load(&out.join(format!("rank{rank}.ot")));
        for ((name, d), (_, s)) in distributed.iter().zip(single) {
            let err = common::rel_err(d, s);
            assert!(
                err < tolerance,
                "rank {rank}: {name}: relative difference {err:e}"
            );
        }
    }
}
