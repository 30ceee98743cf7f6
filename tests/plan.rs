//! Every row of the `auto` table, on simulated hardware (a pure function: no GPU needed).

use speedkit::config::{AutoBool, DeviceChoice, MatmulPrecision, Precision, SpeedConfig};
use speedkit::flags::{Flag, FlagValue};
use speedkit::hardware::Hardware;
use speedkit::plan::{Plan, ResolvedPrecision};
use tch::{Device, Kind};

fn auto_on(hw: &Hardware) -> Plan {
    Plan::resolve(&SpeedConfig::auto(), hw).expect("auto always resolves")
}

fn h100() -> Hardware {
    Hardware::simulated_gpu("NVIDIA H100 80GB HBM3", 9, 0)
}

#[test]
fn ampere_and_newer_get_bf16_and_tf32_high_without_scaler() {
    for (name, major, minor) in [("A100", 8, 0), ("RTX 4090", 8, 9), ("H100", 9, 0)] {
        let plan = auto_on(&Hardware::simulated_gpu(name, major, minor));
        assert_eq!(plan.precision, ResolvedPrecision::Bf16, "{name}");
        assert_eq!(plan.precision.autocast_kind(), Some(Kind::BFloat16));
        assert_eq!(plan.matmul_precision, Some(MatmulPrecision::High), "{name}");
        assert!(plan.grad_scaler.is_none(), "{name}");
        assert!(plan.fused_optimizer && plan.compile_graphs, "{name}");
        assert_eq!(plan.device, Device::Cuda(0));
    }
}

#[test]
fn volta_and_turing_get_fp16_with_grad_scaler_and_no_tf32() {
    for (name, minor) in [("V100", 0), ("T4", 5)] {
        let plan = auto_on(&Hardware::simulated_gpu(name, 7, minor));
        assert_eq!(plan.precision, ResolvedPrecision::Fp16, "{name}");
        assert!(plan.grad_scaler.is_some(), "{name}");
        assert_eq!(
            plan.matmul_precision,
            Some(MatmulPrecision::Highest),
            "{name}"
        );
        let precision = plan
            .flag_settings()
            .into_iter()
            .find(|s| s.flag == Flag::Float32MatmulPrecision)
            .unwrap();
        assert_eq!(
            precision.value,
            FlagValue::MatmulPrecision(MatmulPrecision::Highest)
        );
    }
}

#[test]
fn pre_volta_gpus_stay_in_fp32() {
    let plan = auto_on(&Hardware::simulated_gpu("P100", 6, 0));
    assert_eq!(plan.precision, ResolvedPrecision::Fp32);
    assert!(plan.grad_scaler.is_none());
}

#[test]
fn cpu_gets_fp32_foreach_no_graphs_and_touches_no_tf32_flag() {
    let plan = auto_on(&Hardware::cpu_only());
    assert_eq!(plan.precision, ResolvedPrecision::Fp32);
    assert_eq!(plan.device, Device::Cpu);
    assert!(!plan.fused_optimizer && !plan.compile_graphs && plan.grad_scaler.is_none());
    assert!(plan
        .flag_settings()
        .iter()
        .all(|s| s.flag != Flag::Float32MatmulPrecision));
}

#[test]
fn compile_auto_is_off_on_windows() {
    let plan = auto_on(&h100().with_os("windows"));
    assert!(!plan.compile_graphs);
    assert!(plan.decision("compile").unwrap().reason.contains("Windows"));
}

#[test]
fn every_decision_carries_a_reason() {
    for hw in [
        h100(),
        Hardware::simulated_gpu("T4", 7, 5),
        Hardware::cpu_only(),
    ] {
        let plan = auto_on(&hw);
        assert!(plan.decisions.len() >= 10);
        for d in &plan.decisions {
            assert!(!d.reason.is_empty(), "{} has no reason", d.key);
        }
        for s in plan.flag_settings() {
            assert!(!s.reason.is_empty(), "{} has no reason", s.flag);
        }
    }
}

#[test]
fn tf32_high_sets_the_precision_alone_and_allow_tf32_follows() {
    let settings = auto_on(&h100()).flag_settings();
    let get = |f: Flag| settings.iter().find(|s| s.flag == f).map(|s| s.value);
    assert_eq!(
        get(Flag::Float32MatmulPrecision),
        Some(FlagValue::MatmulPrecision(MatmulPrecision::High))
    );
    // allow_tf32 is a view of the precision: writing it too would write the legacy field twice.
    assert_eq!(get(Flag::CudaMatmulAllowTf32), None);
    assert_eq!(get(Flag::CudnnBenchmark), Some(FlagValue::Bool(true)));
}

#[test]
fn fp32_strict_preset_turns_tf32_off_and_fused_off() {
    let plan = Plan::resolve(&SpeedConfig::preset("fp32_strict").unwrap(), &h100()).unwrap();
    assert_eq!(plan.precision, ResolvedPrecision::Fp32);
    assert_eq!(plan.matmul_precision, Some(MatmulPrecision::Highest));
    assert_eq!(plan.cudnn_allow_tf32, Some(false));
    assert_eq!(plan.cudnn_benchmark, Some(false));
    assert!(!plan.fused_optimizer && !plan.compile_graphs);
}

#[test]
fn bf16_on_a_gpu_without_bf16_is_an_error_that_suggests_fp16() {
    let config = SpeedConfig {
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    let err = Plan::resolve(&config, &Hardware::simulated_gpu("T4", 7, 5))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bf16 needs SM 8.0") && err.contains("fp16"),
        "{err}"
    );
}

#[test]
fn asking_for_a_missing_gpu_is_an_error_that_says_what_to_set() {
    let config = SpeedConfig {
        device: DeviceChoice::Cuda(0),
        ..SpeedConfig::auto()
    };
    let err = Plan::resolve(&config, &Hardware::cpu_only())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cuda:0") && err.contains("device: auto"),
        "{err}"
    );
    let err = Plan::resolve(
        &SpeedConfig {
            device: DeviceChoice::Cuda(3),
            ..SpeedConfig::auto()
        },
        &h100(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("only 1"), "{err}");
}

#[test]
fn graphs_forced_on_a_cpu_is_an_error() {
    let mut config = SpeedConfig::auto();
    config.compile.enabled = AutoBool::On;
    let err = Plan::resolve(&config, &Hardware::cpu_only())
        .unwrap_err()
        .to_string();
    assert!(err.contains("compile.enabled"), "{err}");
}

#[test]
fn explicit_bf16_on_cpu_autocasts_on_cpu() {
    let config = SpeedConfig {
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    let plan = Plan::resolve(&config, &Hardware::cpu_only()).unwrap();
    assert_eq!(plan.precision, ResolvedPrecision::Bf16);
    assert_eq!(plan.device, Device::Cpu);
}

#[test]
fn fp16_forced_on_ampere_gets_the_scaler_under_auto() {
    let config = SpeedConfig {
        precision: Precision::Fp16,
        ..SpeedConfig::auto()
    };
    let plan = Plan::resolve(&config, &h100()).unwrap();
    assert!(plan.grad_scaler.is_some());
    assert_eq!(plan.grad_scaler.unwrap().init_scale, 65536.0);
}

#[test]
fn deterministic_mode_disables_cudnn_benchmark_and_sets_the_modes() {
    let config = SpeedConfig {
        deterministic: true,
        ..SpeedConfig::auto()
    };
    let plan = Plan::resolve(&config, &h100()).unwrap();
    assert_eq!(plan.cudnn_benchmark, Some(false));
    assert_eq!(plan.cudnn_deterministic, Some(true));
    assert_eq!(plan.deterministic_algorithms, Some(true));
}

#[test]
fn disabled_sdp_backends_become_flag_settings() {
    let mut config = SpeedConfig::auto();
    config.sdp_backend.math = false;
    let settings = Plan::resolve(&config, &h100()).unwrap().flag_settings();
    assert!(settings
        .iter()
        .any(|s| s.flag == Flag::SdpMath && s.value == FlagValue::Bool(false)));
    assert!(settings.iter().all(|s| s.flag != Flag::SdpFlash));
}

#[test]
fn an_invalid_config_is_rejected_before_planning() {
    let mut config = SpeedConfig::auto();
    config.grad_scaler.growth_factor = 0.5;
    assert!(Plan::resolve(&config, &h100()).is_err());
}

fn decision<'a>(plan: &'a Plan, key: &str) -> &'a speedkit::plan::Decision {
    plan.decisions
        .iter()
        .find(|d| d.key == key)
        .unwrap_or_else(|| panic!("the plan decides `{key}`"))
}

fn kernels_decision(plan: &Plan) -> &speedkit::plan::Decision {
    decision(plan, "kernels")
}

#[test]
fn kernels_auto_turns_on_for_sm80_and_newer_with_a_toolchain() {
    for (name, major, minor) in [("A100", 8, 0), ("H100", 9, 0)] {
        let plan = auto_on(&Hardware::simulated_gpu(name, major, minor));
        assert!(plan.kernels, "{name}");
        assert!(kernels_decision(&plan).reason.contains("NVRTC"), "{name}");
    }
}

#[test]
fn kernels_auto_stays_off_on_old_gpus_the_cpu_and_without_nvrtc_saying_why() {
    let mut no_nvrtc = h100();
    no_nvrtc.kernels_unavailable = Some("NVRTC (libnvrtc.so.13) was not found".into());
    for (hw, why) in [
        (Hardware::simulated_gpu("T4", 7, 5), "SM 7.5"),
        (Hardware::cpu_only(), "CPU"),
        (no_nvrtc, "libnvrtc.so.13"),
    ] {
        let plan = auto_on(&hw);
        assert!(!plan.kernels, "{why}");
        let reason = &kernels_decision(&plan).reason;
        assert!(reason.contains(why), "{reason:?} does not say {why:?}");
    }
}

#[test]
fn kernels_true_where_they_cannot_run_is_an_error_that_says_what_to_set() {
    let config = SpeedConfig {
        kernels: AutoBool::On,
        ..SpeedConfig::auto()
    };
    for hw in [Hardware::cpu_only(), Hardware::simulated_gpu("T4", 7, 5)] {
        let err = Plan::resolve(&config, &hw).unwrap_err().to_string();
        assert!(err.contains("kernels: true"), "{err}");
        assert!(err.contains("set kernels to auto or false"), "{err}");
    }
    assert!(Plan::resolve(&config, &h100()).unwrap().kernels);
}

#[test]
fn kernels_false_keeps_aten_everywhere() {
    let config = SpeedConfig {
        kernels: AutoBool::Off,
        ..SpeedConfig::auto()
    };
    let plan = Plan::resolve(&config, &h100()).unwrap();
    assert!(!plan.kernels);
    assert!(kernels_decision(&plan).reason.contains("set in the config"));
}

fn fp8_decision(plan: &Plan) -> &speedkit::plan::Decision {
    decision(plan, "fp8")
}

#[test]
fn auto_keeps_every_gemm_in_bf16_on_fp8_hardware_and_says_how_to_turn_fp8_on() {
    let plan = auto_on(&h100());
    assert!(plan.fp8.is_none());
    let decision = fp8_decision(&plan);
    assert_eq!(decision.value, "off");
    for part in [
        "SM 9.0 has FP8 Tensor Cores",
        "converged loss",
        "set fp8.enabled: auto",
    ] {
        assert!(decision.reason.contains(part), "{}", decision.reason);
    }
}

#[test]
fn fp8_enabled_auto_on_fp8_hardware_runs_gemms_from_the_measured_crossover() {
    let config = SpeedConfig::preset("auto_fp8").unwrap();
    let plan = Plan::resolve(&config, &h100()).unwrap();
    let fp8 = plan.fp8.expect("fp8.enabled: auto on an H100 plans FP8");
    assert_eq!(fp8.min_gemm_size, config.fp8.min_gemm_size());
    assert!(fp8_decision(&plan).reason.contains("run in FP8"));
}

#[test]
fn fp8_off_without_fp8_hardware_says_why_rather_than_how() {
    let plan = auto_on(&Hardware::simulated_gpu("A100", 8, 0));
    assert!(plan.fp8.is_none());
    assert!(fp8_decision(&plan).reason.contains("no FP8 Tensor Cores"));
}

#[test]
fn the_warm_ups_saved_tensors_are_parked_by_default_with_fusion_only() {
    let mut config = SpeedConfig::auto();
    let plan = Plan::resolve(&config, &h100()).unwrap();
    assert!(plan.compile_graphs && !plan.graph_warmup_offload);
    assert!(decision(&plan, "compile.warmup_offload")
        .reason
        .contains("no fusion"));
    config.compile.fusion = true;
    assert!(
        Plan::resolve(&config, &h100())
            .unwrap()
            .graph_warmup_offload
    );
    config.compile.warmup_offload = AutoBool::Off;
    assert!(
        !Plan::resolve(&config, &h100())
            .unwrap()
            .graph_warmup_offload
    );
    config.compile.fusion = false;
    config.compile.warmup_offload = AutoBool::On;
    assert!(
        Plan::resolve(&config, &h100())
            .unwrap()
            .graph_warmup_offload
    );
    // No capture, no warm-up steps.
    let cpu = Plan::resolve(&config, &Hardware::cpu_only()).unwrap();
    assert!(!cpu.graph_warmup_offload);
}
