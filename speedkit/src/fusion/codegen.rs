//! CUDA source for a fused group of pointwise operators: one thread per element of the group's
//! results, each operator an inlined device function of the element's storage index, each
//! operator's inputs found by index arithmetic through the views between them (so a `view`, a
//! `permute` or an `expand` costs no copy). Every operator computes in fp32 and rounds its result to
//! its own type, as ATen's kernels do, so the fused kernel gives ATen's values.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;

use tch::Kind;

use crate::cuda::Param;
use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::OpKind;

/// A generated kernel: its source, its entry point and the arguments it takes, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct GeneratedKernel {
    /// The entry point's name (`extern "C"`), unique to the group's structure.
    pub name: String,
    /// CUDA C++ for NVRTC; includes speedkit's `common.cuh`.
    pub source: String,
    /// The arguments, in the entry point's order; the element count (`long long`) comes last.
    pub args: Vec<KernelArg>,
    /// The count the launch passes last (`n`): the elements of each result, or for a group with
    /// a reduction its rows (a block each).
    pub numel: u64,
    /// Whether `numel` counts rows, a block each (a group with a reduction), not elements.
    rows: bool,
    /// Where each argument comes from in the step, in `args`' order.
    pub(crate) sources: Vec<ArgSource>,
}

/// Where a kernel argument's tensor is found in the step: argument (or result) `position` of the
/// traced call `call`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ArgSource {
    pub call: u64,
    pub output: bool,
    pub position: usize,
}

/// One argument of a [`GeneratedKernel`], with the traced tensor it stands for.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelArg {
    /// A tensor the group reads (`const T*`), laid out as traced.
    Input(TracedTensor),
    /// A one-element CPU tensor the group reads as a number (`double`): a Python-style scalar.
    Scalar(TracedTensor),
    /// A result the group writes (`T*`), laid out as traced.
    Output(TracedTensor),
}

impl KernelArg {
    /// The traced tensor it stands for.
    pub fn tensor(&self) -> &TracedTensor {
        match self {
            KernelArg::Input(t) | KernelArg::Scalar(t) | KernelArg::Output(t) => t,
        }
    }
}

impl GeneratedKernel {
    /// The grid and block to launch it with: 256 threads a block, each block a row of a group with
    /// a reduction, else 256 elements (the kernels loop over what a grid does not cover).
    pub fn grid_and_block(&self) -> (u32, u32) {
        const BLOCK: u64 = 256;
        let blocks = if self.rows {
            self.numel
        } else {
            self.numel.div_ceil(BLOCK)
        };
        (blocks.clamp(1, 65_535) as u32, BLOCK as u32)
    }

    /// The parameter list to declare it with ([`crate::cuda::CudaModule::kernel`]).
    pub fn params(&self) -> Vec<Param> {
        let mut params: Vec<Param> = self
            .args
            .iter()
            .map(|a| match a {
                KernelArg::Scalar(_) => Param::F64,
                KernelArg::Input(t) | KernelArg::Output(t) => {
                    Param::Tensor(kind_of(&t.dtype).unwrap_or(Kind::Float))
                }
            })
            .collect();
        params.push(Param::I64);
        params
    }
}

/// The storage types a generated kernel reads and writes.
pub(crate) fn kind_of(dtype: &str) -> Option<Kind> {
    match dtype {
        "float" => Some(Kind::Float),
        "c10::BFloat16" => Some(Kind::BFloat16),
        "c10::Half" => Some(Kind::Half),
        "bool" => Some(Kind::Bool),
        _ => None,
    }
}

fn c_type(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "sk::bf16",
        Kind::Half => "sk::f16",
        Kind::Bool => "bool",
        _ => "float",
    }
}

/// Whether the generator takes `op` (its kind, and for a reduction its dimension): views, pointwise
/// operators that write a new tensor of a type it stores, and `sum`, `mean` or `amax` over the
/// last dimension.
pub(crate) fn takes(op: &TracedOp) -> bool {
    let stores = |op: &TracedOp| match op.outputs.as_slice() {
        [TracedValue::Tensor(t)] => kind_of(&t.dtype).is_some(),
        _ => false,
    };
    match OpKind::of(&op.name) {
        Some(OpKind::View) => true,
        Some(OpKind::Pointwise) => !op.name.ends_with('_') && stores(op),
        Some(OpKind::Reduction) => stores(op) && reduces_last_dimension(op),
        _ => false,
    }
}

fn reduces_last_dimension(op: &TracedOp) -> bool {
    let kind = op.schema.split('(').next().unwrap_or("");
    if !matches!(
        kind,
        "aten::sum.dim_IntList" | "aten::mean.dim" | "aten::amax"
    ) {
        return false;
    }
    let (Some(TracedValue::Tensor(input)), Some(TracedValue::Other { value, .. })) =
        (op.inputs.first(), op.inputs.get(1))
    else {
        return false;
    };
    let rank = input.shape.len() as i64;
    match serde_json::from_str::<Vec<i64>>(value) {
        Ok(dims) => rank > 0 && dims.len() == 1 && (dims[0] + rank) % rank == rank - 1,
        Err(_) => false,
    }
}

/// Generates the kernel of `ops` (a group's operators in step order) writing `results` (the keys
/// of the group's tensors read after it). The error says why a group is not generated.
/// `inside` holds, per operator call, the storages it reads that an operator of the group wrote:
/// the data flow's answer, which storage ids alone cannot give (they are reused with addresses).
pub(crate) fn generate(
    ops: &[&TracedOp],
    results: &[(u64, u64)],
    inside: &HashSet<(u64, u64)>,
) -> Result<GeneratedKernel, String> {
    let mut g = Generator {
        inside: inside.clone(),
        ..Generator::default()
    };
    for op in ops {
        g.call = op.id;
        match OpKind::of(&op.name) {
            Some(OpKind::View) => continue,
            Some(OpKind::Pointwise) if !op.name.ends_with('_') => g.operator(op)?,
            Some(OpKind::Reduction) => g.reduction(op)?,
            _ => {
                return Err(format!(
                    "{} is not generated yet (pointwise operators and row reductions only)",
                    op.name
                ))
            }
        }
    }
    g.kernel(results)
}

/// The reading call, then storage, offset, sizes, strides and type: how a kernel argument reads
/// memory. Reads are shared within one call only: the allocator hands a freed tensor's address to
/// the next, so two calls' reads of the same traced memory may be of different tensors.
type MemoryKey = (u64, u64, u64, Vec<i64>, Vec<i64>, String);

#[derive(Default)]
struct Generator {
    /// Device functions, one per operator, in step order, and how many.
    functions: String,
    function_count: usize,
    /// Storage id → the function computing that storage's elements, as of the operator being
    /// generated (storage ids are reused with addresses, so a later result may take an id over).
    producers: HashMap<u64, (usize, TracedTensor)>,
    /// Result key → its function and the call computing it, for the group's results.
    results: HashMap<(u64, u64), (usize, TracedTensor, u64)>,
    /// Arguments so far, and where each external tensor's memory is among them.
    args: Vec<KernelArg>,
    arg_of: HashMap<MemoryKey, usize>,
    /// Operator names, in order, for the entry point's name.
    signature: String,
    /// The group's one reduction, once generated.
    reduction: Option<RowReduction>,
    /// (call, storage) read from inside the group ([`generate`]), and the call being generated.
    inside: HashSet<(u64, u64)>,
    call: u64,
    /// The position among the call's arguments of the tensor being read.
    position: usize,
    sources: Vec<ArgSource>,
}

/// A reduction over the last dimension: one block per row reduces `in_red(a, row, col, 0)` over
/// its `width` columns, and every function reads the row's result as `red`.
#[derive(Clone, Debug)]
struct RowReduction {
    rows: u64,
    width: u64,
    /// `sum`, `mean` (a sum divided by the width) or `amax`.
    op: &'static str,
}

impl Generator {
    fn operator(&mut self, op: &TracedOp) -> Result<(), String> {
        let out = match op.outputs.as_slice() {
            [TracedValue::Tensor(t)] => t.clone(),
            _ => return Err(format!("{} has other than one tensor result", op.name)),
        };
        let out_kind =
            kind_of(&out.dtype).ok_or_else(|| format!("{} writes {}", op.name, out.dtype))?;
        check_dense(&out).map_err(|e| format!("{}'s result {e}", op.name))?;
        let mut body = coordinates_of(&out);
        let mut operands = Vec::new();
        for (position, value) in op.inputs.iter().enumerate() {
            self.position = position;
            operands.push(match value {
                TracedValue::Tensor(t) => Operand::Value(self.read(t, &out)?),
                TracedValue::Tensors(_) => {
                    return Err(format!("{} takes a list of tensors", op.name))
                }
                TracedValue::Other { value, .. } => Operand::Literal(value.clone()),
            });
        }
        let expression = expression(op, &operands)
            .ok_or_else(|| format!("{} is not generated yet", op.schema))?;
        writeln!(
            body,
            "  return round_to<{}>({expression});",
            c_type(out_kind)
        )
        .unwrap();
        self.define(op, &out, &body);
        Ok(())
    }

    /// Adds `op`'s device function (of `body`) computing `out`.
    fn define(&mut self, op: &TracedOp, out: &TracedTensor, body: &str) {
        let index = self.function_count;
        self.function_count += 1;
        writeln!(
            self.functions,
            "// {}\n__device__ __forceinline__ float v{index}(const Args& a, long long p, float red) {{\n{body}}}\n",
            op.schema
        )
        .unwrap();
        self.results
            .insert(out.key(), (index, out.clone(), self.call));
        self.producers.insert(out.storage, (index, out.clone()));
        write!(self.signature, "{};", op.schema).unwrap();
    }

    /// A `sum`, `mean` or `amax` over the last dimension: `in_red` reads its input at a row and a
    /// column, and its function returns the row's result (`red`), rounded to its type.
    fn reduction(&mut self, op: &TracedOp) -> Result<(), String> {
        let kind = match op.schema.split('(').next().unwrap_or("") {
            "aten::sum.dim_IntList" => "sum",
            "aten::mean.dim" => "mean",
            "aten::amax" => "amax",
            _ => return Err(format!("{} is not generated yet", op.schema)),
        };
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let Some(TracedValue::Tensor(input)) = op.inputs.first() else {
            return Err(format!("{} without its input", op.name));
        };
        let out = match op.outputs.as_slice() {
            [TracedValue::Tensor(t)] => t.clone(),
            _ => return Err(format!("{} has other than one tensor result", op.name)),
        };
        let out_kind =
            kind_of(&out.dtype).ok_or_else(|| format!("{} writes {}", op.name, out.dtype))?;
        if !reduces_last_dimension(op) {
            return Err(format!("{} over other than the last dimension", op.name));
        }
        check_contiguous(&out).map_err(|e| format!("{}'s result {e}", op.name))?;
        let width = input.shape[input.shape.len() - 1].max(1) as u64;
        let rows = input.numel / width;
        // The input at (row, col): the row's coordinates over the leading dimensions.
        let mut body = String::new();
        writeln!(body, "  long long c[{}];", input.shape.len()).unwrap();
        writeln!(body, "  long long r = row;").unwrap();
        for d in (0..input.shape.len() - 1).rev() {
            let size = input.shape[d];
            writeln!(body, "  c[{d}] = r % {size}LL; r /= {size}LL;").unwrap();
        }
        writeln!(body, "  c[{}] = col;", input.shape.len() - 1).unwrap();
        self.position = 0;
        let value = self.read(input, input)?;
        writeln!(body, "  return {value};").unwrap();
        write!(
            self.functions,
            "// the input of {}\n__device__ __forceinline__ float in_red(const Args& a, long long row, long long col, float red) {{\n{body}}}\n\n",
            op.schema
        )
        .unwrap();
        self.define(
            op,
            &out,
            &format!("  return round_to<{}>(red);\n", c_type(out_kind)),
        );
        self.reduction = Some(RowReduction {
            rows,
            width,
            op: kind,
        });
        Ok(())
    }

    /// The expression of `t`'s element at the coordinates `c` of a result shaped `out`.
    fn read(&mut self, t: &TracedTensor, out: &TracedTensor) -> Result<String, String> {
        let rank = out.shape.len();
        if t.shape.len() > rank {
            return Err("an input of more dimensions than its result".into());
        }
        let offset: Vec<String> = t
            .shape
            .iter()
            .zip(&t.strides)
            .enumerate()
            .filter(|(_, (&size, _))| size != 1)
            .map(|(d, (_, &stride))| format!("c[{}] * {stride}LL", d + rank - t.shape.len()))
            .collect();
        let offset = if offset.is_empty() {
            "0LL".to_string()
        } else {
            offset.join(" + ")
        };
        if self.inside.contains(&(self.call, t.storage)) {
            let Some((index, _)) = self.producers.get(&t.storage) else {
                return Err("an input computed in the group by an operator not generated".into());
            };
            return Ok(format!("v{index}(a, {}LL + {offset}, red)", t.offset));
        }
        if t.device == "cpu" && t.shape.is_empty() {
            let i = self.argument(t, KernelArg::Scalar(t.clone()));
            return Ok(format!("(float)a.s{i}"));
        }
        kind_of(&t.dtype).ok_or_else(|| format!("an input of type {}", t.dtype))?;
        let i = self.argument(t, KernelArg::Input(t.clone()));
        Ok(format!("to_float_any(a.in{i}[{offset}])"))
    }

    /// The index of `t`'s argument, added on its first read. Reads of the same memory the same
    /// way share one argument, whatever tensor object the trace saw (views are remade per read).
    fn argument(&mut self, t: &TracedTensor, arg: KernelArg) -> usize {
        let same_memory = (
            self.call,
            t.storage,
            t.offset,
            t.shape.clone(),
            t.strides.clone(),
            t.dtype.clone(),
        );
        *self.arg_of.entry(same_memory).or_insert_with(|| {
            self.args.push(arg);
            self.sources.push(ArgSource {
                call: self.call,
                output: false,
                position: self.position,
            });
            self.args.len() - 1
        })
    }

    fn kernel(mut self, results: &[(u64, u64)]) -> Result<GeneratedKernel, String> {
        // Each result's store, by the space it is written in: whole (every element) or, with a
        // reduction, one per row.
        let (mut whole, mut per_row) = (String::new(), String::new());
        let mut numel = None;
        for key in results {
            let Some((index, out, call)) = self.results.get(key).cloned() else {
                return Err("a result the group does not compute".into());
            };
            let per_row_result = match &self.reduction {
                Some(r) if out.numel == r.rows && out.numel != r.rows * r.width => true,
                // The rows' elements in another shape (a view of them): element p is still
                // column p % width of row p / width when the result is contiguous.
                Some(r)
                    if out.numel == r.rows * r.width
                        && out.shape.last().map(|&w| w as u64) == Some(r.width) =>
                {
                    false
                }
                Some(_) => {
                    return Err("a result of neither the rows' nor the row count's size".into())
                }
                None => false,
            };
            if self.reduction.is_some() {
                check_contiguous(&out).map_err(|e| format!("a result {e}"))?;
            } else if *numel.get_or_insert(out.numel) != out.numel {
                return Err("results of different sizes".into());
            }
            self.args.push(KernelArg::Output(out.clone()));
            self.sources.push(ArgSource {
                call,
                output: true,
                position: 0,
            });
            let i = self.args.len() - 1;
            let ty = c_type(kind_of(&out.dtype).unwrap_or(Kind::Float));
            let store = format!("a.out{i}[p] = store_as<{ty}>(v{index}(a, p, red));");
            if per_row_result {
                writeln!(per_row, "      {store}").unwrap();
            } else {
                writeln!(whole, "      {store}").unwrap();
            }
        }
        if results.is_empty() {
            return Err("a group with no result".into());
        }
        let (numel, body) = match &self.reduction {
            Some(r) => (r.rows, row_loop(r, &whole, &per_row)),
            None => (
                numel.unwrap_or(0),
                format!(
                    "  const float red = 0.f;\n  for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < n; p += (long long)gridDim.x * blockDim.x) {{\n{whole}  }}\n"
                ),
            ),
        };
        let writes = format!("{whole}{per_row}");
        let mut fields = String::new();
        for (i, arg) in self.args.iter().enumerate() {
            let t = arg.tensor();
            let ty = c_type(kind_of(&t.dtype).unwrap_or(Kind::Float));
            match arg {
                KernelArg::Input(_) => writeln!(fields, "  const {ty}* in{i};"),
                KernelArg::Scalar(_) => writeln!(fields, "  double s{i};"),
                KernelArg::Output(_) => writeln!(fields, "  {ty}* out{i};"),
            }
            .unwrap();
        }
        let params: Vec<String> = self
            .args
            .iter()
            .enumerate()
            .map(|(i, arg)| {
                let ty = c_type(kind_of(&arg.tensor().dtype).unwrap_or(Kind::Float));
                match arg {
                    KernelArg::Input(_) => format!("const {ty}* in{i}"),
                    KernelArg::Scalar(_) => format!("double s{i}"),
                    KernelArg::Output(_) => format!("{ty}* out{i}"),
                }
            })
            .collect();
        let names: Vec<String> = self
            .args
            .iter()
            .enumerate()
            .map(|(i, arg)| match arg {
                KernelArg::Input(_) => format!("in{i}"),
                KernelArg::Scalar(_) => format!("s{i}"),
                KernelArg::Output(_) => format!("out{i}"),
            })
            .collect();
        // Named by everything the source says (shapes and strides included): one name, one text.
        let name = format!(
            "sk_fused_{:016x}",
            fnv1a(&format!(
                "{}{fields}{}{writes}",
                self.signature, self.functions
            ))
        );
        let source = format!(
            "{PRELUDE}\nstruct Args {{\n{fields}}};\n\n{functions}extern \"C\" __global__ void {name}({params}, long long n) {{\n  const Args a{{{names}}};\n{body}}}\n",
            functions = self.functions,
            params = params.join(", "),
            names = names.join(", "),
        );
        Ok(GeneratedKernel {
            name,
            source,
            args: self.args,
            numel,
            rows: self.reduction.is_some(),
            sources: self.sources,
        })
    }
}

enum Operand {
    Value(String),
    Literal(String),
}

/// Helpers every generated kernel starts with.
const PRELUDE: &str = r#"#include "common.cuh"
using namespace sk;
__device__ __forceinline__ float to_float_any(float v) { return v; }
__device__ __forceinline__ float to_float_any(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float_any(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float_any(bool v) { return v ? 1.f : 0.f; }
template <typename T> __device__ __forceinline__ T store_as(float v) { return from_float<T>(v); }
template <> __device__ __forceinline__ bool store_as<bool>(float v) { return v != 0.f; }
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(store_as<T>(v)); }
template <> __device__ __forceinline__ float round_to<bool>(float v) { return v != 0.f ? 1.f : 0.f; }
__device__ __forceinline__ float sigmoid_of(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  return 0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(k));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float k = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  const float t = tanhf(k);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.79788456080286536f * (1.f + 3.f * 0.044715f * x * x);
}
"#;

/// The fp32 expression of `op` over its operands, or `None` for an operator or overload not
/// generated yet.
fn expression(op: &TracedOp, operands: &[Operand]) -> Option<String> {
    let v = |i: usize| match operands.get(i)? {
        Operand::Value(e) => Some(format!("({e})")),
        Operand::Literal(l) => literal(l),
    };
    let name = op.name.strip_prefix("aten::")?;
    let scalar_alpha = || v(2).unwrap_or_else(|| "1.f".into());
    Some(match name {
        "add" => format!("{} + {} * {}", v(0)?, scalar_alpha(), v(1)?),
        "sub" => format!("{} - {} * {}", v(0)?, scalar_alpha(), v(1)?),
        "rsub" => format!("{} - {} * {}", v(1)?, scalar_alpha(), v(0)?),
        "mul" => format!("{} * {}", v(0)?, v(1)?),
        "div" if operands.len() == 2 => format!("{} / {}", v(0)?, v(1)?),
        "neg" => format!("-{}", v(0)?),
        "exp" => format!("expf({})", v(0)?),
        "log" => format!("logf({})", v(0)?),
        "sqrt" => format!("sqrtf({})", v(0)?),
        "rsqrt" => format!("rsqrtf({})", v(0)?),
        "reciprocal" => format!("1.f / {}", v(0)?),
        "tanh" => format!("tanhf({})", v(0)?),
        "sigmoid" => format!("sigmoid_of({})", v(0)?),
        "abs" => format!("fabsf({})", v(0)?),
        "sin" => format!("sinf({})", v(0)?),
        "cos" => format!("cosf({})", v(0)?),
        "erf" => format!("erff({})", v(0)?),
        "square" => format!("{0} * {0}", v(0)?),
        "relu" => format!("fmaxf({}, 0.f)", v(0)?),
        "silu" => format!("{0} * sigmoid_of({0})", v(0)?),
        "silu_backward" => format!(
            "{g} * sigmoid_of({x}) * (1.f + {x} * (1.f - sigmoid_of({x})))",
            g = v(0)?,
            x = v(1)?
        ),
        "sigmoid_backward" => format!("{g} * {y} * (1.f - {y})", g = v(0)?, y = v(1)?),
        "tanh_backward" => format!("{g} * (1.f - {y} * {y})", g = v(0)?, y = v(1)?),
        "threshold_backward" => {
            format!("({x} <= {t}) ? 0.f : {g}", g = v(0)?, x = v(1)?, t = v(2)?)
        }
        "gelu" => match operands.get(1) {
            Some(Operand::Literal(l)) if l.contains("tanh") => format!("gelu_tanh({})", v(0)?),
            _ => format!("gelu_erf({})", v(0)?),
        },
        "gelu_backward" => match operands.get(2) {
            Some(Operand::Literal(l)) if l.contains("tanh") => {
                format!("{} * gelu_tanh_grad({})", v(0)?, v(1)?)
            }
            _ => format!("{} * gelu_erf_grad({})", v(0)?, v(1)?),
        },
        "pow" if op.schema.starts_with("aten::pow.Tensor_Scalar") => match v(1)?.as_str() {
            "2.0f" => format!("{0} * {0}", v(0)?),
            e => format!("powf({}, {e})", v(0)?),
        },
        "maximum" => format!("fmaxf({}, {})", v(0)?, v(1)?),
        "minimum" => format!("fminf({}, {})", v(0)?, v(1)?),
        "clamp_min" => format!("fmaxf({}, {})", v(0)?, v(1)?),
        "clamp_max" => format!("fminf({}, {})", v(0)?, v(1)?),
        "where" => format!("({} != 0.f) ? {} : {}", v(0)?, v(1)?, v(2)?),
        "ge" => format!("({} >= {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "gt" => format!("({} > {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "le" => format!("({} <= {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "lt" => format!("({} < {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "eq" => format!("({} == {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "ne" => format!("({} != {}) ? 1.f : 0.f", v(0)?, v(1)?),
        // A cast: the round to the result's type is the whole operator.
        "_to_copy" | "clone" => v(0)?,
        _ => return None,
    })
}

/// A traced non-tensor argument as an fp32 literal: numbers only.
fn literal(json: &str) -> Option<String> {
    let number: f64 = json.trim_matches('"').parse().ok()?;
    if !number.is_finite() {
        return None;
    }
    Some(format!("{:?}f", number as f32))
}

/// The declaration of `c`, the coordinates of the element at storage index `p` of `out` (dense,
/// in any order of dimensions).
fn coordinates_of(out: &TracedTensor) -> String {
    let mut body = format!("  long long c[{}];\n", out.shape.len().max(1));
    for (d, (&size, &stride)) in out.shape.iter().zip(&out.strides).enumerate() {
        if size == 1 {
            body.push_str(&format!("  c[{d}] = 0;\n"));
        } else {
            body.push_str(&format!("  c[{d}] = (p / {stride}LL) % {size}LL;\n"));
        }
    }
    body
}

/// The body of a kernel with a row reduction: a block per row (`n` rows) reduces the row, then
/// writes the results of the whole space (`whole`, one per column) and of the rows (`per_row`).
fn row_loop(r: &RowReduction, whole: &str, per_row: &str) -> String {
    let (init, combine, warp) = match r.op {
        "amax" => ("-infinity()", "fmaxf(acc, v)", "warp_max"),
        _ => ("0.f", "acc + v", "warp_sum"),
    };
    let finish = if r.op == "mean" {
        format!("partial[0] / {}.f", r.width)
    } else {
        "partial[0]".to_string()
    };
    format!(
        "  __shared__ float partial[32];
  for (long long row = blockIdx.x; row < n; row += gridDim.x) {{
    float acc = {init};
    for (long long col = threadIdx.x; col < {width}LL; col += blockDim.x) {{
      const float v = in_red(a, row, col, 0.f);
      acc = {combine};
    }}
    acc = {warp}(acc);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {{
      acc = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : {init};
      acc = {warp}(acc);
      if (threadIdx.x == 0) partial[0] = acc;
    }}
    __syncthreads();
    const float red = {finish};
    for (long long col = threadIdx.x; col < {width}LL; col += blockDim.x) {{
      const long long p = row * {width}LL + col;
{whole}    }}
    if (threadIdx.x == 0) {{
      const long long p = row;
{per_row}    }}
    __syncthreads();
  }}
",
        width = r.width
    )
}

/// Whether `t` is contiguous (row-major) from the start of its storage.
fn check_contiguous(t: &TracedTensor) -> Result<(), String> {
    let mut expected = 1;
    for (&size, &stride) in t.shape.iter().zip(&t.strides).rev() {
        if size != 1 && stride != expected {
            return Err("is not contiguous".into());
        }
        expected *= size;
    }
    if t.offset != 0 {
        return Err("starts inside its storage".into());
    }
    Ok(())
}

/// Whether `t` covers its storage densely from its offset (any order of dimensions).
fn check_dense(t: &TracedTensor) -> Result<(), String> {
    let mut dims: Vec<(i64, i64)> = t
        .shape
        .iter()
        .copied()
        .zip(t.strides.iter().copied())
        .filter(|&(size, _)| size != 1)
        .collect();
    dims.sort_by_key(|&(_, stride)| stride);
    let mut expected = 1;
    for (size, stride) in dims {
        if stride != expected {
            return Err("is not dense in memory".into());
        }
        expected *= size;
    }
    if t.offset != 0 {
        return Err("starts inside its storage".into());
    }
    Ok(())
}

/// FNV-1a, 64 bits: the entry point's name from the group's structure (stable across runs, so the
/// kernel cache finds the same source again).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
