//! The whole FFI surface of speedkit: the shim's C ABI and thin safe wrappers over it, one module
//! per shim file (`speedkit/shim/<concept>.cpp` ↔ `ffi/<concept>.rs`).
//!
//! The ABI is declared once, in `speedkit/shim/speedkit.h`: every shim file includes it, so the C++
//! compiler refuses a definition that differs from it, and the build script generates the Rust
//! declarations ([`raw`]) from the same file, so Rust cannot drift from it either. Nothing outside
//! this module calls into C++. Every shim function catches C++ exceptions, so a failure here is an
//! ordinary `Err` ([`SpeedkitError::Torch`]), never an abort.

use std::ffi::{c_char, c_int, CStr, CString};
use std::ptr;

use tch::{Kind, Tensor};

use crate::error::SpeedkitError;

pub(crate) mod amp;
pub(crate) mod autograd;
pub(crate) mod bias_gelu;
pub(crate) mod classifier;
pub(crate) mod column_sums;
pub(crate) mod convolution;
pub(crate) mod custom_overrides;
pub(crate) mod deferred;
pub(crate) mod device;
pub(crate) mod distributed;
pub(crate) mod embedding;
pub(crate) mod flags;
pub(crate) mod fp8;
pub(crate) mod function;
pub(crate) mod graphs;
pub(crate) mod interposer;
pub(crate) mod kernels;
pub(crate) mod layernorm;
pub(crate) mod linear;
pub(crate) mod memory_history;
pub(crate) mod mlp;
pub(crate) mod nvtx;
pub(crate) mod optim;
pub(crate) mod overrides;
pub(crate) mod profiler;
pub(crate) mod random;
pub(crate) mod saved_offload;
pub(crate) mod sensors;
pub(crate) mod weight_casts;

/// The declarations generated from `speedkit/shim/speedkit.h` (speedkit-build's `abi` module): one
/// module per `// @module` section of the header, its structs and constants at the top.
#[allow(
    non_camel_case_types,
    dead_code,
    clippy::upper_case_acronyms,
    missing_docs
)]
pub(crate) mod raw {
    include!(concat!(env!("OUT_DIR"), "/speedkit_abi.rs"));
}

type Result<T> = std::result::Result<T, SpeedkitError>;

/// Turns a shim status into a `Result`, fetching the C++ message on failure.
fn check(status: c_int) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer into its thread-local error string, valid until the next
    // failing call on this thread; it is copied out at once.
    let message = unsafe { CStr::from_ptr(raw::errors::sk_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(SpeedkitError::Torch(message))
}

/// The shim's handle of a tensor (`at::Tensor*`), borrowed for the duration of one call. The shim
/// only reads or mutates the tensor in place; it never frees a handle it did not allocate.
fn handle(tensor: &Tensor) -> raw::sk_tensor {
    tensor.as_ptr() as raw::sk_tensor
}

/// [`handle`] of each tensor, for the shim's `const sk_tensor*` lists.
fn handles(tensors: &[Tensor]) -> Vec<raw::sk_tensor> {
    tensors.iter().map(handle).collect()
}

/// [`handle`], or the null handle the shim reads as "absent".
fn optional_handle(tensor: Option<&Tensor>) -> raw::sk_tensor {
    tensor.map_or(ptr::null_mut(), handle)
}

/// A tensor the shim allocated and handed over through an `sk_tensor*` out-parameter.
///
/// # Safety
/// `t` must be a fresh, non-null `at::Tensor*` from the shim, owned by nobody else.
unsafe fn owned(t: raw::sk_tensor) -> Tensor {
    Tensor::from_ptr(t)
}

/// As [`owned`], for an out-parameter the shim may leave null.
///
/// # Safety
/// `t` must be null or satisfy [`owned`]'s contract.
unsafe fn owned_or_none(t: raw::sk_tensor) -> Option<Tensor> {
    (!t.is_null()).then(|| Tensor::from_ptr(t))
}

/// The text of a `const char*` the shim handed out, copied; `None` for null or empty (the shim's
/// "no reason").
///
/// # Safety
/// `text` must be null or a NUL-terminated string alive for the call.
unsafe fn text(text: *const c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    let owned = CStr::from_ptr(text).to_string_lossy().into_owned();
    (!owned.is_empty()).then_some(owned)
}

/// Tensors the shim lends to a callback: the handles point at tensors C++ holds for the callback's
/// duration, so they are wrapped without a copy (no allocation, no reference count touched) and
/// forgotten, never freed, when the callback returns.
pub(crate) struct Borrowed<T>(pub(crate) Vec<T>);

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // C++ owns these tensors: forgetting the wrappers leaves them to it.
        for tensor in self.0.drain(..) {
            std::mem::forget(tensor);
        }
    }
}

/// A caught panic's message.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Writes `text` into a callback's message buffer of `capacity` bytes, cut to fit, NUL-terminated.
///
/// # Safety
/// `message` is null or points to `capacity` writable bytes.
unsafe fn write_message(message: *mut std::ffi::c_char, capacity: i64, text: &str) {
    let capacity = usize::try_from(capacity).unwrap_or(0);
    if capacity > 0 && !message.is_null() {
        let bytes = &text.as_bytes()[..text.len().min(capacity - 1)];
        // SAFETY: the buffer holds `capacity` bytes; at most capacity - 1 plus the NUL.
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), message as *mut u8, bytes.len());
        *message.add(bytes.len()) = 0;
    }
}

fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| SpeedkitError::Misuse(format!("{text:?} contains a NUL byte")))
}

/// c10's ScalarType code of a tensor kind speedkit passes across the ABI.
pub(crate) fn scalar_type_code(kind: Kind) -> Result<c_int> {
    Ok(match kind {
        Kind::Int64 => raw::SK_INT64,
        Kind::Half => raw::SK_FLOAT16,
        Kind::Float => raw::SK_FLOAT32,
        Kind::Double => raw::SK_FLOAT64,
        Kind::Bool => raw::SK_BOOL,
        Kind::BFloat16 => raw::SK_BFLOAT16,
        Kind::Float8e5m2 => raw::SK_FLOAT8_E5M2,
        Kind::Float8e4m3fn => raw::SK_FLOAT8_E4M3FN,
        other => {
            return Err(SpeedkitError::Unsupported(format!(
                "speedkit passes no {other:?} tensors across its C ABI"
            )))
        }
    })
}

/// The tensor kind of a ScalarType code the shim reports.
pub(crate) fn kind_of_code(code: c_int) -> Result<Kind> {
    Ok(match code {
        raw::SK_INT64 => Kind::Int64,
        raw::SK_FLOAT16 => Kind::Half,
        raw::SK_FLOAT32 => Kind::Float,
        raw::SK_FLOAT64 => Kind::Double,
        raw::SK_BOOL => Kind::Bool,
        raw::SK_BFLOAT16 => Kind::BFloat16,
        raw::SK_FLOAT8_E5M2 => Kind::Float8e5m2,
        raw::SK_FLOAT8_E4M3FN => Kind::Float8e4m3fn,
        other => {
            return Err(SpeedkitError::Torch(format!(
                "libtorch reported scalar type {other}, which speedkit does not pass"
            )))
        }
    })
}

/// A device index as the ABI's `int`.
fn device_index(index: usize) -> Result<c_int> {
    c_int::try_from(index).map_err(|_| SpeedkitError::Misuse(format!("bad device index {index}")))
}
