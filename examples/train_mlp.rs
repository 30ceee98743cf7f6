//! Integrating speedkit into an existing tch training loop: the same MLP trained twice, first with
//! plain tch, then with the three speedkit lines added (marked `// speedkit:`). Nothing else
//! changes: the model, tch's own AdamW, the data and the loop stay as they were.
//!
//! ```text
//! cargo run --release --example train_mlp
//! cargo run --release --example train_mlp -- --steps 200 --config examples/configs/baseline.yaml
//! ```
//!
//! The three lines:
//! 1. read a speed config (`SpeedConfig::from_yaml`, or `SpeedConfig::auto()`);
//! 2. `apply_speedups(&mut vs, &config)`: detect the hardware, plan, set the flags (restored when
//!    `ctx` drops), move the parameters to the plan's device;
//! 3. run the forward pass under `ctx.autocast(..)` and replace `opt.backward_step(&loss)` by
//!    `ctx.backward_step(&loss, &mut opt)`, which scales the loss when the plan uses fp16.
//!
//! On a CPU the plan keeps fp32, so both runs print the same losses; on a GPU the second one
//! trains in bf16 autocast with TF32, and its losses differ in the last digits.

use clap::Parser;
use speedkit::{apply_speedups, SpeedConfig};
use std::path::PathBuf;
use std::time::Instant;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "The same MLP training loop without and with speedkit")]
struct Args {
    /// Training steps of each run.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Print the loss every N steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// The speed config of the second run.
    #[arg(long, value_name = "FILE", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/configs/speed.yaml"))]
    config: PathBuf,
}

/// The model of the `mlp` workload, written as a tch user would.
fn mlp(p: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(p / "fc1", 512, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "fc2", 1024, 10, Default::default()))
}

/// The batch of the `mlp` workload: 256 random inputs with random labels in 0..10 (which the
/// network learns by heart), the same in both runs.
fn dataset(device: Device) -> (Tensor, Tensor) {
    tch::manual_seed(0);
    let x = Tensor::randn([256, 512], (Kind::Float, device));
    let y = Tensor::randint(10, [256], (Kind::Int64, device));
    (x, y)
}

/// Before: a plain tch training loop.
fn train_plain(args: &Args) -> anyhow::Result<Trace> {
    let device = Device::cuda_if_available();
    let (x, y) = dataset(device);
    let vs = nn::VarStore::new(device);
    let net = mlp(&vs.root());
    let mut opt = nn::AdamW::default().build(&vs, 1e-4)?;
    let mut losses = Vec::new();
    let start = Instant::now();
    for step in 1..=args.steps {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
        if step % args.log_every == 0 {
            losses.push((step, loss.double_value(&[])));
        }
    }
    Ok(Trace {
        losses,
        ms_per_step: ms_since(start, args.steps),
    })
}

/// After: the same loop with speedkit.
fn train_speedkit(args: &Args) -> anyhow::Result<Trace> {
    let device = Device::cuda_if_available();
    let (x, y) = dataset(device);
    let mut vs = nn::VarStore::new(device);
    let net = mlp(&vs.root());
    let config = SpeedConfig::from_yaml(&args.config)?; // speedkit: 1/3 the speed config
    let ctx = apply_speedups(&mut vs, &config)?; // speedkit: 2/3 detect, plan, set flags, place parameters
    let mut opt = nn::AdamW::default().build(&vs, 1e-4)?;
    let mut losses = Vec::new();
    let start = Instant::now();
    for step in 1..=args.steps {
        let loss = ctx.autocast(|| net.forward(&x).cross_entropy_for_logits(&y)); // speedkit: 3/3 forward under autocast
        ctx.backward_step(&loss, &mut opt)?; // speedkit: 3/3 (scaled) backward + step
        if step % args.log_every == 0 {
            losses.push((step, loss.double_value(&[])));
        }
    }
    let ms_per_step = ms_since(start, args.steps);
    println!("{}", ctx.audit());
    Ok(Trace {
        losses,
        ms_per_step,
    })
}

/// Losses at the log steps and the mean wall-clock time of a step (the loop only, loss reads
/// included).
struct Trace {
    losses: Vec<(usize, f64)>,
    ms_per_step: f64,
}

fn ms_since(start: Instant, steps: usize) -> f64 {
    start.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.log_every > 0, "--log-every must be at least 1");
    let plain = train_plain(&args)?;
    let fast = train_speedkit(&args)?;

    println!("\n  step  loss (plain tch)  loss (with speedkit)");
    for ((step, a), (_, b)) in plain.losses.iter().zip(&fast.losses) {
        println!("  {step:>4}  {a:>16.4}  {b:>20.4}");
    }
    println!(
        "\n  {:.2} ms/step plain, {:.2} ms/step with speedkit (wall clock of the loop; a speed comparison needs \
         `cargo run --release --example benchmark_compare -- --workload mlp`)",
        plain.ms_per_step, fast.ms_per_step
    );
    Ok(())
}
