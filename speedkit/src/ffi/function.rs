//! Autograd functions written in Rust and activation checkpointing (`shim/function.cpp`): the
//! C ABI's callbacks as Rust trampolines over a [`Callbacks`] implementation, and the calls a
//! callback makes back into its node.
//!
//! A trampoline never unwinds into C++: a panic in the Rust code is caught and reported through
//! `sk_function_call_fail`, as an error is, and becomes a C++ exception there, which autograd carries
//! to whoever started the pass.

use std::ffi::{c_int, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::ptr;

use tch::Tensor;

use super::{
    c_string, check, handle, optional_handle, owned_or_none, raw, raw::function as abi, Result,
};
use crate::error::SpeedkitError;

/// The most outputs a function may return (the ABI's buffer).
const MAX_OUTPUTS: usize = 64;

/// What the shim calls back: a forward, and (for a function with a hand-written gradient) a
/// backward. Calls never overlap (the node serialises them), but may come from autograd's worker
/// thread, hence `Send`.
pub(crate) trait Callbacks: Send {
    fn forward(&mut self, call: &Call, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    fn backward(
        &mut self,
        call: &Call,
        grad_outputs: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>>;
}

/// One callback's handle on its node: valid for the duration of the callback.
pub(crate) struct Call(*mut c_void);

impl Call {
    pub(crate) fn save_for_backward(&self, tensors: &[&Tensor]) -> Result<()> {
        let handles: Vec<raw::sk_tensor> = tensors.iter().map(|t| handle(t)).collect();
        // SAFETY: a live call (inside its callback) and live handles for the call.
        check(unsafe {
            abi::sk_function_call_save_for_backward(self.0, handles.as_ptr(), handles.len() as i64)
        })
    }

    pub(crate) fn mark_non_differentiable(&self, tensors: &[&Tensor]) -> Result<()> {
        let handles: Vec<raw::sk_tensor> = tensors.iter().map(|t| handle(t)).collect();
        // SAFETY: as above.
        check(unsafe {
            abi::sk_function_call_mark_non_differentiable(
                self.0,
                handles.as_ptr(),
                handles.len() as i64,
            )
        })
    }

    pub(crate) fn set_materialize_grads(&self, value: bool) -> Result<()> {
        // SAFETY: a live call.
        check(unsafe { abi::sk_function_call_set_materialize_grads(self.0, c_int::from(value)) })
    }

    pub(crate) fn saved(&self) -> Result<Vec<Tensor>> {
        let mut out = vec![ptr::null_mut(); MAX_OUTPUTS];
        let mut count = 0i64;
        // SAFETY: a live call; `out` has the capacity passed, filled with fresh tensors.
        check(unsafe {
            abi::sk_function_call_saved(self.0, out.as_mut_ptr(), out.len() as i64, &mut count)
        })?;
        out.truncate(usize::try_from(count).unwrap_or(0));
        // SAFETY: fresh tensors from the shim (null for a saved undefined tensor, never expected).
        Ok(out
            .into_iter()
            .filter_map(|t| unsafe { owned_or_none(t) })
            .collect())
    }

    pub(crate) fn needs_input_grad(&self, index: usize) -> Result<bool> {
        let mut out = 0;
        // SAFETY: a live call, a valid out-pointer.
        check(unsafe { abi::sk_function_call_needs_input_grad(self.0, index as i64, &mut out) })?;
        Ok(out != 0)
    }

    fn hand_back(&self, results: &[Option<&Tensor>]) -> Result<()> {
        let handles: Vec<raw::sk_tensor> = results.iter().map(|t| optional_handle(*t)).collect();
        // SAFETY: a live call; the shim copies the tensors.
        check(unsafe {
            abi::sk_function_call_set_results(self.0, handles.as_ptr(), handles.len() as i64)
        })
    }

    fn fail(&self, message: &str) {
        let message = c_string(message).unwrap_or_default();
        // SAFETY: a live call, a NUL-terminated message the shim copies. Nothing to report to if it
        // fails: the callback's non-zero status says it failed either way.
        let _ = unsafe { abi::sk_function_call_fail(self.0, message.as_ptr()) };
    }
}

/// The tensors of a handle array the shim passed in (null: absent), as shallow clones.
///
/// # Safety
/// `handles` must point at `n` handles, each null or a live tensor, for the call.
unsafe fn tensors_in(handles: *const raw::sk_tensor, n: i64) -> Vec<Option<Tensor>> {
    let n = usize::try_from(n).unwrap_or(0);
    if n == 0 {
        return Vec::new();
    }
    std::slice::from_raw_parts(handles, n)
        .iter()
        .map(|&h| (!h.is_null()).then(|| Tensor::clone_from_ptr(h)))
        .collect()
}

/// Runs `body`, reporting its error or panic through `call`; the callback's status.
fn report(call: &Call, what: &str, body: impl FnOnce() -> Result<()>) -> c_int {
    match panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            call.fail(&format!("{what}: {e}"));
            1
        }
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            call.fail(&format!("{what} panicked: {text}"));
            1
        }
    }
}

unsafe extern "C" fn forward_trampoline<C: Callbacks>(
    state: *mut c_void,
    call: *mut c_void,
    inputs: *const raw::sk_tensor,
    n: i64,
) -> c_int {
    let call = Call(call);
    // SAFETY: `state` is the Box<C> this module handed over, alive until `drop_trampoline`; calls
    // never overlap, so this is the only reference.
    let callbacks = &mut *(state as *mut C);
    // SAFETY: the shim passes `n` live handles.
    let inputs: Vec<Tensor> = tensors_in(inputs, n).into_iter().flatten().collect();
    report(&call, "forward", || {
        let outputs = callbacks.forward(&call, &inputs)?;
        call.hand_back(&outputs.iter().map(Some).collect::<Vec<_>>())
    })
}

unsafe extern "C" fn backward_trampoline<C: Callbacks>(
    state: *mut c_void,
    call: *mut c_void,
    grad_outputs: *const raw::sk_tensor,
    n: i64,
) -> c_int {
    let call = Call(call);
    // SAFETY: as in `forward_trampoline`.
    let callbacks = &mut *(state as *mut C);
    // SAFETY: the shim passes `n` handles, null where an output got no gradient.
    let grads = tensors_in(grad_outputs, n);
    report(&call, "backward", || {
        let input_grads = callbacks.backward(&call, &grads)?;
        call.hand_back(&input_grads.iter().map(Option::as_ref).collect::<Vec<_>>())
    })
}

unsafe extern "C" fn drop_trampoline<C: Callbacks>(state: *mut c_void) {
    // SAFETY: the Box<C> handed over in `apply`, dropped exactly once, by its node.
    drop(Box::from_raw(state as *mut C));
}

fn vtable<C: Callbacks>() -> raw::sk_function_vtable {
    raw::sk_function_vtable {
        forward: Some(forward_trampoline::<C>),
        backward: Some(backward_trampoline::<C>),
        drop: Some(drop_trampoline::<C>),
    }
}

/// How the shim applies the callbacks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Node {
    /// A node whose backward is the callbacks' (`cast_inputs`: a ScalarType code, or -1).
    Function { cast_inputs: c_int },
    /// A checkpoint: the forward again in the backward pass, back-propagated through.
    Checkpoint,
}

/// Applies `callbacks` to `inputs` as one autograd node; its outputs.
pub(crate) fn apply<C: Callbacks + 'static>(
    callbacks: C,
    node: Node,
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>> {
    let handles: Vec<raw::sk_tensor> = inputs.iter().map(|t| handle(t)).collect();
    let state = Box::into_raw(Box::new(callbacks)) as *mut c_void;
    let table = vtable::<C>();
    let mut outputs = vec![ptr::null_mut(); MAX_OUTPUTS];
    let mut count = 0i64;
    // SAFETY: live handles for the call; `state` is handed over to the node, which frees it
    // through `drop_trampoline` (also when this fails); `outputs` has the capacity passed.
    let status = unsafe {
        match node {
            Node::Function { cast_inputs } => abi::sk_function_apply(
                &table,
                state,
                cast_inputs,
                handles.as_ptr(),
                handles.len() as i64,
                outputs.as_mut_ptr(),
                outputs.len() as i64,
                &mut count,
            ),
            Node::Checkpoint => abi::sk_checkpoint_apply(
                &table,
                state,
                c_int::from(crate::graph::is_capturing()),
                handles.as_ptr(),
                handles.len() as i64,
                outputs.as_mut_ptr(),
                outputs.len() as i64,
                &mut count,
            ),
        }
    };
    check(status)?;
    outputs.truncate(usize::try_from(count).unwrap_or(0));
    // SAFETY: fresh tensors from the shim; an undefined output is null.
    outputs
        .into_iter()
        .map(|t| {
            unsafe { owned_or_none(t) }.ok_or_else(|| {
                SpeedkitError::Misuse("a Function returned an undefined output".into())
            })
        })
        .collect()
}

/// `x · k` through the C++ twin of a one-line Rust function.
pub(crate) fn reference_scale(x: &Tensor, k: f64) -> Result<Tensor> {
    let mut y = ptr::null_mut();
    // SAFETY: a live handle for the call; `y` receives a fresh tensor.
    check(unsafe { abi::sk_function_reference_scale(handle(x), k, &mut y) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { super::owned(y) })
}
