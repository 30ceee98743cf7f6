//! The tiny model, its data, optimizer and config: the same in every rank and in the reference.

use speedkit::config::{DeviceChoice, DistributedBackend, SpeedConfig};
use speedkit::optim::AdamW;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Rows of one step over all ranks, and of one step of the one-process reference: however many
/// ranks share it, they train on the same global batch.
pub const GLOBAL_BATCH: i64 = 16;
pub const STEPS: i64 = 6;
/// Ranks, where a test does not say otherwise.
pub const WORLD: i64 = 2;

/// The rows of `step`'s global batch that `rank` of `world` ranks trains on.
pub fn rows_of(t: &Tensor, step: i64, rank: i64, world: i64) -> Tensor {
    let per_rank = GLOBAL_BATCH / world;
    t.narrow(0, step * GLOBAL_BATCH + rank * per_rank, per_rank)
}

pub fn config(bucket_mb: u32) -> SpeedConfig {
    let mut c = SpeedConfig::auto();
    c.device = DeviceChoice::Cpu;
    c.distributed.backend = DistributedBackend::Gloo;
    c.distributed.timeout_s = 30;
    // Small buckets: the tiny model's gradients travel in several all-reduces.
    c.distributed.bucket_mb = bucket_mb;
    // Replicas compared after every step: equal training must never trip the check.
    c.distributed.check_replicas_every = 1;
    c
}

/// Hidden width: l1's weight is exactly 1 MiB, so with 1 MiB buckets it is a bucket of its own
/// (all-reduced in place) and the other parameters share one.
pub const HIDDEN: i64 = 32 * 1024;

pub fn model(vs: &nn::VarStore) -> impl Module {
    nn::seq()
        .add(nn::linear(vs.root() / "l1", 8, HIDDEN, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", HIDDEN, 1, Default::default()))
}

/// The model of the ZeRO-3 scenarios: two numbered blocks (a unit each) between an input and an
/// output layer outside any block (one more unit, kept through the step).
pub fn blocks_model(vs: &nn::VarStore) -> nn::Sequential {
    let root = vs.root();
    let block = |i: i64| nn::linear(&root / "blocks" / i, 64, 64, Default::default());
    nn::seq()
        .add(nn::linear(&root / "input", 8, 64, Default::default()))
        .add(block(0))
        .add_fn(|x| x.tanh())
        .add(block(1))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "output", 64, 1, Default::default()))
}

/// The whole data set, the same in every process: STEPS global batches.
pub fn data() -> (Tensor, Tensor) {
    tch::manual_seed(1234);
    let n = STEPS * GLOBAL_BATCH;
    let x = Tensor::randn([n, 8], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
    (x, y)
}

pub fn adamw() -> AdamW {
    AdamW {
        lr: 1e-2,
        ..Default::default()
    }
}
