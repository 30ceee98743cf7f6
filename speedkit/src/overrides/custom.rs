//! Your own kernel as an ATen operator's implementation: [`OperatorOverride`].

use std::fmt;
use std::panic::{self, AssertUnwindSafe, Location};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;
use tch::{Kind, Tensor};

use crate::error::{Result, SpeedkitError};
pub use crate::ffi::custom_overrides::Value;
use crate::ffi::{self, custom_overrides::OverrideKernel, raw};
use crate::kernels::{self, KernelOp};

/// The dispatch key a kernel is registered under: which calls of the operator reach it.
///
/// A backend key ([`Cpu`](DispatchKey::Cpu), [`Cuda`](DispatchKey::Cuda)) sits below autograd:
/// the kernel computes the operator's values, and autograd records the operator's own formula
/// around it. An autocast key ([`AutocastCpu`](DispatchKey::AutocastCpu),
/// [`AutocastCuda`](DispatchKey::AutocastCuda)) sits above autograd and is reached only under
/// autocast: the kernel decides the types the operator runs in, and whatever operators it calls
/// are recorded by autograd as usual.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum DispatchKey {
    /// CPU tensors.
    Cpu,
    /// CUDA tensors.
    Cuda,
    /// CPU tensors under autocast.
    AutocastCpu,
    /// CUDA tensors under autocast.
    AutocastCuda,
}

impl DispatchKey {
    /// PyTorch's name of the key.
    ///
    /// ```
    /// assert_eq!(speedkit::overrides::DispatchKey::AutocastCuda.name(), "AutocastCUDA");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            DispatchKey::Cpu => "CPU",
            DispatchKey::Cuda => "CUDA",
            DispatchKey::AutocastCpu => "AutocastCPU",
            DispatchKey::AutocastCuda => "AutocastCUDA",
        }
    }

    const fn code(self) -> i32 {
        match self {
            DispatchKey::Cpu => raw::SK_DISPATCH_CPU,
            DispatchKey::Cuda => raw::SK_DISPATCH_CUDA,
            DispatchKey::AutocastCpu => raw::SK_DISPATCH_AUTOCAST_CPU,
            DispatchKey::AutocastCuda => raw::SK_DISPATCH_AUTOCAST_CUDA,
        }
    }
}

impl fmt::Display for DispatchKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel's reply to one call: its results, or why it does not take the call.
#[derive(Debug)]
pub enum Reply {
    /// It computed the operator's results: one tensor per return of the operator's schema.
    Ran(Vec<Tensor>),
    /// It does not take this call (a type, a shape), for the reason given: the kernel it replaced
    /// runs instead, and [`OverrideStats`] counts the call.
    Declined(String),
}

/// One call of an overridden operator, as its kernel sees it: the arguments by their schema
/// names (`aten::gelu(Tensor self, *, str approximate='none')` has `self` and `approximate`).
pub struct OverrideCall<'a> {
    operator: &'a str,
    args: &'a [(&'a str, Value<'a>)],
}

impl<'a> OverrideCall<'a> {
    /// The operator, as registered (`"aten::gelu"`).
    pub fn operator(&self) -> &str {
        self.operator
    }

    /// Every argument, in the schema's order.
    pub fn arguments(&self) -> impl Iterator<Item = (&'a str, Value<'a>)> + '_ {
        self.args.iter().copied()
    }

    /// The argument named `name`.
    pub fn value(&self, name: &str) -> Result<Value<'a>> {
        self.args
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                let names: Vec<&str> = self.args.iter().map(|(n, _)| *n).collect();
                SpeedkitError::Misuse(format!(
                    "{} has no argument `{name}`; its arguments are {}",
                    self.operator,
                    names.join(", ")
                ))
            })
    }

    /// The tensor argument `name`.
    pub fn tensor(&self, name: &str) -> Result<&'a Tensor> {
        match self.value(name)? {
            Value::Tensor(t) => Ok(t),
            other => Err(self.wrong_type(name, "a tensor", other)),
        }
    }

    /// The optional tensor argument `name`.
    pub fn optional_tensor(&self, name: &str) -> Result<Option<&'a Tensor>> {
        match self.value(name)? {
            Value::Tensor(t) => Ok(Some(t)),
            Value::None => Ok(None),
            other => Err(self.wrong_type(name, "a tensor or None", other)),
        }
    }

    /// The integer argument `name`.
    pub fn int(&self, name: &str) -> Result<i64> {
        match self.value(name)? {
            Value::Int(i) => Ok(i),
            other => Err(self.wrong_type(name, "an integer", other)),
        }
    }

    /// The float argument `name` (an integer reads as its float, as a `Scalar` may hold one).
    pub fn double(&self, name: &str) -> Result<f64> {
        match self.value(name)? {
            Value::Double(d) => Ok(d),
            Value::Int(i) => Ok(i as f64),
            other => Err(self.wrong_type(name, "a float", other)),
        }
    }

    /// The boolean argument `name`.
    pub fn bool(&self, name: &str) -> Result<bool> {
        match self.value(name)? {
            Value::Bool(b) => Ok(b),
            other => Err(self.wrong_type(name, "a boolean", other)),
        }
    }

    /// The integer-list argument `name`.
    pub fn ints(&self, name: &str) -> Result<&'a [i64]> {
        match self.value(name)? {
            Value::Ints(v) => Ok(v),
            other => Err(self.wrong_type(name, "a list of integers", other)),
        }
    }

    /// The boolean-list argument `name` (`bool[3] output_mask`).
    pub fn bools(&self, name: &str) -> Result<&'a [bool]> {
        match self.value(name)? {
            Value::Bools(v) => Ok(v),
            other => Err(self.wrong_type(name, "a list of booleans", other)),
        }
    }

    /// The string argument `name`.
    pub fn str(&self, name: &str) -> Result<&'a str> {
        match self.value(name)? {
            Value::Str(s) => Ok(s),
            other => Err(self.wrong_type(name, "a string", other)),
        }
    }

    /// The optional `ScalarType` argument `name` (`dtype`) as a tensor kind; `None` when absent.
    pub fn kind(&self, name: &str) -> Result<Option<Kind>> {
        match self.value(name)? {
            Value::None => Ok(None),
            Value::Int(code) => {
                let code = i32::try_from(code).map_err(|_| {
                    SpeedkitError::Misuse(format!("`{name}` holds no scalar type ({code})"))
                })?;
                ffi::kind_of_code(code).map(Some)
            }
            other => Err(self.wrong_type(name, "a scalar type", other)),
        }
    }

    fn wrong_type(&self, name: &str, wanted: &str, got: Value<'_>) -> SpeedkitError {
        SpeedkitError::Misuse(format!(
            "argument `{name}` of {} is {got:?}, not {wanted}",
            self.operator
        ))
    }
}

/// A kernel's signature: the call in, what it did out.
type KernelFn = dyn Fn(&OverrideCall<'_>) -> Result<Reply> + Send + Sync;

/// Your kernel as the implementation of an ATen operator under one [`DispatchKey`], what
/// `torch.library.Library("aten", "IMPL").impl(...)` does in Python: every call of the operator
/// with that key (from your code, from tch's modules, from libtorch itself) runs it, until the
/// registration is removed, which brings back the kernel it replaced.
///
/// Register it under a [`SpeedContext`](crate::SpeedContext)
/// ([`override_operator`](crate::SpeedContext::override_operator)) to have it in the audit with
/// its reason and removed when the context drops, panics included; or alone with
/// [`register`](OperatorOverride::register), held by the returned [`OverrideRegistration`].
///
/// The rules:
/// - The kernel returns one new tensor per return of the operator's schema, or
///   [`Reply::Declined`] for a call it does not take: the kernel it replaced runs that call.
///   Calling the operator itself from inside the kernel also runs the replaced kernel, so a kernel
///   can adjust ATen's result without recursing.
/// - Errors and panics in the kernel come back as libtorch's error from the operator's call
///   (`f_*` methods return it; tch's panicking methods panic with it). Nothing unwinds into C++.
/// - Under an autocast key the kernel runs with that autocast key off, as autocast's own kernels
///   do: it casts what it chooses.
/// - Refused at registration: in-place and `out=` operators (override their functional form),
///   operators returning anything but tensors, and, under a backend key, composite operators
///   (those ATen computes from others, whose autograd formula a backend kernel would bypass).
/// - The kernel may be called from any thread, several at once (autograd's backward thread,
///   data-loading threads): it is `Send + Sync`, and its state needs its own synchronisation.
///
/// ```
/// use speedkit::overrides::{DispatchKey, OperatorOverride, Reply};
/// use tch::Tensor;
///
/// // ReLU on the CPU, written out: max(x, 0).
/// let relu = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
///     let x = call.tensor("self")?;
///     Ok(Reply::Ran(vec![x.clamp_min(0.0)]))
/// })
/// .register()?;
/// let y = Tensor::from_slice(&[-1.0f32, 2.0]).relu();
/// assert_eq!(Vec::<f32>::try_from(&y)?, [0.0, 2.0]);
/// assert_eq!(relu.stats().ran, 1);
/// drop(relu); // ATen's kernel again
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OperatorOverride {
    operator: String,
    key: DispatchKey,
    location: &'static Location<'static>,
    kernel: Box<KernelFn>,
    noted_as: Option<KernelOp>,
    note_declines: bool,
}

impl OperatorOverride {
    /// `kernel` for `operator` (`"aten::gelu"`; an overload after a dot, `"aten::log_softmax.int"`)
    /// under `key`. The dispatcher's table shows it registered where this is called.
    #[track_caller]
    pub fn new<F>(operator: &str, key: DispatchKey, kernel: F) -> Self
    where
        F: Fn(&OverrideCall<'_>) -> Result<Reply> + Send + Sync + 'static,
    {
        Self {
            operator: operator.to_owned(),
            key,
            location: Location::caller(),
            kernel: Box::new(kernel),
            noted_as: None,
            note_declines: true,
        }
    }

    /// Also notes every call's outcome under `op` in the kernel layer's channel
    /// ([`crate::kernels::notes`]), as the shim's own ops note theirs: how speedkit's override
    /// groups built in Rust reach the audit, the profiler and the runner's `kernels` column.
    pub(crate) fn noted_as(mut self, op: KernelOp) -> Self {
        self.noted_as = Some(op);
        self
    }

    /// Notes only the calls it runs: for an operator whose other calls are not the op's to take
    /// (a `relu` or `add` that reads no pending normalisation), so declining them is no fallback.
    pub(crate) fn declines_unnoted(mut self) -> Self {
        self.note_declines = false;
        self
    }

    /// The operator it implements.
    pub fn operator(&self) -> &str {
        &self.operator
    }

    /// The dispatch key it is registered under.
    pub fn key(&self) -> DispatchKey {
        self.key
    }

    /// Registers it with PyTorch's dispatcher, until the returned registration drops. An
    /// operator that does not exist or cannot take a kernel (see the rules above) is an error,
    /// and nothing is registered.
    pub fn register(self) -> Result<OverrideRegistration> {
        let shared = Arc::new(Shared {
            operator: self.operator,
            kernel: self.kernel,
            stats: StatsCell::default(),
            noted_as: self.noted_as,
            note_declines: self.note_declines,
        });
        let (name, overload) = shared
            .operator
            .split_once('.')
            .unwrap_or((&shared.operator, ""));
        let handle = ffi::custom_overrides::register(
            name,
            overload,
            self.key.code(),
            (self.location.file(), self.location.line()),
            Arc::clone(&shared) as Arc<dyn OverrideKernel>,
        )?;
        Ok(OverrideRegistration {
            key: self.key,
            location: self.location,
            shared,
            handle,
        })
    }
}

impl fmt::Debug for OperatorOverride {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperatorOverride")
            .field("operator", &self.operator)
            .field("key", &self.key)
            .field("location", &self.location)
            .finish_non_exhaustive()
    }
}

/// How a registered kernel's calls went so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OverrideStats {
    /// Calls it computed.
    pub ran: u64,
    /// Calls it declined (the replaced kernel ran them).
    pub declined: u64,
    /// Calls that failed with an error or a panic.
    pub failed: u64,
    /// The reason of the latest declined call.
    pub last_declined: Option<String>,
}

#[derive(Default)]
struct StatsCell {
    ran: AtomicU64,
    declined: AtomicU64,
    failed: AtomicU64,
    last_declined: Mutex<Option<String>>,
}

/// What the dispatcher's calls reach: the kernel and its counts.
struct Shared {
    operator: String,
    kernel: Box<KernelFn>,
    stats: StatsCell,
    noted_as: Option<KernelOp>,
    note_declines: bool,
}

impl OverrideKernel for Shared {
    fn call(&self, args: &[(&str, Value<'_>)]) -> Result<Option<Vec<Tensor>>> {
        let call = OverrideCall {
            operator: &self.operator,
            args,
        };
        // Caught here too (the FFI layer would), so that a panic is counted as a failed call.
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| (self.kernel)(&call)))
            .unwrap_or_else(|panic| {
                Err(SpeedkitError::Misuse(format!(
                    "the kernel of {} panicked: {}",
                    self.operator,
                    ffi::panic_text(&*panic)
                )))
            });
        let counter = match &outcome {
            Ok(Reply::Ran(_)) => &self.stats.ran,
            Ok(Reply::Declined(why)) => {
                let mut last = self
                    .stats
                    .last_declined
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                *last = Some(why.clone());
                &self.stats.declined
            }
            Err(_) => &self.stats.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(op) = self.noted_as {
            match &outcome {
                Ok(Reply::Ran(_)) => kernels::note(op, None),
                Ok(Reply::Declined(why)) if self.note_declines => {
                    kernels::note(op, Some(&format!("{}: {why}", self.operator)));
                }
                Ok(Reply::Declined(_)) => {}
                // The error reaches the operator's caller; nothing ran in its place.
                Err(_) => {}
            }
        }
        match outcome? {
            Reply::Ran(results) => Ok(Some(results)),
            Reply::Declined(_) => Ok(None),
        }
    }
}

/// One override a context holds, as its audit lists it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OverrideRecord {
    /// The operator (`"aten::gelu"`).
    pub operator: String,
    /// The dispatch key.
    pub key: DispatchKey,
    /// Where the override was made (`file:line`).
    pub location: String,
    /// Why, as given to the context.
    pub reason: String,
    /// Its calls so far.
    pub stats: OverrideStats,
}

/// A registered [`OperatorOverride`]: dropping it (or [`remove`](OverrideRegistration::remove))
/// removes the kernel and brings back the one it replaced.
#[must_use = "the kernel is removed when the registration drops; binding it to `_` removes it at once"]
pub struct OverrideRegistration {
    key: DispatchKey,
    location: &'static Location<'static>,
    shared: Arc<Shared>,
    handle: ffi::custom_overrides::Registration,
}

impl OverrideRegistration {
    /// The operator it implements.
    pub fn operator(&self) -> &str {
        &self.shared.operator
    }

    /// The dispatch key it is registered under.
    pub fn key(&self) -> DispatchKey {
        self.key
    }

    /// Where the override was made (`file:line`), as the dispatcher's table shows it.
    pub fn location(&self) -> String {
        format!("{}:{}", self.location.file(), self.location.line())
    }

    /// Its calls so far.
    pub fn stats(&self) -> OverrideStats {
        let s = &self.shared.stats;
        OverrideStats {
            ran: s.ran.load(Ordering::Relaxed),
            declined: s.declined.load(Ordering::Relaxed),
            failed: s.failed.load(Ordering::Relaxed),
            last_declined: s
                .last_declined
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// The audit's record of it, with `reason`.
    pub fn record(&self, reason: &str) -> OverrideRecord {
        OverrideRecord {
            operator: self.operator().to_owned(),
            key: self.key,
            location: self.location(),
            reason: reason.to_owned(),
            stats: self.stats(),
        }
    }

    /// Removes it now, reporting a failure that dropping would only print.
    pub fn remove(self) -> Result<()> {
        self.handle.remove()
    }
}

impl fmt::Debug for OverrideRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverrideRegistration")
            .field("operator", &self.operator())
            .field("key", &self.key)
            .field("location", &self.location())
            .field("stats", &self.stats())
            .finish()
    }
}
