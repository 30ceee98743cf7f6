//! Grouping a traced step's kernels the way Inductor's scheduler does: vertical fusion of
//! pointwise, layout and view operators with at most one reduction, within the forward or the
//! backward pass, never across a call that sits between two members in the data flow.

use std::collections::{HashMap, HashSet};

use super::{codegen, OpKind};
use crate::trace::{TracedOp, TracedTensor};

/// A node of the data flow: one kernel-level call.
pub(super) struct Node<'a> {
    pub op: &'a TracedOp,
    pub kind: Option<OpKind>,
    /// The nodes whose results it reads, by index.
    pub deps: Vec<usize>,
    /// What it reads of them: (node, storage) per tensor argument that a node wrote.
    pub reads: Vec<(usize, u64)>,
}

/// A group under construction.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub members: Vec<usize>,
    /// Elements the group's kernel iterates over (a reduction's input size), once known.
    pub space: Option<u64>,
    /// Elements of the reduction's result, when the group has one.
    pub reduced: Option<u64>,
    pub backward: bool,
    /// A layout node alone (`cat`, padding): its inputs are parts of its output, so producers of a
    /// smaller size join it.
    pub assembles: bool,
    /// Whether its reduction is a group norm's backward, whose kernel sums its results over each
    /// channel too: sums of every element of a channel of its space join it.
    pub channel_rows: bool,
    /// A sum of every element of each channel alone ([`codegen::sums_channels`]).
    pub channel_sum: bool,
    /// A sum over columns alone ([`codegen::sums_columns`]).
    pub column_sum: bool,
    /// The width of the rows whose columns its sums over columns add up, once it has one.
    pub columns: Option<u64>,
    /// The width of the rows a layer norm's backward in it walks (its `reduced` is the input's
    /// size, not its rows'): a sum over columns of rows of that width joins it.
    pub norm_width: Option<u64>,
    /// Whether a layout copy (`cat`, padding) is among its members.
    pub copies_layout: bool,
}

/// The data flow of `ops`: each call's producers, by tensor and by storage for in-place writes.
pub(super) fn data_flow<'a>(ops: &[&'a TracedOp]) -> Vec<Node<'a>> {
    let mut producer: HashMap<(u64, u64), usize> = HashMap::new();
    let mut last_write: HashMap<u64, usize> = HashMap::new();
    // Storage → the call that made it: how a tensor object the trace has not seen made is traced
    // to its producer (autograd hands the backward a saved result as a new object on the same
    // memory, which nothing can free or reuse while it is saved).
    let mut created: HashMap<u64, usize> = HashMap::new();
    let mut nodes = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let reads: Vec<(usize, u64)> = if OpKind::reads_values(&op.name) {
            op.input_tensors()
                .flat_map(|t| {
                    let made = producer.get(&t.key()).or_else(|| created.get(&t.storage));
                    [made, last_write.get(&t.storage)]
                        .into_iter()
                        .flatten()
                        .map(|&p| (p, t.storage))
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut deps: Vec<usize> = reads.iter().map(|&(p, _)| p).collect();
        deps.sort_unstable();
        deps.dedup();
        let inputs: HashSet<(u64, u64)> = op.input_tensors().map(|t| t.key()).collect();
        let storages: HashSet<u64> = op.input_tensors().map(|t| t.storage).collect();
        for t in op.output_tensors() {
            producer.insert(t.key(), i);
            if inputs.contains(&t.key()) {
                // Its input handed back (`add_`, `copy_`, `out=`): it wrote that memory.
                last_write.insert(t.storage, i);
            } else if !storages.contains(&t.storage) {
                // New memory (the trace's storage ids are reused with addresses): no writes yet.
                last_write.remove(&t.storage);
                created.insert(t.storage, i);
            }
        }
        nodes.push(Node {
            op,
            kind: OpKind::of(&op.name),
            deps,
            reads,
        });
    }
    nodes
}

/// Where the trace's storages were allocated: the trace reuses a storage id with a freed address,
/// so one id names as many allocations as calls made new memory there (a result whose storage is
/// none of the call's inputs', as [`data_flow`] tells them apart).
pub(super) struct Allocations {
    /// Storage → the calls that made new memory there, in order.
    made: HashMap<u64, Vec<usize>>,
}

impl Allocations {
    /// The allocations of `ops`' storages.
    pub fn of(ops: &[&TracedOp]) -> Self {
        let mut made: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            let storages: HashSet<u64> = op.input_tensors().map(|t| t.storage).collect();
            for t in op
                .output_tensors()
                .filter(|t| !storages.contains(&t.storage))
            {
                let calls = made.entry(t.storage).or_default();
                if calls.last() != Some(&i) {
                    calls.push(i);
                }
            }
        }
        Allocations { made }
    }

    /// The allocation that holds `storage` at call `at` (its inputs and results alike): the
    /// storage and the call that made that memory, `None` for memory from before the step.
    pub fn holding(&self, storage: u64, at: usize) -> (u64, Option<usize>) {
        let calls = self.made.get(&storage).map_or(&[][..], Vec::as_slice);
        let made = calls[..calls.partition_point(|&c| c <= at)].last().copied();
        (storage, made)
    }

    /// Every allocation of `storage`.
    pub fn all(&self, storage: u64) -> impl Iterator<Item = (u64, Option<usize>)> + '_ {
        let calls = self.made.get(&storage).map_or(&[][..], Vec::as_slice);
        std::iter::once((storage, None)).chain(calls.iter().map(move |&c| (storage, Some(c))))
    }
}

/// Groups the fusable nodes; returns each node's group (`None` for the rest) and the groups
/// (a group merged into another is left empty, so that indices keep their meaning). Only the
/// operators `takes` accepts join a group.
pub(super) fn group(
    nodes: &[Node],
    takes: impl Fn(&TracedOp) -> bool,
) -> (Vec<Option<usize>>, Vec<Group>) {
    let mut group_of: Vec<Option<usize>> = vec![None; nodes.len()];
    let mut groups: Vec<Group> = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        let Some(kind) = node.kind.filter(|k| k.fusable() && takes(node.op)) else {
            continue;
        };
        let mut joined = Group {
            members: vec![n],
            space: None,
            reduced: None,
            backward: node.op.backward,
            assembles: kind == OpKind::Layout,
            channel_rows: node.op.name == "aten::native_group_norm_backward",
            channel_sum: codegen::sums_channels(node.op),
            column_sum: codegen::sums_columns(node.op),
            columns: None,
            norm_width: None,
            copies_layout: kind == OpKind::Layout,
        };
        if !admit(&mut joined, node, kind) {
            continue;
        }
        let mut candidates: Vec<usize> = node.deps.iter().filter_map(|&d| group_of[d]).collect();
        candidates.sort_unstable();
        candidates.dedup();
        let (home, joined) = join_candidates(nodes, &mut groups, &mut group_of, candidates, joined);
        if home.is_none() {
            group_of[n] = Some(groups.len());
            groups.push(joined);
        }
    }
    (group_of, groups)
}

/// Merges `joined` (a node's one-node group) into each of `candidates` (the groups of the node's
/// producers) that takes it, every merge adding to the group before it. Returns the group they
/// all became, if any, and what `joined` grew to.
fn join_candidates(
    nodes: &[Node],
    groups: &mut [Group],
    group_of: &mut [Option<usize>],
    mut candidates: Vec<usize>,
    mut joined: Group,
) -> (Option<usize>, Group) {
    let mut home: Option<usize> = None;
    // A candidate refused may fit once others have joined: two groups that each read the other's
    // results through the node (rotary embeddings' backward: each half's gradient added into the
    // other's) are a cycle apart, and one kernel together.
    loop {
        let before = candidates.len();
        candidates.retain(|&g| {
            let mut merged = groups[g].clone();
            if merged.backward != joined.backward
                || !merge(&mut merged, &joined)
                || closes_a_cycle(nodes, &merged.members)
            {
                return true;
            }
            for &m in &merged.members {
                group_of[m] = Some(g);
            }
            if let Some(previous) = home {
                groups[previous].members.clear();
            }
            merged.members.sort_unstable();
            groups[g] = merged;
            joined = groups[g].clone();
            home = Some(g);
            false
        });
        if candidates.is_empty() || candidates.len() == before {
            return (home, joined);
        }
    }
}

/// Sets up a one-node group for `node`; false when its sizes cannot be known.
fn admit(group: &mut Group, node: &Node, kind: OpKind) -> bool {
    let input = node.op.input_tensors().map(|t| t.numel).max();
    let output = node.op.output_tensors().map(|t| t.numel).max();
    match kind {
        OpKind::View => true,
        OpKind::Reduction if group.column_sum => {
            group.space = input;
            group.columns = output;
            input.is_some()
        }
        OpKind::Reduction => {
            group.space = input;
            let norm_backward = matches!(
                node.op.name.as_str(),
                "aten::native_group_norm_backward" | "aten::native_layer_norm_backward"
            );
            if node.op.name == "aten::native_layer_norm_backward" {
                group.norm_width = node.op.input_tensors().next().and_then(|t| {
                    let width = *t.shape.last()?;
                    u64::try_from(width).ok()
                });
            }
            group.reduced = if norm_backward {
                // A norm's backward: its input's gradient, of its input's size, is what its rows'
                // sums are read into; the weight's and bias's, written once every row is summed,
                // are read by no member.
                input
            } else {
                // A group norm's rows: its statistics, not its normalised input's copy.
                node.op.output_tensors().map(|t| t.numel).min()
            };
            input.is_some()
        }
        _ => {
            group.space = output.or(input);
            true
        }
    }
}

/// Merges `b` into `a` when their iteration spaces agree and they hold at most one reduction, when
/// `b` assembles its output from `a`'s (a `cat` of smaller pointwise results), or when `b` sums
/// each channel of `a`'s group norm's backward's rows.
fn merge(a: &mut Group, b: &Group) -> bool {
    // A bias's gradient summed from a group norm's backward's results (a convolution's before it).
    if a.channel_rows && b.channel_sum && a.space == b.space {
        a.members.extend(&b.members);
        return true;
    }
    // Elsewhere, such a sum is ATen's: the generator sums channels only in those rows.
    if a.channel_sum || b.channel_sum {
        return false;
    }
    // A sum over columns of the group's rows, with their row reduction or before it.
    if b.column_sum {
        let width = |g: &Group| {
            (g.norm_width).or_else(|| g.space.zip(g.reduced).map(|(s, r)| s / r.max(1)))
        };
        // Not into a layout copy: a row kernel reads a `cat`'s strided parts an element at a
        // time, where ATen's cat and speedkit's column sums each read four or eight (the qkv
        // gradient of GPT-2 small: 49.8 µs in one kernel, 18.9 + 11.8 in two, on an H200).
        let fits = a.space == b.space
            && !a.copies_layout
            && !a.channel_rows
            && a.columns.is_none_or(|w| Some(w) == b.columns)
            && (a.reduced.is_none() || width(a) == b.columns);
        if fits {
            a.columns = b.columns;
            a.members.extend(&b.members);
        }
        return fits;
    }
    if a.column_sum {
        return false;
    }
    // A row reduction joins sums over columns of its own rows only.
    let rows_fit = |sums: &Group, rows: &Group| match (sums.columns, rows.space, rows.reduced) {
        (Some(columns), Some(space), Some(reduced)) => space == columns * reduced,
        _ => true,
    };
    let same_columns = a.columns.is_none() || b.columns.is_none() || a.columns == b.columns;
    if !(rows_fit(a, b) && rows_fit(b, a) && same_columns) {
        return false;
    }
    let assembled = b.assembles && a.reduced.is_none() && a.space <= b.space;
    let (space, reduced) = match ((a.space, a.reduced), (b.space, b.reduced)) {
        _ if assembled => (b.space, None),
        ((None, _), (s, r)) | ((s, r), (None, _)) => (s, r),
        ((Some(sa), ra), (Some(sb), None)) if Some(sb) == ra || sb == sa => (Some(sa), ra),
        ((Some(sa), None), (Some(sb), rb)) if Some(sa) == rb || sa == sb => (Some(sb), rb),
        _ => return false,
    };
    a.space = space;
    a.reduced = reduced;
    a.assembles = false;
    a.channel_rows |= b.channel_rows;
    a.columns = a.columns.or(b.columns);
    a.norm_width = a.norm_width.or(b.norm_width);
    a.copies_layout |= b.copies_layout;
    a.members.extend(&b.members);
    true
}

/// Whether `members` as one kernel would make a cycle: a member reads, through a call outside
/// them, a result of another member.
fn closes_a_cycle(nodes: &[Node], members: &[usize]) -> bool {
    let inside: HashSet<usize> = members.iter().copied().collect();
    let first = members.iter().copied().min().unwrap_or(0);
    let mut seen = HashSet::new();
    let mut stack: Vec<usize> = members
        .iter()
        .flat_map(|&m| nodes[m].deps.iter().copied())
        .filter(|d| !inside.contains(d))
        .collect();
    while let Some(d) = stack.pop() {
        if d < first || !seen.insert(d) {
            continue;
        }
        if inside.contains(&d) {
            return true;
        }
        stack.extend(nodes[d].deps.iter().copied());
    }
    false
}

/// Per node: whether a call outside its group reads its result (`Some(true)`), only calls inside
/// it do (`Some(false)`), or nothing does (`None`).
pub(super) fn read_outside(nodes: &[Node], group_of: &[Option<usize>]) -> Vec<Option<bool>> {
    let mut read: Vec<Option<bool>> = vec![None; nodes.len()];
    for (j, node) in nodes.iter().enumerate() {
        for &(d, _) in &node.reads {
            let outside = group_of[d].is_none() || group_of[d] != group_of[j];
            read[d] = Some(read[d].unwrap_or(false) || outside);
        }
    }
    read
}

/// The keys of a group's results: of its members (views aside) that a call outside the group
/// reads, directly or through views of them, or whose results nothing reads; of those that
/// rewrite in place memory from outside the group that the forward did not make (a gradient,
/// which outlives the step, whoever reads it); and of those whose result autograd hands to a
/// leaf as its gradient ([`handed_to_leaves`]), though only members read it.
pub(super) fn results(
    nodes: &[Node],
    members: &[usize],
    read_after: &[Option<bool>],
    handed_to_leaves: &HashSet<(usize, u64)>,
) -> Vec<(u64, u64)> {
    let inside: HashSet<usize> = members.iter().copied().collect();
    let rewrites_outside_memory = |m: usize| {
        let node = &nodes[m];
        let target = node.op.input_tensors().next().map(|t| t.storage);
        codegen::writes_in_place(node.op)
            && !node
                .reads
                .iter()
                .any(|&(p, storage)| Some(storage) == target && inside.contains(&p))
    };
    // Memory the forward made before (a convolution's output, its bias then added in place)
    // whose new values only members read needs no writing: they live in the kernel, as a result
    // of any other member does. Not in the backward, whose in-place writes accumulate gradients
    // that outlive the step, whoever reads them.
    let made_in_the_step = |m: usize| {
        let Some(target) = nodes[m].op.input_tensors().next().map(|t| t.storage) else {
            return false;
        };
        if nodes[m].op.backward {
            return false;
        }
        nodes[..m].iter().any(|n| {
            n.op.output_tensors().any(|t| t.storage == target)
                && !n.op.input_tensors().any(|t| t.storage == target)
        })
    };
    let outlives = |m: usize, t: &TracedTensor| {
        needed(nodes, &inside, m, t.storage) || handed_to_leaves.contains(&(m, t.storage))
    };
    let mut wanted: Vec<usize> = Vec::new();
    for &m in members {
        let several = nodes[m].op.output_tensors().count() > 1;
        if several && nodes[m].op.output_tensors().any(|t| outlives(m, t)) {
            wanted.push(m);
            continue;
        }
        // Through views, to the member that computed the memory.
        let computed = |mut source: usize| {
            while nodes[source].kind == Some(OpKind::View) {
                match nodes[source].reads.iter().find(|(p, _)| inside.contains(p)) {
                    Some(&(p, _)) => source = p,
                    None => break,
                }
            }
            (nodes[source].kind != Some(OpKind::View)).then_some(source)
        };
        let handed_on =
            (nodes[m].op.output_tensors()).any(|t| handed_to_leaves.contains(&(m, t.storage)));
        if read_after[m] == Some(false)
            && !handed_on
            && (!rewrites_outside_memory(m) || made_in_the_step(m))
        {
            continue;
        }
        wanted.extend(computed(m));
    }
    wanted.sort_unstable();
    wanted.dedup();
    // Of a call with several results (a group norm's backward: the input's gradient read in the
    // group, the weight's and bias's outliving it), those the group's kernel must write; never one
    // not asked for (an undefined tensor: a norm's backward without a weight's gradient).
    let outlives = &outlives;
    wanted
        .into_iter()
        .flat_map(|m| {
            let several = nodes[m].op.output_tensors().count() > 1;
            (nodes[m].op.output_tensors())
                .filter(|t| t.item_bytes > 0)
                .filter(move |t| !several || outlives(m, t))
                .map(|t| t.key())
        })
        .collect()
}

/// The nodes whose results autograd handed to leaves as their gradients, with the results'
/// storage: for each of the trace's `leaf_gradients` (the handing call's id and the tensor's
/// key), the last node before that call that made the tensor.
pub(super) fn handed_to_leaves(
    nodes: &[Node],
    leaf_gradients: &[(u64, (u64, u64))],
) -> HashSet<(usize, u64)> {
    leaf_gradients
        .iter()
        .filter_map(|&(call, key)| {
            let made = |n: &Node| n.op.id < call && n.op.output_tensors().any(|t| t.key() == key);
            let m = nodes.iter().rposition(made)?;
            Some((m, key.1))
        })
        .collect()
}

/// Whether result `storage` of node `m` is needed beyond the group (`inside`): nothing reads it
/// (it outlives the step, as a gradient autograd hands on), or a call outside the group reads it,
/// directly or through views.
fn needed(nodes: &[Node], inside: &HashSet<usize>, m: usize, storage: u64) -> bool {
    let mut readers = (nodes.iter().enumerate())
        .filter(|(_, n)| n.reads.contains(&(m, storage)))
        .peekable();
    if readers.peek().is_none() {
        return true;
    }
    readers.any(|(j, n)| {
        !inside.contains(&j)
            || (n.kind == Some(OpKind::View)
                && (n.op.output_tensors()).any(|t| needed(nodes, inside, j, t.storage)))
    })
}

/// (call id, storage) of each read by a member of a result another member computed, through any
/// views of it in the group (a view in the group of a tensor from outside is a read from outside).
pub(super) fn inside_reads(nodes: &[Node], members: &[usize]) -> HashSet<(u64, u64)> {
    let inside: HashSet<usize> = members.iter().copied().collect();
    let computed_inside = |mut p: usize| loop {
        if !inside.contains(&p) {
            return false;
        }
        if nodes[p].kind != Some(OpKind::View) {
            return true;
        }
        match nodes[p].reads.first() {
            Some(&(q, _)) => p = q,
            None => return false,
        }
    };
    let mut reads = HashSet::new();
    for &m in members {
        for &(p, storage) in &nodes[m].reads {
            if computed_inside(p) {
                reads.insert((nodes[m].op.id, storage));
            }
        }
    }
    reads
}

/// Splits each group where a call outside it reads a member's result before the group's last
/// input exists: one kernel cannot run there (it would run before that input, or after the
/// read), so the members before the read and those after it become groups of their own. Returns
/// the groups and each node's group again.
pub(super) fn split_at_early_reads(
    nodes: &[Node],
    groups: Vec<Group>,
) -> (Vec<Option<usize>>, Vec<Group>) {
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (j, node) in nodes.iter().enumerate() {
        for &(d, _) in &node.reads {
            readers[d].push(j);
        }
    }
    let mut pending: Vec<Group> = groups
        .into_iter()
        .filter(|g| !g.members.is_empty())
        .collect();
    let grouped: HashSet<usize> = pending.iter().flat_map(|g| g.members.clone()).collect();
    let mut done = Vec::new();
    while let Some(group) = pending.pop() {
        match early_read(nodes, &readers, &grouped, &group.members) {
            Some(at) => {
                let (before, after): (Vec<usize>, Vec<usize>) =
                    group.members.iter().partition(|&&m| m < at);
                for members in [before, after] {
                    if !members.is_empty() {
                        pending.push(Group {
                            members,
                            ..group.clone()
                        });
                    }
                }
            }
            None => done.push(group),
        }
    }
    done.sort_by_key(|g| g.members[0]);
    let mut group_of = vec![None; nodes.len()];
    for (g, group) in done.iter().enumerate() {
        for &m in &group.members {
            group_of[m] = Some(g);
        }
    }
    (group_of, done)
}

/// The first call outside `members` that reads one of their results before the last member
/// that reads a tensor from outside the group (one that no call before the group holds: see
/// [`earlier_holder`]); `grouped`: the members of every group.
fn early_read(
    nodes: &[Node],
    readers: &[Vec<usize>],
    grouped: &HashSet<usize>,
    members: &[usize],
) -> Option<usize> {
    let inside: HashSet<usize> = members.iter().copied().collect();
    let computed_inside = inside_reads(nodes, members);
    let first = *members.first()?;
    let reads_from_outside = |m: usize| {
        nodes[m].kind != Some(OpKind::View)
            && nodes[m].op.input_tensors().any(|t| {
                !computed_inside.contains(&(nodes[m].op.id, t.storage))
                    && earlier_holder(nodes, grouped, m, t, first).is_none()
            })
    };
    let last_input = members
        .iter()
        .copied()
        .filter(|&m| reads_from_outside(m))
        .max()
        .unwrap_or(first);
    members
        .iter()
        .flat_map(|&m| readers[m].iter().copied())
        .filter(|&j| !inside.contains(&j) && j > first && j < last_input)
        .min()
}

/// A call before `before` (a group's first member) that holds `tensor`, which node `reader` reads,
/// so that the group's kernel can take it from there instead of waiting for `reader`: the
/// latest call after the one that made its memory that takes a tensor of that memory and layout
/// as an argument, not a view. `None` where its memory was made by a member of a group (`grouped`:
/// its value may be written only later, or never), not in the step (a parameter), or is written
/// in place before `reader` (the value read there would be another).
///
/// SwiGLU's backward is the case: `silu_backward` reads the gate's saved input, which the
/// forward's `silu` read long before, while the up-projection's GEMMs read the group's other
/// result before `silu_backward` runs.
pub(super) fn earlier_holder(
    nodes: &[Node],
    grouped: &HashSet<usize>,
    reader: usize,
    tensor: &TracedTensor,
    before: usize,
) -> Option<usize> {
    let made = made_and_untouched(nodes, reader, tensor.storage)?;
    if grouped.contains(&made) || made >= before {
        return None;
    }
    let same = |t: &TracedTensor| same_elements(t, tensor);
    (made + 1..before)
        .rev()
        .find(|&q| nodes[q].kind != Some(OpKind::View) && nodes[q].op.input_tensors().any(same))
}

/// Whether `a` and `b` are the same elements of one memory: storage, offset, layout and type (the
/// tensor objects may differ: autograd hands the backward a saved tensor as a new object).
pub(super) fn same_elements(a: &TracedTensor, b: &TracedTensor) -> bool {
    (a.storage, a.offset, &a.shape, &a.strides, &a.dtype)
        == (b.storage, b.offset, &b.shape, &b.strides, &b.dtype)
}

/// The node that made the memory `storage` that node `reader` reads, where no node wrote it in
/// place since (views of it aside).
fn made_and_untouched(nodes: &[Node], reader: usize, storage: u64) -> Option<usize> {
    for q in (0..reader).rev() {
        let op = nodes[q].op;
        for t in op.output_tensors().filter(|t| t.storage == storage) {
            if op.input_tensors().any(|i| i.key() == t.key()) {
                return None;
            }
            if op.input_tensors().all(|i| i.storage != storage) {
                return Some(q);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::testing::{backward, call, tensor};
    use crate::trace::TracedValue;

    /// The keys a group of calls 1 and 2 stores: call 0 (a library kernel) makes memory 20, call 1
    /// adds to it in place, call 2 reads it and makes the step's result.
    fn stored(
        pass: fn(u64, &str, Vec<TracedValue>, Vec<TracedValue>) -> TracedOp,
    ) -> Vec<(u64, u64)> {
        let ops = [
            pass(0, "aten::mm", vec![tensor(1, 10)], vec![tensor(2, 20)]),
            pass(
                1,
                "aten::add_",
                vec![tensor(2, 20), tensor(3, 30)],
                vec![tensor(2, 20)],
            ),
            pass(2, "aten::exp", vec![tensor(2, 20)], vec![tensor(4, 40)]),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = data_flow(&kernels);
        let group_of = [None, Some(0), Some(0)];
        results(
            &nodes,
            &[1, 2],
            &read_outside(&nodes, &group_of),
            &HashSet::new(),
        )
    }

    #[test]
    fn an_in_place_rewrite_of_memory_the_forward_made_and_only_its_group_reads_is_not_stored() {
        assert_eq!(stored(call), [(4, 40)]);
    }

    #[test]
    fn an_in_place_rewrite_in_the_backward_is_stored_whoever_reads_it() {
        // Autograd accumulates a gradient there, which outlives the step.
        assert_eq!(stored(backward), [(2, 20), (4, 40)]);
    }

    /// The holder `earlier_holder` finds for the gate's input that `silu_backward` (the last
    /// call) reads, where `between` runs after the forward's `silu` read it, and `grouped` are
    /// the members of every group.
    fn holder_of_the_gate_input(between: Option<TracedOp>, grouped: &[usize]) -> Option<usize> {
        let mut ops = vec![
            // ATen makes the gate's input (storage 20); the forward's silu reads it.
            call(0, "aten::mm", vec![tensor(1, 10)], vec![tensor(2, 20)]),
            call(1, "aten::silu", vec![tensor(2, 20)], vec![tensor(3, 30)]),
        ];
        ops.extend(between);
        let first = ops.len();
        // The group: a product's gradient, then silu's backward of it and of the saved input,
        // which autograd hands over as a new object on the same memory.
        ops.push(backward(
            4,
            "aten::mul",
            vec![tensor(5, 50)],
            vec![tensor(6, 60)],
        ));
        ops.push(backward(
            7,
            "aten::silu_backward",
            vec![tensor(6, 60), tensor(8, 20)],
            vec![tensor(9, 90)],
        ));
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = data_flow(&kernels);
        let grouped: HashSet<usize> = grouped.iter().copied().collect();
        let TracedValue::Tensor(saved) = &ops[first + 1].inputs[1] else {
            unreachable!("a tensor argument")
        };
        earlier_holder(&nodes, &grouped, first + 1, saved, first)
    }

    #[test]
    fn an_input_a_call_before_the_group_took_is_held_there() {
        assert_eq!(holder_of_the_gate_input(None, &[2, 3]), Some(1));
    }

    #[test]
    fn an_input_written_in_place_before_its_reader_is_held_nowhere_earlier() {
        let add = call(
            10,
            "aten::add_",
            vec![tensor(2, 20), tensor(11, 110)],
            vec![tensor(2, 20)],
        );
        assert_eq!(holder_of_the_gate_input(Some(add), &[3, 4]), None);
    }

    #[test]
    fn an_input_a_group_made_is_held_nowhere_earlier() {
        // The mm's result computed by a group's kernel may be written only at its launch.
        assert_eq!(holder_of_the_gate_input(None, &[0, 2, 3]), None);
    }

    #[test]
    fn a_tensor_handed_to_a_leaf_is_the_last_of_its_key_made_before_the_handing_call() {
        // Calls 0 and 2 make tensors of one key (an object and an address both reused); the
        // call numbered 3 hands the key's tensor to a leaf: call 2's, not call 0's.
        let ops = [
            backward(0, "aten::mul", vec![tensor(1, 10)], vec![tensor(2, 20)]),
            backward(1, "aten::exp", vec![tensor(2, 20)], vec![tensor(3, 30)]),
            backward(2, "aten::neg", vec![tensor(3, 30)], vec![tensor(2, 20)]),
            backward(4, "aten::mul", vec![tensor(2, 20)], vec![tensor(5, 50)]),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = data_flow(&kernels);
        assert_eq!(
            handed_to_leaves(&nodes, &[(3, (2, 20))]),
            HashSet::from([(2, 20)])
        );
    }

    /// `x * 2` at memory 20, `exp` of it at 30, which is freed; `sin` of `x * 2` gets its address
    /// (30 again), and `add_` writes it in place.
    fn reused_address() -> Vec<TracedOp> {
        vec![
            call(0, "aten::mul", vec![tensor(1, 10)], vec![tensor(2, 20)]),
            call(1, "aten::exp", vec![tensor(2, 20)], vec![tensor(3, 30)]),
            call(2, "aten::sin", vec![tensor(2, 20)], vec![tensor(3, 30)]),
            call(
                3,
                "aten::add_",
                vec![tensor(3, 30), tensor(2, 20)],
                vec![tensor(3, 30)],
            ),
        ]
    }

    #[test]
    fn a_storage_id_at_a_freed_address_names_a_second_allocation() {
        let ops = reused_address();
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let allocations = Allocations::of(&kernels);
        assert_eq!(allocations.holding(30, 1), (30, Some(1)));
        assert_eq!(allocations.holding(30, 2), (30, Some(2)));
    }

    #[test]
    fn an_in_place_write_keeps_its_inputs_allocation() {
        let ops = reused_address();
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let allocations = Allocations::of(&kernels);
        assert_eq!(allocations.holding(30, 3), (30, Some(2)));
        assert_eq!(allocations.holding(10, 3), (10, None));
        assert_eq!(allocations.all(30).count(), 3);
    }
}
