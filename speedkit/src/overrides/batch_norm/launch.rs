//! How a call's activations are read (the layout), the kernels' launch geometry, and the kernels,
//! compiled and loaded once per device, type and width.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tch::{Device, Kind, Tensor};

use super::params::{
    BackwardFinish, BackwardInput, BackwardPartials, Entry, Normalize, StatsFinish, StatsPartials,
};
use crate::cuda::{type_tag, CudaModule, TypedKernel};
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::kernels::KernelOp;

/// The kernels' file name, as NVRTC's messages and the kernel cache name it.
const SOURCE_NAME: &str = "batch_norm.cuh";

/// Threads per block of the row passes (`kThreads` in the source).
const THREADS: i64 = 256;
/// Threads per side of the finishing passes' square blocks (`kFinish`).
pub(super) const FINISH: u32 = 32;

/// How a call's activations are read: as a matrix [rows, channels] through the permutation that
/// moves the channel dimension last, which must be contiguous (channels-last memory, or `[N, C]`);
/// with the kernels for their type and the launch shape.
pub(super) struct Layout {
    /// The input's sizes, type and device.
    shape: Vec<i64>,
    pub(super) kind: Kind,
    pub(super) device: Device,
    /// The dimensions in matrix order: 0, 2, 3, ..., 1.
    order: Vec<i64>,
    pub(super) rows: i64,
    pub(super) channels: i64,
    pub(super) kernels: Arc<Kernels>,
    /// Channels per thread: 8 (16-byte loads) or 1.
    vec: i64,
    multiprocessors: i64,
}

/// A reduction's partial sums, [strips, 2, channels], how many strips, and the rows of each.
pub(super) struct Partials {
    pub(super) sums: Tensor,
    pub(super) strips: i64,
    pub(super) strip_rows: i64,
}

impl Layout {
    /// The layout of `x` with the parameters `params`, or `None` where the kernels do not take it
    /// (see [`Layout::declined`] for why).
    pub(super) fn of<'t>(
        x: &Tensor,
        params: impl Iterator<Item = &'t Tensor>,
    ) -> Result<Option<Layout>> {
        let device = x.device();
        let kinds_fit = matches!(x.kind(), Kind::Float | Kind::BFloat16 | Kind::Half);
        let mut params_fit = true;
        for p in params {
            params_fit &= p.kind() == Kind::Float && p.device() == device && p.is_contiguous();
        }
        if !kinds_fit || !params_fit || x.dim() < 2 || !enabled(device)? {
            return Ok(None);
        }
        let mut order: Vec<i64> = (0..x.dim() as i64).filter(|&d| d != 1).collect();
        order.push(1);
        let size = x.size();
        let channels = size[1];
        let rows = if channels == 0 {
            0
        } else {
            x.numel() as i64 / channels
        };
        if rows < 2 || channels > i64::from(i32::MAX) || !x.f_permute(&order)?.is_contiguous() {
            return Ok(None);
        }
        // The kernels read x through a raw pointer: a deferred x gets its values (and address) now.
        crate::deferred::materialize(x)?;
        let vec = if channels % 8 == 0 && aligned(x) {
            8
        } else {
            1
        };
        let Device::Cuda(index) = device else {
            return Ok(None);
        };
        Ok(Some(Layout {
            shape: size,
            kind: x.kind(),
            device,
            order,
            rows,
            channels,
            kernels: Kernels::get(device, x.kind(), vec)?,
            vec,
            multiprocessors: i64::from(
                ffi::device::cuda_device_props(index)?
                    .multiprocessors
                    .max(1),
            ),
        }))
    }

    /// Why [`Layout::of`] found no layout for `x`.
    pub(super) fn declined(x: &Tensor) -> String {
        format!(
            "a {:?} input {:?} with strides {:?} on {:?} (the kernels take fp32, bf16 and fp16 \
             activations in channels-last memory with at least two rows, fp32 parameters, and \
             speedkit's kernels switched on)",
            x.kind(),
            x.size(),
            x.stride(),
            x.device()
        )
    }

    /// Whether `t` is laid out as the input (its matrix view contiguous and, where the kernels
    /// load 16 bytes at a time, aligned).
    pub(super) fn fits(&self, t: &Tensor) -> bool {
        let contiguous = t
            .f_permute(&self.order)
            .map(|m| m.is_contiguous())
            .unwrap_or(false);
        let readable = crate::deferred::materialize(t).is_ok();
        contiguous && readable && (self.vec == 1 || aligned(t))
    }

    /// `t` as the matrix [rows, channels] (a view of the same memory).
    pub(super) fn matrix(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.f_permute(&self.order)?
            .f_reshape([self.rows, self.channels])?)
    }

    /// Whether `t` has the input's type, shape and strides (and the alignment the kernels load at):
    /// a whole output of this layout, or a tensor that can stand beside it.
    pub(super) fn is_whole(&self, t: &Tensor) -> bool {
        t.kind() == self.kind
            && t.device() == self.device
            && t.size() == self.shape
            && t.stride() == self.strides()
            && (self.vec == 1 || aligned(t))
    }

    /// The input's strides: those of its matrix, contiguous, read back through the permutation.
    fn strides(&self) -> Vec<i64> {
        let mut strides = vec![0i64; self.order.len()];
        let mut stride = 1;
        for &dim in self.order.iter().rev() {
            strides[dim as usize] = stride;
            stride *= self.shape[dim as usize];
        }
        strides
    }

    /// The matrix `m` back in the input's shape and strides (a view).
    pub(super) fn unmatrix(&self, m: &Tensor) -> Result<Tensor> {
        let permuted: Vec<i64> = self.order.iter().map(|&d| self.shape[d as usize]).collect();
        let mut inverse = vec![0i64; self.order.len()];
        for (position, &dim) in self.order.iter().enumerate() {
            inverse[dim as usize] = position as i64;
        }
        Ok(m.f_view(permuted.as_slice())?.f_permute(&inverse)?)
    }

    /// Column groups per block row and block rows: `ct` × `256 / ct`, `ct` the power of two that
    /// covers the channels' groups, at most 32.
    pub(super) fn block(&self) -> (u32, u32) {
        let groups = (self.channels + self.vec - 1) / self.vec;
        let ct = (groups.min(32) as u64).next_power_of_two() as i64;
        (ct as u32, (THREADS / ct) as u32)
    }

    fn grid_x(&self) -> i64 {
        let groups = (self.channels + self.vec - 1) / self.vec;
        let (ct, _) = self.block();
        (groups + i64::from(ct) - 1) / i64::from(ct)
    }

    /// Strips of rows for a pass: enough blocks to fill the GPU eight times over, at least four
    /// rows per thread, at most 65535 (the grid's y).
    fn strips(&self) -> (i64, i64) {
        let rows_per_pass = i64::from(self.block().1);
        let wanted = (8 * self.multiprocessors / self.grid_x()).max(1);
        let most = ((self.rows + 4 * rows_per_pass - 1) / (4 * rows_per_pass)).clamp(1, 65535);
        let strips = wanted.min(most);
        let strip_rows = (self.rows + strips - 1) / strips;
        let strip_rows = (strip_rows + rows_per_pass - 1) / rows_per_pass * rows_per_pass;
        ((self.rows + strip_rows - 1) / strip_rows, strip_rows)
    }

    pub(super) fn elementwise_grid(&self) -> (u32, u32) {
        (self.grid_x() as u32, self.strips().0 as u32)
    }

    pub(super) fn finish_grid(&self) -> u32 {
        ((self.channels + i64::from(FINISH) - 1) / i64::from(FINISH)) as u32
    }

    /// The partial sums of a partials pass (StatsPartials, BackwardPartials), not yet written.
    pub(super) fn partials(&self) -> Result<Partials> {
        let (strips, strip_rows) = self.strips();
        let sums = Tensor::f_empty([strips, 2, self.channels], (Kind::Float, self.device))?;
        Ok(Partials {
            sums,
            strips,
            strip_rows,
        })
    }

    /// A partials pass's grid: the column groups' blocks × the strips.
    pub(super) fn partials_grid(&self, partials: &Partials) -> (u32, u32) {
        (self.grid_x() as u32, partials.strips as u32)
    }
}

/// Whether `t`'s data starts on a 16-byte boundary (the kernels' vector loads). A pending deferred
/// tensor has no address yet: the callers that ask about one ask about a whole output of this
/// module, whose memory will come from the allocator, aligned.
fn aligned(t: &Tensor) -> bool {
    match crate::deferred::is_pending(t) {
        Ok(true) => true,
        _ => t.data_ptr() as usize % 16 == 0,
    }
}

/// Whether speedkit's kernels run on `device` with BatchNorm's switched on.
fn enabled(device: Device) -> Result<bool> {
    Ok(crate::kernels::op_enabled(KernelOp::BatchNorm)
        && crate::kernels::unavailable_reason(device)?.is_none())
}

/// The kernels for one activation type and column group width on one device.
pub(super) struct Kernels {
    pub(super) stats_partials: TypedKernel<StatsPartials<'static>>,
    pub(super) stats_finish: TypedKernel<StatsFinish<'static>>,
    /// The normalisation, by [ReLU or not][what it adds: nothing, a tensor, a normalisation].
    pub(super) normalize: [[TypedKernel<Normalize<'static>>; 3]; 2],
    pub(super) backward_partials: TypedKernel<BackwardPartials<'static>>,
    pub(super) backward_finish: TypedKernel<BackwardFinish<'static>>,
    pub(super) backward_input: TypedKernel<BackwardInput<'static>>,
}

impl Kernels {
    /// Compiled and loaded once per (device, type, width): the first call compiles with NVRTC (or
    /// reads the on-disk cache), later ones are a lookup.
    fn get(device: Device, kind: Kind, vec: i64) -> Result<Arc<Kernels>> {
        type Loaded = Mutex<Vec<((Device, Kind, i64), Arc<Kernels>)>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let mut loaded = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let key = (device, kind, vec);
        if let Some((_, k)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(k));
        }
        let tag = type_tag(kind).ok_or_else(|| {
            SpeedkitError::Misuse(format!("BatchNorm's kernels take no {kind:?} activations"))
        })?;
        let module = CudaModule::built_in(SOURCE_NAME)?;
        let per_width = format!("_{tag}_v{vec}");
        let normalize =
            |relu: u8, add: u8| load(&module, &format!("{per_width}_r{relu}_a{add}"), device);
        let kernels = Arc::new(Kernels {
            stats_partials: load(&module, &per_width, device)?,
            stats_finish: load(&module, &format!("_{tag}"), device)?,
            normalize: [
                [normalize(0, 0)?, normalize(0, 1)?, normalize(0, 2)?],
                [normalize(1, 0)?, normalize(1, 1)?, normalize(1, 2)?],
            ],
            backward_partials: load(&module, &per_width, device)?,
            backward_finish: load(&module, "", device)?,
            backward_input: load(&module, &per_width, device)?,
        });
        loaded.push((key, Arc::clone(&kernels)));
        Ok(kernels)
    }
}

/// The entry point of `P`'s kernel named `P::NAME` then `suffix` (`_<type tag>`, `_v<width>`, ...,
/// as the source's entry-point macros spell it).
fn load<P: Entry>(module: &CudaModule, suffix: &str, device: Device) -> Result<TypedKernel<P>> {
    module.typed_kernel(&format!("{}{suffix}", P::NAME), device)
}
