//! The kernel layer's notes of the drop-in modules on the CPU: each fallback is noted once with its
//! reason and counts its calls, and nothing is noted while the kernels are switched off.
//!
//! The notes are process-wide and the harness runs tests on several threads, so every test here
//! holds `common::serial()`, and the tests that only check numerics live in `nn_modules.rs`: in one
//! binary with them, a module called by another test at the same time would add to these counts.

mod common;

use speedkit::kernels::{KernelNote, KernelOp, NoteMark, Outcome};
use speedkit::nn::{embedding, layer_norm, Linear};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// The one note of `op` falling back for a CPU tensor since `mark`: there must be exactly one, and
/// it counts the calls.
fn cpu_fallback_count(mark: &NoteMark, op: KernelOp) -> u64 {
    let notes: Vec<KernelNote> = mark
        .since()
        .into_iter()
        .filter(|n| {
            n.op == op && matches!(&n.outcome, Outcome::FellBack(r) if r.contains("not on cpu"))
        })
        .collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    notes[0].count
}

#[test]
fn fallbacks_are_noted_once_with_their_reason_and_counted() {
    let _serial = common::serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 8, Default::default());
    let mark = NoteMark::now();
    for _ in 0..3 {
        let _ = ours.forward(&Tensor::randn([2, 8], CPU));
    }
    assert_eq!(cpu_fallback_count(&mark, KernelOp::LayerNorm), 3);
}

#[test]
fn kernels_switched_off_say_so() {
    let _serial = common::serial();
    let before = speedkit::kernels::set_enabled(false);
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 8, Default::default());
    let reason = ours.fallback_reason(&Tensor::randn([2, 8], CPU));
    speedkit::kernels::set_enabled(before);
    assert!(reason.is_some_and(|r| r.contains("kernels: false")));
}

#[test]
fn nothing_is_noted_while_the_kernels_are_switched_off() {
    let _serial = common::serial();
    let before = speedkit::kernels::set_enabled(false);
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 13, Default::default());
    let _ = ours.forward(&Tensor::randn([2, 13], CPU));
    speedkit::kernels::set_enabled(before);
    let notes = speedkit::kernels::fallbacks();
    assert!(
        !notes.iter().any(|n| n.contains("kernels: false")),
        "{notes:?}"
    );
}

#[test]
fn linear_on_the_cpu_says_once_why_it_runs_aten() {
    let _serial = common::serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = Linear::new(&(vs.root() / "fc"), 8, 4, true);
    let mark = NoteMark::now();
    for _ in 0..3 {
        let _ = fc.forward_t(&Tensor::randn([2, 8], CPU)).unwrap();
    }
    assert_eq!(cpu_fallback_count(&mark, KernelOp::Linear), 3);
}

#[test]
fn embedding_on_the_cpu_says_once_why_it_runs_aten() {
    let _serial = common::serial();
    let table = Tensor::randn([10, 4], CPU);
    let tokens = Tensor::from_slice(&[1i64, 2]);
    let mark = NoteMark::now();
    for _ in 0..3 {
        let _ = embedding(&tokens, &table, None).unwrap();
    }
    assert_eq!(cpu_fallback_count(&mark, KernelOp::Embedding), 3);
}
