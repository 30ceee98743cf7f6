//! The three-line integration on the CPU: apply_speedups → autocast → backward_step, the audit, and
//! restoration when the context drops.

mod common;

use speedkit::config::{Precision, SpeedConfig};
use speedkit::flags::FlagState;
use speedkit::optim::AdamW;
use speedkit::{apply_speedups, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[test]
fn three_line_integration_trains_and_restores_flags() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = nn::linear(vs.root(), 16, 4, Default::default());
        let config = SpeedConfig {
            precision: Precision::Bf16,
            ..SpeedConfig::auto()
        };
        let ctx = apply_speedups(&mut vs, &config).unwrap();
        let mut opt = ctx
            .adamw(
                &vs,
                AdamW {
                    lr: 1e-2,
                    ..Default::default()
                },
            )
            .unwrap();
        let x = Tensor::randn([32, 16], (Kind::Float, ctx.device()));
        let y = Tensor::randint(4, [32], (Kind::Int64, ctx.device()));
        let first = ctx.autocast(|| model.forward(&x).cross_entropy_for_logits(&y));
        let mut last = first.copy();
        for _ in 0..20 {
            let loss = ctx.autocast(|| model.forward(&x).cross_entropy_for_logits(&y));
            ctx.backward_step(&loss, &mut opt).unwrap();
            last = loss;
        }
        assert!(last.double_value(&[]) < first.double_value(&[]));
        assert_eq!(opt.steps_taken().unwrap(), 20);
    }
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn the_forward_pass_runs_under_autocast_and_the_rest_does_not() {
    let _lock = common::serial();
    let config = SpeedConfig {
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    let ctx = SpeedContext::new(&config).unwrap();
    let a = Tensor::randn([4, 4], (Kind::Float, ctx.device()));
    assert_eq!(ctx.autocast(|| a.matmul(&a)).kind(), Kind::BFloat16);
    assert_eq!(a.matmul(&a).kind(), Kind::Float);
}

#[test]
fn an_fp32_plan_makes_autocast_a_no_op() {
    let _lock = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    if ctx.device() == Device::Cpu {
        let a = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        assert_eq!(ctx.autocast(|| a.matmul(&a)).kind(), Kind::Float);
        assert!(!ctx.grad_scaler().is_enabled());
    }
}

#[test]
fn the_audit_lists_decisions_with_reasons_and_prints_as_a_table_and_json() {
    let _lock = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let audit = ctx.audit();
    assert!(audit.decisions.iter().any(|d| d.key == "precision"));
    let table = audit.to_string();
    assert!(
        table.contains("precision") && table.contains("reason"),
        "{table}"
    );
    let json: serde_json::Value = serde_json::from_str(&audit.to_json()).unwrap();
    assert!(json["decisions"].as_array().is_some_and(|d| !d.is_empty()));
}

#[test]
fn the_audit_prints_a_reason_shared_by_several_flags_once() {
    let _lock = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu").unwrap()).unwrap();
    let audit = ctx.audit();
    // Every override group's flag takes its reason from the one `overrides` setting.
    let shared = &audit
        .flag_changes
        .iter()
        .find(|c| c.name == "speedkit.overrides.layer_norm")
        .expect("the layer_norm group's flag is in the audit")
        .reason;
    let table = audit.to_string();
    let flags = table
        .split("flags changed")
        .nth(1)
        .expect("the audit has a flags section");
    assert_eq!(flags.matches(shared.as_str()).count(), 1, "{table}");
    assert!(
        flags.contains("as for speedkit.overrides.layer_norm"),
        "{table}"
    );
}

#[test]
fn a_config_that_needs_a_missing_gpu_fails_and_changes_nothing() {
    let _lock = common::serial();
    if tch::Cuda::is_available() {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    let before = FlagState::capture().unwrap();
    let config = SpeedConfig::from_yaml_str("device: cuda\n").unwrap();
    let err = SpeedContext::new(&config).unwrap_err().to_string();
    assert!(err.contains("cuda:0"), "{err}");
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn apply_speedups_moves_parameters_to_the_plan_device() {
    let _lock = common::serial();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root(), 2, 2, Default::default());
    let ctx = apply_speedups(&mut vs, &SpeedConfig::auto()).unwrap();
    assert_eq!(vs.device(), ctx.device());
}

#[test]
fn speedkit_linear_without_fp8_equals_tch_linear() {
    let _lock = common::serial();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let layer = speedkit::nn::Linear::new(&(vs.root() / "fc"), 24, 40, true);
    let x = tch::Tensor::randn([5, 3, 24], (tch::Kind::Float, tch::Device::Cpu));
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let y = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    assert!(y.allclose(&x.linear(&layer.ws, layer.bs.as_ref()), 1e-6, 1e-6, false));
    assert!(vs.variables().contains_key("fc.fp8_amax_history"));
}

#[test]
fn fp8_asked_for_on_a_machine_without_it_is_an_error_that_changes_nothing() {
    let _lock = common::serial();
    let before = speedkit::flags::FlagState::capture().unwrap();
    let config = SpeedConfig::from_yaml_str("device: cpu\nfp8: {enabled: true}\n").unwrap();
    let err = SpeedContext::new(&config).unwrap_err().to_string();
    assert!(
        err.contains("fp8.enabled: true needs FP8 Tensor Cores"),
        "{err}"
    );
    assert_eq!(speedkit::flags::FlagState::capture().unwrap(), before);
}

#[test]
fn the_kernels_setting_holds_while_the_context_lives_and_comes_back_after() {
    let _lock = common::serial();
    let before = speedkit::kernels::set_enabled(true);
    let config = SpeedConfig {
        kernels: speedkit::config::AutoBool::Off,
        ..SpeedConfig::auto()
    };
    {
        let ctx = SpeedContext::new(&config).unwrap();
        assert!(!speedkit::kernels::enabled(), "kernels: false is in force");
        let decision = ctx.plan().decisions.iter().find(|d| d.key == "kernels");
        assert_eq!(decision.map(|d| d.value.as_str()), Some("off"));
    }
    assert!(
        speedkit::kernels::enabled(),
        "the setting before the context is back"
    );
    speedkit::kernels::set_enabled(before);
}

#[test]
fn the_kernels_setting_comes_back_when_the_training_code_panics() {
    let _lock = common::serial();
    let before = speedkit::kernels::set_enabled(true);
    let config = SpeedConfig {
        kernels: speedkit::config::AutoBool::Off,
        ..SpeedConfig::auto()
    };
    let result = std::panic::catch_unwind(|| {
        let _ctx = SpeedContext::new(&config).unwrap();
        panic!("training failed");
    });
    assert!(result.is_err());
    assert!(speedkit::kernels::enabled());
    speedkit::kernels::set_enabled(before);
}

#[test]
fn one_op_switched_off_by_a_guard_runs_aten_and_comes_back_after() {
    use speedkit::flags::{FlagGuard, FlagSetting, FlagValue};
    use speedkit::kernels::KernelOp;
    let _lock = common::serial();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let norm = speedkit::nn::layer_norm(vs.root(), 8, Default::default());
    let x = tch::Tensor::randn([2, 8], (tch::Kind::Float, tch::Device::Cpu));
    let op = KernelOp::LayerNorm.flag();
    let before = op.get().unwrap();
    {
        let _guard =
            FlagGuard::apply(&[FlagSetting::new(op, FlagValue::Bool(false), "test")]).unwrap();
        let why = norm.fallback_reason(&x).unwrap_or_default();
        assert!(why.contains("kernels: false"), "{why}");
        assert!(speedkit::kernels::enabled(), "only the one op is off");
    }
    assert_eq!(op.get().unwrap(), before);
}

#[test]
fn the_audit_counts_the_calls_that_fell_back_in_this_context() {
    let _lock = common::serial();
    let config = SpeedConfig::from_yaml_str("device: cpu\nkernels: false\n").unwrap();
    // kernels: false on the CPU: nothing is noted (the plan says why), so the audit lists nothing.
    let ctx = SpeedContext::new(&config).unwrap();
    let x = tch::Tensor::randn([2, 8], (tch::Kind::Float, tch::Device::Cpu));
    let _ = speedkit::nn::cross_entropy(
        &x,
        &tch::Tensor::zeros([2], (tch::Kind::Int64, tch::Device::Cpu)),
    );
    let audit = ctx.audit().to_string();
    assert!(!audit.contains("cross_entropy:"), "{audit}");
}
