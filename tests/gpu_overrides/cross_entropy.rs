//! nll_loss fused after log_softmax: values, gradients, the memory it keeps, reads beside it.

use crate::common;
use speedkit::memory::MemoryUse;
use speedkit::overrides::Override;
use tch::{Kind, Tensor};

/// The loss `nll_loss(log_softmax(x))` under CUDA autocast, as tch's `cross_entropy_for_logits`
/// computes it with `reduction` and `ignore_index`, and the logits' gradient; `also` adds a second
/// use of the log-probabilities to the loss.
fn cross_entropy_pass(
    x: &Tensor,
    target: &Tensor,
    reduction: tch::Reduction,
    also: bool,
) -> (Tensor, Tensor) {
    let x = x.detach().set_requires_grad(true);
    let loss = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        let y = x.log_softmax(-1, Kind::Float);
        let nll = y.g_nll_loss(target, None::<&Tensor>, reduction, -100);
        if also {
            nll + y.exp().square().mean(Kind::Float)
        } else {
            nll
        }
    })
    .unwrap();
    loss.backward();
    (loss.detach(), x.grad())
}

#[test]
fn nll_loss_after_log_softmax_is_fused_and_matches_aten_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("nll_loss_after_log_softmax_is_fused_and_matches_aten_on_odd_shapes")
    else {
        return;
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, classes) in [(7, 50257), (64, 8192), (5, 13), (3, 8)] {
            for reduction in [tch::Reduction::Mean, tch::Reduction::Sum] {
                let x = (Tensor::randn([rows, classes], (Kind::Float, device)) * 4.0).to_kind(kind);
                // Every third row ignored (ATen's default ignore_index).
                let target = Tensor::randint(classes, [rows], (Kind::Int64, device)).index_fill(
                    0,
                    &Tensor::arange_start_step(0, rows, 3, (Kind::Int64, device)),
                    -100,
                );
                let case = format!("{kind:?} {rows}x{classes} {reduction:?}");
                let (loss_aten, dx_aten) = {
                    let _off = common::hold_override(Override::CrossEntropy, false);
                    cross_entropy_pass(&x, &target, reduction, false)
                };
                let _on = common::hold_override(Override::CrossEntropy, true);
                let (loss, dx) = cross_entropy_pass(&x, &target, reduction, false);
                let stats = Override::CrossEntropy.stats("aten::nll_loss").unwrap();
                assert_eq!((stats.ran, stats.declined), (1, 0), "{case}: {stats:?}");
                let loss_err = common::rel_err(&loss, &loss_aten);
                assert!(loss_err < 1e-5, "{case} loss: relative error {loss_err}");
                let dx_err = common::rel_err(&dx, &dx_aten);
                let tolerance = if kind == Kind::Half { 2e-3 } else { 1e-2 };
                assert!(dx_err < tolerance, "{case} dx: relative error {dx_err}");
            }
        }
    }
}

/// `cross_entropy_loss` of `x` (logits in their own type: its `log_softmax` asks for that type)
/// under CUDA autocast, mean over the rows, with every third row ignored; the loss and the logits'
/// gradient.
fn cross_entropy_loss_pass(x: &Tensor, target: &Tensor) -> (Tensor, Tensor) {
    let x = x.detach().set_requires_grad(true);
    let loss = speedkit::amp::autocast(x.device(), Kind::BFloat16, || {
        x.cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Mean, -100, 0.0)
    })
    .unwrap();
    loss.backward();
    (loss.detach(), x.grad())
}

#[test]
fn cross_entropy_loss_of_half_logits_is_fused_and_at_least_as_exact_as_atens() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "cross_entropy_loss_of_half_logits_is_fused_and_at_least_as_exact_as_atens",
    ) else {
        return;
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, classes) in [(7, 50257), (64, 8192), (5, 13), (3, 8)] {
            let x = (Tensor::randn([rows, classes], (Kind::Float, device)) * 4.0).to_kind(kind);
            let target = Tensor::randint(classes, [rows], (Kind::Int64, device)).index_fill(
                0,
                &Tensor::arange_start_step(0, rows, 3, (Kind::Int64, device)),
                -100,
            );
            let case = format!("{kind:?} {rows}x{classes}");
            // The same logits in fp32 throughout: what both are measured against.
            let (loss_exact, dx_exact) = cross_entropy_loss_pass(&x.to_kind(Kind::Float), &target);
            let (loss_aten, dx_aten) = {
                let _off = common::hold_override(Override::CrossEntropy, false);
                cross_entropy_loss_pass(&x, &target)
            };
            let _on = common::hold_override(Override::CrossEntropy, true);
            let (loss, dx) = cross_entropy_loss_pass(&x, &target);
            for op in ["aten::log_softmax.int", "aten::nll_loss"] {
                let stats = Override::CrossEntropy.stats(op).unwrap();
                assert_eq!(
                    (stats.ran, stats.declined),
                    (1, 0),
                    "{case} {op}: {stats:?}"
                );
            }
            assert_eq!((loss.kind(), dx.kind()), (Kind::Float, kind), "{case}");
            // ATen rounds the log-probabilities to the logits' type before the loss and its
            // gradient read them; the fused loss reads the logits and an fp32 log-sum-exp.
            let (loss_err, aten_loss_err) = (
                common::rel_err(&loss, &loss_exact),
                common::rel_err(&loss_aten, &loss_exact),
            );
            assert!(
                loss_err <= aten_loss_err + 1e-6,
                "{case} loss: relative error {loss_err}, ATen's {aten_loss_err}"
            );
            let (dx_err, aten_dx_err) = (
                common::rel_err(&dx, &dx_exact),
                common::rel_err(&dx_aten, &dx_exact),
            );
            let rounding = if kind == Kind::Half { 1e-3 } else { 8e-3 };
            assert!(
                dx_err <= aten_dx_err.max(rounding),
                "{case} dx: relative error {dx_err}, ATen's {aten_dx_err}"
            );
        }
    }
}

/// Rows and classes of the logits the memory tests below take (bf16: 32 MiB).
const MEMORY_TEST_LOGITS: (i64, i64) = (512, 32768);

/// How far the forward of `loss` over random bf16 logits of [`MEMORY_TEST_LOGITS`] (and random
/// targets) rose above what was allocated before it, under CUDA autocast with speedkit's
/// cross-entropy; its backward then runs and must leave a bf16 gradient.
fn loss_forward_peak(device: tch::Device, loss: impl Fn(&Tensor, &Tensor) -> Tensor) -> u64 {
    let _on = common::hold_override(Override::CrossEntropy, true);
    let (rows, classes) = MEMORY_TEST_LOGITS;
    let x = Tensor::randn([rows, classes], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let base = MemoryUse::now(device).unwrap().allocated;
    speedkit::memory::reset_peaks(device).unwrap();
    let value = speedkit::amp::autocast(device, Kind::BFloat16, || loss(&x, &target)).unwrap();
    let peak = MemoryUse::now(device).unwrap().peak_allocated - base;
    assert_eq!(speedkit::deferred::pending().unwrap().0, 0);
    value.backward();
    assert_eq!(x.grad().kind(), Kind::BFloat16);
    peak
}

#[test]
fn cross_entropy_loss_keeps_no_log_probabilities_and_no_fp32_copy_of_them() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "cross_entropy_loss_keeps_no_log_probabilities_and_no_fp32_copy_of_them",
    ) else {
        return;
    };
    let peak = loss_forward_peak(device, |x, target| {
        x.cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Mean, -100, 0.0)
    });
    // ATen's path holds the bf16 log-probabilities (32 MiB here) and autocast's fp32 copy of them
    // (64 MiB) at once; the fused loss neither.
    let (rows, classes) = MEMORY_TEST_LOGITS;
    let log_probs = (rows * classes * 2) as u64;
    assert!(
        peak < log_probs / 8,
        "the forward peaked {peak} bytes above its inputs (the log-probabilities are {log_probs})"
    );
}

#[test]
fn log_probabilities_used_beside_the_nll_get_both_gradients() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("log_probabilities_used_beside_the_nll_get_both_gradients")
    else {
        return;
    };
    let x = Tensor::randn([9, 1000], (Kind::BFloat16, device));
    let target = Tensor::randint(1000, [9], (Kind::Int64, device));
    let (loss_aten, dx_aten) = {
        let _off = common::hold_override(Override::CrossEntropy, false);
        cross_entropy_pass(&x, &target, tch::Reduction::Mean, true)
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    let (loss, dx) = cross_entropy_pass(&x, &target, tch::Reduction::Mean, true);
    assert_eq!(
        Override::CrossEntropy.stats("aten::nll_loss").unwrap().ran,
        1
    );
    assert!(common::rel_err(&loss, &loss_aten) < 1e-5);
    let dx_err = common::rel_err(&dx, &dx_aten);
    assert!(dx_err < 1e-2, "dx: relative error {dx_err}");
}

#[test]
fn nll_loss_of_other_log_probabilities_runs_autocasts_path() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("nll_loss_of_other_log_probabilities_runs_autocasts_path")
    else {
        return;
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    let x = Tensor::randn([4, 6, 10], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(10, [24], (Kind::Int64, device));
    let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
        // A view of speedkit's log-probabilities is not theirs: its node is the view's.
        x.log_softmax(-1, Kind::Float)
            .view([24, 10])
            .nll_loss(&target)
    })
    .unwrap();
    loss.backward();
    let stats = Override::CrossEntropy.stats("aten::nll_loss").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    let expected = {
        let x = x.detach().to_kind(Kind::Float).set_requires_grad(true);
        x.log_softmax(-1, Kind::Float)
            .view([24, 10])
            .nll_loss(&target)
            .backward();
        x.grad()
    };
    assert!(common::rel_err(&x.grad(), &expected) < 1e-2);
}

#[test]
fn the_fused_cross_entropy_keeps_no_fp32_log_probabilities_for_the_backward() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "the_fused_cross_entropy_keeps_no_fp32_log_probabilities_for_the_backward",
    ) else {
        return;
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    let (rows, classes) = (512, 32768);
    let x = Tensor::randn([rows, classes], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let allocated = || MemoryUse::now(device).unwrap().allocated;
    let before = allocated();
    let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
        x.cross_entropy_for_logits(&target)
    })
    .unwrap();
    let held = allocated() - before;
    assert_eq!(
        Override::CrossEntropy.stats("aten::nll_loss").unwrap().ran,
        1
    );
    // The log-probabilities alone would be rows × classes × 4 bytes (64 MiB); what the loss keeps
    // is per row (log-sum-exp, targets' count) and the loss itself.
    let log_probs = (rows * classes * 4) as u64;
    assert!(
        held < log_probs / 16,
        "the loss holds {held} bytes (the fp32 log-probabilities are {log_probs})"
    );
    loss.backward();
    assert_eq!(x.grad().kind(), Kind::BFloat16);
}

#[test]
fn the_fused_cross_entropy_never_writes_the_fp32_log_probabilities() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("the_fused_cross_entropy_never_writes_the_fp32_log_probabilities")
    else {
        return;
    };
    let peak = loss_forward_peak(device, |x, target| x.cross_entropy_for_logits(target));
    // Deferred, never read but by the fused loss: the 64 MiB of log-probabilities never existed.
    let (rows, classes) = MEMORY_TEST_LOGITS;
    let log_probs = (rows * classes * 4) as u64;
    assert!(
        peak < log_probs / 16,
        "the forward peaked {peak} bytes above its inputs (the log-probabilities are {log_probs})"
    );
}

/// A classifier's loss over `h` [rows, d] and `w` [classes, d] under CUDA autocast (logits
/// `h.linear(w)`, viewed as [rows, classes] as a model's `[B, T, classes]` would be), its
/// gradients, and how far the backward's peak rose above what was allocated when it began;
/// `hold_logits` keeps the user's handle on the logits through the backward.
fn classifier_backward(
    h: &Tensor,
    w: &Tensor,
    target: &Tensor,
    hold_logits: bool,
) -> (Tensor, Tensor, u64) {
    let (h, w) = (
        h.detach().set_requires_grad(true),
        w.detach().set_requires_grad(true),
    );
    let device = h.device();
    let (loss, logits) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        let logits = h.linear(&w, None::<&Tensor>).view([1, -1, w.size()[0]]);
        (
            logits
                .view([-1, w.size()[0]])
                .cross_entropy_for_logits(target),
            logits,
        )
    })
    .unwrap();
    let logits = hold_logits.then_some(logits);
    let base = MemoryUse::now(device).unwrap().allocated;
    speedkit::memory::reset_peaks(device).unwrap();
    loss.backward();
    let rise = MemoryUse::now(device).unwrap().peak_allocated - base;
    drop(logits);
    (h.grad(), w.grad(), rise)
}

#[test]
fn the_logits_gradient_takes_the_logits_memory_once_nothing_else_holds_them() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "the_logits_gradient_takes_the_logits_memory_once_nothing_else_holds_them",
    ) else {
        return;
    };
    let _log_softmax = common::hold_override(Override::CrossEntropy, true);
    // 64 MiB of bf16 logits: below the chunked classifier's least (a head that defers its
    // logits never makes them whole, with or without a handle on them).
    let (rows, d, classes) = (1024, 32, 32771);
    let h = Tensor::randn([rows, d], (Kind::Float, device));
    let w = Tensor::randn([classes, d], (Kind::Float, device)) * 0.1;
    let target = Tensor::randint(classes, [rows], (Kind::Int64, device));
    let logits = (rows * classes * 2) as u64;
    // Through ATen's linear (autocast's casts) and speedkit's (tch's `nn::linear` on the override).
    for linear_override in [false, true] {
        let _linear = common::hold_override(Override::Linear, linear_override);
        let (dh_held, dw_held, rise_held) = classifier_backward(&h, &w, &target, true);
        let (dh, dw, rise) = classifier_backward(&h, &w, &target, false);
        // The same kernel writes the same values, wherever it writes them.
        assert_eq!(common::rel_err(&dh, &dh_held), 0.0);
        assert_eq!(common::rel_err(&dw, &dw_held), 0.0);
        assert!(
            rise_held >= logits,
            "with the logits held, the gradient is a tensor of its own: {rise_held} bytes"
        );
        assert!(
            rise < logits / 2,
            "linear override {linear_override}: the backward rose {rise} bytes above its start (the \
             bf16 logits are {logits})"
        );
    }
}

#[test]
fn log_probabilities_read_before_the_fused_loss_are_atens_at_that_read() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("log_probabilities_read_before_the_fused_loss_are_atens_at_that_read")
    else {
        return;
    };
    let x = Tensor::randn([37, 5003], (Kind::BFloat16, device)) * 3.0;
    let target = Tensor::randint(5003, [37], (Kind::Int64, device));
    let run = || {
        let x = x.detach().set_requires_grad(true);
        let (y, first_row, loss) = speedkit::amp::autocast(device, Kind::BFloat16, || {
            let y = x.log_softmax(-1, Kind::Float);
            // A view read before the loss: written at this read, whole.
            let first_row = y.narrow(0, 0, 1).copy();
            let loss = y.nll_loss(&target);
            (y, first_row, loss)
        })
        .unwrap();
        loss.backward();
        (y.detach(), first_row, loss.detach(), x.grad())
    };
    let aten = {
        let _off = common::hold_override(Override::CrossEntropy, false);
        run()
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    let ours = run();
    assert_eq!(
        Override::CrossEntropy.stats("aten::nll_loss").unwrap().ran,
        1
    );
    assert!(!speedkit::deferred::is_pending(&ours.0).unwrap());
    assert!(
        common::rel_err(&ours.0, &aten.0) < 1e-5,
        "log-probabilities"
    );
    assert!(
        common::rel_err(&ours.1, &aten.1) < 1e-5,
        "the row read first"
    );
    assert!(common::rel_err(&ours.2, &aten.2) < 1e-5, "loss");
    assert!(common::rel_err(&ours.3, &aten.3) < 1e-2, "logits' gradient");
}

#[test]
fn log_probabilities_read_beside_the_loss_every_step_are_written_in_one_pass_after_the_first() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "log_probabilities_read_beside_the_loss_every_step_are_written_in_one_pass_after_the_first",
    ) else {
        return;
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    // A shape no other test uses: the choice is remembered per shape.
    let x = Tensor::randn([23, 4099], (Kind::BFloat16, device)).set_requires_grad(true);
    let target = Tensor::randint(4099, [23], (Kind::Int64, device));
    let mut deferred = Vec::new();
    for _ in 0..3 {
        let loss = speedkit::amp::autocast(device, Kind::BFloat16, || {
            let y = x.log_softmax(-1, Kind::Float);
            deferred.push(speedkit::deferred::is_pending(&y).unwrap());
            // Label smoothing: the log-probabilities are read beside the loss.
            y.nll_loss(&target) - y.mean(Kind::Float) * 0.1
        })
        .unwrap();
        loss.backward();
    }
    assert_eq!(deferred, [true, false, false]);
}

#[test]
fn under_the_fusion_the_log_probabilities_own_gradient_is_undefined_and_the_logits_exact() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "under_the_fusion_the_log_probabilities_own_gradient_is_undefined_and_the_logits_exact",
    ) else {
        return;
    };
    let x = Tensor::randn([9, 1000], (Kind::BFloat16, device));
    let target = Tensor::randint(1000, [9], (Kind::Int64, device));
    let (_, dx_aten) = {
        let _off = common::hold_override(Override::CrossEntropy, false);
        cross_entropy_pass(&x, &target, tch::Reduction::Mean, false)
    };
    let _on = common::hold_override(Override::CrossEntropy, true);
    let x = x.set_requires_grad(true);
    let (loss, y) = speedkit::amp::autocast(device, Kind::BFloat16, || {
        let y = x.log_softmax(-1, Kind::Float);
        (y.nll_loss(&target), y)
    })
    .unwrap();
    let grads = Tensor::run_backward(&[&loss], &[&y, &x], false, false);
    assert!(
        !grads[0].defined(),
        "the loss reaches the logits, not the log-probabilities, in autograd's graph"
    );
    let dx_err = common::rel_err(&grads[1], &dx_aten);
    assert!(dx_err < 1e-2, "dx: relative error {dx_err}");
}
