//! Compile-fail tests of speedkit's macros: each `tests/ui/*.rs` must fail to compile with exactly
//! the diagnostics in its `.stderr` (regenerate with `TRYBUILD=overwrite cargo test --test macro_ui`
//! and review the diff).
//!
//! trybuild checks the cases in a project of its own under `target/tests/trybuild`, whose first
//! run builds the suite's dependencies once more (`cargo check`, with trybuild's rustflags and
//! `--target`, so as units of their own), but in this checkout's build dir (`.cargo/config.toml`),
//! where speedkit's build script finds the C++ shim the suite compiled instead of compiling it again.

#[test]
fn macro_misuse_is_reported_where_it_happens() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
