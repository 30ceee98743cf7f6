//! Autograd functions written in Rust: a forward over tensors and a backward over the outputs'
//! gradients, joined to libtorch's autograd graph as one node, what PyTorch users write as a
//! `torch.autograd.Function`. The building block of a fused op: put a [`crate::cuda`] kernel in
//! the forward and one in the backward, and the op trains like any other.
//!
//! The rules follow PyTorch's:
//! - **Saved tensors** ([`ForwardContext::save_for_backward`]) come back in the backward
//!   ([`BackwardContext::saved`]); one changed in place in between is an error there.
//! - **Gradients**: `backward` returns one entry per input, `None` for an input without one
//!   (an integer input, or one [`BackwardContext::needs_input_grad`] says needs none). An output the
//!   loss does not depend on arrives as zeros, or as `None` after
//!   [`ForwardContext::set_materialize_grads`]`(false)`. Outputs marked
//!   [`ForwardContext::mark_non_differentiable`] get no gradient and carry none.
//! - **An input used twice** gets the sum of its two gradients, as autograd adds them.
//! - **No-grad mode**: without grad mode, or with no input that requires grad, the forward runs
//!   and no node is recorded.
//! - **Autocast**: the forward runs under the caller's autocast and sees its inputs as given; with
//!   [`Function::autocast_inputs`] it sees floating CUDA inputs in that type and runs with autocast
//!   off (`torch.amp.custom_fwd(cast_inputs=…)`). The backward runs under the autocast state the
//!   forward ran under (`custom_bwd`).
//! - **Errors and panics** in either direction come back as errors: from [`apply`] for the
//!   forward, from `backward` (e.g. [`SpeedContext::backward_step`](crate::SpeedContext::backward_step))
//!   for the backward. Nothing unwinds across the C++ boundary.
//! - **Second derivatives** (a backward with `create_graph`) go through the backward's tch ops as
//!   through any others; a backward that launches kernels is differentiable once
//!   ([`Function::once_differentiable`]), and a second derivative that reaches it is an error.
//! - **CUDA graphs**: a function whose forward and backward only launch work on the current stream
//!   (no host reads) is captured with the rest of a [`GraphedStep`](crate::graph::GraphedStep); a
//!   replay runs its kernels with no Rust code on the way.
//!
//! ```
//! use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
//! use tch::{Device, Kind, Tensor};
//!
//! /// y = x², written out by hand.
//! struct Square;
//!
//! impl Function for Square {
//!     fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> speedkit::Result<Vec<Tensor>> {
//!         ctx.save_for_backward(&[&inputs[0]])?;
//!         Ok(vec![&inputs[0] * &inputs[0]])
//!     }
//!     fn backward(&mut self, ctx: &mut BackwardContext<'_>, grads: &[Option<Tensor>]) -> speedkit::Result<Vec<Option<Tensor>>> {
//!         let x = &ctx.saved()?[0];
//!         Ok(vec![grads[0].as_ref().map(|g| g * x * 2.0)])
//!     }
//! }
//!
//! let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
//! let y = apply(Square, &[&x])?.remove(0);
//! y.sum(Kind::Float).backward();
//! assert_eq!(Vec::<f32>::try_from(x.grad())?, [2.0, 4.0, 6.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::CString;

use tch::{Kind, Tensor};

use crate::error::Result;
use crate::ffi::{self, function::Call};

/// An autograd function: see the [module docs](self). `Send`, because autograd may call the
/// backward from its worker thread (the calls never overlap).
pub trait Function: Send + 'static {
    /// Under autocast, the type to cast floating CUDA inputs to before the forward, which then runs
    /// with autocast off; `None` (the default) passes inputs as given and keeps autocast on.
    fn autocast_inputs(&self) -> Option<Kind> {
        None
    }

    /// Whether the backward is differentiable once only (`torch.autograd.function.once_differentiable`):
    /// `true` for a backward autograd cannot differentiate again (one that launches kernels, as
    /// speedkit's fused ops do). A second derivative (a backward with `create_graph`) that reaches
    /// the node then fails with an error naming the function, where it would otherwise silently
    /// miss the node's part. `false` (the default) for a backward written with differentiable tch
    /// ops, which a second derivative goes through.
    fn once_differentiable(&self) -> bool {
        false
    }

    /// The outputs of `inputs`. Grad mode is off here: the function is one node of the graph.
    fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The inputs' gradients (one entry per input; `None` for none) from the outputs' (one entry
    /// per output; `None` only after `set_materialize_grads(false)`).
    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grad_outputs: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>>;
}

/// What the forward may tell its node.
pub struct ForwardContext<'call> {
    call: &'call Call,
}

impl ForwardContext<'_> {
    /// Keeps tensors for the backward ([`BackwardContext::saved`]); an in-place change to one of
    /// them in between makes the backward fail instead of computing with changed values.
    pub fn save_for_backward(&mut self, tensors: &[&Tensor]) -> Result<()> {
        self.call.save_for_backward(tensors)
    }

    /// Declares outputs that carry no gradient (an index, a mask).
    pub fn mark_non_differentiable(&mut self, outputs: &[&Tensor]) -> Result<()> {
        self.call.mark_non_differentiable(outputs)
    }

    /// Whether outputs the loss does not depend on get zeros (`true`, the default) or `None` as
    /// their gradient in the backward.
    pub fn set_materialize_grads(&mut self, value: bool) -> Result<()> {
        self.call.set_materialize_grads(value)
    }
}

/// What the backward may ask its node.
pub struct BackwardContext<'call> {
    call: &'call Call,
}

impl BackwardContext<'_> {
    /// The tensors the forward saved, in order.
    pub fn saved(&self) -> Result<Vec<Tensor>> {
        self.call.saved()
    }

    /// Whether input `index` needs a gradient (a gradient for one that does not is computed for
    /// nothing).
    pub fn needs_input_grad(&self, index: usize) -> Result<bool> {
        self.call.needs_input_grad(index)
    }

    /// Whether the backward may write its result into `tensor`'s memory, as llm.c writes the
    /// logits' gradient over the logits: `tensor` (usually a saved one, from [`saved`](Self::saved))
    /// is held only by the node and by the caller's one handle, no other tensor (a view, its
    /// base, the user's own) shares its memory, and the graph is not kept
    /// (`retain_graph`) for another backward that reads it again. The gradient can then take the
    /// place of what it is computed from, and the step's peak holds one of the two.
    ///
    /// Save a [`detach`](Tensor::detach)ed alias of an input for this to hold once the user
    /// drops the input: the input's own tensor is also held by whatever made it.
    ///
    /// ```
    /// use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
    /// use tch::{Kind, Tensor};
    ///
    /// /// y = exp(x), whose gradient g·y may take y's memory.
    /// struct Exp;
    ///
    /// impl Function for Exp {
    ///     fn forward(&mut self, ctx: &mut ForwardContext<'_>, inputs: &[Tensor]) -> speedkit::Result<Vec<Tensor>> {
    ///         let y = inputs[0].exp();
    ///         ctx.save_for_backward(&[&y.detach()])?;
    ///         Ok(vec![y])
    ///     }
    ///     fn backward(&mut self, ctx: &mut BackwardContext<'_>, grads: &[Option<Tensor>]) -> speedkit::Result<Vec<Option<Tensor>>> {
    ///         let y = ctx.saved()?.remove(0);
    ///         let g = grads[0].as_ref().expect("a gradient");
    ///         let dx = if ctx.may_overwrite(&y)? { y.shallow_clone().f_mul_(g)? } else { g * &y };
    ///         Ok(vec![Some(dx)])
    ///     }
    /// }
    ///
    /// let x = Tensor::from_slice(&[0.0f32, 1.0]).set_requires_grad(true);
    /// let loss = apply(Exp, &[&x])?.remove(0).sum(Kind::Float); // y itself is dropped here
    /// loss.backward();
    /// assert_eq!(Vec::<f32>::try_from(x.grad())?, [1.0, 1.0f32.exp()]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn may_overwrite(&self, tensor: &Tensor) -> Result<bool> {
        self.call.may_overwrite(tensor)
    }
}

/// `function`'s outputs for `inputs`, recorded as one node of the autograd graph where grad mode is
/// on and an input requires grad. At most 64 outputs.
pub fn apply<F: Function>(function: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let cast_inputs = match function.autocast_inputs() {
        Some(kind) => ffi::scalar_type_code(kind)?,
        None => -1,
    };
    let once_differentiable = function
        .once_differentiable()
        .then(|| CString::new(std::any::type_name::<F>()).ok())
        .flatten();
    ffi::function::apply(
        Node(function),
        ffi::function::Node::Function {
            cast_inputs,
            once_differentiable,
        },
        inputs,
    )
}

/// A [`Function`] as the shim's callbacks.
struct Node<F>(F);

impl<F: Function> ffi::function::Callbacks for Node<F> {
    fn forward(&mut self, call: &Call, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.0.forward(&mut ForwardContext { call }, inputs)
    }

    fn backward(
        &mut self,
        call: &Call,
        grad_outputs: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        self.0.backward(&mut BackwardContext { call }, grad_outputs)
    }
}

/// `x · k` through a C++ autograd function of the same shape as a one-line [`Function`] (forward
/// `x · k`, backward `grad · k`, nothing saved): the twin that a Rust node's host cost is measured
/// against (`examples/custom_op/main.rs`).
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let y = speedkit::function::reference_scale(&x, 2.0)?;
/// y.sum(Kind::Float).backward();
/// assert_eq!(Vec::<f32>::try_from(x.grad())?, [2.0; 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn reference_scale(x: &Tensor, k: f64) -> Result<Tensor> {
    ffi::function::reference_scale(x, k)
}
