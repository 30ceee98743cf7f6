//! The keys of the trace's tensors, each of its own, and the reads of saved tensors parked in host
//! memory during the trace ([`crate::offload`]) given the keys of the forward's tensors.
//!
//! The trace names a tensor by its object's address and its storage's, both reused once freed: a
//! result made where an earlier one was freed, on an object at the same address, shares its key
//! (a SwiGLU backward's two products, the first still read by a GEMM between them). So every
//! tensor object and every storage gets an id of its own, never reused: a result is a new object
//! unless it is one of its call's arguments (in place) or an enclosing call's result (the kernel of
//! a composite), on new memory unless its call reads that memory or an enclosing call made it; a
//! read is of the last object and memory made under its ids.
//!
//! Without parking, the backward reads the very tensor object the forward saved (or, for a saved
//! result, another object on its memory). With parking, the forward's object may die and its memory
//! move: the backward reads another object (autograd wraps what the hook returns), perhaps at
//! another address, and a later tensor may take the forward's addresses. The parking marks each
//! pack (the saved tensor, as an alias of its own) and each unpack (the tensor returned, then the
//! alias). From them:
//! - a read inside the backward function that unpacked a saved tensor, where that tensor is (on the
//!   forward's storage) and of an object no call made since, is a read of the forward's tensor;
//! - a saved tensor on memory no call of the trace touched before it was saved was made before the
//!   step (a parameter that speedkit's own kernels read through its pointer, never an operator).
//!   Without parking the backward would read that same object, new to the trace; with it, it gets
//!   a key of its own.

use std::collections::{HashMap, HashSet};

use super::{TracedOp, TracedTensor, TracedValue};

/// The record function marking a pack (`shim/saved_offload.cpp`): its input is the saved alias.
const PACKED: &str = "speedkit::saved_tensor_packed";
/// The record function marking an unpack: its inputs are the tensor returned, then the saved alias.
const UNPACKED: &str = "speedkit::saved_tensor_unpacked";

/// Object ids given here start above any the trace gives.
const FIRST_ID: u64 = 1 << 48;

type Key = (u64, u64);

/// Where a tensor's elements are: its storage, offset, sizes and strides.
type Place = (u64, u64, Vec<i64>, Vec<i64>);

fn place(t: &TracedTensor) -> Place {
    (t.storage, t.offset, t.shape.clone(), t.strides.clone())
}

/// A saved tensor the backward unpacked: the forward's key, the backward function that unpacked
/// it, and the number of calls seen before the unpack.
struct Unpacked {
    forward: Key,
    function: Option<u64>,
    after: usize,
}

#[derive(Default)]
struct Resolver {
    parents: HashMap<u64, u64>,
    next_id: u64,
    /// The object id given to the last object made under each trace key.
    ids: HashMap<Key, u64>,
    /// How many calls had been seen when each trace key was last made.
    made_at: HashMap<Key, usize>,
    /// The storage id given to the memory last made at each trace storage id.
    storages: HashMap<u64, u64>,
    /// Each call's results, as (trace key, key given).
    results: HashMap<u64, Vec<(Key, Key)>>,
    /// The key (as given) of the last tensor seen on each place by a call no enclosing call of
    /// which has a tensor there (a composite's own views of its result are not what it saved).
    last_on: HashMap<Place, Key>,
    /// The places of each call's tensors.
    places: HashMap<u64, HashSet<Place>>,
    /// Per saved alias (its trace object id): the forward tensor's key, where it was found.
    saved: HashMap<u64, Option<Key>>,
    /// Unpacked saved tensors by their place now (memory brought back is at another address).
    unpacked: HashMap<Place, Unpacked>,
    seen: usize,
    unmatched: usize,
}

impl Resolver {
    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        FIRST_ID + self.next_id
    }

    /// Whether a call made under `parent` runs inside `function` (anywhere, when `None`).
    fn inside(&self, parent: Option<u64>, function: Option<u64>) -> bool {
        let Some(function) = function else {
            return true;
        };
        let mut at = parent;
        while let Some(p) = at {
            if p == function {
                return true;
            }
            at = self.parents.get(&p).copied();
        }
        false
    }

    fn mark(&mut self, op: &TracedOp, kept: &[TracedOp], made: &HashMap<u64, usize>) {
        let tensors: Vec<&TracedTensor> = op.input_tensors().collect();
        match (op.name.as_str(), tensors.as_slice()) {
            (PACKED, [alias, ..]) => {
                let saver = op.parent.and_then(|p| made.get(&p)).map(|&i| &kept[i]);
                let mut alias = (*alias).clone();
                let made_before = !self.storages.contains_key(&alias.storage);
                alias.storage = self.storage_id(alias.storage);
                let forward = match self.saved_key(&alias, saver) {
                    None if made_before => Some(self.made_before_the_step(&alias)),
                    found => found,
                };
                self.saved.insert(alias.id, forward);
            }
            (UNPACKED, [_returned, alias, ..]) => match self.saved.get(&alias.id).copied() {
                Some(Some(forward)) => {
                    // The memory the backward reads is the forward's again, wherever it is now.
                    self.storages.insert(alias.storage, forward.1);
                    let (function, after) = (op.parent, self.seen);
                    let unpacked = Unpacked {
                        forward,
                        function,
                        after,
                    };
                    self.unpacked.insert(place(alias), unpacked);
                }
                _ => self.unmatched += 1,
            },
            _ => {}
        }
    }

    /// The key of the tensor `alias` was saved from: one of the results or arguments of the call
    /// that saved it (the operator whose autograd kernel packed it) where its place is; else the
    /// last tensor seen there (a custom autograd function saves outside any operator's call).
    fn saved_key(&self, alias: &TracedTensor, saver: Option<&TracedOp>) -> Option<Key> {
        let here = place(alias);
        let of_saver = saver.and_then(|op| {
            (op.output_tensors().chain(op.input_tensors())).find(|t| place(t) == here)
        });
        of_saver
            .map(TracedTensor::key)
            .or_else(|| self.last_on.get(&here).copied())
    }

    /// The key of a saved tensor on memory no call of the trace has touched: one made before the
    /// step (a parameter that only speedkit's own kernels read, through its pointer), which every
    /// read of that place shares from now on.
    fn made_before_the_step(&mut self, alias: &TracedTensor) -> Key {
        let key = (self.fresh(), alias.storage);
        self.last_on.insert(place(alias), key);
        key
    }

    /// The storage id given to the memory now at trace storage `raw` (one of its own if unseen).
    fn storage_id(&mut self, raw: u64) -> u64 {
        if let Some(&id) = self.storages.get(&raw) {
            return id;
        }
        let id = self.fresh();
        self.storages.insert(raw, id);
        id
    }

    /// Gives `op`'s tensors their ids, in place.
    fn resolve(&mut self, op: &mut TracedOp) {
        let mut read: HashMap<Key, u64> = HashMap::new();
        let mut read_memory: HashMap<u64, u64> = HashMap::new();
        for t in tensors_mut(&mut op.inputs) {
            let key = t.key();
            let unpacked = self.unpacked.get(&place(t)).filter(|u| {
                self.made_at.get(&key).is_none_or(|&at| at < u.after)
                    && self.inside(op.parent, u.function)
            });
            let given = match unpacked {
                Some(u) => u.forward,
                None => {
                    let id = match self.ids.get(&key) {
                        Some(&id) => id,
                        None => self.fresh(),
                    };
                    (id, self.storage_id(t.storage))
                }
            };
            self.ids.insert(key, given.0);
            read.insert(key, given.0);
            read_memory.insert(t.storage, given.1);
            (t.id, t.storage) = given;
        }
        let enclosing = self.enclosing_results(op.parent);
        let mut results = Vec::new();
        for t in tensors_mut(&mut op.outputs) {
            let key = t.key();
            let made_by = |k: Key| enclosing.iter().find(|(raw, _)| *raw == k).map(|(_, g)| *g);
            let made_memory = enclosing.iter().find(|(raw, _)| raw.1 == t.storage);
            let id = match read
                .get(&key)
                .copied()
                .or_else(|| made_by(key).map(|g| g.0))
            {
                Some(id) => id,
                None => self.fresh(),
            };
            let storage = match (read_memory.get(&t.storage), made_memory) {
                (Some(&storage), _) | (None, Some(&(_, (_, storage)))) => storage,
                (None, None) => self.fresh(),
            };
            self.ids.insert(key, id);
            self.storages.insert(t.storage, storage);
            self.made_at.insert(key, self.seen);
            results.push((key, (id, storage)));
            (t.id, t.storage) = (id, storage);
        }
        self.results.insert(op.id, results);
        let here: HashSet<Place> = op
            .input_tensors()
            .chain(op.output_tensors())
            .map(place)
            .collect();
        for t in op.input_tensors().chain(op.output_tensors()) {
            if !self.enclosing_has(op.parent, &place(t)) {
                self.last_on.insert(place(t), t.key());
            }
        }
        self.places.insert(op.id, here);
        self.seen += 1;
    }

    /// Whether a call enclosing one has a tensor on `at`.
    fn enclosing_has(&self, mut parent: Option<u64>, at: &Place) -> bool {
        while let Some(p) = parent {
            if self
                .places
                .get(&p)
                .is_some_and(|places| places.contains(at))
            {
                return true;
            }
            parent = self.parents.get(&p).copied();
        }
        false
    }

    /// The results of the calls enclosing one (whose kernels make them): (trace key, key given).
    fn enclosing_results(&self, mut at: Option<u64>) -> Vec<(Key, Key)> {
        let mut out = Vec::new();
        while let Some(p) = at {
            out.extend(self.results.get(&p).into_iter().flatten().copied());
            at = self.parents.get(&p).copied();
        }
        out
    }
}

fn tensors_mut(values: &mut [TracedValue]) -> impl Iterator<Item = &mut TracedTensor> {
    values.iter_mut().flat_map(|v| match v {
        TracedValue::Tensor(t) => std::slice::from_mut(t),
        TracedValue::Tensors(ts) => ts.as_mut_slice(),
        TracedValue::Other { .. } => &mut [],
    })
}

/// Gives every tensor object and every storage of `ops` an id of its own, never reused (the trace
/// reuses both with freed addresses, so that two results of one chain, the second made where the
/// first was freed, would share a key); gives a trace made while parking the keys it would have
/// without, and drops the marks. Returns how many unpacks found no tensor of the forward.
pub(super) fn resolve(ops: &mut Vec<TracedOp>) -> usize {
    let mut resolver = Resolver {
        parents: (ops.iter())
            .filter_map(|op| Some((op.id, op.parent?)))
            .collect(),
        ..Resolver::default()
    };
    let mut kept: Vec<TracedOp> = Vec::with_capacity(ops.len());
    let mut made: HashMap<u64, usize> = HashMap::new();
    for mut op in ops.drain(..) {
        if op.name == PACKED || op.name == UNPACKED {
            resolver.mark(&op, &kept, &made);
            continue;
        }
        resolver.resolve(&mut op);
        made.insert(op.id, kept.len());
        kept.push(op);
    }
    *ops = kept;
    resolver.unmatched
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::testing::{self, traced_tensor as tensor};

    fn call(id: u64, name: &str, parent: Option<u64>, inputs: Vec<TracedTensor>) -> TracedOp {
        let inputs = inputs.into_iter().map(TracedValue::Tensor).collect();
        TracedOp {
            parent,
            ..testing::call(id, name, inputs, Vec::new())
        }
    }

    /// A weight no operator touched in the forward (speedkit's kernels read it through its
    /// pointer), saved, parked and unpacked by the backward function 4, which reads it at the
    /// address it is unpacked to.
    fn a_weight_saved_unread() -> Vec<TracedOp> {
        let (saved, alias, returned) = (tensor(10, 100), tensor(11, 100), tensor(12, 200));
        vec![
            call(1, "speedkit::forward", None, Vec::new()),
            call(2, PACKED, Some(1), vec![alias.clone()]),
            call(4, "LinearBackward", None, Vec::new()),
            call(
                5,
                UNPACKED,
                Some(4),
                vec![returned.clone(), tensor(11, 200)],
            ),
            call(6, "aten::mm", Some(4), vec![returned]),
            call(7, "aten::mul", None, vec![saved]),
        ]
    }

    #[test]
    fn a_saved_tensor_on_memory_the_trace_never_touched_is_one_made_before_the_step() {
        let mut ops = a_weight_saved_unread();
        assert_eq!(resolve(&mut ops), 0);
        let read = |name: &str| {
            let op = ops.iter().find(|op| op.name == name).unwrap();
            op.input_tensors().next().unwrap().key()
        };
        // The backward reads the weight's memory, as a later call does, under a key of its own
        // that no call of the step made.
        assert_eq!(read("aten::mm").1, read("aten::mul").1);
        let made: Vec<Key> = ops
            .iter()
            .flat_map(|op| op.output_tensors().map(TracedTensor::key))
            .collect();
        assert!(!made.contains(&read("aten::mm")));
    }

    /// A chain whose second product is made where its first was freed, on the same tensor object
    /// (an address reused twice), as a SwiGLU backward makes them: the first read by a call
    /// between the two.
    fn a_result_made_again_at_a_freed_address() -> Vec<TracedOp> {
        let product = |id, input| {
            testing::backward(
                id,
                "aten::mul",
                vec![TracedValue::Tensor(tensor(input, input * 10))],
                vec![TracedValue::Tensor(tensor(2, 20))],
            )
        };
        let read = testing::backward(
            2,
            "aten::mm",
            vec![TracedValue::Tensor(tensor(2, 20))],
            vec![TracedValue::Tensor(tensor(3, 30))],
        );
        vec![product(1, 1), read, product(3, 4)]
    }

    #[test]
    fn a_result_made_where_an_earlier_one_was_freed_gets_a_key_of_its_own_without_parking() {
        let mut ops = a_result_made_again_at_a_freed_address();
        assert_eq!(resolve(&mut ops), 0);
        let first = ops[0].output_tensors().next().unwrap().key();
        let second = ops[2].output_tensors().next().unwrap().key();
        assert_ne!(first, second);
        assert_ne!(first.1, second.1, "the second product's memory is new");
        // The call between them read the first.
        assert_eq!(ops[1].input_tensors().next().unwrap().key(), first);
    }
}
