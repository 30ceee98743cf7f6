//! The GPU's clock, power and the reasons its clock is held down, through NVML (`shim/sensors.cpp`).

use super::{check, device_index, raw, raw::sensors as abi, Result};

pub(crate) use raw::sk_gpu_reading as GpuReading;

/// One reading of CUDA device `index`'s sensors.
pub(crate) fn gpu_reading(index: usize) -> Result<GpuReading> {
    let mut out = GpuReading {
        sm_clock_mhz: 0,
        max_sm_clock_mhz: 0,
        power_mw: 0,
        power_limit_mw: 0,
        energy_mj: 0,
        clock_event_reasons: 0,
    };
    // SAFETY: `out` is the header's struct, valid for the call.
    check(unsafe { abi::sk_gpu_sensors_read(device_index(index)?, &mut out) })?;
    Ok(out)
}
