//! The classifier's loss, softmax cross-entropy, fused into one kernel per direction where
//! speedkit's kernels run, with an ATen fallback that gives the same result anywhere else.

use tch::Tensor;

use crate::ffi;
use crate::overrides::chunked_classifier;

/// The index PyTorch's cross-entropy leaves out by default (`ignore_index = -100`).
pub const IGNORE_INDEX: i64 = -100;

/// The mean softmax cross-entropy of `logits` `[rows, classes]` against `targets` `[rows]` (int64),
/// rows whose target is [`IGNORE_INDEX`] left out: a drop-in for tch's
/// `logits.cross_entropy_for_logits(targets)`, returning an fp32 scalar.
///
/// On a CUDA device of SM ≥ 8.0 with speedkit's kernels on, the forward reads the logits once (an
/// online softmax per row) and writes nothing of their size; the backward reads them once more and
/// writes the gradient in the logits' own type (bf16 under bf16 autocast), never materialising
/// fp32 probabilities. Logits straight from a [`Linear`](super::Linear) classifier head's
/// `forward_t` in a training step (128 MiB of them or more, over at least 4096 classes, outside
/// FP8) were never written: the loss runs the head's GEMM and itself a block of rows at a time,
/// the gradients made on the way, so the logits never exist whole. Anywhere else it runs ATen's
/// composite (fp32 log-softmax and NLL, as tch's `cross_entropy_for_logits`), and
/// [`crate::kernels::notes`] say why. An out-of-range target
/// makes the kernel's loss NaN (ATen raises instead). Panics on a libtorch error, as tch does.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let logits = Tensor::randn([8, 10], (Kind::Float, Device::Cpu));
/// let targets = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]);
/// let loss = speedkit::nn::cross_entropy(&logits, &targets);
/// assert!(loss.allclose(&logits.cross_entropy_for_logits(&targets), 1e-6, 1e-6, false));
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    match loss_of(logits, targets) {
        Ok(loss) => loss,
        Err(e) => panic!("speedkit::nn::cross_entropy: {e}"),
    }
}

/// The loss from the head that `logits` are still pending from (a block of rows at a time,
/// never the logits whole), else from the logits.
fn loss_of(logits: &Tensor, targets: &Tensor) -> crate::Result<Tensor> {
    match chunked_classifier::head_of(logits)? {
        Some(head) => head.loss(&targets.f_reshape([-1])?, IGNORE_INDEX, true),
        None => ffi::classifier::cross_entropy(logits, targets, IGNORE_INDEX),
    }
}

/// Why [`cross_entropy`] would run ATen's composite for these inputs, or `None` when it runs
/// speedkit's kernel.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let logits = Tensor::randn([8, 10], (Kind::Float, Device::Cpu));
/// let targets = Tensor::zeros([8], (Kind::Int64, Device::Cpu));
/// assert!(speedkit::nn::cross_entropy_fallback_reason(&logits, &targets).is_some());
/// ```
pub fn cross_entropy_fallback_reason(logits: &Tensor, targets: &Tensor) -> Option<String> {
    ffi::classifier::unsupported(logits, targets).unwrap_or_else(|e| Some(e.to_string()))
}
