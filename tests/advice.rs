//! `speedkit::audit`: advice on the user's model.

use speedkit::audit;
use tch::{nn, Device};

#[test]
fn misaligned_linear_dimensions_are_reported_with_the_padded_size() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "proj", 768, 1001, Default::default());
    let a = audit(&vs);
    let w = a
        .warnings
        .iter()
        .find(|w| w.subject == "proj.weight")
        .expect("finding for proj.weight");
    assert!(
        w.problem.contains("1001") && w.fix.contains("1008"),
        "{w:?}"
    );
}

#[test]
fn aligned_large_models_have_no_alignment_findings() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "a", 1024, 2048, Default::default());
    let a = audit(&vs);
    assert!(
        a.warnings.iter().all(|w| !w.problem.contains("multiple")),
        "{a}"
    );
    assert_eq!(a.parameters, 1024 * 2048 + 2048);
}

#[test]
fn small_models_are_told_that_precision_will_not_pay_off() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "a", 64, 64, Default::default());
    assert!(audit(&vs)
        .warnings
        .iter()
        .any(|w| w.problem.contains("kernel launches")));
}

#[test]
fn small_batches_are_flagged() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "a", 1024, 2048, Default::default());
    let a = audit(&vs).with_batch_rows(32);
    assert!(a.warnings.iter().any(|w| w.subject == "batch"), "{a}");
}
