//! FP8 `speedkit::nn::Linear` on a GPU with FP8 Tensor Cores (SM >= 8.9), against the same layer in
//! bf16. Skipped, with the reason printed, elsewhere.
//!
//! Tolerances: e4m3 keeps 3 mantissa bits (relative rounding up to 1/16) and e5m2 2 bits (1/8); a
//! GEMM over K products averages much of that out, so outputs land within a few percent of bf16's.
//! Stated per test below.

mod common;

use speedkit::nn::Linear;
use speedkit::{SpeedConfig, SpeedContext};
use tch::{nn, Device, Kind, Tensor};

fn fp8_context(test: &str, recipe: &str) -> Option<SpeedContext> {
    let device = common::cuda_or_skip(test)?;
    let config = SpeedConfig::from_yaml_str(&format!(
        "device: cuda\nfp8:\n  enabled: true\n  recipe: {recipe}\n  amax_history: 4\n"
    ))
    .unwrap();
    match SpeedContext::new(&config) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            eprintln!("skipped {test} on {device:?}: {e}");
            None
        }
    }
}

/// (output, dX, dW, db) of `layer` on `x` inside `ctx`'s forward scope.
fn run(ctx: &SpeedContext, layer: &Linear, x: &Tensor, dy: &Tensor) -> [Tensor; 4] {
    for p in [&layer.ws, layer.bs.as_ref().unwrap()] {
        p.grad().defined().then(|| p.grad().zero_());
    }
    let x = x.detach().set_requires_grad(true);
    let y = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    (&y * dy).sum(Kind::Float).backward();
    [
        y.detach().to_kind(Kind::Float),
        x.grad().to_kind(Kind::Float),
        layer.ws.grad().copy(),
        layer.bs.as_ref().unwrap().grad().copy(),
    ]
}

#[test]
fn fp8_linear_matches_bf16_forward_and_backward() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("fp8_linear_matches_bf16_forward_and_backward", "dynamic") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 768, 1040, true);
    let x = Tensor::randn([4, 96, 768], (Kind::BFloat16, Device::Cuda(0)));
    let dy = Tensor::randn([4, 96, 1040], (Kind::BFloat16, Device::Cuda(0)));
    let fp8 = run(&ctx, &layer, &x, &dy);
    drop(ctx);
    let bf16_ctx = SpeedContext::new(
        &SpeedConfig::from_yaml_str("device: cuda\nfp8: {enabled: false}\n").unwrap(),
    )
    .unwrap();
    let bf16 = run(&bf16_ctx, &layer, &x, &dy);
    // Forward and dX within 8%, dW within 10% (e5m2 gradients), db exact up to bf16 summation.
    for (what, a, b, tol) in [
        ("y", &fp8[0], &bf16[0], 0.08),
        ("dX", &fp8[1], &bf16[1], 0.10),
        ("dW", &fp8[2], &bf16[2], 0.10),
        ("db", &fp8[3], &bf16[3], 0.01),
    ] {
        let err = common::rel_err(a, b);
        assert!(err < tol, "{what}: relative error {err:.4} >= {tol}");
        assert!(
            err > 0.0 || what == "db",
            "{what}: identical to bf16, so FP8 did not run"
        );
    }
}

#[test]
fn a_huge_activation_saturates_instead_of_producing_nan_under_delayed_scaling() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("a_huge_activation_saturates", "delayed") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 256, 256, true);
    let dy = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0)));
    for scale in [1.0, 1.0, 1.0, 1e4] {
        let x = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0))) * scale;
        let [y, dx, dw, db] = run(&ctx, &layer, &x, &dy);
        for (what, t) in [("y", y), ("dX", dx), ("dW", dw), ("db", db)] {
            let finite = t.isfinite().all().int64_value(&[]) == 1;
            assert!(
                finite,
                "{what} not finite with an activation {scale}× the history"
            );
        }
    }
}

#[test]
fn the_amax_history_is_saved_and_loaded_with_the_checkpoint() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("the_amax_history_is_saved_and_loaded", "delayed") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 128, 128, true);
    let x = Tensor::randn([32, 128], (Kind::BFloat16, Device::Cuda(0)));
    let dy = Tensor::randn([32, 128], (Kind::BFloat16, Device::Cuda(0)));
    let _ = run(&ctx, &layer, &x, &dy);
    let history = vs.variables()["fc.fp8_amax_history"].copy();
    assert!(
        history.abs().sum(Kind::Float).double_value(&[]) > 0.0,
        "history recorded"
    );
    let file =
        std::env::temp_dir().join(format!("speedkit-fp8-{}.safetensors", std::process::id()));
    vs.save(&file).unwrap();
    let mut restored = nn::VarStore::new(Device::Cuda(0));
    let _twin = Linear::new(&(restored.root() / "fc"), 128, 128, true);
    restored.load(&file).unwrap();
    std::fs::remove_file(&file).ok();
    assert!(restored.variables()["fc.fp8_amax_history"].equal(&history));
}

#[test]
fn the_audit_says_which_layers_ran_in_fp8_and_why_not() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("the_audit_says_which_layers_ran_in_fp8", "dynamic") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let wide = Linear::new(&(vs.root() / "wide"), 256, 512, true);
    let odd = Linear::new(&(vs.root() / "odd"), 512, 1000, true);
    let x = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0)));
    let y = ctx
        .autocast(|| odd.forward_t(&wide.forward_t(&x)?))
        .unwrap();
    assert_eq!(y.size(), [64, 1000]);
    let notes = ctx.audit().notes;
    assert!(
        notes.iter().any(|n| n.contains("layer wide runs in FP8")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("layer odd stays") && n.contains("multiple of 16")),
        "{notes:?}"
    );
}
