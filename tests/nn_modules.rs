//! speedkit::nn's drop-in modules on the ATen path (the CPU, or kernels off) equal tch's own ops,
//! keep tch's parameter names, and handle the shapes the kernels must never get wrong.

use speedkit::nn::{cross_entropy, embedding, layer_norm, Linear, Mlp};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn same_parameters(vs: &nn::VarStore) -> (nn::VarStore, nn::LayerNorm) {
    let theirs_vs = nn::VarStore::new(Device::Cpu);
    let theirs = nn::layer_norm(theirs_vs.root(), vec![33], Default::default());
    let mut theirs_vs = theirs_vs;
    theirs_vs.copy(vs).expect("same parameter names and shapes");
    (theirs_vs, theirs)
}

#[test]
fn layer_norm_keeps_tch_parameter_names() {
    let ours = nn::VarStore::new(Device::Cpu);
    let _ = layer_norm(ours.root(), 33, Default::default());
    let theirs = nn::VarStore::new(Device::Cpu);
    let _ = nn::layer_norm(theirs.root(), vec![33], Default::default());
    let mut a: Vec<String> = ours.variables().into_keys().collect();
    let mut b: Vec<String> = theirs.variables().into_keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn layer_norm_on_the_cpu_equals_tch_forward_and_backward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    tch::no_grad(|| {
        ours.weight
            .as_ref()
            .unwrap()
            .shallow_clone()
            .copy_(&Tensor::randn([33], CPU))
    });
    let (theirs_vs, theirs) = same_parameters(&vs);
    let x = Tensor::randn([5, 7, 33], CPU).set_requires_grad(true);
    let x2 = x.detach().set_requires_grad(true);
    let (y, y2) = (ours.forward(&x), theirs.forward(&x2));
    assert!(y.equal(&y2));
    y.sum(Kind::Float).backward();
    (y2 * 1.0).sum(Kind::Float).backward();
    assert!(x.grad().allclose(&x2.grad(), 1e-6, 1e-6, false));
    let w2 = &theirs_vs.variables()["weight"];
    assert!(ours
        .weight
        .as_ref()
        .unwrap()
        .grad()
        .allclose(&w2.grad(), 1e-6, 1e-6, false));
}

#[test]
fn residual_layer_norm_on_the_cpu_equals_add_then_layer_norm() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    let (x, r) = (Tensor::randn([4, 33], CPU), Tensor::randn([4, 33], CPU));
    let (y, sum) = ours.forward_residual(&x, &r);
    assert!(sum.equal(&(&x + &r)));
    assert!(y.equal(&ours.forward(&(&x + &r))));
}

#[test]
fn layer_norm_handles_zero_rows_and_non_contiguous_inputs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = layer_norm(vs.root(), 33, Default::default());
    assert_eq!(ours.forward(&Tensor::zeros([0, 33], CPU)).size(), [0, 33]);
    let strided = Tensor::randn([33, 6], CPU).transpose(0, 1);
    assert!(ours
        .forward(&strided)
        .equal(&ours.forward(&strided.contiguous())));
}

#[test]
fn cross_entropy_on_the_cpu_equals_tch_with_ignored_rows() {
    let logits = Tensor::randn([6, 1023], CPU).set_requires_grad(true);
    let targets = Tensor::from_slice(&[3i64, -100, 1022, 0, -100, 7]);
    let loss = cross_entropy(&logits, &targets);
    let reference = logits.detach().set_requires_grad(true);
    let want = reference.cross_entropy_for_logits(&targets);
    assert!(loss.equal(&want));
    loss.backward();
    want.backward();
    assert!(logits.grad().equal(&reference.grad()));
}

// ----- FP8 quantisation (ATen's composite on the CPU; the fused kernel is in gpu_fp8.rs) ---------

#[test]
fn quantize_fp8_round_trips_within_the_format_and_transposes() {
    use speedkit::nn::{quantize_fp8, Fp8Format};
    tch::manual_seed(5);
    let t = Tensor::randn([48, 40], (Kind::Float, tch::Device::Cpu));
    for (format, tolerance) in [(Fp8Format::E4m3, 1.0 / 16.0), (Fp8Format::E5m2, 1.0 / 8.0)] {
        let q = quantize_fp8(&t, format, None, true).unwrap();
        assert_eq!(q.data.kind(), format.kind());
        let back = q.data.to_kind(Kind::Float) * &q.inverse_scale;
        // Each element within half an FP8 step of itself (relative), or of the smallest normal.
        let err = (&back - &t).abs() - t.abs() * tolerance;
        assert!(err.max().double_value(&[]) < 1e-2, "{format:?}");
        let transpose = q.transpose.unwrap().to_kind(Kind::Float);
        assert!(transpose.equal(&q.data.to_kind(Kind::Float).tr()));
        // The largest magnitude lands on the format's largest value.
        let top = q.data.to_kind(Kind::Float).abs().max().double_value(&[]);
        assert_eq!(top, format.max());
    }
}

#[test]
fn quantize_fp8_with_a_history_scales_from_it_and_records_the_amax() {
    use speedkit::nn::{quantize_fp8, Fp8Format};
    let t = Tensor::from_slice(&[1.0f32, -3.0, 0.5, 2.0]).view([2, 2]);
    let history = Tensor::from_slice(&[0.0f32, 1.5, 0.0]);
    let q = quantize_fp8(&t, Fp8Format::E4m3, Some(&history), false).unwrap();
    assert!(q.transpose.is_none());
    // Scaled from the history's 1.5: -3 saturates at -448; 1.5 / 448 back.
    let scale = (1.0f32 / 1.5) * 448.0;
    assert_eq!(q.inverse_scale.double_value(&[]), f64::from(1.0 / scale));
    assert_eq!(q.data.to_kind(Kind::Float).double_value(&[0, 1]), -448.0);
    assert_eq!(Vec::<f32>::try_from(&history).unwrap(), [3.0, 0.0, 1.5]);
}

#[test]
fn quantize_fp8_rowwise_scales_each_row_and_each_column_by_its_own_amax() {
    use speedkit::nn::{quantize_fp8_rowwise, Fp8Format};
    tch::manual_seed(6);
    // Rows and columns six orders of magnitude apart, and an all-zero row.
    let spread = Tensor::from_slice(&[1e-3f32, 1.0, 1e3, 0.0, 7.0]).view([5, 1]);
    let t = Tensor::randn([5, 48], (Kind::Float, Device::Cpu)) * &spread;
    let q = quantize_fp8_rowwise(&t, Fp8Format::E4m3, true).unwrap();
    let inverse_of = |amax: Tensor| (amax.clamp_min(1e-12).reciprocal() * 448.0).reciprocal();
    let row_amax = t.abs().amax([1].as_slice(), false);
    assert!(q.inverse_scale.equal(&inverse_of(row_amax.shallow_clone())));
    // Every row within e4m3's rounding (1/16 relative) of itself, whatever its scale: the error
    // beyond that is below a thousandth of the row's own amax (FP8's subnormals).
    let back = q.data.to_kind(Kind::Float) * q.inverse_scale.unsqueeze(1);
    let err = (&back - &t).abs() - t.abs() / 16.0 - row_amax.unsqueeze(1) * 1e-3;
    assert!(err.max().double_value(&[]) <= 0.0);
    // The transpose is scaled per column of t, by the column's amax.
    let column_inverse = q.transpose_inverse_scale.unwrap();
    assert!(column_inverse.equal(&inverse_of(t.abs().amax([0].as_slice(), false))));
    let back_t = q.transpose.unwrap().to_kind(Kind::Float) * column_inverse.unsqueeze(1);
    let column_amax = t.tr().abs().amax([1].as_slice(), true);
    let err_t = (&back_t - &t.tr()).abs() - t.tr().abs() / 16.0 - column_amax * 1e-3;
    assert!(err_t.max().double_value(&[]) <= 0.0);
}

#[test]
fn quantize_fp8_rejects_bad_input_and_changes_nothing() {
    use speedkit::nn::{quantize_fp8, Fp8Format, MAX_AMAX_HISTORY};
    let cpu = tch::Device::Cpu;
    let history = Tensor::from_slice(&[2.0f32, 1.0]);
    for (t, why) in [
        (Tensor::ones([2, 3, 4], (Kind::Float, cpu)), "3-d"),
        (Tensor::ones([4, 4], (Kind::Int64, cpu)), "Int64"),
    ] {
        let err = quantize_fp8(&t, Fp8Format::E4m3, Some(&history), true).unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    }
    let long = Tensor::zeros([MAX_AMAX_HISTORY + 1], (Kind::Float, cpu));
    let t = Tensor::ones([4, 4], (Kind::Float, cpu));
    let err = quantize_fp8(&t, Fp8Format::E5m2, Some(&long), false).unwrap_err();
    assert!(err.to_string().contains("1025 entries"), "{err}");
    assert_eq!(Vec::<f32>::try_from(&history).unwrap(), [2.0, 1.0]);
    let vector = Tensor::ones([8], (Kind::Float, cpu));
    let err = speedkit::nn::quantize_fp8_rowwise(&vector, Fp8Format::E4m3, true).unwrap_err();
    assert!(err.to_string().contains("1-d"), "{err}");
}

#[test]
fn mlp_keeps_tch_parameter_names() {
    let ours = nn::VarStore::new(Device::Cpu);
    let _ = Mlp::new(&(ours.root() / "mlp"), 16, 40, 12);
    let theirs = nn::VarStore::new(Device::Cpu);
    let path = theirs.root() / "mlp";
    let _ = nn::linear(&path / "fc1", 16, 40, Default::default());
    let _ = nn::linear(&path / "fc2", 40, 12, Default::default());
    let shapes = |vs: &nn::VarStore| {
        let mut v: Vec<(String, Vec<i64>)> = vs
            .variables()
            .into_iter()
            .map(|(name, t)| (name, t.size()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(shapes(&ours), shapes(&theirs));
    assert!(ours.variables().contains_key("mlp.fc2.bias"));
}

/// The composite the fused path replaces, on separate leaf copies of the same parameters.
fn mlp_reference(mlp: &Mlp, x: &Tensor) -> (Tensor, [Tensor; 5]) {
    let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (b1, b2) = (mlp.fc1.bs.as_ref().unwrap(), mlp.fc2.bs.as_ref().unwrap());
    let leaves = [x, &mlp.fc1.ws, b1, &mlp.fc2.ws, b2].map(leaf);
    let [x, w1, b1, w2, b2] = &leaves;
    let y = x.linear(w1, Some(b1)).gelu("tanh").linear(w2, Some(b2));
    (y, leaves)
}

#[test]
fn linear_forward_gelu_on_the_cpu_equals_gelu_of_the_linear_forward_and_backward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = Linear::new(&(vs.root() / "fc"), 12, 37, true);
    let bias = fc.bs.as_ref().expect("bias");
    let x = Tensor::randn([3, 5, 12], CPU).set_requires_grad(true);
    let y = fc.forward_gelu(&x).unwrap();
    let copy = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (rx, rw, rb) = (copy(&x), copy(&fc.ws), copy(bias));
    let want = rx.linear(&rw, Some(&rb)).gelu("tanh");
    assert!(y.equal(&want));
    let dy = Tensor::randn([3, 5, 37], CPU);
    (&y * &dy).sum(Kind::Float).backward();
    (&want * &dy).sum(Kind::Float).backward();
    assert!(x.grad().equal(&rx.grad()));
    assert!(fc.ws.grad().equal(&rw.grad()));
    assert!(bias.grad().equal(&rb.grad()));
}

#[test]
fn mlp_on_the_cpu_equals_the_aten_composite_forward_and_backward() {
    for tokens in [0, 1, 7] {
        let vs = nn::VarStore::new(Device::Cpu);
        let mlp = Mlp::new(&vs.root(), 16, 40, 12);
        let x = Tensor::randn([3, tokens, 16], CPU).set_requires_grad(true);
        let y = mlp.forward_t(&x).unwrap();
        let (want, leaves) = mlp_reference(&mlp, &x);
        assert_eq!(y.size(), [3, tokens, 12]);
        assert!(y.equal(&want));
        let dy = Tensor::randn([3, tokens, 12], CPU);
        (&y * &dy).sum(Kind::Float).backward();
        (&want * &dy).sum(Kind::Float).backward();
        let (b1, b2) = (mlp.fc1.bs.as_ref().unwrap(), mlp.fc2.bs.as_ref().unwrap());
        for (got, reference) in [&x, &mlp.fc1.ws, b1, &mlp.fc2.ws, b2].iter().zip(&leaves) {
            assert!(got.grad().allclose(&reference.grad(), 1e-6, 1e-6, false));
        }
    }
}

#[test]
fn mlp_on_the_cpu_says_why_it_is_not_fused_and_rejects_a_wrong_width() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mlp = Mlp::new(&vs.root(), 16, 40, 12);
    let why = mlp.fallback_reason(&Tensor::zeros([2, 16], CPU));
    assert!(why.is_some_and(|w| w.contains("CUDA") || w.contains("kernels: false")));
    let err = mlp.forward_t(&Tensor::zeros([2, 15], CPU));
    assert!(err.is_err());
}

#[test]
fn linear_on_the_cpu_equals_tch_linear_forward_and_backward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let ours = Linear::new(&(vs.root() / "fc"), 13, 7, true);
    let theirs = nn::Linear {
        ws: ours.ws.detach().copy().set_requires_grad(true),
        bs: ours
            .bs
            .as_ref()
            .map(|b| b.detach().copy().set_requires_grad(true)),
    };
    let x = Tensor::randn([5, 3, 13], CPU);
    let (y, want) = (ours.forward_t(&x).unwrap(), theirs.forward(&x));
    assert!(y.allclose(&want, 1e-6, 1e-6, false));
    y.sum(Kind::Float).backward();
    want.sum(Kind::Float).backward();
    assert!(ours
        .ws
        .grad()
        .allclose(&theirs.ws.grad(), 1e-5, 1e-5, false));
    let (b, tb) = (ours.bs.as_ref().unwrap(), theirs.bs.as_ref().unwrap());
    assert!(b.grad().allclose(&tb.grad(), 1e-5, 1e-5, false));
}

#[test]
fn linear_given_the_wrong_input_width_is_an_error_naming_the_layer_and_shapes() {
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = Linear::new(&(vs.root() / "fc"), 16, 24, true);
    let err = fc.forward_t(&Tensor::randn([4, 17], CPU)).unwrap_err();
    let message = err.to_string();
    for part in ["fc", "[4, 17]", "16 input features"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    let err = fc.forward_gelu(&Tensor::randn([4, 17], CPU)).unwrap_err();
    assert!(err.to_string().contains("[4, 17]"), "{err}");
}

#[test]
fn embedding_on_the_cpu_equals_aten_lookup_plus_positions_forward_and_backward() {
    let table = Tensor::randn([50, 12], CPU).set_requires_grad(true);
    let positions = Tensor::randn([9, 12], CPU).set_requires_grad(true);
    let tokens = Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]).view([2, 6]);
    let x = embedding(&tokens, &table, Some(&positions)).unwrap();
    let (t, p) = (
        table.detach().set_requires_grad(true),
        positions.detach().set_requires_grad(true),
    );
    let want = Tensor::embedding(&t, &tokens, -1, false, false) + p.narrow(0, 0, 6);
    assert!(x.equal(&want));
    let dy = Tensor::randn([2, 6, 12], CPU);
    (&x * &dy).sum(Kind::Float).backward();
    (&want * &dy).sum(Kind::Float).backward();
    assert!(table.grad().allclose(&t.grad(), 1e-6, 1e-6, false));
    assert!(positions.grad().allclose(&p.grad(), 1e-6, 1e-6, false));
}

#[test]
fn embedding_without_positions_keeps_the_shape_of_the_tokens() {
    let table = Tensor::randn([10, 4], CPU);
    let tokens = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]).view([2, 2, 2]);
    let x = embedding(&tokens, &table, None).unwrap();
    assert_eq!(x.size(), [2, 2, 2, 4]);
    assert!(x.equal(&Tensor::embedding(&table, &tokens, -1, false, false)));
}

#[test]
fn embedding_with_a_sequence_longer_than_the_positions_is_a_misuse_error() {
    let table = Tensor::randn([10, 4], CPU);
    let positions = Tensor::randn([3, 4], CPU);
    let tokens = Tensor::zeros([2, 5], (Kind::Int64, Device::Cpu));
    let err = embedding(&tokens, &table, Some(&positions)).unwrap_err();
    assert!(matches!(err, speedkit::SpeedkitError::Misuse(_)), "{err}");
    for part in ["[>= 5, 4]", "[3, 4]"] {
        assert!(
            err.to_string().contains(part),
            "{part:?} missing from: {err}"
        );
    }
}

#[test]
fn embedding_of_tokens_that_are_not_int64_is_a_misuse_error() {
    let table = Tensor::randn([10, 4], CPU);
    let tokens = Tensor::zeros([2, 5], (Kind::Int, Device::Cpu));
    let err = embedding(&tokens, &table, None).unwrap_err();
    assert!(err.to_string().contains("int64"), "{err}");
}

#[test]
fn linear_chunks_on_the_cpu_are_the_split_of_the_forward() {
    let vs = nn::VarStore::new(Device::Cpu);
    let qkv = Linear::new(&(vs.root() / "qkv"), 8, 12, true);
    let x = Tensor::randn([2, 3, 8], CPU);
    let parts = qkv.forward_chunks(&x, 3).unwrap();
    let whole = qkv.forward_t(&x).unwrap();
    assert_eq!(parts.len(), 3);
    for (i, part) in parts.iter().enumerate() {
        assert!(part.equal(&whole.narrow(-1, 4 * i as i64, 4)), "chunk {i}");
    }
}

#[test]
fn linear_chunks_that_do_not_divide_the_output_are_a_misuse_error() {
    let vs = nn::VarStore::new(Device::Cpu);
    let qkv = Linear::new(&(vs.root() / "qkv"), 8, 10, true);
    let err = qkv
        .forward_chunks(&Tensor::randn([2, 8], CPU), 3)
        .unwrap_err();
    assert!(matches!(err, speedkit::SpeedkitError::Misuse(_)), "{err}");
    assert!(err.to_string().contains("10 output features"), "{err}");
}
