//! A `speedkit::nn::Linear` head followed by `speedkit::nn::cross_entropy`: the loss and the
//! gradients, computed a block of rows at a time, equal ATen's, the logits are never whole, and a
//! read of the logits beside the loss sees the head's values.

use crate::common::{self, cuda_or_skip};
use crate::support::{assert_close, context_for};
use speedkit::memory::MemoryUse;
use speedkit::nn::{cross_entropy, Linear, IGNORE_INDEX};
use speedkit::overrides::Override;
use tch::{nn, Device, Kind, Tensor};

/// Rows as 3 × 2803 of width 96 over a vocabulary of 32003: bf16 logits of 513 MiB, in
/// two blocks of 4224 rows (the last one of 4185).
const SHAPE: [i64; 3] = [3, 2803, 96];
const VOCABULARY: i64 = 32003;
const LOGITS_BYTES: u64 = (SHAPE[0] * SHAPE[1] * VOCABULARY * 2) as u64;

/// A head of `speedkit::nn`, an input of `shape`, and targets with every fifth row ignored.
fn operands(
    device: Device,
    shape: [i64; 3],
    with_bias: bool,
) -> (nn::VarStore, Linear, Tensor, Tensor) {
    let vs = nn::VarStore::new(device);
    let head = Linear::new(&(vs.root() / "head"), SHAPE[2], VOCABULARY, with_bias);
    let x = Tensor::randn(shape, (Kind::Float, device));
    let rows = shape[0] * shape[1];
    let targets = Tensor::randint(VOCABULARY, [rows], (Kind::Int64, device)).index_fill(
        0,
        &Tensor::arange_start_step(0, rows, 5, (Kind::Int64, device)),
        IGNORE_INDEX,
    );
    (vs, head, x, targets)
}

/// The loss (times 3, so that the backward scales by a gradient other than 1) with `also` added
/// from the logits, under bf16 autocast, on speedkit's modules (`speedkit`) or ATen's `linear`
/// and `cross_entropy_for_logits`; the loss, the gradients of x and of the head's parameters, and
/// the most memory the pass held beyond what was allocated before it.
fn pass(
    (_, head, x, targets): &(nn::VarStore, Linear, Tensor, Tensor),
    speedkit: bool,
    also: impl Fn(&Tensor) -> Option<Tensor>,
) -> (Vec<Tensor>, u64) {
    let device = x.device();
    let ctx = context_for(true);
    // ATen's own `linear` and loss: the context's overrides would chunk them too.
    let _linear = common::hold_override(Override::Linear, speedkit);
    let _loss = common::hold_override(Override::CrossEntropy, speedkit);
    let x = x.detach().set_requires_grad(true);
    let mut parameters: Vec<Tensor> = [Some(&head.ws), head.bs.as_ref()]
        .into_iter()
        .flatten()
        .map(Tensor::shallow_clone)
        .collect();
    for p in &mut parameters {
        p.zero_grad();
    }
    tch::Cuda::synchronize(0);
    let before = MemoryUse::now(device).unwrap().allocated;
    speedkit::memory::reset_peaks(device).unwrap();
    let loss = ctx
        .autocast(|| -> speedkit::Result<Tensor> {
            let (logits, loss) = if speedkit {
                let logits = head.forward_t(&x)?.view([-1, VOCABULARY]);
                let loss = cross_entropy(&logits, targets);
                (logits, loss)
            } else {
                let logits = x.linear(&head.ws, head.bs.as_ref()).view([-1, VOCABULARY]);
                let loss = logits.cross_entropy_for_logits(targets);
                (logits, loss)
            };
            Ok(match also(&logits) {
                Some(extra) => (loss + extra) * 3.0,
                None => loss * 3.0,
            })
        })
        .unwrap();
    loss.backward();
    tch::Cuda::synchronize(0);
    let peak = MemoryUse::now(device)
        .unwrap()
        .peak_allocated
        .saturating_sub(before);
    let mut results = vec![loss.detach(), x.grad()];
    results.extend(parameters.iter().map(Tensor::grad));
    (results, peak)
}

fn assert_equal_to_atens(results: &[Tensor], expected: &[Tensor], case: &str) {
    // bf16 logits from GEMMs over fewer rows: cuBLAS may round them differently.
    assert_close(&format!("loss, {case}"), &results[0], &expected[0], 1e-3);
    for (i, (got, want)) in results.iter().zip(expected).enumerate().skip(1) {
        assert_close(&format!("gradient {i}, {case}"), got, want, 1e-2);
    }
}

#[test]
fn a_linear_heads_cross_entropy_equals_atens_without_the_logits_whole() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("a_linear_heads_cross_entropy_equals_atens_without_the_logits_whole")
    else {
        return;
    };
    for with_bias in [false, true] {
        let inputs = operands(device, SHAPE, with_bias);
        let (expected, aten_peak) = pass(&inputs, false, |_| None);
        let (results, peak) = pass(&inputs, true, |_| None);
        assert_equal_to_atens(&results, &expected, &format!("bias {with_bias}"));
        assert!(
            aten_peak > LOGITS_BYTES,
            "ATen's pass held {aten_peak} bytes"
        );
        assert!(
            peak < LOGITS_BYTES,
            "bias {with_bias}: the chunked pass held {peak} bytes, the logits are {LOGITS_BYTES}"
        );
    }
}

#[test]
fn a_read_of_a_linear_heads_logits_beside_its_loss_sees_the_heads_values() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("a_read_of_a_linear_heads_logits_beside_its_loss_sees_the_heads_values")
    else {
        return;
    };
    let also = |logits: &Tensor| Some(logits.square().mean(Kind::Float) * 1e-2);
    // Another shape than the other test's: a shape whose logits were read is not deferred again.
    let inputs = operands(device, [SHAPE[1], SHAPE[0], SHAPE[2]], true);
    let (expected, _) = pass(&inputs, false, also);
    let (results, _) = pass(&inputs, true, also);
    assert_equal_to_atens(&results, &expected, "logits read");
}
