//! speedkit::nn::Mlp on cuBLASLt's epilogues against ATen's composite on the GPU: forward and every
//! gradient (dx, dW1, db1, dW2, db2) under bf16 and fp16 autocast on odd token counts (zero
//! included), a width that must fall back, and a graphed training step equal to the eager one.
//! Each test is skipped, with the reason printed, where no CUDA device is visible.
//!
//! The reference is ATen's composite in fp32 on the inputs and parameters rounded to the autocast
//! type (what both paths actually multiply). Tolerances, ‖got − want‖ ≤ tol · max(‖want‖, 1): bf16
//! 2e-2, fp16 4e-3 — a few units of the type's rounding, since the hidden activation and the
//! gradient between the layers are stored in it. ATen's own autocast composite is held to the same
//! bound, so the test cannot pass by a loose tolerance alone.

mod common;

use common::cuda_or_skip;
use speedkit::config::{AutoBool, DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::{set_mlp_backward_fusion, Mlp, MlpBackwardFusion};
use speedkit::optim::AdamW;
use speedkit::SpeedContext;
use tch::nn;
use tch::{Device, Kind, Tensor};

fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 2e-2,
        _ => 4e-3,
    }
}

fn gap(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size(), "shapes differ");
    let got = got.to_kind(Kind::Double).to_device(Device::Cpu);
    let want = want.to_kind(Kind::Double).to_device(Device::Cpu);
    (&got - &want).norm().double_value(&[]) / want.norm().double_value(&[]).max(1.0)
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    let g = gap(got, want);
    assert!(g <= tol, "{what}: relative gap {g:.3e} > {tol:.0e}");
}

/// No GEMM of the MLP ran on ATen for want of a cuBLASLt algorithm (empty dimensions aside).
fn assert_cublaslt_ran() {
    let notes = speedkit::kernels::fallbacks();
    let missing: Vec<_> = notes
        .iter()
        .filter(|n| n.contains("no algorithm") && !n.contains("empty dimension"))
        .collect();
    assert!(missing.is_empty(), "cuBLASLt fell back: {missing:?}");
}

/// The output and the five gradients of `mlp` at `x` for output gradient `dy`.
fn run(mlp: &Mlp, x: &Tensor, dy: &Tensor, kind: Kind) -> (Tensor, Vec<Tensor>) {
    let x = x.detach().set_requires_grad(true);
    let device = x.device();
    let y = speedkit::amp::autocast(device, kind, || mlp.forward_t(&x))
        .expect("autocast")
        .expect("forward");
    assert_eq!(y.kind(), kind, "the output is in the autocast type");
    (&y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
    let params = [
        &mlp.fc1.ws,
        mlp.fc1.bs.as_ref().unwrap(),
        &mlp.fc2.ws,
        mlp.fc2.bs.as_ref().unwrap(),
    ];
    let mut grads = vec![x.grad()];
    for p in params {
        let g = p.grad();
        assert_eq!(g.kind(), Kind::Float, "master gradients are fp32");
        grads.push(g.detach().copy());
        let _ = p.grad().zero_();
    }
    (y, grads)
}

/// ATen's composite in fp32 on everything rounded to `kind`.
fn reference(mlp: &Mlp, x: &Tensor, dy: &Tensor, kind: Kind) -> (Tensor, Vec<Tensor>) {
    let leaf = |t: &Tensor| {
        t.detach()
            .to_kind(kind)
            .to_kind(Kind::Float)
            .set_requires_grad(true)
    };
    let (b1, b2) = (mlp.fc1.bs.as_ref().unwrap(), mlp.fc2.bs.as_ref().unwrap());
    let leaves = [x, &mlp.fc1.ws, b1, &mlp.fc2.ws, b2].map(leaf);
    let [x, w1, b1, w2, b2] = &leaves;
    let y = x.linear(w1, Some(b1)).gelu("tanh").linear(w2, Some(b2));
    (&y * dy).sum(Kind::Float).backward();
    (y, leaves.iter().map(Tensor::grad).collect())
}

const NAMES: [&str; 6] = ["y", "dx", "dW1", "db1", "dW2", "db2"];

fn compare(shape: &[i64], widths: (i64, i64, i64), kind: Kind, x_kind: Kind, device: Device) {
    let (d_in, hidden, d_out) = widths;
    let vs = nn::VarStore::new(device);
    let mlp = Mlp::new(&vs.root(), d_in, hidden, d_out);
    let mut x_shape = shape.to_vec();
    x_shape.push(d_in);
    let x = Tensor::randn(&x_shape, (x_kind, device));
    let mut y_shape = shape.to_vec();
    y_shape.push(d_out);
    let dy = Tensor::randn(&y_shape, (Kind::Float, device));
    let fused_reason = speedkit::amp::autocast(device, kind, || mlp.fallback_reason(&x)).unwrap();
    assert_eq!(
        fused_reason, None,
        "the fused path takes {shape:?} {widths:?}"
    );
    let (y, grads) = run(&mlp, &x, &dy, kind);
    let (want_y, want) = reference(&mlp, &x, &dy, kind);
    let context = format!("{kind:?} x {x_kind:?} {shape:?} {widths:?}");
    assert_close(&format!("{context} y"), &y, &want_y, tolerance(kind));
    for ((name, got), want) in NAMES[1..].iter().zip(&grads).zip(&want) {
        assert_close(&format!("{context} {name}"), got, want, tolerance(kind));
    }
    // ATen's own autocast composite meets the same bound: the bound is the type's, not slack.
    let before = speedkit::kernels::set_enabled(false);
    let (aten_y, aten_grads) = run(&mlp, &x, &dy, kind);
    speedkit::kernels::set_enabled(before);
    assert_close(
        &format!("{context} ATen y"),
        &aten_y,
        &want_y,
        tolerance(kind),
    );
    for ((name, got), want) in NAMES[1..].iter().zip(&aten_grads).zip(&want) {
        assert_close(
            &format!("{context} ATen {name}"),
            got,
            want,
            tolerance(kind),
        );
    }
}

#[test]
fn fused_mlp_matches_aten_under_bf16_and_fp16_autocast() {
    let Some(device) = cuda_or_skip("fused_mlp_matches_aten_under_bf16_and_fp16_autocast") else {
        return;
    };
    let _serial = common::serial();
    tch::manual_seed(0);
    for kind in [Kind::BFloat16, Kind::Half] {
        for tokens in [0, 1, 7, 333] {
            for widths in [(64, 256, 64), (40, 136, 24), (768, 3072, 768)] {
                compare(&[tokens], widths, kind, Kind::Float, device);
            }
        }
        // 3-d inputs already in the autocast type, as a LayerNorm writes them, one of them empty.
        compare(&[3, 17], (64, 256, 64), kind, kind, device);
        compare(&[2, 0], (64, 256, 64), kind, kind, device);
    }
    assert_cublaslt_ran();
}

#[test]
fn every_backward_fusion_setting_matches_aten() {
    let Some(device) = cuda_or_skip("every_backward_fusion_setting_matches_aten") else {
        return;
    };
    let _serial = common::serial();
    tch::manual_seed(2);
    let all = MlpBackwardFusion::ALL;
    let settings = [
        MlpBackwardFusion::NONE,
        MlpBackwardFusion {
            fp32_weight_grads: false,
            ..all
        },
        MlpBackwardFusion {
            fc2_bias_grad: false,
            ..all
        },
        MlpBackwardFusion {
            fc1_bias_grad: false,
            ..all
        },
        MlpBackwardFusion {
            gelu_grad: false,
            ..all
        },
        all,
    ];
    for setting in settings {
        let before = set_mlp_backward_fusion(setting).unwrap();
        for kind in [Kind::BFloat16, Kind::Half] {
            for tokens in [0, 7, 333] {
                compare(&[tokens], (768, 3072, 768), kind, Kind::Float, device);
            }
        }
        set_mlp_backward_fusion(before).unwrap();
    }
    assert_cublaslt_ran();
}

#[test]
fn an_odd_width_falls_back_to_the_aten_composite_with_a_reason() {
    let Some(device) = cuda_or_skip("an_odd_width_falls_back_to_the_aten_composite_with_a_reason")
    else {
        return;
    };
    let _serial = common::serial();
    let vs = nn::VarStore::new(device);
    let mlp = Mlp::new(&vs.root(), 33, 100, 30);
    let x = Tensor::randn([9, 33], (Kind::Float, device));
    let (y, reason) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        (mlp.forward_t(&x).unwrap(), mlp.fallback_reason(&x))
    })
    .unwrap();
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("multiples of 8")),
        "{reason:?}"
    );
    let want = speedkit::amp::autocast(device, Kind::BFloat16, || {
        x.linear(&mlp.fc1.ws, mlp.fc1.bs.as_ref())
            .gelu("tanh")
            .linear(&mlp.fc2.ws, mlp.fc2.bs.as_ref())
    })
    .unwrap();
    assert!(y.equal(&want), "the fallback is ATen's composite itself");
    assert!(speedkit::kernels::fallbacks()
        .iter()
        .any(|n| n.starts_with("mlp:") && n.contains("multiples of 8")));
}

#[test]
fn a_non_contiguous_input_gives_the_same_result_as_its_contiguous_copy() {
    let Some(device) =
        cuda_or_skip("a_non_contiguous_input_gives_the_same_result_as_its_contiguous_copy")
    else {
        return;
    };
    let _serial = common::serial();
    let vs = nn::VarStore::new(device);
    let mlp = Mlp::new(&vs.root(), 64, 256, 32);
    let strided = Tensor::randn([64, 9], (Kind::Float, device)).transpose(0, 1);
    let (y, y_contiguous) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        assert_eq!(mlp.fallback_reason(&strided), None);
        (
            mlp.forward_t(&strided).unwrap(),
            mlp.forward_t(&strided.contiguous()).unwrap(),
        )
    })
    .unwrap();
    assert!(y.equal(&y_contiguous));
}

/// An MLP regressing a fixed target with bf16 autocast and AdamW, eager or as a captured graph.
fn train(graphed: bool, device: Device, steps: usize) -> (Vec<f64>, Vec<Tensor>) {
    let (batch, width, hidden) = (256, 256, 1024);
    tch::manual_seed(0);
    let x = Tensor::randn([batch, width], (Kind::Float, device));
    let target = Tensor::randn([batch, width], (Kind::Float, device));
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(device);
    let mlp = Mlp::new(&(vs.root() / "mlp"), width, hidden, width);
    let mut config = SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    config.compile.enabled = if graphed { AutoBool::On } else { AutoBool::Off };
    let ctx = SpeedContext::new(&config).unwrap();
    ctx.prepare(&mut vs).unwrap();
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap();
    let step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| {
            let y = mlp.forward_t(&x)?;
            Ok::<_, speedkit::SpeedkitError>(
                (y.to_kind(Kind::Float) - &target)
                    .square()
                    .mean(Kind::Float),
            )
        })?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let losses = common::run_steps(&ctx, step, graphed, steps);
    (losses, common::trained_parameters(&vs))
}

#[test]
fn a_graphed_step_through_the_fused_mlp_equals_the_eager_step() {
    let Some(device) = cuda_or_skip("a_graphed_step_through_the_fused_mlp_equals_the_eager_step")
    else {
        return;
    };
    let _serial = common::serial();
    let (eager_losses, eager) = train(false, device, 30);
    let (_, graphed) = train(true, device, 30);
    assert!(
        eager_losses[29] < eager_losses[0],
        "the loss falls: {eager_losses:?}"
    );
    for (e, g) in eager.iter().zip(&graphed) {
        assert_close("parameter after 30 steps", g, e, 1e-5);
    }
    assert_cublaslt_ran();
}
