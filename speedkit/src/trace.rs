//! The operator graph of a step: every ATen operator a closure calls, forward, backward and
//! optimizer alike, with its tensors (identity, shape, strides, type, device) and its nesting.
//!
//! speedkit records it with PyTorch's own execution trace (the observer behind
//! `torch.profiler.ExecutionTraceObserver`, the Chakra format), so the graph is what the
//! dispatcher saw: composite operators with the operators they decompose into, autograd's backward
//! functions with the kernels they call. [`StepTrace::kernels`] reduces it to the calls that run
//! kernels, which is what [`crate::fusion`] groups.
//!
//! ```
//! use speedkit::trace::StepTrace;
//! use tch::{Device, Kind, Tensor};
//!
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
//! let (_, trace) = StepTrace::record(|| (&x * 2.0 + 1.0).silu().sum(Kind::Float).backward())?;
//! let names: Vec<&str> = trace.kernels().iter().map(|op| op.name.as_str()).collect();
//! assert!(names.contains(&"aten::silu") && names.contains(&"aten::silu_backward"));
//! assert!(trace.kernels().iter().any(|op| op.backward));
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::Value;

use crate::error::{Result, SpeedkitError};
use crate::ffi;

mod keys;

/// One operator call of a recorded step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracedOp {
    /// The trace's id of the call (calls are numbered in the order they started).
    pub id: u64,
    /// The operator, e.g. `aten::mul`, or an autograd function such as `MulBackward0`.
    pub name: String,
    /// The operator's schema (empty for what is not an operator, such as autograd functions).
    pub schema: String,
    /// The call this one was made from (a composite operator, an autograd function), if any.
    pub parent: Option<u64>,
    /// Its arguments, in the schema's order.
    pub inputs: Vec<TracedValue>,
    /// Its results.
    pub outputs: Vec<TracedValue>,
    /// Whether it ran in the backward pass (inside an autograd function).
    pub backward: bool,
    /// The thread it ran on, in RecordFunction's numbering.
    pub thread: u64,
    /// For an autograd function, the thread of the forward call it differentiates (0 otherwise).
    pub forward_thread: u64,
    /// The call's RecordFunction handle (the trace's `rf_id`), by which speedkit's interposer
    /// finds it again; 0 where the trace has none.
    pub rf_id: u64,
}

impl TracedOp {
    /// Its tensor arguments, tensors inside lists included.
    pub fn input_tensors(&self) -> impl Iterator<Item = &TracedTensor> {
        self.inputs.iter().flat_map(TracedValue::tensors)
    }

    /// Its tensor results.
    pub fn output_tensors(&self) -> impl Iterator<Item = &TracedTensor> {
        self.outputs.iter().flat_map(TracedValue::tensors)
    }
}

/// An argument or result of a traced call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TracedValue {
    /// A tensor.
    Tensor(TracedTensor),
    /// A list of tensors (`cat`'s inputs, `split`'s results).
    Tensors(Vec<TracedTensor>),
    /// Anything else, as the trace writes it (a number, a list of sizes, `<None>`), with its type.
    Other {
        /// The value, as JSON. A float argument (`Double`) of a recorded step is exact (Rust's
        /// shortest form of the `f64`), where the trace file itself keeps six decimals.
        value: String,
        /// The trace's type name (`Int`, `Double`, `GenericList[Int,Int]`, ...).
        kind: String,
    },
}

impl TracedValue {
    /// The tensors it holds (none, one, or a list's).
    pub fn tensors(&self) -> &[TracedTensor] {
        match self {
            TracedValue::Tensor(t) => std::slice::from_ref(t),
            TracedValue::Tensors(ts) => ts,
            TracedValue::Other { .. } => &[],
        }
    }
}

/// A tensor as a traced call saw it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TracedTensor {
    /// The id of the tensor object: one of its own in the step (PyTorch's trace reuses an id
    /// with a freed object's address; [`StepTrace`] gives each object its own).
    pub id: u64,
    /// The id of its storage, one of its own as the object's: views of one tensor share it.
    pub storage: u64,
    /// Its first element's offset into the storage, in elements.
    pub offset: u64,
    /// Its number of elements.
    pub numel: u64,
    /// Bytes per element.
    pub item_bytes: u64,
    /// Its device, e.g. `cpu` or `cuda:0`.
    pub device: String,
    /// Its element type as the trace names it (`float`, `c10::BFloat16`, `long int`, ...).
    pub dtype: String,
    /// Its sizes.
    pub shape: Vec<i64>,
    /// Its strides, in elements.
    pub strides: Vec<i64>,
}

impl TracedTensor {
    /// The key of its value in the step's data flow: the object and its storage.
    pub fn key(&self) -> (u64, u64) {
        (self.id, self.storage)
    }
}

/// The operator graph of one recorded closure; see the [module docs](self).
#[derive(Clone, Debug, Default)]
pub struct StepTrace {
    ops: Vec<TracedOp>,
    kernels: Vec<usize>,
    unmatched_parked_reads: usize,
}

/// One trace at a time: the observer is one per process.
static RECORDING: Mutex<()> = Mutex::new(());
static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

/// Stops the execution trace when dropped, so a panic in the traced closure leaves no observer
/// behind.
struct Recording;

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = ffi::profiler::execution_trace_stop();
    }
}

/// The environment variable naming a directory where each recorded step's execution trace is
/// kept (PyTorch's JSON, as [`StepTrace::read`] reads it), to read what the fusion planner saw.
///
/// ```
/// // SPEEDKIT_TRACE_DIR=target/traces cargo run --release --example ...
/// assert_eq!(speedkit::trace::TRACE_DIR_VARIABLE, "SPEEDKIT_TRACE_DIR");
/// ```
pub const TRACE_DIR_VARIABLE: &str = "SPEEDKIT_TRACE_DIR";

/// A copy of the trace at `path` in [`TRACE_DIR_VARIABLE`]'s directory, where that is set; a copy
/// that cannot be written is left out (the trace is only kept for reading).
fn keep_for_reading(path: &Path) {
    let (Some(dir), Some(name)) = (std::env::var_os(TRACE_DIR_VARIABLE), path.file_name()) else {
        return;
    };
    let dir = Path::new(&dir);
    let _ = std::fs::create_dir_all(dir).and_then(|()| std::fs::copy(path, dir.join(name)));
}

impl StepTrace {
    /// Runs `f` with every operator call of the process recorded, and returns its result with the
    /// trace. The observer (a global callback) is removed on every exit path, panics included.
    /// The trace keeps the calls made on this thread and the backward of its forward (which CUDA
    /// runs on autograd's device threads, with the engine's own calls between its functions);
    /// other threads' calls are left out.
    ///
    /// The observer is PyTorch's, one per process, and it is freed when the recording ends: no
    /// other thread may be inside an operator at that moment (a data loader's thread running
    /// operators beside the step), or that operator's exit meets freed memory.
    pub fn record<R>(f: impl FnOnce() -> R) -> Result<(R, StepTrace)> {
        let _one_at_a_time = RECORDING.lock().unwrap_or_else(|e| e.into_inner());
        let path = std::env::temp_dir().join(format!(
            "speedkit-trace-{}-{}.json",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        ));
        let thread = ffi::profiler::record_function_thread_id()?;
        ffi::profiler::execution_trace_start(&path)?;
        let recording = Recording;
        let result = f();
        drop(recording);
        let nodes = read_nodes(&path);
        keep_for_reading(&path);
        let _ = std::fs::remove_file(&path);
        let mut nodes = nodes?;
        restore_exact_doubles(&mut nodes, &ffi::profiler::execution_trace_doubles()?);
        Ok((result, Self::from_nodes(nodes, Some(thread))))
    }

    /// Reads an execution trace file (PyTorch's JSON, as `torch.profiler.ExecutionTraceObserver`
    /// writes it).
    /// Every thread's calls are kept. Float arguments are as the file writes them, with six
    /// decimals ([`StepTrace::record`] keeps them exactly).
    pub fn read(path: &Path) -> Result<StepTrace> {
        Ok(Self::from_nodes(read_nodes(path)?, None))
    }

    /// The trace of `ops`: of those on `thread` and the backward of their forward, when given.
    fn from_nodes(mut ops: Vec<TracedOp>, thread: Option<u64>) -> StepTrace {
        ops.sort_by_key(|op| op.id);
        let unmatched_parked_reads = keys::resolve(&mut ops);
        mark_backward(&mut ops);
        if let Some(thread) = thread {
            keep_thread(&mut ops, thread);
        }
        let kernels = kernel_calls(&ops);
        StepTrace {
            ops,
            kernels,
            unmatched_parked_reads,
        }
    }

    /// How many of the backward's reads of saved tensors that were parked in host memory
    /// ([`crate::offload`]) could not be given the key of a tensor of the forward. The trace's data
    /// flow is whole only where this is 0.
    ///
    /// ```
    /// use speedkit::offload::ParkedActivations;
    /// use speedkit::trace::StepTrace;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let x = Tensor::randn([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let (_, trace) = StepTrace::record(|| -> speedkit::Result<()> {
    ///     let parked = ParkedActivations::start(0)?;
    ///     x.exp().tanh().sum(Kind::Float).backward();
    ///     parked.finish()?;
    ///     Ok(())
    /// })?;
    /// assert_eq!(trace.unmatched_parked_reads(), 0);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn unmatched_parked_reads(&self) -> usize {
        self.unmatched_parked_reads
    }

    /// Every recorded call, composite operators and autograd functions included, in start order.
    pub fn ops(&self) -> &[TracedOp] {
        &self.ops
    }

    /// The tensors autograd handed to leaves as their gradients: per `AccumulateGrad` call, its
    /// id and its input's key. They outlive the step, though no call of it may read them, since
    /// a leaf's gradient can be the tensor itself. The tensor handed on is the last one of that
    /// key made before the call.
    ///
    /// ```
    /// use speedkit::trace::StepTrace;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let (_, trace) = StepTrace::record(|| (&x * 2.0).sum(Kind::Float).backward())?;
    /// let mul = trace.kernels().into_iter().filter(|op| op.name == "aten::mul").last().unwrap();
    /// let gradient = mul.output_tensors().next().unwrap();
    /// let (call, key) = trace.leaf_gradients()[0];
    /// assert!(key == gradient.key() && call > mul.id);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn leaf_gradients(&self) -> Vec<(u64, (u64, u64))> {
        (self.ops.iter())
            .filter(|op| op.name == "torch::autograd::AccumulateGrad")
            .flat_map(|op| op.input_tensors().map(|t| (op.id, t.key())))
            .collect()
    }

    /// The calls that run the step's kernels, in start order: each operator speedkit models
    /// ([`crate::fusion::OpKind`]) taken whole, and everything else by the calls it made, down to
    /// the ones that made none (so `aten::linear` appears as its `aten::t` and `aten::addmm`).
    pub fn kernels(&self) -> Vec<&TracedOp> {
        self.kernels.iter().map(|&i| &self.ops[i]).collect()
    }
}

fn read_nodes(path: &Path) -> Result<Vec<TracedOp>> {
    let io = |source| SpeedkitError::Io {
        path: PathBuf::from(path),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let json: Value = serde_json::from_str(&text).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not an execution trace: {e}"),
        ))
    })?;
    Ok(parse_nodes(&json))
}

/// Puts each float argument the trace file rounded to six decimals (an epsilon of 1e-8 read as 0)
/// back to its exact value, from the recording's own list: `(rf_id, position, value)` per argument.
fn restore_exact_doubles(ops: &mut [TracedOp], doubles: &[(u64, usize, f64)]) {
    let mut by_call: HashMap<u64, Vec<(usize, f64)>> = HashMap::new();
    for &(rf_id, position, value) in doubles {
        by_call.entry(rf_id).or_default().push((position, value));
    }
    for op in ops.iter_mut().filter(|op| op.rf_id != 0) {
        for &(position, exact) in by_call.get(&op.rf_id).into_iter().flatten() {
            if let Some(TracedValue::Other { value, kind }) = op.inputs.get_mut(position) {
                if kind == "Double" {
                    *value = format!("{exact:?}");
                }
            }
        }
    }
}

/// Keeps the calls of the step run on `thread`: its own, those under an autograd function whose
/// forward ran there (the backward, which CUDA runs on autograd's device threads), and the rest
/// of those threads' calls. Other threads' calls during the recording are someone else's work.
fn keep_thread(ops: &mut Vec<TracedOp>, thread: u64) {
    let index: HashMap<u64, usize> = ops.iter().enumerate().map(|(i, op)| (op.id, i)).collect();
    // Per call: Some(ours) once decided by a backward function above it or itself.
    let mut decided: Vec<Option<bool>> = vec![None; ops.len()];
    for i in 0..ops.len() {
        let from_parent = ops[i]
            .parent
            .and_then(|p| index.get(&p))
            .and_then(|&p| decided[p]);
        decided[i] = from_parent
            .or_else(|| (ops[i].forward_thread != 0).then_some(ops[i].forward_thread == thread));
    }
    // Autograd's device threads run our backward functions, and between them the engine's own
    // calls (the sums that reduce a broadcast input's gradient, the adds that accumulate two
    // gradients), which no backward function encloses: every call of such a thread is ours.
    let mut threads: HashSet<u64> = HashSet::from([thread]);
    threads.extend(
        ops.iter()
            .filter(|op| op.forward_thread == thread)
            .map(|op| op.thread),
    );
    let mut i = 0;
    ops.retain(|op| {
        let ours = decided[i].unwrap_or(threads.contains(&op.thread));
        i += 1;
        ours
    });
}

/// The trace's nodes as calls, leaving out its thread and process markers.
fn parse_nodes(json: &Value) -> Vec<TracedOp> {
    let nodes = json.get("nodes").and_then(Value::as_array);
    nodes
        .into_iter()
        .flatten()
        .filter_map(parse_node)
        .filter(|op| !op.name.starts_with("[pytorch|profiler|execution_trace"))
        .collect()
}

fn parse_node(node: &Value) -> Option<TracedOp> {
    let attr = |name: &str| {
        node.get("attrs")?
            .as_array()?
            .iter()
            .find(|a| a.get("name").and_then(Value::as_str) == Some(name))?
            .get("value")
            .cloned()
    };
    let parent = node.get("ctrl_deps").and_then(Value::as_u64);
    let scope = attr("scope").and_then(|v| v.as_u64()).unwrap_or(0);
    let name = node.get("name")?.as_str()?.to_string();
    Some(TracedOp {
        id: node.get("id")?.as_u64()?,
        // A backward function's scope (RecordScope::BACKWARD_FUNCTION) marks its subtree too.
        backward: scope == 1 || name.starts_with("autograd::engine::evaluate_function"),
        name,
        schema: attr("op_schema")
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        parent: parent.filter(|&p| p != 0),
        thread: attr("tid").and_then(|v| v.as_u64()).unwrap_or(0),
        forward_thread: attr("fw_tid").and_then(|v| v.as_u64()).unwrap_or(0),
        rf_id: attr("rf_id").and_then(|v| v.as_u64()).unwrap_or(0),
        inputs: parse_values(node.get("inputs")?),
        outputs: parse_values(node.get("outputs")?),
    })
}

/// `{"values": [...], "shapes": [...], "types": [...], "strides": [...]}` as values.
fn parse_values(io: &Value) -> Vec<TracedValue> {
    let column = |name: &str| io.get(name).and_then(Value::as_array).cloned();
    let (Some(values), types) = (column("values"), column("types").unwrap_or_default()) else {
        return Vec::new();
    };
    let shapes = column("shapes").unwrap_or_default();
    let strides = column("strides").unwrap_or_default();
    values
        .iter()
        .enumerate()
        .map(|(i, value)| {
            let kind = types.get(i).and_then(Value::as_str).unwrap_or("");
            parse_value(value, kind, shapes.get(i), strides.get(i))
        })
        .collect()
}

fn parse_value(
    value: &Value,
    kind: &str,
    shape: Option<&Value>,
    strides: Option<&Value>,
) -> TracedValue {
    let other = || TracedValue::Other {
        value: value.to_string(),
        kind: kind.to_string(),
    };
    if let Some(dtype) = kind
        .strip_prefix("Tensor(")
        .and_then(|k| k.strip_suffix(')'))
    {
        return parse_tensor(value, dtype, shape, strides).map_or_else(other, TracedValue::Tensor);
    }
    if let Some(items) = kind
        .strip_prefix("GenericList[")
        .and_then(|k| k.strip_suffix(']'))
    {
        let kinds: Vec<&str> = items.split(',').collect();
        let all_tensors = !kinds.is_empty() && kinds.iter().all(|k| k.starts_with("Tensor("));
        if let (true, Some(list)) = (all_tensors, value.as_array()) {
            let at = |v: Option<&Value>, i: usize| v.and_then(|v| v.get(i)).cloned();
            let tensors: Option<Vec<TracedTensor>> = list
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let dtype = kinds[i.min(kinds.len() - 1)];
                    let dtype = dtype.trim_start_matches("Tensor(").trim_end_matches(')');
                    parse_tensor(v, dtype, at(shape, i).as_ref(), at(strides, i).as_ref())
                })
                .collect();
            if let Some(tensors) = tensors {
                return TracedValue::Tensors(tensors);
            }
        }
    }
    other()
}

/// `[tensor_id, storage_id, offset, numel, itemsize, device]` with its shape and strides.
fn parse_tensor(
    value: &Value,
    dtype: &str,
    shape: Option<&Value>,
    strides: Option<&Value>,
) -> Option<TracedTensor> {
    let fields = value.as_array()?;
    let number = |i: usize| fields.get(i)?.as_u64();
    let ints = |v: Option<&Value>| -> Vec<i64> {
        v.and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default()
    };
    Some(TracedTensor {
        id: number(0)?,
        storage: number(1)?,
        offset: number(2)?,
        numel: number(3)?,
        item_bytes: number(4)?,
        device: fields.get(5)?.as_str()?.to_string(),
        dtype: dtype.to_string(),
        shape: ints(shape),
        strides: ints(strides),
    })
}

/// Marks every call under a backward function as backward.
fn mark_backward(ops: &mut [TracedOp]) {
    let index: HashMap<u64, usize> = ops.iter().enumerate().map(|(i, op)| (op.id, i)).collect();
    // Parents start before their children, so one pass in start order sees each parent first.
    for i in 0..ops.len() {
        if let Some(p) = ops[i].parent.and_then(|p| index.get(&p)) {
            if ops[*p].backward {
                ops[i].backward = true;
            }
        }
    }
}

/// The indices of the kernel-level calls: a modelled operator whole, else its children.
fn kernel_calls(ops: &[TracedOp]) -> Vec<usize> {
    let index: HashMap<u64, usize> = ops.iter().enumerate().map(|(i, op)| (op.id, i)).collect();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); ops.len()];
    let mut roots = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match op.parent.and_then(|p| index.get(&p)) {
            Some(&p) => children[p].push(i),
            None => roots.push(i),
        }
    }
    // Autocast's wrapper of an operator it runs in another type: the same overload again below it,
    // after the casts of its inputs. Below autograd (where speedkit's interposer sees calls) there
    // are only the casts and the inner call, which are the step's kernels. (An operator that casts
    // and calls its own `out` overload, as a CPU `sum` with a type does, is one call there.)
    let wraps_casts = |i: usize| {
        let again = children[i].iter().any(|&c| ops[c].schema == ops[i].schema);
        let casts = (children[i].iter())
            .any(|&c| matches!(ops[c].name.as_str(), "aten::_to_copy" | "aten::to"));
        again && casts
    };
    let mut taken = Vec::new();
    let mut stack: Vec<usize> = roots.into_iter().rev().collect();
    while let Some(i) = stack.pop() {
        // A view that did more (a `reshape` that copied, a `to` that cast) shows it below.
        let kind = crate::fusion::OpKind::of(&ops[i].name);
        let modelled = kind
            .is_some_and(|k| k != crate::fusion::OpKind::View || children[i].is_empty())
            && !wraps_casts(i);
        if modelled || children[i].is_empty() {
            if ops[i].name.starts_with("aten::") || modelled {
                taken.push(i);
            }
        } else {
            stack.extend(children[i].iter().rev());
        }
    }
    taken.sort_unstable();
    taken
}

/// Traced calls and tensors made up for the unit tests of the trace and fusion modules.
#[cfg(test)]
pub(crate) mod testing {
    use crate::trace::{TracedOp, TracedTensor, TracedValue};

    /// A tensor of 4 floats: object `id` on storage `storage`.
    pub fn tensor(id: u64, storage: u64) -> TracedValue {
        TracedValue::Tensor(traced_tensor(id, storage))
    }

    /// The tensor of [`tensor`].
    pub fn traced_tensor(id: u64, storage: u64) -> TracedTensor {
        TracedTensor {
            id,
            storage,
            offset: 0,
            numel: 4,
            item_bytes: 4,
            device: "cuda:0".into(),
            dtype: "float".into(),
            shape: vec![4],
            strides: vec![1],
        }
    }

    /// A forward call.
    pub fn call(
        id: u64,
        name: &str,
        inputs: Vec<TracedValue>,
        outputs: Vec<TracedValue>,
    ) -> TracedOp {
        TracedOp {
            id,
            name: name.into(),
            schema: String::new(),
            parent: None,
            inputs,
            outputs,
            backward: false,
            thread: 1,
            forward_thread: 0,
            rf_id: 0,
        }
    }

    /// A backward call.
    pub fn backward(
        id: u64,
        name: &str,
        inputs: Vec<TracedValue>,
        outputs: Vec<TracedValue>,
    ) -> TracedOp {
        TracedOp {
            backward: true,
            ..call(id, name, inputs, outputs)
        }
    }
}
