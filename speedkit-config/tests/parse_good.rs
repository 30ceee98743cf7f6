//! Inputs that must parse, and what they parse to.

// Tests start from the defaults and change a few, often nested, fields: plain assignments read
// better than struct-update syntax here.
#![allow(clippy::field_reassign_with_default)]

use speedkit_config::{
    AutoBool, CompileMode, DeviceChoice, Fp8GradientFormat, Fp8Recipe, MatmulPrecision,
    MatmulPrecisionChoice, OptimizerName, Precision, SpeedConfig,
};

/// A config with every field away from its default (and still valid).
fn everything_changed() -> SpeedConfig {
    let mut c = SpeedConfig::default();
    c.device = DeviceChoice::Cuda(2);
    c.precision = Precision::Fp16;
    c.tf32_matmul_precision = MatmulPrecisionChoice::Medium;
    c.reduced_precision_reduction = AutoBool::On;
    c.channels_last = AutoBool::Off;
    c.deterministic = true;
    c.cudnn.enabled = false;
    c.cudnn.benchmark = AutoBool::Off;
    c.cudnn.allow_tf32 = AutoBool::On;
    c.cudnn.deterministic = true;
    c.compile.enabled = AutoBool::On;
    c.compile.max_graphs = 7;
    c.compile.warmup_steps = 1;
    c.optimizer.fused = AutoBool::On;
    c.sdp_backend.flash = false;
    c.sdp_backend.mem_efficient = false;
    c.sdp_backend.cudnn = false;
    c.grad_scaler.enabled = AutoBool::On;
    c.grad_scaler.init_scale = 1024.5;
    c.grad_scaler.growth_factor = 1.5;
    c.grad_scaler.backoff_factor = 0.25;
    c.grad_scaler.growth_interval = 100;
    c.fp8.enabled = AutoBool::On;
    c.fp8.recipe = Fp8Recipe::Rowwise;
    c.fp8.amax_history = 32;
    c.fp8.gradient_format = Some(Fp8GradientFormat::E5m2);
    c.fp8.min_gemm_size = Some(4096);
    c.bench.warmup = 0;
    c.bench.steps = 3;
    c.bench.paranoid_sync = false;
    c
}

const EVERYTHING_CHANGED_YAML: &str = "\
device: cuda:2
precision: fp16
tf32_matmul_precision: medium
reduced_precision_reduction: true
channels_last: false
deterministic: true
cudnn:
  enabled: false
  benchmark: false
  allow_tf32: true
  deterministic: true
compile:
  enabled: true
  mode: graphs
  max_graphs: 7
  warmup_steps: 1
optimizer:
  name: adamw
  fused: true
sdp_backend:
  flash: false
  mem_efficient: false
  math: true
  cudnn: false
grad_scaler:
  enabled: true
  init_scale: 1024.5
  growth_factor: 1.5
  backoff_factor: 0.25
  growth_interval: 100
fp8:
  enabled: true
  recipe: rowwise
  amax_history: 32
  gradient_format: e5m2
  min_gemm_size: 4096
bench:
  warmup: 0
  steps: 3
  paranoid_sync: false
";

#[test]
fn empty_yaml_is_the_default() {
    assert_eq!(
        SpeedConfig::from_yaml_str("").unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn comment_only_yaml_is_the_default() {
    let cfg = SpeedConfig::from_yaml_str("# nothing here yet\n").unwrap();
    assert_eq!(cfg, SpeedConfig::default());
}

#[test]
fn null_yaml_document_is_the_default() {
    assert_eq!(
        SpeedConfig::from_yaml_str("~").unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn auto_is_the_default() {
    assert_eq!(SpeedConfig::auto(), SpeedConfig::default());
}

#[test]
fn defaults_match_the_documented_values() {
    let c = SpeedConfig::default();
    assert_eq!(c.device, DeviceChoice::Auto);
    assert_eq!(c.precision, Precision::Auto);
    assert_eq!(c.tf32_matmul_precision, MatmulPrecisionChoice::Auto);
    assert!(c.reduced_precision_reduction.is_auto() && c.channels_last.is_auto());
    assert!(!c.deterministic);
    assert!(c.cudnn.enabled && !c.cudnn.deterministic);
    assert!(c.cudnn.benchmark.is_auto() && c.cudnn.allow_tf32.is_auto());
    assert_eq!(c.compile.enabled, AutoBool::Auto);
    assert_eq!(c.compile.mode, CompileMode::Graphs);
    assert_eq!((c.compile.max_graphs, c.compile.warmup_steps), (4, 3));
    assert_eq!(c.optimizer.name, OptimizerName::AdamW);
    assert_eq!(c.optimizer.fused, AutoBool::Auto);
    let sdp = &c.sdp_backend;
    assert!(sdp.flash && sdp.mem_efficient && sdp.math && sdp.cudnn);
    let gs = &c.grad_scaler;
    assert_eq!(gs.enabled, AutoBool::Auto);
    assert_eq!(gs.init_scale, 65536.0);
    assert_eq!((gs.growth_factor, gs.backoff_factor), (2.0, 0.5));
    assert_eq!(gs.growth_interval, 2000);
    let fp8 = &c.fp8;
    assert_eq!(
        (fp8.enabled, fp8.recipe, fp8.amax_history),
        (AutoBool::Off, Fp8Recipe::Delayed, 16)
    );
    assert_eq!((fp8.gradient_format, fp8.min_gemm_size), (None, None));
    assert_eq!(fp8.gradient_format(), Fp8GradientFormat::E5m2);
    assert_eq!(
        (c.bench.warmup, c.bench.steps, c.bench.paranoid_sync),
        (10, 50, true)
    );
}

#[test]
fn full_yaml_sets_every_key() {
    let cfg = SpeedConfig::from_yaml_str(EVERYTHING_CHANGED_YAML).unwrap();
    assert_eq!(cfg, everything_changed());
}

#[test]
fn partial_yaml_keeps_defaults_for_missing_keys() {
    let cfg = SpeedConfig::from_yaml_str("precision: bf16\ngrad_scaler:\n  growth_interval: 10\n")
        .unwrap();
    let mut expected = SpeedConfig::default();
    expected.precision = Precision::Bf16;
    expected.grad_scaler.growth_interval = 10;
    assert_eq!(cfg, expected);
}

#[test]
fn section_with_every_key_commented_out_is_its_default() {
    let cfg = SpeedConfig::from_yaml_str("cudnn:\n  # benchmark: true\nprecision: fp32\n").unwrap();
    assert_eq!(cfg.cudnn, SpeedConfig::default().cudnn);
}

#[test]
fn integer_is_accepted_for_float_key() {
    let cfg = SpeedConfig::from_yaml_str("grad_scaler:\n  init_scale: 1024\n").unwrap();
    assert_eq!(cfg.grad_scaler.init_scale, 1024.0);
}

#[test]
fn json_object_parses() {
    let json = r#"{"precision": "bf16", "cudnn": {"benchmark": true}, "device": "cpu"}"#;
    let cfg = SpeedConfig::from_json_str(json).unwrap();
    let mut expected = SpeedConfig::default();
    expected.precision = Precision::Bf16;
    expected.cudnn.benchmark = AutoBool::On;
    expected.device = DeviceChoice::Cpu;
    assert_eq!(cfg, expected);
}

#[test]
fn json_null_is_the_default() {
    assert_eq!(
        SpeedConfig::from_json_str("null").unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn json_null_section_is_its_default() {
    let cfg = SpeedConfig::from_json_str(r#"{"bench": null}"#).unwrap();
    assert_eq!(cfg.bench, SpeedConfig::default().bench);
}

#[test]
fn yaml_and_json_of_the_same_config_agree() {
    let yaml = SpeedConfig::from_yaml_str(EVERYTHING_CHANGED_YAML).unwrap();
    let json = SpeedConfig::from_json_str(&everything_changed().to_json_string().unwrap()).unwrap();
    assert_eq!(yaml, json);
}

#[test]
fn yaml_round_trips() {
    let cfg = everything_changed();
    let text = cfg.to_yaml_string().unwrap();
    assert_eq!(SpeedConfig::from_yaml_str(&text).unwrap(), cfg);
}

#[test]
fn json_round_trips() {
    let cfg = everything_changed();
    let text = cfg.to_json_string().unwrap();
    assert_eq!(SpeedConfig::from_json_str(&text).unwrap(), cfg);
}

#[test]
fn default_yaml_round_trips() {
    let text = SpeedConfig::default().to_yaml_string().unwrap();
    assert_eq!(
        SpeedConfig::from_yaml_str(&text).unwrap(),
        SpeedConfig::default()
    );
}

#[test]
fn json_output_is_pretty() {
    let text = SpeedConfig::default().to_json_string().unwrap();
    assert!(text.contains("\n  \"precision\": \"auto\","), "{text}");
}

#[test]
fn auto_bool_parses_auto_and_both_booleans() {
    let cfg = SpeedConfig::from_yaml_str(
        "channels_last: auto\ncudnn: {benchmark: true, allow_tf32: false}",
    )
    .unwrap();
    assert_eq!(
        (cfg.channels_last, cfg.cudnn.benchmark, cfg.cudnn.allow_tf32),
        (AutoBool::Auto, AutoBool::On, AutoBool::Off)
    );
}

#[test]
fn auto_bool_serialises_as_auto_string_or_boolean() {
    let text = serde_json::to_string(&[AutoBool::Auto, AutoBool::On, AutoBool::Off]).unwrap();
    assert_eq!(text, r#"["auto",true,false]"#);
}

#[test]
fn auto_bool_resolve_uses_auto_value_only_when_auto() {
    assert_eq!(
        [AutoBool::Auto, AutoBool::On, AutoBool::Off].map(|a| (a.resolve(true), a.resolve(false))),
        [(true, false), (true, true), (false, false)]
    );
}

#[test]
fn auto_bool_is_auto_only_for_auto() {
    assert_eq!(
        [AutoBool::Auto, AutoBool::On, AutoBool::Off].map(AutoBool::is_auto),
        [true, false, false]
    );
}

#[test]
fn auto_bool_converts_from_bool_and_option() {
    assert_eq!(AutoBool::from(true), AutoBool::On);
    assert_eq!(AutoBool::from(Some(false)), AutoBool::Off);
    assert_eq!(AutoBool::from(None), AutoBool::Auto);
}

#[test]
fn device_forms_parse() {
    let parse = |s: &str| {
        SpeedConfig::from_yaml_str(&format!("device: {s}"))
            .unwrap()
            .device
    };
    assert_eq!(parse("auto"), DeviceChoice::Auto);
    assert_eq!(parse("cpu"), DeviceChoice::Cpu);
    assert_eq!(parse("cuda"), DeviceChoice::Cuda(0));
    assert_eq!(parse("cuda:0"), DeviceChoice::Cuda(0));
    assert_eq!(parse("cuda:12"), DeviceChoice::Cuda(12));
}

#[test]
fn device_serialises_with_explicit_index() {
    let text =
        serde_json::to_string(&[DeviceChoice::Auto, DeviceChoice::Cpu, DeviceChoice::Cuda(3)])
            .unwrap();
    assert_eq!(text, r#"["auto","cpu","cuda:3"]"#);
}

#[test]
fn device_from_str_rejects_signs_and_missing_index() {
    for bad in ["cuda:", "cuda:+1", "cuda:-1", "CUDA", "cuda:0:1", "gpu"] {
        assert!(bad.parse::<DeviceChoice>().is_err(), "{bad} was accepted");
    }
}

#[test]
fn precision_spellings_are_lowercase() {
    for (text, precision) in [
        ("auto", Precision::Auto),
        ("bf16", Precision::Bf16),
        ("fp16", Precision::Fp16),
        ("fp32", Precision::Fp32),
    ] {
        let cfg = SpeedConfig::from_yaml_str(&format!("precision: {text}")).unwrap();
        assert_eq!(cfg.precision, precision);
        assert_eq!(precision.as_str(), text);
    }
}

#[test]
fn matmul_precision_uses_pytorch_spelling() {
    assert_eq!(
        [
            MatmulPrecision::Highest,
            MatmulPrecision::High,
            MatmulPrecision::Medium
        ]
        .map(MatmulPrecision::as_str),
        ["highest", "high", "medium"]
    );
}

#[test]
fn matmul_precision_from_str_inverts_as_str() {
    for p in [
        MatmulPrecision::Highest,
        MatmulPrecision::High,
        MatmulPrecision::Medium,
    ] {
        assert_eq!(p.as_str().parse::<MatmulPrecision>().unwrap(), p);
    }
}

#[test]
fn matmul_precision_choice_is_concrete_unless_auto() {
    assert_eq!(MatmulPrecisionChoice::Auto.concrete(), None);
    assert_eq!(
        MatmulPrecisionChoice::High.concrete(),
        Some(MatmulPrecision::High)
    );
    assert_eq!(
        MatmulPrecisionChoice::from(MatmulPrecision::Medium),
        MatmulPrecisionChoice::Medium
    );
}

#[test]
fn yaml_file_is_read_from_disk() {
    let path = std::env::temp_dir().join(format!("speedkit-config-{}.yaml", std::process::id()));
    std::fs::write(&path, "precision: bf16\n").unwrap();
    let cfg = SpeedConfig::from_yaml(&path);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(cfg.unwrap().precision, Precision::Bf16);
}

#[test]
fn json_file_is_read_from_disk() {
    let path = std::env::temp_dir().join(format!("speedkit-config-{}.json", std::process::id()));
    std::fs::write(&path, r#"{"precision": "fp16"}"#).unwrap();
    let cfg = SpeedConfig::from_json(&path);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(cfg.unwrap().precision, Precision::Fp16);
}

#[test]
fn distributed_section_reads_backend_buckets_and_timeout() {
    let cfg = SpeedConfig::from_yaml_str(
        "distributed:\n  backend: nccl\n  bucket_mb: 50\n  first_bucket_mb: 2\n  timeout_s: 60\n",
    )
    .unwrap();
    assert_eq!(
        cfg.distributed.backend,
        speedkit_config::DistributedBackend::Nccl
    );
    assert_eq!(
        (
            cfg.distributed.bucket_mb,
            cfg.distributed.first_bucket_mb,
            cfg.distributed.timeout_s
        ),
        (50, 2, 60)
    );
}
