//! A classifier head's `linear` followed by `log_softmax` and `nll_loss`: the loss and the
//! gradients computed a block of rows at a time equal ATen's, the logits are never whole, and a
//! read of the logits beside the loss sees the `linear`'s values.

use crate::common;
use speedkit::memory::MemoryUse;
use speedkit::overrides::Override;
use tch::{Device, Kind, Tensor};

/// A head over 3 × 2803 rows of width 96 and a vocabulary of 32003: bf16 logits of 513 MiB, in
/// two blocks of 4224 rows (the last one of 4185). A vocabulary of an odd size takes the loss
/// kernel's element-by-element path; [`VECTORISED`] classes its 16-byte vectors.
const SHAPE: [i64; 3] = [3, 2803, 96];
const VOCABULARY: i64 = 32003;
const VECTORISED: i64 = 32008;

/// The operands: input of `shape` (rows as [`SHAPE`]'s), weight and bias (where `with_bias`) of
/// a head over `vocabulary` classes, targets with every fifth row ignored.
fn operands(
    device: Device,
    shape: [i64; 3],
    vocabulary: i64,
    with_bias: bool,
) -> (Tensor, Tensor, Option<Tensor>, Tensor) {
    let x = Tensor::randn(shape, (Kind::Float, device));
    let w = Tensor::randn([vocabulary, SHAPE[2]], (Kind::Float, device)) * 0.1;
    let b = with_bias.then(|| Tensor::randn([vocabulary], (Kind::Float, device)) * 0.1);
    let rows = SHAPE[0] * SHAPE[1];
    let targets = Tensor::randint(vocabulary, [rows], (Kind::Int64, device)).index_fill(
        0,
        &Tensor::arange_start_step(0, rows, 5, (Kind::Int64, device)),
        -100,
    );
    (x, w, b, targets)
}

/// The head's loss under CUDA autocast to `kind`, as a tch model writes it (`linear`, a view to
/// rows, `cross_entropy_for_logits`'s two calls), with `also` added to it from the logits; the
/// loss and the gradients of x, the weight and the bias.
fn head_pass(
    (x, w, b, targets): &(Tensor, Tensor, Option<Tensor>, Tensor),
    kind: Kind,
    also: impl Fn(&Tensor) -> Option<Tensor>,
) -> Vec<Tensor> {
    let x = x.detach().set_requires_grad(true);
    let w = w.detach().set_requires_grad(true);
    let b = b.as_ref().map(|b| b.detach().set_requires_grad(true));
    let vocabulary = w.size()[0];
    let loss = speedkit::amp::autocast(x.device(), kind, || {
        let logits = x.linear(&w, b.as_ref()).view([-1, vocabulary]);
        let nll = logits.log_softmax(-1, Kind::Float).g_nll_loss(
            targets,
            None::<&Tensor>,
            tch::Reduction::Mean,
            -100,
        );
        match also(&logits) {
            Some(extra) => nll + extra,
            None => nll,
        }
    })
    .unwrap();
    loss.backward();
    let mut results = vec![loss.detach(), x.grad(), w.grad()];
    results.extend(b.map(|b| b.grad()));
    results
}

/// `head_pass` with the overrides off (ATen under autocast) and on; the largest relative error of
/// each result, and the most memory the pass held on each side beyond what was allocated before.
fn against_aten(
    device: Device,
    (shape, vocabulary, kind): ([i64; 3], i64, Kind),
    with_bias: bool,
    also: impl Fn(&Tensor) -> Option<Tensor> + Copy,
) -> (Vec<f64>, [u64; 2]) {
    let inputs = operands(device, shape, vocabulary, with_bias);
    let peak = |on: bool| {
        let _linear = common::hold_override(Override::Linear, on);
        let _loss = common::hold_override(Override::CrossEntropy, on);
        tch::Cuda::synchronize(0);
        let before = MemoryUse::now(device).unwrap().allocated;
        speedkit::memory::reset_peaks(device).unwrap();
        let results = head_pass(&inputs, kind, also);
        tch::Cuda::synchronize(0);
        let peak = MemoryUse::now(device).unwrap().peak_allocated;
        (results, peak.saturating_sub(before))
    };
    let (expected, aten_peak) = peak(false);
    let (results, peak) = peak(true);
    let errors = results
        .iter()
        .zip(&expected)
        .map(|(r, e)| common::rel_err(r, e))
        .collect();
    (errors, [peak, aten_peak])
}

const LOGITS_BYTES: u64 = (SHAPE[0] * SHAPE[1] * VOCABULARY * 2) as u64;

#[test]
fn a_heads_loss_and_gradients_equal_atens_without_the_logits_whole() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("a_heads_loss_and_gradients_equal_atens_without_the_logits_whole")
    else {
        return;
    };
    for with_bias in [false, true] {
        let case = (SHAPE, VOCABULARY, Kind::BFloat16);
        let (errors, [peak, aten_peak]) = against_aten(device, case, with_bias, |_| None);
        // bf16 logits from GEMMs over fewer rows: cuBLAS may round them differently.
        assert!(errors[0] < 1e-3, "bias {with_bias}: loss {errors:?}");
        assert!(
            errors[1..].iter().all(|&e| e < 1e-2),
            "bias {with_bias}: gradients {errors:?}"
        );
        assert!(
            aten_peak > LOGITS_BYTES,
            "ATen's pass held {aten_peak} bytes"
        );
        assert!(
            peak < LOGITS_BYTES,
            "bias {with_bias}: the chunked pass held {peak} bytes, logits are {LOGITS_BYTES}"
        );
    }
}

#[test]
fn a_heads_loss_and_gradients_equal_atens_in_bf16_and_fp16_over_vocabularies_of_16_byte_vectors() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_heads_loss_and_gradients_equal_atens_in_bf16_and_fp16_over_vocabularies_of_16_byte_vectors",
    ) else {
        return;
    };
    // A row of 120008 bf16 classes (240 KiB) is longer than a block's shared memory can keep.
    let past_shared_memory = ([1, SHAPE[0] * SHAPE[1], SHAPE[2]], 120_008, Kind::BFloat16);
    let cases = [
        (SHAPE, VECTORISED, Kind::BFloat16),
        (SHAPE, VECTORISED, Kind::Half),
        past_shared_memory,
    ];
    for (shape, vocabulary, kind) in cases {
        let (errors, [peak, _]) = against_aten(device, (shape, vocabulary, kind), true, |_| None);
        let case = format!("{kind:?}, {vocabulary} classes");
        assert!(errors[0] < 1e-3, "{case}: loss {errors:?}");
        assert!(
            errors[1..].iter().all(|&e| e < 1e-2),
            "{case}: gradients {errors:?}"
        );
        let logits_bytes = (SHAPE[0] * SHAPE[1] * vocabulary * 2) as u64;
        assert!(
            peak < logits_bytes,
            "{case}: the chunked pass held {peak} bytes, the logits are {logits_bytes}"
        );
    }
}

#[test]
fn a_read_of_a_heads_logits_beside_the_loss_sees_the_linears_values() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("a_read_of_a_heads_logits_beside_the_loss_sees_the_linears_values")
    else {
        return;
    };
    let also = |logits: &Tensor| Some(logits.square().mean(Kind::Float) * 1e-2);
    // Another shape than the other test's: a shape whose logits were read is not deferred again.
    let case = ([SHAPE[1], SHAPE[0], SHAPE[2]], VOCABULARY, Kind::BFloat16);
    let (errors, _) = against_aten(device, case, true, also);
    assert!(errors[0] < 1e-3, "loss {errors:?}");
    assert!(
        errors[1..].iter().all(|&e| e < 1e-2),
        "gradients {errors:?}"
    );
}

/// The head's loss and input gradient where the head's input is written in place between the
/// `linear` and the loss (through a detached alias, which autograd lets pass).
fn written_between_pass(x: &Tensor, w: &Tensor, targets: &Tensor) -> Vec<Tensor> {
    let x = x.detach().set_requires_grad(true);
    let loss = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        let h = &x * 1.0;
        let logits = h.linear(w, None::<&Tensor>).view([-1, VOCABULARY]);
        let _ = h.detach().g_add_scalar_(1.0);
        logits.log_softmax(-1, Kind::Float).g_nll_loss(
            targets,
            None::<&Tensor>,
            tch::Reduction::Mean,
            -100,
        )
    })
    .unwrap();
    loss.backward();
    vec![loss.detach(), x.grad()]
}

#[test]
fn a_write_to_a_heads_input_before_its_loss_leaves_the_loss_atens() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("a_write_to_a_heads_input_before_its_loss_leaves_the_loss_atens")
    else {
        return;
    };
    // Another shape again: this one's logits are read (by the write's materialization).
    let shape = [SHAPE[0] * SHAPE[1], 1, SHAPE[2]];
    let (x, w, _, targets) = operands(device, shape, VOCABULARY, false);
    let expected = {
        let _linear = common::hold_override(Override::Linear, false);
        let _loss = common::hold_override(Override::CrossEntropy, false);
        written_between_pass(&x, &w, &targets)
    };
    let _linear = common::hold_override(Override::Linear, true);
    let _loss = common::hold_override(Override::CrossEntropy, true);
    let results = written_between_pass(&x, &w, &targets);
    let loss_err = common::rel_err(&results[0], &expected[0]);
    assert!(loss_err < 1e-3, "loss: relative error {loss_err}");
    let dx_err = common::rel_err(&results[1], &expected[1]);
    assert!(dx_err < 1e-2, "dx: relative error {dx_err}");
}
