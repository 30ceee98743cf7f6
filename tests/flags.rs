//! The flag registry and FlagGuard: every flag round-trips through the shim, and the guard restores
//! on return, on `?`, during a panic, and when nested.

mod common;

use speedkit::config::MatmulPrecision;
use speedkit::flags::{
    Flag, FlagGuard, FlagKind, FlagSetting, FlagState, FlagValue, Fp32Precision,
};
use speedkit::SpeedkitError;
use speedkit::{SpeedConfig, SpeedContext};

fn flipped(flag: Flag) -> FlagValue {
    match flag.get().expect("read flag") {
        FlagValue::Bool(b) => FlagValue::Bool(!b),
        FlagValue::MatmulPrecision(MatmulPrecision::Highest) => {
            FlagValue::MatmulPrecision(MatmulPrecision::Medium)
        }
        FlagValue::MatmulPrecision(_) => FlagValue::MatmulPrecision(MatmulPrecision::Highest),
        FlagValue::Fp32Precision(Fp32Precision::None | Fp32Precision::Ieee) => {
            FlagValue::Fp32Precision(Fp32Precision::Tf32)
        }
        FlagValue::Fp32Precision(_) => FlagValue::Fp32Precision(Fp32Precision::Ieee),
    }
}

fn every_flag_flipped() -> Vec<FlagSetting> {
    Flag::all()
        .into_iter()
        .filter(|f| !f.is_view()) // allow_tf32 reads the CUDA matmul entry
        .map(|f| FlagSetting::new(f, flipped(f), "test"))
        .collect()
}

#[test]
fn every_flag_round_trips_through_the_shim() {
    let _lock = common::serial();
    // PyTorch's setters cannot put back a `none` entry; an empty guard restores it raw at the end.
    let _restore_raw = FlagGuard::apply(&[]).unwrap();
    for flag in Flag::all() {
        let original = flag.get().unwrap();
        let other = flipped(flag);
        flag.set(other).unwrap();
        assert_eq!(flag.get().unwrap(), other, "{flag} did not take {other}");
        flag.set(original).unwrap();
        assert_eq!(
            flag.get().unwrap(),
            original,
            "{flag} did not go back to {original}"
        );
    }
}

#[test]
fn matmul_precision_takes_all_three_values() {
    let _lock = common::serial();
    let original = Flag::Float32MatmulPrecision.get().unwrap();
    for p in [
        MatmulPrecision::Medium,
        MatmulPrecision::High,
        MatmulPrecision::Highest,
    ] {
        Flag::Float32MatmulPrecision
            .set(FlagValue::MatmulPrecision(p))
            .unwrap();
        assert_eq!(
            Flag::Float32MatmulPrecision.get().unwrap(),
            FlagValue::MatmulPrecision(p)
        );
    }
    Flag::Float32MatmulPrecision.set(original).unwrap();
    assert_eq!(
        Flag::Float32MatmulPrecision.kind(),
        FlagKind::MatmulPrecision
    );
}

#[test]
fn high_matmul_precision_also_reads_back_as_allow_tf32() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let guard = FlagGuard::apply(&[FlagSetting::new(
        Flag::Float32MatmulPrecision,
        FlagValue::MatmulPrecision(MatmulPrecision::High),
        "test",
    )])
    .unwrap();
    assert_eq!(
        Flag::CudaMatmulAllowTf32.get().unwrap(),
        FlagValue::Bool(true)
    );
    // The coupled flag is in the audit, marked as a consequence.
    if before.get(Flag::CudaMatmulAllowTf32) == Some(FlagValue::Bool(false)) {
        let side = guard
            .changes()
            .iter()
            .find(|c| c.flag == Flag::CudaMatmulAllowTf32)
            .expect("coupled change recorded");
        assert!(side.reason.contains("follows from"));
    }
    drop(guard);
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn guard_restores_every_flag_on_drop() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    {
        let guard = FlagGuard::apply(&every_flag_flipped()).unwrap();
        assert!(!FlagState::capture().unwrap().diff(&before).is_empty());
        let changed = guard.changes().iter().filter(|c| c.changed()).count();
        assert!(changed >= 12, "only {changed} flags changed");
    }
    assert_eq!(FlagState::capture().unwrap(), before);
}

fn apply_then_fail() -> Result<(), SpeedkitError> {
    let _guard = FlagGuard::apply(&every_flag_flipped())?;
    Err(SpeedkitError::Misuse("early exit".into()))?;
    unreachable!()
}

#[test]
fn guard_restores_on_early_return_through_question_mark() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    assert!(apply_then_fail().is_err());
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn guard_restores_during_panic_unwinding() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let result = std::panic::catch_unwind(|| {
        let _guard = FlagGuard::apply(&every_flag_flipped()).unwrap();
        panic!("training blew up");
    });
    assert!(result.is_err());
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn nested_guards_each_restore_what_they_found() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let outer_value = flipped(Flag::CudnnBenchmark);
    let outer =
        FlagGuard::apply(&[FlagSetting::new(Flag::CudnnBenchmark, outer_value, "outer")]).unwrap();
    let middle = FlagState::capture().unwrap();
    {
        let _inner = FlagGuard::apply(&[
            FlagSetting::new(Flag::CudnnBenchmark, flipped(Flag::CudnnBenchmark), "inner"),
            FlagSetting::new(Flag::SdpMath, flipped(Flag::SdpMath), "inner"),
        ])
        .unwrap();
        assert_ne!(FlagState::capture().unwrap(), middle);
    }
    assert_eq!(
        FlagState::capture().unwrap(),
        middle,
        "inner guard restores the outer guard's state"
    );
    assert_eq!(Flag::CudnnBenchmark.get().unwrap(), outer_value);
    drop(outer);
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn explicit_restore_reports_the_state_read_back() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let guard = FlagGuard::apply(&every_flag_flipped()).unwrap();
    assert_eq!(guard.state_before(), &before);
    let after = guard.restore().unwrap();
    assert_eq!(after, before);
}

#[test]
fn a_wrongly_typed_setting_fails_and_changes_nothing() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let settings = vec![
        FlagSetting::new(Flag::SdpFlash, flipped(Flag::SdpFlash), "applied first"),
        FlagSetting::new(
            Flag::CudnnBenchmark,
            FlagValue::MatmulPrecision(MatmulPrecision::High),
            "wrong type",
        ),
    ];
    let err = FlagGuard::apply(&settings).unwrap_err();
    assert!(
        err.to_string().contains("torch.backends.cudnn.benchmark"),
        "{err}"
    );
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn audit_trail_serialises_to_json_with_pytorch_names() {
    let _lock = common::serial();
    let guard = FlagGuard::apply(&[FlagSetting::new(
        Flag::CudnnBenchmark,
        flipped(Flag::CudnnBenchmark),
        "autotune",
    )])
    .unwrap();
    let json = serde_json::to_value(guard.changes()).unwrap();
    assert_eq!(json[0]["name"], "torch.backends.cudnn.benchmark");
    assert_eq!(json[0]["reason"], "autotune");
    assert_ne!(json[0]["before"], json[0]["after"]);
}

/// What `torch.backends.cuda.matmul.allow_tf32 = True` after `set_float32_matmul_precision("medium")`
/// leaves behind in libtorch 2.11: the legacy field says `high`, oneDNN's matmul entry still says
/// `bf16`, and PyTorch's checked getter refuses to read the matmul precision at all.
fn mix_legacy_and_new_precision_apis() {
    Flag::Float32MatmulPrecision
        .set(FlagValue::MatmulPrecision(MatmulPrecision::Medium))
        .unwrap();
    Flag::CudaMatmulAllowTf32
        .set(FlagValue::Bool(true))
        .unwrap();
}

#[test]
fn a_mix_of_legacy_and_new_precision_apis_is_read_without_error() {
    let _lock = common::serial();
    let _restore_raw = FlagGuard::apply(&[]).unwrap();
    mix_legacy_and_new_precision_apis();
    let state = FlagState::capture().expect("capture survives the mix");
    assert_eq!(
        state.get(Flag::Float32MatmulPrecision),
        Some(FlagValue::MatmulPrecision(MatmulPrecision::High))
    );
    assert_eq!(
        state.get(Flag::MkldnnMatmulFp32Precision),
        Some(FlagValue::Fp32Precision(Fp32Precision::Bf16))
    );
}

#[test]
fn a_mixed_precision_state_is_restored_exactly_after_a_guard() {
    let _lock = common::serial();
    let _restore_raw = FlagGuard::apply(&[]).unwrap();
    mix_legacy_and_new_precision_apis();
    let mixed = FlagState::capture().unwrap();
    let guard = FlagGuard::apply(&[FlagSetting::new(
        Flag::Float32MatmulPrecision,
        FlagValue::MatmulPrecision(MatmulPrecision::Highest),
        "test",
    )])
    .unwrap();
    assert_ne!(FlagState::capture().unwrap(), mixed);
    drop(guard);
    assert_eq!(FlagState::capture().unwrap(), mixed);
}

#[test]
fn medium_matmul_precision_applies_restores_and_leaves_the_process_usable() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let config =
        SpeedConfig::from_yaml_str("device: cpu\ntf32_matmul_precision: medium\n").unwrap();
    {
        let ctx = SpeedContext::new(&config).expect("a context with `medium`");
        assert_eq!(
            Flag::Float32MatmulPrecision.get().unwrap(),
            FlagValue::MatmulPrecision(MatmulPrecision::Medium)
        );
        let x = tch::Tensor::randn([8, 8], (tch::Kind::Float, ctx.device()));
        assert_eq!(
            x.matmul(&x).size(),
            [8, 8],
            "matmuls still run under `medium`"
        );
    }
    assert_eq!(FlagState::capture().unwrap(), before);
    let next = SpeedContext::new(&SpeedConfig::auto()).expect("the next context still works");
    drop(next);
    assert_eq!(FlagState::capture().unwrap(), before);
}
