//! What the machine offers: GPUs and their compute capability, CUDA/cuDNN/libtorch versions, OS.
//!
//! [`Hardware::detect`] reads the real machine; [`Hardware::cpu_only`] and [`Hardware::simulated_gpu`]
//! build snapshots for tests and for planning ahead, because every speed decision is a pure function of
//! a `Hardware` value (see [`crate::plan`]).

use serde::Serialize;
use std::fmt;

use crate::error::Result;
use crate::ffi;

/// A CUDA compute capability (`major.minor`), e.g. 9.0 for the H100.
///
/// ```
/// use speedkit::hardware::ComputeCapability;
/// let h100 = ComputeCapability::new(9, 0);
/// assert!(h100 >= ComputeCapability::new(8, 9));
/// assert_eq!(h100.to_string(), "9.0");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ComputeCapability {
    /// Major version (the architecture generation).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl ComputeCapability {
    /// A capability `major.minor`.
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One CUDA device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuInfo {
    /// CUDA device index.
    pub index: usize,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (SM version).
    pub compute_capability: ComputeCapability,
    /// Number of streaming multiprocessors.
    pub multiprocessors: u32,
    /// Device memory in bytes.
    pub total_memory_bytes: u64,
    /// L2 cache in bytes.
    pub l2_cache_bytes: u64,
}

impl GpuInfo {
    /// Tensor Cores exist from Volta (SM 7.0) on.
    pub fn has_tensor_cores(&self) -> bool {
        self.compute_capability >= ComputeCapability::new(7, 0)
    }
    /// TF32 Tensor Core math for fp32 matmuls: Ampere (SM 8.0) and newer.
    pub fn supports_tf32(&self) -> bool {
        self.compute_capability >= ComputeCapability::new(8, 0)
    }
    /// bf16 Tensor Cores: Ampere (SM 8.0) and newer.
    pub fn supports_bf16(&self) -> bool {
        self.compute_capability >= ComputeCapability::new(8, 0)
    }
    /// fp16 Tensor Cores: Volta (SM 7.0) and newer.
    pub fn supports_fp16_tensor_cores(&self) -> bool {
        self.has_tensor_cores()
    }
    /// FP8 (e4m3/e5m2) Tensor Cores: Ada (SM 8.9) and Hopper (SM 9.0) and newer.
    pub fn supports_fp8(&self) -> bool {
        self.compute_capability >= ComputeCapability::new(8, 9)
    }
    /// PyTorch's FlashAttention-2 kernels need SM 8.0 or newer.
    pub fn supports_flash_attention(&self) -> bool {
        self.compute_capability >= ComputeCapability::new(8, 0)
    }
}

/// Whether the machine runs CUDA work or only CPU work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// No usable CUDA device.
    Cpu,
    /// At least one CUDA device.
    Cuda,
}

/// A snapshot of the machine.
///
/// ```
/// use speedkit::hardware::{Hardware, DeviceKind};
/// let hw = Hardware::simulated_gpu("NVIDIA H100 80GB HBM3", 9, 0);
/// assert_eq!(hw.kind(), DeviceKind::Cuda);
/// assert!(hw.primary_gpu().unwrap().supports_fp8());
/// assert_eq!(Hardware::cpu_only().kind(), DeviceKind::Cpu);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hardware {
    /// Visible CUDA devices, in index order.
    pub gpus: Vec<GpuInfo>,
    /// libtorch version, e.g. "2.11.0".
    pub libtorch: String,
    /// Whether speedkit's shim was built with its CUDA parts.
    pub built_with_cuda: bool,
    /// CUDA runtime version libtorch uses, e.g. "13.0".
    pub cuda_runtime: Option<String>,
    /// cuDNN version, e.g. "9.15.0".
    pub cudnn: Option<String>,
    /// NVIDIA driver version, from `/proc/driver/nvidia/version`.
    pub driver: Option<String>,
    /// Operating system (`std::env::consts::OS`).
    pub os: String,
    /// Logical CPUs available to this process.
    pub cpu_threads: usize,
    /// Why speedkit's own kernels ([`crate::kernels`]) cannot run on the first GPU (no GPU, SM below
    /// 8.0, NVRTC or the CUDA driver library not found), or `None` when they can.
    pub kernels_unavailable: Option<String>,
    /// Whether the values were read from this machine (`false` for simulated snapshots).
    pub detected: bool,
}

impl Hardware {
    /// Reads the machine through libtorch. Never fails for lack of a GPU: that is `kind() == Cpu`.
    pub fn detect() -> Result<Self> {
        let versions = ffi::device::versions()?;
        let count = if versions.built_with_cuda != 0 {
            ffi::device::cuda_device_count()?
        } else {
            0
        };
        let mut gpus = Vec::with_capacity(count);
        for index in 0..count {
            let raw = ffi::device::cuda_device_props(index)?;
            // SAFETY-free: the shim NUL-terminates name within its 256 bytes.
            let bytes: Vec<u8> = raw
                .name
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            gpus.push(GpuInfo {
                index,
                name: String::from_utf8_lossy(&bytes).into_owned(),
                compute_capability: ComputeCapability::new(
                    raw.major.max(0) as u32,
                    raw.minor.max(0) as u32,
                ),
                multiprocessors: raw.multiprocessors.max(0) as u32,
                total_memory_bytes: raw.total_memory.max(0) as u64,
                l2_cache_bytes: raw.l2_cache_bytes.max(0) as u64,
            });
        }
        Ok(Self {
            gpus,
            libtorch: format!(
                "{}.{}.{}",
                versions.torch_major, versions.torch_minor, versions.torch_patch
            ),
            built_with_cuda: versions.built_with_cuda != 0,
            cuda_runtime: (versions.cuda_runtime > 0).then(|| {
                // CUDART encodes 13.0 as 13000.
                format!(
                    "{}.{}",
                    versions.cuda_runtime / 1000,
                    (versions.cuda_runtime % 1000) / 10
                )
            }),
            cudnn: (versions.cudnn > 0).then(|| cudnn_version(versions.cudnn)),
            driver: driver_version(),
            os: std::env::consts::OS.to_owned(),
            cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernels_unavailable: match count {
                0 => Some("no CUDA device".into()),
                _ => crate::kernels::unavailable_reason(tch::Device::Cuda(0))?,
            },
            detected: true,
        })
    }

    /// A machine without a GPU (as CI runs).
    pub fn cpu_only() -> Self {
        Self {
            gpus: Vec::new(),
            libtorch: "2.11.0".into(),
            built_with_cuda: false,
            cuda_runtime: None,
            cudnn: None,
            driver: None,
            os: "linux".into(),
            cpu_threads: 1,
            kernels_unavailable: Some("no CUDA device".into()),
            detected: false,
        }
    }

    /// A machine with one GPU of the given name and compute capability (for planning and tests).
    pub fn simulated_gpu(name: &str, major: u32, minor: u32) -> Self {
        Self {
            gpus: vec![GpuInfo {
                index: 0,
                name: name.into(),
                compute_capability: ComputeCapability::new(major, minor),
                multiprocessors: 0,
                total_memory_bytes: 0,
                l2_cache_bytes: 0,
            }],
            built_with_cuda: true,
            cuda_runtime: Some("13.0".into()),
            kernels_unavailable: (major < 8).then(|| format!("the GPU is SM {major}.{minor}")),
            ..Self::cpu_only()
        }
    }

    /// The same snapshot, as if on another OS (e.g. `"windows"`).
    pub fn with_os(mut self, os: &str) -> Self {
        self.os = os.into();
        self
    }

    /// CPU or CUDA.
    pub fn kind(&self) -> DeviceKind {
        if self.gpus.is_empty() {
            DeviceKind::Cpu
        } else {
            DeviceKind::Cuda
        }
    }

    /// The GPU speedkit plans for by default (index 0), if any.
    pub fn primary_gpu(&self) -> Option<&GpuInfo> {
        self.gpus.first()
    }

    /// The GPU with this index, if visible.
    pub fn gpu(&self, index: usize) -> Option<&GpuInfo> {
        self.gpus.get(index)
    }

    /// Whether this is Windows, where graph capture (`compile`) stays off under `auto`.
    pub fn is_windows(&self) -> bool {
        self.os == "windows"
    }
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpus.is_empty() {
            writeln!(
                f,
                "device      cpu ({} threads), no CUDA device visible",
                self.cpu_threads
            )?;
        }
        for gpu in &self.gpus {
            writeln!(
                f,
                "device      cuda:{} {} (SM {}, {} SMs, {:.1} GiB)",
                gpu.index,
                gpu.name,
                gpu.compute_capability,
                gpu.multiprocessors,
                gpu.total_memory_bytes as f64 / (1u64 << 30) as f64
            )?;
            writeln!(
                f,
                "            tensor cores {}, tf32 {}, bf16 {}, fp8 {}, flash attention {}",
                yes_no(gpu.has_tensor_cores()),
                yes_no(gpu.supports_tf32()),
                yes_no(gpu.supports_bf16()),
                yes_no(gpu.supports_fp8()),
                yes_no(gpu.supports_flash_attention())
            )?;
        }
        writeln!(f, "libtorch    {}", self.libtorch)?;
        writeln!(
            f,
            "cuda        {}",
            self.cuda_runtime.as_deref().unwrap_or("-")
        )?;
        writeln!(f, "cudnn       {}", self.cudnn.as_deref().unwrap_or("-"))?;
        writeln!(f, "driver      {}", self.driver.as_deref().unwrap_or("-"))?;
        write!(f, "os          {}", self.os)
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// cuDNN 9 encodes major*10000 + minor*100 + patch (91500 = 9.15.0); cuDNN 8 used major*1000.
fn cudnn_version(v: i64) -> String {
    if v >= 90000 {
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
    }
}

fn driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ..."
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cudnn_9_versions_decode() {
        assert_eq!(cudnn_version(91500), "9.15.0");
        assert_eq!(cudnn_version(8902), "8.9.2");
    }

    #[test]
    fn capability_predicates_follow_the_architecture_table() {
        let gpu = |maj, min| Hardware::simulated_gpu("x", maj, min).gpus[0].clone();
        assert!(!gpu(6, 1).has_tensor_cores());
        assert!(gpu(7, 5).has_tensor_cores() && !gpu(7, 5).supports_bf16());
        assert!(gpu(8, 0).supports_tf32() && !gpu(8, 0).supports_fp8());
        assert!(gpu(8, 9).supports_fp8());
        assert!(gpu(9, 0).supports_flash_attention());
    }
}
