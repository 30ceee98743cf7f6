//! Times speedkit's fused kernels against ATen's composites at the `transformer` workload's shapes
//! (32 × 512 tokens, d 768, vocabulary 8192), forward + backward, on the first CUDA device.
//!
//! cargo run --release --example kernel_timings
//!
//! Each figure is the median over 30 timed repetitions (after 5 warm-up ones) of one forward and
//! backward, with a device synchronisation around each repetition. The LayerNorm backward is driven
//! by sum(y · dy), whose multiply and sum are in both figures; so are the Linear layers'.

use std::time::Instant;

use speedkit::nn::{cross_entropy, layer_norm, Linear};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const ROWS: i64 = 32 * 512;
const WIDTH: i64 = 768;
const VOCAB: i64 = 8192;

fn median_ms(mut run: impl FnMut()) -> f64 {
    for _ in 0..5 {
        run();
    }
    let mut times: Vec<f64> = (0..30)
        .map(|_| {
            tch::Cuda::synchronize(0);
            let start = Instant::now();
            run();
            tch::Cuda::synchronize(0);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn both(label: &str, run: &mut dyn FnMut(bool)) {
    speedkit::kernels::set_enabled(true);
    let fused = median_ms(|| run(true));
    speedkit::kernels::set_enabled(false);
    let aten = median_ms(|| run(false));
    speedkit::kernels::set_enabled(true);
    println!(
        "{label:<58} ATen {aten:7.3} ms   speedkit {fused:7.3} ms   ({:.2}×)",
        aten / fused
    );
}

fn main() -> anyhow::Result<()> {
    if !tch::Cuda::is_available() {
        println!("kernel_timings needs a CUDA device");
        return Ok(());
    }
    let device = Device::Cuda(0);
    if let Some(why) = speedkit::kernels::unavailable_reason(device)? {
        println!("speedkit's kernels cannot run here: {why}");
        return Ok(());
    }
    let vs = nn::VarStore::new(device);
    let norm = layer_norm(vs.root(), WIDTH, Default::default());
    let x = Tensor::randn([ROWS, WIDTH], (Kind::Float, device)).set_requires_grad(true);
    let residual = Tensor::randn([ROWS, WIDTH], (Kind::Float, device)).set_requires_grad(true);
    let dy = Tensor::randn([ROWS, WIDTH], (Kind::BFloat16, device));
    let bf16 = |f: &mut dyn FnMut()| speedkit::amp::autocast(device, Kind::BFloat16, f).map(|_| ());

    both("LayerNorm fwd+bwd, fp32 in, bf16 autocast", &mut |_| {
        let mut y = None;
        bf16(&mut || y = Some(norm.forward(&x))).expect("autocast");
        let y = y.expect("ran");
        (&y * dy.to_kind(y.kind())).sum(Kind::Float).backward();
    });
    both(
        "residual add + LayerNorm fwd+bwd, fp32 in, bf16 autocast",
        &mut |_| {
            let mut out = None;
            bf16(&mut || out = Some(norm.forward_residual(&x, &residual))).expect("autocast");
            let (y, _) = out.expect("ran");
            (&y * dy.to_kind(y.kind())).sum(Kind::Float).backward();
        },
    );
    let logits = Tensor::randn([ROWS, VOCAB], (Kind::BFloat16, device)).set_requires_grad(true);
    let targets = Tensor::randint(VOCAB, [ROWS], (Kind::Int64, device));
    both(
        "cross-entropy fwd+bwd, bf16 logits 16384 × 8192",
        &mut |_| {
            cross_entropy(&logits, &targets).backward();
        },
    );
    let tokens = Tensor::randn([ROWS, WIDTH], (Kind::BFloat16, device)).set_requires_grad(true);
    for (label, inputs, outputs) in [
        (
            "Linear fwd+bwd 768 → 2304 (qkv), fp32 weights, bf16 autocast",
            WIDTH,
            3 * WIDTH,
        ),
        (
            "Linear fwd+bwd 3072 → 768 (fc2), fp32 weights, bf16 autocast",
            4 * WIDTH,
            WIDTH,
        ),
    ] {
        let layer = Linear::new(&(vs.root() / label), inputs, outputs, true);
        let input = if inputs == WIDTH {
            tokens.shallow_clone()
        } else {
            Tensor::randn([ROWS, inputs], (Kind::BFloat16, device)).set_requires_grad(true)
        };
        let grad = Tensor::randn([ROWS, outputs], (Kind::BFloat16, device));
        both(label, &mut |_| {
            let mut y = None;
            bf16(&mut || y = Some(layer.forward(&input))).expect("autocast");
            (y.expect("ran") * &grad).sum(Kind::Float).backward();
        });
    }
    let fc1 = Linear::new(&(vs.root() / "fc1"), WIDTH, 4 * WIDTH, true);
    let grad = Tensor::randn([ROWS, 4 * WIDTH], (Kind::BFloat16, device));
    both(
        "Linear 768 → 3072 + bias + GELU fwd+bwd (fc1), bf16 autocast",
        &mut |_| {
            let mut y = None;
            bf16(&mut || y = Some(fc1.forward_gelu(&tokens).expect("forward_gelu")))
                .expect("autocast");
            (y.expect("ran") * &grad).sum(Kind::Float).backward();
        },
    );
    for note in speedkit::kernels::fallbacks() {
        println!("ATen fallback: {note}");
    }
    println!("device: {}", speedkit::hardware::Hardware::detect()?);
    Ok(())
}
