//! Activation checkpointing: run part of the forward without keeping its activations, and run it
//! again during the backward pass to back-propagate through it (`torch.utils.checkpoint`). A
//! checkpointed transformer block keeps only its input until the backward reaches it, so the
//! activations of one block at a time are alive instead of all of them, for the cost of one more
//! forward of each checkpointed block.
//!
//! Checkpoints live in a scope, [`SpeedContext::checkpointed`]: the functions it checkpoints may
//! borrow the model, and the backward must run inside the scope (a whole training step is the
//! natural scope). A backward through a checkpoint after its scope ended is an error, never a call
//! into a function whose borrows are gone.
//!
//! The recomputation sees what the forward saw: the same inputs (saved, and checked against
//! in-place changes), the same autocast state, and the same random numbers (the CPU's and the
//! current CUDA device's generators are rewound, so dropout draws the same mask), except inside a
//! CUDA graph capture, where a generator's state cannot be read: do not checkpoint random ops in a
//! graphed step. It works under autocast, inside `#[speedkit::forward]` and inside whole-step CUDA
//! graphs (the recomputation is captured with the backward). A second derivative through a
//! checkpoint (a backward with `create_graph`) is an error: the recomputation back-propagates
//! without one.
//!
//! ```
//! use speedkit::{SpeedConfig, SpeedContext};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
//! let vs = nn::VarStore::new(Device::Cpu);
//! let block = nn::seq().add(nn::linear(vs.root() / "a", 8, 32, Default::default())).add_fn(|x| x.gelu("tanh"))
//!     .add(nn::linear(vs.root() / "b", 32, 8, Default::default()));
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
//! ctx.checkpointed(|ck| -> speedkit::Result<()> {
//!     let y = ck.checkpoint(&[&x], |inputs| Ok(vec![block.forward(&inputs[0])]))?.remove(0);
//!     y.square().mean(Kind::Float).backward();   // runs the block again, then back-propagates
//!     Ok(())
//! })?;
//! assert!(vs.trainable_variables().iter().all(|p| p.grad().defined()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use tch::Tensor;

use crate::error::{Result, SpeedkitError};
use crate::ffi::{self, function::Call};
use crate::SpeedContext;

/// A checkpointed function that borrows for `'env`.
type Function<'env> = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'env>;

/// A checkpointed function, its borrows' lifetime erased while its scope lasts.
struct Recompute(Function<'static>);

// SAFETY: the function is called only while its scope lasts: in the forward, on the scope's
// thread, and in a backward pass through the checkpoint, which autograd runs (on the calling
// thread or a device thread of its own) while the thread that started it waits, the same footing
// as tch's `Tensor: Send`. Every call holds the slot's mutex.
unsafe impl Send for Recompute {}

/// Where a checkpoint node finds its function: emptied when the scope ends.
type Slot = Arc<Mutex<Option<Recompute>>>;

/// The checkpoints of one [`SpeedContext::checkpointed`] scope; `'env` is the context's borrow,
/// which every checkpointed function's borrows outlive.
///
/// `'env` is invariant (as `std::thread::Scope`'s): were it not, a scope could shrink it and
/// checkpoint a function borrowing a model dropped before the backward, which then calls it. That
/// does not compile:
///
/// ```compile_fail
/// use speedkit::{SpeedConfig, SpeedContext};
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap();
/// let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// ctx.checkpointed(|ck| {
///     let y = {
///         let vs = nn::VarStore::new(Device::Cpu);
///         let layer = nn::linear(vs.root(), 8, 8, Default::default());
///         ck.checkpoint(&[&x], |i| Ok(vec![layer.forward(&i[0])])).unwrap().remove(0)
///     }; // `layer` is dropped here: the backward below would call into it
///     y.sum(Kind::Float).backward();
/// });
/// ```
pub struct Checkpointer<'env> {
    slots: RefCell<Vec<Slot>>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'env> Checkpointer<'env> {
    /// `function(inputs)`, its activations not kept: the backward pass runs it again on the same
    /// inputs and back-propagates through that run, giving the inputs their gradients and adding to
    /// those of the parameters it uses. `function` must compute the same thing each time it runs;
    /// it sees the inputs detached, with `requires_grad` set on the floating ones in the rerun.
    pub fn checkpoint<F>(&self, inputs: &[&Tensor], function: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'env,
    {
        let boxed: Function<'env> = Box::new(function);
        // SAFETY: only the lifetime changes. The slot is emptied (the box dropped) when this
        // checkpointer drops, which is before `'env` ends (it lives inside `checkpointed`, which
        // borrows the context for `'env`); a node that outlives the scope finds the slot empty.
        let erased =
            Recompute(unsafe { std::mem::transmute::<Function<'env>, Function<'static>>(boxed) });
        let slot: Slot = Arc::new(Mutex::new(Some(erased)));
        self.slots.borrow_mut().push(Arc::clone(&slot));
        ffi::function::apply(
            CheckpointNode(slot),
            ffi::function::Node::Checkpoint,
            inputs,
        )
    }
}

impl Drop for Checkpointer<'_> {
    fn drop(&mut self) {
        for slot in self.slots.get_mut().drain(..) {
            slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        }
    }
}

/// A checkpoint's callbacks.
struct CheckpointNode(Slot);

impl ffi::function::Callbacks for CheckpointNode {
    fn forward(&mut self, _call: &Call, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let function = slot.as_ref().ok_or_else(|| {
            SpeedkitError::Misuse(
                "a checkpoint was back-propagated through after its `checkpointed` scope ended: \
                 run the backward inside the scope"
                    .into(),
            )
        })?;
        // The function runs again in the backward, one block at a time: casts of its weights made
        // where they are used die with the block, where kept copies would all live through the
        // step (what torch.utils.checkpoint gets from autocast's per-forward casts).
        let _casts = ffi::weight_casts::CastsPerUse::enter()?;
        (function.0)(inputs)
    }

    fn backward(&mut self, _call: &Call, _grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Err(SpeedkitError::Misuse(
            "a checkpoint's backward is its recomputation; nothing calls this".into(),
        ))
    }
}

impl SpeedContext {
    /// Runs `body` with a [`Checkpointer`], whose checkpointed functions may borrow the model; the
    /// backward through them must run inside `body`. See [the module](crate::checkpoint).
    pub fn checkpointed<'env, R>(&'env self, body: impl FnOnce(&Checkpointer<'env>) -> R) -> R {
        let checkpointer = Checkpointer {
            slots: RefCell::default(),
            _env: PhantomData,
        };
        body(&checkpointer)
    }
}
