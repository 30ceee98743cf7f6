//! Autograd functions written in Rust (`speedkit::function`): gradients against finite differences
//! in fp64 and against the composite they replace, and each of PyTorch's `Function` rules — saved
//! tensors, `None` gradients, non-differentiable outputs, an input used twice, no-grad mode —
//! plus errors and panics in either direction coming back as errors.

mod common;

use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedkitError};
use tch::{nn, Device, Kind, Tensor};

const F64: (Kind, Device) = (Kind::Double, Device::Cpu);

/// y = x · sin(w) + x², with its gradient written by hand: two inputs, saved tensors.
struct SinScale;

impl Function for SinScale {
    fn forward(
        &mut self,
        ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        let (x, w) = (&inputs[0], &inputs[1]);
        ctx.save_for_backward(&[x, w])?;
        Ok(vec![x * w.sin() + x * x])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        let saved = ctx.saved()?;
        let (x, w) = (&saved[0], &saved[1]);
        let g = grads[0].as_ref().expect("materialized");
        let dx = g * (w.sin() + x * 2.0);
        let dw = (g * x * w.cos()).sum_to_size(w.size());
        Ok(vec![Some(dx), Some(dw)])
    }
}

fn composite(x: &Tensor, w: &Tensor) -> Tensor {
    x * w.sin() + x * x
}

/// The gradient of `f`'s sum with respect to `at`, by central differences.
fn finite_differences(f: impl Fn(&Tensor) -> Tensor, at: &Tensor) -> Tensor {
    let eps = 1e-6;
    let flat = at.detach().flatten(0, -1);
    let grad = Tensor::zeros_like(&flat);
    for i in 0..flat.numel() as i64 {
        let plus = flat.copy();
        let _ = plus.get(i).g_add_scalar_(eps);
        let minus = flat.copy();
        let _ = minus.get(i).g_add_scalar_(-eps);
        let delta =
            f(&plus.view_as(at)).sum(Kind::Double) - f(&minus.view_as(at)).sum(Kind::Double);
        let _ = grad.get(i).fill_(delta.double_value(&[]) / (2.0 * eps));
    }
    grad.view_as(at)
}

#[test]
fn gradients_equal_finite_differences_in_fp64() {
    let x = Tensor::randn([3, 5], F64).set_requires_grad(true);
    let w = Tensor::randn([5], F64).set_requires_grad(true);
    let y = apply(SinScale, &[&x, &w]).unwrap().remove(0);
    y.sum(Kind::Double).backward();
    let dx = finite_differences(|x| composite(x, &w.detach()), &x);
    let dw = finite_differences(|w| composite(&x.detach(), w), &w);
    assert!(
        x.grad().allclose(&dx, 1e-6, 1e-6, false),
        "{}",
        x.grad() - dx
    );
    assert!(w.grad().allclose(&dw, 1e-6, 1e-6, false));
}

#[test]
fn forward_and_gradients_equal_the_composite() {
    let x = Tensor::randn([4, 7], F64).set_requires_grad(true);
    let w = Tensor::randn([7], F64).set_requires_grad(true);
    let (x2, w2) = (
        x.detach().set_requires_grad(true),
        w.detach().set_requires_grad(true),
    );
    let ours = apply(SinScale, &[&x, &w]).unwrap().remove(0);
    let theirs = composite(&x2, &w2);
    assert!(ours.allclose(&theirs, 1e-12, 1e-12, false));
    let g = Tensor::randn([4, 7], F64);
    (&ours * &g).sum(Kind::Double).backward();
    (&theirs * &g).sum(Kind::Double).backward();
    assert!(x.grad().allclose(&x2.grad(), 1e-12, 1e-12, false));
    assert!(w.grad().allclose(&w2.grad(), 1e-12, 1e-12, false));
}

/// The gradient of `y`'s sum with respect to `x`, itself differentiable (create_graph).
fn differentiable_gradient(y: &Tensor, x: &Tensor) -> Tensor {
    Tensor::f_run_backward(&[y.sum(Kind::Double)], &[x], true, true)
        .unwrap()
        .remove(0)
}

#[test]
fn a_second_derivative_goes_through_a_backward_written_with_tch_ops() {
    let x = Tensor::randn([3, 5], F64).set_requires_grad(true);
    let w = Tensor::randn([5], F64).set_requires_grad(true);
    let (x2, w2) = (
        x.detach().set_requires_grad(true),
        w.detach().set_requires_grad(true),
    );
    let ours = differentiable_gradient(&apply(SinScale, &[&x, &w]).unwrap()[0], &x);
    let theirs = differentiable_gradient(&composite(&x2, &w2), &x2);
    ours.square().sum(Kind::Double).backward();
    theirs.square().sum(Kind::Double).backward();
    assert!(x.grad().allclose(&x2.grad(), 1e-12, 1e-12, false));
    assert!(w.grad().allclose(&w2.grad(), 1e-12, 1e-12, false));
}

/// SinScale, declared differentiable once.
struct OnceSinScale;

impl Function for OnceSinScale {
    fn once_differentiable(&self) -> bool {
        true
    }
    fn forward(
        &mut self,
        ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        SinScale.forward(ctx, inputs)
    }
    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        SinScale.backward(ctx, grads)
    }
}

#[test]
fn a_second_derivative_through_a_once_differentiable_function_is_an_error_naming_it() {
    let x = Tensor::randn([3, 5], F64).set_requires_grad(true);
    let w = Tensor::randn([5], F64).set_requires_grad(true);
    let gradient = differentiable_gradient(&apply(OnceSinScale, &[&x, &w]).unwrap()[0], &x);
    let expected = w.detach().sin() + x.detach() * 2.0;
    assert!(gradient.detach().allclose(&expected, 1e-12, 1e-12, false));
    let err = gradient
        .sum(Kind::Double)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("OnceSinScale is differentiable once"), "{err}");
}

#[test]
fn a_once_differentiable_function_trains_as_any_other_without_create_graph() {
    let x = Tensor::randn([3, 5], F64).set_requires_grad(true);
    let w = Tensor::randn([5], F64).set_requires_grad(true);
    let y = apply(OnceSinScale, &[&x, &w]).unwrap().remove(0);
    y.sum(Kind::Double).backward();
    let expected = w.detach().sin() + x.detach() * 2.0;
    assert!(x.grad().allclose(&expected, 1e-12, 1e-12, false));
    assert!(!x.grad().requires_grad());
}

#[test]
fn an_input_changed_in_place_after_saving_is_an_error_at_backward() {
    let x = Tensor::randn([3], F64).set_requires_grad(true);
    let w = Tensor::randn([3], F64);
    let y = apply(SinScale, &[&x, &w]).unwrap().remove(0);
    tch::no_grad(|| {
        let _ = w.shallow_clone().g_add_scalar_(1.0);
    });
    let err = y.sum(Kind::Double).f_backward().unwrap_err().to_string();
    assert!(err.contains("modified by an inplace operation"), "{err}");
}

/// out = x · k for an integer k, whose gradient is `None`; also returns argmax(x), marked
/// non-differentiable.
struct ScaleByInt;

impl Function for ScaleByInt {
    fn forward(
        &mut self,
        ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        let (x, k) = (&inputs[0], &inputs[1]);
        ctx.save_for_backward(&[k])?;
        let index = x.argmax(None, false);
        ctx.mark_non_differentiable(&[&index])?;
        Ok(vec![x * k, index])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        assert!(
            !ctx.needs_input_grad(1)?,
            "an integer input needs no gradient"
        );
        let k = &ctx.saved()?[0];
        Ok(vec![grads[0].as_ref().map(|g| g * k), None])
    }
}

#[test]
fn an_integer_input_gets_none_and_a_marked_output_carries_no_gradient() {
    let x = Tensor::randn([4], F64).set_requires_grad(true);
    let k = Tensor::from(3i64);
    let mut out = apply(ScaleByInt, &[&x, &k]).unwrap();
    let index = out.remove(1);
    assert!(!index.requires_grad());
    out[0].sum(Kind::Double).backward();
    assert_eq!(Vec::<f64>::try_from(x.grad()).unwrap(), [3.0; 4]);
}

/// Returns (x, 2x); backward reports which gradients it got.
struct TwoOutputs {
    materialize: bool,
}

impl Function for TwoOutputs {
    fn forward(
        &mut self,
        ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        ctx.set_materialize_grads(self.materialize)?;
        Ok(vec![inputs[0].copy(), &inputs[0] * 2.0])
    }

    fn backward(
        &mut self,
        _ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        let first = match &grads[0] {
            Some(g) => g.shallow_clone(),
            None => Tensor::full([1], -100.0, F64),
        };
        let second = grads[1].as_ref().map(|g| g * 2.0);
        Ok(vec![Some(match second {
            Some(s) => first + s,
            None => first,
        })])
    }
}

#[test]
fn an_unused_output_gets_zeros_by_default_and_none_when_asked() {
    let x = Tensor::ones([1], F64).set_requires_grad(true);
    apply(TwoOutputs { materialize: true }, &[&x]).unwrap()[1]
        .sum(Kind::Double)
        .backward();
    assert_eq!(
        x.grad().double_value(&[0]),
        2.0,
        "zeros for the unused output, plus 2"
    );
    let y = Tensor::ones([1], F64).set_requires_grad(true);
    apply(TwoOutputs { materialize: false }, &[&y]).unwrap()[1]
        .sum(Kind::Double)
        .backward();
    assert_eq!(
        y.grad().double_value(&[0]),
        -98.0,
        "None for the unused output"
    );
}

#[test]
fn an_input_used_twice_gets_both_gradients() {
    let x = Tensor::randn([5], F64).set_requires_grad(true);
    let y = apply(SinScale, &[&x, &x]).unwrap().remove(0);
    y.sum(Kind::Double).backward();
    let expected = finite_differences(|x| composite(x, x), &x);
    assert!(x.grad().allclose(&expected, 1e-6, 1e-6, false));
}

#[test]
fn in_no_grad_mode_the_forward_runs_and_no_node_is_recorded() {
    let x = Tensor::randn([3], F64).set_requires_grad(true);
    let w = Tensor::randn([3], F64);
    let y = tch::no_grad(|| apply(SinScale, &[&x, &w]).unwrap().remove(0));
    assert!(!y.requires_grad());
    assert!(y.allclose(&composite(&x.detach(), &w), 1e-12, 1e-12, false));
}

/// A function whose backward or forward panics, on request.
struct Panics {
    in_forward: bool,
}

impl Function for Panics {
    fn forward(
        &mut self,
        _ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        assert!(!self.in_forward, "the forward gave up");
        Ok(vec![&inputs[0] * 1.0])
    }

    fn backward(
        &mut self,
        _ctx: &mut BackwardContext<'_>,
        _grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        panic!("the backward gave up")
    }
}

#[test]
fn a_panicking_forward_is_an_error_from_apply() {
    let x = Tensor::ones([2], F64).set_requires_grad(true);
    let err = apply(Panics { in_forward: true }, &[&x])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("forward panicked") && err.contains("the forward gave up"),
        "{err}"
    );
}

#[test]
fn a_panicking_backward_is_an_error_at_backward_step() {
    let _serial = common::serial();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[3]);
    let ctx = speedkit::apply_speedups(
        &mut vs,
        &SpeedConfig::from_yaml_str("device: cpu\n").unwrap(),
    )
    .unwrap();
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let loss = apply(Panics { in_forward: false }, &[&w]).unwrap()[0].sum(Kind::Float);
    let err = ctx.backward_step(&loss, &mut opt).unwrap_err();
    assert!(matches!(err, SpeedkitError::Torch(_)), "{err}");
    assert!(err.to_string().contains("the backward gave up"), "{err}");
}

/// Returns an error from its backward instead of panicking.
struct Fails;

impl Function for Fails {
    fn forward(
        &mut self,
        _ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        Ok(vec![&inputs[0] * 1.0])
    }

    fn backward(
        &mut self,
        _ctx: &mut BackwardContext<'_>,
        _grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        Err(SpeedkitError::Misuse("no gradient today".into()))
    }
}

#[test]
fn an_error_from_the_backward_names_itself() {
    let x = Tensor::ones([2], F64).set_requires_grad(true);
    let y = apply(Fails, &[&x]).unwrap().remove(0);
    let err = y.sum(Kind::Double).f_backward().unwrap_err().to_string();
    assert!(err.contains("backward: no gradient today"), "{err}");
}

#[test]
fn a_backward_with_the_wrong_number_of_gradients_is_an_error() {
    struct TooMany;
    impl Function for TooMany {
        fn forward(
            &mut self,
            _: &mut ForwardContext<'_>,
            inputs: &[Tensor],
        ) -> speedkit::Result<Vec<Tensor>> {
            Ok(vec![&inputs[0] * 1.0])
        }
        fn backward(
            &mut self,
            _: &mut BackwardContext<'_>,
            g: &[Option<Tensor>],
        ) -> speedkit::Result<Vec<Option<Tensor>>> {
            Ok(vec![
                g[0].as_ref().map(Tensor::shallow_clone),
                g[0].as_ref().map(Tensor::shallow_clone),
            ])
        }
    }
    let x = Tensor::ones([2], F64).set_requires_grad(true);
    let y = apply(TooMany, &[&x]).unwrap().remove(0);
    let err = y.sum(Kind::Double).f_backward().unwrap_err().to_string();
    assert!(err.contains("incorrect number of gradients"), "{err}");
}

#[test]
fn the_function_is_dropped_with_its_node() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    impl Function for Counted {
        fn forward(
            &mut self,
            _: &mut ForwardContext<'_>,
            inputs: &[Tensor],
        ) -> speedkit::Result<Vec<Tensor>> {
            Ok(vec![&inputs[0] * 2.0])
        }
        fn backward(
            &mut self,
            _: &mut BackwardContext<'_>,
            g: &[Option<Tensor>],
        ) -> speedkit::Result<Vec<Option<Tensor>>> {
            Ok(vec![g[0].as_ref().map(|g| g * 2.0)])
        }
    }
    let drops = Arc::new(AtomicUsize::new(0));
    let x = Tensor::ones([2], F64).set_requires_grad(true);
    let y = apply(Counted(Arc::clone(&drops)), &[&x]).unwrap().remove(0);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "alive while the graph holds its node"
    );
    drop(y);
    assert_eq!(drops.load(Ordering::SeqCst), 1, "freed with the node");
}

/// What `may_overwrite` said in ExpInPlace's backward, run by `backward`, which hands back x's
/// gradient; the gradient is checked against exp(x) whatever it said.
fn may_overwrite_after(backward: impl FnOnce(&Tensor, Tensor) -> Tensor) -> bool {
    let said = std::sync::Arc::new(std::sync::Mutex::new(None));
    let x = Tensor::from_slice(&[0.0f64, 1.0, -2.0]).set_requires_grad(true);
    let y = apply(common::ExpInPlace(std::sync::Arc::clone(&said)), &[&x])
        .unwrap()
        .remove(0);
    let dx = backward(&x, y);
    assert!(common::rel_err(&dx, &x.detach().exp()) < 1e-12);
    let said = said.lock().unwrap().expect("the backward ran");
    said
}

#[test]
fn may_overwrite_holds_for_a_saved_alias_nobody_else_holds() {
    assert!(may_overwrite_after(|x, y| {
        let loss = y.sum(Kind::Double);
        drop(y);
        loss.backward();
        x.grad()
    }));
}

#[test]
fn may_overwrite_is_false_while_the_user_holds_the_output() {
    assert!(!may_overwrite_after(|x, y| {
        y.sum(Kind::Double).backward();
        // The gradient was not written over y, which is still alive.
        assert!(common::rel_err(&y, &x.detach().exp()) < 1e-12);
        x.grad()
    }));
}

#[test]
fn may_overwrite_is_false_when_the_graph_is_kept_for_another_backward() {
    assert!(!may_overwrite_after(|x, y| {
        let loss = y.sum(Kind::Double);
        drop(y);
        Tensor::run_backward(&[&loss], &[x], true, false).remove(0)
    }));
}
