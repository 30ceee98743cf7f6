//! `cargo bench --bench workloads -- [--filter PAT] [--config NAME|FILE]... [--size tiny|bench] ...`
//!
//! Runs the registered workloads of `workloads/` under several configurations in one process
//! (`fp32_strict` and `auto` unless `--config` says otherwise); see `speedkit::bench::runner` for
//! every option.

#[path = "../workloads/mod.rs"]
mod workloads;

speedkit::bench_main!(workloads);
