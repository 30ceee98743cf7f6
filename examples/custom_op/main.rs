//! A fused op written as a user would: SwiGLU, `y = silu(a) · b` for `[a | b] = x` (the gated
//! activation of LLaMA-style MLPs), with a forward and a backward CUDA kernel, joined to autograd by
//! a `speedkit::function::Function`, falling back to tch's ops on the CPU, and trained in a small
//! model. Then, on a GPU, it is timed against the tch composite at a transformer's shape, and the
//! host cost of a Rust-defined autograd node is set against its C++ twin.
//!
//! ```text
//! cargo run --release --example custom_op              # train (GPU if there is one), then time
//! cargo run --release --example custom_op -- --steps 300 --rows 16384 --hidden 3072
//! ```
//!
//! The pieces, in the order a reader meets them:
//! 1. `swiglu.rs`, `SOURCE`: the two kernels, templated over the storage type, with one `extern "C"` entry
//!    point per type. Eight elements per thread move as one 16-byte vector (`sk::load8` from
//!    speedkit's `common.cuh`) where the row allows it.
//! 2. `SwiGluKernels`: the module compiled by speedkit for this GPU and its kernels, declared with
//!    their parameters (speedkit checks every launch against the declaration).
//! 3. `SwiGlu`: the autograd `Function`: the forward launches one kernel and saves `x`; the
//!    backward launches the other and returns `dx`.
//! 4. `swiglu`: what the model calls: the fused op on CUDA, tch's composite elsewhere.

mod swiglu;

use std::time::Instant;

use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use swiglu::{swiglu, swiglu_composite};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// A small model: Linear(d, 2h) → SwiGLU → Linear(h, d), with a residual.
struct GatedMlp {
    up: nn::Linear,
    down: nn::Linear,
}

impl GatedMlp {
    fn new(vs: &nn::VarStore, d: i64, hidden: i64) -> Self {
        Self {
            up: nn::linear(vs.root() / "up", d, 2 * hidden, Default::default()),
            down: nn::linear(vs.root() / "down", hidden, d, Default::default()),
        }
    }

    fn forward(&self, x: &Tensor) -> speedkit::Result<Tensor> {
        Ok(x + self.down.forward(&swiglu(&self.up.forward(x))?))
    }
}

fn arg(args: &[String], name: &str, default: i64) -> i64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cuda = tch::Cuda::is_available();
    let device = if cuda { Device::Cuda(0) } else { Device::Cpu };
    let steps = arg(&args, "--steps", if cuda { 200 } else { 60 }) as usize;

    // Train the small model on a fixed teacher, through speedkit's context (autocast, graphs).
    let ctx = SpeedContext::new(&SpeedConfig::auto())?;
    let (d, hidden, batch) = if cuda {
        (512, 1408, 4096)
    } else {
        (32, 88, 256)
    };
    let mut vs = nn::VarStore::new(device);
    let model = GatedMlp::new(&vs, d, hidden);
    ctx.prepare(&mut vs)?;
    let mut opt = ctx.adamw(
        &vs,
        AdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    tch::manual_seed(0);
    let teacher = Tensor::randn([d, d], (Kind::Float, device)) / (d as f64).sqrt();
    let x = Tensor::randn([batch, d], (Kind::Float, device));
    let target = x.matmul(&teacher).tanh();
    let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| -> speedkit::Result<Tensor> {
            Ok((model.forward(&x)? - &target).square().mean(Kind::Float))
        })?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    });
    let mut first = None;
    let mut last = 0.0;
    for i in 0..steps {
        let loss = step.run(&[])?.map_or(f64::NAN, |l| l.double_value(&[]));
        first.get_or_insert(loss);
        last = loss;
        if i % (steps / 5).max(1) == 0 {
            println!("step {i:4}  loss {loss:.5}");
        }
    }
    println!(
        "trained {steps} steps on {device:?} ({}): loss {:.5} -> {last:.5}",
        if step.is_graphed() {
            "one CUDA graph per step"
        } else {
            "eager"
        },
        first.unwrap_or(f64::NAN)
    );
    drop(step);
    host_cost_of_a_rust_node()?;
    if !cuda {
        println!(
            "no GPU: the fused kernels and their timings need one (the CPU ran tch's composite)"
        );
        return Ok(());
    }
    time_against_the_composite(arg(&args, "--rows", 16384), arg(&args, "--hidden", 3072))?;
    Ok(())
}

/// Median milliseconds of `run` on the GPU (CUDA events around each of 50 runs after 10).
fn median_ms(mut run: impl FnMut() -> speedkit::Result<()>) -> speedkit::Result<f64> {
    for _ in 0..10 {
        run()?;
    }
    let mut times = Vec::new();
    for _ in 0..50 {
        tch::Cuda::synchronize(0);
        let start = Instant::now();
        run()?;
        tch::Cuda::synchronize(0);
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Forward + backward of the fused op against tch's composite, bf16, at `rows × 2·hidden`: the
/// gradient of `x` from a given gradient of `y`.
fn time_against_the_composite(rows: i64, hidden: i64) -> speedkit::Result<()> {
    let device = Device::Cuda(0);
    let x = Tensor::randn([rows, 2 * hidden], (Kind::BFloat16, device)).set_requires_grad(true);
    let g = Tensor::randn([rows, hidden], (Kind::BFloat16, device));
    let through = |op: &dyn Fn(&Tensor) -> speedkit::Result<Tensor>| {
        median_ms(|| speedkit::autograd::grad(&[op(&x)?], &[g.shallow_clone()], &[&x]).map(|_| ()))
    };
    let fused = through(&|x| swiglu(x))?;
    let composite = through(&|x| Ok(swiglu_composite(x)))?;
    println!(
        "SwiGLU forward + backward, bf16 [{rows}, 2×{hidden}] on the GPU: fused {fused:.3} ms, tch \
         composite {composite:.3} ms: {:.2}× faster",
        composite / fused
    );
    Ok(())
}

/// Host microseconds per forward + backward of a one-line Rust Function, against its C++ twin.
fn host_cost_of_a_rust_node() -> speedkit::Result<()> {
    struct Scale;
    impl Function for Scale {
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
            grads: &[Option<Tensor>],
        ) -> speedkit::Result<Vec<Option<Tensor>>> {
            Ok(vec![grads[0].as_ref().map(|g| g * 2.0)])
        }
    }
    let x = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let per_call = |f: &dyn Fn() -> speedkit::Result<Tensor>| -> speedkit::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = Instant::now();
            for _ in 0..2000 {
                f()?.sum(Kind::Float).f_backward()?;
            }
            best = best.min(start.elapsed().as_secs_f64() * 1e6 / 2000.0);
        }
        Ok(best)
    };
    let rust = per_call(&|| Ok(apply(Scale, &[&x])?.remove(0)))?;
    let cpp = per_call(&|| speedkit::function::reference_scale(&x, 2.0))?;
    println!(
        "a Rust-defined autograd node, forward + backward on the host: {rust:.2} µs per call against \
         {cpp:.2} µs for its C++ twin: {:+.2} µs",
        rust - cpp
    );
    Ok(())
}
