//! The CUDA generator's Philox state for generated kernels that draw dropout's numbers
//! (`shim/random.cpp`).

use super::{check, raw, raw::random as abi, Result};

/// One dropout's stretch of the default CUDA generator ([`dropout_draw`]).
pub(crate) use raw::sk_philox_draw as PhiloxDraw;

/// Reserves of the current device's default CUDA generator what ATen's dropout of `numel`
/// elements reserves, and says where the kernel finds it and how many threads ATen's kernel runs.
pub(crate) fn dropout_draw(numel: u64) -> Result<PhiloxDraw> {
    let mut out = PhiloxDraw {
        seed: 0,
        offset: 0,
        intragraph: 0,
        threads: 0,
        captured: 0,
    };
    let numel = i64::try_from(numel).unwrap_or(i64::MAX);
    // SAFETY: `out` is the header's struct, valid for the call.
    check(unsafe { abi::sk_dropout_philox_draw(numel, &mut out) })?;
    Ok(out)
}
