// The runner must be told which crate's workloads to run: an unnamed crate is not linked, and its
// workloads would silently be missing.
speedkit::bench_main!();
