//! Training data: the fixed random batches the workloads train on, and CIFAR-10 ([`cifar`]).
//!
//! `docs/workloads.md` fixes the inputs: random tensors made **once** on the device with seed 0,
//! not reloaded per step, so a timed step is the model's work alone and a graph-captured step can read
//! them as static inputs. Every generator here re-seeds with [`SEED`] first, so a workload gets the
//! same batch whatever it drew from the generator before (e.g. to initialise the model). libtorch's
//! generator is process-global: another thread drawing random numbers at the same time changes the
//! batch (the benchmark runner and the test harness run one workload at a time).

pub mod cifar;

use speedkit::Result;
use tch::{Device, Kind, Tensor};

/// The seed of every generated batch (and of the workloads' model initialisation).
pub const SEED: i64 = 0;

/// Seeds libtorch's generators (CPU and every GPU) with [`SEED`].
pub fn seed() {
    tch::manual_seed(SEED);
}

/// `(x, target)`, both `[batch, width]` standard normal: the regression batch of `linear3`.
pub fn regression(batch: i64, width: i64, device: Device) -> Result<(Tensor, Tensor)> {
    seed();
    let x = Tensor::f_randn([batch, width], (Kind::Float, device))?;
    let target = Tensor::f_randn([batch, width], (Kind::Float, device))?;
    Ok((x, target))
}

/// `(x, labels)`: `[batch, features]` standard normal inputs and `[batch]` labels uniform in
/// `0..classes` (the batch of `mlp`).
pub fn classification(
    batch: i64,
    features: i64,
    classes: i64,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    seed();
    let x = Tensor::f_randn([batch, features], (Kind::Float, device))?;
    let labels = Tensor::f_randint(classes, [batch], (Kind::Int64, device))?;
    Ok((x, labels))
}

/// `(tokens, targets)`, both `[batch, seq_len]` ids uniform in `0..vocab` (the batch of
/// `transformer`; the targets are independent of the tokens, as the reference workload's are).
pub fn tokens(batch: i64, seq_len: i64, vocab: i64, device: Device) -> Result<(Tensor, Tensor)> {
    seed();
    let tokens = Tensor::f_randint(vocab, [batch, seq_len], (Kind::Int64, device))?;
    let targets = Tensor::f_randint(vocab, [batch, seq_len], (Kind::Int64, device))?;
    Ok((tokens, targets))
}

/// `(images, labels)`: `[batch, 3, size, size]` standard normal images (already "normalised") and
/// `[batch]` labels uniform in `0..classes` (the batch of `resnet`).
pub fn images(batch: i64, size: i64, classes: i64, device: Device) -> Result<(Tensor, Tensor)> {
    seed();
    let images = Tensor::f_randn([batch, 3, size, size], (Kind::Float, device))?;
    let labels = Tensor::f_randint(classes, [batch], (Kind::Int64, device))?;
    Ok((images, labels))
}
