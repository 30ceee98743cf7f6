//! The step profiler on the CPU: the ops of a tiny step, its JSON and its Chrome trace.

mod common;

use speedkit::config::{DeviceChoice, SpeedConfig};
use speedkit::graph::StepKind;
use speedkit::profile::Rows;
use speedkit::{SpeedContext, SpeedkitError};
use tch::{nn, nn::Module, Device, Kind, Tensor};

fn cpu_context() -> SpeedContext {
    let config = SpeedConfig {
        device: DeviceChoice::Cpu,
        ..SpeedConfig::auto()
    };
    SpeedContext::new(&config).expect("a CPU context")
}

/// linear → relu → sum, forward and backward: a step whose ops are known.
struct TinyStep {
    layer: nn::Linear,
    x: Tensor,
    _vs: nn::VarStore,
}

impl TinyStep {
    fn new() -> Self {
        let vs = nn::VarStore::new(Device::Cpu);
        let layer = nn::linear(vs.root(), 16, 8, Default::default());
        let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
        Self { layer, x, _vs: vs }
    }

    fn run(&self) -> speedkit::Result<()> {
        self.layer.forward(&self.x).relu().sum(None).f_backward()?;
        Ok(())
    }
}

#[test]
fn profiler_lists_the_cpu_ops_of_each_step_with_their_counts() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let step = TinyStep::new();
    let profile = ctx.profile(2, || step.run()).unwrap();
    assert_eq!(profile.rows, Rows::CpuOps);
    assert_eq!(profile.steps.len(), 2);
    for s in &profile.steps {
        let calls = |name: &str| s.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("aten::linear"), Some(1), "{s}");
        assert_eq!(calls("aten::addmm"), Some(1), "{s}");
        assert_eq!(calls("aten::relu"), Some(1), "{s}");
        // The weight's gradient (the input needs none).
        assert_eq!(calls("aten::mm"), Some(1), "{s}");
        assert!(
            s.rows.iter().any(|r| r.name.contains("AddmmBackward0")),
            "the backward ops are recorded too:\n{s}"
        );
        assert_eq!(s.kind, StepKind::Eager);
        assert!(s.cuda_event_ms.is_none() && s.peak_memory_bytes.is_none());
    }
}

#[test]
fn cpu_op_self_times_fit_inside_the_step() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let step = TinyStep::new();
    let profile = ctx.profile(1, || step.run()).unwrap();
    let s = &profile.steps[0];
    assert!(s.rows_total_ms() > 0.0);
    assert!(
        s.rows_total_ms() <= s.host_ms * 1.05,
        "self times add up to at most the step: {} ms of {} ms",
        s.rows_total_ms(),
        s.host_ms
    );
}

#[test]
fn trace_file_parses_as_json_and_shows_the_steps() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let step = TinyStep::new();
    let profile = ctx.profile(2, || step.run()).unwrap();
    let dir = std::env::temp_dir().join(format!("speedkit-profile-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.json");
    profile.save_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    let events = trace["traceEvents"]
        .as_array()
        .expect("a traceEvents array");
    for marker in ["speedkit step #1", "speedkit step #2"] {
        assert!(
            events.iter().any(|e| e["name"] == marker),
            "{marker} missing"
        );
    }
    assert!(events.iter().any(|e| e["name"] == "aten::addmm"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn profile_json_holds_every_step_and_row() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let step = TinyStep::new();
    let profile = ctx.profile(1, || step.run()).unwrap();
    let json: serde_json::Value = serde_json::from_str(&profile.to_json()).unwrap();
    assert_eq!(json["rows"], "cpu_ops");
    let rows = json["steps"][0]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), profile.steps[0].rows.len());
    assert!(rows
        .iter()
        .any(|r| r["name"] == "aten::addmm" && r["category"] == "gemm"));
}

#[test]
fn zero_steps_is_refused() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let err = ctx.profile(0, || Ok(())).unwrap_err();
    assert!(matches!(err, SpeedkitError::Misuse(_)), "{err}");
}

#[test]
fn a_failing_step_stops_the_profiler_and_reports_the_error() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let err = ctx
        .profile(1, || -> speedkit::Result<()> {
            Err(SpeedkitError::Misuse("the step failed".into()))
        })
        .unwrap_err();
    assert_eq!(err.to_string(), "the step failed");
    // The profiler is off again: a new profile can start.
    let step = TinyStep::new();
    assert!(ctx.profile(1, || step.run()).is_ok());
}
