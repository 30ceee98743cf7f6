//! Deferred tensors: an output whose memory and values come at its first read by an operator.
//!
//! A fused op often makes an intermediate that its usual consumer never needs written: a
//! classifier's fp32 log-probabilities, which a fused cross-entropy recomputes from the logits
//! and a log-sum-exp per row (speedkit's own `cross_entropy` override does this for `log_softmax`, 1.6 GB unwritten at
//! GPT-2's size). Returning it [deferred](tensor) keeps the op exact for every other caller: the
//! tensor has its sizes, type and device from the start, and the first operator that reads it or
//! any view of it (every dispatcher call that takes it, except the consumers named as exempt and
//! the operators that only make views of it: `view`, `permute`, `narrow`, `detach`, ...) first
//! gives it memory from the device's allocator and runs your writer on it, on that operator's
//! thread and current stream, so also inside a CUDA graph capture. The writer runs at most once;
//! if the tensor dies unread, it never runs and nothing was allocated. A fused consumer recognises
//! its producer's output by the [tag](tagged) the producer gave it.
//!
//! While a deferred tensor is pending, every operator of the process is observed (a RecordFunction
//! callback with its inputs, a few microseconds per call); the observer exists only then. A read
//! that bypasses operators — a raw pointer handed to a kernel — needs [`materialize`] first
//! (speedkit's [`CudaKernel::launch`](crate::cuda::CudaKernel::launch) does it for its arguments);
//! without it the read fails with ATen's "data is not allocated yet", never reading stale memory.
//!
//! ```
//! use speedkit::deferred;
//! use tch::{Device, Kind, Tensor};
//!
//! // A [2, 3] tensor whose values (0, 1, ..., 5) are written only when something reads them.
//! let t = deferred::tensor(&[2, 3], Kind::Float, Device::Cpu, &["aten::nll_loss"], |t| {
//!     t.shallow_clone().f_copy_(&Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]))?;
//!     Ok(())
//! })?;
//! assert!(deferred::is_pending(&t)?);
//! assert_eq!(t.sum(Kind::Float).double_value(&[]), 15.0);   // the read writes it first
//! assert!(!deferred::is_pending(&t)?);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::ffi;

/// A contiguous tensor of `sizes`, `kind` and `device` with no memory yet (see the
/// [module docs](self)). `write` gives it its values when the first operator not among
/// `exempt_ops` (full operator names without an overload, such as `"aten::nll_loss"`) reads it;
/// an exempt operator must not read its data (an override of that operator that recomputes what
/// it needs). An error from `write` leaves the tensor filled with NaN, with a warning naming it.
pub fn tensor(
    sizes: &[i64],
    kind: Kind,
    device: Device,
    exempt_ops: &[&str],
    write: impl FnMut(&Tensor) -> Result<()> + Send + 'static,
) -> Result<Tensor> {
    ffi::deferred::deferred(sizes, kind, device, exempt_ops, 0, write)
}

/// As [`tensor`], with a `tag` of the caller's choosing that [`tag`] reads back while the tensor
/// is pending: how the override of an exempt operator recognises the output it fuses with (and
/// finds, by the tag, what it needs to compute its result without reading the tensor).
///
/// ```
/// use speedkit::deferred;
/// use tch::{Device, Kind};
///
/// let t = deferred::tagged(&[3], Kind::Float, Device::Cpu, &["aten::relu"], 42, |t| {
///     let _ = t.shallow_clone().f_fill_(-1.0)?;
///     Ok(())
/// })?;
/// assert_eq!(deferred::tag(&t.view([1, 3]))?, Some(42)); // a view has it too
/// assert_eq!(t.sum(Kind::Float).double_value(&[]), -3.0); // the read writes it
/// assert_eq!(deferred::tag(&t)?, None);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn tagged(
    sizes: &[i64],
    kind: Kind,
    device: Device,
    exempt_ops: &[&str],
    tag: u64,
    write: impl FnMut(&Tensor) -> Result<()> + Send + 'static,
) -> Result<Tensor> {
    ffi::deferred::deferred(sizes, kind, device, exempt_ops, tag, write)
}

/// The tag given to [`tagged`] of the deferred tensor that `t` is or views, while it is pending;
/// `None` for any other tensor (and `Some(0)` for one made by [`tensor`]).
///
/// ```
/// # use tch::{Device, Kind, Tensor};
/// assert_eq!(speedkit::deferred::tag(&Tensor::zeros([2], (Kind::Float, Device::Cpu)))?, None);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn tag(t: &Tensor) -> Result<Option<u64>> {
    ffi::deferred::tag(t)
}

/// Declares what the pending deferred tensor `t` is computed from, so that it never sees them
/// changed: an operator that writes one of `sources` in place (an argument its schema marks as
/// written: `add_`'s `self`, an `out=`) first writes `t`, from the values they have before that
/// write. A source written where no operator is seen (a kernel on a raw pointer that moves the
/// version counter, as speedkit's optimizers do) leaves `t` reading as NaN, with a warning naming
/// it, rather than values computed from the new contents. Once per tensor.
///
/// ```
/// use speedkit::deferred;
/// use tch::{Device, Kind, Tensor};
///
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu));
/// let source = x.shallow_clone();
/// let doubled = deferred::tensor(&[3], Kind::Float, Device::Cpu, &[], move |t| {
///     let _ = t.shallow_clone().f_copy_(&(&source * 2.0))?;
///     Ok(())
/// })?;
/// deferred::computed_from(&doubled, &[&x])?;
/// let _ = x.shallow_clone().fill_(5.0);               // writes `doubled` first, from the ones
/// assert_eq!(doubled.sum(Kind::Float).double_value(&[]), 6.0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn computed_from(t: &Tensor, sources: &[&Tensor]) -> Result<()> {
    ffi::deferred::computed_from(t, sources)
}

/// Whether `t` (or the tensor it is a view of) is deferred and not yet written.
///
/// ```
/// # use tch::{Device, Kind, Tensor};
/// assert!(!speedkit::deferred::is_pending(&Tensor::zeros([2], (Kind::Float, Device::Cpu)))?);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn is_pending(t: &Tensor) -> Result<bool> {
    ffi::deferred::is_pending(t)
}

/// Writes `t` now if it is deferred and pending, before a read that no operator makes (a raw
/// pointer); whether it was pending.
///
/// ```
/// # use tch::{Device, Kind, Tensor};
/// let t = speedkit::deferred::tensor(&[4], Kind::Float, Device::Cpu, &[], |t| {
///     let _ = t.shallow_clone().f_fill_(1.0)?;
///     Ok(())
/// })?;
/// assert!(speedkit::deferred::materialize(&t)?);
/// assert!(!speedkit::deferred::materialize(&t)?);   // already written
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn materialize(t: &Tensor) -> Result<bool> {
    ffi::deferred::materialize(t)
}

/// How many deferred tensors are pending in the process, and whether the operator observer is
/// registered (exactly while some are).
///
/// ```
/// let (pending, observing) = speedkit::deferred::pending()?;
/// assert_eq!(observing, pending > 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn pending() -> Result<(i64, bool)> {
    ffi::deferred::pending()
}
