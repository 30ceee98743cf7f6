//! `speedkit::autograd::summary` against graphs built by hand.

use speedkit::amp::autocast;
use speedkit::autograd::{summary, SdpaBackward};
use tch::{nn, Device, Kind, Tensor};

/// y = (a * b + c).sum() over three parameters, with a fourth that the loss never touches.
fn hand_built() -> (nn::VarStore, Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let a = root.randn("a", &[3], 0.0, 1.0);
    let b = root.randn("b", &[3], 0.0, 1.0);
    let c = root.randn("c", &[3], 0.0, 1.0);
    let _unused = root.randn("unused", &[3], 0.0, 1.0);
    let y = (&a * &b + &c).sum(None);
    (vs, y)
}

#[test]
fn node_counts_match_the_hand_built_graph() {
    let (_vs, y) = hand_built();
    let s = summary(&y).unwrap();
    assert_eq!(s.count("SumBackward0"), 1);
    assert_eq!(s.count("AddBackward0"), 1);
    assert_eq!(s.count("MulBackward0"), 1);
    assert_eq!(s.count("AccumulateGrad"), 3);
    assert_eq!(s.nodes, 6);
    assert_eq!(s.leaves_with_gradient, 3);
    assert_eq!(s.casts, 0);
    assert!(s.attention_backward.is_empty());
}

#[test]
fn parameters_the_loss_never_touches_are_named() {
    let (vs, y) = hand_built();
    let s = summary(&y).unwrap().with_parameters(&vs).unwrap();
    assert_eq!(
        s.parameters_without_gradient,
        Some(vec!["unused".to_string()])
    );
}

#[test]
fn frozen_parameters_are_not_reported_missing() {
    let (mut vs, y) = hand_built();
    vs.freeze();
    let s = summary(&y).unwrap().with_parameters(&vs).unwrap();
    assert_eq!(s.parameters_without_gradient, Some(vec![]));
}

#[test]
fn casts_inserted_by_autocast_are_counted() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().randn("w", &[8, 8], 0.0, 1.0);
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let y = autocast(Device::Cpu, Kind::BFloat16, || x.matmul(&w).sum(None)).unwrap();
    let s = summary(&y).unwrap();
    assert_eq!(s.casts, 1, "the weight's cast to bf16:\n{s}");
}

#[test]
fn the_fused_attention_backward_is_named() {
    let opts = (Kind::Float, Device::Cpu);
    let q = Tensor::randn([2, 4, 16, 8], opts).set_requires_grad(true);
    let k = Tensor::randn([2, 4, 16, 8], opts);
    let v = Tensor::randn([2, 4, 16, 8], opts);
    let out =
        Tensor::scaled_dot_product_attention::<Tensor>(&q, &k, &v, None, 0.0, true, None, false);
    let s = summary(&out.sum(None)).unwrap();
    assert_eq!(
        s.attention_backward,
        vec![(SdpaBackward::FlashCpu, 1)],
        "{s}"
    );
}

#[test]
fn a_tensor_without_a_graph_is_an_error() {
    let t = Tensor::ones([2], (Kind::Float, Device::Cpu));
    let err = summary(&t).unwrap_err();
    assert!(err.to_string().contains("no backward graph"), "{err}");
}
