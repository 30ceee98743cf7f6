//! Where training runs: the device a config names, or under a launcher this rank's own GPU.

use tch::Device;

use super::decisions::Decisions;
use crate::config::DeviceChoice;
use crate::dist::LaunchEnv;
use crate::error::{Result, SpeedkitError};
use crate::hardware::{GpuInfo, Hardware};

/// The device of a single process: `auto` takes the first GPU, since one process drives one device.
pub(super) fn resolve_device<'h>(
    choice: DeviceChoice,
    hw: &'h Hardware,
    d: &mut Decisions,
) -> Result<(Device, Option<&'h GpuInfo>)> {
    match choice {
        DeviceChoice::Auto => match hw.primary_gpu() {
            Some(g) => {
                d.push("device", "cuda:0", format!("{} is visible", g.name));
                Ok((Device::Cuda(0), Some(g)))
            }
            None => {
                d.push("device", "cpu", "no CUDA device is visible");
                Ok((Device::Cpu, None))
            }
        },
        DeviceChoice::Cpu => {
            d.push("device", "cpu", "set in the config");
            Ok((Device::Cpu, None))
        }
        DeviceChoice::Cuda(i) => match hw.gpu(i) {
            Some(g) => {
                d.push(
                    "device",
                    format!("cuda:{i}"),
                    format!("set in the config ({})", g.name),
                );
                Ok((Device::Cuda(i), Some(g)))
            }
            None => Err(SpeedkitError::Unsupported(format!(
                "the config asks for device cuda:{i}, but {}; set `device: auto` (or `cpu`)",
                match hw.gpus.len() {
                    0 if !hw.built_with_cuda && hw.detected => {
                        "this libtorch/speedkit build has no CUDA support".to_string()
                    }
                    0 => "no CUDA device is visible".to_string(),
                    n => format!("only {n} CUDA device(s) are visible"),
                }
            ))),
        },
    }
}

/// Under a launcher: `auto` and `cuda` mean this rank's GPU (`cuda:LOCAL_RANK`), one per process.
pub(super) fn resolve_rank_device<'h>(
    choice: DeviceChoice,
    hw: &'h Hardware,
    env: &LaunchEnv,
    d: &mut Decisions,
) -> Result<(Device, Option<&'h GpuInfo>)> {
    let local = env.local_rank;
    match choice {
        DeviceChoice::Cpu => resolve_device(choice, hw, d),
        DeviceChoice::Auto if hw.gpus.is_empty() => resolve_device(choice, hw, d),
        DeviceChoice::Cuda(i) if i != local => Err(SpeedkitError::Unsupported(format!(
            "the config asks for device cuda:{i}, but this is rank {} with LOCAL_RANK {local}: \
             data-parallel ranks each use their own GPU, cuda:LOCAL_RANK; set `device: auto`",
            env.rank
        ))),
        _ => match hw.gpu(local) {
            Some(g) => {
                d.push(
                    "device",
                    format!("cuda:{local}"),
                    format!("{}: LOCAL_RANK {local} of a data-parallel run", g.name),
                );
                Ok((Device::Cuda(local), Some(g)))
            }
            None => Err(SpeedkitError::Unsupported(format!(
                "LOCAL_RANK is {local}, but only {} CUDA device(s) are visible: start at most \
                 one process per GPU (`speedkit launch --nproc-per-node {}`)",
                hw.gpus.len(),
                hw.gpus.len()
            ))),
        },
    }
}
