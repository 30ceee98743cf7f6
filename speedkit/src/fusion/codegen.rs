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
    /// Elements each thread computes per tile (a pointwise kernel's unrolling, else 1).
    unroll: u64,
    /// Threads a block.
    block: u64,
    /// Per argument, the bytes its pointer must be aligned to (0: any), for a vectorised kernel's
    /// loads and stores of four elements; the launch checks it.
    pub(crate) alignment: Vec<usize>,
    /// Where each argument comes from in the step, in `args`' order.
    pub(crate) sources: Vec<ArgSource>,
    /// Floats of zeroed scratch memory the kernel takes after its arguments (0: none): a group
    /// norm's backward's per-sample terms of its weight and bias gradients.
    pub(crate) workspace: u64,
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
    /// registers, [`RowCache`]), each block a row of a group with a reduction, else 256 × the
    /// unrolling elements (the kernels loop over what a grid does not cover).
    pub fn grid_and_block(&self) -> (u32, u32) {
        let blocks = if self.rows {
            self.numel
        } else {
            self.numel.div_ceil(self.block * self.unroll)
        };
        (blocks.clamp(1, 65_535) as u32, self.block as u32)
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
/// dimension, and group norms ([`GroupNormRows`]) and their backwards ([`GroupNormGradients`]).
pub(crate) fn takes(op: &TracedOp) -> bool {
    let stores = |op: &TracedOp| match op.outputs.as_slice() {
        [TracedValue::Tensor(t)] => kind_of(&t.dtype).is_some(),
        _ => false,
    };
    match OpKind::of(&op.name) {
        Some(OpKind::View) => true,
        Some(OpKind::Pointwise) => (!op.name.ends_with('_') || writes_in_place(op)) && stores(op),
        Some(OpKind::Reduction) => {
            (stores(op) && reduces_last_dimension(op))
                || sums_channels(op)
                || normalizes_groups(op).is_some()
                || group_norm_gradients(op).is_some()
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
/// coordinates less the part's start) and `slice_backward` (the gradient where the slice took its
/// elements, zero elsewhere).
fn generates_layout(op: &TracedOp) -> bool {
    matches!(op.name.as_str(), "aten::cat" | "aten::slice_backward")
}

/// A group norm's rows as the generator takes them: `native_group_norm` of a tensor of samples ×
/// channels × `hxw` elements, in `rows` = samples × groups rows of `width` elements, its
/// three results (normalised elements, means, reciprocal standard deviations) of stored types and
/// contiguous, the first in its input's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
struct GroupNormRows {
    rows: u64,
    width: u64,
    eps: f64,
}

/// `op`'s rows where it is a group norm the generator takes ([`GroupNormRows`]).
fn normalizes_groups(op: &TracedOp) -> Option<GroupNormRows> {
    if op.name != "aten::native_group_norm" {
        return None;
    }
    let [TracedValue::Tensor(out), TracedValue::Tensor(mean), TracedValue::Tensor(rstd)] =
        op.outputs.as_slice()
    else {
        return None;
    };
    let Some(TracedValue::Tensor(input)) = op.inputs.first() else {
        return None;
    };
    let (samples, channels, hxw, groups) = (
        integer(op.inputs.get(3))?,
        integer(op.inputs.get(4))?,
        integer(op.inputs.get(5))?,
        integer(op.inputs.get(6))?,
    );
    let eps = match op.inputs.get(7)? {
        TracedValue::Other { value, .. } => value.trim_matches('"').parse::<f64>().ok()?,
        _ => return None,
    };
    let rows = (samples * groups) as u64;
    let sized = groups > 0
        && channels % groups == 0
        && input.shape.len() >= 2
        && input.shape[1] == channels
        && input.numel == (samples * channels * hxw) as u64
        && out.shape == input.shape
        && mean.numel == rows
        && rstd.numel == rows;
    let stored = [input, out, mean, rstd]
        .iter()
        .all(|t| kind_of(&t.dtype).is_some_and(|k| k != Kind::Bool));
    let contiguous = [out, mean, rstd]
        .iter()
        .all(|t| check_contiguous(t).is_ok());
    (sized && stored && contiguous).then_some(GroupNormRows {
        rows,
        width: (channels / groups * hxw) as u64,
        eps,
    })
}

/// A group norm's backward as the generator takes it: `native_group_norm_backward` of the
/// gradient and input of a tensor of `samples` × `channels` × `hxw` elements in `groups` groups,
/// with the forward's stored statistics (contiguous, one per row), and all three gradients (the
/// input's contiguous in its shape, the weight's and bias's one per channel) of stored types.
#[derive(Clone, Copy, Debug, PartialEq)]
struct GroupNormGradients {
    samples: u64,
    channels: u64,
    groups: u64,
    hxw: u64,
}

impl GroupNormGradients {
    fn rows(&self) -> u64 {
        self.samples * self.groups
    }

    fn channels_per_group(&self) -> u64 {
        self.channels / self.groups
    }

    fn width(&self) -> u64 {
        self.channels_per_group() * self.hxw
    }
}

/// `op`'s shape where it is a group norm's backward the generator takes ([`GroupNormGradients`]).
fn group_norm_gradients(op: &TracedOp) -> Option<GroupNormGradients> {
    if op.name != "aten::native_group_norm_backward" {
        return None;
    }
    let tensor = |i: usize| match op.inputs.get(i) {
        Some(TracedValue::Tensor(t)) => Some(t),
        _ => None,
    };
    let (grad, input, mean, rstd) = (tensor(0)?, tensor(1)?, tensor(2)?, tensor(3)?);
    let [TracedValue::Tensor(dx), TracedValue::Tensor(dw), TracedValue::Tensor(db)] =
        op.outputs.as_slice()
    else {
        return None;
    };
    let (samples, channels, hxw, groups) = (
        integer(op.inputs.get(5))?,
        integer(op.inputs.get(6))?,
        integer(op.inputs.get(7))?,
        integer(op.inputs.get(8))?,
    );
    if samples <= 0 || channels <= 0 || hxw <= 0 || groups <= 0 || channels % groups != 0 {
        return None;
    }
    let shape = GroupNormGradients {
        samples: samples as u64,
        channels: channels as u64,
        groups: groups as u64,
        hxw: hxw as u64,
    };
    let sized = input.shape.len() >= 2
        && input.shape[1] == channels
        && input.numel == shape.rows() * shape.width()
        && grad.shape == input.shape
        && dx.shape == input.shape
        && [mean, rstd].iter().all(|t| t.numel == shape.rows())
        && [dw, db].iter().all(|t| t.numel == shape.channels);
    let stored = [grad, input, mean, rstd, dx, dw, db]
        .iter()
        .all(|t| t.item_bytes > 0 && kind_of(&t.dtype).is_some_and(|k| k != Kind::Bool));
    let contiguous = [mean, rstd, dx, dw, db]
        .iter()
        .all(|t| check_contiguous(t).is_ok());
    (sized && stored && contiguous).then_some(shape)
}

/// A traced integer argument (a dimension, a slice's bound).
fn integer(value: Option<&TracedValue>) -> Option<i64> {
    match value? {
        TracedValue::Other { value, .. } => value.trim_matches('"').parse().ok(),
        _ => None,
    }
}

/// Whether `op` sums every element of each channel (all dimensions but the second) of a tensor
/// of at least three dimensions, in its own type: the gradient of a bias broadcast over a
/// convolution's output, as autograd sums it.
pub(crate) fn sums_channels(op: &TracedOp) -> bool {
    if !op.schema.starts_with("aten::sum.dim_IntList(") {
        return false;
    }
    let (Some(TracedValue::Tensor(input)), Some(TracedValue::Other { value, .. })) =
        (op.inputs.first(), op.inputs.get(1))
    else {
        return false;
    };
    let rank = input.shape.len() as i64;
    let Ok(mut dims) = serde_json::from_str::<Vec<i64>>(value) else {
        return false;
    };
    for d in &mut dims {
        *d = (*d + rank) % rank.max(1);
    }
    dims.sort_unstable();
    let all_but_channels: Vec<i64> = (0..rank).filter(|&d| d != 1).collect();
    let same_type = match op.outputs.as_slice() {
        [TracedValue::Tensor(out)] => out.dtype == input.dtype && kind_of(&out.dtype).is_some(),
        _ => false,
    };
    rank >= 3 && dims == all_but_channels && same_type
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
    generate_with(ops, results, inside, false)
}

/// As [`generate`], for a result recomputed in the backward: a group norm among `ops` reads its
/// rows' statistics from its own stored results (the means and reciprocal standard deviations
/// the backward keeps), so that its normalised elements are pointwise.
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
            Some(OpKind::Pointwise) if !op.name.ends_with('_') || writes_in_place(op) => {
                g.operator(op)?
            }
            Some(OpKind::Reduction) if normalizes_groups(op).is_some() => g.group_norm(op)?,
            Some(OpKind::Reduction) if group_norm_gradients(op).is_some() => {
                g.group_norm_backward(op)?
            }
            Some(OpKind::Reduction) if sums_channels(op) => g.channel_sum(op)?,
            Some(OpKind::Reduction) => g.reduction(op)?,
            Some(OpKind::Layout) if generates_layout(op) => g.layout(op)?,
            _ => {
                return Err(format!(
                    "{} is not generated yet (pointwise operators, row reductions, cat and \
                     slice_backward only)",
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
    /// Whether group norms read their statistics from their stored results
    /// ([`generate_recomputed`]) instead of reducing their rows.
    stored_statistics: bool,
    /// A group norm's backward's weight and bias gradients by key (0 and 1): the kernel's last
    /// block writes them, once every row is summed, so no function computes them.
    channel_results: HashMap<(u64, u64), usize>,
}

/// A reduction over the last dimension: one block per row reduces `in_red(a, row, col, NO_ROW)`
/// over its `width` columns, and every function reads the row's result as `red.x`; a group
/// norm's rows (its `moments`) give their mean as `red.x` and their reciprocal standard
/// deviation as `red.y`.
#[derive(Clone, Debug)]
struct RowReduction {
    rows: u64,
    width: u64,
    /// `sum`, `mean` (a sum divided by the width), `amax` or `moments`.
    op: &'static str,
    /// The `moments`' epsilon, added to the variance.
    eps: f64,
    /// A group norm's backward's (`op` `group_norm_backward`).
    gradients: Option<GradientRows>,
}

/// A group norm's backward's rows ([`GroupNormGradients`]) and the arguments its row loop reads
/// itself: the statistics, one per row, and the weight (its argument and stride), if any.
#[derive(Clone, Debug)]
struct GradientRows {
    shape: GroupNormGradients,
    mean: usize,
    rstd: usize,
    weight: Option<(usize, i64)>,
    /// The elements summed over each channel ([`Generator::channel_sum`]), as read at `p`.
    channel_sums: Vec<String>,
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

    /// A layout copy ([`generates_layout`]): its result's element read from the input element it
    /// copies, through coordinates of its own.
    fn layout(&mut self, op: &TracedOp) -> Result<(), String> {
        let (out, out_kind) = dense_result(op)?;
        let mut body = coordinates_of(&out);
        let expression = if op.name == "aten::cat" {
            self.cat(op, &out, &mut body)
        } else {
            self.slice_backward(op, &out, &mut body)
        };
        self.coords = "c".into();
        self.element = None;
        writeln!(
            body,
            "  return round_to<{}>({});",
            c_type(out_kind),
            expression?
        )
        .unwrap();
        self.define(op, &out, &body);
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
        let index = self.function_count;
        self.function_count += 1;
        if std::mem::take(&mut self.read_written) {
            self.reads_written.insert(index);
        }
        if std::mem::take(&mut self.read_row_element) {
            self.row_elements.insert(index);
        }
        writeln!(
            self.functions,
            "// {}\n__device__ __forceinline__ float v{index}(const Args& a, idx_t p, float2 red) {{\n{body}}}\n",
            op.schema
        )
        .unwrap();
        self.note_extent(out);
        let position = (op.outputs.iter())
            .position(|v| matches!(v, TracedValue::Tensor(t) if t.key() == out.key()))
            .unwrap_or(0);
        self.results
            .insert(out.key(), (index, out.clone(), self.call, position));
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
        // `p` is the element's index in the rows' space, which a contiguous input reads as it
        // is (its coordinates are then dead code, which the compiler drops).
        writeln!(body, "  const idx_t p = row * {width} + col;").unwrap();
        writeln!(body, "  idx_t c[{}];", input.shape.len()).unwrap();
        writeln!(body, "  idx_t r = row;").unwrap();
        for d in (0..input.shape.len() - 1).rev() {
            let size = input.shape[d];
            writeln!(body, "  c[{d}] = r % {size}; r /= {size};").unwrap();
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

    /// A group norm ([`GroupNormRows`]): its input read at row `n * groups + g`, column `col`
    /// (the row's channels one after the other, each channel's elements in order), and three
    /// functions: the normalised element, scaled and shifted by its channel's weight and bias as
    /// ATen does (`x * (rstd * w) + (b - mean * rstd * w)`), and the row's mean and reciprocal
    /// standard deviation.
    fn group_norm(&mut self, op: &TracedOp) -> Result<(), String> {
        let shape = normalizes_groups(op).ok_or("a group norm of a shape not generated")?;
        if self.stored_statistics {
            return self.group_norm_from_statistics(op, shape.width);
        }
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let (
            Some(TracedValue::Tensor(input)),
            [TracedValue::Tensor(out), TracedValue::Tensor(mean), TracedValue::Tensor(rstd)],
        ) = (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err("native_group_norm without its input and three results".into());
        };
        let mut body = String::new();
        writeln!(body, "  const idx_t p = row * {} + col;", shape.width).unwrap();
        body.push_str(&coordinates_of(&row_major(input)));
        self.row_input(op, "in_red", 0, body)?;
        let body = self.normalised(op, input, out, |_| ["red.x".into(), "red.y".into()])?;
        self.read_row_element = true;
        self.define(op, out, &body);
        // A row's statistics too are its own block's only.
        for (statistic, t) in [("red.x", mean), ("red.y", rstd)] {
            let kind = kind_of(&t.dtype).unwrap_or(Kind::Float);
            let body = format!("  return round_to<{}>({statistic});\n", c_type(kind));
            self.read_row_element = true;
            self.define(op, t, &body);
        }
        self.reduction = Some(RowReduction {
            rows: shape.rows,
            width: shape.width,
            op: "moments",
            eps: shape.eps,
            gradients: None,
        });
        Ok(())
    }

    /// A group norm's normalised elements from its stored statistics (results 1 and 2, one per
    /// row of `width` elements): a pointwise function, computed as the reduction's is.
    fn group_norm_from_statistics(&mut self, op: &TracedOp, width: u64) -> Result<(), String> {
        let (
            Some(TracedValue::Tensor(input)),
            [TracedValue::Tensor(out), TracedValue::Tensor(mean), TracedValue::Tensor(rstd)],
        ) = (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err("native_group_norm without its input and three results".into());
        };
        let body = self.normalised(op, input, out, |g| {
            [(mean, 1), (rstd, 2)].map(|(t, position)| {
                let i = g.result_argument(t, position);
                format!("to_float_any(a.in{i}[p / {width}])")
            })
        })?;
        self.define(op, out, &body);
        Ok(())
    }

    /// A group norm's backward ([`GroupNormGradients`]) as ATen computes it: per row, the sums of
    /// `dy * x` and `dy` over each of its channels; the input's gradient
    /// `rstd * w * dy + c2 * x + c3`, with `c2` and `c3` of the row's channel sums weighted by
    /// `w` (`red`); the weight's and bias's, the sums over samples of each channel's
    /// `(sum(dy * x) - sum(dy) * mean) * rstd` and `sum(dy)`, by the kernel's last block.
    fn group_norm_backward(&mut self, op: &TracedOp) -> Result<(), String> {
        let shape = group_norm_gradients(op).ok_or("a group norm's backward not generated")?;
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let (
            [Some(TracedValue::Tensor(grad)), Some(TracedValue::Tensor(input)), Some(TracedValue::Tensor(mean)), Some(TracedValue::Tensor(rstd))],
            [TracedValue::Tensor(dx), TracedValue::Tensor(dw), TracedValue::Tensor(db)],
        ) = (
            [0, 1, 2, 3].map(|i| op.inputs.get(i)),
            op.outputs.as_slice(),
        )
        else {
            return Err(
                "native_group_norm_backward without its four inputs and three results".into(),
            );
        };
        let width = shape.width();
        for (name, position, t) in [("in_dy", 0, grad), ("in_x", 1, input)] {
            let mut body = format!("  const idx_t p = row * {width} + col;\n");
            body.push_str(&coordinates_of(&row_major(t)));
            self.row_input(op, name, position, body)?;
        }
        let [mean, rstd] = [(2, mean), (3, rstd)].map(|(position, t)| {
            self.position = position;
            self.note_extent(t);
            (!self.inside.contains(&(self.call, t.storage)))
                .then(|| self.argument(t, KernelArg::Input(t.clone())))
        });
        let (Some(mean), Some(rstd)) = (mean, rstd) else {
            return Err("a group norm's statistics computed in the group of its backward".into());
        };
        let weight = self.channel_argument(op, 4)?;
        let mut body = coordinates_of(dx);
        self.position = 0;
        let dy = format!("OWN(0, {})", self.read(grad, dx)?);
        self.position = 1;
        let x = self.read(input, dx)?;
        let w = channel_read(weight, "c[1]", "1.f");
        let kind = kind_of(&dx.dtype).unwrap_or(Kind::Float);
        writeln!(
            body,
            "  return round_to<{}>(to_float_any(a.in{rstd}[p / {width}]) * {w} * {dy} + red.x * {x} + red.y);",
            c_type(kind)
        )
        .unwrap();
        // Computed with its row's sums, it is its own block's only.
        self.read_row_element = true;
        self.define(op, dx, &body);
        for (which, t) in [dw, db].into_iter().enumerate() {
            self.note_extent(t);
            self.results
                .insert(t.key(), (usize::MAX, t.clone(), self.call, which + 1));
            self.channel_results.insert(t.key(), which);
        }
        self.reduction = Some(RowReduction {
            rows: shape.rows(),
            width,
            op: "group_norm_backward",
            eps: 0.0,
            gradients: Some(GradientRows {
                shape,
                mean,
                rstd,
                weight,
                channel_sums: Vec::new(),
            }),
        });
        Ok(())
    }

    /// A sum of every element of each channel ([`sums_channels`]) of a result of the group's
    /// group norm's backward's rows, read at its own element: each block sums its row's channels
    /// as it writes them, and the last block sums the samples, as it does the weight's gradient.
    fn channel_sum(&mut self, op: &TracedOp) -> Result<(), String> {
        let outside = "a sum over each channel outside a group norm's backward's rows";
        let Some(shape) = (self.reduction.as_ref())
            .and_then(|r| r.gradients.as_ref())
            .map(|g| g.shape)
        else {
            return Err(outside.into());
        };
        let (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) =
            (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err(format!("{} without its input and result", op.name));
        };
        let rows = input.shape.len() >= 3
            && input.shape[..2] == [shape.samples as i64, shape.channels as i64]
            && input.numel == shape.rows() * shape.width()
            && check_contiguous(input).is_ok()
            && out.numel == shape.channels
            && check_contiguous(out).is_ok();
        if !rows || !self.inside.contains(&(self.call, input.storage)) {
            return Err(outside.into());
        }
        self.position = 0;
        let value = self.read(input, &row_major(input))?;
        if value.contains("c[") {
            return Err(outside.into());
        }
        let Some(gradients) = self.reduction.as_mut().and_then(|r| r.gradients.as_mut()) else {
            return Err(outside.into());
        };
        gradients.channel_sums.push(value);
        let which = 1 + gradients.channel_sums.len();
        self.read_row_element = false;
        self.note_extent(out);
        self.results
            .insert(out.key(), (usize::MAX, out.clone(), self.call, 0));
        self.channel_results.insert(out.key(), which);
        write!(self.signature, "{};", op.schema).unwrap();
        Ok(())
    }

    /// The body of a group norm's normalised element `out[p]`, scaled and shifted as ATen does,
    /// from its row's mean and reciprocal standard deviation as `statistics` reads them (after
    /// the input, weight and bias).
    fn normalised(
        &mut self,
        op: &TracedOp,
        input: &TracedTensor,
        out: &TracedTensor,
        statistics: impl FnOnce(&mut Self) -> [String; 2],
    ) -> Result<String, String> {
        let mut body = coordinates_of(out);
        self.position = 0;
        let x = self.read(input, out)?;
        // The row's own input, held in registers where the kernel holds its row.
        let x = match self.stored_statistics {
            true => x,
            false => format!("OWN(0, {x})"),
        };
        let weight = self.read_channel(op, 1, "1.f")?;
        let bias = self.read_channel(op, 2, "0.f")?;
        let [mean, rstd] = statistics(self);
        let out_kind = kind_of(&out.dtype).unwrap_or(Kind::Float);
        writeln!(body, "  const float scale = {rstd} * {weight};").unwrap();
        writeln!(
            body,
            "  return round_to<{}>({x} * scale + ({bias} - {mean} * scale));",
            c_type(out_kind)
        )
        .unwrap();
        Ok(body)
    }

    /// The index of the argument reading result `position` of the call being generated (a
    /// statistic it stored), added on its first read.
    fn result_argument(&mut self, t: &TracedTensor, position: usize) -> usize {
        self.note_extent(t);
        let i = self.argument(t, KernelArg::Input(t.clone()));
        self.sources[i] = ArgSource {
            call: self.call,
            output: true,
            position,
            element: None,
        };
        i
    }

    /// A group norm's per-channel argument `position` (its weight or bias) at the channel of the
    /// element being computed (`c[1]`), or `absent` where the call has none.
    fn read_channel(
        &mut self,
        op: &TracedOp,
        position: usize,
        absent: &str,
    ) -> Result<String, String> {
        Ok(channel_read(
            self.channel_argument(op, position)?,
            "c[1]",
            absent,
        ))
    }

    /// The argument and stride of a group norm's per-channel argument `position` (its weight or
    /// bias), added on its first read; `None` where the call has none.
    fn channel_argument(
        &mut self,
        op: &TracedOp,
        position: usize,
    ) -> Result<Option<(usize, i64)>, String> {
        // An undefined tensor (none given) is traced as one of no element type.
        let t = match op.inputs.get(position) {
            Some(TracedValue::Tensor(t)) if t.item_bytes > 0 => t,
            _ => return Ok(None),
        };
        if t.shape.len() != 1 {
            return Err("a group norm's weight or bias of other than one dimension".into());
        }
        if self.inside.contains(&(self.call, t.storage)) {
            return Err("a group norm's weight or bias computed in the group".into());
        }
        let kind = kind_of(&t.dtype).ok_or_else(|| format!("a weight of type {}", t.dtype))?;
        if kind == Kind::Bool {
            return Err("a weight of type bool".into());
        }
        self.position = position;
        self.note_extent(t);
        let i = self.argument(t, KernelArg::Input(t.clone()));
        Ok(Some((i, t.strides[0])))
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
                return Err("a group norm's weight or bias gradient read in its group".into());
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
        let stored = self.stored_results(results)?;
        // Four neighbouring elements a thread, loaded and stored four at once, where the space
        // the kernel runs over (each result's, or the rows') comes in whole groups of four and no
        // result of it is bool.
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
                .is_none_or(|g| g.shape.hxw % UNROLL == 0)
            && stored.iter().all(|r| r.per_row || r.ty != "bool");
        let groups = self.vector_groups(space, vectorised);
        let cache = (self.reduction.as_ref()).and_then(|r| RowCache::of(r, vectorised));
        let (numel, unroll, body) = match &self.reduction {
            Some(r) => (r.rows, 1, row_loop(r, &stored, vectorised, &groups, cache)),
            None => (space, UNROLL, pointwise_loop(&stored, vectorised, &groups)),
        };
        // A row held in registers hands each element's value to the functions that read it
        // (`OWN`): the value of a group norm's input, or of its backward's gradient.
        // Declared to the compiler, which then keeps each thread within its share of registers.
        let block = cache.map_or(256, |c| c.threads);
        let own = match cache {
            Some(_) => "a.own##i",
            None => "(e)",
        };
        let alignment: Vec<usize> = (0..self.args.len())
            .map(|i| match &self.args[i] {
                KernelArg::Input(t) if vectorised && groups.contains(&i) => vector_bytes(t),
                KernelArg::Output(t) if vectorised => vector_bytes(t),
                _ => 0,
            })
            .collect();
        // A vectorised kernel's thread holds the group of four of each such input from `a.first`
        // (its elements' own, which the compiler sees); other indices (a view of an intermediate)
        // read memory.
        let load = "((unsigned)((p) - a.first) < 4u ? group_element(ptr, a.g##i, (p) - a.first) : to_float_any((ptr)[p]))";
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
        if cache.is_some() {
            fields.push_str("  float own0;\n");
        }
        if vectorised {
            fields.push_str("  idx_t first;\n");
            for i in &groups {
                writeln!(fields, "  uint4 g{i};").unwrap();
            }
        }
        let workspace = (self.reduction.as_ref().and_then(|r| r.gradients.as_ref()))
            .map_or(0, |g| {
                1 + (2 + g.channel_sums.len() as u64) * g.shape.samples * g.shape.channels
            });
        if workspace > 0 {
            params.push("float* ws".into());
        }
        let entry = format!(
            "({}, long long n) {{\n  Args a{{{}}};\n{body}}}\n",
            params.join(", "),
            names.join(", ")
        );
        // Named by everything the source says (shapes and strides included): one name, one text.
        let name = format!(
            "sk_fused_{:016x}",
            fnv1a(&format!(
                "{}{load}{own}{block}{fields}{}{entry}",
                self.signature, self.functions
            ))
        );
        let source = format!(
            "{PRELUDE}\ntypedef {index} idx_t;\n#define LOAD(i, ptr, p) {load}\n#define OWN(i, e) {own}\nstruct Args {{\n{fields}}};\n\n{functions}extern \"C\" __global__ __launch_bounds__({block}) void {name}{entry}",
            functions = self.functions,
            index = index_type(self.extent),
            block = block,
        );
        Ok(GeneratedKernel {
            name,
            source,
            args: self.args,
            numel,
            rows: self.reduction.is_some(),
            unroll,
            block,
            alignment,
            sources: self.sources,
            workspace,
        })
    }

    /// The inputs a vectorised kernel of `numel` elements a result loads four at a time: those
    /// `LOAD` reads that hold at least as many elements, so that a thread's group of four (from its
    /// first element) lies inside them. Every other `LOAD` becomes a plain read.
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
                // column p % width of row p / width when the result is contiguous. A group
                // norm's rows span several dimensions; its reads keep to their own rows
                // (`row_elements`).
                Some(r)
                    if out.numel == r.rows * r.width
                        && (r.op == "moments"
                            || r.op == "group_norm_backward"
                            || out.shape.last().map(|&w| w as u64) == Some(r.width)) =>
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
            });
        }
        Ok(stored)
    }
}

/// How a kernel stores one result: argument `out{arg}` takes function `v{function}`'s values as
/// `ty`, one per element or, with `per_row`, one per row of the reduction; or, with `channel`, a
/// group norm's backward's weight (0) or bias (1) gradient, one per channel.
struct StoredResult {
    arg: usize,
    function: usize,
    ty: &'static str,
    per_row: bool,
    channel: Option<usize>,
}

/// Elements each thread of a pointwise kernel computes per tile, a block apart (ATen's unrolled
/// elementwise kernels do the same): every load is coalesced across the warp, and each thread has
/// this many in flight.
const UNROLL: u64 = 4;

/// The bytes of four of `t`'s elements.
fn vector_bytes(t: &TracedTensor) -> usize {
    kind_of(&t.dtype).unwrap_or(Kind::Float).elt_size_in_bytes() * UNROLL as usize
}

/// The body of a pointwise kernel. `vectorised`: each thread computes four neighbouring elements
/// of every result, whose inputs `LOAD` reads four at a time, and stores each result's four at
/// once. Else a block takes tiles of `UNROLL` × its threads elements, a thread's a block apart
/// (as ATen's unrolled kernels). Either way every value comes first, then the stores: a load after
/// a store through another pointer could not be shared, as the compiler cannot rule out aliasing.
fn pointwise_loop(stored: &[StoredResult], vectorised: bool, groups: &[usize]) -> String {
    let (mut declare, mut values, mut stores) = (String::new(), String::new(), String::new());
    if vectorised {
        writeln!(declare, "    a.first = q * {UNROLL};").unwrap();
        for i in groups {
            writeln!(declare, "    a.g{i} = load_group(a.in{i} + a.first);").unwrap();
        }
    }
    for r in stored {
        let (i, f, ty) = (r.arg, r.function, r.ty);
        writeln!(declare, "    float r{i}[{UNROLL}];").unwrap();
        if vectorised {
            writeln!(values, "      r{i}[k] = v{f}(a, p, red);").unwrap();
            writeln!(stores, "    store4(a.out{i} + a.first, r{i});").unwrap();
        } else {
            writeln!(values, "      if (p < (idx_t)n) r{i}[k] = v{f}(a, p, red);").unwrap();
            writeln!(
                stores,
                "      if (p < (idx_t)n) a.out{i}[p] = store_as<{ty}>(r{i}[k]);"
            )
            .unwrap();
        }
    }
    let each = |p: &str| {
        format!("#pragma unroll\n    for (int k = 0; k < {UNROLL}; ++k) {{\n      const idx_t p = {p};\n")
    };
    if vectorised {
        return format!(
            "  const float2 red = NO_ROW;
  for (idx_t q = blockIdx.x * (idx_t)blockDim.x + threadIdx.x; q < (idx_t)(n / {UNROLL}); q += (idx_t)gridDim.x * blockDim.x) {{
{declare}{}{values}    }}
{stores}  }}
",
            each("a.first + k")
        );
    }
    let each = each("tile + k * (idx_t)blockDim.x");
    format!(
        "  const float2 red = NO_ROW;
  for (idx_t tile = blockIdx.x * (idx_t)blockDim.x * {UNROLL} + threadIdx.x; tile < (idx_t)n; tile += (idx_t)gridDim.x * blockDim.x * {UNROLL}) {{
{declare}{each}{values}    }}
{each}{stores}    }}
  }}
"
    )
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
// A vectorised kernel's group of four elements of an input, loaded at once (16 bytes of fp32, 8 of
// bf16/fp16), and element j of it: selects, not an indexed array, which would live in local memory.
__device__ __forceinline__ uint4 load_group(const float* g) { return *reinterpret_cast<const uint4*>(g); }
template <typename T> __device__ __forceinline__ uint4 load_group(const T* g) {
  const uint2 v = *reinterpret_cast<const uint2*>(g);
  return make_uint4(v.x, v.y, 0, 0);
}
__device__ __forceinline__ float group_element(const float*, uint4 g, int j) {
  return __uint_as_float(j == 0 ? g.x : j == 1 ? g.y : j == 2 ? g.z : g.w);
}
template <typename T> __device__ __forceinline__ float group_element(const T*, uint4 g, int j) {
  const unsigned w = (j & 2) ? g.y : g.x;
  const unsigned short bits = (j & 1) ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
  return to_float_any(*reinterpret_cast<const T*>(&bits));
}
template <> __device__ __forceinline__ bool store_as<bool>(float v) { return v != 0.f; }
// A row reduction's results as every function reads them (`red`): the reduction's value, or a
// group norm's mean and reciprocal standard deviation; none outside a row kernel.
#define NO_ROW make_float2(0.f, 0.f)
// The sum of every thread's `v` over the block, handed to every thread; `partial` holds 32 floats
// of shared scratch, free again once it returns.
__device__ __forceinline__ float block_sum(float v, float* partial) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < (blockDim.x + 31) / 32 ? partial[threadIdx.x & 31] : 0.f;
  return warp_sum(v);
}
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
    // An in-place operator computes what its out-of-place twin does, into its first argument.
    let name = match writes_in_place(op) {
        true => name.strip_suffix('_')?,
        false => name,
    };
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
        // As ATen's kernel: `norm * (input - target) * grad`, `norm` 2 / numel for a mean.
        "mse_loss_backward" => {
            let numel = op.inputs.get(1)?.tensors().first()?.numel.max(1);
            let norm = match integer(op.inputs.get(3))? {
                1 => 2.0 / numel as f64,
                _ => 2.0,
            } as f32;
            format!("{norm:?}f * ({} - {}) * {}", v(1)?, v(2)?, v(0)?)
        }
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
        // ATen's own special cases (pow_tensor_scalar_optimized_kernel): the same values, and a
        // multiplication where powf would take a logarithm and an exponential.
        "pow" if op.schema.starts_with("aten::pow.Tensor_Scalar") => match v(1)?.as_str() {
            "1.0f" => v(0)?,
            "2.0f" => format!("{0} * {0}", v(0)?),
            "3.0f" => format!("{0} * {0} * {0}", v(0)?),
            "0.5f" => format!("sqrtf({})", v(0)?),
            "-0.5f" => format!("rsqrtf({})", v(0)?),
            "-1.0f" => format!("1.f / {}", v(0)?),
            "-2.0f" => format!("1.f / ({0} * {0})", v(0)?),
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
    let mut body = format!("  idx_t c[{}];\n", out.shape.len().max(1));
    for (d, (&size, &stride)) in out.shape.iter().zip(&out.strides).enumerate() {
        if size == 1 {
            body.push_str(&format!("  c[{d}] = 0;\n"));
        } else {
            body.push_str(&format!("  c[{d}] = (p / {stride}) % {size};\n"));
        }
    }
    body
}

/// The body of a kernel with a row reduction: a block per row (`n` rows) reduces the row, then
/// writes the results of the whole space (one per column) and of the rows (one per row). Vectorised,
/// a thread takes four neighbouring columns at a time, as [`pointwise_loop`] takes elements.
fn row_loop(
    r: &RowReduction,
    stored: &[StoredResult],
    vectorised: bool,
    groups: &[usize],
    cache: Option<RowCache>,
) -> String {
    let (init, combine, warp) = match r.op {
        "amax" => ("-infinity()", "fmaxf(acc, v)", "warp_max"),
        _ => ("0.f", "acc + v", "warp_sum"),
    };
    let finish = if r.op == "mean" {
        format!("partial[0] / {}.f", r.width)
    } else {
        "partial[0]".to_string()
    };
    let columns = column_loop(r.width, vectorised, groups);
    let mut accumulate = String::new();
    for (t, value) in (r.gradients.iter()).flat_map(|g| g.channel_sums.iter().enumerate()) {
        writeln!(accumulate, "        t{t} += {value};").unwrap();
    }
    let own = cache.map(|c| c.own());
    let (whole, per_row) = row_stores(stored, r.width, vectorised, own, &accumulate);
    if let Some(gradients) = &r.gradients {
        let loops = match cache {
            Some(cache) => cache.gradient_loops(gradients, groups, &whole),
            None => uncached_gradient_loops(gradients, vectorised, groups, &whole),
        };
        return group_norm_backward_loop(gradients, stored, &loops);
    }
    if r.op == "moments" {
        return match cache {
            Some(cache) => cache.moments_loop(r, groups, &whole, &per_row),
            None => moments_loop(r, &columns, vectorised, &whole, &per_row),
        };
    }
    let read = if vectorised {
        format!("#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const float v = in_red(a, row, col + k, NO_ROW);\n        acc = {combine};\n      }}\n")
    } else {
        format!("      const float v = in_red(a, row, col, NO_ROW);\n      acc = {combine};\n")
    };
    format!(
        "  __shared__ float partial[32];
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    float acc = {init};
    {columns}{read}    }}
    acc = {warp}(acc);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {{
      acc = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : {init};
      acc = {warp}(acc);
      if (threadIdx.x == 0) partial[0] = acc;
    }}
    __syncthreads();
    const float2 red = make_float2({finish}, 0.f);
    {columns}{whole}    }}
    if (threadIdx.x == 0) {{
      const idx_t p = row;
{per_row}    }}
    __syncthreads();
  }}
"
    )
}

/// The body of a group norm's kernel: a block per row sums the row for its mean, then the squares
/// of its elements less the mean for its variance (two passes: a row's second read comes from the
/// cache, and the variance is as exact as ATen's Welford one), then writes the results.
fn moments_loop(
    r: &RowReduction,
    columns: &str,
    vectorised: bool,
    whole: &str,
    per_row: &str,
) -> String {
    let width = r.width;
    let read = |value: &str| {
        if vectorised {
            format!("#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const float v = in_red(a, row, col + k, NO_ROW);\n        acc += {value};\n      }}\n")
        } else {
            format!("      const float v = in_red(a, row, col, NO_ROW);\n      acc += {value};\n")
        }
    };
    let (sum, squares) = (read("v"), read("(v - mean) * (v - mean)"));
    format!(
        "  __shared__ float partial[32];
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    float acc = 0.f;
    {columns}{sum}    }}
    const float mean = block_sum(acc, partial) / {width}.f;
    acc = 0.f;
    {columns}{squares}    }}
    const float variance = block_sum(acc, partial) / {width}.f;
    const float2 red = make_float2(mean, rsqrtf(fmaxf(variance, 0.f) + {eps:?}f));
    {columns}{whole}    }}
    if (threadIdx.x == 0) {{
      const idx_t p = row;
{per_row}    }}
    __syncthreads();
  }}
",
        eps = r.eps as f32,
    )
}

/// A group norm's backward's two loops over channel `cl` of a row: the one summing it (`s += dy *
/// x`, `b += dy`), and the one writing the input's gradient (and adding to the channel sums).
struct GradientLoops {
    /// What a row declares first.
    declare: String,
    /// `#pragma unroll` where the loops over the channels are unrolled (a row held in registers).
    unroll: &'static str,
    /// The loop over the channel's elements summing them, opened and closed.
    sums: String,
    /// The loop over the channel's elements writing the results, opened and closed.
    stores: String,
}

/// [`GradientLoops`] reading each element where it is needed.
fn uncached_gradient_loops(
    gradients: &GradientRows,
    vectorised: bool,
    groups: &[usize],
    whole: &str,
) -> GradientLoops {
    let (hxw, width) = (gradients.shape.hxw, gradients.shape.width());
    let mut head = match vectorised {
        true => format!("for (idx_t hw = threadIdx.x * {UNROLL}; hw < {hxw}; hw += blockDim.x * {UNROLL}) {{\n        const idx_t col = cl * {hxw} + hw;\n        a.first = row * {width} + col;\n"),
        false => format!("for (idx_t hw = threadIdx.x; hw < {hxw}; hw += blockDim.x) {{\n        const idx_t col = cl * {hxw} + hw;\n"),
    };
    for i in groups.iter().filter(|_| vectorised) {
        writeln!(head, "        a.g{i} = load_group(a.in{i} + a.first);").unwrap();
    }
    let sums = if vectorised {
        format!("{head}#pragma unroll\n        for (int k = 0; k < {UNROLL}; ++k) {{\n          const float dy = in_dy(a, row, col + k, NO_ROW);\n          s += dy * in_x(a, row, col + k, NO_ROW);\n          b += dy;\n        }}\n      }}\n")
    } else {
        format!("{head}        const float dy = in_dy(a, row, col, NO_ROW);\n        s += dy * in_x(a, row, col, NO_ROW);\n        b += dy;\n      }}\n")
    };
    GradientLoops {
        declare: String::new(),
        unroll: "",
        sums,
        stores: format!("{head}{whole}      }}\n"),
    }
}

/// The body of a group norm's backward's kernel ([`Generator::group_norm_backward`]). A block per
/// row sums `dy * x` and `dy` over each of the row's channels, one channel after the other, and
/// keeps each sample's channel terms of the weight and bias gradients in the workspace `ws`
/// (after its first float, a counter of finished blocks); then writes the row's input gradient,
/// channel after channel, keeping each channel's sums ([`Generator::channel_sum`]) there too.
/// The last block to finish sums the workspace over samples, in order (the same sums every run).
fn group_norm_backward_loop(
    gradients: &GradientRows,
    stored: &[StoredResult],
    loops: &GradientLoops,
) -> String {
    let GroupNormGradients {
        samples,
        channels,
        groups: norm_groups,
        ..
    } = gradients.shape;
    let (width, per_group) = (
        gradients.shape.width(),
        gradients.shape.channels_per_group(),
    );
    let (mean, rstd) = (gradients.mean, gradients.rstd);
    let w = channel_read(gradients.weight, "channel", "1.f");
    let bias_terms = samples * channels;
    let GradientLoops {
        declare,
        unroll,
        sums,
        stores,
    } = loops;
    // Per channel: its sums' terms of this sample, kept in the workspace after the weight's and
    // the bias's; and the last block's sums of each over the samples.
    let (mut open, mut close, mut finish) = (String::new(), String::new(), String::new());
    for t in 0..gradients.channel_sums.len() as u64 {
        writeln!(open, "      float t{t} = 0.f;").unwrap();
        writeln!(close, "      t{t} = block_sum(t{t}, partial);\n      if (threadIdx.x == 0) ws[1 + {} + sample * {channels} + channel] = t{t};", (2 + t) * bias_terms).unwrap();
        writeln!(finish, "      float sum{} = 0.f;\n      for (idx_t sample = 0; sample < {samples}; ++sample) sum{} += __ldcg(ws + 1 + {} + sample * {channels} + channel);", 2 + t, 2 + t, (2 + t) * bias_terms).unwrap();
    }
    for r in stored {
        if let Some(which) = r.channel {
            let sum = match which {
                0 => "weight_sum".to_string(),
                1 => "bias_sum".to_string(),
                k => format!("sum{k}"),
            };
            writeln!(
                finish,
                "      a.out{}[channel] = store_as<{}>({sum});",
                r.arg, r.ty
            )
            .unwrap();
        }
    }

    format!(
        "  __shared__ float partial[32];
  __shared__ bool last_block;
  const float s_width = 1.f / {width}.f;
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    const float mean = to_float_any(a.in{mean}[row]);
    const float rstd = to_float_any(a.in{rstd}[row]);
    const idx_t sample = row / {norm_groups};
    float sum_dy_x = 0.f, sum_dy = 0.f;
{declare}{unroll}
    for (int cl = 0; cl < {per_group}; ++cl) {{
      const idx_t channel = (row % {norm_groups}) * {per_group} + cl;
      float s = 0.f, b = 0.f;
      {sums}      s = block_sum(s, partial);
      b = block_sum(b, partial);
      const float w = {w};
      sum_dy_x += s * w;
      sum_dy += b * w;
      if (threadIdx.x == 0) {{
        ws[1 + sample * {channels} + channel] = (s - b * mean) * rstd;
        ws[1 + {bias_terms} + sample * {channels} + channel] = b;
      }}
    }}
    const float cx = (sum_dy * mean - sum_dy_x) * rstd * rstd * rstd * s_width;
    const float2 red = make_float2(cx, -cx * mean - sum_dy * rstd * s_width);
{unroll}
    for (int cl = 0; cl < {per_group}; ++cl) {{
      const idx_t channel = (row % {norm_groups}) * {per_group} + cl;
{open}      {stores}{close}    }}
    __syncthreads();
  }}
  // The last block to finish: every other block's terms are written (each fenced before it
  // counted itself), and are read past the L1 cache.
  if (threadIdx.x == 0) {{
    __threadfence();
    last_block = atomicAdd(reinterpret_cast<unsigned int*>(ws), 1u) == gridDim.x - 1;
  }}
  __syncthreads();
  if (last_block) {{
    __threadfence();
    for (idx_t channel = threadIdx.x; channel < {channels}; channel += blockDim.x) {{
      float weight_sum = 0.f, bias_sum = 0.f;
#pragma unroll 8
      for (idx_t sample = 0; sample < {samples}; ++sample) {{
        weight_sum += __ldcg(ws + 1 + sample * {channels} + channel);
        bias_sum += __ldcg(ws + 1 + {bias_terms} + sample * {channels} + channel);
      }}
{finish}    }}
  }}
"
    )
}

/// A row held in registers between its passes: each of `threads` threads a block holds `slots`
/// groups of four of the row's elements (of a group norm's backward, `slots` per channel of its
/// group), so that a row's input is computed once, not once per pass. A row kernel's input is
/// often a chain (a concatenation, a cast, a bias added; SiLU's backward of the recomputed norm)
/// whose index arithmetic and transcendental functions cost more than the memory it reads.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RowCache {
    threads: u64,
    slots: u64,
}

/// The most values a thread holds: 32 registers of the 64 a thread of a block of 1024 has.
const CACHED_VALUES: u64 = 32;

impl RowCache {
    /// The cache of a vectorised group norm's kernel, or of its backward's: the fewest threads
    /// (256 to 1024) that hold the row in [`CACHED_VALUES`] a thread; `None` for a longer row.
    fn of(r: &RowReduction, vectorised: bool) -> Option<RowCache> {
        if !vectorised {
            return None;
        }
        let (span, channels) = match (&r.gradients, r.op) {
            (Some(g), _) => (g.shape.hxw, g.shape.channels_per_group()),
            (None, "moments") => (r.width, 1),
            _ => return None,
        };
        [256, 512, 1024].into_iter().find_map(|threads| {
            let slots = span.div_ceil(threads * UNROLL);
            (channels * slots * UNROLL <= CACHED_VALUES).then_some(RowCache { threads, slots })
        })
    }

    /// The value an element's functions read as their own (`OWN`): slot `j` (of channel `cl`).
    fn own(&self) -> String {
        format!("held[(cl * {} + j) * {UNROLL} + k]", self.slots)
    }

    /// The head of slot `j` of channel `cl` of a row (`span` elements a channel): its first
    /// column, the guard, and the inputs' groups of four.
    fn slot_head(&self, span: u64, width: u64, groups: &[usize]) -> String {
        let mut head = format!(
            "#pragma unroll\n    for (int j = 0; j < {slots}; ++j) {{\n      const idx_t hw = (j * (idx_t)blockDim.x + threadIdx.x) * {UNROLL};\n      if (hw >= {span}) continue;\n      const idx_t col = cl * {span} + hw;\n      a.first = row * {width} + col;\n",
            slots = self.slots
        );
        for i in groups {
            writeln!(head, "      a.g{i} = load_group(a.in{i} + a.first);").unwrap();
        }
        head
    }

    /// A group norm's kernel with its row held: one pass computes and sums the row, the variance
    /// sums the held values less the mean, and the results read them (`OWN`).
    fn moments_loop(
        &self,
        r: &RowReduction,
        groups: &[usize],
        whole: &str,
        per_row: &str,
    ) -> String {
        let (width, eps) = (r.width, r.eps as f32);
        let head = self.slot_head(width, width, groups);
        let values = self.slots * UNROLL;
        let each = format!("#pragma unroll\n    for (int j = 0; j < {}; ++j) {{\n      if ((j * (idx_t)blockDim.x + threadIdx.x) * {UNROLL} >= {width}) continue;\n#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n", self.slots);
        format!(
            "  __shared__ float partial[32];
  const int cl = 0;
  for (idx_t row = blockIdx.x; row < (idx_t)n; row += gridDim.x) {{
    float held[{values}];
    float acc = 0.f;
    {head}#pragma unroll
      for (int k = 0; k < {UNROLL}; ++k) {{
        held[j * {UNROLL} + k] = in_red(a, row, col + k, NO_ROW);
        acc += held[j * {UNROLL} + k];
      }}
    }}
    const float mean = block_sum(acc, partial) / {width}.f;
    acc = 0.f;
    {each}        const float v = held[j * {UNROLL} + k];
        acc += (v - mean) * (v - mean);
      }}
    }}
    const float variance = block_sum(acc, partial) / {width}.f;
    const float2 red = make_float2(mean, rsqrtf(fmaxf(variance, 0.f) + {eps:?}f));
    {head}{whole}    }}
    if (threadIdx.x == 0) {{
      const idx_t p = row;
{per_row}    }}
    __syncthreads();
  }}
"
        )
    }

    /// A group norm's backward's loops with its gradient held: the sums compute each element's
    /// gradient once, the stores read it (`OWN`), one channel after the other too.
    fn gradient_loops(
        &self,
        gradients: &GradientRows,
        groups: &[usize],
        whole: &str,
    ) -> GradientLoops {
        let (hxw, width) = (gradients.shape.hxw, gradients.shape.width());
        let head = self
            .slot_head(hxw, width, groups)
            .replace("\n    ", "\n      ");
        let sums = format!(
            "{head}#pragma unroll\n        for (int k = 0; k < {UNROLL}; ++k) {{\n          const float dy = in_dy(a, row, col + k, NO_ROW);\n          held[(cl * {slots} + j) * {UNROLL} + k] = dy;\n          s += dy * in_x(a, row, col + k, NO_ROW);\n          b += dy;\n        }}\n      }}\n",
            slots = self.slots
        );
        let held = gradients.shape.channels_per_group() * self.slots * UNROLL;
        GradientLoops {
            declare: format!("    float held[{held}];\n"),
            unroll: "#pragma unroll",
            sums,
            stores: format!("{head}{whole}      }}\n"),
        }
    }
}

/// The head of a row's loop over its `width` columns: one at a time a block apart, or (vectorised)
/// four neighbours at a time, the inputs' groups of four loaded first.
fn column_loop(width: u64, vectorised: bool, groups: &[usize]) -> String {
    if !vectorised {
        return format!("for (idx_t col = threadIdx.x; col < {width}; col += blockDim.x) {{\n");
    }
    let mut head = format!(
        "for (idx_t col = threadIdx.x * {UNROLL}; col < {width}; col += blockDim.x * {UNROLL}) {{\n      a.first = row * {width} + col;\n"
    );
    for i in groups {
        writeln!(head, "      a.g{i} = load_group(a.in{i} + a.first);").unwrap();
    }
    head
}

/// The stores of a row-reduction kernel: those of its column loop (every value first, then the
/// stores, as in [`pointwise_loop`]; `own`, the element's held value, set first, and the
/// `accumulate` lines of a group norm's backward's channel sums after) and those of the row's one
/// thread.
fn row_stores(
    stored: &[StoredResult],
    width: u64,
    vectorised: bool,
    own: Option<String>,
    accumulate: &str,
) -> (String, String) {
    let (mut values, mut stores) = (String::new(), String::new());
    let (mut per_row, mut per_row_stores) = (String::new(), String::new());
    let mut columns = String::new();
    for s in stored.iter().filter(|s| s.channel.is_none()) {
        let (i, f, ty) = (s.arg, s.function, s.ty);
        if s.per_row {
            writeln!(per_row, "      const float r{i} = v{f}(a, p, red);").unwrap();
            writeln!(per_row_stores, "      a.out{i}[p] = store_as<{ty}>(r{i});").unwrap();
        } else if vectorised {
            writeln!(values, "      float r{i}[{UNROLL}];").unwrap();
            writeln!(columns, "        r{i}[k] = v{f}(a, p, red);").unwrap();
            writeln!(stores, "      store4(a.out{i} + a.first, r{i});").unwrap();
        } else {
            writeln!(values, "      const float r{i} = v{f}(a, p, red);").unwrap();
            writeln!(stores, "      a.out{i}[p] = store_as<{ty}>(r{i});").unwrap();
        }
    }
    let whole = if vectorised {
        let own = own.map_or(String::new(), |own| format!("        a.own0 = {own};\n"));
        format!("{values}#pragma unroll\n      for (int k = 0; k < {UNROLL}; ++k) {{\n        const idx_t p = a.first + k;\n{own}{columns}{accumulate}      }}\n{stores}")
    } else {
        format!("      const idx_t p = row * {width} + col;\n{values}{accumulate}{stores}")
    };
    (whole, per_row + &per_row_stores)
}

/// The read of a per-channel argument (`channel_argument`'s: its index and stride) at `channel`,
/// or `absent` where there is none.
fn channel_read(argument: Option<(usize, i64)>, channel: &str, absent: &str) -> String {
    match argument {
        Some((i, stride)) => format!("to_float_any(a.in{i}[{channel} * {stride}])"),
        None => absent.into(),
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
