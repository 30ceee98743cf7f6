//! Where a training step's device memory goes, phase by phase: the model and optimizer, the eager
//! warm-up, the whole-step graph's capture, its replays, and what is left once the model is
//! dropped. `docs/benchmarks/memory_phases.py` prints the same table for PyTorch's whole-step
//! graph (`torch.cuda.graph`) of the same model, so the two can be set side by side.
//!
//! ```text
//! cargo run --release --example memory_phases -- [transformer|mlp_block] [--eager] [--steps N]
//! ```
//!
//! Needs a GPU; on a CPU it says so and exits.

use speedkit::graph::CompiledStep;
use speedkit::memory::{gib, MemoryUse};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use speedkit_suite::data;
use speedkit_suite::models::{MlpBlock, MlpBlockConfig, Transformer, TransformerConfig};
use speedkit_suite::REFERENCE_ADAMW;
use tch::nn::VarStore;
use tch::{Device, Tensor};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or("transformer", String::as_str)
        .to_owned();
    let eager = args.iter().any(|a| a == "--eager");
    let steps = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(10), |n| n.parse::<usize>())?;
    if !tch::Cuda::is_available() {
        println!("memory_phases needs a CUDA device; none is visible");
        return Ok(());
    }
    let device = Device::Cuda(0);
    let mut config = SpeedConfig::auto();
    if eager {
        config.compile.enabled = speedkit::config::AutoBool::Off;
    }
    let ctx = SpeedContext::new(&config)?;
    let mut table = Table::new(device);
    table.row("start")?;
    {
        let vs = VarStore::new(device);
        let (loss, name): (Box<dyn Fn() -> speedkit::Result<Tensor>>, &str) = build(&model, &vs)?;
        table.row(&format!("{name} built"))?;
        let mut opt = ctx.adamw(&vs, AdamW { ..REFERENCE_ADAMW })?;
        let mut step = CompiledStep::new(&ctx, || {
            opt.zero_grad()?;
            let l = ctx.autocast(&loss)?;
            ctx.backward(&l)?;
            ctx.step(&mut opt)?;
            Ok(Some(l))
        });
        for i in 0..steps {
            step.run()?;
            table.row(&format!("step {} ({})", i + 1, phase_of(eager, i)))?;
        }
        for phase in step.memory_phases() {
            println!("phase {}: {}", phase.phase, phase.memory);
        }
    }
    table.row("model, optimizer and step dropped")?;
    let freed = speedkit::memory::release_cached(device)?;
    table.row(&format!("release_cached (gave back {})", gib(freed)))?;
    Ok(())
}

/// The model's loss closure over fixed random data, and its name.
#[allow(clippy::type_complexity)]
fn build(
    model: &str,
    vs: &VarStore,
) -> anyhow::Result<(Box<dyn Fn() -> speedkit::Result<Tensor>>, &'static str)> {
    data::seed();
    let device = vs.device();
    Ok(match model {
        "mlp_block" => {
            let config = MlpBlockConfig::bench();
            let m = MlpBlock::new(&vs.root(), &config);
            let (x, target) = data::regression(config.tokens, config.width, device)?;
            (Box::new(move || m.loss(&x, &target)), "mlp_block")
        }
        _ => {
            let config = TransformerConfig::bench();
            let m = Transformer::new(&vs.root(), &config)?;
            let (tokens, targets) =
                data::tokens(config.batch, config.seq_len, config.vocab, device)?;
            (Box::new(move || m.loss(&tokens, &targets)), "transformer")
        }
    })
}

/// What step `index` is under `auto`'s graphs (three eager warm-up steps, then the capture).
fn phase_of(eager: bool, index: usize) -> &'static str {
    match (eager, index) {
        (true, _) => "eager",
        (false, 0..=2) => "graph warm-up",
        (false, 3) => "capture + first replay",
        (false, _) => "replay",
    }
}

/// One row per moment: allocated, reserved and the pools, in GiB.
struct Table {
    device: Device,
}

impl Table {
    fn new(device: Device) -> Self {
        println!(
            "{:<44} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "moment",
            "alloc",
            "reserved",
            "peak al",
            "peak res",
            "default",
            "graph",
            "frag",
            "copies"
        );
        Self { device }
    }

    fn row(&mut self, moment: &str) -> anyhow::Result<()> {
        tch::Cuda::synchronize(0);
        let m = MemoryUse::now(self.device)?;
        let g = |b: u64| format!("{:.3}", b as f64 / (1u64 << 30) as f64);
        println!(
            "{:<44} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            moment,
            g(m.allocated),
            g(m.reserved),
            g(m.peak_allocated),
            g(m.peak_reserved),
            g(m.default_pool.reserved),
            g(m.graph_pools.reserved),
            g(m.fragmented),
            g(m.weight_copies)
        );
        Ok(())
    }
}
