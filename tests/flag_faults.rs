//! A flag write that fails — as a libtorch setter that throws would — never leaves a flag changed:
//! not while applying, not while rolling back a failed apply, not while restoring. Each test makes
//! one write fail through the shim's fault injection and checks every flag afterwards.

mod common;

use speedkit::config::MatmulPrecision;
use speedkit::flags::{
    inject_write_fault, Flag, FlagGuard, FlagSetting, FlagState, FlagValue, Fp32Precision,
};

/// Every flag that has storage of its own, set away from its current value.
fn every_flag_changed() -> Vec<FlagSetting> {
    Flag::all()
        .into_iter()
        .filter(|f| !f.is_view())
        .map(|flag| {
            let value = match flag.get().unwrap() {
                FlagValue::Bool(b) => FlagValue::Bool(!b),
                FlagValue::MatmulPrecision(MatmulPrecision::Highest) => {
                    FlagValue::MatmulPrecision(MatmulPrecision::High)
                }
                FlagValue::MatmulPrecision(_) => {
                    FlagValue::MatmulPrecision(MatmulPrecision::Highest)
                }
                FlagValue::Fp32Precision(Fp32Precision::Tf32) => {
                    FlagValue::Fp32Precision(Fp32Precision::Ieee)
                }
                FlagValue::Fp32Precision(_) => FlagValue::Fp32Precision(Fp32Precision::Tf32),
            };
            FlagSetting::new(flag, value, "fault test")
        })
        .collect()
}

/// Turns fault injection off however the test ends.
struct FaultOff;
impl Drop for FaultOff {
    fn drop(&mut self) {
        inject_write_fault(0);
    }
}

#[test]
fn each_failing_write_during_apply_leaves_every_flag_as_before() {
    let _lock = common::serial();
    let _off = FaultOff;
    let settings = every_flag_changed();
    let before = FlagState::capture().unwrap();
    for n in 1..=settings.len() as u32 {
        inject_write_fault(n);
        let err = FlagGuard::apply(&settings).expect_err("the n-th write fails");
        assert!(
            err.to_string().contains("injected fault"),
            "write {n}: {err}"
        );
        assert_eq!(
            FlagState::capture().unwrap(),
            before,
            "after failing write {n}"
        );
    }
}

#[test]
fn a_failing_write_during_rollback_is_retried_and_every_flag_comes_back() {
    let _lock = common::serial();
    let _off = FaultOff;
    let before = FlagState::capture().unwrap();
    // Three writes: two that work, then one that libtorch itself refuses (CUDA has no bf16 fp32
    // precision). The fourth write is the rollback's first, and it is made to fail too.
    let settings = [
        FlagSetting::new(
            Flag::CudnnBenchmark,
            FlagValue::Bool(!bool_of(Flag::CudnnBenchmark)),
            "a",
        ),
        FlagSetting::new(Flag::SdpMath, FlagValue::Bool(!bool_of(Flag::SdpMath)), "b"),
        FlagSetting::new(
            Flag::CudaMatmulFp32Precision,
            FlagValue::Fp32Precision(Fp32Precision::Bf16),
            "refused by libtorch",
        ),
    ];
    inject_write_fault(4);
    let err = FlagGuard::apply(&settings).expect_err("libtorch refuses bf16 for CUDA");
    assert!(err.to_string().contains("bf16"), "{err}");
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn each_failing_write_during_restore_is_retried_and_every_flag_comes_back() {
    let _lock = common::serial();
    let _off = FaultOff;
    let settings = every_flag_changed();
    let before = FlagState::capture().unwrap();
    for n in 1..=settings.len() as u32 {
        let guard = FlagGuard::apply(&settings).unwrap();
        inject_write_fault(n);
        let restored = guard.restore().expect("a single failed write is retried");
        assert_eq!(restored, before, "after failing restore write {n}");
        assert_eq!(FlagState::capture().unwrap(), before);
    }
}

#[test]
fn a_failing_write_while_dropping_during_a_panic_still_restores() {
    let _lock = common::serial();
    let _off = FaultOff;
    let settings = every_flag_changed();
    let before = FlagState::capture().unwrap();
    let result = std::panic::catch_unwind(|| {
        let _guard = FlagGuard::apply(&settings).unwrap();
        inject_write_fault(1);
        panic!("training blew up");
    });
    assert!(result.is_err());
    assert_eq!(FlagState::capture().unwrap(), before);
}

fn bool_of(flag: Flag) -> bool {
    flag.get().unwrap().as_bool().unwrap()
}
