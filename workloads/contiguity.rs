//! `contiguity_*`: what operand layout costs. A matmul takes a transposed operand for free
//! (cuBLAS reads it through a transpose flag) but copies a strided one first; an elementwise op
//! over a transposed operand reads memory out of order. One measurement per workload, so each
//! layout is its own workload: compare them within one run.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use tch::Tensor;

/// Matrix side of the matmul variants (bench size; 256 tiny).
const MATMUL_N: i64 = 4096;
/// Matrix side of the elementwise variants (bench size; 256 tiny): large enough to be
/// memory-bound.
const ADD_N: i64 = 8192;

/// Times `x @ operand(y)`, where `operand` turns the `n × n` (or, for `strided`, `n × 2n`)
/// matrix `y` into the `n × n` right-hand side.
fn matmul_with(
    b: &mut Bencher<'_>,
    wide: bool,
    operand: fn(&Tensor) -> tch::Result<Tensor>,
) -> anyhow::Result<()> {
    let n = b.size().pick(256, MATMUL_N);
    data::seed();
    let x = super::random_matrix(b, n, n)?;
    let y = operand(&super::random_matrix(b, n, if wide { 2 * n } else { n })?)?;
    b.set_flops_per_step(2.0 * (n as f64).powi(3));
    b.run(|| x.f_mm(&y))?;
    Ok(())
}

/// Times `operand(x) + y` over `n × n` matrices.
fn add_with(
    b: &mut Bencher<'_>,
    operand: fn(&Tensor) -> tch::Result<Tensor>,
) -> anyhow::Result<()> {
    let n = b.size().pick(256, ADD_N);
    data::seed();
    let x = operand(&super::random_matrix(b, n, n)?)?;
    let y = super::random_matrix(b, n, n)?;
    b.set_items_per_step((n * n) as f64, "elements");
    b.run(|| x.f_add(&y))?;
    Ok(())
}

/// `x @ y`, both contiguous: the reference.
#[speedkit::bench(tags = ["anatomy", "contiguity"], cuda_only)]
fn contiguity_matmul_contiguous(b: &mut Bencher) -> anyhow::Result<()> {
    matmul_with(b, false, |y| Ok(y.shallow_clone()))
}

/// `x @ yᵀ` with `yᵀ` a transposed view: same speed, no copy.
#[speedkit::bench(tags = ["anatomy", "contiguity"], cuda_only)]
fn contiguity_matmul_transposed(b: &mut Bencher) -> anyhow::Result<()> {
    matmul_with(b, false, |y| y.f_tr())
}

/// `x @ y[:, ::2]`: every other column, a non-unit inner stride that the matmul must copy first.
#[speedkit::bench(tags = ["anatomy", "contiguity"], cuda_only)]
fn contiguity_matmul_strided(b: &mut Bencher) -> anyhow::Result<()> {
    matmul_with(b, true, |y| y.f_slice(1, 0, None, 2))
}

/// `x + y`, both contiguous: one coalesced pass over memory.
#[speedkit::bench(tags = ["anatomy", "contiguity"], cuda_only)]
fn contiguity_add_contiguous(b: &mut Bencher) -> anyhow::Result<()> {
    add_with(b, |x| Ok(x.shallow_clone()))
}

/// `xᵀ + y` with `xᵀ` a transposed view: the same bytes read with a stride of a whole row.
#[speedkit::bench(tags = ["anatomy", "contiguity"], cuda_only)]
fn contiguity_add_strided(b: &mut Bencher) -> anyhow::Result<()> {
    add_with(b, |x| x.f_tr())
}
