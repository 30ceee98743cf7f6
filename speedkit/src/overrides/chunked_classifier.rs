//! The chunked classifier: a classifier head whose logits only the cross-entropy reads never holds
//! them whole.
//!
//! A language model's last `linear` makes `[rows, vocabulary]` logits (500 MiB in bf16 for 8 × 1024
//! tokens of a 32k vocabulary) that live from the end of the forward to the loss's backward, the
//! step's memory peak. Where [`Override::Linear`](super::Override::Linear) and
//! [`Override::CrossEntropy`](super::Override::CrossEntropy) are both in force, the `linear` of a
//! large output returns its logits deferred ([`crate::deferred`]), tagged as a head's; the
//! `log_softmax` of them returns its log-probabilities deferred too (`super::log_softmax`), and
//! the `nll_loss` of those runs the head's GEMM and the loss together, a block of rows at a time
//! (the shim's chunked classifier, Liger's fused linear cross-entropy): each block's logits are
//! made, turned into their gradient and consumed by the two gradient GEMMs before the next block's
//! exist. The weight's gradient adds up in fp32 over the blocks; the input's and the weight's are
//! computed in the forward for a loss gradient of 1 and scaled in the backward.
//!
//! [`speedkit::nn::Linear`](crate::nn::Linear) does the same for a head whose loss is
//! [`speedkit::nn::cross_entropy`](crate::nn::cross_entropy) ([`HeadReader::SpeedkitCrossEntropy`]).
//!
//! Anything else that reads the logits (or the log-probabilities) gets them written at that read,
//! exactly as the `linear` would have written them, with their own backward; a shape whose logits
//! were read that way runs the plain `linear` from then on, as `log_softmax`'s deferral does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tch::{Kind, Tensor};

use super::log_softmax::Deferrals;
use super::producers::Producers;
use super::Override;
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::function::{apply, BackwardContext, ForwardContext, Function};

/// The least width of a head's output: a vocabulary, not a layer's features.
const LEAST_VOCABULARY: i64 = 4096;

/// The most bytes of one block's logits. Smaller blocks save more memory and cost more time:
/// each block's input-gradient GEMM has fewer output tiles than the GPU has SMs to fill, and each
/// adds its weight gradient to the fp32 sum. Measured on an H200 (`llama_tch`, `gpt2_tch`: 500 and
/// 786 MiB of logits), against the logits whole: 64 MiB blocks saved 0.42 and 0.71 GiB for 5% and
/// 14% more time a step, 256 MiB blocks 0.23 and 0.52 GiB for 0.3% and 2%. `gpt2_tch` in two
/// blocks of 393 MiB rather than four of 197: 0.28 ms less a step (1.6%) for 0.19 GiB more, 4.66
/// GiB against reduce-overhead's 5.50. Two blocks at least hold half the logits at most: the
/// memory a chunked head saves against one that writes them whole never falls below that half.
const BLOCK_BYTES: i64 = 512 << 20;

/// The least bytes of logits a head runs chunked, in two blocks at least: below, the logits are
/// a small part of a step's peak.
const LEAST_BYTES: i64 = 128 << 20;

/// The rows of each block (the last may have fewer) for `rows` rows of logits of `row_bytes`
/// each: as few blocks as [`BLOCK_BYTES`] allows, two at least, of equal rows (a multiple of 64).
fn block_rows(rows: i64, row_bytes: i64) -> i64 {
    let bytes = rows * row_bytes;
    let blocks = ((bytes + BLOCK_BYTES - 1) / BLOCK_BYTES).max(2);
    ((rows + blocks - 1) / blocks + 63) / 64 * 64
}

/// Head tags carry this bit, which keeps them apart from the batch norm fusion's, counted from 1.
const TAG_BIT: u64 = 1 << 62;

/// A head's operands: what its logits are computed from, by the chunked loss or at a read.
pub(crate) struct Head {
    /// The input, the weight and the bias (a `Mutex` only to share tensors, which are not `Sync`).
    operands: Mutex<(Tensor, Tensor, Option<Tensor>)>,
    /// The GEMMs' type: autocast's.
    kind: Kind,
    /// The operands in that type as the logits were written from them, where they were: what
    /// their backward reads, as autocast's `linear` keeps its casts (copies, so that a later
    /// in-place write to an operand does not reach them).
    written_from: Mutex<Option<(Tensor, Tensor)>>,
}

impl Head {
    fn operands(&self) -> (Tensor, Tensor, Option<Tensor>) {
        let operands = self.operands.lock().unwrap_or_else(PoisonError::into_inner);
        (
            operands.0.shallow_clone(),
            operands.1.shallow_clone(),
            operands.2.as_ref().map(Tensor::shallow_clone),
        )
    }

    /// The logits into `y`, as autocast's `linear` computes them: the operands cast to the GEMMs'
    /// type, `x Wᵀ + b`.
    fn write_logits(&self, y: &Tensor) -> Result<()> {
        let (x, weight, bias) = self.operands();
        let _no_grad = tch::no_grad_guard();
        let width = weight.size()[1];
        let x = x
            .f_reshape([-1, width])?
            .f_to_dtype(self.kind, false, true)?;
        let weight = weight.f_to_dtype(self.kind, false, true)?;
        let out = y.f_view([-1, weight.size()[0]])?;
        let _written = match bias {
            Some(b) => b
                .f_to_kind(self.kind)?
                .f_addmm_out(&out, &x, &weight.f_tr()?)?,
            None => x.f_mm_out(&out, &weight.f_tr()?)?,
        };
        *self
            .written_from
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((x, weight));
        Ok(())
    }

    /// The cross-entropy of its logits against `targets` ([rows] int64), the mean over the rows
    /// not ignored or (`mean` false) the sum, computed a block of rows at a time.
    pub(crate) fn loss(&self, targets: &Tensor, ignore_index: i64, mean: bool) -> Result<Tensor> {
        let (x, weight, bias) = self.operands();
        let (vocabulary, width) = (weight.size()[0], weight.size()[1]);
        let rows = x.numel() as i64 / width.max(1);
        let block_rows = block_rows(rows, vocabulary * self.kind.elt_size_in_bytes() as i64);
        ffi::classifier::chunked_cross_entropy(
            &x.f_reshape([-1, width])?,
            &weight,
            bias.as_ref(),
            targets,
            ignore_index,
            mean,
            self.kind,
            block_rows,
        )
    }
}

/// What takes a head's deferred logits to its chunked loss without reading them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadReader {
    /// The `log_softmax` override, for tch's `cross_entropy_for_logits` (`log_softmax`, then the
    /// `nll_loss` that runs the chunked loss).
    LogSoftmaxOverride,
    /// [`crate::nn::cross_entropy`], which recognises the head before any operator reads the
    /// logits.
    SpeedkitCrossEntropy,
}

impl HeadReader {
    /// The operators that may take the pending logits without writing them.
    fn exempt_ops(self) -> &'static [&'static str] {
        match self {
            HeadReader::LogSoftmaxOverride => &["aten::log_softmax"],
            HeadReader::SpeedkitCrossEntropy => &[],
        }
    }

    /// Whether this reader is there to take the logits.
    fn is_ready(self) -> Result<bool> {
        match self {
            HeadReader::LogSoftmaxOverride => Override::CrossEntropy.is_registered(),
            HeadReader::SpeedkitCrossEntropy => Ok(true),
        }
    }
}

/// `x Wᵀ + b` of a head, deferred (see the [module docs](self)), where the logits are large
/// enough, the step trains and `reader` is there to take them; `None` for the plain `linear`.
pub(crate) fn deferred_logits(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    kind: Kind,
    reader: HeadReader,
) -> Result<Option<Tensor>> {
    let vocabulary = weight.size()[0];
    let rows = x.numel() as i64 / weight.size()[1].max(1);
    let bytes = rows * vocabulary * kind.elt_size_in_bytes() as i64;
    let trains =
        (x.requires_grad() || weight.requires_grad()) && ffi::autograd::grad_mode_enabled()?;
    if vocabulary < LEAST_VOCABULARY || bytes < LEAST_BYTES || !trains {
        return Ok(None);
    }
    if !reader.is_ready()? {
        return Ok(None);
    }
    let mut shape = x.size();
    if let Some(last) = shape.last_mut() {
        *last = vocabulary;
    }
    let Some(read) = head_deferrals().next(x.device(), &shape) else {
        return Ok(None);
    };
    let head = Arc::new(Head {
        operands: Mutex::new((
            x.shallow_clone(),
            weight.shallow_clone(),
            bias.map(Tensor::shallow_clone),
        )),
        kind,
        written_from: Mutex::new(None),
    });
    let tag = heads().insert(&head);
    let function = HeadLinear {
        head,
        read,
        shape,
        tag,
        exempt_ops: reader.exempt_ops(),
    };
    let inputs: Vec<&Tensor> = [Some(x), Some(weight), bias]
        .into_iter()
        .flatten()
        .collect();
    match apply(function, &inputs) {
        Ok(mut y) => Ok(Some(y.remove(0))),
        // No operator observer on this thread to see a read by: the plain `linear`.
        Err(_) => Ok(None),
    }
}

/// The head whose pending logits `logits` holds whole (itself, or a view of all of them as
/// `[rows, vocabulary]`), where it is one.
pub(crate) fn head_of(logits: &Tensor) -> Result<Option<Arc<Head>>> {
    let Some(head) = crate::deferred::tag(logits)?.and_then(|tag| heads().find(tag)) else {
        return Ok(None);
    };
    let (x, weight, _) = head.operands();
    let whole = x.numel() / weight.size()[1].max(1) as usize * weight.size()[0] as usize;
    let rows_intact = logits.numel() == whole
        && logits.is_contiguous()
        && logits.size().last() == Some(&weight.size()[0]);
    Ok(rows_intact.then_some(head))
}

/// The autograd node of a head's deferred logits: what a reader other than the chunked loss
/// differentiates through, as autocast's `linear`.
struct HeadLinear {
    head: Arc<Head>,
    /// Set if anything reads the logits.
    read: Arc<AtomicBool>,
    shape: Vec<i64>,
    tag: u64,
    /// The reader's operators that take the logits unwritten.
    exempt_ops: &'static [&'static str],
}

impl Function for HeadLinear {
    /// The backward reads the operands' copies the logits were written from, which carry no
    /// gradient: a second derivative through it is an error.
    fn once_differentiable(&self) -> bool {
        true
    }

    fn forward(&mut self, _: &mut ForwardContext<'_>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let (head, read) = (Arc::clone(&self.head), Arc::clone(&self.read));
        let y = crate::deferred::tagged(
            &self.shape,
            self.head.kind,
            inputs[0].device(),
            self.exempt_ops,
            self.tag,
            move |y| {
                read.store(true, Ordering::Relaxed);
                head.write_logits(y)
            },
        )?;
        crate::deferred::computed_from(&y, &inputs.iter().collect::<Vec<_>>())?;
        Ok(vec![y])
    }

    fn backward(
        &mut self,
        _: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let (x, weight, bias) = self.head.operands();
        let with_bias = bias.is_some();
        let Some(dy) = &grads[0] else {
            return Ok((0..2 + usize::from(with_bias)).map(|_| None).collect());
        };
        // A gradient of the logits means they were read, so written: from these operands.
        let written_from = self.head.written_from.lock();
        let written_from = written_from.unwrap_or_else(PoisonError::into_inner);
        let Some((x_c, w_c)) = written_from.as_ref() else {
            return Err(SpeedkitError::Misuse(
                "a classifier head's logits have a gradient but were never written".into(),
            ));
        };
        let dy = dy
            .f_reshape([-1, weight.size()[0]])?
            .f_to_kind(self.head.kind)?;
        let dx = dy.f_mm(w_c)?.f_reshape(x.size())?.f_to_kind(x.kind())?;
        let dw = dy.f_tr()?.f_mm(x_c)?.f_to_kind(weight.kind())?;
        let mut gradients = vec![Some(dx), Some(dw)];
        if with_bias {
            gradients.push(Some(dy.f_sum_dim_intlist(0, false, Kind::Float)?));
        }
        Ok(gradients)
    }
}

/// The heads whose logits may be pending, by tag (from [`TAG_BIT`]).
fn heads() -> MutexGuard<'static, Producers<Head>> {
    static HEADS: Mutex<Producers<Head>> = Mutex::new(Producers::starting_at(TAG_BIT));
    HEADS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether deferring a head's logits pays, per shape (see `log_softmax`'s [`Deferrals`]).
fn head_deferrals() -> MutexGuard<'static, Deferrals> {
    static DEFERRALS: Mutex<Deferrals> = Mutex::new(Deferrals::new());
    DEFERRALS.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::block_rows;

    const MIB: i64 = 1 << 20;

    #[test]
    fn logits_of_one_block_or_less_run_in_two_blocks() {
        // 16384 rows over 16384 classes in bf16: 512 MiB.
        assert_eq!(block_rows(16384, 16384 * 2), 8192);
        assert_eq!(block_rows(1000, 128 * MIB / 1000), 512);
    }

    #[test]
    fn larger_logits_run_in_as_few_blocks_as_the_block_size_allows_of_equal_rows() {
        // 8192 rows over 128256 classes: 2004 MiB in four blocks of 2048 rows.
        assert_eq!(block_rows(8192, 128256 * 2), 2048);
        // 8192 rows over 50304 classes: 786 MiB in two.
        assert_eq!(block_rows(8192, 50304 * 2), 4096);
        // 12000 rows over 32003 classes: 732 MiB in two, the last shorter.
        assert_eq!(block_rows(12000, 32003 * 2), 6016);
    }
}
