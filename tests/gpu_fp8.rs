//! FP8 `speedkit::nn::Linear` on a GPU with FP8 Tensor Cores (SM >= 8.9), against the same layer in
//! bf16. Skipped, with the reason printed, elsewhere.
//!
//! Tolerances: e4m3 keeps 3 mantissa bits (relative rounding up to 1/16) and e5m2 2 bits (1/8); a
//! GEMM over K products averages much of that out, so outputs land within a few percent of bf16's.
//! Stated per test below.

mod common;

use speedkit::nn::Linear;
use speedkit::{SpeedConfig, SpeedContext};
use tch::{nn, Device, Kind, Tensor};

fn fp8_context(test: &str, recipe: &str) -> Option<SpeedContext> {
    fp8_context_with(test, &format!("recipe: {recipe}, amax_history: 4"))
}

/// A context with FP8 on and the `fp8` section's other `fields` (YAML flow mapping entries).
fn fp8_context_with(test: &str, fields: &str) -> Option<SpeedContext> {
    let device = common::cuda_or_skip(test)?;
    let config =
        SpeedConfig::from_yaml_str(&format!("device: cuda\nfp8: {{enabled: true, {fields}}}\n"))
            .unwrap();
    match SpeedContext::new(&config) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            eprintln!("skipped {test} on {device:?}: {e}");
            None
        }
    }
}

/// (output, dX, dW, db) of `layer` on `x` inside `ctx`'s forward scope.
fn run(ctx: &SpeedContext, layer: &Linear, x: &Tensor, dy: &Tensor) -> [Tensor; 4] {
    for p in [&layer.ws, layer.bs.as_ref().unwrap()] {
        p.grad().defined().then(|| p.grad().zero_());
    }
    let x = x.detach().set_requires_grad(true);
    let y = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    (&y * dy).sum(Kind::Float).backward();
    [
        y.detach().to_kind(Kind::Float),
        x.grad().to_kind(Kind::Float),
        layer.ws.grad().copy(),
        layer.bs.as_ref().unwrap().grad().copy(),
    ]
}

fn bf16_context() -> SpeedContext {
    SpeedContext::new(&SpeedConfig::from_yaml_str("device: cuda\nfp8: {enabled: false}\n").unwrap())
        .unwrap()
}

#[test]
fn fp8_linear_matches_bf16_forward_and_backward() {
    assert_fp8_linear_matches_bf16("fp8_linear_matches_bf16_forward_and_backward", "dynamic");
}

#[test]
fn rowwise_fp8_linear_matches_bf16_forward_and_backward() {
    assert_fp8_linear_matches_bf16("rowwise_fp8_linear_matches_bf16", "rowwise");
}

fn assert_fp8_linear_matches_bf16(test: &str, recipe: &str) {
    let _lock = common::serial();
    let Some(ctx) = fp8_context(test, recipe) else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 768, 1040, true);
    let x = Tensor::randn([4, 96, 768], (Kind::BFloat16, Device::Cuda(0)));
    let dy = Tensor::randn([4, 96, 1040], (Kind::BFloat16, Device::Cuda(0)));
    let fp8 = run(&ctx, &layer, &x, &dy);
    drop(ctx);
    let bf16 = run(&bf16_context(), &layer, &x, &dy);
    // Forward and dX within 8%, dW within 10% (e5m2 gradients), db exact up to bf16 summation.
    for (what, a, b, tol) in [
        ("y", &fp8[0], &bf16[0], 0.08),
        ("dX", &fp8[1], &bf16[1], 0.10),
        ("dW", &fp8[2], &bf16[2], 0.10),
        ("db", &fp8[3], &bf16[3], 0.01),
    ] {
        let err = common::rel_err(a, b);
        assert!(err < tol, "{what}: relative error {err:.4} >= {tol}");
        assert!(
            err > 0.0 || what == "db",
            "{what}: identical to bf16, so FP8 did not run"
        );
    }
}

#[test]
fn rowwise_scaling_keeps_an_outlier_tokens_cost_in_its_own_row() {
    let _lock = common::serial();
    let test = "rowwise_scaling_keeps_an_outlier_tokens_cost_in_its_own_row";
    let (Some(rowwise), Some(dynamic)) =
        (fp8_context(test, "rowwise"), fp8_context(test, "dynamic"))
    else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 512, 256, true);
    let x = Tensor::randn([64, 512], (Kind::BFloat16, Device::Cuda(0)));
    let mut outlier = x.get(7);
    let _ = outlier.g_mul_scalar_(3e4);
    let dy = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0)));
    let bf16 = run(&bf16_context(), &layer, &x, &dy);
    let others = |y: &Tensor| Tensor::cat(&[y.narrow(0, 0, 7), y.narrow(0, 8, 56)], 0);
    let error_of = |ctx: &SpeedContext| {
        let [y, dx, dw, db] = run(ctx, &layer, &x, &dy);
        for t in [&y, &dx, &dw, &db] {
            assert!(t.isfinite().all().int64_value(&[]) == 1, "not finite");
        }
        common::rel_err(&others(&y), &others(&bf16[0]))
    };
    let (rowwise_err, tensor_err) = (error_of(&rowwise), error_of(&dynamic));
    // Row-wise: the other 63 tokens keep e4m3's usual few percent. Per tensor, the outlier's scale
    // pushes them into e4m3's subnormals.
    assert!(rowwise_err < 0.08, "row-wise: {rowwise_err:.4}");
    assert!(
        tensor_err > 2.0 * rowwise_err,
        "per tensor {tensor_err:.4} vs row-wise {rowwise_err:.4}"
    );
}

#[test]
fn e4m3_gradients_halve_the_input_gradients_rounding() {
    let _lock = common::serial();
    let test = "e4m3_gradients_halve_the_input_gradients_rounding";
    let (Some(e5m2), Some(e4m3)) = (
        fp8_context_with(test, "recipe: rowwise, gradient_format: e5m2"),
        fp8_context_with(test, "recipe: rowwise, gradient_format: e4m3"),
    ) else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 768, 1040, true);
    let x = Tensor::randn([384, 768], (Kind::BFloat16, Device::Cuda(0)));
    let dy = Tensor::randn([384, 1040], (Kind::BFloat16, Device::Cuda(0)));
    let bf16 = run(&bf16_context(), &layer, &x, &dy);
    let dx_error = |ctx: &SpeedContext| common::rel_err(&run(ctx, &layer, &x, &dy)[1], &bf16[1]);
    let (wide, precise) = (dx_error(&e5m2), dx_error(&e4m3));
    // A third mantissa bit halves the gradient's rounding; W's e4m3 rounding is in both.
    assert!(
        precise < 0.75 * wide,
        "dX error: e4m3 {precise:.4}, e5m2 {wide:.4}"
    );
}

#[test]
fn a_huge_activation_saturates_instead_of_producing_nan_under_delayed_scaling() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("a_huge_activation_saturates", "delayed") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 256, 256, true);
    let dy = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0)));
    for scale in [1.0, 1.0, 1.0, 1e4] {
        let x = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0))) * scale;
        let [y, dx, dw, db] = run(&ctx, &layer, &x, &dy);
        for (what, t) in [("y", y), ("dX", dx), ("dW", dw), ("db", db)] {
            let finite = t.isfinite().all().int64_value(&[]) == 1;
            assert!(
                finite,
                "{what} not finite with an activation {scale}× the history"
            );
        }
    }
}

#[test]
fn the_amax_history_is_saved_and_loaded_with_the_checkpoint() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("the_amax_history_is_saved_and_loaded", "delayed") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let layer = Linear::new(&(vs.root() / "fc"), 128, 128, true);
    let x = Tensor::randn([32, 128], (Kind::BFloat16, Device::Cuda(0)));
    let dy = Tensor::randn([32, 128], (Kind::BFloat16, Device::Cuda(0)));
    let _ = run(&ctx, &layer, &x, &dy);
    let history = vs.variables()["fc.fp8_amax_history"].copy();
    assert!(
        history.abs().sum(Kind::Float).double_value(&[]) > 0.0,
        "history recorded"
    );
    let file =
        std::env::temp_dir().join(format!("speedkit-fp8-{}.safetensors", std::process::id()));
    vs.save(&file).unwrap();
    let mut restored = nn::VarStore::new(Device::Cuda(0));
    let _twin = Linear::new(&(restored.root() / "fc"), 128, 128, true);
    restored.load(&file).unwrap();
    std::fs::remove_file(&file).ok();
    assert!(restored.variables()["fc.fp8_amax_history"].equal(&history));
}

#[test]
fn the_audit_says_which_layers_ran_in_fp8_and_why_not() {
    let _lock = common::serial();
    let Some(ctx) = fp8_context("the_audit_says_which_layers_ran_in_fp8", "dynamic") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let wide = Linear::new(&(vs.root() / "wide"), 256, 512, true);
    let odd = Linear::new(&(vs.root() / "odd"), 512, 1000, true);
    let x = Tensor::randn([64, 256], (Kind::BFloat16, Device::Cuda(0)));
    let y = ctx
        .autocast(|| odd.forward_t(&wide.forward_t(&x)?))
        .unwrap();
    assert_eq!(y.size(), [64, 1000]);
    let notes = ctx.audit().notes;
    assert!(
        notes.iter().any(|n| n.contains("layer wide runs in FP8")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("layer odd stays") && n.contains("multiple of 16")),
        "{notes:?}"
    );
}

// ----- the fused cast (kernels/fp8_cast.cuh) against ATen's composite --------------------------

use speedkit::nn::{quantize_fp8, quantize_fp8_rowwise, Fp8Format, Fp8Tensor};

/// A `[rows, cols]` matrix of `kind` spanning many binades (so FP8's subnormals and saturation are
/// both hit), at an address that is 16-byte aligned or, with `misaligned`, not.
fn wide_range_matrix(rows: i64, cols: i64, kind: Kind, misaligned: bool) -> Tensor {
    let n = rows * cols;
    let opts = (Kind::Float, Device::Cuda(0));
    // Within fp16's range: an infinity would make the scale 0 and the bytes NaN.
    let values = (Tensor::randn([n + 1], opts) * (Tensor::randn([n + 1], opts) * 2.0).exp())
        .clamp(-6e4, 6e4);
    let start = i64::from(misaligned);
    values.to_kind(kind).narrow(0, start, n).view([rows, cols])
}

/// Full tiles, edge tiles, shapes that are not multiples of 8 or 16, a single element.
const CAST_SHAPES: [(i64, i64); 7] = [
    (256, 512),
    (192, 64),
    (100, 70),
    (130, 24),
    (17, 33),
    (1, 1),
    (64, 1000),
];

/// Calls `check(t, format, description)` for every input the bit-for-bit cast tests take: each
/// storage type and FP8 format, each shape of [`CAST_SHAPES`] and `extra_shapes`, at an aligned and
/// a misaligned address.
fn for_each_cast_input(
    extra_shapes: &[(i64, i64)],
    mut check: impl FnMut(&Tensor, Fp8Format, &str),
) {
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
            for &(rows, cols) in CAST_SHAPES.iter().chain(extra_shapes) {
                for misaligned in [false, true] {
                    let t = wide_range_matrix(rows, cols, kind, misaligned);
                    check(
                        &t,
                        format,
                        &format!("{kind:?} {format:?} {rows}×{cols} misaligned {misaligned}"),
                    );
                }
            }
        }
    }
}

/// The cast with the kernels on or off (ATen's composite); the history is a copy, returned.
fn cast_with(
    kernels_on: bool,
    t: &Tensor,
    format: Fp8Format,
    history: Option<&Tensor>,
) -> (Fp8Tensor, Option<Tensor>) {
    let history = history.map(|h| h.copy());
    let before = speedkit::kernels::set_enabled(kernels_on);
    let q = quantize_fp8(t, format, history.as_ref(), true);
    speedkit::kernels::set_enabled(before);
    (q.unwrap(), history)
}

/// No FP8 cast took ATen's path for a reason other than the tests switching the kernels off.
fn assert_no_cast_fallback() {
    let notes = speedkit::kernels::fallbacks();
    let fallbacks: Vec<_> = notes
        .iter()
        .filter(|n| n.starts_with("fp8 cast") && !n.contains("kernels are off"))
        .collect();
    assert!(fallbacks.is_empty(), "{fallbacks:?}");
}

fn bytes(t: &Tensor) -> Tensor {
    t.view_dtype(Kind::Uint8)
}

fn assert_casts_equal(what: &str, t: &Tensor, format: Fp8Format, history: Option<&Tensor>) {
    let (fused, fused_history) = cast_with(true, t, format, history);
    let (aten, aten_history) = cast_with(false, t, format, history);
    let fused_t = fused.transpose.as_ref().expect("a transpose was asked for");
    assert_eq!(fused.data.kind(), format.kind(), "{what}");
    assert!(
        bytes(&fused.data).equal(&bytes(&aten.data)),
        "{what}: FP8 bytes differ"
    );
    assert!(
        bytes(fused_t).equal(&bytes(aten.transpose.as_ref().unwrap())),
        "{what}: transposes differ"
    );
    assert!(
        bytes(fused_t).equal(&bytes(&fused.data).tr().contiguous()),
        "{what}: the transpose is not the data's"
    );
    assert!(
        fused.inverse_scale.equal(&aten.inverse_scale),
        "{what}: inverse scale {} vs {}",
        fused.inverse_scale.double_value(&[]),
        aten.inverse_scale.double_value(&[])
    );
    if let (Some(f), Some(a)) = (fused_history, aten_history) {
        assert!(f.equal(&a), "{what}: history {f} vs {a}");
        let amax = t.to_kind(Kind::Float).abs().max();
        assert!(
            f.get(0).equal(&amax),
            "{what}: the recorded amax is not max |t|"
        );
    }
}

#[test]
fn the_fused_fp8_cast_equals_the_aten_composite_bit_for_bit() {
    let _lock = common::serial();
    let Some(device) = common::cuda_or_skip("the_fused_fp8_cast_equals_the_aten_composite") else {
        return;
    };
    if let Some(why) = speedkit::kernels::unavailable_reason(device).unwrap() {
        eprintln!("skipped the_fused_fp8_cast_equals_the_aten_composite: {why}");
        return;
    }
    tch::manual_seed(13);
    let opts = (Kind::Float, device);
    // Empty, a history from earlier steps smaller than this tensor's amax (so values saturate),
    // and one larger.
    let histories = [
        None,
        Some(Tensor::zeros([4], opts)),
        Some(Tensor::from_slice(&[0.5f32, 2.0, 0.0]).to_device(device)),
        Some(Tensor::full([16], 1e6, opts)),
    ];
    for_each_cast_input(&[], |t, format, what| {
        for history in &histories {
            let what = format!(
                "{what} history {}",
                history.as_ref().map_or(0, |h| h.numel())
            );
            assert_casts_equal(&what, t, format, history.as_ref());
        }
    });
    assert_no_cast_fallback();
}

#[test]
fn the_fused_fp8_cast_of_an_empty_matrix_records_a_zero_amax() {
    let _lock = common::serial();
    let Some(device) = common::cuda_or_skip("the_fused_fp8_cast_of_an_empty_matrix") else {
        return;
    };
    if speedkit::kernels::unavailable_reason(device)
        .unwrap()
        .is_some()
    {
        return;
    }
    for (rows, cols) in [(0, 32), (48, 0), (0, 0)] {
        let t = Tensor::zeros([rows, cols], (Kind::BFloat16, device));
        let history = Tensor::from_slice(&[3.0f32, 1.0]).to_device(device);
        let q = quantize_fp8(&t, Fp8Format::E4m3, Some(&history), true).unwrap();
        assert_eq!(q.data.size(), [rows, cols]);
        assert_eq!(q.transpose.unwrap().size(), [cols, rows]);
        // Scaled from the history's 3.0; the newest entry is this step's amax, 0.
        let inverse = q.inverse_scale.double_value(&[]);
        assert!((inverse - 3.0 / 448.0).abs() < 1e-6, "{inverse}");
        assert_eq!(
            Vec::<f32>::try_from(&history.to_device(Device::Cpu)).unwrap(),
            [0.0, 3.0]
        );
    }
}

/// The row-wise cast with the kernels on or off (ATen's composite).
fn rowwise_cast_with(kernels_on: bool, t: &Tensor, format: Fp8Format) -> Fp8Tensor {
    let before = speedkit::kernels::set_enabled(kernels_on);
    let q = quantize_fp8_rowwise(t, format, true);
    speedkit::kernels::set_enabled(before);
    q.unwrap()
}

#[test]
fn the_fused_rowwise_fp8_cast_equals_the_aten_composite_bit_for_bit() {
    let _lock = common::serial();
    let test = "the_fused_rowwise_fp8_cast_equals_the_aten_composite";
    let Some(device) = common::cuda_or_skip(test) else {
        return;
    };
    if let Some(why) = speedkit::kernels::unavailable_reason(device).unwrap() {
        eprintln!("skipped {test}: {why}");
        return;
    }
    tch::manual_seed(14);
    for_each_cast_input(&[(0, 32), (48, 0)], |t, format, what| {
        let (rows, cols) = (t.size()[0], t.size()[1]);
        let fused = rowwise_cast_with(true, t, format);
        let aten = rowwise_cast_with(false, t, format);
        let (fused_t, aten_t) = (fused.transpose.unwrap(), aten.transpose.unwrap());
        assert!(
            bytes(&fused.data).equal(&bytes(&aten.data)),
            "{what}: bytes"
        );
        assert!(bytes(&fused_t).equal(&bytes(&aten_t)), "{what}: transposes");
        assert!(
            fused.inverse_scale.equal(&aten.inverse_scale),
            "{what}: row scales"
        );
        let fused_columns = fused.transpose_inverse_scale.unwrap();
        let aten_columns = aten.transpose_inverse_scale.unwrap();
        assert!(fused_columns.equal(&aten_columns), "{what}: column scales");
        assert_eq!(fused.inverse_scale.size(), [rows], "{what}");
        assert_eq!(fused_columns.size(), [cols], "{what}");
    });
    assert_no_cast_fallback();
}

#[test]
fn the_fp8_linear_on_the_kernels_equals_the_aten_path() {
    assert_fp8_linear_on_kernels_equals_aten(
        "the_fp8_linear_on_the_kernels_equals_the_aten_path",
        "delayed",
    );
}

#[test]
fn the_rowwise_fp8_linear_on_the_kernels_equals_the_aten_path() {
    assert_fp8_linear_on_kernels_equals_aten(
        "the_rowwise_fp8_linear_on_the_kernels_equals_the_aten",
        "rowwise",
    );
}

fn assert_fp8_linear_on_kernels_equals_aten(test: &str, recipe: &str) {
    let _lock = common::serial();
    let Some(ctx) = fp8_context(test, recipe) else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    // 240 tokens and 784 outputs: multiples of 16 (FP8 GEMMs) but not of the casts' 64-wide tiles.
    let layer = Linear::new(&(vs.root() / "fc"), 512, 784, true);
    let history = || vs.variables()["fc.fp8_amax_history"].copy();
    let start = history();
    let mut outputs = Vec::new();
    for kernels_on in [true, false] {
        let mut live = vs.variables()["fc.fp8_amax_history"].shallow_clone();
        live.copy_(&start);
        let before = speedkit::kernels::set_enabled(kernels_on);
        let mut last = Vec::new();
        // Three steps: the first scales from this step's amax, the later ones from the history.
        for step in 0..3 {
            tch::manual_seed(step);
            let x = Tensor::randn([3, 80, 512], (Kind::BFloat16, Device::Cuda(0))) * 4.0;
            let dy = Tensor::randn([3, 80, 784], (Kind::BFloat16, Device::Cuda(0)));
            last = Vec::from(run(&ctx, &layer, &x, &dy));
        }
        speedkit::kernels::set_enabled(before);
        last.push(history());
        outputs.push(last);
    }
    // The same FP8 bytes into the same GEMMs: equal. The bias gradient is summed in another order
    // (the cast's per-tile column sums, then the tiles, against ATen's reduction): fp32 rounding.
    for (what, (a, b)) in ["y", "dX", "dW", "db", "history"]
        .iter()
        .zip(outputs[0].iter().zip(&outputs[1]))
    {
        if *what == "db" {
            let err = common::rel_err(a, b);
            assert!(err < 1e-6, "db: kernels and ATen differ by {err}");
        } else {
            assert!(
                a.equal(b),
                "{what}: kernels and ATen differ ({})",
                common::rel_err(a, b)
            );
        }
    }
}

/// A model's forward pass, boxed: speedkit's layers or tch's behind one type.
type Forward = Box<dyn Fn(&Tensor) -> speedkit::Result<Tensor>>;

/// Linear → GELU → Linear in FP8 (`recipe`), MSE, AdamW, on speedkit's Linear or, with
/// `tch_layers`, tch's (the Linear override); the losses and the parameters after `steps`.
fn train_fp8(
    graphed: bool,
    steps: usize,
    recipe: &str,
    tch_layers: bool,
) -> (Vec<f64>, Vec<Tensor>) {
    let device = Device::Cuda(0);
    tch::manual_seed(0);
    let x = Tensor::randn([256, 256], (Kind::Float, device));
    let target = Tensor::randn([256, 256], (Kind::Float, device));
    let mut vs = nn::VarStore::new(device);
    let forward: Forward = if tch_layers {
        let first = nn::linear(vs.root() / "first", 256, 512, Default::default());
        let second = nn::linear(vs.root() / "second", 512, 256, Default::default());
        Box::new(move |x| Ok(x.apply(&first).gelu("tanh").apply(&second)))
    } else {
        let first = Linear::new(&(vs.root() / "first"), 256, 512, true);
        let second = Linear::new(&(vs.root() / "second"), 512, 256, true);
        Box::new(move |x| second.forward_t(&first.forward_t(x)?.gelu("tanh")))
    };
    let config = SpeedConfig::from_yaml_str(&format!(
        "device: cuda\nprecision: bf16\ncompile: {{enabled: {graphed}}}\n\
         fp8: {{enabled: true, recipe: {recipe}, amax_history: 4, min_gemm_size: 0}}\n"
    ))
    .unwrap();
    let ctx = SpeedContext::new(&config).unwrap();
    ctx.prepare(&mut vs).unwrap();
    let mut opt = ctx.adamw(&vs, Default::default()).unwrap();
    let step = |_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        let loss = ctx.autocast(|| -> speedkit::Result<Tensor> {
            Ok(forward(&x)?
                .to_kind(Kind::Float)
                .mse_loss(&target, tch::Reduction::Mean))
        })?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(Some(loss))
    };
    let losses = common::run_steps(&ctx, step, graphed, steps);
    // By name: the VarStore's map has no stable order of its own.
    let variables: std::collections::BTreeMap<_, _> = vs.variables().into_iter().collect();
    let state = variables.values().map(|p| p.detach().copy()).collect();
    (losses, state)
}

#[test]
fn a_graphed_fp8_step_equals_the_eager_step() {
    assert_graphed_fp8_step_equals_eager(
        "a_graphed_fp8_step_equals_the_eager_step",
        "delayed",
        false,
    );
}

#[test]
fn a_graphed_fp8_step_of_tch_layers_with_kept_amax_histories_equals_the_eager_step() {
    assert_graphed_fp8_step_equals_eager(
        "a_graphed_fp8_step_of_tch_layers_with_kept_amax_histories_equals_the_eager_step",
        "delayed",
        true,
    );
}

#[test]
fn a_graphed_rowwise_fp8_step_equals_the_eager_step() {
    assert_graphed_fp8_step_equals_eager(
        "a_graphed_rowwise_fp8_step_equals_the_eager_step",
        "rowwise",
        false,
    );
}

fn assert_graphed_fp8_step_equals_eager(test: &str, recipe: &str, tch_layers: bool) {
    let _lock = common::serial();
    if fp8_context(test, recipe).is_none() {
        return;
    }
    let (eager_losses, eager) = train_fp8(false, 20, recipe, tch_layers);
    let (graphed_losses, graphed) = train_fp8(true, 20, recipe, tch_layers);
    assert!(
        eager_losses[19] < eager_losses[0],
        "the loss falls: {eager_losses:?}"
    );
    // The same kernels in the same order; 1e-5 as for the bf16 graphed step (tests/gpu_kernels.rs).
    let last = (graphed_losses[19] - eager_losses[19]).abs() / eager_losses[19];
    assert!(last < 1e-5, "{eager_losses:?} vs {graphed_losses:?}");
    // Parameters, and the amax histories the graph's replays recorded on the device.
    for (e, g) in eager.iter().zip(&graphed) {
        let err = common::rel_err(g, e);
        assert!(err < 1e-5, "graphed and eager differ: {err}");
    }
    assert_no_cast_fallback();
}

#[test]
fn tch_linear_layers_run_in_fp8_where_the_plan_says_and_match_bf16() {
    let _lock = common::serial();
    let test = "tch_linear_layers_run_in_fp8_where_the_plan_says_and_match_bf16";
    let Some(ctx) = fp8_context(test, "delayed") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let wide = nn::linear(vs.root() / "wide", 768, 1040, Default::default());
    let odd = nn::linear(vs.root() / "odd", 1040, 1000, Default::default());
    let x = Tensor::randn([4, 96, 768], (Kind::Float, Device::Cuda(0)));
    let dy = Tensor::randn([4, 96, 1000], (Kind::Float, Device::Cuda(0)));
    let pass = |ctx: &SpeedContext| -> [Tensor; 3] {
        for mut p in vs.trainable_variables() {
            p.zero_grad();
        }
        let x = x.detach().set_requires_grad(true);
        let y = ctx.autocast(|| x.apply(&wide).apply(&odd));
        (y.to_kind(Kind::Float) * &dy).sum(Kind::Float).backward();
        [
            y.detach().to_kind(Kind::Float),
            x.grad(),
            wide.ws.grad().copy(),
        ]
    };
    // The second pass scales from the amax history the first recorded for each weight.
    let first = pass(&ctx);
    let fp8 = pass(&ctx);
    let notes = ctx.audit().notes;
    assert!(
        notes
            .iter()
            .any(|n| n.contains("tch linear [1040, 768] runs in FP8")
                && n.contains("amax history kept for the weight")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("tch linear [1000, 1040] stays") && n.contains("multiple of 16")),
        "{notes:?}"
    );
    drop(ctx);
    let bf16 = pass(&bf16_context());
    for (what, a, b, tol) in [
        ("y", &fp8[0], &bf16[0], 0.08),
        ("dX", &fp8[1], &bf16[1], 0.10),
        ("dW", &fp8[2], &bf16[2], 0.10),
        ("y, first pass", &first[0], &bf16[0], 0.08),
    ] {
        let err = common::rel_err(a, b);
        assert!(err < tol, "{what}: relative error {err:.4} >= {tol}");
        assert!(err > 0.0, "{what}: identical to bf16, so FP8 did not run");
    }
}

#[test]
fn tch_linear_layers_under_the_dynamic_recipe_scale_from_the_call() {
    let _lock = common::serial();
    let test = "tch_linear_layers_under_the_dynamic_recipe_scale_from_the_call";
    let Some(ctx) = fp8_context(test, "dynamic") else {
        return;
    };
    let vs = nn::VarStore::new(Device::Cuda(0));
    let wide = nn::linear(vs.root() / "wide", 768, 1040, Default::default());
    let x = Tensor::randn([4, 96, 768], (Kind::Float, Device::Cuda(0)));
    let fp8 = ctx.autocast(|| x.apply(&wide)).to_kind(Kind::Float);
    let notes = ctx.audit().notes;
    assert!(
        notes.iter().any(
            |n| n.contains("tch linear [1040, 768] runs in FP8") && n.contains("from the call")
        ),
        "{notes:?}"
    );
    drop(ctx);
    let bf16 = bf16_context()
        .autocast(|| x.apply(&wide))
        .to_kind(Kind::Float);
    let err = common::rel_err(&fp8, &bf16);
    assert!(err > 0.0 && err < 0.08, "relative error {err:.4}");
}
