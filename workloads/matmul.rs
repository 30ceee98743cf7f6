//! `matmul{N}`: one `N×N @ N×N` product in the precision the config implies.

use speedkit::bench::Bencher;
use speedkit_suite::data;

/// Times `a.mm(b)` for `n × n` matrices (`n` at the bench size, 256 at the tiny size);
/// 2·n³ FLOPs.
fn matmul(b: &mut Bencher<'_>, n: i64) -> anyhow::Result<()> {
    let n = b.size().pick(256, n);
    data::seed();
    let (x, y) = (
        super::random_matrix(b, n, n)?,
        super::random_matrix(b, n, n)?,
    );
    b.set_flops_per_step(2.0 * (n as f64).powi(3));
    b.run(|| x.f_mm(&y))?;
    Ok(())
}

/// 4096³: a Tensor Core friendly size.
#[speedkit::bench(tags = ["matmul"], cuda_only)]
fn matmul4096(b: &mut Bencher) -> anyhow::Result<()> {
    matmul(b, 4096)
}

/// 8192³: large enough to approach the device's peak.
#[speedkit::bench(tags = ["matmul"], cuda_only)]
fn matmul8192(b: &mut Bencher) -> anyhow::Result<()> {
    matmul(b, 8192)
}

/// 4000³: not a multiple of 16 (nor of the Tensor Core tiles), to show what odd sizes cost.
#[speedkit::bench(tags = ["matmul"], cuda_only)]
fn matmul4000(b: &mut Bencher) -> anyhow::Result<()> {
    matmul(b, 4000)
}
