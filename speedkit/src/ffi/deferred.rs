//! Deferred tensors (`shim/deferred.cpp`): a tensor whose memory and values come at its first read
//! by an operator, written then by a Rust closure. A fused op returns one for an output that its
//! fused consumer never needs written, and pays for it only where something else reads it.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{self, AssertUnwindSafe};

use tch::{Device, Kind, Tensor};

use super::{
    c_string, check, device_index, handle, owned, panic_text, raw, raw::deferred as abi,
    scalar_type_code, write_message, Borrowed, Result,
};

/// What writes a deferred tensor's values into its fresh memory; runs at most once, on the thread
/// of the operator that reads it first (possibly autograd's).
type Materialize = Box<dyn FnMut(&Tensor) -> Result<()> + Send>;

/// A contiguous tensor of `sizes` and `kind` on `device` with no memory yet: the first operator
/// that reads it or a view of it, other than the `exempt_ops` (consumers that never read its data,
/// e.g. `aten::nll_loss`), first gives it memory and runs `materialize` on it. `tag` is returned
/// by [`tag`] while it is pending.
pub(crate) fn deferred(
    sizes: &[i64],
    kind: Kind,
    device: Device,
    exempt_ops: &[&str],
    tag: u64,
    materialize: impl FnMut(&Tensor) -> Result<()> + Send + 'static,
) -> Result<Tensor> {
    let device = match device {
        Device::Cuda(i) => device_index(i)?,
        _ => -1,
    };
    if let Some(op) = exempt_ops.iter().find(|op| op.contains(',')) {
        return Err(crate::error::SpeedkitError::Misuse(format!(
            "`{op}` is not an operator name (it holds a comma)"
        )));
    }
    let exempt_ops = c_string(&exempt_ops.join(","))?;
    let state: Box<Materialize> = Box::new(Box::new(materialize));
    let vtable = raw::sk_deferred_vtable {
        materialize: Some(materialize_trampoline),
        release: Some(release_trampoline),
    };
    let mut out = std::ptr::null_mut();
    // SAFETY: valid sizes, vtable and out-pointer; the state is handed over (released by the shim
    // through `release_trampoline`, also when this fails); on success `out` is a fresh tensor.
    check(unsafe {
        abi::sk_deferred_new(
            sizes.as_ptr(),
            sizes.len() as i64,
            scalar_type_code(kind)?,
            device,
            exempt_ops.as_ptr(),
            tag,
            &vtable,
            Box::into_raw(state) as *mut c_void,
            &mut out,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}

/// Declares what pending `tensor` is computed from: an operator writing one of `sources` in place
/// first materializes it; a write no operator made leaves it NaN with a warning.
pub(crate) fn computed_from(tensor: &Tensor, sources: &[&Tensor]) -> Result<()> {
    let handles: Vec<_> = sources.iter().map(|t| handle(t)).collect();
    // SAFETY: live tensors borrowed for the call; the shim keeps its own references.
    check(unsafe {
        abi::sk_deferred_computed_from(handle(tensor), handles.as_ptr(), handles.len() as i64)
    })
}

/// Materializes `tensor` now if it is deferred and pending, before a read that no operator makes
/// (a kernel's raw pointer); whether it was pending.
pub(crate) fn materialize(tensor: &Tensor) -> Result<bool> {
    let mut out = 0;
    // SAFETY: a live tensor and a valid out-pointer.
    check(unsafe { abi::sk_deferred_materialize(handle(tensor), &mut out) })?;
    Ok(out != 0)
}

/// Whether `tensor` (or the tensor it views) is deferred and not yet materialized.
pub(crate) fn is_pending(tensor: &Tensor) -> Result<bool> {
    let mut out = 0;
    // SAFETY: a live tensor and a valid out-pointer.
    check(unsafe { abi::sk_deferred_is_pending(handle(tensor), &mut out) })?;
    Ok(out != 0)
}

/// The tag of the deferred tensor that `tensor` is or views, while it is pending.
pub(crate) fn tag(tensor: &Tensor) -> Result<Option<u64>> {
    let (mut pending, mut tag) = (0 as c_int, 0u64);
    // SAFETY: a live tensor and valid out-pointers.
    check(unsafe { abi::sk_deferred_tag(handle(tensor), &mut pending, &mut tag) })?;
    Ok((pending != 0).then_some(tag))
}

/// How many deferred tensors are pending in the process, and whether the shim's operator observer
/// is registered (exactly while some are).
pub(crate) fn pending() -> Result<(i64, bool)> {
    let (mut count, mut observing) = (0i64, 0 as c_int);
    // SAFETY: valid out-pointers.
    check(unsafe { abi::sk_deferred_pending(&mut count, &mut observing) })?;
    Ok((count, observing != 0))
}

unsafe extern "C" fn materialize_trampoline(
    state: *mut c_void,
    tensor: raw::sk_tensor,
    message: *mut c_char,
    capacity: i64,
) -> c_int {
    // SAFETY: `state` is the Box<Materialize> handed over in `deferred`, alive until
    // `release_trampoline`; the shim serialises materializations.
    let materialize = &mut *(state as *mut Materialize);
    // SAFETY: the shim lends a live tensor for the call.
    let tensor = Borrowed(vec![Tensor::from_ptr(tensor)]);
    let failure = match panic::catch_unwind(AssertUnwindSafe(|| materialize(&tensor.0[0]))) {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => format!("panicked: {}", panic_text(&*panic)),
    };
    write_message(message, capacity, &failure);
    1
}

unsafe extern "C" fn release_trampoline(state: *mut c_void) {
    // SAFETY: the Box handed over in `deferred`, released exactly once, by the shim.
    drop(Box::from_raw(state as *mut Materialize));
}
