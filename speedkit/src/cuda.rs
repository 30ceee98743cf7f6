//! Your own CUDA kernels on tensors: CUDA C++ source compiled by speedkit's NVRTC layer for the GPU
//! in use (cached on disk as speedkit's own kernels are), launched on PyTorch's current stream with
//! tensors and scalars as arguments and a grid of your choosing. Launches allocate nothing and never
//! synchronise, so they are captured in CUDA graphs like any other kernel.
//!
//! A kernel is declared with its parameters ([`Param`]); speedkit checks the declaration against the
//! compiled kernel where the driver can tell (CUDA 12.4 and newer: count and sizes) and every launch
//! against the declaration (count, tensor types, device, contiguity, scalar types), so a wrong
//! argument is an error before the launch, never a kernel reading the wrong bytes. A source that
//! does not compile is an error carrying NVRTC's log with the offending source lines. speedkit's own
//! kernel files are available as headers (`#include "common.cuh"` gives `sk::load8`, `sk::warp_sum`,
//! the bf16/fp16 conversions).
//!
//! With [`crate::function::Function`] around a forward and a backward kernel, a fused op trains like
//! any other: `examples/custom_op/main.rs` walks through one.
//!
//! ```no_run
//! use speedkit::cuda::{CudaModule, Param};
//! use tch::{Device, Kind, Tensor};
//!
//! let module = CudaModule::new("scale.cu", r#"
//!     extern "C" __global__ void scale(float* x, float k, int n) {
//!         int i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < n) x[i] *= k;
//!     }"#)?;
//! let scale = module.kernel("scale", &[Param::Tensor(Kind::Float), Param::F32, Param::I32], Device::Cuda(0))?;
//! let x = Tensor::ones([1000], (Kind::Float, Device::Cuda(0)));
//! scale.launch(4, 256, 0, &[(&x).into(), 2.0f32.into(), 1000i32.into()])?;
//! assert_eq!(x.sum(Kind::Float).double_value(&[]), 2000.0);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```
//!
//! A kernel that takes one params struct, as speedkit's own do (`speedkit/kernels/*.cuh`), is
//! launched with a `#[repr(C)]` mirror of that struct ([`KernelParams`]), so every argument is named
//! at the launch site: [`CudaModule::typed_kernel`] refuses a kernel whose one compiled parameter is
//! not the struct's size (where the driver can tell), and [`TypedKernel::ptr`] checks each tensor
//! (type, device, contiguity) as it turns it into a [`DevicePtr`], which borrows the tensor, so the
//! tensor outlives the launch. [`CudaModule::built_in`] opens one of speedkit's own kernel files.
//!
//! ```no_run
//! use speedkit::cuda::{CudaModule, DevicePtr, KernelParams};
//! use tch::{Device, Kind, Tensor};
//!
//! /// The kernel's `struct Scale { float* x; float k; int n; }`, field for field.
//! #[repr(C)]
//! #[derive(Clone, Copy)]
//! struct Scale<'t> {
//!     x: DevicePtr<'t>,
//!     k: f32,
//!     n: i32,
//! }
//! // SAFETY: `#[repr(C)]`, with the CUDA struct's fields in its order, of its sizes.
//! unsafe impl KernelParams for Scale<'_> {}
//! const _: () = assert!(std::mem::size_of::<Scale>() == 16);
//!
//! let module = CudaModule::new("scale_params.cu", r#"
//!     struct Scale { float* x; float k; int n; };
//!     extern "C" __global__ void scale(const Scale p) {
//!         int i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < p.n) p.x[i] *= p.k;
//!     }"#)?;
//! let scale = module.typed_kernel::<Scale>("scale", Device::Cuda(0))?;
//! let x = Tensor::ones([1000], (Kind::Float, Device::Cuda(0)));
//! scale.launch(4, 256, 0, &Scale { x: scale.ptr(&x, Kind::Float)?, k: 2.0, n: 1000 })?;
//! assert_eq!(x.sum(Kind::Float).double_value(&[]), 2000.0);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::ffi;

/// CUDA C++ source registered with speedkit's kernel layer, compiled on first use for each GPU.
#[derive(Clone, Debug)]
pub struct CudaModule {
    name: String,
}

impl CudaModule {
    /// Registers `source` under the file name `name` (what NVRTC's messages call it). The same name
    /// with other text is an error; the same name and text is the same module.
    pub fn new(name: &str, source: &str) -> Result<Self> {
        crate::kernels::register_source(name, source)?;
        Ok(Self {
            name: name.to_owned(),
        })
    }

    /// Registers the file at `path` under its file name.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|source| SpeedkitError::Io {
            path: path.to_owned(),
            source,
        })?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| SpeedkitError::Misuse(format!("{} names no file", path.display())))?;
        Self::new(&name, &source)
    }

    /// speedkit's own kernel file `name` (one of [`crate::kernels::files`], e.g.
    /// `"batch_norm.cuh"`), embedded at build time: nothing is registered.
    ///
    /// ```
    /// let module = speedkit::cuda::CudaModule::built_in("layernorm.cuh")?;
    /// assert_eq!(module.name(), "layernorm.cuh");
    /// assert!(speedkit::cuda::CudaModule::built_in("no_such_file.cuh").is_err());
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn built_in(name: &str) -> Result<Self> {
        if !crate::kernels::files()?.iter().any(|f| f == name) {
            return Err(SpeedkitError::Misuse(format!(
                "speedkit has no kernel file {name} (speedkit::kernels::files() lists them)"
            )));
        }
        Ok(Self {
            name: name.to_owned(),
        })
    }

    /// The module's file name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The kernel `name` (an `extern "C" __global__` function) with parameters `params`, compiled
    /// for and loaded on `device`: a compile error carries NVRTC's log; a kernel whose compiled
    /// parameters differ from `params` in count or size is refused.
    pub fn kernel(&self, name: &str, params: &[Param], device: Device) -> Result<CudaKernel> {
        let (handle, sizes) = self.load(name, device)?;
        let kernel = CudaKernel {
            handle,
            name: format!("{}::{name}", self.name),
            params: params.to_vec(),
            device,
        };
        if let Some(sizes) = sizes {
            kernel.check_declaration(&sizes)?;
        }
        Ok(kernel)
    }

    /// The kernel `name` (an `extern "C" __global__` function taking one params struct by value),
    /// launched with `P`, the struct's mirror, and compiled for and loaded on `device`: a compile
    /// error carries NVRTC's log; a kernel whose compiled parameters are not one of `P`'s size is
    /// refused.
    pub fn typed_kernel<P: KernelParams>(
        &self,
        name: &str,
        device: Device,
    ) -> Result<TypedKernel<P>> {
        let (handle, sizes) = self.load(name, device)?;
        let kernel = TypedKernel {
            handle,
            name: format!("{}::{name}", self.name),
            device,
            params: PhantomData,
        };
        let size = std::mem::size_of::<P>();
        match sizes {
            Some(sizes) if sizes != [size] => Err(kernel.misuse(format!(
                "takes parameters of {sizes:?} bytes, but its params struct {} has {size}: the \
                 struct and the source differ",
                std::any::type_name::<P>()
            ))),
            _ => Ok(kernel),
        }
    }

    /// Kernel `name` of this source loaded on `device`, and its compiled parameters' sizes where
    /// the driver can tell.
    fn load(&self, name: &str, device: Device) -> Result<(KernelHandle, Option<Vec<usize>>)> {
        let Device::Cuda(index) = device else {
            return Err(SpeedkitError::Misuse(format!(
                "kernel {name} of {}: CUDA kernels run on CUDA devices, not on {device:?}",
                self.name
            )));
        };
        let source = ffi::kernels::source_names()?
            .0
            .iter()
            .position(|n| n == &self.name)
            .ok_or_else(|| SpeedkitError::Misuse(format!("no kernel source {}", self.name)))?;
        let (handle, sizes) = ffi::kernels::load(source, name, index)?;
        Ok((KernelHandle(handle), sizes))
    }
}

/// A kernel parameter as declared: a tensor of a type (passed as a pointer to its data) or a scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A contiguous tensor of this type on the kernel's device, passed as `T*`.
    Tensor(Kind),
    /// `int`.
    I32,
    /// `long long` / `int64_t`.
    I64,
    /// `unsigned int`.
    U32,
    /// `float`.
    F32,
    /// `double`.
    F64,
}

impl Param {
    /// The bytes it takes in the kernel's parameter list.
    fn size(self) -> usize {
        match self {
            Param::Tensor(_) | Param::I64 | Param::F64 => 8,
            Param::I32 | Param::U32 | Param::F32 => 4,
        }
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Param::Tensor(kind) => write!(f, "a {kind:?} tensor"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// One launch argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A contiguous tensor, passed as a pointer to its data.
    Tensor(&'a Tensor),
    /// A tensor the kernel indexes through its strides itself (a transposed or sliced view),
    /// passed as a pointer to its first element, contiguous or not.
    Strided(&'a Tensor),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `unsigned int`.
    U32(u32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl<'a> From<&'a Tensor> for Arg<'a> {
    fn from(t: &'a Tensor) -> Self {
        Arg::Tensor(t)
    }
}

macro_rules! scalar_args {
    ($($t:ty => $variant:ident),*) => {
        $(impl From<$t> for Arg<'_> {
            fn from(v: $t) -> Self {
                Arg::$variant(v)
            }
        })*
    };
}
scalar_args!(i32 => I32, i64 => I64, u32 => U32, f32 => F32, f64 => F64);

fn describe(arg: &Arg<'_>) -> String {
    match arg {
        Arg::Tensor(t) | Arg::Strided(t) => format!("a {:?} tensor", t.kind()),
        Arg::I32(v) => format!("an i32 ({v})"),
        Arg::I64(v) => format!("an i64 ({v})"),
        Arg::U32(v) => format!("a u32 ({v})"),
        Arg::F32(v) => format!("an f32 ({v})"),
        Arg::F64(v) => format!("an f64 ({v})"),
    }
}

/// Grid or block dimensions; `4`, `(4, 2)` and `(4, 2, 1)` convert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3 {
    /// x.
    pub x: u32,
    /// y.
    pub y: u32,
    /// z.
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Self { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Self { x, y, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Self { x, y, z }
    }
}

/// A loaded kernel with its declared parameters (see [`CudaModule::kernel`]).
pub struct CudaKernel {
    handle: KernelHandle,
    name: String,
    params: Vec<Param>,
    device: Device,
}

/// The shim's kernel handle, freed on drop.
struct KernelHandle(*mut c_void);

impl Drop for KernelHandle {
    fn drop(&mut self) {
        ffi::kernels::free(self.0);
    }
}

/// Launches `kernel` on the current stream with `pointers` as its argument array, one pointer per
/// parameter (a params struct is one).
fn launch_raw(
    kernel: &KernelHandle,
    grid: Dim3,
    block: Dim3,
    shared_bytes: u32,
    pointers: &mut [*mut c_void],
) -> Result<()> {
    ffi::kernels::launch(
        kernel.0,
        [grid.x, grid.y, grid.z],
        [block.x, block.y, block.z],
        shared_bytes,
        pointers,
    )
}

// SAFETY: the handle names a loaded CUfunction, which any thread may launch; the shim's launch reads
// it only.
unsafe impl Send for KernelHandle {}
// SAFETY: as above.
unsafe impl Sync for KernelHandle {}

impl CudaKernel {
    /// The kernel's name, `file::function`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Launches the kernel on the current stream of its device with `grid` × `block` threads,
    /// `shared_bytes` of dynamic shared memory and `args`, each checked against the declaration
    /// first: an error names the argument and what was expected.
    pub fn launch(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_bytes: u32,
        args: &[Arg<'_>],
    ) -> Result<()> {
        if args.len() != self.params.len() {
            return Err(self.misuse(format!(
                "takes {} arguments, got {}",
                self.params.len(),
                args.len()
            )));
        }
        let mut words = Vec::with_capacity(args.len());
        for (index, (arg, param)) in args.iter().zip(&self.params).enumerate() {
            words.push(self.word(index, arg, *param)?);
        }
        let mut pointers: Vec<*mut c_void> = words
            .iter_mut()
            .map(|w| w as *mut u64 as *mut c_void)
            .collect();
        launch_raw(
            &self.handle,
            grid.into(),
            block.into(),
            shared_bytes,
            &mut pointers,
        )
    }

    /// One argument's bytes (in the low bytes of a u64, as the kernel's parameter of that size
    /// reads them), or why it does not fit its parameter.
    fn word(&self, index: usize, arg: &Arg<'_>, param: Param) -> Result<u64> {
        let wrong =
            |got: String| self.misuse(format!("argument {index} must be {param}, got {got}"));
        Ok(match (arg, param) {
            (Arg::Tensor(t), Param::Tensor(kind)) => {
                tensor_address(t, kind, self.device, true, wrong)?
            }
            (Arg::Strided(t), Param::Tensor(kind)) => {
                tensor_address(t, kind, self.device, false, wrong)?
            }
            (Arg::I32(v), Param::I32) => *v as u32 as u64,
            (Arg::U32(v), Param::U32) => u64::from(*v),
            (Arg::I64(v), Param::I64) => *v as u64,
            (Arg::F32(v), Param::F32) => u64::from(v.to_bits()),
            (Arg::F64(v), Param::F64) => v.to_bits(),
            (other, _) => return Err(wrong(describe(other))),
        })
    }

    /// The declaration against the compiled kernel's parameter sizes.
    fn check_declaration(&self, sizes: &[usize]) -> Result<()> {
        let declared: Vec<usize> = self.params.iter().map(|p| p.size()).collect();
        if declared == sizes {
            return Ok(());
        }
        Err(self.misuse(format!(
            "was declared with parameters of {declared:?} bytes, but its compiled code takes \
             {sizes:?} bytes: the declaration and the source differ"
        )))
    }

    fn misuse(&self, what: String) -> SpeedkitError {
        SpeedkitError::Misuse(format!("CUDA kernel {} {what}", self.name))
    }
}

impl fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKernel")
            .field("name", &self.name)
            .field("params", &self.params)
            .field("device", &self.device)
            .finish()
    }
}

/// The address of `t`'s data for a kernel on `device` that reads it as `kind`, or `wrong` of what
/// `t` is instead.
fn tensor_address(
    t: &Tensor,
    kind: Kind,
    device: Device,
    contiguous: bool,
    wrong: impl Fn(String) -> SpeedkitError,
) -> Result<u64> {
    if t.kind() != kind {
        return Err(wrong(format!("a {:?} tensor", t.kind())));
    }
    if t.device() != device {
        return Err(wrong(format!(
            "a tensor on {:?} (the kernel is on {device:?})",
            t.device()
        )));
    }
    if contiguous && !t.is_contiguous() {
        return Err(wrong(
            "a tensor that is not contiguous (call .contiguous())".into(),
        ));
    }
    // A raw pointer is a read no operator sees: a deferred tensor gets its values first.
    ffi::deferred::materialize(t)?;
    Ok(t.data_ptr() as u64)
}

/// A `#[repr(C)]` mirror of the params struct a CUDA kernel takes as its one parameter, launched by
/// [`TypedKernel::launch`] (see the [module](self)'s example). A struct whose fields are tensors'
/// addresses has the tensors' lifetime: `Scale<'t>`, its `DevicePtr<'t>` fields from
/// [`TypedKernel::ptr`].
///
/// # Safety
///
/// The type is `#[repr(C)]` and has exactly the CUDA struct's fields, in its order, each of the same
/// size and alignment: [`DevicePtr`] for a pointer, `i64` for `long long`, `i32` or `u32` for `int` or
/// `unsigned`, `f32` for `float`, `f64` for `double`. speedkit checks the struct's size against the
/// compiled kernel's parameter where the driver can tell, never its fields: put the 8-byte fields
/// first and assert the size on both sides (`const _: () = assert!(size_of::<Scale>() == 16);`,
/// `static_assert(sizeof(Scale) == 16)`).
pub unsafe trait KernelParams: Copy {}

/// A device address as a field of a params struct ([`KernelParams`]): a `T*` or `const void*` in the
/// kernel's struct, 8 bytes. Made from a checked tensor by [`TypedKernel::ptr`], borrowing it for
/// `'t` so that it outlives the launch, or [`DevicePtr::NULL`] for a pointer the kernel does not
/// read.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DevicePtr<'t> {
    address: u64,
    tensor: PhantomData<&'t ()>,
}

impl DevicePtr<'static> {
    /// The null pointer.
    pub const NULL: Self = Self {
        address: 0,
        tensor: PhantomData,
    };
}

impl DevicePtr<'_> {
    /// The address.
    pub fn address(self) -> u64 {
        self.address
    }
}

impl fmt::Debug for DevicePtr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.address)
    }
}

/// A loaded kernel whose one parameter is a `P` (see [`CudaModule::typed_kernel`]).
pub struct TypedKernel<P> {
    handle: KernelHandle,
    name: String,
    device: Device,
    params: PhantomData<fn() -> P>,
}

impl<P: KernelParams> TypedKernel<P> {
    /// The kernel's name, `file::function`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device it is loaded on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The address of `tensor`'s data for a field of `P`, checked first: a `kind` tensor on the
    /// kernel's device, contiguous (a deferred tensor gets its values now). An error names the
    /// kernel and what the tensor is instead.
    pub fn ptr<'t>(&self, tensor: &'t Tensor, kind: Kind) -> Result<DevicePtr<'t>> {
        let wrong = |got: String| self.misuse(format!("takes a {kind:?} tensor, got {got}"));
        Ok(DevicePtr {
            address: tensor_address(tensor, kind, self.device, true, wrong)?,
            tensor: PhantomData,
        })
    }

    /// [`ptr`](Self::ptr) of `tensor` where there is one, [`DevicePtr::NULL`] where not.
    pub fn ptr_or_null<'t>(&self, tensor: Option<&'t Tensor>, kind: Kind) -> Result<DevicePtr<'t>> {
        tensor.map_or(Ok(DevicePtr::NULL), |t| self.ptr(t, kind))
    }

    /// Launches the kernel on the current stream of its device with `grid` × `block` threads,
    /// `shared_bytes` of dynamic shared memory and `params`: allocation-free, never synchronising,
    /// captured in a CUDA graph like any other kernel.
    pub fn launch(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_bytes: u32,
        params: &P,
    ) -> Result<()> {
        let mut pointers = [params as *const P as *mut c_void];
        launch_raw(
            &self.handle,
            grid.into(),
            block.into(),
            shared_bytes,
            &mut pointers,
        )
    }
}

impl<P> TypedKernel<P> {
    fn misuse(&self, what: String) -> SpeedkitError {
        SpeedkitError::Misuse(format!("CUDA kernel {} {what}", self.name))
    }
}

impl<P> fmt::Debug for TypedKernel<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypedKernel")
            .field("name", &self.name)
            .field("params", &std::any::type_name::<P>())
            .field("device", &self.device)
            .finish()
    }
}

/// The suffix speedkit's kernel files give an entry point per storage type (`f32`, `bf16`, `f16`:
/// `common.cuh`'s `SK_TYPES_*`), or `None` for a type they do not store.
///
/// ```
/// use tch::Kind;
/// assert_eq!(speedkit::cuda::type_tag(Kind::BFloat16), Some("bf16"));
/// assert_eq!(speedkit::cuda::type_tag(Kind::Double), None);
/// ```
pub fn type_tag(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::Float => Some("f32"),
        Kind::BFloat16 => Some("bf16"),
        Kind::Half => Some("f16"),
        _ => None,
    }
}
