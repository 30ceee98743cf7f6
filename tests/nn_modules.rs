//! speedkit::nn's drop-in modules on the ATen path (the CPU, or kernels off) equal tch's own ops,
//! keep tch's parameter names, and handle the shapes the kernels must never get wrong.

mod common;

use speedkit::nn::{cross_entropy, layer_norm};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn same_parameters(vs: &nn::VarStore) -> (nn::VarStore, nn::LayerNorm) {
    let theirs_vs = nn::VarStore::new(Device::Cpu);
    let theirs = nn::layer_norm(theirs_vs.root(), vec![33], Default::default());
    let mut theirs_vs = theirs_vs;
    theirs_vs.copy(vs).expect("same parameter names and shapes");
    (theirs_vs, theirs)
}

#[test]
fn layer_norm_keeps_tch_parameter_names() {
    let ours = nn::VarStore::new(Device::Cpu);
    let _ = layer_norm(ours.root(), 33, Default::default());
    let theirs = nn::VarStore::new(Device::Cpu);
    let _ = nn::layer_norm(theirs.root(), vec![33], Default::default());
    let mut a: Vec<String> = ours.variables().into_keys().collect();
    let mut b: Vec<String> = theirs.variables().into_keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn layer_norm_on_the_cpu_equals_tch_forward_and_backward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    tch::no_grad(|| {
        ours.weight
            .as_ref()
            .unwrap()
            .shallow_clone()
            .copy_(&Tensor::randn([33], CPU))
    });
    let (theirs_vs, theirs) = same_parameters(&vs);
    let x = Tensor::randn([5, 7, 33], CPU).set_requires_grad(true);
    let x2 = x.detach().set_requires_grad(true);
    let (y, y2) = (ours.forward(&x), theirs.forward(&x2));
    assert!(y.equal(&y2));
    y.sum(Kind::Float).backward();
    (y2 * 1.0).sum(Kind::Float).backward();
    assert!(x.grad().allclose(&x2.grad(), 1e-6, 1e-6, false));
    let w2 = &theirs_vs.variables()["weight"];
    assert!(ours
        .weight
        .as_ref()
        .unwrap()
        .grad()
        .allclose(&w2.grad(), 1e-6, 1e-6, false));
}

#[test]
fn residual_layer_norm_on_the_cpu_equals_add_then_layer_norm() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    let (x, r) = (Tensor::randn([4, 33], CPU), Tensor::randn([4, 33], CPU));
    let (y, sum) = ours.forward_residual(&x, &r);
    assert!(sum.equal(&(&x + &r)));
    assert!(y.equal(&ours.forward(&(&x + &r))));
}

#[test]
fn layer_norm_handles_zero_rows_and_non_contiguous_inputs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    assert_eq!(ours.forward(&Tensor::zeros([0, 33], CPU)).size(), [0, 33]);
    let strided = Tensor::randn([33, 6], CPU).transpose(0, 1);
    assert!(ours
        .forward(&strided)
        .equal(&ours.forward(&strided.contiguous())));
}

#[test]
fn cross_entropy_on_the_cpu_equals_tch_with_ignored_rows() {
    let logits = Tensor::randn([6, 1023], CPU).set_requires_grad(true);
    let targets = Tensor::from_slice(&[3i64, -100, 1022, 0, -100, 7]);
    let loss = cross_entropy(&logits, &targets);
    let reference = logits.detach().set_requires_grad(true);
    let want = reference.cross_entropy_for_logits(&targets);
    assert!(loss.equal(&want));
    loss.backward();
    want.backward();
    assert!(logits.grad().equal(&reference.grad()));
}

#[test]
fn fallbacks_are_noted_once_with_their_reason() {
    let _serial = common::serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 8, Default::default());
    for _ in 0..3 {
        let _ = ours.forward(&Tensor::randn([2, 8], CPU));
    }
    let notes = speedkit::kernels::fallbacks();
    let cpu_notes = notes
        .iter()
        .filter(|n| n.starts_with("layer_norm:") && n.contains("Cpu"))
        .count();
    assert_eq!(cpu_notes, 1, "{notes:?}");
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
