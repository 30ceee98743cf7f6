//! The memory breakdown's accounting (`speedkit::memory::MemoryBreakdown`, `OptimizerMemory`): what
//! an optimizer holds, counted exactly and only while it lives, and parts that add up to the peaks.

mod common;

use speedkit::memory::{MemoryBreakdown, MemoryUse, PoolUse};
use speedkit::optim::{AdamW, AdamWOptimizer, OptimizerMemory};
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn cpu_context() -> SpeedContext {
    SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap()
}

#[test]
fn an_optimizer_counts_its_parameters_gradients_and_state() {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 100, 30, Default::default());
    let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    let parameters = 4 * (100 * 30 + 30);
    let before = opt.memory();
    assert_eq!(before.parameters, parameters);
    assert_eq!(before.gradients, 0);
    // One learning rate; the first step makes the rest, as torch.optim does.
    assert_eq!(before.state, 4);

    let x = Tensor::ones([8, 100], (Kind::Float, Device::Cpu));
    layer.forward(&x).sum(Kind::Float).backward();
    opt.step().unwrap();
    let after = opt.memory();
    assert_eq!(after.gradients, parameters);
    // Two fp32 moments per parameter, a float step count per parameter, one learning rate.
    assert_eq!(after.state, 2 * parameters + 2 * 4 + 4);
}

#[test]
fn a_bf16_model_counts_two_bytes_a_parameter() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root(), 64, 64, Default::default());
    vs.bfloat16();
    let opt = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    assert_eq!(opt.memory().parameters, 2 * (64 * 64 + 64));
}

#[test]
fn a_context_counts_its_optimizers_only_while_they_live() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root(), 16, 16, Default::default());
    assert_eq!(ctx.optimizer_memory(), OptimizerMemory::default());
    let first = ctx.adamw(&vs, AdamW::default()).unwrap();
    let second = ctx.adamw(&vs, AdamW::default()).unwrap();
    assert_eq!(ctx.optimizer_memory(), first.memory() + second.memory());
    drop(first);
    assert_eq!(ctx.optimizer_memory(), second.memory());
    drop(second);
    assert_eq!(ctx.optimizer_memory(), OptimizerMemory::default());
}

#[test]
fn the_breakdown_adds_up_to_the_peaks() {
    let after = MemoryUse {
        allocated: 10_000,
        reserved: 14_000,
        weight_copies: 1_000,
        graph_pools: PoolUse {
            reserved: 3_000,
            allocated: 500,
            segments: 2,
        },
        fragmented: 700,
        ..Default::default()
    };
    let optimizer = OptimizerMemory {
        parameters: 2_000,
        gradients: 2_000,
        state: 4_000,
    };
    let b = MemoryBreakdown::of(after, optimizer, (16_000, 20_000));
    assert_eq!(b.other_held, 1_000);
    assert_eq!(b.held(), after.allocated);
    assert_eq!(b.held() + b.activations, 16_000);
    assert_eq!(b.held() + b.activations + b.cached, 20_000);
    assert_eq!((b.graph_pools, b.fragmented), (3_000, 700));
}

#[test]
fn parts_named_beyond_what_is_allocated_leave_no_negative_rest() {
    // The optimizer's count can exceed what one device's allocator holds (parameters on another
    // device): the rest is zero, never a wrapped-around number.
    let after = MemoryUse {
        allocated: 1_000,
        ..Default::default()
    };
    let optimizer = OptimizerMemory {
        parameters: 800,
        gradients: 800,
        state: 0,
    };
    let b = MemoryBreakdown::of(after, optimizer, (900, 800));
    assert_eq!((b.other_held, b.activations, b.cached), (0, 0, 0));
}

#[test]
fn a_memory_history_of_no_events_is_refused() {
    let err = speedkit::memory::MemoryHistory::record(0).unwrap_err();
    assert!(err.to_string().contains("max_events >= 1"), "{err}");
}

#[test]
fn a_memory_history_without_a_gpu_is_refused_and_records_nothing() {
    use speedkit::memory::{MemoryHistory, DEFAULT_HISTORY_EVENTS};
    if tch::Cuda::is_available() {
        eprintln!("skipped: a CUDA device is visible (gpu_memory.rs covers that case)");
        return;
    }
    let err = MemoryHistory::record(DEFAULT_HISTORY_EVENTS).unwrap_err();
    assert!(err.to_string().contains("needs a CUDA device"), "{err}");
    assert!(!MemoryHistory::is_recording().unwrap());
}
