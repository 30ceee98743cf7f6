//! Where FP8 starts to pay: one `speedkit::nn::Linear` (with bias), forward and backward (dX, dW,
//! db), timed in bf16 and in FP8 (delayed, dynamic and row-wise scaling) over GEMM shapes from a small
//! transformer's to `mlp_block`'s, each step captured as a CUDA graph as training runs it. Prints
//! each shape's times and the smallest GEMM (tokens × in × out) from which FP8 is faster at every
//! larger shape measured: what `fp8.min_gemm_size` is chosen from. Needs a GPU with FP8 Tensor
//! Cores (SM 8.9+).
//!
//! ```text
//! cargo run --release --example fp8_crossover
//! ```
//!
//! Each figure is the median of 7 rounds of 20 replays (after the graph's warm-up and capture),
//! divided by 20. The backward is driven by sum(y · dy), whose multiply and sum are in every
//! figure.

use std::time::Instant;

use anyhow::Context;
use speedkit::nn::Linear;
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// Token counts and (in, out) widths; every combination is measured.
const TOKENS: [i64; 4] = [512, 2048, 4096, 16384];
const WIDTHS: [(i64, i64); 9] = [
    (768, 768),
    (768, 2304),
    (768, 3072),
    (3072, 768),
    (1024, 4096),
    (2048, 2048),
    (4096, 4096),
    (8192, 8192),
    (4096, 16384),
];

/// The configurations compared: bf16 GEMMs, then FP8 under each recipe.
const CONFIGS: [(&str, &str); 4] = [
    ("bf16", "fp8: {enabled: false}"),
    ("delayed", "fp8: {enabled: true, recipe: delayed}"),
    ("dynamic", "fp8: {enabled: true, recipe: dynamic}"),
    ("rowwise", "fp8: {enabled: true, recipe: rowwise}"),
];

fn main() -> anyhow::Result<()> {
    anyhow::ensure!(tch::Cuda::is_available(), "fp8_crossover needs a CUDA GPU");
    let mut shapes: Vec<(i64, i64, i64)> = TOKENS
        .iter()
        .flat_map(|&t| WIDTHS.iter().map(move |&(i, o)| (t, i, o)))
        .collect();
    shapes.sort_by_key(|&(t, i, o)| t * i * o);
    let mut header = format!(
        "  {:<28} {:>9}  {:>9}",
        "GEMM (tokens × in × out)", "size", "bf16 µs"
    );
    for (name, _) in &CONFIGS[1..] {
        header += &format!("   {:>9}  (speed-up)", format!("{name} µs"));
    }
    println!("{header}");
    let mut speedups = vec![Vec::new(); CONFIGS.len() - 1];
    for &(tokens, input, output) in &shapes {
        let times: Vec<f64> = CONFIGS
            .iter()
            .map(|(_, yaml)| time_layer(yaml, tokens, input, output))
            .collect::<anyhow::Result<_>>()?;
        let size = tokens * input * output;
        let mut line = format!(
            "  {:<28} {size:>9.2e}  {:>9.1}",
            format!("{tokens} × {input} × {output}"),
            times[0]
        );
        for (k, t) in times[1..].iter().enumerate() {
            line += &format!("   {t:>9.1}  ({:.2}×)", times[0] / t);
            speedups[k].push((size, times[0] / t));
        }
        println!("{line}");
    }
    for (k, (name, _)) in CONFIGS[1..].iter().enumerate() {
        match crossover(&speedups[k]) {
            Some(size) => println!(
                "fp8 {name}: faster than bf16 at every GEMM measured from {size} ({size:.2e}) up"
            ),
            None => println!("fp8 {name}: slower than bf16 at the largest GEMM measured"),
        }
    }
    Ok(())
}

/// The smallest measured size above every size at which some shape was not faster in FP8 (shapes
/// of equal size can differ: few tokens make the weight's cast relatively dear).
fn crossover(speedups: &[(i64, f64)]) -> Option<i64> {
    let largest_loss = speedups
        .iter()
        .filter(|&&(_, s)| s <= 1.0)
        .map(|&(size, _)| size)
        .max();
    speedups
        .iter()
        .map(|&(size, _)| size)
        .filter(|&size| largest_loss.is_none_or(|loss| size > loss))
        .min()
}

/// Microseconds of one forward and backward of a `input → output` layer on `tokens` rows under the
/// config's `fp8` section.
fn time_layer(fp8_yaml: &str, tokens: i64, input: i64, output: i64) -> anyhow::Result<f64> {
    let config = SpeedConfig::from_yaml_str(&format!(
        "device: cuda\nprecision: bf16\ncompile: {{enabled: true}}\n{fp8_yaml}\n"
    ))?;
    let ctx = SpeedContext::new(&config).context(fp8_yaml.to_owned())?;
    let device = Device::Cuda(0);
    tch::manual_seed(0);
    let vs = VarStore::new(device);
    let layer = Linear::new(&(vs.root() / "fc"), input, output, true);
    let x = Tensor::randn([tokens, input], (Kind::BFloat16, device)).set_requires_grad(true);
    let dy = Tensor::randn([tokens, output], (Kind::BFloat16, device));
    let bias = layer.bs.as_ref().context("the layer has a bias")?;
    let mut step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let y = ctx.autocast(|| layer.forward_t(&x))?;
        let loss = (y * &dy).f_sum(Kind::Float)?;
        // Gradients returned, not accumulated into .grad: one layer's backward and nothing else.
        let _grads = Tensor::f_run_backward(&[&loss], &[&x, &layer.ws, bias], false, false)?;
        Ok(Some(loss))
    };
    let mut graphed = ctx.graphed(&mut step);
    for _ in 0..10 {
        graphed.run(&[])?;
    }
    anyhow::ensure!(
        graphed.is_graphed(),
        "the step was not captured: {:?}",
        graphed.fallback_reason()
    );
    let mut rounds = Vec::new();
    for _ in 0..7 {
        tch::Cuda::synchronize(0);
        let start = Instant::now();
        for _ in 0..20 {
            graphed.run(&[])?;
        }
        tch::Cuda::synchronize(0);
        rounds.push(start.elapsed().as_secs_f64() * 1e6 / 20.0);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[rounds.len() / 2])
}
