//! The `distributed` decision of the plan: `auto` on when WORLD_SIZE > 1, the backend by device,
//! each rank on its own GPU, how gradients are all-reduced (speedkit's all-reduce inside the step's
//! CUDA graph, or c10d's Reducer for an eager step), and impossible combinations refused with what to change.

use speedkit::config::{
    AllReduce, DeviceChoice, DistributedBackend, GradientCompression, SpeedConfig,
};
use speedkit::dist::{Backend, LaunchEnv};
use speedkit::hardware::{GpuInfo, Hardware};
use speedkit::plan::Plan;
use tch::Device;

fn two_h200() -> Hardware {
    let mut hw = Hardware::simulated_gpu("H200", 9, 0);
    let second = GpuInfo {
        index: 1,
        ..hw.gpus[0].clone()
    };
    hw.gpus.push(second);
    hw
}

fn rank(rank: usize, world_size: usize) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
    }
}

fn decision(plan: &Plan) -> String {
    let d = plan
        .decisions
        .iter()
        .find(|d| d.key == "distributed")
        .unwrap();
    format!("{}: {}", d.value, d.reason)
}

#[test]
fn auto_is_off_in_a_single_process_and_says_why() {
    let plan = Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), None).unwrap();
    assert!(plan.distributed.is_none());
    assert!(decision(&plan).contains("single process"));
}

#[test]
fn auto_picks_nccl_and_this_ranks_gpu_under_a_launcher() {
    let plan =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(1, 2))).unwrap();
    assert_eq!(plan.device, Device::Cuda(1));
    let settings = plan.distributed.as_ref().unwrap();
    assert_eq!(settings.backend, Backend::Nccl);
    assert_eq!(settings.bucket_bytes, 25 << 20);
    assert!(decision(&plan).contains("rank 1 of 2"));
    assert!(decision(&plan).contains("its stream at high priority"));
}

#[test]
fn auto_picks_gloo_on_the_cpu() {
    let plan = Plan::resolve_launched(
        &SpeedConfig::auto(),
        &Hardware::cpu_only(),
        Some(&rank(0, 2)),
    )
    .unwrap();
    assert_eq!(plan.distributed.map(|d| d.backend), Some(Backend::Gloo));
}

#[test]
fn a_launch_of_one_process_joins_a_group_of_one_only_where_the_backend_is_named() {
    let auto =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(0, 1))).unwrap();
    assert!(auto.distributed.is_none());
    let mut config = SpeedConfig::auto();
    config.distributed.backend = DistributedBackend::Nccl;
    let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 1))).unwrap();
    let settings = plan.distributed.as_ref().unwrap();
    assert_eq!(
        (settings.backend, settings.env.world_size),
        (Backend::Nccl, 1)
    );
    assert!(
        decision(&plan).contains("rank 0 of 1"),
        "{}",
        decision(&plan)
    );
    assert!(plan.compile_graphs);
}

#[test]
fn off_trains_each_process_alone() {
    let mut config = SpeedConfig::auto();
    config.distributed.backend = DistributedBackend::Off;
    let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(1, 2))).unwrap();
    assert!(plan.distributed.is_none());
    assert_eq!(plan.device, Device::Cuda(0));
}

#[test]
fn nccl_on_the_cpu_is_refused() {
    let mut config = SpeedConfig::auto();
    config.distributed.backend = DistributedBackend::Nccl;
    config.device = DeviceChoice::Cpu;
    let err = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap_err();
    assert!(err.to_string().contains("needs CUDA tensors"), "{err}");
}

#[test]
fn a_fixed_gpu_other_than_local_rank_is_refused() {
    let mut config = SpeedConfig::auto();
    config.device = DeviceChoice::Cuda(0);
    let err = Plan::resolve_launched(&config, &two_h200(), Some(&rank(1, 2))).unwrap_err();
    assert!(err.to_string().contains("LOCAL_RANK 1"), "{err}");
}

#[test]
fn more_ranks_than_gpus_is_refused() {
    let err =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(2, 3))).unwrap_err();
    assert!(err.to_string().contains("only 2 CUDA device(s)"), "{err}");
}

fn all_reduce(plan: &Plan) -> String {
    let d = plan
        .decisions
        .iter()
        .find(|d| d.key == "all_reduce")
        .unwrap();
    format!("{}: {}", d.value, d.reason)
}

#[test]
fn auto_keeps_the_graph_and_all_reduces_inside_it_during_the_backward_pass() {
    let plan =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(0, 2))).unwrap();
    assert!(plan.compile_graphs);
    let settings = plan.distributed.as_ref().unwrap();
    assert_eq!(settings.all_reduce, AllReduce::InBackward);
    assert!(!settings.bf16_gradients);
    let why = all_reduce(&plan);
    assert!(
        why.starts_with("in_backward: the step runs as a CUDA graph"),
        "{why}"
    );
}

#[test]
fn auto_takes_the_reducer_for_an_eager_step() {
    let plan = Plan::resolve_launched(
        &SpeedConfig::auto(),
        &Hardware::cpu_only(),
        Some(&rank(0, 2)),
    )
    .unwrap();
    assert_eq!(
        plan.distributed.as_ref().unwrap().all_reduce,
        AllReduce::Reducer
    );
    let why = all_reduce(&plan);
    assert!(why.starts_with("reducer: the step runs eagerly"), "{why}");
}

#[test]
fn the_reducer_turns_auto_graphs_eager_with_the_reason() {
    let mut config = SpeedConfig::auto();
    config.distributed.all_reduce = AllReduce::Reducer;
    let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap();
    assert!(!plan.compile_graphs);
    assert!(plan
        .decisions
        .iter()
        .any(|d| d.key == "compile" && d.value == "off" && d.reason.contains("Reducer")));
}

#[test]
fn explicit_graphs_with_the_reducer_are_refused() {
    let mut config = SpeedConfig::auto();
    config.compile.enabled = speedkit::config::AutoBool::On;
    config.distributed.all_reduce = AllReduce::Reducer;
    let err = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap_err();
    assert!(
        err.to_string().contains(
            "compile.enabled: true cannot be combined with distributed.all_reduce: reducer"
        ),
        "{err}"
    );
}

#[test]
fn explicit_graphs_with_speedkits_all_reduce_are_kept() {
    for all_reduce in [AllReduce::InBackward, AllReduce::AfterBackward] {
        let mut config = SpeedConfig::auto();
        config.compile.enabled = speedkit::config::AutoBool::On;
        config.distributed.all_reduce = all_reduce;
        let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap();
        assert!(plan.compile_graphs);
        assert_eq!(plan.distributed.unwrap().all_reduce, all_reduce);
    }
}

#[test]
fn bf16_gradients_take_speedkits_all_reduce_and_are_refused_with_the_reducer() {
    let mut config = SpeedConfig::auto();
    config.distributed.compress = GradientCompression::Bf16;
    config.compile.enabled = speedkit::config::AutoBool::Off;
    let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap();
    let settings = plan.distributed.as_ref().unwrap();
    assert_eq!(settings.all_reduce, AllReduce::InBackward);
    assert!(settings.bf16_gradients);
    config.distributed.all_reduce = AllReduce::Reducer;
    let err = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap_err();
    assert!(err.to_string().contains("compress: bf16"), "{err}");
}

#[test]
fn a_sharded_optimizer_takes_speedkits_all_reduce_and_says_so_in_the_plan() {
    let mut config = SpeedConfig::auto();
    config.distributed.shard_optimizer = true;
    config.compile.enabled = speedkit::config::AutoBool::Off;
    let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(1, 2))).unwrap();
    let settings = plan.distributed.as_ref().unwrap();
    assert!(settings.shard_optimizer);
    assert_eq!(settings.all_reduce, AllReduce::InBackward);
    let sharding = plan
        .decisions
        .iter()
        .find(|d| d.key == "optimizer_state")
        .unwrap();
    assert_eq!(sharding.value, "sharded");
    assert!(
        sharding.reason.contains("1/2 of the parameters"),
        "{}",
        sharding.reason
    );
}

#[test]
fn a_sharded_optimizer_is_refused_with_the_reducer() {
    let mut config = SpeedConfig::auto();
    config.distributed.shard_optimizer = true;
    config.distributed.all_reduce = AllReduce::Reducer;
    let err = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap_err();
    assert!(
        err.to_string().contains(
            "set all_reduce to auto, in_backward or after_backward, or shard_optimizer to false"
        ),
        "{err}"
    );
}

#[test]
fn the_optimizer_state_is_whole_unless_the_config_shards_it() {
    let plan =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(0, 2))).unwrap();
    assert!(!plan.distributed.as_ref().unwrap().shard_optimizer);
    assert!(!plan.decisions.iter().any(|d| d.key == "optimizer_state"));
}

fn optimizer_step(plan: &Plan) -> (bool, String) {
    let d = plan
        .decisions
        .iter()
        .find(|d| d.key == "optimizer_step")
        .unwrap();
    (
        plan.distributed.as_ref().unwrap().overlap_optimizer,
        format!("{}: {}", d.value, d.reason),
    )
}

#[test]
fn the_optimizer_steps_each_bucket_as_it_lands_under_speedkits_all_reduce() {
    let plan =
        Plan::resolve_launched(&SpeedConfig::auto(), &two_h200(), Some(&rank(0, 2))).unwrap();
    let (on, why) = optimizer_step(&plan);
    assert!(on, "{why}");
    assert!(
        why.starts_with("as buckets land: speedkit's AdamW"),
        "{why}"
    );
}

#[test]
fn a_sharded_optimizer_steps_each_buckets_pieces_as_it_lands_and_gathers_it_right_after() {
    let mut sharded = SpeedConfig::auto();
    sharded.distributed.shard_optimizer = true;
    let plan = Plan::resolve_launched(&sharded, &two_h200(), Some(&rank(0, 2))).unwrap();
    let (on, why) = optimizer_step(&plan);
    assert!(on, "{why}");
    assert!(
        why.contains("reduce-scatter lands and starts its all-gather"),
        "{why}"
    );
}

#[test]
fn the_optimizer_steps_after_all_buckets_under_the_reducer_or_the_config() {
    let mut reducer = SpeedConfig::auto();
    reducer.distributed.all_reduce = AllReduce::Reducer;
    reducer.compile.enabled = speedkit::config::AutoBool::Off;
    let mut off = SpeedConfig::auto();
    off.distributed.overlap_optimizer = false;
    for (config, reason) in [(reducer, "c10d's Reducer"), (off, "set in the config")] {
        let plan = Plan::resolve_launched(&config, &two_h200(), Some(&rank(0, 2))).unwrap();
        let (on, why) = optimizer_step(&plan);
        assert!(!on, "{why}");
        assert!(why.starts_with("after all buckets: "), "{why}");
        assert!(why.contains(reason), "{why}");
    }
}

fn sharded_parameters() -> SpeedConfig {
    let mut cfg = SpeedConfig::auto();
    cfg.distributed.shard_parameters = true.into();
    cfg
}

#[test]
fn sharded_parameters_compute_in_bf16_on_speedkits_all_reduce_and_say_so() {
    let plan =
        Plan::resolve_launched(&sharded_parameters(), &two_h200(), Some(&rank(0, 2))).unwrap();
    let settings = plan.distributed.as_ref().unwrap();
    assert_eq!(settings.shard_parameters, Some(tch::Kind::BFloat16));
    assert!(
        settings.shard_optimizer,
        "ZeRO-3 shards the optimizer state too"
    );
    assert_eq!(settings.all_reduce, AllReduce::InBackward);
    let d = plan.decision("parameters").unwrap();
    assert!(
        d.reason.contains("ZeRO-3") && d.reason.contains("bf16"),
        "{}",
        d.reason
    );
    assert!(all_reduce(&plan).contains("each block's gradients, sent in fp32"));
}

#[test]
fn sharded_parameters_run_the_step_eagerly_on_atens_kernels_and_say_why() {
    let plan =
        Plan::resolve_launched(&sharded_parameters(), &two_h200(), Some(&rank(0, 2))).unwrap();
    assert!(!plan.compile_graphs && !plan.graph_fusion);
    assert!(!plan.kernels && plan.overrides.is_empty() && plan.fp8.is_none());
    for key in ["compile", "kernels"] {
        let last = plan.decisions.iter().rev().find(|d| d.key == key).unwrap();
        assert_eq!(last.value, "off");
        assert!(
            last.reason.contains("distributed.shard_parameters"),
            "{}",
            last.reason
        );
    }
    let replicas = plan.decision("check_replicas_every").unwrap();
    assert_eq!(replicas.value, "0");
    assert_eq!(plan.distributed.as_ref().unwrap().check_replicas_every, 0);
}

#[test]
fn sharded_parameters_turn_on_expandable_segments_on_cuda_only() {
    let plan =
        Plan::resolve_launched(&sharded_parameters(), &two_h200(), Some(&rank(0, 2))).unwrap();
    assert_eq!(plan.cuda_expandable_segments, Some(true));
    assert!(plan
        .flag_settings()
        .iter()
        .any(|s| s.flag == speedkit::flags::Flag::CudaExpandableSegments));
    let mut cpu = sharded_parameters();
    cpu.device = DeviceChoice::Cpu;
    let plan = Plan::resolve_launched(&cpu, &two_h200(), Some(&rank(0, 2))).unwrap();
    assert_eq!(
        plan.distributed.as_ref().unwrap().shard_parameters,
        Some(tch::Kind::Float)
    );
    assert_eq!(plan.cuda_expandable_segments, None);
}

#[test]
fn sharded_parameters_are_refused_with_fp16_the_reducer_or_graphs_asked_for() {
    use speedkit::config::{AutoBool, Precision};
    let mut fp16 = sharded_parameters();
    fp16.precision = Precision::Fp16;
    let mut reducer = sharded_parameters();
    reducer.distributed.all_reduce = AllReduce::Reducer;
    let mut graphs = sharded_parameters();
    graphs.compile.enabled = AutoBool::On;
    for (cfg, names) in [
        (fp16, "precision to bf16 or fp32"),
        (reducer, "set all_reduce to auto"),
        (graphs, "set compile.enabled to auto"),
    ] {
        let err = Plan::resolve_launched(&cfg, &two_h200(), Some(&rank(0, 2)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shard_parameters") && err.contains(names),
            "{err}"
        );
    }
}

/// Two H200s of 141 GiB each, their memory known (a simulated GPU's is 0, unknown).
fn two_h200_with_memory() -> Hardware {
    let mut hw = two_h200();
    for gpu in &mut hw.gpus {
        gpu.total_memory_bytes = 141 << 30;
    }
    hw
}

/// The `parameters` decision of rank 0 of two, for a model of `parameters` parameters.
fn auto_sharding(hw: &Hardware, parameters: Option<u64>) -> (bool, String) {
    let plan =
        Plan::resolve_for_model(&SpeedConfig::auto(), hw, Some(&rank(0, 2)), parameters).unwrap();
    let sharded = plan
        .distributed
        .as_ref()
        .unwrap()
        .shard_parameters
        .is_some();
    (sharded, plan.decision("parameters").unwrap().reason.clone())
}

#[test]
fn auto_shards_the_parameters_of_a_model_whose_state_does_not_fit_the_gpu_and_says_why() {
    // Llama 2 13B: 13 B parameters, 194 GiB of fp32 weights, gradients and AdamW state.
    let (sharded, why) = auto_sharding(&two_h200_with_memory(), Some(13_000_000_000));
    assert!(sharded, "{why}");
    assert!(
        why.contains("shard_parameters: auto")
            && why.contains("193.7 GiB")
            && why.contains("96.9 GiB"),
        "{why}"
    );
}

#[test]
fn auto_keeps_whole_the_parameters_of_a_model_that_fits_and_says_why() {
    // 5 B parameters: 74.5 GiB of state, within 70% of an H200's 141 GiB (98.7 GiB).
    let (sharded, why) = auto_sharding(&two_h200_with_memory(), Some(5_000_000_000));
    assert!(!sharded, "{why}");
    assert!(why.contains("they fit whole"), "{why}");
}

#[test]
fn auto_keeps_the_parameters_whole_where_the_plan_does_not_know_the_model() {
    let (sharded, why) = auto_sharding(&two_h200_with_memory(), None);
    assert!(!sharded);
    assert!(why.contains("does not know the model"), "{why}");
    let (sharded, why) = auto_sharding(&two_h200(), Some(13_000_000_000));
    assert!(!sharded, "a simulated GPU's memory is unknown: {why}");
}

#[test]
fn auto_keeps_the_parameters_whole_beside_settings_sharding_cannot_take() {
    use speedkit::config::{AutoBool, Precision};
    let mut fp16 = SpeedConfig::auto();
    fp16.precision = Precision::Fp16;
    let mut reducer = SpeedConfig::auto();
    reducer.distributed.all_reduce = AllReduce::Reducer;
    let mut graphs = SpeedConfig::auto();
    graphs.compile.enabled = AutoBool::On;
    for (config, reason) in [
        (fp16, "fp16's GradScaler"),
        (reducer, "all_reduce is reducer"),
        (graphs, "compile.enabled is true"),
    ] {
        let plan = Plan::resolve_for_model(
            &config,
            &two_h200_with_memory(),
            Some(&rank(0, 2)),
            Some(13_000_000_000),
        )
        .unwrap();
        assert!(plan
            .distributed
            .as_ref()
            .unwrap()
            .shard_parameters
            .is_none());
        let why = &plan.decision("parameters").unwrap().reason;
        assert!(why.contains(reason), "{why}");
    }
}
