// The test harness must be told which crate's workloads to test: an unnamed crate is not linked,
// and its workloads would silently be missing.
speedkit::bench_tests!();
