//! Compile-fail tests of speedkit's macros: each `tests/ui/*.rs` must fail to compile with exactly
//! the diagnostics in its `.stderr` (regenerate with `TRYBUILD=overwrite cargo test --test macro_ui`
//! and review the diff).

#[test]
fn macro_misuse_is_reported_where_it_happens() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
