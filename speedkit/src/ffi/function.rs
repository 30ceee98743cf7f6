//! Autograd functions written in Rust and activation checkpointing (`shim/function.cpp`): the
//! C ABI's callbacks as Rust trampolines over a [`Callbacks`] implementation, and the calls a
//! callback makes back into its node.
//!
//! A trampoline never unwinds into C++: a panic in the Rust code is caught and reported through
//! `sk_function_call_fail`, as an error is, and becomes a C++ exception there, which autograd carries
//! to whoever started the pass.

use std::ffi::{c_int, c_void, CString};
use std::panic::{self, AssertUnwindSafe};
use std::ptr;

use tch::Tensor;

use super::{
    c_string, check, handle, optional_handle, owned_or_none, panic_text, raw, raw::function as abi,
    Borrowed, Result,
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

    pub(crate) fn may_overwrite(&self, tensor: &Tensor) -> Result<bool> {
        let mut out = 0;
        // SAFETY: a live call, a live tensor, a valid out-pointer.
        check(unsafe { abi::sk_function_call_may_overwrite(self.0, handle(tensor), &mut out) })?;
        Ok(out != 0)
    }

    fn hand_back<'t>(
        &self,
        results: impl ExactSizeIterator<Item = Option<&'t Tensor>>,
    ) -> Result<()> {
        if results.len() > MAX_OUTPUTS {
            return Err(SpeedkitError::Misuse(format!(
                "a Function hands back at most {MAX_OUTPUTS} tensors, this one {}",
                results.len()
            )));
        }
        // On the stack: a node's every call passes through here.
        let mut handles = [ptr::null_mut(); MAX_OUTPUTS];
        let mut n = 0;
        for (slot, result) in handles.iter_mut().zip(results) {
            *slot = optional_handle(result);
            n += 1;
        }
        // SAFETY: a live call; the shim copies the tensors.
        check(unsafe { abi::sk_function_call_set_results(self.0, handles.as_ptr(), n as i64) })
    }

    fn fail(&self, message: &str) {
        let message = c_string(message).unwrap_or_default();
        // SAFETY: a live call, a NUL-terminated message the shim copies. Nothing to report to if it
        // fails: the callback's non-zero status says it failed either way.
        let _ = unsafe { abi::sk_function_call_fail(self.0, message.as_ptr()) };
    }
}

/// The tensors of a handle array the shim passed in (null: absent), borrowed.
///
/// # Safety
/// `handles` must point at `n` handles, each null or a live tensor that outlives the result.
unsafe fn tensors_in(handles: *const raw::sk_tensor, n: i64) -> Borrowed<Option<Tensor>> {
    let n = usize::try_from(n).unwrap_or(0);
    if n == 0 {
        return Borrowed(Vec::new());
    }
    Borrowed(
        std::slice::from_raw_parts(handles, n)
            .iter()
            .map(|&h| (!h.is_null()).then(|| Tensor::from_ptr(h)))
            .collect(),
    )
}

/// [`tensors_in`] without the absent ones (a forward's inputs).
///
/// # Safety
/// As [`tensors_in`].
unsafe fn defined_tensors_in(handles: *const raw::sk_tensor, n: i64) -> Borrowed<Tensor> {
    let n = usize::try_from(n).unwrap_or(0);
    if n == 0 {
        return Borrowed(Vec::new());
    }
    Borrowed(
        std::slice::from_raw_parts(handles, n)
            .iter()
            .filter(|h| !h.is_null())
            .map(|&h| Tensor::from_ptr(h))
            .collect(),
    )
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
            call.fail(&format!("{what} panicked: {}", panic_text(&*panic)));
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
    // SAFETY: the shim passes `n` handles, held for the callback.
    let inputs = defined_tensors_in(inputs, n);
    report(&call, "forward", || {
        let outputs = callbacks.forward(&call, &inputs.0)?;
        call.hand_back(outputs.iter().map(Some))
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
    // SAFETY: the shim passes `n` handles held for the callback, null where an output got no
    // gradient.
    let grads = tensors_in(grad_outputs, n);
    report(&call, "backward", || {
        let input_grads = callbacks.backward(&call, &grads.0)?;
        call.hand_back(input_grads.iter().map(Option::as_ref))
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
#[derive(Clone, Debug)]
pub(crate) enum Node {
    /// A node whose backward is the callbacks' (`cast_inputs`: a ScalarType code, or -1;
    /// `once_differentiable`: the function's name where its backward is not differentiable again).
    Function {
        cast_inputs: c_int,
        once_differentiable: Option<CString>,
    },
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
    let mut outputs = [ptr::null_mut(); MAX_OUTPUTS];
    let mut count = 0i64;
    // SAFETY: live handles for the call; `state` is handed over to the node, which frees it
    // through `drop_trampoline` (also when this fails); `outputs` has the capacity passed.
    let status = unsafe {
        match node {
            Node::Function {
                cast_inputs,
                once_differentiable,
            } => abi::sk_function_apply(
                &table,
                state,
                cast_inputs,
                once_differentiable
                    .as_ref()
                    .map_or(ptr::null(), |name| name.as_ptr()),
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
    let count = usize::try_from(count).unwrap_or(0).min(MAX_OUTPUTS);
    // SAFETY: fresh tensors from the shim, each taken once; an undefined output is null.
    let owned: Vec<Option<Tensor>> = outputs[..count]
        .iter()
        .map(|&t| unsafe { owned_or_none(t) })
        .collect();
    owned
        .into_iter()
        .map(|t| {
            t.ok_or_else(|| SpeedkitError::Misuse("a Function returned an undefined output".into()))
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
