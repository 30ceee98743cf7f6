//! Operator overrides (`speedkit::overrides`): what the plan registers and why, the dispatcher's
//! table while one is held and after (normally, by a panic, out of order), and nothing changed for
//! CPU tensors. Registration needs no GPU, so this runs in CI; the kernels themselves are checked
//! against ATen in `gpu_overrides.rs`.

mod common;

use speedkit::hardware::Hardware;
use speedkit::overrides::{dispatcher_table, Override};
use speedkit::plan::Plan;
use speedkit::{SpeedConfig, SpeedContext};
use tch::{Device, Kind, Tensor};

/// Where speedkit's registrations say they come from in the dispatcher's table.
const OURS: &str = "overrides.cpp";

fn hold(on: bool) -> speedkit::flags::FlagGuard {
    common::hold_override(Override::LayerNorm, on)
}

fn ours_in_every_table() -> Vec<bool> {
    Override::LayerNorm
        .operators()
        .iter()
        .map(|op| {
            dispatcher_table(op)
                .expect("an ATen operator")
                .contains(OURS)
        })
        .collect()
}

#[test]
fn a_gpu_plan_lists_the_operators_it_takes_over_and_why() {
    let plan = Plan::resolve(
        &SpeedConfig::auto(),
        &Hardware::simulated_gpu("NVIDIA H100 80GB HBM3", 9, 0),
    )
    .unwrap();
    assert_eq!(plan.overrides, Override::ALL);
    let decision = plan
        .decision("overrides")
        .expect("the plan decides `overrides`");
    assert_eq!(decision.value, "on");
    assert!(
        decision.reason.contains("aten::native_layer_norm_backward"),
        "{}",
        decision.reason
    );
}

#[test]
fn a_cpu_plan_registers_nothing_and_says_why() {
    let _serial = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap();
    assert!(ctx.plan().overrides.is_empty());
    let decision = ctx.plan().decision("overrides").unwrap();
    assert!(
        decision.reason.contains("nothing to register"),
        "{}",
        decision.reason
    );
    assert!(!Override::LayerNorm.is_registered().unwrap());
    assert_eq!(ours_in_every_table(), [false, false]);
}

#[test]
fn overrides_false_registers_nothing_where_the_kernels_run() {
    let config = SpeedConfig::from_yaml_str("overrides: false\n").unwrap();
    let plan = Plan::resolve(&config, &Hardware::simulated_gpu("H100", 9, 0)).unwrap();
    assert!(plan.kernels && plan.overrides.is_empty());
}

#[test]
fn overrides_true_without_the_kernels_is_an_error_that_says_what_to_set() {
    let config = SpeedConfig::from_yaml_str("overrides: true\n").unwrap();
    let err = Plan::resolve(&config, &Hardware::simulated_gpu("T4", 7, 5)).unwrap_err();
    assert!(
        err.to_string().contains("set overrides to auto or false"),
        "{err}"
    );
}

#[test]
fn a_held_override_is_in_the_dispatcher_table_and_gone_after_its_guard() {
    let _serial = common::serial();
    assert_eq!(ours_in_every_table(), [false, false]);
    {
        let guard = hold(true);
        assert_eq!(ours_in_every_table(), [true, true]);
        assert!(Override::LayerNorm.is_registered().unwrap());
        let change = &guard.changes()[0];
        assert!(change.changed(), "the audit records the registration");
    }
    assert_eq!(ours_in_every_table(), [false, false]);
    assert!(!Override::LayerNorm.is_registered().unwrap());
}

#[test]
fn a_panic_through_the_guard_removes_the_override() {
    let _serial = common::serial();
    let outcome = std::panic::catch_unwind(|| {
        let _guard = hold(true);
        panic!("a training step fails");
    });
    assert!(outcome.is_err());
    assert_eq!(ours_in_every_table(), [false, false]);
}

#[test]
fn guards_dropped_out_of_order_leave_the_newest_ones_registration() {
    let _serial = common::serial();
    let outer = hold(true);
    let inner = hold(false);
    assert_eq!(ours_in_every_table(), [false, false]);
    drop(outer);
    // The inner guard, still alive, keeps its setting: not registered.
    assert_eq!(ours_in_every_table(), [false, false]);
    drop(inner);
    assert_eq!(ours_in_every_table(), [false, false]);
    let outer = hold(true);
    let inner = hold(true);
    drop(outer);
    assert_eq!(ours_in_every_table(), [true, true]);
    drop(inner);
    assert_eq!(ours_in_every_table(), [false, false]);
}

#[test]
fn cpu_tensors_never_reach_an_override() {
    let _serial = common::serial();
    let x = Tensor::randn([5, 37], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([37], (Kind::Float, Device::Cpu));
    let before = x.layer_norm([37], Some(&w), None::<&Tensor>, 1e-5, false);
    let _guard = hold(true);
    let after = x.layer_norm([37], Some(&w), None::<&Tensor>, 1e-5, false);
    assert!(before.equal(&after));
}

/// `group`, built in Rust, is registered under AutocastCUDA for each of its operators (where its
/// module `file` made it) while its guard lives, with no calls counted yet, and gone after.
fn assert_registered_under_autocast_cuda_while_held(group: Override, file: &str) {
    assert_registered_while_held(group, "AutocastCUDA", file);
}

/// As above, under the dispatch key `key`.
fn assert_registered_while_held(group: Override, key: &str, file: &str) {
    let _serial = common::serial();
    let key_lines = || -> Vec<String> {
        group
            .operators()
            .iter()
            .map(|op| {
                dispatcher_table(op)
                    .unwrap()
                    .lines()
                    .find(|l| l.starts_with(&format!("{key}:")))
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    };
    assert!(key_lines().iter().all(|l| !l.contains(file)));
    {
        let _guard = common::hold_override(group, true);
        assert!(group.is_registered().unwrap());
        // Registered through the public OperatorOverride, where speedkit's Rust module made it.
        let lines = key_lines();
        assert!(lines.iter().all(|l| l.contains(file)), "{lines:?}");
        for op in group.operators() {
            assert_eq!(group.stats(op).unwrap().ran, 0, "{op}");
        }
    }
    assert!(!group.is_registered().unwrap());
    assert!(key_lines().iter().all(|l| !l.contains(file)));
}

#[test]
fn the_log_softmax_group_registers_rust_kernels_under_autocast_cuda_until_its_guard_drops() {
    assert_registered_under_autocast_cuda_while_held(
        Override::CrossEntropy,
        "overrides/log_softmax.rs",
    );
}

#[test]
fn the_linear_group_registers_a_rust_kernel_under_autocast_cuda_until_its_guard_drops() {
    assert_registered_under_autocast_cuda_while_held(Override::Linear, "overrides/linear.rs");
}

#[test]
fn the_batch_norm_group_registers_rust_kernels_under_cuda_until_its_guard_drops() {
    assert_registered_while_held(Override::BatchNorm, "CUDA", "overrides/batch_norm/mod.rs");
}

#[test]
fn the_convolution_group_registers_a_rust_kernel_under_autocast_cuda_until_its_guard_drops() {
    assert_registered_under_autocast_cuda_while_held(
        Override::Convolution,
        "overrides/convolution.rs",
    );
}

#[test]
fn the_embedding_group_registers_a_rust_kernel_under_autocast_cuda_until_its_guard_drops() {
    assert_registered_under_autocast_cuda_while_held(Override::Embedding, "overrides/embedding.rs");
}

#[test]
fn the_depthwise_choice_is_put_back_when_its_guard_drops_even_by_a_panic() {
    use speedkit::overrides::{choose_depthwise, DepthwiseChoice};
    let outer = choose_depthwise(DepthwiseChoice::Cudnn);
    let found = outer.previous();
    let unwound = std::panic::catch_unwind(|| {
        let _kernel = choose_depthwise(DepthwiseChoice::Kernel);
        panic!("a training step fails while the kernel is pinned");
    });
    assert!(unwound.is_err());
    let inner = choose_depthwise(DepthwiseChoice::Timed);
    assert_eq!(
        inner.previous(),
        DepthwiseChoice::Cudnn,
        "the panic's guard put back"
    );
    drop(inner);
    drop(outer);
    let after = choose_depthwise(DepthwiseChoice::Timed);
    assert_eq!(after.previous(), found, "the process's choice put back");
}
