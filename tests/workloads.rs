//! Every registered workload as a `cargo test` case: tiny size on the CPU, plain and under bf16
//! autocast, checking that the step runs, that the loss is finite, and that every global flag is
//! restored afterwards (`speedkit::bench::testing`). Workloads marked `cuda_only` are listed as
//! ignored here; `tests/cuda_workloads_on_cpu.rs` still exercises their code on the CPU.

#[path = "../workloads/mod.rs"]
mod workloads;

speedkit::bench_tests!(workloads);
