//! Times speedkit's fused MLP (`speedkit::nn::Mlp`, GEMMs on cuBLASLt with bias/GELU epilogues and
//! DGELU/BGRAD in the backward) against ATen's composite `linear → gelu_tanh → linear`, at the
//! `transformer` workload's shape: 16384 tokens, 768 → 3072 → 768, bf16 autocast, fp32 master
//! weights, a bf16 input (what speedkit's LayerNorm writes), on the first CUDA device.
//!
//! cargo run --example mlp_timings
//!
//! Each figure is the median of 50 repetitions after 10 warm-up ones, each timed with CUDA events
//! and followed by a device synchronisation (speedkit's `Bencher` with `paranoid_sync`). The
//! backward is driven by sum(y · dy), whose multiply and sum are in both figures. Also timed: the
//! per-step cast of the fp32 master weights and biases to bf16, which both paths do.

use speedkit::bench::{Bencher, Protocol, Size};
use speedkit::config::{AutoBool, DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::{set_mlp_backward_fusion, Mlp, MlpBackwardFusion};
use speedkit::SpeedContext;
use tch::{nn, Device, Kind, Tensor};

const TOKENS: i64 = 16384;
const WIDTH: i64 = 768;
const HIDDEN: i64 = 3072;

/// The median milliseconds of `step` under the protocol above.
fn median_ms(ctx: &SpeedContext, step: &mut dyn FnMut()) -> anyhow::Result<f64> {
    let protocol = Protocol {
        warmup: 10,
        steps: 50,
        paranoid_sync: true,
    };
    let mut bencher = Bencher::new(Size::Bench, ctx, protocol);
    bencher.run(step)?;
    let m = bencher
        .take_measurement()
        .ok_or_else(|| anyhow::anyhow!("no measurement"))?;
    anyhow::ensure!(m.timer == "cuda-events", "timed with {}", m.timer);
    Ok(m.median_ms)
}

/// `run` timed with speedkit's kernels on and then off (ATen's composite).
fn both(ctx: &SpeedContext, run: &mut dyn FnMut()) -> anyhow::Result<(f64, f64)> {
    let before = speedkit::kernels::set_enabled(true);
    let fused = median_ms(ctx, run);
    speedkit::kernels::set_enabled(false);
    let aten = median_ms(ctx, run);
    speedkit::kernels::set_enabled(before);
    Ok((fused?, aten?))
}

fn main() -> anyhow::Result<()> {
    if !tch::Cuda::is_available() {
        println!("mlp_timings needs a CUDA device");
        return Ok(());
    }
    let device = Device::Cuda(0);
    let mut config = SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: Precision::Bf16,
        ..SpeedConfig::auto()
    };
    config.compile.enabled = AutoBool::Off;
    let ctx = SpeedContext::new(&config)?;
    let vs = nn::VarStore::new(device);
    let mlp = Mlp::new(&(vs.root() / "mlp"), WIDTH, HIDDEN, WIDTH);
    let x = Tensor::randn([TOKENS, WIDTH], (Kind::BFloat16, device)).set_requires_grad(true);
    let dy = Tensor::randn([TOKENS, WIDTH], (Kind::BFloat16, device));
    let reason = ctx.autocast(|| mlp.fallback_reason(&x));
    println!("fused path: {}", reason.as_deref().unwrap_or("taken"));

    let mut fwd_bwd = || {
        let y = ctx.autocast(|| mlp.forward_t(&x)).expect("forward");
        (&y * &dy).sum(Kind::Float).backward();
    };
    let (fused_fb, aten_fb) = both(&ctx, &mut fwd_bwd)?;
    // Each backward epilogue switched off in turn: which of them pay on this GPU.
    let all = MlpBackwardFusion::ALL;
    let settings = [
        ("all epilogues", all),
        (
            "weight grads in bf16 + cast",
            MlpBackwardFusion {
                fp32_weight_grads: false,
                ..all
            },
        ),
        (
            "db2 by ATen sum",
            MlpBackwardFusion {
                fc2_bias_grad: false,
                ..all
            },
        ),
        (
            "DGELU without BGRAD, db1 by ATen sum",
            MlpBackwardFusion {
                fc1_bias_grad: false,
                ..all
            },
        ),
        (
            "no DGELU: ATen gelu_backward + sum",
            MlpBackwardFusion {
                gelu_grad: false,
                ..all
            },
        ),
        (
            "DGELU only, fp32 wgrad",
            MlpBackwardFusion {
                fc2_bias_grad: false,
                fc1_bias_grad: false,
                ..all
            },
        ),
        ("plain cuBLASLt GEMMs, rest ATen", MlpBackwardFusion::NONE),
    ];
    let mut variants = Vec::new();
    for (label, setting) in settings {
        let before = set_mlp_backward_fusion(setting)?;
        let ms = median_ms(&ctx, &mut fwd_bwd);
        set_mlp_backward_fusion(before)?;
        let ms = ms?;
        println!("  fused fwd+bwd, backward {label:<40} {ms:.3} ms");
        variants.push(serde_json::json!({"backward": label, "fwd_bwd_ms": ms}));
    }
    let (fused_f, aten_f) = both(&ctx, &mut || {
        let _ = tch::no_grad(|| ctx.autocast(|| mlp.forward_t(&x)).expect("forward"));
    })?;
    let params = vs.trainable_variables();
    let cast = median_ms(&ctx, &mut || {
        for p in &params {
            let _ = p.to_kind(Kind::BFloat16);
        }
    })?;
    let shape = format!("{TOKENS} × {WIDTH} → {HIDDEN} → {WIDTH}, bf16 autocast");
    println!(
        "MLP fwd+bwd  {shape}: ATen {aten_fb:.3} ms  fused {fused_fb:.3} ms  ({:.2}×)",
        aten_fb / fused_fb
    );
    println!(
        "MLP fwd only {shape}: ATen {aten_f:.3} ms  fused {fused_f:.3} ms  ({:.2}×)",
        aten_f / fused_f
    );
    println!(
        "cast of the fp32 master weights and biases to bf16 (both paths, each step): {cast:.3} ms"
    );
    for note in speedkit::kernels::fallbacks() {
        println!("ATen fallback: {note}");
    }
    let hardware = speedkit::hardware::Hardware::detect()?;
    println!("device: {hardware}");
    println!(
        "{}",
        serde_json::json!({
            "device": hardware.to_string(),
            "shape": shape,
            "protocol": "median of 50 after 10 warm-up, CUDA events, synchronised",
            "fwd_bwd_ms": {"aten": aten_fb, "fused": fused_fb},
            "fwd_ms": {"aten": aten_f, "fused": fused_f},
            "weight_cast_ms": cast,
            "backward_variants": variants,
        })
    );
    Ok(())
}
