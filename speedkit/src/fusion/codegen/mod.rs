//! CUDA source for a fused group of pointwise operators: one thread per element of the group's
//! results, each operator an inlined device function of the element's storage index, each
//! operator's inputs found by index arithmetic through the views between them (so a `view`, a
//! `permute` or an `expand` costs no copy). Every operator computes in fp32 and rounds its result to
//! its own type, as ATen's kernels do, so the fused kernel gives ATen's values. A group with a
//! reduction runs a block per row (of the last dimension, or a group norm's channels of a
//! sample), its results computed with the row's statistics. An in-place
//! operator (autograd's `add_` of a gradient's parts) writes its result into its argument's
//! memory, which every thread then reads at its own element only.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;

use tch::Kind;

use crate::cuda::Param;
use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::OpKind;

mod columns;
mod dropout;
mod expression;
mod loops;
mod norms;
mod upsampling;

pub(crate) use columns::sums_columns;
use columns::COLUMN_BLOCKS;
pub(crate) use dropout::Draw;
use expression::{expression, Operand, PRELUDE};
use loops::{
    column_finish, layer_norm_backward_threads, pointwise_loop, row_loop, ColumnStrips, FinishPlan,
    RowCache, COLUMN_THREADS, FINISH_THREADS, WARP_ROWS,
};
pub(crate) use norms::sums_channels;
use norms::{group_norm_gradients, layer_norm_gradients, normalizes_rows, GradientRows};
use upsampling::{upsamples_nearest, upsamples_nearest_backward};

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
    /// a reduction its rows (a block each, or a warp each: [`GeneratedKernel::grid_and_block`]).
    pub numel: u64,
    /// Whether `numel` counts rows (a group with a reduction), not elements.
    rows: bool,
    /// Rows a block takes: one, or a warp's each where a row fits a warp ([`loops::WARP_ROWS`]).
    rows_per_block: u64,
    /// Elements each thread computes per tile (a pointwise kernel's unrolling, else 1).
    unroll: u64,
    /// Threads a block.
    block: u64,
    /// The most blocks it runs (fewer than its rows where it sums columns, each block's sums
    /// kept in the workspace).
    max_blocks: u64,
    /// Per argument, the bytes its pointer must be aligned to (0: any), for a vectorised kernel's
    /// loads and stores of four elements; the launch checks it.
    pub(crate) alignment: Vec<usize>,
    /// Where each argument comes from in the step, in `args`' order.
    pub(crate) sources: Vec<ArgSource>,
    /// Floats of scratch memory the kernel takes after its arguments (0: none): a group norm's
    /// backward's per-sample terms of its weight and bias gradients, or each block's sums over
    /// columns.
    pub(crate) workspace: u64,
    /// Whether the workspace must start from zeros: a group norm's backward counts its finished
    /// blocks in its first float. Sums over columns write every float before the finish reads it.
    pub(crate) zeroed_workspace: bool,
    /// The entry point launched after this one with the same arguments, where it has one.
    pub(crate) finish: Option<Finish>,
    /// The dropouts it computes, in step order: each launch reserves their stretches of the
    /// CUDA generator and passes them after the arguments.
    pub(crate) draws: Vec<Draw>,
}

/// A kernel's second entry point ([`GeneratedKernel::finish`]): the sums over columns of its
/// blocks added up, `blocks` blocks of [`FINISH_THREADS`] threads.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Finish {
    pub(crate) name: String,
    pub(crate) blocks: u64,
}

impl Finish {
    /// Its grid and block.
    pub(crate) fn grid_and_block(&self) -> (u32, u32) {
        (self.blocks.clamp(1, 65_535) as u32, FINISH_THREADS as u32)
    }
}

/// Where a kernel argument's tensor is found in the step: argument (or result) `position` of the
/// traced call `call`, and of an argument that is a list of tensors (`cat`'s), its `element`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ArgSource {
    pub call: u64,
    pub output: bool,
    pub position: usize,
    pub element: Option<usize>,
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
    /// The grid and block to launch it with: 256 threads a block (up to 1024 for a row held in
    /// registers, [`RowCache`]), each block a row of a group with a reduction (eight, a warp each,
    /// where a norm's row fits a warp), else 256 × the unrolling elements (the kernels loop over
    /// what a grid does not cover).
    pub fn grid_and_block(&self) -> (u32, u32) {
        let blocks = if self.rows {
            self.numel.div_ceil(self.rows_per_block)
        } else {
            self.numel.div_ceil(self.block * self.unroll)
        };
        (blocks.clamp(1, self.max_blocks) as u32, self.block as u32)
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
        for _ in &self.draws {
            params.extend([Param::I64, Param::I64, Param::I64, Param::U32, Param::I32]);
        }
        if self.workspace > 0 {
            params.push(Param::Tensor(Kind::Float));
        }
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
/// operators that write a new tensor of a type it stores, `sum`, `mean` or `amax` over the last
/// dimension, group and layer norms ([`NormRows`]) and their backwards ([`GroupNormGradients`],
/// [`LayerNormGradients`]).
pub(crate) fn takes(op: &TracedOp) -> bool {
    let stores = |op: &TracedOp| match op.outputs.as_slice() {
        [TracedValue::Tensor(t)] => kind_of(&t.dtype).is_some(),
        _ => false,
    };
    match OpKind::of(&op.name) {
        Some(OpKind::View) => true,
        Some(OpKind::Pointwise) if op.name == "aten::native_dropout" => {
            dropout::dropout_of(op).is_ok()
        }
        Some(OpKind::Pointwise) => (!op.name.ends_with('_') || writes_in_place(op)) && stores(op),
        Some(OpKind::Reduction) => {
            (stores(op) && reduces_last_dimension(op))
                || sums_channels(op)
                || sums_columns(op)
                || normalizes_rows(op).is_some()
                || group_norm_gradients(op).is_some()
                || layer_norm_gradients(op).is_some()
                || (stores(op) && upsamples_nearest_backward(op).is_some())
        }
        Some(OpKind::Layout) => stores(op) && generates_layout(op),
        _ => false,
    }
}

/// The in-place operators the generator writes: autograd accumulates a gradient read by two
/// operators with `add_`, between the kernels that make its parts and the ones that read it.
const IN_PLACE: [&str; 4] = ["aten::add_", "aten::sub_", "aten::mul_", "aten::div_"];

/// Whether `op` is an in-place pointwise operator the generator writes ([`IN_PLACE`]): its one
/// result is its first argument, the same tensor, rewritten.
pub(crate) fn writes_in_place(op: &TracedOp) -> bool {
    IN_PLACE.contains(&op.name.as_str())
        && matches!(
            (op.inputs.first(), op.outputs.as_slice()),
            (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) if input.key() == out.key()
        )
}

/// The layout copies the generator writes as index arithmetic: `cat` (each part read at its
/// coordinates less the part's start), `slice_backward` (the gradient where the slice took its
/// elements, zero elsewhere) and nearest up-sampling ([`upsamples_nearest`]).
fn generates_layout(op: &TracedOp) -> bool {
    matches!(op.name.as_str(), "aten::cat" | "aten::slice_backward")
        || upsamples_nearest(op).is_some()
}

/// A traced integer argument (a dimension, a slice's bound).
fn integer(value: Option<&TracedValue>) -> Option<i64> {
    match value? {
        TracedValue::Other { value, .. } => value.trim_matches('"').parse().ok(),
        _ => None,
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
    match reduced_dimensions(op) {
        Some((input, dims)) => !input.shape.is_empty() && dims == [input.shape.len() as i64 - 1],
        None => false,
    }
}

/// A `sum` over dimensions of its input in the input's own type, one the generator stores: the
/// input's rank and the dimensions it sums, in order.
fn sums_in_own_type(op: &TracedOp) -> Option<(usize, Vec<i64>)> {
    if !op.schema.starts_with("aten::sum.dim_IntList(") {
        return None;
    }
    let (input, mut dims) = reduced_dimensions(op)?;
    let same_type = match op.outputs.as_slice() {
        [TracedValue::Tensor(out)] => out.dtype == input.dtype && kind_of(&out.dtype).is_some(),
        _ => false,
    };
    dims.sort_unstable();
    same_type.then_some((input.shape.len(), dims))
}

/// A reduction's input and the dimensions it reduces (its second argument), each in
/// `0..rank`.
fn reduced_dimensions(op: &TracedOp) -> Option<(&TracedTensor, Vec<i64>)> {
    let (Some(TracedValue::Tensor(input)), Some(TracedValue::Other { value, .. })) =
        (op.inputs.first(), op.inputs.get(1))
    else {
        return None;
    };
    let rank = (input.shape.len() as i64).max(1);
    let dims: Vec<i64> = serde_json::from_str(value).ok()?;
    Some((input, dims.iter().map(|d| (d + rank) % rank).collect()))
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
    generate_with(ops, results, inside, false)
}

/// As [`generate`], for a result recomputed in the backward: a group norm among `ops` reads its
/// rows' statistics from its own stored results (the means and reciprocal standard deviations
/// the backward keeps), so that its normalised elements are pointwise; a dropout draws again what
/// its forward call drew ([`Draw::replays`]).
pub(crate) fn generate_recomputed(
    ops: &[&TracedOp],
    results: &[(u64, u64)],
    inside: &HashSet<(u64, u64)>,
) -> Result<GeneratedKernel, String> {
    generate_with(ops, results, inside, true)
}

fn generate_with(
    ops: &[&TracedOp],
    results: &[(u64, u64)],
    inside: &HashSet<(u64, u64)>,
    stored_statistics: bool,
) -> Result<GeneratedKernel, String> {
    let mut g = Generator {
        inside: inside.clone(),
        coords: "c".into(),
        stored_statistics,
        ..Generator::default()
    };
    // Memory an in-place operator rewrites that the kernel does not store is only read.
    for op in ops.iter().filter(|op| writes_in_place(op)) {
        if let Some(TracedValue::Tensor(target)) = op.inputs.first() {
            if !inside.contains(&(op.id, target.storage)) && results.contains(&target.key()) {
                g.written_in_place.insert(target.storage, target.clone());
            }
        }
    }
    for op in ops {
        g.call = op.id;
        match OpKind::of(&op.name) {
            Some(OpKind::View) => continue,
            Some(OpKind::Pointwise) if op.name == "aten::native_dropout" => {
                g.dropout(op, results)?
            }
            Some(OpKind::Pointwise) if !op.name.ends_with('_') || writes_in_place(op) => {
                g.operator(op)?
            }
            Some(OpKind::Reduction) if normalizes_rows(op).is_some() => g.norm(op)?,
            Some(OpKind::Reduction) if group_norm_gradients(op).is_some() => {
                g.group_norm_backward(op)?
            }
            Some(OpKind::Reduction) if layer_norm_gradients(op).is_some() => {
                g.layer_norm_backward(op)?
            }
            Some(OpKind::Reduction) if sums_channels(op) => g.channel_sum(op)?,
            Some(OpKind::Reduction) if sums_columns(op) => g.column_sum(op)?,
            // Each element a sum of its own window: a gather, not a reduction over rows.
            Some(OpKind::Reduction) if upsamples_nearest_backward(op).is_some() => g.layout(op)?,
            Some(OpKind::Reduction) => g.reduction(op)?,
            Some(OpKind::Layout) if generates_layout(op) => g.layout(op)?,
            _ => {
                return Err(format!(
                    "{} is not generated yet (pointwise operators, row reductions, cat, \
                     slice_backward and nearest up-sampling only)",
                    op.name
                ))
            }
        }
    }
    g.kernel(results)
}

/// Why a group reading a group norm's normalised elements elsewhere is not generated: a block
/// holds one row's statistics, so each element is computed in its own row only.
const ROW_ELEMENT_ELSEWHERE: &str =
    "a group norm's result is read at another element than its own (another row's)";

/// Why a group with an in-place operator is not generated: another element's thread reads memory
/// the kernel rewrites (a broadcast or a transposed read), which it might read rewritten.
const IN_PLACE_ELSEWHERE: &str =
    "memory an in-place operator rewrites is read at another element than its own";

/// The reading call, then storage, offset, sizes, strides and type: how a kernel argument reads
/// memory. Reads are shared within one call only: the allocator hands a freed tensor's address to
/// the next, so two calls' reads of the same traced memory may be of different tensors.
type MemoryKey = (u64, u64, u64, Vec<i64>, Vec<i64>, String);

#[derive(Default)]
struct Generator {
    /// Device functions, one per operator, in step order, and how many.
    functions: String,
    function_count: usize,
    /// The functions with a form taking their result's coordinates (`v{i}_at`), by index, and
    /// the result each computes: a reader at coordinates it can hand over calls that form instead
    /// of dividing them out of an index again.
    at_coordinates: HashMap<usize, TracedTensor>,
    /// Whether the function being generated reads at its coordinates `c` (a pointwise or layout
    /// operator's), so that it hands them over even at its own element.
    reading_at_coordinates: bool,
    /// Storage id → the function computing that storage's elements, as of the operator being
    /// generated (storage ids are reused with addresses, so a later result may take an id over).
    producers: HashMap<u64, (usize, TracedTensor)>,
    /// Result key → its function, the call computing it and its position among the call's
    /// results, for the group's results.
    results: HashMap<(u64, u64), (usize, TracedTensor, u64, usize)>,
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
    /// The position among the call's arguments of the tensor being read, and its element where
    /// that argument is a list of tensors.
    position: usize,
    element: Option<usize>,
    sources: Vec<ArgSource>,
    /// One past the largest element index any tensor of the group reaches: whether 32-bit
    /// indices (`idx_t`) suffice.
    extent: u64,
    /// The coordinates reads index with: the result's (`c`), or a layout copy's shifted ones.
    coords: String,
    /// The arguments read at each element's own index through `LOAD`, with their elements.
    vector_reads: BTreeMap<usize, u64>,
    /// Memory from outside the group that an in-place operator of it rewrites, by storage: the
    /// kernel writes each element where it reads it, so only that element's thread may read it.
    written_in_place: HashMap<u64, TracedTensor>,
    /// The functions that read such memory, themselves or through others: they may only be
    /// called at the element's own index.
    reads_written: HashSet<usize>,
    /// Whether the operator being generated has read such memory.
    read_written: bool,
    /// The functions that read a group norm's normalised elements, themselves or through others:
    /// each is computed with its own row's statistics, so it may only be read at its own element.
    row_elements: HashSet<usize>,
    /// Whether the operator being generated has read such a function.
    read_row_element: bool,
    /// Whether the kernel computes again what the forward computed ([`generate_recomputed`]):
    /// group norms read their statistics from their stored results instead of reducing their
    /// rows, and dropouts draw again what their forward kernels drew.
    stored_statistics: bool,
    /// A group norm's backward's weight and bias gradients by key (0 and 1): the kernel's last
    /// block writes them, once every row is summed, so no function computes them.
    channel_results: HashMap<(u64, u64), usize>,
    /// Functions whose value is exactly an earlier one's at the same element, by index: that
    /// earlier function's (a cast to a type holding every value of its input's, or a copy).
    copies_of: HashMap<usize, usize>,
    /// The dropouts among the operators, in step order ([`dropout`]).
    draws: Vec<Draw>,
    /// The function whose values a group norm's row holds in registers ([`RowCache`]), where
    /// its input is one of the group's results read at its own elements.
    held_function: Option<usize>,
}

/// A reduction over the last dimension: one block per row reduces `in_red(a, row, col, NO_ROW)`
/// over its `width` columns, and every function reads the row's result as `red.x`; a group
/// norm's rows (its `moments`) give their mean as `red.x` and their reciprocal standard
/// deviation as `red.y`.
#[derive(Clone, Debug)]
struct RowReduction {
    rows: u64,
    width: u64,
    /// `sum`, `mean` (a sum divided by the width), `amax`, `moments`, or `columns` (rows with no
    /// reduction of their own, for their column sums).
    op: &'static str,
    /// The `moments`' epsilon, added to the variance.
    eps: f64,
    /// A group norm's backward's (`op` `group_norm_backward`).
    gradients: Option<GradientRows>,
    /// The elements summed over each column ([`Generator::column_sum`]), as read at `p`.
    column_sums: Vec<String>,
}

impl Generator {
    fn operator(&mut self, op: &TracedOp) -> Result<(), String> {
        let (out, out_kind) = dense_result(op)?;
        // A result of the group rewritten through a view of it would be two values for one
        // memory, the rest of the result's elements unwritten.
        if writes_in_place(op) && self.inside.contains(&(op.id, out.storage)) {
            match self.producers.get(&out.storage) {
                Some((_, made)) if made.key() == out.key() => {}
                _ => return Err("an in-place operator on a view of a result of the group".into()),
            }
        }
        let mut body = String::new();
        let mut operands = Vec::new();
        self.reading_at_coordinates = true;
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
        self.reading_at_coordinates = false;
        let expression = expression(op, &operands)
            .ok_or_else(|| format!("{} is not generated yet", op.schema))?;
        writeln!(
            body,
            "  return round_to<{}>({expression});",
            c_type(out_kind)
        )
        .unwrap();
        let copied = match (op.name.as_str(), op.inputs.first()) {
            ("aten::_to_copy" | "aten::clone", Some(TracedValue::Tensor(input))) => {
                (self.own_producer(input, &out)).filter(|_| holds_every_value(input, &out))
            }
            _ => None,
        };
        self.define_at_coordinates(op, &out, &body);
        if let Some(source) = copied {
            self.copies_of.insert(self.function_count - 1, source);
        }
        Ok(())
    }

    /// The function computing `t`, a result of the group read at the elements of `out` that are
    /// its own, if it is one.
    fn own_producer(&self, t: &TracedTensor, out: &TracedTensor) -> Option<usize> {
        let (index, made) = self.producers.get(&t.storage)?;
        let own = made.key() == t.key() && t.offset == 0 && t.shape == out.shape;
        (own && self.inside.contains(&(self.call, t.storage)) && reads_as_laid_out(t, out))
            .then_some(*index)
    }

    /// The functions whose values equal the held function's ([`Self::held_function`]), through
    /// exact copies either way.
    fn held_functions(&self) -> HashSet<usize> {
        let mut held: HashSet<usize> = self.held_function.into_iter().collect();
        loop {
            let more: Vec<usize> = (self.copies_of.iter())
                .filter(|(f, s)| held.contains(f) != held.contains(s))
                .flat_map(|(&f, &s)| [f, s])
                .collect();
            if more.is_empty() {
                return held;
            }
            held.extend(more);
        }
    }

    /// A layout copy ([`generates_layout`]): its result's element read from the input element it
    /// copies, through coordinates of its own.
    fn layout(&mut self, op: &TracedOp) -> Result<(), String> {
        let (out, out_kind) = dense_result(op)?;
        let mut body = String::new();
        self.reading_at_coordinates = true;
        let expression = match op.name.as_str() {
            "aten::cat" => self.cat(op, &out, &mut body),
            "aten::upsample_nearest2d" => self.nearest(op, &out, &mut body),
            "aten::upsample_nearest2d_backward" => self.nearest_backward(op, &out, &mut body),
            _ => self.slice_backward(op, &out, &mut body),
        };
        self.reading_at_coordinates = false;
        self.coords = "c".into();
        self.element = None;
        writeln!(
            body,
            "  return round_to<{}>({});",
            c_type(out_kind),
            expression?
        )
        .unwrap();
        self.define_at_coordinates(op, &out, &body);
        Ok(())
    }

    /// `cat`: part k's element at the result's coordinates less the parts before it along `dim`.
    fn cat(
        &mut self,
        op: &TracedOp,
        out: &TracedTensor,
        body: &mut String,
    ) -> Result<String, String> {
        let Some(TracedValue::Tensors(parts)) = op.inputs.first() else {
            return Err("cat without its list of tensors".into());
        };
        let rank = out.shape.len();
        let dim = normalized_dim(integer(op.inputs.get(1)).unwrap_or(0), rank)?;
        let mut choices = Vec::new();
        let mut start = 0;
        self.position = 0;
        for (k, part) in parts.iter().enumerate() {
            if part.shape.len() != rank {
                return Err("cat of a part of another rank".into());
            }
            let size = part.shape[dim];
            if size == 0 {
                continue;
            }
            self.coords = format!("k{k}");
            body.push_str(&moved_coordinates(
                &self.coords,
                rank,
                dim,
                &format!("c[{dim}] - {start}"),
            ));
            self.element = Some(k);
            let value = self.read(part, out)?;
            start += size;
            choices.push((start, value));
        }
        if start != out.shape[dim] {
            return Err("cat whose parts do not add up to its result".into());
        }
        // The last part is what no earlier one covers; each other is chosen by its end.
        let (_, last) = choices.pop().ok_or("cat of no elements")?;
        Ok(choices.iter().rev().fold(last, |rest, (end, value)| {
            format!("(c[{dim}] < {end} ? {value} : {rest})")
        }))
    }

    /// `slice_backward`: the gradient's element where the slice `start:end:step` along `dim` took
    /// this one, zero elsewhere.
    fn slice_backward(
        &mut self,
        op: &TracedOp,
        out: &TracedTensor,
        body: &mut String,
    ) -> Result<String, String> {
        let Some(TracedValue::Tensor(grad)) = op.inputs.first() else {
            return Err("slice_backward without its gradient".into());
        };
        let rank = out.shape.len();
        let bound = |i: usize| integer(op.inputs.get(i)).ok_or("slice_backward's bounds unknown");
        let dim = normalized_dim(bound(2)?, rank)?;
        let size = out.shape[dim];
        let clamp = |v: i64| (if v < 0 { v + size } else { v }).clamp(0, size);
        let (start, end, step) = (clamp(bound(3)?), clamp(bound(4)?), bound(5)?);
        if step < 1
            || grad.shape.len() != rank
            || grad.shape[dim] != (end - start + step - 1).max(0) / step
        {
            return Err("slice_backward of a gradient the slice does not give".into());
        }
        self.coords = "g".into();
        body.push_str(&moved_coordinates(
            &self.coords,
            rank,
            dim,
            &format!("(c[{dim}] - {start}) / {step}"),
        ));
        self.position = 0;
        let value = self.read(grad, out)?;
        Ok(format!(
            "(c[{dim}] >= {start} && c[{dim}] < {end} && (c[{dim}] - {start}) % {step} == 0 ? {value} : 0.f)"
        ))
    }

    /// Adds `op`'s device function (of `body`) computing `out`.
    fn define(&mut self, op: &TracedOp, out: &TracedTensor, body: &str) {
        self.add_function(op, out, |index| {
            format!(
                "// {}\n__device__ __forceinline__ float v{index}(const Args& a, idx_t p, float2 red) {{\n{body}}}\n",
                op.schema
            )
        });
    }

    /// Adds `op`'s device functions computing `out` from its coordinates `c` (`body`, which reads
    /// them): `v{i}_at` takes them, `v{i}` divides them out of `p` first.
    fn define_at_coordinates(&mut self, op: &TracedOp, out: &TracedTensor, body: &str) {
        if out.shape.len() > MAX_RANK || out.offset != 0 {
            return self.define(op, out, &format!("{}{body}", coordinates_of(out)));
        }
        self.at_coordinates.insert(self.function_count, out.clone());
        let divided = coordinate_lines(out);
        self.add_function(op, out, |index| {
            format!(
                "// {}\n__device__ __forceinline__ float v{index}_at(const Args& a, idx_t p, Coords at, float2 red) {{\n  const idx_t* c = at.v;\n{body}}}\n\n__device__ __forceinline__ float v{index}(const Args& a, idx_t p, float2 red) {{\n  Coords at{{}};\n  idx_t* c = at.v;\n{divided}  return v{index}_at(a, p, at, red);\n}}\n",
                op.schema
            )
        });
    }

    /// Adds the device function(s) `text` gives for index `v{i}`, computing `out`.
    fn add_function(
        &mut self,
        op: &TracedOp,
        out: &TracedTensor,
        text: impl FnOnce(usize) -> String,
    ) {
        let index = self.function_count;
        self.function_count += 1;
        if std::mem::take(&mut self.read_written) {
            self.reads_written.insert(index);
        }
        if std::mem::take(&mut self.read_row_element) {
            self.row_elements.insert(index);
        }
        writeln!(self.functions, "{}", text(index)).unwrap();
        self.note_extent(out);
        let position = (op.outputs.iter())
            .position(|v| matches!(v, TracedValue::Tensor(t) if t.key() == out.key()))
            .unwrap_or(0);
        self.results
            .insert(out.key(), (index, out.clone(), self.call, position));
        self.producers.insert(out.storage, (index, out.clone()));
        write!(self.signature, "{};", op.schema).unwrap();
    }

    /// `t`, argument 0 of the call being generated, read at the element of the rows' space being
    /// written (`p`), or `None` where it is read elsewhere: what a sum over channels or columns
    /// adds as the kernel writes each element.
    fn read_at_own_element(&mut self, t: &TracedTensor) -> Result<Option<String>, String> {
        self.read_laid_out_as(t, &row_major(t))
    }

    /// [`Generator::read_at_own_element`], where `t`'s element at memory offset `p` is the one
    /// written there: a channels-last view of a result of the rows, whose shape orders its
    /// elements otherwise.
    fn read_in_memory_order(&mut self, t: &TracedTensor) -> Result<Option<String>, String> {
        match check_dense(t) {
            Ok(()) => self.read_laid_out_as(t, t),
            Err(_) => self.read_at_own_element(t),
        }
    }

    /// `t` read at the element of the rows' space being written, the space laid out as `layout`;
    /// `None` where that is another element.
    fn read_laid_out_as(
        &mut self,
        t: &TracedTensor,
        layout: &TracedTensor,
    ) -> Result<Option<String>, String> {
        self.position = 0;
        let value = self.read(t, layout)?;
        Ok((!value.contains("c[")).then_some(value))
    }

    /// Adds `out`, `op`'s result that the kernel writes once every row is summed (sum `which` of
    /// its group, [`StoredResult::channel`]): no function computes it.
    fn summed_result(&mut self, op: &TracedOp, out: &TracedTensor, which: usize) {
        self.read_row_element = false;
        self.note_extent(out);
        self.results
            .insert(out.key(), (usize::MAX, out.clone(), self.call, 0));
        self.channel_results.insert(out.key(), which);
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
        // Rows whose sums over columns came first take their reduction now.
        let (column_sums, summed_rows) = match self.reduction.take() {
            None => (Vec::new(), None),
            Some(r) if r.op == "columns" => (r.column_sums, Some((r.rows, r.width))),
            Some(_) => return Err("a second reduction in one group".into()),
        };
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
        if summed_rows.is_some_and(|summed| summed != (rows, width)) {
            return Err("a row reduction of other rows than its group's sums over columns".into());
        }
        // The input at (row, col): the row's coordinates over the leading dimensions.
        let mut body = String::new();
        // `p` is the element's index in the rows' space, which a contiguous input reads as it
        // is (its coordinates are then dead code, which the compiler drops).
        writeln!(body, "  const idx_t p = row * {width} + col;").unwrap();
        writeln!(body, "  idx_t c[{}];", input.shape.len()).unwrap();
        writeln!(body, "  uidx_t r = row;").unwrap();
        for d in (0..input.shape.len() - 1).rev() {
            let size = input.shape[d];
            writeln!(body, "  c[{d}] = (idx_t)(r % {size}); r /= {size};").unwrap();
        }
        writeln!(body, "  c[{}] = col;", input.shape.len() - 1).unwrap();
        self.row_input(op, "in_red", 0, body)?;
        self.define(
            op,
            &out,
            &format!("  return round_to<{}>(red.x);\n", c_type(out_kind)),
        );
        self.reduction = Some(RowReduction {
            rows,
            width,
            op: kind,
            eps: 0.0,
            gradients: None,
            column_sums,
        });
        Ok(())
    }

    /// `name` (`in_red`, the reduction's input), argument `position` of `op` at a row and a
    /// column, from `body`, which declares that element's index `p` and coordinates `c` in the
    /// rows' space.
    fn row_input(
        &mut self,
        op: &TracedOp,
        name: &str,
        position: usize,
        mut body: String,
    ) -> Result<(), String> {
        let Some(TracedValue::Tensor(input)) = op.inputs.get(position) else {
            return Err(format!("{} without its input", op.name));
        };
        self.position = position;
        let value = self.read(input, &row_major(input))?;
        writeln!(body, "  return {value};").unwrap();
        write!(
            self.functions,
            "// argument {position} of {}\n__device__ __forceinline__ float {name}(const Args& a, idx_t row, idx_t col, float2 red) {{\n{body}}}\n\n",
            op.schema
        )
        .unwrap();
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
            .map(|(d, (_, &stride))| {
                format!("{}[{}] * {stride}", self.coords, d + rank - t.shape.len())
            })
            .collect();
        self.note_extent(t);
        let offset = if self.coords == "c" && reads_as_laid_out(t, out) {
            "p".to_string()
        } else if offset.is_empty() {
            "0".to_string()
        } else {
            offset.join(" + ")
        };
        let own_element = offset == "p";
        if self.inside.contains(&(self.call, t.storage)) {
            if (self.channel_results.keys()).any(|&(_, storage)| storage == t.storage) {
                return Err(
                    "a sum over channels or columns (written once every row is summed) read in \
                     its group"
                        .into(),
                );
            }
            let Some(&(index, _)) = self.producers.get(&t.storage) else {
                return Err("an input computed in the group by an operator not generated".into());
            };
            if self.reads_written.contains(&index) {
                if !own_element || t.offset != 0 {
                    return Err(IN_PLACE_ELSEWHERE.into());
                }
                self.read_written = true;
            }
            if self.row_elements.contains(&index) {
                if !own_element || t.offset != 0 {
                    return Err(ROW_ELEMENT_ELSEWHERE.into());
                }
                self.read_row_element = true;
            }
            // A row reduction's reads at their own element stay plain (`read_at_own_element`).
            let hands_over = !own_element || self.reading_at_coordinates;
            if let Some(at) = self.at_coordinates.get(&index).filter(|_| hands_over) {
                if let Some(coordinates) = handed_coordinates(t, at, &self.coords, rank) {
                    return Ok(format!(
                        "v{index}_at(a, {} + {offset}, Coords{{{{{coordinates}}}}}, red)",
                        t.offset
                    ));
                }
            }
            return Ok(format!("v{index}(a, {} + {offset}, red)", t.offset));
        }
        if let Some(target) = self.written_in_place.get(&t.storage) {
            let same =
                (t.offset, &t.shape, &t.strides) == (target.offset, &target.shape, &target.strides);
            if !own_element || !same {
                return Err(IN_PLACE_ELSEWHERE.into());
            }
            self.read_written = true;
        }
        if t.device == "cpu" && t.shape.is_empty() {
            let i = self.argument(t, KernelArg::Scalar(t.clone()));
            return Ok(format!("(float)a.s{i}"));
        }
        let kind = kind_of(&t.dtype).ok_or_else(|| format!("an input of type {}", t.dtype))?;
        let i = self.argument(t, KernelArg::Input(t.clone()));
        // Read at the element's own index from the start of a group of four: a vectorised kernel
        // loads the four at once (`LOAD`, defined per kernel).
        if offset == "p" && t.offset % UNROLL == 0 && kind != Kind::Bool {
            self.vector_reads.insert(i, t.numel);
            return Ok(format!("LOAD({i}, a.in{i}, p)"));
        }
        Ok(format!("to_float_any(a.in{i}[{offset}])"))
    }

    /// Widens [`Self::extent`] to cover `t`'s elements.
    fn note_extent(&mut self, t: &TracedTensor) {
        let last: i64 = t
            .shape
            .iter()
            .zip(&t.strides)
            .map(|(&size, &stride)| (size - 1).max(0) * stride.abs())
            .sum();
        let extent = (t.offset + last.max(0) as u64 + 1).max(t.numel);
        self.extent = self.extent.max(extent);
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
                element: self.element,
            });
            self.args.len() - 1
        })
    }

    fn kernel(mut self, results: &[(u64, u64)]) -> Result<GeneratedKernel, String> {
        let mut stored = self.stored_results(results)?;
        // Four neighbouring elements a thread (eight of 16-bit types, `vector_width`), loaded and
        // stored at once, where the space the kernel runs over (each result's, or the rows') comes
        // in whole groups of four (bool results too: a dropout's mask, four or eight bytes).
        let space = match &self.reduction {
            Some(r) => r.rows * r.width,
            None => self.results[&results[0]].1.numel,
        };
        let vectorised = space % UNROLL == 0
            && self
                .reduction
                .as_ref()
                .is_none_or(|r| r.width % UNROLL == 0)
            && (self.reduction.as_ref().and_then(|r| r.gradients.as_ref()))
                .is_none_or(|g| g.shape.hxw % UNROLL == 0);
        let groups = self.vector_groups(space, vectorised);
        let width = self.vector_width(space, vectorised, &groups, &stored);
        let cache = (self.reduction.as_ref()).and_then(|r| RowCache::of(r, vectorised));
        let strips = (self.reduction.as_ref()).and_then(|r| ColumnStrips::of(r, vectorised, width));
        let held = self.held_functions();
        for s in stored.iter_mut().filter(|_| cache.is_some()) {
            s.held = held.contains(&s.function);
        }
        let (numel, unroll, body) = match &self.reduction {
            Some(r) => (
                r.rows,
                1,
                row_loop(r, &stored, vectorised, &groups, cache, strips),
            ),
            None => (
                space,
                width,
                pointwise_loop(&stored, vectorised, &groups, width),
            ),
        };
        // A row held in registers hands each element's value to the functions that read it
        // (`OWN`): the value of a group norm's input, or of its backward's gradient.
        // Declared to the compiler, which then keeps each thread within its share of registers.
        let block = match (cache, &self.reduction) {
            (Some(c), _) => c.threads,
            (None, _) if strips.is_some() => COLUMN_THREADS,
            (None, Some(r)) => layer_norm_backward_threads(r, vectorised).unwrap_or(256),
            (None, None) => 256,
        };
        let own = match cache {
            Some(_) => "a.own##i",
            None => "(e)",
        };
        let alignment: Vec<usize> = (0..self.args.len())
            .map(|i| match &self.args[i] {
                KernelArg::Input(t) if vectorised && groups.contains(&i) => vector_bytes(t, width),
                KernelArg::Output(t) if vectorised => vector_bytes(t, width),
                _ => 0,
            })
            .collect();
        // A vectorised kernel's thread holds the group of four of each such input from `a.first`
        // (its elements' own, which the compiler sees); other indices (a view of an intermediate)
        // read memory.
        let element = if width == WIDE {
            "group_element8"
        } else {
            "group_element"
        };
        let load = format!("((unsigned)((p) - a.first) < {width}u ? {element}(ptr, a.g##i, (p) - a.first) : to_float_any((ptr)[p]))");
        let (coord, row_of) = index_division(vectorised.then_some(width));
        let mut fields = String::new();
        let (mut params, mut names) = (Vec::new(), Vec::new());
        for (i, arg) in self.args.iter().enumerate() {
            let ty = c_type(kind_of(&arg.tensor().dtype).unwrap_or(Kind::Float));
            let (field, param, name) = match arg {
                KernelArg::Input(_) => (
                    format!("const {ty}* in{i}"),
                    format!("const {ty}* in{i}"),
                    format!("in{i}"),
                ),
                KernelArg::Scalar(_) => (
                    format!("double s{i}"),
                    format!("double s{i}"),
                    format!("s{i}"),
                ),
                KernelArg::Output(_) => (
                    format!("{ty}* out{i}"),
                    format!("{ty}* out{i}"),
                    format!("out{i}"),
                ),
            };
            writeln!(fields, "  {field};").unwrap();
            params.push(param);
            names.push(name);
        }
        let mut draw_code = String::new();
        for (d, draw) in self.draws.iter().enumerate() {
            fields.push_str(&Draw::fields(d));
            params.extend(Draw::params(d));
            names.extend(Draw::initializers(d));
            draw_code.push_str(&draw.keep_function(d));
        }
        if !self.draws.is_empty() {
            draw_code = format!("{}{draw_code}\n", dropout::DEVICE_CODE);
        }
        if cache.is_some() {
            fields.push_str("  float own0;\n");
        }
        if vectorised {
            fields.push_str("  idx_t first;\n");
            for i in &groups {
                writeln!(fields, "  uint4 g{i};").unwrap();
            }
        }
        let workspace = match &self.reduction {
            Some(r) if !r.column_sums.is_empty() => {
                FinishPlan::of(r, partial_blocks(r, vectorised, strips)).workspace()
            }
            Some(RowReduction {
                gradients: Some(g), ..
            }) => 1 + (2 + g.channel_sums.len() as u64) * g.shape.samples * g.shape.channels,
            _ => 0,
        };
        if workspace > 0 {
            params.push("float* ws".into());
        }
        let entry = format!(
            "({}, long long n) {{\n  Args a{{{}}};\n{body}}}\n",
            params.join(", "),
            names.join(", ")
        );
        // A one-wave layer norm's backward asks for the registers its wave was planned with.
        let wave = match (&self.reduction, strips) {
            (Some(r), None) if !r.column_sums.is_empty() => {
                layer_norm_backward_threads(r, vectorised).and_then(|t| one_wave(r, t))
            }
            _ => None,
        };
        let bounds = match wave {
            Some((_, resident)) => format!("{block}, {resident}"),
            None => block.to_string(),
        };
        // Named by everything the source says (shapes and strides included): one name, one text.
        let name = format!(
            "sk_fused_{:016x}",
            fnv1a(&format!(
                "{}{load}{own}{bounds}{fields}{draw_code}{}{entry}",
                self.signature, self.functions
            ))
        );
        let mut source = format!(
            "{PRELUDE}\ntypedef {index} idx_t;\ntypedef {unsigned} uidx_t;\nstruct Coords {{ idx_t v[{MAX_RANK}]; }};\n#define LOAD(i, ptr, p) {load}\n#define COORD(p, stride, size) {coord}\n#define ROW_OF(p, width) {row_of}\n#define OWN(i, e) {own}\nstruct Args {{\n{fields}}};\n\n{draw_code}{functions}extern \"C\" __global__ __launch_bounds__({bounds}) void {name}{entry}",
            functions = self.functions,
            index = index_type(self.extent),
            unsigned = unsigned_index_type(self.extent),
        );
        // Sums over columns end in a second entry point, launched after the first.
        let finish = match &self.reduction {
            Some(r) if !r.column_sums.is_empty() => {
                let (finish, entry) = finish_entry(
                    r,
                    partial_blocks(r, vectorised, strips),
                    &name,
                    &params,
                    &names,
                    &stored,
                );
                source.push_str(&entry);
                Some(finish)
            }
            _ => None,
        };
        Ok(GeneratedKernel {
            name,
            source,
            args: self.args,
            numel,
            rows: self.reduction.is_some(),
            rows_per_block: match cache {
                Some(c) if c.warp_rows => WARP_ROWS,
                _ => 1,
            },
            unroll,
            block,
            max_blocks: match (&self.reduction, strips) {
                (_, Some(strips)) => strips.blocks(),
                (Some(r), None) if !r.column_sums.is_empty() => column_blocks(r, vectorised),
                _ => 65_535,
            },
            alignment,
            sources: self.sources,
            workspace,
            zeroed_workspace: matches!(
                &self.reduction,
                Some(RowReduction {
                    gradients: Some(_),
                    ..
                })
            ),
            finish,
            draws: self.draws,
        })
    }

    /// Elements a thread of a vectorised kernel takes at a time: [`WIDE`] in a pointwise kernel
    /// of `space` elements whose loaded `groups` and `stored` results are all 16-bit (16 bytes
    /// each), else [`UNROLL`].
    fn vector_width(
        &self,
        space: u64,
        vectorised: bool,
        groups: &[usize],
        stored: &[StoredResult],
    ) -> u64 {
        // A kernel summing its rows over columns alone takes eight too, in strips of rows.
        let columns_alone = (self.reduction.as_ref())
            .is_some_and(|r| ColumnStrips::of(r, vectorised, WIDE).is_some());
        let wide = vectorised
            && (self.reduction.is_none() || columns_alone)
            && space % WIDE == 0
            && groups
                .iter()
                .all(|&i| takes_wide_groups(self.args[i].tensor()))
            && stored
                .iter()
                .all(|r| takes_wide_groups(self.args[r.arg].tensor()));
        if wide {
            WIDE
        } else {
            UNROLL
        }
    }

    /// The inputs a vectorised kernel of `numel` elements a result loads a thread's elements of at
    /// a time: those `LOAD` reads that hold at least as many elements, so that a thread's group
    /// (from its first element) lies inside them. Every other `LOAD` becomes a plain read.
    fn vector_groups(&mut self, numel: u64, vectorised: bool) -> Vec<usize> {
        let (groups, plain): (Vec<usize>, Vec<usize>) = self
            .vector_reads
            .keys()
            .partition(|i| vectorised && self.vector_reads[i] >= numel);
        for i in plain {
            self.functions = self.functions.replace(
                &format!("LOAD({i}, a.in{i}, p)"),
                &format!("to_float_any(a.in{i}[p])"),
            );
        }
        groups
    }

    /// Adds each of `results` as an output argument, and says how it is stored: its argument, its
    /// function, its type, and whether it is one value per row of the reduction.
    fn stored_results(&mut self, results: &[(u64, u64)]) -> Result<Vec<StoredResult>, String> {
        if results.is_empty() {
            return Err("a group with no result".into());
        }
        let mut stored = Vec::with_capacity(results.len());
        let mut seen = HashSet::new();
        // A result rewritten in place is one result: its last value.
        for key in results.iter().filter(|&&key| seen.insert(key)) {
            let Some((index, out, call, position)) = self.results.get(key).cloned() else {
                return Err("a result the group does not compute".into());
            };
            let channel = self.channel_results.get(key).copied();
            let per_row = match &self.reduction {
                _ if channel.is_some() => false,
                Some(r) if out.numel == r.rows && out.numel != r.rows * r.width => true,
                // The rows' elements in another shape (a view of them): element p is still
                // column p % width of row p / width when the result is contiguous, or laid out
                // in the rows' order (a channels-last image as an NCHW tensor: its pixels are
                // rows of channels). A group norm's rows span several dimensions; its reads keep
                // to their own rows (`row_elements`).
                Some(r)
                    if out.numel == r.rows * r.width
                        && (r.op == "moments"
                            || r.op == "group_norm_backward"
                            || out.shape.last().map(|&w| w as u64) == Some(r.width)
                            || rows_in_memory_order(&out, r.width)) =>
                {
                    false
                }
                Some(_) => {
                    return Err("a result of neither the rows' nor the row count's size".into())
                }
                None => false,
            };
            if let Some(r) = &self.reduction {
                if !rows_in_memory_order(&out, r.width) {
                    check_contiguous(&out).map_err(|e| format!("a result {e}"))?;
                }
            } else if out.numel != self.results[&results[0]].1.numel {
                return Err("results of different sizes".into());
            }
            self.args.push(KernelArg::Output(out.clone()));
            self.sources.push(ArgSource {
                call,
                output: true,
                position,
                element: None,
            });
            stored.push(StoredResult {
                arg: self.args.len() - 1,
                function: index,
                ty: c_type(kind_of(&out.dtype).unwrap_or(Kind::Float)),
                per_row,
                channel,
                held: false,
            });
        }
        Ok(stored)
    }
}

/// The second entry point of kernel `name` (its parameters `params`, its arguments' `names`),
/// which adds up its blocks' sums over columns into the `stored` results, and its source.
fn finish_entry(
    r: &RowReduction,
    blocks: u64,
    name: &str,
    params: &[String],
    names: &[String],
    stored: &[StoredResult],
) -> (Finish, String) {
    let plan = FinishPlan::of(r, blocks);
    let finish = Finish {
        name: format!("{name}_columns"),
        blocks: plan.finish_blocks(),
    };
    let entry = format!(
        "\nextern \"C\" __global__ __launch_bounds__({FINISH_THREADS}) void {}({}, long long n) {{\n  Args a{{{}}};\n{}}}\n",
        finish.name,
        params.join(", "),
        names.join(", "),
        column_finish(&plan, stored)
    );
    (finish, entry)
}

/// The blocks of a row kernel that sums columns: one per row up to [`COLUMN_BLOCKS`], or as many
/// more as a layer norm's backward's blocks (a thread per four columns) are smaller than 256
/// threads, so that a narrow row's kernel still fills the SMs (1024 blocks of 32 threads kept an
/// eighth of an H200's threads busy). A layer norm's backward of [`ONE_WAVE_THREADS`] or more
/// generated for a GPU ([`for_multiprocessors`]) runs one wave: as many blocks as its SMs hold at
/// once ([`resident_blocks`]). Its blocks walk their rows one after another, a block sum apart,
/// so a second wave of a few blocks took as long as the first: `transformer_tch`'s (16384 rows of
/// 768) took 79.5 µs in 1365 blocks of 192 threads on an H200, which holds 1056, and 65.1 µs in
/// 1056.
fn column_blocks(r: &RowReduction, vectorised: bool) -> u64 {
    let Some(threads) = layer_norm_backward_threads(r, vectorised) else {
        return r.rows.clamp(1, COLUMN_BLOCKS);
    };
    let most = match one_wave(r, threads) {
        Some((sms, resident)) => sms * resident,
        None => (COLUMN_BLOCKS * 256 / threads).max(COLUMN_BLOCKS),
    };
    r.rows.clamp(1, most)
}

/// The least threads of a layer norm's backward's blocks that run one wave (rows of 512 columns
/// or more). Narrower rows' blocks stay as many as before: bounded to 40 registers, `vit_tch`'s
/// (384 columns, its dropout's mask drawn again) took its step from 15.9 to 16.3 ms, unresolved.
const ONE_WAVE_THREADS: u64 = 128;

/// (SMs, blocks an SM holds) where the layer norm's backward of `r`, of blocks of `threads`,
/// runs one wave.
fn one_wave(r: &RowReduction, threads: u64) -> Option<(u64, u64)> {
    let sms = TARGET_MULTIPROCESSORS.get()?;
    // Its column sums in shared memory, a float a column each, and its block sums' 32 pairs.
    let shared = 4 * r.width * r.column_sums.len() as u64 + 256;
    (threads >= ONE_WAVE_THREADS).then(|| (sms, resident_blocks(threads, shared)))
}

/// The registers a thread of a one-wave kernel may take ([`resident_blocks`]): a layer norm's
/// backward takes 40 at 768 columns.
const REGISTER_BUDGET: u64 = 40;

/// Blocks of `threads` using `shared` bytes of shared memory that an SM holds at once (2048
/// threads, 64 Ki registers, 32 blocks; 164 KiB of shared memory with 1 KiB more a block, an
/// A100's, where an H100 has 228) where each thread takes at most [`REGISTER_BUDGET`] registers:
/// the kernel's `__launch_bounds__` asks the compiler for that many, so that the wave
/// [`column_blocks`] plans is the one that runs.
fn resident_blocks(threads: u64, shared: u64) -> u64 {
    (2048 / threads)
        .min(65_536 / (threads * REGISTER_BUDGET))
        .min(167_936 / (shared + 1024))
        .clamp(1, 32)
}

thread_local! {
    /// The SMs of the GPU the kernels being generated on this thread are for
    /// ([`for_multiprocessors`]).
    static TARGET_MULTIPROCESSORS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// While the guard lives, the kernels this thread generates are for a GPU of `multiprocessors`
/// SMs (a row kernel's blocks fill it in one wave); its drop puts back what was before.
pub(crate) fn for_multiprocessors(multiprocessors: u64) -> TargetGuard {
    TargetGuard(TARGET_MULTIPROCESSORS.replace(Some(multiprocessors.max(1))))
}

/// What [`for_multiprocessors`] replaced, put back at its drop.
pub(crate) struct TargetGuard(Option<u64>);

impl Drop for TargetGuard {
    fn drop(&mut self) {
        TARGET_MULTIPROCESSORS.set(self.0);
    }
}

/// The sums of each column a kernel keeps for its finish: one a strip of rows where its rows are
/// summed in strips ([`ColumnStrips`]), else one a block.
fn partial_blocks(r: &RowReduction, vectorised: bool, strips: Option<ColumnStrips>) -> u64 {
    strips.map_or_else(|| column_blocks(r, vectorised), |s| s.strips)
}

/// How a kernel stores one result: argument `out{arg}` takes function `v{function}`'s values as
/// `ty`, one per element or, with `per_row`, one per row of the reduction; or, with `channel`, a
/// group norm's backward's weight (0) or bias (1) gradient or sum over channels (2 on), one per
/// channel, or a row kernel's sum over columns (0 on), one per column.
struct StoredResult {
    arg: usize,
    function: usize,
    ty: &'static str,
    per_row: bool,
    channel: Option<usize>,
    /// Whether its value at each element is the one the row held in registers holds there
    /// ([`Generator::held_function`]): stored from the register, not computed again.
    held: bool,
}

/// Elements each thread of a pointwise kernel computes per tile, a block apart (ATen's unrolled
/// elementwise kernels do the same): every load is coalesced across the warp, and each thread has
/// this many in flight.
const UNROLL: u64 = 4;

/// Elements a thread of a vectorised pointwise kernel takes where every argument it loads or
/// stores a group of is 16-bit: 16 bytes each, as [`UNROLL`] fp32 elements are.
const WIDE: u64 = 8;

/// The bytes of `width` of `t`'s elements.
fn vector_bytes(t: &TracedTensor, width: u64) -> usize {
    kind_of(&t.dtype).unwrap_or(Kind::Float).elt_size_in_bytes() * width as usize
}

/// Whether `t` is a 16-bit tensor whose groups of [`WIDE`] elements from its start are 16 bytes
/// apart, or a bool result's (8 bytes): one vectorised load or store each.
fn takes_wide_groups(t: &TracedTensor) -> bool {
    kind_of(&t.dtype).is_some_and(|k| k.elt_size_in_bytes() == 2 || k == Kind::Bool)
        && t.offset % WIDE == 0
}

/// The most dimensions a result computed from its coordinates has (`Coords`' size).
const MAX_RANK: usize = 8;

/// The declaration of `c`, the coordinates of the element at storage index `p` of `out` (dense,
/// in any order of dimensions).
fn coordinates_of(out: &TracedTensor) -> String {
    format!(
        "  idx_t c[{}];\n{}",
        out.shape.len().max(1),
        coordinate_lines(out)
    )
}

/// The coordinates of `at`'s element that `t`'s element at coordinates `coords` is (their last
/// `t`'s rank of the `rank` read), as C expressions joined by commas, where `t` is a box of
/// `at`'s elements with `at`'s strides (`at` itself, a `narrow` of it, a `select`, a transposed
/// view): an offset into `at` per dimension, each of `t`'s dimensions one of `at`'s. `None` where
/// `t` reads `at` otherwise (a view of other sizes), whose index must be divided out again.
fn handed_coordinates(
    t: &TracedTensor,
    at: &TracedTensor,
    coords: &str,
    rank: usize,
) -> Option<String> {
    // The offset into `at`, split over its dimensions from the widest stride down.
    let mut order: Vec<usize> = (0..at.shape.len()).filter(|&e| at.shape[e] > 1).collect();
    order.sort_by_key(|&e| std::cmp::Reverse(at.strides[e]));
    let mut start = vec![0i64; at.shape.len()];
    let mut rest = t.offset.checked_sub(at.offset)? as i64;
    for &e in &order {
        start[e] = rest / at.strides[e].max(1);
        rest -= start[e] * at.strides[e];
    }
    if rest != 0 {
        return None;
    }
    let lead = rank.checked_sub(t.shape.len())?;
    let mut of_at: Vec<Option<usize>> = vec![None; at.shape.len()];
    for (d, (&size, &stride)) in t.shape.iter().zip(&t.strides).enumerate() {
        if size == 1 {
            continue;
        }
        let e = (0..at.shape.len())
            .find(|&e| at.strides[e] == stride && at.shape[e] > 1 && of_at[e].is_none())?;
        if start[e] + size > at.shape[e] {
            return None;
        }
        of_at[e] = Some(d + lead);
    }
    let coordinates: Vec<String> = (0..at.shape.len())
        .map(|e| match (of_at[e], start[e]) {
            (Some(d), 0) => format!("{coords}[{d}]"),
            (Some(d), s) => format!("{coords}[{d}] + {s}"),
            (None, s) => s.to_string(),
        })
        .collect();
    (start
        .iter()
        .zip(&at.shape)
        .all(|(&s, &size)| s < size.max(1)))
    .then(|| coordinates.join(", "))
}

/// The statements setting `c`, the coordinates of the element at storage index `p` of `out`.
fn coordinate_lines(out: &TracedTensor) -> String {
    let mut body = String::new();
    for (d, (&size, &stride)) in out.shape.iter().zip(&out.strides).enumerate() {
        if size == 1 {
            body.push_str(&format!("  c[{d}] = 0;\n"));
        } else {
            // `COORD` (per kernel): of a vectorised thread's own group, from its first element.
            body.push_str(&format!("  c[{d}] = COORD(p, {stride}, {size});\n"));
        }
    }
    body
}

/// The definitions of `COORD(p, stride, size)`, the coordinate of stride `stride` and size `size`
/// of index `p`, and `ROW_OF(p, width)`, the row of `width` elements that `p` is in. Unsigned: a
/// division by a power of two is then one shift and a remainder one mask (signed, each takes
/// several instructions, and layout-heavy kernels such as rotary embeddings were bound by them).
///
/// In a kernel vectorised `width` elements a thread, each `p` of a thread's own group (from
/// `a.first`, a multiple of `width`) is divided once per group, not once per element: a stride
/// or row that is a multiple of `width` gives every element of the group `a.first`'s quotient,
/// and along stride 1 of a size that is a multiple of `width` the element is `a.first`'s plus its
/// place in the group. The tests are of constants and of the element's place in its group, a
/// constant where the element is `a.first + k`, so the compiler keeps one branch. Generated
/// kernels of group norms spent most of their instructions dividing each element's index by the
/// strides of four dimensions.
fn index_division(width: Option<u64>) -> (String, String) {
    let plain = (
        "((idx_t)((uidx_t)(p) / (stride) % (size)))".to_string(),
        "((p) / (width))".to_string(),
    );
    let Some(w) = width else { return plain };
    let own = format!("(unsigned)((p) - a.first) < {w}u");
    (
        format!(
            "({own} && (stride) % {w} == 0 ? (idx_t)((uidx_t)a.first / (stride) % (size)) : {own} && (stride) == 1 && (size) % {w} == 0 ? (idx_t)((uidx_t)a.first % (size)) + ((p) - a.first) : {})",
            plain.0
        ),
        format!("({own} && (width) % {w} == 0 ? a.first / (width) : {})", plain.1),
    )
}

/// Whether `out`'s type holds every value of `t`'s: the same type, or fp32 of a 16-bit one.
fn holds_every_value(t: &TracedTensor, out: &TracedTensor) -> bool {
    match (kind_of(&t.dtype), kind_of(&out.dtype)) {
        (Some(from), Some(to)) if from == to => true,
        (Some(Kind::BFloat16 | Kind::Half), Some(Kind::Float)) => true,
        _ => false,
    }
}

/// The index type of a kernel whose tensors reach `extent` elements: 32-bit where every index and
/// every grid-stride step past the last fits, since 64-bit division by the strides' constants
/// costs several times the instructions; signed, so that the compiler may take an index plus a
/// small constant not to wrap, and see neighbouring elements' addresses as neighbours.
fn index_type(extent: u64) -> &'static str {
    if extent < 1 << 30 {
        "int"
    } else {
        "long long"
    }
}

/// The unsigned type of [`index_type`]'s: what coordinates are divided out of an index in.
fn unsigned_index_type(extent: u64) -> &'static str {
    if extent < 1 << 30 {
        "unsigned"
    } else {
        "unsigned long long"
    }
}

/// Whether `t`, read at the coordinates of an element of `out`, is at that element's own index:
/// the same sizes and strides over every dimension where `out` is not of size 1.
/// `t` has no more dimensions than `out` (its own are `out`'s last ones), as [`Generator::read`]
/// checks first.
fn reads_as_laid_out(t: &TracedTensor, out: &TracedTensor) -> bool {
    let lead = out.shape.len() - t.shape.len();
    out.shape.iter().enumerate().all(|(d, &size)| {
        size == 1
            || (d >= lead && t.shape[d - lead] == size && t.strides[d - lead] == out.strides[d])
    })
}

/// The declaration of `name`, the result's coordinates `c` with dimension `dim` moved to `at`: where
/// a layout copy reads its input.
fn moved_coordinates(name: &str, rank: usize, dim: usize, at: &str) -> String {
    format!(
        "  idx_t {name}[{rank}];\n  for (int d = 0; d < {rank}; ++d) {name}[d] = c[d];\n  {name}[{dim}] = {at};\n"
    )
}

/// `t`'s sizes in row-major order from offset 0: the space a row reduction's `(row, col)` index.
fn row_major(t: &TracedTensor) -> TracedTensor {
    let mut strides = vec![1i64; t.shape.len()];
    for d in (0..t.shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * t.shape[d + 1].max(1);
    }
    TracedTensor {
        strides,
        offset: 0,
        ..t.clone()
    }
}

/// `op`'s one tensor result and its type, checked to be dense from the start of its storage (the
/// space a generated function indexes).
fn dense_result(op: &TracedOp) -> Result<(TracedTensor, Kind), String> {
    let out = match op.outputs.as_slice() {
        [TracedValue::Tensor(t)] => t.clone(),
        _ => return Err(format!("{} has other than one tensor result", op.name)),
    };
    let kind = kind_of(&out.dtype).ok_or_else(|| format!("{} writes {}", op.name, out.dtype))?;
    check_dense(&out).map_err(|e| format!("{}'s result {e}", op.name))?;
    Ok((out, kind))
}

/// `dim` counted from the front of `rank` dimensions.
fn normalized_dim(dim: i64, rank: usize) -> Result<usize, String> {
    let rank = rank as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    if (0..rank).contains(&d) {
        Ok(d as usize)
    } else {
        Err(format!("dimension {dim} of a tensor of {rank}"))
    }
}

/// Whether `t` is contiguous (row-major) from the start of its storage.
fn check_contiguous(t: &TracedTensor) -> Result<(), String> {
    if !is_row_major(t) {
        return Err("is not contiguous".into());
    }
    if t.offset != 0 {
        return Err("starts inside its storage".into());
    }
    Ok(())
}

/// Whether `t` is row-major from wherever it starts.
fn is_row_major(t: &TracedTensor) -> bool {
    let mut expected = 1;
    for (&size, &stride) in t.shape.iter().zip(&t.strides).rev() {
        if size != 1 && stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// Whether `t`'s elements lie in memory as rows of `width` (dense from its start, its dimension of
/// stride 1 `width` long) where its shape says otherwise: an NCHW tensor in channels-last memory
/// holds its pixels as rows of channels. A kernel that writes element p at offset p writes it.
fn rows_in_memory_order(t: &TracedTensor, width: u64) -> bool {
    let innermost = (t.shape.iter().zip(&t.strides))
        .filter(|&(&size, _)| size != 1)
        .min_by_key(|&(_, &stride)| stride)
        .map(|(&size, _)| size as u64);
    check_dense(t).is_ok() && innermost == Some(width)
}

/// Whether `t` covers its storage densely from its start (any order of dimensions).
fn check_dense(t: &TracedTensor) -> Result<(), String> {
    if !dense(t) {
        return Err("is not dense in memory".into());
    }
    if t.offset != 0 {
        return Err("starts inside its storage".into());
    }
    Ok(())
}

/// Whether `t`'s elements lie in memory without gaps or overlaps, in any order of its
/// dimensions, from wherever it starts.
fn dense(t: &TracedTensor) -> bool {
    let mut dims: Vec<(i64, i64)> = (t.shape.iter().copied().zip(t.strides.iter().copied()))
        .filter(|&(size, _)| size != 1)
        .collect();
    dims.sort_by_key(|&(_, stride)| stride);
    let mut expected = 1;
    for (size, stride) in dims {
        if stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// FNV-1a, 64 bits: the entry point's name from the group's structure (stable across runs, so the
/// kernel cache finds the same source again).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
