//! speedkit's AdamW kernel against torch.optim.AdamW's update, with kept bf16 weight copies.

use crate::common::{self, cuda_or_skip};
use crate::support::{assert_close, assert_linear_uses_current_weights, assert_no_fallback};
use speedkit::config::{DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::Linear;
use speedkit::optim::AdamW;
use speedkit::SpeedContext;
use tch::nn;
use tch::{Kind, Tensor};

/// Five AdamW steps (weight decay on) from the same weights and gradients: `with_copies`'s weights
/// have kept bf16 copies (a forward on the kernels made them), so speedkit's AdamW kernel updates
/// them and writes the copies; `without`'s have none, so ATen's `_fused_adamw_` updates them.
/// torch.optim.AdamW's update of `p` for gradient `g`, in fp64, `steps` times with the same
/// gradients as `grads` gives; the reference for speedkit's AdamW kernel.
fn adamw_reference(p: &Tensor, grads: &[Tensor], config: &AdamW) -> Tensor {
    let mut p = p.to_kind(Kind::Double);
    let mut m = p.zeros_like();
    let mut v = p.zeros_like();
    for (step, g) in grads.iter().enumerate() {
        let g = g.to_kind(Kind::Double);
        let t = (step + 1) as i32;
        p = &p * (1.0 - config.lr * config.wd);
        m = &m * config.beta1 + &g * (1.0 - config.beta1);
        v = &v * config.beta2 + &g * &g * (1.0 - config.beta2);
        let step_size = config.lr / (1.0 - config.beta1.powi(t));
        let denom = v.sqrt() / (1.0 - config.beta2.powi(t)).sqrt() + config.eps;
        p -= (&m / denom) * step_size;
    }
    p
}

#[test]
fn adamw_kernel_matches_the_adamw_update_with_and_without_weight_copies() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("adamw_kernel_matches_the_adamw_update_with_and_without_weight_copies")
    else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let config = AdamW {
        lr: 1e-2,
        wd: 0.1,
        ..Default::default()
    };
    // The weight gets a bf16 copy from the forward; the bias, used outside the layer, and the
    // embedding table keep none.
    let vs = nn::VarStore::new(device);
    let layer = Linear::new(&(vs.root() / "fc"), 64, 48, false);
    let bias = vs.root().randn("bias", &[48], 0.0, 1.0);
    let table = vs.root().randn("table", &[100, 64], 0.0, 1.0);
    // As many rows as the layer has outputs: a narrower batch keeps no copy (linear.cpp).
    let x = Tensor::randn([48, 64], (Kind::Float, device));
    let _ = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    let initial: Vec<Tensor> = [&layer.ws, &bias, &table]
        .iter()
        .map(|t| t.copy())
        .collect();
    let mut opt = ctx.adamw(&vs, config.clone()).unwrap();
    let randn = |size: &[i64]| Tensor::randn(size, (Kind::Float, device));
    let grads: Vec<[Tensor; 3]> = (0..5)
        .map(|_| [randn(&[48, 64]), randn(&[48]), randn(&[100, 64])])
        .collect();
    for [dw, db, dt] in &grads {
        opt.zero_grad().unwrap();
        let loss = (&layer.ws * dw).sum(Kind::Float)
            + (&bias * db).sum(Kind::Float)
            + (&table * dt).sum(Kind::Float);
        loss.backward();
        opt.step().unwrap();
    }
    for (i, (param, name)) in [(&layer.ws, "weight"), (&bias, "bias"), (&table, "table")]
        .into_iter()
        .enumerate()
    {
        let own: Vec<Tensor> = grads.iter().map(|g| g[i].shallow_clone()).collect();
        let want = adamw_reference(&initial[i], &own, &config);
        assert_close(&format!("{name} after 5 steps"), param, &want, 1e-6);
    }
    assert_linear_uses_current_weights(&ctx, &layer, &x, "the copies after 5 steps");
    assert_no_fallback();
}

#[test]
fn adamw_writing_the_weight_copies_skips_the_step_the_grad_scaler_finds_inf_in() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("adamw_writing_the_weight_copies_skips_the_step_the_grad_scaler_finds_inf_in")
    else {
        return;
    };
    let ctx = SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Fp16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let vs = nn::VarStore::new(device);
    let fc = Linear::new(&(vs.root() / "fc"), 64, 48, true);
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let x = Tensor::randn([32, 64], (Kind::Float, device));
    let before = fc.ws.copy();
    let overflow = ctx.autocast(|| fc.forward_t(&x).unwrap().sum(Kind::Float) * f64::INFINITY);
    ctx.backward_step(&overflow, &mut opt).unwrap();
    assert!(
        fc.ws.equal(&before),
        "a step with inf gradients changed the weights"
    );
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after the skipped step");
    let loss = ctx.autocast(|| fc.forward_t(&x).unwrap().square().mean(Kind::Float));
    ctx.backward_step(&loss, &mut opt).unwrap();
    assert!(
        !fc.ws.equal(&before),
        "a finite step must change the weights"
    );
    assert_linear_uses_current_weights(&ctx, &fc, &x, "after a finite step");
}
