//! [`Override::MseLoss`](super::Override::MseLoss): `aten::mse_loss` on CUDA tensors with its
//! reduced loss in memory of its own size.
//!
//! ATen's structured `mse_loss` allocates its output at the input's shape, computes the reduction
//! into it and resizes it to the reduced shape: the loss keeps the whole storage (the input's size
//! in the input's type) for as long as it lives, which is the whole backward, and in a graphed
//! step as long as the graph. What torch.compile runs, a decomposition, keeps nothing of it. The
//! override runs ATen's kernel (a call of the operator from inside its own override runs the kernel
//! it replaced) and returns a copy of the few bytes of the loss, so the storage is freed before the
//! backward begins.

use super::{DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::error::Result;
use crate::kernels::KernelOp;

/// The override: ATen's `mse_loss` on CUDA tensors.
pub(crate) fn operator_overrides() -> [OperatorOverride; 1] {
    [OperatorOverride::new(
        "aten::mse_loss",
        DispatchKey::Cuda,
        mse_loss,
    )]
}

fn mse_loss(call: &OverrideCall<'_>) -> Result<Reply> {
    let (input, target) = (call.tensor("self")?, call.tensor("target")?);
    let reduction = call.int("reduction")?;
    if !crate::kernels::op_enabled(KernelOp::MseLoss) {
        return Ok(Reply::Declined(
            "speedkit's kernels are switched off".into(),
        ));
    }
    let loss = input.f_mse_loss(target, reduction_of(reduction))?;
    // Without a reduction the loss is the input's size and owns its storage already.
    if loss.dim() == input.dim() {
        return Ok(Reply::Ran(vec![loss]));
    }
    let mut compact = loss.f_empty_like()?;
    compact.f_copy_(&loss)?;
    Ok(Reply::Ran(vec![compact]))
}

/// ATen's reduction code (`at::Reduction`) as tch's.
fn reduction_of(code: i64) -> tch::Reduction {
    match code {
        0 => tch::Reduction::None,
        1 => tch::Reduction::Mean,
        2 => tch::Reduction::Sum,
        other => tch::Reduction::Other(other),
    }
}
