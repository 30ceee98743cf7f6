//! PyTorch's flags are process-wide. speedkit keeps a record of the active guards (and so of the
//! active contexts), so the thread rule cannot be broken silently: guards dropped out of order leave
//! exactly the flags of those that remain, and a second thread that would change flags under another
//! thread's guard is refused, with an error that says why.

mod common;

use std::sync::mpsc;
use std::thread;

use speedkit::flags::{Flag, FlagGuard, FlagSetting, FlagState, FlagValue};
use speedkit::{SpeedConfig, SpeedContext, SpeedkitError};

fn flip(flag: Flag) -> FlagSetting {
    let now = flag.get().unwrap().as_bool().unwrap();
    FlagSetting::new(flag, FlagValue::Bool(!now), "thread rule test")
}

#[test]
fn a_guard_dropped_out_of_order_leaves_the_flags_of_the_guard_that_remains() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let outer = FlagGuard::apply(&[flip(Flag::CudnnBenchmark)]).unwrap();
    let benchmark = Flag::CudnnBenchmark.get().unwrap();
    let inner = FlagGuard::apply(&[flip(Flag::SdpMath)]).unwrap();
    let math = Flag::SdpMath.get().unwrap();

    drop(outer);
    assert_eq!(
        Flag::CudnnBenchmark.get().unwrap(),
        before.get(Flag::CudnnBenchmark).unwrap()
    );
    assert_eq!(
        Flag::SdpMath.get().unwrap(),
        math,
        "the inner guard's flag stays"
    );
    assert_ne!(benchmark, before.get(Flag::CudnnBenchmark).unwrap());

    drop(inner);
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn a_guard_on_another_thread_that_would_change_flags_is_refused_and_changes_nothing() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let (held, release, done) = hold_guard_on_thread("trainer", vec![flip(Flag::CudnnBenchmark)]);
    held.recv().unwrap();
    let during = FlagState::capture().unwrap();

    let err = FlagGuard::apply(&[flip(Flag::SdpMath)]).unwrap_err();
    assert!(matches!(err, SpeedkitError::ThreadConflict(_)), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("'trainer'"),
        "names the other thread: {message}"
    );
    assert!(
        message.contains("torch.backends.cuda.math_sdp_enabled()"),
        "{message}"
    );
    assert_eq!(
        FlagState::capture().unwrap(),
        during,
        "the refused guard changed nothing"
    );

    release.send(()).unwrap();
    done.join().unwrap();
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn a_guard_on_another_thread_with_the_same_settings_is_allowed_and_flags_last_until_both_drop() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let settings = vec![flip(Flag::CudnnBenchmark)];
    let applied = settings[0].value;
    let (held, release, done) = hold_guard_on_thread("trainer", settings.clone());
    held.recv().unwrap();

    let mine = FlagGuard::apply(&settings).expect("the same settings change nothing");
    release.send(()).unwrap();
    done.join().unwrap();
    assert_eq!(
        Flag::CudnnBenchmark.get().unwrap(),
        applied,
        "still in force while this thread's guard lives"
    );
    drop(mine);
    assert_eq!(FlagState::capture().unwrap(), before);
}

#[test]
fn a_context_with_another_plan_on_another_thread_is_refused() {
    let _lock = common::serial();
    let before = FlagState::capture().unwrap();
    let (held, release, done) = hold_guard_on_thread("trainer", vec![flip(Flag::CudnnBenchmark)]);
    held.recv().unwrap();

    let deterministic = SpeedConfig::from_yaml_str("device: cpu\ndeterministic: true\n").unwrap();
    let err = SpeedContext::new(&deterministic).unwrap_err();
    assert!(matches!(err, SpeedkitError::ThreadConflict(_)), "{err}");
    assert!(err.to_string().contains("process-wide"), "{err}");

    release.send(()).unwrap();
    done.join().unwrap();
    assert_eq!(FlagState::capture().unwrap(), before);
}

/// Starts a thread named `name` that applies `settings`, signals, and holds the guard until released.
fn hold_guard_on_thread(
    name: &str,
    settings: Vec<FlagSetting>,
) -> (mpsc::Receiver<()>, mpsc::Sender<()>, thread::JoinHandle<()>) {
    let (held_tx, held_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let handle = thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _guard = FlagGuard::apply(&settings).unwrap();
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        })
        .unwrap();
    (held_rx, release_tx, handle)
}

#[test]
fn a_context_with_the_other_kernels_setting_on_another_thread_is_refused() {
    let _lock = common::serial();
    // On the CPU a plan can only turn the kernels off, so the other thread turns them on.
    let kernels_before = speedkit::kernels::set_enabled(false);
    let before = FlagState::capture().unwrap();
    let kernels_on = FlagSetting::new(
        speedkit::kernels::flag(),
        FlagValue::Bool(true),
        "thread rule test",
    );
    let (held, release, done) = hold_guard_on_thread("trainer", vec![kernels_on]);
    held.recv().unwrap();

    let config = SpeedConfig::from_yaml_str("device: cpu\nkernels: false\n").unwrap();
    let err = SpeedContext::new(&config).unwrap_err();

    release.send(()).unwrap();
    done.join().unwrap();
    assert_eq!(FlagState::capture().unwrap(), before);
    speedkit::kernels::set_enabled(kernels_before);
    assert!(matches!(err, SpeedkitError::ThreadConflict(_)), "{err}");
    assert!(err.to_string().contains("speedkit.kernels"), "{err}");
}
