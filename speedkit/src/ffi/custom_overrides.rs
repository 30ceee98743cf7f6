//! A Rust kernel as an ATen operator's implementation (`shim/custom_overrides.cpp`): the
//! registration, and the trampoline that turns one dispatcher call into a call of an
//! [`OverrideKernel`].
//!
//! The trampoline never unwinds into C++: a panic in the kernel is caught and reported through
//! `sk_override_call_fail`, as an error is, and reaches the operator's caller as libtorch's error.

use std::ffi::{c_int, c_void, CStr};
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::sync::Arc;

use tch::Tensor;

use super::{c_string, check, handle, panic_text, raw, raw::custom_overrides as abi, Borrowed};
use super::{raw::sk_override_arg, Result};

/// One argument of an operator call, as its schema types it.
#[derive(Clone, Copy, Debug)]
pub enum Value<'a> {
    /// An absent optional (`None`).
    None,
    /// A tensor.
    Tensor(&'a Tensor),
    /// An integer (also a `ScalarType`, as its code: see [`OverrideCall::kind`](crate::overrides::OverrideCall::kind)).
    Int(i64),
    /// A float.
    Double(f64),
    /// A boolean.
    Bool(bool),
    /// A list of integers (sizes, dimensions).
    Ints(&'a [i64]),
    /// A list of booleans (an `output_mask`).
    Bools(&'a [bool]),
    /// A string (`approximate="tanh"`).
    Str(&'a str),
    /// Anything else (a device, a layout, a list of tensors), named by its type.
    Other(&'a str),
}

/// What the shim calls: one operator call's arguments (schema name and value, in the schema's
/// order) in, the operator's results out, or `None` to hand the call to the kernel it replaced.
/// Calls may come from any thread, also at once, hence `Send + Sync`.
pub(crate) trait OverrideKernel: Send + Sync {
    fn call(&self, args: &[(&str, Value<'_>)]) -> Result<Option<Vec<Tensor>>>;
}

/// A registration's handle; removing it brings back the kernel it replaced.
pub(crate) struct Registration(*mut c_void);

// SAFETY: the handle is only passed back to the shim, whose dispatcher registrations may be
// removed from any thread.
unsafe impl Send for Registration {}
// SAFETY: no method reads through the handle.
unsafe impl Sync for Registration {}

impl Registration {
    /// Removes the registration, once.
    pub(crate) fn remove(mut self) -> Result<()> {
        self.remove_once()
    }

    fn remove_once(&mut self) -> Result<()> {
        let handle = std::mem::replace(&mut self.0, ptr::null_mut());
        if handle.is_null() {
            return Ok(());
        }
        // SAFETY: a live registration from `register`, removed once (the handle is cleared).
        check(unsafe { abi::sk_custom_override_remove(handle) })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.remove_once() {
            // A kernel left registered is global state changed behind the user's back: say so.
            eprintln!("speedkit: WARNING: an operator override could not be removed: {e}");
        }
    }
}

/// Registers `kernel` as operator `name` (overload `overload`) under dispatch key `key` (an
/// `sk_dispatch_key`), shown by the dispatcher as registered at `file`:`line`.
pub(crate) fn register(
    name: &str,
    overload: &str,
    key: c_int,
    (file, line): (&str, u32),
    kernel: Arc<dyn OverrideKernel>,
) -> Result<Registration> {
    let (name, overload, file) = (c_string(name)?, c_string(overload)?, c_string(file)?);
    let line = c_int::try_from(line).unwrap_or(c_int::MAX);
    let state = Box::into_raw(Box::new(kernel)) as *mut c_void;
    let vtable = raw::sk_override_vtable {
        kernel: Some(kernel_trampoline),
        drop: Some(drop_trampoline),
    };
    let mut out = ptr::null_mut();
    // SAFETY: NUL-terminated strings alive for the call; `state` is handed over (the shim frees it
    // through `drop_trampoline`, also when this fails); valid out-pointer.
    check(unsafe {
        abi::sk_custom_override_register(
            name.as_ptr(),
            overload.as_ptr(),
            key,
            file.as_ptr(),
            line,
            &vtable,
            state,
            &mut out,
        )
    })?;
    Ok(Registration(out))
}

/// One call's handle: valid for the duration of the callback.
struct Call(*mut c_void);

impl Call {
    fn set_results(&self, results: &[Tensor]) -> Result<()> {
        let handles: Vec<raw::sk_tensor> = results.iter().map(handle).collect();
        // SAFETY: a live call; the shim copies the tensors.
        check(unsafe {
            abi::sk_override_call_set_results(self.0, handles.as_ptr(), handles.len() as i64)
        })
    }

    fn decline(&self) -> Result<()> {
        // SAFETY: a live call.
        check(unsafe { abi::sk_override_call_decline(self.0) })
    }

    fn fail(&self, message: &str) {
        let message = c_string(message).unwrap_or_default();
        // SAFETY: a live call, a NUL-terminated message the shim copies. The non-zero status says
        // the call failed whether or not the message arrives.
        let _ = unsafe { abi::sk_override_call_fail(self.0, message.as_ptr()) };
    }
}

/// The tensors among `args`, borrowed (`None` where an argument is not a tensor).
///
/// # Safety
/// Each tensor argument's handle must be live for the result's lifetime.
unsafe fn tensors_of(args: &[sk_override_arg]) -> Borrowed<Option<Tensor>> {
    Borrowed(
        args.iter()
            .map(|a| {
                (a.kind == raw::SK_VALUE_TENSOR && !a.tensor.is_null())
                    .then(|| Tensor::from_ptr(a.tensor))
            })
            .collect(),
    )
}

/// One argument's value, borrowing `tensor` (the argument's tensor, if it is one).
///
/// # Safety
/// `arg`'s pointers must be valid for `'a` as `arg.kind` says (the shim keeps them for the call).
unsafe fn value_of<'a>(arg: &'a sk_override_arg, tensor: Option<&'a Tensor>) -> Value<'a> {
    let text = || {
        if arg.text.is_null() {
            ""
        } else {
            CStr::from_ptr(arg.text).to_str().unwrap_or("")
        }
    };
    match (arg.kind, tensor) {
        (raw::SK_VALUE_TENSOR, Some(t)) => Value::Tensor(t),
        (raw::SK_VALUE_INT, _) => Value::Int(arg.int_value),
        (raw::SK_VALUE_DOUBLE, _) => Value::Double(arg.double_value),
        (raw::SK_VALUE_BOOL, _) => Value::Bool(arg.int_value != 0),
        (raw::SK_VALUE_INTS, _) if arg.n_ints == 0 || arg.ints.is_null() => Value::Ints(&[]),
        (raw::SK_VALUE_INTS, _) => {
            Value::Ints(std::slice::from_raw_parts(arg.ints, arg.n_ints as usize))
        }
        (raw::SK_VALUE_BOOLS, _) if arg.n_bools == 0 || arg.bools.is_null() => Value::Bools(&[]),
        // The shim writes each as 0 or 1, which is a valid `bool`.
        (raw::SK_VALUE_BOOLS, _) => Value::Bools(std::slice::from_raw_parts(
            arg.bools.cast::<bool>(),
            arg.n_bools as usize,
        )),
        (raw::SK_VALUE_STRING, _) => Value::Str(text()),
        (raw::SK_VALUE_NONE, _) => Value::None,
        _ => Value::Other(text()),
    }
}

unsafe extern "C" fn kernel_trampoline(
    state: *mut c_void,
    call: *mut c_void,
    args: *const sk_override_arg,
    n: i64,
) -> c_int {
    let call = Call(call);
    // SAFETY: `state` is the Box<Arc<dyn OverrideKernel>> `register` handed over, alive until
    // `drop_trampoline`; only shared references are taken (calls may overlap).
    let kernel = &*(state as *const Arc<dyn OverrideKernel>);
    let args: &[sk_override_arg] = match usize::try_from(n) {
        Ok(n) if n > 0 && !args.is_null() => std::slice::from_raw_parts(args, n),
        _ => &[],
    };
    // SAFETY: the shim keeps every argument alive for the callback.
    let tensors = tensors_of(args);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
        let named: Vec<(&str, Value<'_>)> = args
            .iter()
            .zip(&tensors.0)
            .map(|(arg, tensor)| {
                // SAFETY: as above; names are NUL-terminated schema names.
                let name = unsafe { CStr::from_ptr(arg.name) }.to_str().unwrap_or("");
                (name, unsafe { value_of(arg, tensor.as_ref()) })
            })
            .collect();
        match kernel.call(&named)? {
            Some(results) => call.set_results(&results),
            None => call.decline(),
        }
    }));
    match outcome {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            call.fail(&e.to_string());
            1
        }
        Err(panic) => {
            call.fail(&format!(
                "the Rust kernel panicked: {}",
                panic_text(&*panic)
            ));
            1
        }
    }
}

unsafe extern "C" fn drop_trampoline(state: *mut c_void) {
    // SAFETY: the Box handed over in `register`, dropped exactly once, by its registration.
    drop(Box::from_raw(state as *mut Arc<dyn OverrideKernel>));
}
