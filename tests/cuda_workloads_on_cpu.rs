//! The `cuda_only` workloads (matmul, contiguity, sync points) are skipped by `tests/workloads.rs`
//! without a GPU; their timings only mean something on one, but their code runs anywhere. This runs
//! each at the tiny size on the CPU (fp32 and bf16 autocast), so a broken workload shows up before
//! it reaches a GPU machine.

#[path = "../workloads/mod.rs"]
mod workloads;

use speedkit::bench::{testing::run_tiny, Size, Workload};
use speedkit::config::{DeviceChoice, Precision, SpeedConfig};

#[test]
fn cuda_only_workloads_run_at_the_tiny_size_on_the_cpu() {
    let cpu = SpeedConfig {
        device: DeviceChoice::Cpu,
        ..SpeedConfig::auto()
    };
    let bf16 = SpeedConfig {
        precision: Precision::Bf16,
        ..cpu.clone()
    };
    let cuda_only: Vec<&Workload> = Workload::all()
        .into_iter()
        .filter(|w| w.cuda_only)
        .collect();
    assert!(
        cuda_only.len() >= 10,
        "expected the matmul, contiguity and sync workloads, got {}",
        cuda_only.len()
    );
    let mut failures = Vec::new();
    for w in cuda_only {
        assert!(w.sizes.contains(&Size::Tiny), "{} has no tiny size", w.name);
        for (name, config) in [("cpu", &cpu), ("cpu_bf16", &bf16)] {
            if let Err(e) = run_tiny(w, config) {
                failures.push(format!("{} under {name}: {e:?}", w.name));
            }
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}
