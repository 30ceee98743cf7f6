//! The interposer (`shim/interposer.cpp`): a step's operator calls where they reach the kernels,
//! recorded, or replaced by a program whose fused groups run generated kernels.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{self, AssertUnwindSafe};

use tch::{Device, Kind, Tensor};

use super::{
    c_string, check, device_index, panic_text, raw, raw::interposer as abi, scalar_type_code,
    write_message, Borrowed, Result,
};

/// What launches a group's kernel on its arguments' tensors; runs on the thread of the call that
/// launches it (possibly autograd's), on that thread's current stream.
type Launch = Box<dyn FnMut(usize, &[Tensor]) -> Result<()> + Send>;

/// One call a recording saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecordedCall {
    pub op: String,
    /// The RecordFunction handle (the execution trace's `rf_id`); 0 where none was seen.
    pub rf_id: u64,
    /// The calls it made, itself included.
    pub span: i64,
}

/// A program for the interposer: what each call of the step does (see `speedkit.h`).
pub(crate) struct Program {
    raw: *mut c_void,
}

// SAFETY: the shim's program is plain data plus the launch state, which is Send; sessions running
// it are serialised by the shim.
unsafe impl Send for Program {}

impl Program {
    /// An empty program for `device`, whose groups `launch` runs.
    pub fn new(
        device: Device,
        launch: impl FnMut(usize, &[Tensor]) -> Result<()> + Send + 'static,
    ) -> Result<Program> {
        let device = match device {
            Device::Cuda(i) => device_index(i)?,
            _ => -1,
        };
        let state: Box<Launch> = Box::new(Box::new(launch));
        let vtable = raw::sk_interposer_vtable {
            launch: Some(launch_trampoline),
            release: Some(release_trampoline),
        };
        let mut out = std::ptr::null_mut();
        // SAFETY: a valid vtable and out-pointer; the state is handed over (released by the shim,
        // also when this fails).
        check(unsafe {
            abi::sk_interposer_program_new(
                device,
                &vtable,
                Box::into_raw(state) as *mut c_void,
                &mut out,
            )
        })?;
        Ok(Program { raw: out })
    }

    /// Appends the next call (see `sk_interposer_program_add_call`).
    pub fn add_call(
        &mut self,
        op: &str,
        group: Option<usize>,
        computed: bool,
        launch: bool,
        span: i64,
    ) -> Result<()> {
        let op = c_string(op)?;
        let group = group.map_or(-1, |g| g as i64);
        // SAFETY: a live program and a NUL-terminated name, copied by the shim.
        check(unsafe {
            abi::sk_interposer_program_add_call(
                self.raw,
                op.as_ptr(),
                group,
                c_int::from(computed),
                c_int::from(launch),
                span,
            )
        })
    }

    /// Appends the layout of computed call `call`'s next output; `unwritten`: no kernel writes or
    /// reads its memory, so the call may hand it out without memory.
    pub fn add_output(
        &mut self,
        call: usize,
        kind: Kind,
        sizes: &[i64],
        strides: &[i64],
        unwritten: bool,
    ) -> Result<()> {
        if sizes.len() != strides.len() {
            return Err(crate::error::SpeedkitError::Misuse(format!(
                "an output layout of {} sizes and {} strides",
                sizes.len(),
                strides.len()
            )));
        }
        // SAFETY: a live program and `ndim` sizes and strides, copied by the shim.
        check(unsafe {
            abi::sk_interposer_program_add_output(
                self.raw,
                call as i64,
                scalar_type_code(kind)?,
                sizes.as_ptr(),
                strides.as_ptr(),
                sizes.len() as i64,
                c_int::from(unwritten),
            )
        })
    }

    /// Serves call `call`, a cast left to ATen, from its input's kept copy where the input is a
    /// parameter (see `sk_interposer_program_keep_copy`).
    pub fn keep_copy(&mut self, call: usize) -> Result<()> {
        // SAFETY: a live program.
        check(unsafe { abi::sk_interposer_program_keep_copy(self.raw, call as i64) })
    }

    /// Defers computed call `call`'s result `output`: group `group`'s kernel writes it at its first
    /// read (see `sk_interposer_program_defer`).
    pub fn defer(&mut self, call: usize, output: usize, group: usize) -> Result<()> {
        // SAFETY: a live program.
        check(unsafe {
            abi::sk_interposer_program_defer(self.raw, call as i64, output as i32, group as i64)
        })
    }

    /// Appends an argument of `group`'s kernel: argument or result `index` of call `call`, or of
    /// an argument that is a list of tensors, its `element`.
    pub fn add_arg(
        &mut self,
        group: usize,
        call: usize,
        output: bool,
        index: usize,
        element: Option<usize>,
    ) -> Result<()> {
        // SAFETY: a live program.
        check(unsafe {
            abi::sk_interposer_program_add_arg(
                self.raw,
                group as i64,
                call as i64,
                c_int::from(output),
                index as i32,
                element.map_or(-1, |e| e as i32),
            )
        })
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program, freed once; no session runs it (a session borrows it).
        unsafe { abi::sk_interposer_program_free(self.raw) }
    }
}

/// A running session, ended on drop (on the thread it began on, which `!Send` keeps it to).
pub(crate) struct Session<'p> {
    raw: *mut c_void,
    _program: std::marker::PhantomData<&'p Program>,
}

impl Session<'_> {
    /// Starts recording every operator call of this thread (and of autograd's for its backward).
    pub fn record() -> Result<Session<'static>> {
        Session::begin(std::ptr::null_mut())
    }

    /// Starts running `program` on this thread's calls.
    pub fn run(program: &Program) -> Result<Session<'_>> {
        Session::begin(program.raw)
    }

    fn begin<'p>(program: *mut c_void) -> Result<Session<'p>> {
        let mut out = std::ptr::null_mut();
        // SAFETY: a live program or NULL, and a valid out-pointer.
        check(unsafe { abi::sk_interposer_begin(program, &mut out) })?;
        Ok(Session {
            raw: out,
            _program: std::marker::PhantomData,
        })
    }

    /// Ends the session: the dispatcher and the thread's keys as before.
    pub fn end(&mut self) -> Result<()> {
        // SAFETY: a live session; ending twice is harmless in the shim.
        check(unsafe { abi::sk_interposer_end(self.raw) })
    }

    /// The calls a recording saw, in order.
    pub fn recorded(&self) -> Result<Vec<RecordedCall>> {
        let mut count = 0i64;
        // SAFETY: a live session and a valid out-pointer.
        check(unsafe { abi::sk_interposer_recorded_count(self.raw, &mut count) })?;
        let mut calls = Vec::with_capacity(count.max(0) as usize);
        for i in 0..count {
            let (mut op, mut rf_id, mut span) = (std::ptr::null(), 0u64, 0i64);
            // SAFETY: an index below the count and valid out-pointers; `op` points into the
            // session, copied at once.
            check(unsafe {
                abi::sk_interposer_recorded_get(self.raw, i, &mut op, &mut rf_id, &mut span)
            })?;
            // SAFETY: a NUL-terminated name owned by the live session.
            let op = unsafe { CStr::from_ptr(op) }.to_string_lossy().into_owned();
            calls.push(RecordedCall { op, rf_id, span });
        }
        Ok(calls)
    }

    /// After a recording: makes the kept copies of the parameters its calls `calls` cast (see
    /// `sk_interposer_keep_copies`).
    pub fn keep_copies(&self, calls: &[usize]) -> Result<()> {
        let calls: Vec<i64> = calls.iter().map(|&c| c as i64).collect();
        // SAFETY: a live session and `calls.len()` call indices.
        check(unsafe {
            abi::sk_interposer_keep_copies(self.raw, calls.as_ptr(), calls.len() as i64)
        })
    }

    /// Why the program's run departed from it, if it did.
    pub fn failure(&self) -> Result<Option<String>> {
        let mut out: *const c_char = std::ptr::null();
        // SAFETY: a live session; the text is the thread's copy, read at once.
        check(unsafe { abi::sk_interposer_failure(self.raw, &mut out) })?;
        // SAFETY: a NUL-terminated string from the shim.
        let text = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        Ok((!text.is_empty()).then_some(text))
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // SAFETY: the session, freed once (ended first if it still runs).
        unsafe { abi::sk_interposer_free(self.raw) }
    }
}

/// Whether an interposer session runs in the process.
pub(crate) fn active() -> Result<bool> {
    let mut out = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { abi::sk_interposer_active(&mut out) })?;
    Ok(out != 0)
}

unsafe extern "C" fn launch_trampoline(
    state: *mut c_void,
    group: i64,
    args: *const raw::sk_tensor,
    n: i64,
    message: *mut c_char,
    capacity: i64,
) -> c_int {
    // SAFETY: `state` is the Box<Launch> handed over in `Program::new`, alive until
    // `release_trampoline`; the shim calls it from one call at a time.
    let launch = &mut *(state as *mut Launch);
    // SAFETY: the shim lends `n` live tensors for the call.
    let tensors = Borrowed(
        (0..n.max(0) as usize)
            .map(|i| Tensor::from_ptr(*args.add(i)))
            .collect::<Vec<_>>(),
    );
    let failure = match panic::catch_unwind(AssertUnwindSafe(|| launch(group as usize, &tensors.0)))
    {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => format!("panicked: {}", panic_text(&*panic)),
    };
    write_message(message, capacity, &failure);
    1
}

unsafe extern "C" fn release_trampoline(state: *mut c_void) {
    // SAFETY: the Box handed over in `Program::new`, released exactly once, by the shim.
    drop(Box::from_raw(state as *mut Launch));
}
