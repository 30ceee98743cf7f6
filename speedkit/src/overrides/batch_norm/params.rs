//! The kernels' params structs, `speedkit/kernels/batch_norm.cuh`'s `sk::kernels::batch_norm`,
//! mirrored field for field (`#[repr(C)]`, 8-byte fields first, the sizes asserted here as the
//! source asserts them), and the flags they carry.

use std::mem::size_of;

use crate::cuda::{DevicePtr, KernelParams};

/// The kernels' flags for the optional tensors (the source's `kWeight`, ...).
pub(super) const WEIGHT: i32 = 1;
pub(super) const BIAS: i32 = 2;
pub(super) const RUNNING: i32 = 4;
pub(super) const GRAD_WEIGHT: i32 = 8;
pub(super) const GRAD_BIAS: i32 = 16;

/// `bit` where `present`, else no flag.
pub(super) fn flag(present: bool, bit: i32) -> i32 {
    if present {
        bit
    } else {
        0
    }
}

/// A params struct's entry points' common name (the source's `SK_KERNEL_ENTRY`), to which the
/// loader appends the type tag and the variant.
pub(super) trait Entry: KernelParams {
    const NAME: &'static str;
}

/// `StatsPartials`: the partials of the statistics.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct StatsPartials<'t> {
    pub(super) x: DevicePtr<'t>,
    pub(super) partials: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) strip_rows: i64,
    pub(super) channels: i32,
}

// SAFETY: `#[repr(C)]`, the source's `StatsPartials` field for field.
unsafe impl KernelParams for StatsPartials<'_> {}
impl Entry for StatsPartials<'_> {
    const NAME: &'static str = "batch_norm_stats_partials";
}
const _: () = assert!(size_of::<StatsPartials>() == 40);

/// `StatsFinish`: the statistics, the running statistics and the normalisation's coefficients.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct StatsFinish<'t> {
    pub(super) partials: DevicePtr<'t>,
    pub(super) x: DevicePtr<'t>,
    pub(super) weight: DevicePtr<'t>,
    pub(super) bias: DevicePtr<'t>,
    pub(super) save_mean: DevicePtr<'t>,
    pub(super) save_invstd: DevicePtr<'t>,
    pub(super) running_mean: DevicePtr<'t>,
    pub(super) running_var: DevicePtr<'t>,
    pub(super) coefficients: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) strips: i32,
    pub(super) channels: i32,
    pub(super) eps: f32,
    pub(super) momentum: f32,
    pub(super) flags: i32,
}

// SAFETY: `#[repr(C)]`, the source's `StatsFinish` field for field.
unsafe impl KernelParams for StatsFinish<'_> {}
impl Entry for StatsFinish<'_> {
    const NAME: &'static str = "batch_norm_stats_finish";
}
const _: () = assert!(size_of::<StatsFinish>() == 104);

/// `Normalize`: the normalisation, with its addend and ReLU.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Normalize<'t> {
    pub(super) x: DevicePtr<'t>,
    pub(super) coefficients: DevicePtr<'t>,
    pub(super) other: DevicePtr<'t>,
    pub(super) other_coefficients: DevicePtr<'t>,
    pub(super) y: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) channels: i32,
}

// SAFETY: `#[repr(C)]`, the source's `Normalize` field for field.
unsafe impl KernelParams for Normalize<'_> {}
impl Entry for Normalize<'_> {
    const NAME: &'static str = "batch_norm_normalize";
}
const _: () = assert!(size_of::<Normalize>() == 56);

/// `BackwardPartials`: the partials of the backward's sums.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct BackwardPartials<'t> {
    pub(super) dy: DevicePtr<'t>,
    pub(super) x: DevicePtr<'t>,
    pub(super) mean: DevicePtr<'t>,
    pub(super) partials: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) strip_rows: i64,
    pub(super) channels: i32,
}

// SAFETY: `#[repr(C)]`, the source's `BackwardPartials` field for field.
unsafe impl KernelParams for BackwardPartials<'_> {}
impl Entry for BackwardPartials<'_> {
    const NAME: &'static str = "batch_norm_backward_partials";
}
const _: () = assert!(size_of::<BackwardPartials>() == 56);

/// `BackwardFinish`: the parameters' gradients and the input gradient's coefficients.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct BackwardFinish<'t> {
    pub(super) partials: DevicePtr<'t>,
    pub(super) save_mean: DevicePtr<'t>,
    pub(super) save_invstd: DevicePtr<'t>,
    pub(super) weight: DevicePtr<'t>,
    pub(super) grad_weight: DevicePtr<'t>,
    pub(super) grad_bias: DevicePtr<'t>,
    pub(super) coefficients: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) strips: i32,
    pub(super) channels: i32,
    pub(super) flags: i32,
}

// SAFETY: `#[repr(C)]`, the source's `BackwardFinish` field for field.
unsafe impl KernelParams for BackwardFinish<'_> {}
impl Entry for BackwardFinish<'_> {
    const NAME: &'static str = "batch_norm_backward_finish";
}
const _: () = assert!(size_of::<BackwardFinish>() == 80);

/// `BackwardInput`: the input's gradient.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct BackwardInput<'t> {
    pub(super) dy: DevicePtr<'t>,
    pub(super) x: DevicePtr<'t>,
    pub(super) coefficients: DevicePtr<'t>,
    pub(super) dx: DevicePtr<'t>,
    pub(super) rows: i64,
    pub(super) channels: i32,
}

// SAFETY: `#[repr(C)]`, the source's `BackwardInput` field for field.
unsafe impl KernelParams for BackwardInput<'_> {}
impl Entry for BackwardInput<'_> {
    const NAME: &'static str = "batch_norm_backward_input";
}
const _: () = assert!(size_of::<BackwardInput>() == 48);
