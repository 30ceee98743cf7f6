//! speedkit::nn's drop-in modules on the ATen path (the CPU, or kernels off) equal tch's own ops,
//! keep tch's parameter names, and handle the shapes the kernels must never get wrong.

mod common;

use speedkit::nn::{cross_entropy, layer_norm, Mlp};
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
fn mlp_keeps_tch_parameter_names() {
    let ours = nn::VarStore::new(Device::Cpu);
    let _ = Mlp::new(&(ours.root() / "mlp"), 16, 40, 12);
    let theirs = nn::VarStore::new(Device::Cpu);
    let path = theirs.root() / "mlp";
    let _ = nn::linear(&path / "fc1", 16, 40, Default::default());
    let _ = nn::linear(&path / "fc2", 40, 12, Default::default());
    let shapes = |vs: &nn::VarStore| {
        let mut v: Vec<(String, Vec<i64>)> = vs
            .variables()
            .into_iter()
            .map(|(name, t)| (name, t.size()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(shapes(&ours), shapes(&theirs));
    assert!(ours.variables().contains_key("mlp.fc2.bias"));
}

/// The composite the fused path replaces, on separate leaf copies of the same parameters.
fn mlp_reference(mlp: &Mlp, x: &Tensor) -> (Tensor, [Tensor; 5]) {
    let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (b1, b2) = (mlp.fc1.bs.as_ref().unwrap(), mlp.fc2.bs.as_ref().unwrap());
    let leaves = [x, &mlp.fc1.ws, b1, &mlp.fc2.ws, b2].map(leaf);
    let [x, w1, b1, w2, b2] = &leaves;
    let y = x.linear(w1, Some(b1)).gelu("tanh").linear(w2, Some(b2));
    (y, leaves)
}

#[test]
fn mlp_on_the_cpu_equals_the_aten_composite_forward_and_backward() {
    for tokens in [0, 1, 7] {
        let vs = nn::VarStore::new(Device::Cpu);
        let mlp = Mlp::new(&vs.root(), 16, 40, 12);
        let x = Tensor::randn([3, tokens, 16], CPU).set_requires_grad(true);
        let y = mlp.forward_t(&x).unwrap();
        let (want, leaves) = mlp_reference(&mlp, &x);
        assert_eq!(y.size(), [3, tokens, 12]);
        assert!(y.equal(&want));
        let dy = Tensor::randn([3, tokens, 12], CPU);
        (&y * &dy).sum(Kind::Float).backward();
        (&want * &dy).sum(Kind::Float).backward();
        let (b1, b2) = (mlp.fc1.bs.as_ref().unwrap(), mlp.fc2.bs.as_ref().unwrap());
        for (got, reference) in [&x, &mlp.fc1.ws, b1, &mlp.fc2.ws, b2].iter().zip(&leaves) {
            assert!(got.grad().allclose(&reference.grad(), 1e-6, 1e-6, false));
        }
    }
}

#[test]
fn mlp_on_the_cpu_says_why_it_is_not_fused_and_rejects_a_wrong_width() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mlp = Mlp::new(&vs.root(), 16, 40, 12);
    let why = mlp.fallback_reason(&Tensor::zeros([2, 16], CPU));
    assert!(why.is_some_and(|w| w.contains("CUDA") || w.contains("kernels: false")));
    let err = mlp.forward_t(&Tensor::zeros([2, 15], CPU));
    assert!(err.is_err());
}
