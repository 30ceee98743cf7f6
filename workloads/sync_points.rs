//! `sync_*`: what a host read (`.item()`, here `double_value`) costs. The GPU runs queued work
//! asynchronously; a host read waits until **everything** queued before it has finished, not only
//! the value it reads. Compare `sync_item_pending` with `matmul8192` (the same product without
//! the read) and with `sync_item_idle` (the read alone).
//!
//! A step that reads on the host cannot be captured as a CUDA graph. Under a config with `compile`
//! on, these steps therefore refuse the capture up front ([`refuse_capture`]) and the runner runs
//! them eagerly, saying so in its notes.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use tch::{Kind, Tensor};

/// Fails when called during a CUDA graph capture, before anything is queued. Letting the host read
/// itself fail inside the capture would invalidate it, and an invalidated capture leaves libtorch's
/// CUDA random generator in capture mode (every later CUDA random op of the process then fails);
/// an error on a still-valid capture ends it cleanly.
fn refuse_capture() -> anyhow::Result<()> {
    if speedkit::graph::is_capturing() {
        anyhow::bail!(
            "this step reads a value on the host on purpose, which a CUDA graph cannot hold"
        );
    }
    Ok(())
}

/// Reads a one-element tensor on the host right after queueing an 8192³ matmul: the read waits
/// for the matmul.
#[speedkit::bench(tags = ["anatomy", "sync"], cuda_only)]
fn sync_item_pending(b: &mut Bencher) -> anyhow::Result<()> {
    let n = b.size().pick(256, 8192);
    data::seed();
    let (x, y) = (
        super::random_matrix(b, n, n)?,
        super::random_matrix(b, n, n)?,
    );
    let flag = Tensor::f_zeros([1], (Kind::Float, b.device()))?;
    b.run(|| -> anyhow::Result<()> {
        refuse_capture()?;
        let _product = x.f_mm(&y)?;
        // Unrelated to the product, yet it cannot return before the product is done.
        flag.f_double_value(&[0])?;
        Ok(())
    })?;
    Ok(())
}

/// The same host read with nothing queued: the bare round trip.
#[speedkit::bench(tags = ["anatomy", "sync"], cuda_only)]
fn sync_item_idle(b: &mut Bencher) -> anyhow::Result<()> {
    let flag = Tensor::f_zeros([1], (Kind::Float, b.device()))?;
    b.run(|| -> anyhow::Result<()> {
        refuse_capture()?;
        flag.f_double_value(&[0])?;
        Ok(())
    })?;
    Ok(())
}
