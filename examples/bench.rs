//! The benchmark runner as an example, for a quick run without `cargo bench`:
//!
//! ```text
//! cargo run --release --example bench -- --filter transformer
//! cargo run --release --example bench -- --list
//! cargo run --release --example bench -- --filter matmul --config fp32_strict --config tf32 --config bf16
//! ```
//!
//! Same workloads and options as `cargo bench --bench workloads` (`speedkit::bench::runner`).

#[path = "../workloads/mod.rs"]
mod workloads;

speedkit::bench_main!(workloads);
