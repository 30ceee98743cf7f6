//! Convolution under autocast without a kept copy of the weight, else ATen's
//! (`shim/convolution.cpp`), and what its cuDNN plans did (`shim/conv_plans.cpp`).

use std::ptr;

use tch::{Kind, Tensor};

use super::{check, handle, optional_handle, owned, raw::convolution as abi, Result};
use crate::error::SpeedkitError;

/// A convolution's geometry: per spatial dimension its stride, padding and dilation (each as long
/// as the weight has spatial dimensions), and its groups.
pub(crate) struct ConvolutionParams<'a> {
    pub(crate) stride: &'a [i64],
    pub(crate) padding: &'a [i64],
    pub(crate) dilation: &'a [i64],
    pub(crate) groups: i64,
}

/// The convolution of `x` by `weight` (+ `bias`) in `kind`, differentiable; on the kernel path its
/// backward casts the weight again instead of keeping the forward's copy.
pub(crate) fn convolution(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    params: &ConvolutionParams<'_>,
    kind: Kind,
) -> Result<Tensor> {
    let dims = weight.dim().saturating_sub(2);
    for (name, values) in [
        ("stride", params.stride),
        ("padding", params.padding),
        ("dilation", params.dilation),
    ] {
        if values.len() != dims {
            return Err(SpeedkitError::Misuse(format!(
                "convolution: {name} {values:?} has {} values for a weight with {dims} spatial \
                 dimensions",
                values.len()
            )));
        }
    }
    let code = super::scalar_type_code(kind)?;
    let mut y = ptr::null_mut();
    // SAFETY: live handles (null for no bias) and slices of `dims` values borrowed for the call;
    // on success the shim hands over `y`.
    check(unsafe {
        abi::sk_convolution(
            handle(x),
            handle(weight),
            optional_handle(bias),
            params.stride.as_ptr(),
            params.padding.as_ptr(),
            params.dilation.as_ptr(),
            dims as i64,
            params.groups,
            code,
            &mut y,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(y) })
}

/// What the cuDNN plans of speedkit's convolutions did in this process, counted from its start.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PlanCounts {
    /// Plans chosen by timing cuDNN's candidates.
    pub(crate) timed: i64,
    /// The seconds that timing took.
    pub(crate) timing_seconds: f64,
    /// Plans built from the choices an earlier run kept in the kernel cache.
    pub(crate) from_disk: i64,
    /// The seconds building those took.
    pub(crate) building_seconds: f64,
    /// Convolutions left to ATen's because no plan could be had then.
    pub(crate) to_aten: i64,
}

/// The counts now.
pub(crate) fn plan_counts() -> PlanCounts {
    let mut counts = PlanCounts::default();
    // SAFETY: five out-pointers to live locals, written by the shim.
    unsafe {
        abi::sk_conv_plans_counts(
            &mut counts.timed,
            &mut counts.timing_seconds,
            &mut counts.from_disk,
            &mut counts.building_seconds,
            &mut counts.to_aten,
        );
    }
    counts
}

/// Of the depthwise convolutions' passes this process timed, how many run on speedkit's kernel as
/// the faster and how many stay on the plans' or ATen's path.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DepthwiseCounts {
    pub(crate) on_kernels: i64,
    pub(crate) left: i64,
    pub(crate) kernel_runs: i64,
}

/// The counts now.
pub(crate) fn depthwise_counts() -> DepthwiseCounts {
    let mut counts = DepthwiseCounts::default();
    // SAFETY: three out-pointers to live locals, written by the shim.
    unsafe {
        abi::sk_depthwise_conv_counts(
            &mut counts.on_kernels,
            &mut counts.left,
            &mut counts.kernel_runs,
        );
    }
    counts
}

/// Sets how depthwise passes choose their kernel (speedkit.h's codes: 0 timed, 1 speedkit's, 2 the
/// other path); returns the previous code.
pub(crate) fn choose_depthwise(code: i32) -> i32 {
    // SAFETY: stores an atomic in the shim; any code is checked there.
    unsafe { abi::sk_depthwise_conv_choose(code) }
}

/// While held, speedkit's convolutions run only plans chosen earlier (this process's or the kernel
/// cache's) and time nothing; dropping it puts back the setting it found.
pub(crate) struct KeptPlansOnly {
    before: bool,
}

impl KeptPlansOnly {
    /// Runs only kept plans until the guard drops.
    pub(crate) fn hold() -> Self {
        // SAFETY: sets an atomic in the shim.
        let before = unsafe { abi::sk_conv_plans_kept_only(1) } != 0;
        Self { before }
    }
}

impl Drop for KeptPlansOnly {
    fn drop(&mut self) {
        // SAFETY: as in `hold`.
        unsafe { abi::sk_conv_plans_kept_only(i32::from(self.before)) };
    }
}
