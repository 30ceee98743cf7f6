//! `SpeedConfig::validate`: every rule, and that all broken rules are reported together.

// Tests start from the defaults and change a few, often nested, fields: plain assignments read
// better than struct-update syntax here.
#![allow(clippy::field_reassign_with_default)]

use speedkit_config::{AutoBool, ConfigError, Precision, Problem, SpeedConfig};

/// The dotted paths of the problems `cfg` has (empty when valid).
fn problem_paths(cfg: &SpeedConfig) -> Vec<String> {
    match cfg.validate() {
        Ok(()) => Vec::new(),
        Err(ConfigError::Invalid { problems }) => problems.into_iter().map(|p| p.path).collect(),
        Err(other) => panic!("validate returned a non-Invalid error: {other:?}"),
    }
}

fn problems(cfg: &SpeedConfig) -> Vec<Problem> {
    match cfg.validate() {
        Err(ConfigError::Invalid { problems }) => problems,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn default_config_is_valid() {
    assert_eq!(problem_paths(&SpeedConfig::default()), Vec::<String>::new());
}

#[test]
fn every_preset_is_valid() {
    for name in SpeedConfig::PRESETS {
        assert_eq!(
            problem_paths(&SpeedConfig::preset(name).unwrap()),
            Vec::<String>::new()
        );
    }
}

#[test]
fn all_sdp_backends_off_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.sdp_backend.flash = false;
    cfg.sdp_backend.mem_efficient = false;
    cfg.sdp_backend.math = false;
    cfg.sdp_backend.cudnn = false;
    let problems = problems(&cfg);
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].message.starts_with(
            "no attention backend left: enable at least one of \
             sdp_backend.flash/mem_efficient/math/cudnn"
        ),
        "{}",
        problems[0].message
    );
}

#[test]
fn one_sdp_backend_left_is_enough() {
    let cfg = SpeedConfig::builder()
        .sdp_backends(false, false, false, true)
        .build();
    assert!(cfg.is_ok(), "{cfg:?}");
}

#[test]
fn non_positive_or_non_finite_init_scale_is_rejected() {
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut cfg = SpeedConfig::default();
        cfg.grad_scaler.init_scale = bad;
        assert_eq!(
            problem_paths(&cfg),
            ["grad_scaler.init_scale"],
            "init_scale {bad}"
        );
    }
}

#[test]
fn growth_factor_not_above_one_is_rejected() {
    for bad in [1.0, 0.5, f64::INFINITY, f64::NAN] {
        let mut cfg = SpeedConfig::default();
        cfg.grad_scaler.growth_factor = bad;
        assert_eq!(
            problem_paths(&cfg),
            ["grad_scaler.growth_factor"],
            "growth_factor {bad}"
        );
    }
}

#[test]
fn backoff_factor_outside_open_unit_interval_is_rejected() {
    for bad in [0.0, 1.0, -0.5, 2.0, f64::NAN] {
        let mut cfg = SpeedConfig::default();
        cfg.grad_scaler.backoff_factor = bad;
        assert_eq!(
            problem_paths(&cfg),
            ["grad_scaler.backoff_factor"],
            "backoff_factor {bad}"
        );
    }
}

#[test]
fn zero_growth_interval_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.grad_scaler.growth_interval = 0;
    assert_eq!(problem_paths(&cfg), ["grad_scaler.growth_interval"]);
}

#[test]
fn zero_bench_steps_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.bench.steps = 0;
    assert_eq!(problem_paths(&cfg), ["bench.steps"]);
}

#[test]
fn zero_bench_warmup_is_accepted() {
    let mut cfg = SpeedConfig::default();
    cfg.bench.warmup = 0;
    assert!(cfg.validate().is_ok());
}

#[test]
fn zero_max_graphs_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.compile.max_graphs = 0;
    assert_eq!(problem_paths(&cfg), ["compile.max_graphs"]);
}

#[test]
fn zero_compile_warmup_steps_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.compile.warmup_steps = 0;
    assert_eq!(problem_paths(&cfg), ["compile.warmup_steps"]);
}

#[test]
fn grad_scaler_forced_on_with_fp32_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.precision = Precision::Fp32;
    cfg.grad_scaler.enabled = AutoBool::On;
    let problems = problems(&cfg);
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, "grad_scaler.enabled");
    assert!(
        problems[0].message.contains("precision: fp16"),
        "{}",
        problems[0].message
    );
    assert!(
        problems[0].message.contains("grad_scaler.enabled: auto"),
        "{}",
        problems[0].message
    );
}

#[test]
fn grad_scaler_forced_on_with_fp16_is_accepted() {
    let cfg = SpeedConfig::builder()
        .precision(Precision::Fp16)
        .grad_scaler(true)
        .build();
    assert!(cfg.is_ok(), "{cfg:?}");
}

#[test]
fn grad_scaler_auto_with_fp32_is_accepted() {
    let cfg = SpeedConfig::builder().precision(Precision::Fp32).build();
    assert!(cfg.is_ok(), "{cfg:?}");
}

#[test]
fn deterministic_with_cudnn_benchmark_is_rejected() {
    let mut cfg = SpeedConfig::default();
    cfg.deterministic = true;
    cfg.cudnn.benchmark = AutoBool::On;
    assert_eq!(problem_paths(&cfg), ["cudnn.benchmark"]);
}

#[test]
fn deterministic_with_cudnn_benchmark_auto_is_accepted() {
    let cfg = SpeedConfig::builder().deterministic(true).build();
    assert!(cfg.is_ok(), "{cfg:?}");
}

#[test]
fn every_broken_rule_is_reported_in_key_order() {
    let text = "\
deterministic: true
precision: fp32
cudnn: {benchmark: true}
compile: {max_graphs: 0, warmup_steps: 0}
sdp_backend: {flash: false, mem_efficient: false, math: false, cudnn: false}
grad_scaler:
  enabled: true
  init_scale: 0
  growth_factor: 1
  backoff_factor: 1
  growth_interval: 0
bench: {steps: 0}
";
    let err = SpeedConfig::from_yaml_str(text).unwrap_err();
    let ConfigError::Invalid { problems } = &err else {
        panic!("not Invalid: {err:?}");
    };
    let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "cudnn.benchmark",
            "compile.max_graphs",
            "compile.warmup_steps",
            "sdp_backend",
            "grad_scaler.enabled",
            "grad_scaler.init_scale",
            "grad_scaler.growth_factor",
            "grad_scaler.backoff_factor",
            "grad_scaler.growth_interval",
            "bench.steps",
        ]
    );
}

#[test]
fn several_problems_display_one_per_line() {
    let mut cfg = SpeedConfig::default();
    cfg.bench.steps = 0;
    cfg.compile.max_graphs = 0;
    let text = cfg.validate().unwrap_err().to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0], "invalid speed config (2 problems):");
    assert!(
        lines[1].starts_with("  - `compile.max_graphs`: is 0"),
        "{text}"
    );
    assert!(lines[2].starts_with("  - `bench.steps`: is 0"), "{text}");
}

#[test]
fn single_problem_displays_on_one_line() {
    let mut cfg = SpeedConfig::default();
    cfg.grad_scaler.growth_interval = 0;
    assert_eq!(
        cfg.validate().unwrap_err().to_string(),
        "invalid speed config: `grad_scaler.growth_interval`: is 0; set it to at least 1 step \
         (default 2000)"
    );
}

#[test]
fn parsing_runs_validation() {
    let err = SpeedConfig::from_json_str(r#"{"compile": {"max_graphs": 0}}"#).unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err:?}");
}

#[test]
fn overrides_without_kernels_is_an_error_naming_both_keys() {
    let mut cfg = SpeedConfig::default();
    cfg.kernels = AutoBool::Off;
    cfg.overrides = AutoBool::On;
    let found = problems(&cfg);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].path, "overrides");
    assert!(
        found[0].message.contains("`kernels`"),
        "{}",
        found[0].message
    );
}
