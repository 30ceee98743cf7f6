//! Named presets, the shipped example files, and the builder.

// Tests start from the defaults and change a few, often nested, fields: plain assignments read
// better than struct-update syntax here.
#![allow(clippy::field_reassign_with_default)]

use speedkit_config::{
    AllReduce, AutoBool, ConfigError, DeviceChoice, GradientCompression, MatmulPrecisionChoice,
    Precision, SpeedConfig, SpeedConfigBuilder,
};

const SPEED_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/configs/speed.yaml"
);
const AUTO_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/configs/auto_speed.yaml"
);
const BASELINE_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/configs/baseline.yaml"
);

#[test]
fn baseline_yaml_is_the_fp32_strict_preset() {
    assert_eq!(
        SpeedConfig::from_yaml(BASELINE_YAML).unwrap(),
        SpeedConfig::preset("fp32_strict").unwrap()
    );
}

#[test]
fn auto_speed_yaml_is_the_auto_preset() {
    assert_eq!(
        SpeedConfig::from_yaml(AUTO_YAML).unwrap(),
        SpeedConfig::preset("auto").unwrap()
    );
}

#[test]
fn every_shipped_example_config_loads() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/configs");
    let mut loaded = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            SpeedConfig::from_yaml(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            loaded += 1;
        }
    }
    assert!(loaded >= 6, "{loaded} configs in {dir}");
}

#[test]
fn the_data_parallel_example_configs_change_only_their_distributed_setting() {
    let path = |name: &str| format!("{}/../examples/configs/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut after_backward = SpeedConfig::default();
    after_backward.distributed.all_reduce = AllReduce::AfterBackward;
    assert_eq!(
        SpeedConfig::from_yaml(path("dp_after_backward.yaml")).unwrap(),
        after_backward
    );
    let mut bf16 = SpeedConfig::default();
    bf16.distributed.compress = GradientCompression::Bf16;
    assert_eq!(SpeedConfig::from_yaml(path("dp_bf16.yaml")).unwrap(), bf16);
    let mut sharded = SpeedConfig::default();
    sharded.distributed.shard_optimizer = true;
    assert_eq!(
        SpeedConfig::from_yaml(path("dp_sharded.yaml")).unwrap(),
        sharded
    );
}

#[test]
fn speed_yaml_is_the_default() {
    assert_eq!(
        SpeedConfig::from_yaml(SPEED_YAML).unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn speed_yaml_spells_out_every_key() {
    // Same document as the serialised default: every key present, none extra.
    let file: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(SPEED_YAML).unwrap()).unwrap();
    let default: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&SpeedConfig::default().to_yaml_string().unwrap()).unwrap();
    assert_eq!(file, default);
}

#[test]
fn preset_auto_is_the_default() {
    assert_eq!(SpeedConfig::preset("auto").unwrap(), SpeedConfig::default());
}

#[test]
fn preset_fp32_strict_turns_every_speed_flag_off() {
    let c = SpeedConfig::preset("fp32_strict").unwrap();
    assert_eq!(c.precision, Precision::Fp32);
    assert_eq!(c.tf32_matmul_precision, MatmulPrecisionChoice::Highest);
    assert_eq!(
        [
            c.cudnn.benchmark,
            c.cudnn.allow_tf32,
            c.reduced_precision_reduction,
            c.optimizer.fused,
            c.compile.enabled,
            c.grad_scaler.enabled,
        ],
        [AutoBool::Off; 6]
    );
}

#[test]
fn preset_tf32_differs_from_fp32_strict_only_in_tf32_switches() {
    let mut expected = SpeedConfig::preset("fp32_strict").unwrap();
    expected.tf32_matmul_precision = MatmulPrecisionChoice::High;
    expected.cudnn.allow_tf32 = AutoBool::On;
    assert_eq!(SpeedConfig::preset("tf32").unwrap(), expected);
}

#[test]
fn every_listed_preset_exists() {
    for name in SpeedConfig::PRESETS {
        assert!(SpeedConfig::preset(name).is_ok(), "{name}");
    }
}

#[test]
fn unknown_preset_carries_names() {
    let err = SpeedConfig::preset("tf31").unwrap_err();
    let ConfigError::UnknownPreset {
        name,
        suggestion,
        presets,
    } = err
    else {
        panic!("not UnknownPreset: {err:?}");
    };
    assert_eq!(name, "tf31");
    assert_eq!(suggestion.as_deref(), Some("tf32"));
    assert_eq!(presets, SpeedConfig::PRESETS);
}

#[test]
fn unrelated_preset_name_gets_no_suggestion() {
    let err = SpeedConfig::preset("turbo").unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::UnknownPreset {
                suggestion: None,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn builder_without_calls_builds_the_default() {
    assert_eq!(
        SpeedConfig::builder().build().unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn builder_sets_the_requested_fields() {
    let cfg = SpeedConfig::builder()
        .precision(Precision::Bf16)
        .tf32_matmul_precision(MatmulPrecisionChoice::High)
        .cudnn_benchmark(true)
        .fused_optimizer(AutoBool::On)
        .compile(AutoBool::Off)
        .grad_scaler(AutoBool::On)
        .sdp_backends(true, false, true, false)
        .device(DeviceChoice::Cuda(0))
        .build()
        .unwrap();
    let mut expected = SpeedConfig::default();
    expected.precision = Precision::Bf16;
    expected.tf32_matmul_precision = MatmulPrecisionChoice::High;
    expected.cudnn.benchmark = AutoBool::On;
    expected.optimizer.fused = AutoBool::On;
    expected.compile.enabled = AutoBool::Off;
    expected.grad_scaler.enabled = AutoBool::On;
    expected.sdp_backend.mem_efficient = false;
    expected.sdp_backend.cudnn = false;
    expected.device = DeviceChoice::Cuda(0);
    assert_eq!(cfg, expected);
}

#[test]
fn builder_sets_the_remaining_switches() {
    let cfg = SpeedConfig::builder()
        .reduced_precision_reduction(false)
        .channels_last(true)
        .cudnn_allow_tf32(false)
        .bench_steps(2, 5)
        .build()
        .unwrap();
    assert_eq!(
        (
            cfg.reduced_precision_reduction,
            cfg.channels_last,
            cfg.cudnn.allow_tf32
        ),
        (AutoBool::Off, AutoBool::On, AutoBool::Off)
    );
    assert_eq!((cfg.bench.warmup, cfg.bench.steps), (2, 5));
}

#[test]
fn builder_build_validates() {
    let err = SpeedConfig::builder()
        .deterministic(true)
        .cudnn_benchmark(true)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err:?}");
}

#[test]
fn builder_can_start_from_a_preset() {
    let cfg = SpeedConfigBuilder::from(SpeedConfig::preset("fp32_strict").unwrap())
        .device(DeviceChoice::Cpu)
        .build()
        .unwrap();
    assert_eq!(cfg.precision, Precision::Fp32);
    assert_eq!(cfg.device, DeviceChoice::Cpu);
}
