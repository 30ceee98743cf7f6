//! [`Override::Embedding`](super::Override::Embedding): `aten::embedding` under CUDA autocast
//! (`nn::embedding`, `Tensor::embedding`) on speedkit's embedding, the one behind
//! `speedkit::nn::embedding`.
//!
//! The forward is the same gather. The backward is where they differ: ATen's dense embedding
//! backward zeroes the table's gradient, sorts the tokens as 64-bit keys over all their bits and
//! runs four kernels to segment and add the rows (about 0.24 ms of GPT-2 small's step, 8 × 1024
//! tokens into 50304 rows, on an H200). speedkit's sorts only the bits a token can have and writes
//! every row of the gradient once, a warp per row adding its token's positions in increasing order
//! (deterministic, as ATen's). Autocast leaves `embedding` in the table's type, and so does this.

use super::{DispatchKey, OperatorOverride, OverrideCall, Reply};
use crate::error::Result;
use crate::kernels::KernelOp;

/// The override: ATen's `embedding` under autocast on CUDA.
pub(crate) fn operator_overrides() -> [OperatorOverride; 1] {
    [OperatorOverride::new(
        "aten::embedding",
        DispatchKey::AutocastCuda,
        embedding,
    )]
}

fn embedding(call: &OverrideCall<'_>) -> Result<Reply> {
    let (table, tokens) = (call.tensor("weight")?, call.tensor("indices")?);
    if call.int("padding_idx")? != -1 {
        return Ok(Reply::Declined("a padding index".into()));
    }
    if call.bool("scale_grad_by_freq")? || call.bool("sparse")? {
        return Ok(Reply::Declined(
            "gradients scaled by frequency, or sparse".into(),
        ));
    }
    if !crate::kernels::op_enabled(KernelOp::Embedding) {
        return Ok(Reply::Declined(
            "speedkit's kernels are switched off".into(),
        ));
    }
    if tokens.kind() != tch::Kind::Int64 || table.dim() != 2 {
        return Ok(Reply::Declined(format!(
            "{:?} tokens into a table of {} dimensions (speedkit's takes int64 tokens into [vocab, width])",
            tokens.kind(),
            table.dim()
        )));
    }
    if let Some(why) = crate::nn::embedding_fallback_reason(tokens, table, None) {
        return Ok(Reply::Declined(why));
    }
    Ok(Reply::Ran(vec![crate::nn::embedding(tokens, table, None)?]))
}
