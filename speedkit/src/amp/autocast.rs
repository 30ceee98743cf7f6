//! Autocast scopes over libtorch's `at::autocast` state.
//!
//! Mirrors `torch.autocast`: entering sets the device type's autocast dtype and enables it; leaving
//! restores the previous enabled flag **and** dtype, and the outermost exit clears the cast cache.
//! Unlike `tch::autocast` it takes bf16 as well as fp16, and it restores during panic unwinding.
//! Autocast state in libtorch is thread-local, so a guard is not `Send`.
//!
//! ```
//! use speedkit::amp::{autocast, is_autocast_enabled};
//! use tch::{Device, Kind, Tensor};
//! let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
//! let y = autocast(Device::Cpu, Kind::BFloat16, || a.matmul(&a))?;
//! assert_eq!(y.kind(), Kind::BFloat16);          // the matmul ran in bf16
//! assert!(!is_autocast_enabled(Device::Cpu)?);   // and the state is back
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::marker::PhantomData;
use tch::{Device, Kind};

use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::nvtx::NvtxRange;

/// c10::DeviceType codes.
fn device_type(device: Device) -> Result<i32> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(SpeedkitError::Unsupported(format!(
            "autocast on {other:?} is not supported"
        ))),
    }
}

/// c10::ScalarType codes of the dtypes autocast takes.
fn scalar_type(kind: Kind) -> Result<i32> {
    match kind {
        Kind::Half | Kind::Float | Kind::BFloat16 => ffi::scalar_type_code(kind),
        other => Err(SpeedkitError::Unsupported(format!(
            "autocast dtype must be bf16 or fp16, not {other:?}"
        ))),
    }
}

/// The dtype libtorch reports; anything speedkit does not name reads as fp32 (autocast's own
/// default).
fn kind_of(code: i32) -> Kind {
    ffi::kind_of_code(code).unwrap_or(Kind::Float)
}

/// Autocast state of one device type: whether it is on and its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutocastState {
    /// Autocast on.
    pub enabled: bool,
    /// The lower-precision dtype ops are cast to.
    pub dtype: Kind,
}

impl AutocastState {
    /// Reads the state for `device`'s type (CPU or CUDA).
    pub fn current(device: Device) -> Result<Self> {
        let (enabled, dtype) = ffi::amp::autocast_get(device_type(device)?)?;
        Ok(Self {
            enabled,
            dtype: kind_of(dtype),
        })
    }
}

/// Whether autocast is on for `device`'s type, on this thread.
pub fn is_autocast_enabled(device: Device) -> Result<bool> {
    Ok(AutocastState::current(device)?.enabled)
}

/// An autocast scope; restores the previous state when dropped.
#[must_use = "autocast ends when the guard drops"]
pub struct AutocastGuard {
    device_type: i32,
    previous: Option<(bool, i32)>,
    // The forward pass's NVTX range (closed after autocast is restored, as fields drop last).
    _nvtx: NvtxRange,
    _not_send: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Enters autocast with `dtype` for `device`'s type.
    pub fn enter(device: Device, dtype: Kind) -> Result<Self> {
        let dt = device_type(device)?;
        let st = scalar_type(dtype)?;
        let previous = ffi::amp::autocast_get(dt)?;
        ffi::amp::autocast_set(dt, true, st)?;
        ffi::amp::autocast_increment_nesting()?;
        Ok(Self {
            device_type: dt,
            previous: Some(previous),
            _nvtx: NvtxRange::none(),
            _not_send: PhantomData,
        })
    }

    /// A scope that does nothing (fp32 plans): same type, no cost.
    pub fn disabled() -> Self {
        Self {
            device_type: 0,
            previous: None,
            _nvtx: NvtxRange::none(),
            _not_send: PhantomData,
        }
    }

    /// The same scope, also holding `range` open until it ends.
    pub(crate) fn with_nvtx(mut self, range: NvtxRange) -> Self {
        self._nvtx = range;
        self
    }

    /// Whether this scope actually turned autocast on.
    pub fn is_active(&self) -> bool {
        self.previous.is_some()
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let Some((enabled, dtype)) = self.previous.take() else {
            return;
        };
        // Errors cannot propagate from drop; these calls only fail on a broken libtorch.
        if let Ok(0) = ffi::amp::autocast_decrement_nesting() {
            let _ = ffi::amp::autocast_clear_cache();
        }
        if let Err(e) = ffi::amp::autocast_set(self.device_type, enabled, dtype) {
            eprintln!("speedkit: WARNING: autocast state not restored: {e}");
        }
    }
}

/// Runs `f` with autocast on for `device`'s type in `dtype`, restoring the state afterwards (also
/// if `f` panics).
pub fn autocast<T>(device: Device, dtype: Kind, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::enter(device, dtype)?;
    Ok(f())
}
