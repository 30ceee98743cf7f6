//! The classifier's loss, softmax cross-entropy, fused into one kernel per direction where
//! speedkit's kernels run, with an ATen fallback that gives the same result anywhere else.

use tch::{Kind, Tensor};

use crate::{ffi, kernels};

const OP: &str = "cross_entropy";

/// The index PyTorch's cross-entropy leaves out by default (`ignore_index = -100`).
pub const IGNORE_INDEX: i64 = -100;

/// The mean softmax cross-entropy of `logits` `[rows, classes]` against `targets` `[rows]` (int64),
/// rows whose target is [`IGNORE_INDEX`] left out: a drop-in for tch's
/// `logits.cross_entropy_for_logits(targets)`, returning an fp32 scalar.
///
/// On a CUDA device of SM ≥ 8.0 with speedkit's kernels on, the forward reads the logits once (an
/// online softmax per row) and writes nothing of their size; the backward reads them once more and
/// writes the gradient in the logits' own type (bf16 under bf16 autocast), never materialising
/// fp32 probabilities. Anywhere else it runs ATen's composite and [`crate::kernels::fallbacks`]
/// says why, once. An out-of-range target makes the kernel's loss NaN (ATen raises instead).
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let logits = Tensor::randn([8, 10], (Kind::Float, Device::Cpu));
/// let targets = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]);
/// let loss = speedkit::nn::cross_entropy(&logits, &targets);
/// assert!(loss.allclose(&logits.cross_entropy_for_logits(&targets), 1e-6, 1e-6, false));
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    match unsupported(logits, targets) {
        None => match ffi::cross_entropy(logits, targets, IGNORE_INDEX) {
            Ok(loss) => {
                kernels::note_run(OP);
                return loss;
            }
            Err(e) => kernels::note_fallback(OP, &format!("the kernel failed ({e})")),
        },
        Some(reason) => kernels::note_fallback(OP, &reason),
    }
    aten(logits, targets)
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
    unsupported(logits, targets)
}

fn aten(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits.cross_entropy_for_logits(targets)
}

fn unsupported(logits: &Tensor, targets: &Tensor) -> Option<String> {
    if let Some(reason) = kernels::unusable_on(logits.device()) {
        return Some(reason);
    }
    if !matches!(logits.kind(), Kind::Float | Kind::BFloat16 | Kind::Half) {
        return Some(format!(
            "logits of type {:?} (the kernel takes fp32, bf16, fp16)",
            logits.kind()
        ));
    }
    let (size, target_size) = (logits.size(), targets.size());
    if size.len() != 2 || target_size.len() != 1 || target_size[0] != size[0] {
        return Some(format!(
            "logits {size:?} and targets {target_size:?} are not [rows, classes] and [rows]"
        ));
    }
    if targets.kind() != Kind::Int64 || targets.device() != logits.device() {
        return Some(format!(
            "targets of type {:?} on {:?}",
            targets.kind(),
            targets.device()
        ));
    }
    if size[0] > i64::from(i32::MAX) || size[1] > i64::from(i32::MAX) || size[1] == 0 {
        return Some(format!("logits shape {size:?}"));
    }
    None
}
