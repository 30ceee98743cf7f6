//! Recompute instead of save: a forward group's result that only the backward reads (autograd saved
//! it) is not written by the group's kernel; the step hands autograd a [deferred](crate::deferred)
//! tensor, which a kernel generated from the members it depends on writes at its first read in the
//! backward. Inductor's partitioner makes the same trade: RMSNorm's fp32 copy of its input and its
//! normalised output, SwiGLU's `silu`, are cheaper to compute again from what is saved anyway than
//! to keep from the forward to the backward.
//!
//! A result is recomputed where every call outside its group that reads it (through views made in
//! the forward too) is a backward call, it is laid out contiguously, and it holds at least
//! [`MIN_BYTES`]. Its kernel reads the group's other results and its inputs as they are; the
//! deferred tensor holds them until it is written. A group recomputes its results only where they
//! hold more memory than the tensors their kernels hold that the backward would not have kept.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::codegen::{self, GeneratedKernel};
use super::grouping::{self, Node};
use super::{FusedGroup, KernelArg, OpKind};
use crate::trace::{TracedOp, TracedTensor};

/// The smallest result worth a kernel of its own in the backward.
pub(super) const MIN_BYTES: u64 = 1 << 20;

/// A result of a group written in the backward, at its first read.
#[derive(Clone, Debug)]
pub(super) struct Deferral {
    /// The key of the result.
    pub result: (u64, u64),
    /// The member that computes it (its traced call).
    pub member: TracedOp,
    /// The calls its kernel computes, in step order.
    pub calls: Vec<TracedOp>,
    /// Its kernel: the group's inputs and other results it reads, then the result.
    pub kernel: GeneratedKernel,
    /// (call, storage) of each read by one of `calls` of a result another of them computes.
    pub inside: HashSet<(u64, u64)>,
    /// The data-flow node of `member`.
    node: usize,
    /// Its size.
    pub bytes: u64,
}

impl Deferral {
    /// Whether its calls are pointwise (and views; a norm's normalised elements, from its stored
    /// statistics, are): a kernel reading the result may compute it at each element it reads
    /// instead.
    fn pointwise(&self) -> bool {
        self.calls.iter().all(|op| {
            matches!(OpKind::of(&op.name), Some(OpKind::Pointwise | OpKind::View)) || normalizes(op)
        })
    }
}

/// A backward group's kernel that computes deferred results where it reads them.
pub(super) struct Inlined {
    pub kernel: GeneratedKernel,
    /// The forward calls it computes them from, in step order.
    pub calls: Vec<TracedOp>,
    /// The keys of the results it computes.
    pub results: Vec<(u64, u64)>,
}

/// The kernel of backward group `group` computing, at each element it reads, the results of
/// `deferred` it reads (the pointwise ones; a read is of a result where the data flow says so, not
/// the memory's id, which the allocator hands on): where every reader does, a result is never
/// written. `None` where it reads none or the kernel is not generated.
pub(super) fn inlined_kernel(
    group: &FusedGroup,
    deferred: &[&Deferral],
    nodes: &[Node],
    node_of: &HashMap<u64, usize>,
) -> Option<Inlined> {
    if !group.backward {
        return None;
    }
    let mut inside = group.inside.clone();
    let mut used: Vec<&Deferral> = Vec::new();
    for op in &group.calls {
        let &j = node_of.get(&op.id)?;
        for &(p, storage) in &nodes[j].reads {
            let from = origin(nodes, p);
            // The deferred result itself, not another result of its call (a group norm's
            // statistics).
            let Some(d) = (deferred.iter())
                .find(|d| d.node == from && d.result.1 == storage && d.pointwise())
            else {
                continue;
            };
            // Memory written in place since holds other values than the result's.
            let rewritten = (nodes[j].reads.iter())
                .any(|&(q, other)| other == storage && origin(nodes, q) != from);
            if rewritten {
                continue;
            }
            if !inside.insert((op.id, storage)) {
                continue;
            }
            if !used.iter().any(|u| u.result == d.result) {
                used.push(d);
            }
        }
    }
    if used.is_empty() {
        return None;
    }
    let mut chains: Vec<TracedOp> = used.iter().flat_map(|d| d.calls.iter().cloned()).collect();
    chains.sort_by_key(|op| node_of.get(&op.id).copied());
    chains.dedup_by_key(|op| op.id);
    inside.extend(used.iter().flat_map(|d| d.inside.iter().copied()));
    let calls: Vec<&TracedOp> = chains.iter().chain(&group.calls).collect();
    let kernel = codegen::generate_recomputed(&calls, &group.results, &inside).ok()?;
    Some(Inlined {
        kernel,
        calls: chains,
        results: used.iter().map(|d| d.result).collect(),
    })
}

/// Node `p`, or through the views it is of, the node that made the memory.
fn origin(nodes: &[Node], mut p: usize) -> usize {
    while nodes[p].kind == Some(OpKind::View) {
        match nodes[p].reads.first() {
            Some(&(q, _)) => p = q,
            None => break,
        }
    }
    p
}

/// The results of `group` to recompute in the backward (none for a backward group, or where the
/// memory they free is no more than what their kernels hold).
pub(super) fn deferrals(
    group: &FusedGroup,
    nodes: &[Node],
    node_of: &HashMap<u64, usize>,
) -> Vec<Deferral> {
    if group.backward {
        return Vec::new();
    }
    let members: Vec<usize> = group
        .calls
        .iter()
        .filter_map(|op| node_of.get(&op.id).copied())
        .collect();
    if members.len() != group.calls.len() {
        return Vec::new();
    }
    let inside: HashSet<usize> = members.iter().copied().collect();
    // The last member making `key`: a key names a tensor object at an address, both reused once
    // freed, so an earlier member's result freed within the group may have had the same key.
    let computing = |key: (u64, u64)| {
        members.iter().copied().rev().find(|&m| {
            nodes[m].kind != Some(OpKind::View)
                && nodes[m].op.output_tensors().any(|t| t.key() == key)
        })
    };
    let mut results: Vec<(u64, u64)> = group.results.clone();
    results.dedup();
    let candidates: Vec<((u64, u64), usize)> = results
        .iter()
        .filter_map(|&key| Some((key, computing(key)?)))
        .filter(|&(key, m)| worth_recomputing(nodes, &inside, m, key))
        .collect();
    let deferred: HashSet<usize> = candidates.iter().map(|&(_, m)| m).collect();
    // Each stored value by the member that makes it: a key freed within the group may name a
    // later member's result too.
    let deferred_keys: HashSet<(u64, u64)> = candidates.iter().map(|&(key, _)| key).collect();
    // The members still storing a result: those not deferred, and a dropout whose mask alone is.
    let stored: HashSet<usize> = (results.iter())
        .filter(|key| !deferred_keys.contains(key))
        .filter_map(|&key| computing(key))
        .filter(|&m| !deferred.contains(&m) || draws(nodes[m].op))
        .collect();
    let stored_values: HashSet<(usize, (u64, u64))> = (results.iter())
        .filter(|key| !deferred_keys.contains(key))
        .filter_map(|&key| Some((computing(key)?, key)))
        .collect();
    if candidates.is_empty() || stored.is_empty() {
        return Vec::new();
    }
    let planned: Vec<Deferral> = candidates
        .into_iter()
        .filter_map(|(result, m)| {
            // A dropout's mask is its forward kernel's draw alone, drawn again.
            let chain = match draws(nodes[m].op) {
                true => vec![m],
                false => chain_of(nodes, &inside, &stored_values, m),
            };
            // A norm is recomputed from the statistics it stored, its own; another's statistics
            // would have to be computed again, a block per row. A dropout's result would need
            // its input held.
            if (chain.iter()).any(|&c| c != m && normalizes(nodes[c].op))
                || (chain.iter()).any(|&c| c != m && draws(nodes[c].op))
            {
                return None;
            }
            let calls: Vec<&TracedOp> = chain.iter().map(|&c| nodes[c].op).collect();
            let reads = grouping::inside_reads(nodes, &chain);
            let kernel = codegen::generate_recomputed(&calls, &[result], &reads).ok()?;
            let out = nodes[m].op.output_tensors().find(|t| t.key() == result)?;
            Some(Deferral {
                result,
                member: nodes[m].op.clone(),
                calls: calls.into_iter().cloned().collect(),
                kernel,
                inside: reads,
                node: m,
                bytes: bytes(out),
            })
        })
        .collect();
    let freed: u64 = planned.iter().map(|d| d.bytes).sum();
    if freed <= held_bytes(nodes, &planned) {
        return Vec::new();
    }
    planned
}

/// Whether member `m`'s result `key` (its one result, a norm's normalised elements, recomputed
/// from the statistics it keeps, or a dropout's mask, drawn again) is contiguous, large enough,
/// and read only by backward calls (at least one) outside the group, as are `m`'s other results
/// but a dropout's.
fn worth_recomputing(nodes: &[Node], inside: &HashSet<usize>, m: usize, key: (u64, u64)) -> bool {
    let op = nodes[m].op;
    let outputs: Vec<&TracedTensor> = op.output_tensors().collect();
    let (out, only) = match outputs[..] {
        [out] => (out, None),
        [out, ..] if normalizes(op) && out.key() == key => (out, None),
        [_, mask] if draws(op) && mask.key() == key => (mask, Some(mask.storage)),
        _ => return false,
    };
    !codegen::writes_in_place(op)
        && contiguous(out)
        && bytes(out) >= MIN_BYTES
        && read_only_in_the_backward(nodes, inside, m, only)
}

/// Whether every call outside `inside` that reads node `m`'s result (`only` that of its results,
/// where given), directly or through views made in the forward (in the group or not), is a
/// backward call; and at least one does.
fn read_only_in_the_backward(
    nodes: &[Node],
    inside: &HashSet<usize>,
    m: usize,
    only: Option<u64>,
) -> bool {
    let mut readers = 0;
    let mut sources = vec![m];
    let mut seen = HashSet::new();
    while let Some(source) = sources.pop() {
        if !seen.insert(source) {
            continue;
        }
        let reads_it = |&(p, storage): &(usize, u64)| {
            p == source && (source != m || only.is_none_or(|s| s == storage))
        };
        for (j, node) in nodes.iter().enumerate().skip(source + 1) {
            if !node.reads.iter().any(reads_it) {
                continue;
            }
            // A view in the forward, the group's own included, is the result under another name.
            match (node.op.backward, node.kind) {
                (false, Some(OpKind::View)) => sources.push(j),
                _ if inside.contains(&j) => {}
                (true, _) => readers += 1,
                (false, _) => return false,
            }
        }
    }
    readers > 0
}

/// The members `m` depends on within the group, itself included, in step order: what its kernel
/// computes. A stored result of the group (`stored`: the member that makes it, its key) is read
/// as it is, not computed again.
fn chain_of(
    nodes: &[Node],
    inside: &HashSet<usize>,
    stored: &HashSet<(usize, (u64, u64))>,
    m: usize,
) -> Vec<usize> {
    // The value read, not its call: a norm stores its statistics, not always its normalised
    // elements.
    let reads_stored = |p: usize, storage: u64| {
        (nodes[p].op.output_tensors())
            .any(|t| t.storage == storage && stored.contains(&(p, t.key())))
    };
    let mut chain = BTreeSet::new();
    let mut stack = vec![m];
    while let Some(n) = stack.pop() {
        if !chain.insert(n) {
            continue;
        }
        for &(p, storage) in &nodes[n].reads {
            if inside.contains(&p) && !reads_stored(p, storage) {
                stack.push(p);
            }
        }
    }
    chain.into_iter().collect()
}

/// The bytes the deferred tensors hold for their kernels that the backward would not have held:
/// tensors the step made (not parameters or data) that no backward call reads.
fn held_bytes(nodes: &[Node], planned: &[Deferral]) -> u64 {
    let mut made: HashMap<(u64, u64), usize> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        for t in node.op.output_tensors() {
            made.entry(t.key()).or_insert(i);
        }
    }
    // Through views (a saved tensor may be read as the view autograd saved), to what made it.
    let origin = |p: usize| origin(nodes, p);
    let kept = |t: &TracedTensor| match made.get(&t.key()) {
        None => true,
        Some(&p) => nodes.iter().any(|n| {
            n.op.backward
                && (n.reads.iter())
                    .any(|&(q, storage)| storage == t.storage && origin(q) == origin(p))
        }),
    };
    let mut held: HashMap<u64, u64> = HashMap::new();
    for d in planned {
        for arg in &d.kernel.args {
            if let KernelArg::Input(t) = arg {
                if !kept(t) {
                    held.insert(t.storage, bytes(t));
                }
            }
        }
    }
    held.values().sum()
}

fn bytes(t: &TracedTensor) -> u64 {
    t.numel * t.item_bytes
}

/// Laid out as a deferred tensor is: row-major from the start of its storage, with the strides
/// PyTorch gives a contiguous tensor (also over dimensions of size 1).
fn contiguous(t: &TracedTensor) -> bool {
    let mut expected = 1;
    for (&size, &stride) in t.shape.iter().zip(&t.strides).rev() {
        if stride != expected {
            return false;
        }
        expected *= size.max(1);
    }
    t.offset == 0
}

/// Whether `op` draws random numbers (a dropout): computed again, its result would need its input
/// held; its mask is the draw alone, which a kernel draws again from the forward's stretch.
fn draws(op: &TracedOp) -> bool {
    op.name == "aten::native_dropout"
}

/// Whether `op` is a norm's forward (a group or layer norm), whose normalised elements the
/// generator computes from its stored statistics.
fn normalizes(op: &TracedOp) -> bool {
    matches!(
        op.name.as_str(),
        "aten::native_group_norm" | "aten::native_layer_norm"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::testing::{backward, call, tensor};
    use crate::trace::TracedValue;

    /// A 4 MiB fp32 tensor: object `id` on storage `storage`.
    fn large(id: u64, storage: u64) -> TracedValue {
        let mut t = tensor(id, storage);
        if let TracedValue::Tensor(t) = &mut t {
            (t.numel, t.shape) = (1 << 20, vec![1 << 20]);
        }
        t
    }

    #[test]
    fn a_member_whose_result_key_a_later_member_takes_over_is_computed_again_not_read() {
        // neg's result (object 2, storage 20) is freed after add reads it; exp's result takes the
        // same object and address. add's result, which only the backward reads, is deferred: its
        // kernel must compute neg again, which the group does not store.
        let ops = [
            call(0, "aten::neg", vec![large(1, 10)], vec![large(2, 20)]),
            call(
                1,
                "aten::add",
                vec![large(2, 20), large(5, 50)],
                vec![large(3, 30)],
            ),
            call(2, "aten::exp", vec![large(3, 30)], vec![large(2, 20)]),
            call(3, "aten::mm", vec![large(2, 20)], vec![large(6, 60)]),
            backward(4, "aten::mm", vec![large(3, 30)], vec![large(7, 70)]),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = grouping::data_flow(&kernels);
        let node_of: HashMap<u64, usize> = ops.iter().map(|op| (op.id, op.id as usize)).collect();
        let group = FusedGroup {
            operators: vec!["aten::neg".into(), "aten::add".into(), "aten::exp".into()],
            aten_kernels: 3,
            reduction: None,
            backward: false,
            recomputed: Vec::new(),
            calls: ops[..3].to_vec(),
            results: vec![(3, 30), (2, 20)],
            inside: HashSet::from([(1, 20), (2, 30)]),
        };
        let deferred = deferrals(&group, &nodes, &node_of);
        let calls: Vec<Vec<&str>> = (deferred.iter())
            .map(|d| d.calls.iter().map(|op| op.name.as_str()).collect())
            .collect();
        assert_eq!(calls, [["aten::neg", "aten::add"]]);
    }

    /// A 1 Mi-element tensor of `dtype`: object `id` on storage `storage`.
    fn large_of(id: u64, storage: u64, dtype: &str) -> TracedValue {
        let mut t = large(id, storage);
        if let TracedValue::Tensor(t) = &mut t {
            t.dtype = dtype.into();
        }
        t
    }

    #[test]
    fn a_dropouts_mask_only_the_backward_reads_is_drawn_again_from_nothing_but_its_draw() {
        // mul → dropout → mm in the forward: the mask only the backward's native_dropout_backward
        // reads; the dropout's result is read by the forward's mm, and stays stored.
        let other = |value: &str| TracedValue::Other {
            value: value.into(),
            kind: "Double".into(),
        };
        let dropout = call(
            1,
            "aten::native_dropout",
            vec![large(2, 20), other("0.1"), other("true")],
            vec![large(3, 30), large_of(4, 40, "bool")],
        );
        let ops = [
            call(
                0,
                "aten::mul",
                vec![large(1, 10), large(5, 50)],
                vec![large(2, 20)],
            ),
            dropout,
            call(2, "aten::mm", vec![large(3, 30)], vec![large(6, 60)]),
            backward(
                3,
                "aten::native_dropout_backward",
                vec![large(7, 70), large_of(4, 40, "bool"), other("1.111111")],
                vec![large(8, 80)],
            ),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = grouping::data_flow(&kernels);
        let node_of: HashMap<u64, usize> = ops.iter().map(|op| (op.id, op.id as usize)).collect();
        let group = FusedGroup {
            operators: vec!["aten::mul".into(), "aten::native_dropout".into()],
            aten_kernels: 2,
            reduction: None,
            backward: false,
            recomputed: Vec::new(),
            calls: ops[..2].to_vec(),
            results: vec![(3, 30), (4, 40)],
            inside: HashSet::from([(1, 20)]),
        };
        let deferred = deferrals(&group, &nodes, &node_of);
        assert_eq!(deferred.len(), 1);
        let mask = &deferred[0];
        assert_eq!((mask.result, mask.calls.len()), ((4, 40), 1));
        // Its kernel reads nothing: the mask is the forward kernel's draw, drawn again.
        assert!(mask
            .kernel
            .args
            .iter()
            .all(|a| matches!(a, KernelArg::Output(_))));
        assert!(
            matches!(&mask.kernel.draws[..], [d] if d.replays && d.call == 1),
            "{:?}",
            mask.kernel.draws
        );
    }

    #[test]
    fn a_deferred_result_is_computed_where_the_data_flow_reads_it_not_where_its_memory_id_returns()
    {
        // The forward's silu (object 2, storage 20) is deferred. The backward's first mul reads it;
        // then new memory gets storage id 20 again (the allocator's address), and the last mul
        // reads that: other values, which the kernel must read as they are.
        let ops = [
            call(0, "aten::silu", vec![tensor(1, 10)], vec![tensor(2, 20)]),
            backward(
                1,
                "aten::mul",
                vec![tensor(5, 50), tensor(2, 20)],
                vec![tensor(6, 60)],
            ),
            backward(2, "aten::exp", vec![tensor(6, 60)], vec![tensor(7, 70)]),
            backward(3, "aten::empty", vec![], vec![tensor(8, 20)]),
            backward(
                4,
                "aten::mul",
                vec![tensor(8, 20), tensor(7, 70)],
                vec![tensor(9, 90)],
            ),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let nodes = grouping::data_flow(&kernels);
        let node_of: HashMap<u64, usize> = ops.iter().map(|op| (op.id, op.id as usize)).collect();
        let silu = [&ops[0]];
        let deferral = Deferral {
            result: (2, 20),
            member: ops[0].clone(),
            calls: vec![ops[0].clone()],
            kernel: codegen::generate(&silu, &[(2, 20)], &HashSet::new()).unwrap(),
            inside: HashSet::new(),
            node: 0,
            bytes: 16,
        };
        let group = FusedGroup {
            operators: vec!["aten::mul".into(), "aten::exp".into(), "aten::mul".into()],
            aten_kernels: 3,
            reduction: None,
            backward: true,
            recomputed: Vec::new(),
            calls: vec![ops[1].clone(), ops[2].clone(), ops[4].clone()],
            results: vec![(9, 90)],
            inside: HashSet::from([(2, 60), (4, 70)]),
        };
        let inlined = inlined_kernel(&group, &[&deferral], &nodes, &node_of).unwrap();
        assert_eq!(inlined.results, [(2, 20)]);
        let inputs: Vec<u64> = (inlined.kernel.args.iter())
            .filter_map(|a| match a {
                KernelArg::Input(t) => Some(t.id),
                _ => None,
            })
            .collect();
        // silu's input instead of the deferred result; the new memory read as it is.
        assert!(inputs.contains(&1) && inputs.contains(&8), "{inputs:?}");
        assert!(!inputs.contains(&2), "{inputs:?}");
    }
}
