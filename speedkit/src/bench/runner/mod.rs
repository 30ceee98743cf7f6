//! The benchmark runner behind [`bench_main!`](crate::bench_main).
//!
//! ```text
//! cargo bench --bench workloads -- [--list] [--filter PAT]... [--exact] [--config NAME|FILE]... [--size tiny|bench]
//!     [--steps N] [--warmup N] [--paranoid-sync|--no-paranoid-sync] [--json FILE] [--csv FILE] [--svg FILE]
//!     [--save-baseline NAME] [--baseline NAME|FILE [--noise-threshold PCT] [--fail-above PCT]]
//!     [--peer pytorch [--python PATH]] [--profile [STEPS]] [--fusion-plan]
//! ```
//! Configurations run side by side in one process (comparisons are only valid within one run); the
//! first is the one the speedup column divides by. `--config` takes a preset (`fp32_strict`,
//! `tf32`, `auto`), `bf16`/`fp16` (auto with that precision), or a YAML/JSON file.
//!
//! `--save-baseline`/`--baseline` keep a run and judge a later one against it
//! ([`baseline`](super::baseline)); `--peer pytorch` times the same workloads in PyTorch in the
//! same run ([`peer`](super::peer)). Exit status: 0, 1 when a workload failed or a row is slower
//! than the baseline beyond `--fail-above`, 2 for bad input (including no workload to run).
//!
//! Under `speedkit launch --nproc-per-node N -- <runner>` (or torchrun) every rank runs every
//! workload data-parallel, and rank 0 alone prints and writes files: each row then carries every
//! rank's median ([`DataParallelRow`]) and the throughput per GPU and in total.
//!
//! `--batch N` builds the workloads that take a batch ([`Bencher::batch`](crate::bench::Bencher::batch))
//! at N; `--largest-batch` instead searches the largest batch each of them trains at under each
//! config, and with `--peer pytorch` PyTorch's in `reduce-overhead` mode (`largest`:
//! [`LargestBatchReport`], [`search_largest`]).
//!
//! Its parts: the command line (`cli`: [`main`], [`Args`], [`resolve_config`]), the run loop
//! (`run`: [`run_with`], [`main_with`], [`exit_status`]), what a run produces (`report`:
//! [`RunReport`], [`Row`]) and its rendering (`output`: [`render_text`], [`render_csv`],
//! [`render_svg`], the files of `--json`/`--csv`/`--svg`/`--save-baseline`, the progress bars).
//! All of it comes with speedkit's `runner` feature.

mod cli;
mod largest;
mod output;
mod report;
mod run;

pub use cli::{main, resolve_config, Args, NamedConfig};
pub use largest::{largest_batches, search_largest, Attempt, LargestBatch, LargestBatchReport};
pub use output::{render_csv, render_svg, render_text};
pub use report::{DataParallelRow, Row, RunReport, REPORT_SCHEMA_VERSION};
pub use run::{exit_status, main_with, measure_matmul_peak, run, run_with, select};
