//! AdamW and the parameter-list helpers of the optimizer and the context (`shim/optim.cpp`).

use std::ptr;

use tch::Tensor;

use super::{check, handle, handles, optional_handle, owned, raw, raw::optim as abi, Result};
use crate::error::SpeedkitError;

/// Borrowed tensor lists of one AdamW bucket (same device and dtype).
pub(crate) struct AdamWLists<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub exp_avgs: &'a [Tensor],
    pub exp_avg_sqs: &'a [Tensor],
    pub steps: &'a [Tensor],
}

/// Hyper-parameters of one AdamW update.
pub(crate) struct AdamWHyper<'a> {
    pub lr: &'a Tensor,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// The lists' handles, checked to be of one length, and the ABI's view of them.
struct ListHandles {
    params: Vec<raw::sk_tensor>,
    grads: Vec<raw::sk_tensor>,
    exp_avgs: Vec<raw::sk_tensor>,
    exp_avg_sqs: Vec<raw::sk_tensor>,
    steps: Vec<raw::sk_tensor>,
}

impl ListHandles {
    fn of(l: &AdamWLists<'_>) -> Result<Self> {
        let n = l.params.len();
        let lengths = [
            l.grads.len(),
            l.exp_avgs.len(),
            l.exp_avg_sqs.len(),
            l.steps.len(),
        ];
        if lengths.iter().any(|&len| len != n) {
            return Err(SpeedkitError::Torch(
                "AdamW tensor lists differ in length".into(),
            ));
        }
        Ok(Self {
            params: handles(l.params),
            grads: handles(l.grads),
            exp_avgs: handles(l.exp_avgs),
            exp_avg_sqs: handles(l.exp_avg_sqs),
            steps: handles(l.steps),
        })
    }

    /// Borrows the handles for one call.
    fn abi(&self) -> raw::sk_adamw_lists {
        raw::sk_adamw_lists {
            params: self.params.as_ptr(),
            grads: self.grads.as_ptr(),
            exp_avgs: self.exp_avgs.as_ptr(),
            exp_avg_sqs: self.exp_avg_sqs.as_ptr(),
            steps: self.steps.as_ptr(),
            n: self.params.len() as i64,
        }
    }
}

impl AdamWHyper<'_> {
    fn abi(&self) -> raw::sk_adamw_hyper {
        raw::sk_adamw_hyper {
            lr: handle(self.lr),
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            eps: self.eps,
        }
    }
}

/// `_fused_adamw_`, or speedkit's AdamW kernel for every parameter it takes where the kernel switch
/// allows it (writing the parameters' kept autocast copies in the same pass).
pub(crate) fn fused_adamw_(
    lists: &AdamWLists<'_>,
    hyper: &AdamWHyper<'_>,
    grad_scale: Option<&Tensor>,
    found_inf: Option<&Tensor>,
) -> Result<()> {
    let l = ListHandles::of(lists)?;
    // SAFETY: the structs point at live handles (`l`, `hyper`'s tensors) for the call; optional
    // tensors are null or live.
    check(unsafe {
        abi::sk_fused_adamw_(
            &l.abi(),
            &hyper.abi(),
            optional_handle(grad_scale),
            optional_handle(found_inf),
        )
    })
}

pub(crate) fn foreach_adamw_(lists: &AdamWLists<'_>, hyper: &AdamWHyper<'_>) -> Result<()> {
    let l = ListHandles::of(lists)?;
    // SAFETY: the structs point at live handles for the call.
    check(unsafe { abi::sk_foreach_adamw_(&l.abi(), &hyper.abi()) })
}

pub(crate) fn foreach_zero_(tensors: &[Tensor]) -> Result<()> {
    let t = handles(tensors);
    // SAFETY: live handles for the call.
    check(unsafe { abi::sk_foreach_zero_(t.as_ptr(), t.len() as i64) })
}

/// Sets `grad` of every tensor to undefined (`param.grad = None`).
pub(crate) fn clear_grads(params: &[Tensor]) -> Result<()> {
    let t = handles(params);
    // SAFETY: live handles for the call.
    check(unsafe { abi::sk_clear_grads(t.as_ptr(), t.len() as i64) })
}

/// Sets `params[i].grad = grads[i]`.
pub(crate) fn set_grads(params: &[Tensor], grads: &[Tensor]) -> Result<()> {
    if params.len() != grads.len() {
        return Err(SpeedkitError::Misuse(format!(
            "{} parameters but {} gradients",
            params.len(),
            grads.len()
        )));
    }
    let (p, g) = (handles(params), handles(grads));
    // SAFETY: live handles of equal length for the call.
    check(unsafe { abi::sk_set_grads(p.as_ptr(), g.as_ptr(), p.len() as i64) })
}

/// The `ord`-norm of all tensors together (as `torch.nn.utils.clip_grad_norm_` computes it).
pub(crate) fn foreach_total_norm(tensors: &[Tensor], ord: f64) -> Result<Tensor> {
    let t = handles(tensors);
    let mut out = ptr::null_mut();
    // SAFETY: live handles; `out` receives a new tensor that we wrap and own.
    check(unsafe { abi::sk_foreach_norm(t.as_ptr(), t.len() as i64, ord, &mut out) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}

pub(crate) fn foreach_mul_(tensors: &[Tensor], factor: &Tensor) -> Result<()> {
    let t = handles(tensors);
    // SAFETY: live handles for the call.
    check(unsafe { abi::sk_foreach_mul_scalar_tensor_(t.as_ptr(), t.len() as i64, handle(factor)) })
}

pub(crate) fn to_channels_last_(tensor: &Tensor) -> Result<()> {
    // SAFETY: live handle; the shim keeps the same parameter object.
    check(unsafe { abi::sk_to_channels_last_(handle(tensor)) })
}

pub(crate) fn to_contiguous_(tensor: &Tensor) -> Result<()> {
    // SAFETY: live handle; the shim keeps the same object.
    check(unsafe { abi::sk_to_contiguous_(handle(tensor)) })
}

/// Starts counting GroupNorm calls on channels-last input (process-wide).
pub(crate) fn channels_last_census_start() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { abi::sk_channels_last_census_start() })
}

/// Stops the count and returns it.
pub(crate) fn channels_last_census_stop() -> Result<i64> {
    let mut calls = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_channels_last_census_stop(&mut calls) })?;
    Ok(calls)
}

pub(crate) fn is_channels_last(tensor: &Tensor) -> Result<bool> {
    let mut out = 0;
    // SAFETY: live handle, valid out-pointer.
    check(unsafe { abi::sk_is_channels_last(handle(tensor), &mut out) })?;
    Ok(out != 0)
}
