//! What an optimizer holds in memory ([`OptimizerMemory`]), counted by the context that made it.

use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::state::Group;

/// What an optimizer holds, in bytes: its parameters, their gradients (those allocated now) and
/// its state (AdamW's two moments and step counts, made at the first step, and learning rates).
///
/// ```
/// use speedkit::optim::{AdamW, AdamWOptimizer};
/// use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _layer = nn::linear(vs.root(), 256, 256, Default::default());
/// let opt = AdamWOptimizer::new(&vs, AdamW::default(), false)?;
/// let held = opt.memory();
/// assert_eq!(held.parameters, 4 * (256 * 256 + 256));
/// assert_eq!(held.gradients, 0); // no backward yet
/// assert_eq!(held.state, 4); // the learning rate: the first step makes the rest
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerMemory {
    /// The parameters' bytes.
    pub parameters: u64,
    /// The bytes of the parameters' gradients that are allocated.
    pub gradients: u64,
    /// The optimizer state's bytes.
    pub state: u64,
}

impl std::ops::Add for OptimizerMemory {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            parameters: self.parameters + other.parameters,
            gradients: self.gradients + other.gradients,
            state: self.state + other.state,
        }
    }
}

/// An optimizer's tensors (shallow handles to the same storage), shared with the context that made
/// it: the context counts them for as long as the optimizer lives, through a [`Weak`], and not a
/// moment longer. (In a mutex only so that the optimizer stays `Send`: a tensor is not `Sync`.)
pub(crate) struct Holdings(Mutex<HeldTensors>);

struct HeldTensors {
    params: Vec<Tensor>,
    /// The tensors whose gradients the optimizer reads: `params`, or a sharded optimizer's pieces.
    stepped: Vec<Tensor>,
    state: Vec<Tensor>,
}

impl Holdings {
    pub(crate) fn memory(&self) -> OptimizerMemory {
        self.held().memory()
    }

    /// Counts `state` as the optimizer's state from now on.
    pub(super) fn count_state<'a>(&self, state: impl Iterator<Item = &'a Tensor>) {
        self.held().state.extend(state.map(Tensor::shallow_clone));
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HeldTensors> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl HeldTensors {
    fn memory(&self) -> OptimizerMemory {
        let bytes = |t: &Tensor| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        OptimizerMemory {
            parameters: self.params.iter().map(bytes).sum(),
            gradients: self
                .stepped
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .map(|g| bytes(&g))
                .sum(),
            state: self.state.iter().map(bytes).sum(),
        }
    }
}

/// What an optimizer over `groups` holds; `whole`: the parameters a sharded optimizer's pieces
/// belong to (counted as its parameters).
pub(super) fn holdings_of(groups: &[Group], whole: Option<&[Tensor]>) -> Holdings {
    let buckets = || groups.iter().flat_map(|g| &g.buckets);
    let stepped: Vec<Tensor> = buckets()
        .flat_map(|b| &b.params)
        .map(Tensor::shallow_clone)
        .collect();
    Holdings(Mutex::new(HeldTensors {
        params: match whole {
            Some(whole) => whole.iter().map(Tensor::shallow_clone).collect(),
            None => stepped.iter().map(Tensor::shallow_clone).collect(),
        },
        stepped,
        state: buckets()
            .flat_map(|b| b.state.tensors().chain([&b.lr]))
            .map(Tensor::shallow_clone)
            .collect(),
    }))
}
