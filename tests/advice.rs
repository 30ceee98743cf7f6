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

#[test]
fn the_audit_says_which_speedkit_linear_layers_can_run_in_fp8_and_why_not() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _fits = speedkit::nn::Linear::new(&(vs.root() / "fits"), 64, 128, true);
    let _odd = speedkit::nn::Linear::new(&(vs.root() / "odd"), 64, 100, true);
    let _plain = nn::linear(vs.root() / "plain", 64, 64, Default::default());
    let advice = audit(&vs);
    let verdicts: Vec<(&str, bool)> = advice
        .fp8
        .iter()
        .map(|l| (l.layer.as_str(), l.possible))
        .collect();
    assert_eq!(
        verdicts,
        [("fits", true), ("odd", false)],
        "tch's own Linear is not listed"
    );
    assert!(advice.fp8[1].reason.contains("multiple of 16"));
    assert!(advice
        .to_string()
        .contains("fp8: odd stays in the autocast dtype"));
}
