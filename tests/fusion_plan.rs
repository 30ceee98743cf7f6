//! The step trace and the fusion planner on the CPU: what a traced step holds, which of its
//! kernels the planner groups and which it leaves to ATen, and that both are the same on every
//! recording of the same step.
//!
//! Each test holds `common::serial()`: PyTorch's execution trace observer must not see another
//! thread's operator in flight when a recording ends (`StepTrace::record`'s docs).

mod common;

use speedkit::fusion::{FusionPlan, GeneratedKernel, KernelArg, OpKind};
use speedkit::trace::{StepTrace, TracedOp, TracedValue};
use speedkit_suite::data;
use speedkit_suite::models::llama_tch::{LlamaConfig, LlamaTch};
use tch::{nn, Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn names(plan_group: &[String]) -> Vec<&str> {
    plan_group
        .iter()
        .map(|o| o.trim_start_matches("aten::"))
        .collect()
}

/// One training step of the tiny Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU),
/// forward and backward, traced.
fn llama_step_trace() -> StepTrace {
    tch::manual_seed(0);
    let config = LlamaConfig::tiny();
    let vs = nn::VarStore::new(CPU);
    let model = LlamaTch::new(&vs.root(), &config).unwrap();
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, CPU).unwrap();
    let (_, trace) = StepTrace::record(|| {
        model.loss(&tokens, &targets).unwrap().backward();
    })
    .unwrap();
    trace
}

#[test]
fn a_recorded_trace_is_kept_where_the_trace_dir_variable_says_and_reads_back_the_same() {
    let _serial = common::serial();
    let dir = std::env::temp_dir().join(format!("speedkit-kept-traces-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var(speedkit::trace::TRACE_DIR_VARIABLE, &dir);
    let x = Tensor::randn([3, 5], (Kind::Float, CPU)).set_requires_grad(true);
    let recorded = StepTrace::record(|| x.silu().sum(Kind::Float).backward());
    std::env::remove_var(speedkit::trace::TRACE_DIR_VARIABLE);
    let (_, trace) = recorded.unwrap();
    let kept: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let read = StepTrace::read(&kept[0].path()).unwrap();
    let names = |t: &StepTrace| {
        t.kernels()
            .iter()
            .map(|op| op.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&read), names(&trace));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_traced_step_holds_its_forward_and_backward_kernels_with_their_tensors() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 5], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| x.silu().sum(Kind::Float).backward()).unwrap();
    let kernels = trace.kernels();
    let silu = kernels.iter().find(|op| op.name == "aten::silu").unwrap();
    assert!(!silu.backward);
    let input = silu.input_tensors().next().unwrap();
    assert_eq!(
        (input.shape.as_slice(), input.strides.as_slice()),
        (&[3, 5][..], &[5, 1][..])
    );
    assert_eq!(
        (input.dtype.as_str(), input.device.as_str()),
        ("float", "cpu")
    );
    let backward = kernels
        .iter()
        .find(|op| op.name == "aten::silu_backward")
        .unwrap();
    assert!(backward.backward);
    // The backward reads the forward's input: the same tensor.
    assert!(backward.input_tensors().any(|t| t.key() == input.key()));
}

#[test]
fn composite_operators_appear_as_the_kernels_they_run() {
    let _serial = common::serial();
    let x = Tensor::randn([4, 6], (Kind::Float, CPU));
    let w = Tensor::randn([3, 6], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| x.linear(&w, None::<Tensor>)).unwrap();
    let kernels: Vec<&str> = trace.kernels().iter().map(|op| op.name.as_str()).collect();
    assert!(!kernels.contains(&"aten::linear"), "{kernels:?}");
    assert!(
        kernels.contains(&"aten::mm") || kernels.contains(&"aten::matmul"),
        "{kernels:?}"
    );
    assert!(trace.ops().iter().any(|op| op.name == "aten::linear"));
}

#[test]
fn rms_norm_forward_and_backward_are_one_group_each() {
    let _serial = common::serial();
    let x = Tensor::randn([16, 32], (Kind::Float, CPU)).set_requires_grad(true);
    let w = Tensor::ones([32], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt();
        (&x * rms * &w).sum(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let forward: Vec<_> = plan.groups().iter().filter(|g| !g.backward).collect();
    assert_eq!(forward.len(), 1, "{plan}");
    assert_eq!(
        names(&forward[0].operators),
        ["pow", "mean", "add", "rsqrt", "mul", "mul"],
        "{plan}"
    );
    assert_eq!(forward[0].reduction.as_deref(), Some("aten::mean"));
    assert!(plan.groups().iter().any(|g| g.backward), "{plan}");
}

#[test]
fn library_kernels_stay_atens_with_the_reason() {
    let _serial = common::serial();
    let x = Tensor::randn([8, 8], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| (x.mm(&x) * 2.0).relu()).unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let mm = plan
        .left_to_aten()
        .iter()
        .find(|l| l.operator == "aten::mm")
        .unwrap();
    assert_eq!(mm.calls, 1);
    assert!(mm.reason.starts_with("a library kernel"), "{plan}");
    assert_eq!(OpKind::of("aten::mm"), Some(OpKind::Library));
    assert_eq!(
        names(&plan.groups()[0].operators),
        ["mul", "relu"],
        "{plan}"
    );
}

#[test]
fn a_chain_is_not_fused_across_a_call_between_its_members() {
    let _serial = common::serial();
    let x = Tensor::randn([8, 8], (Kind::Float, CPU));
    // mul → mm → add, and mul → add: one kernel for mul and add would have to run before and
    // after the mm.
    let (_, trace) = StepTrace::record(|| {
        let y = &x * 2.0;
        y.mm(&x) + &y
    })
    .unwrap();
    let plan = FusionPlan::from_trace(&trace);
    assert!(plan.groups().is_empty(), "{plan}");
    assert_eq!(plan.kernels_after(), plan.kernels_before());
}

#[test]
fn a_group_whose_result_is_read_before_its_last_input_exists_is_split_where_it_can_run() {
    let _serial = common::serial();
    let x = Tensor::randn([8, 8], (Kind::Float, CPU));
    let v = Tensor::randn([8, 8], (Kind::Float, CPU));
    // exp, then an mm reading its result, then an mm of other inputs, then two muls: one group
    // for Inductor, who reorders; one kernel here would have to run both before the first mm
    // (which reads exp's result) and after the second (which makes the last mul's input).
    let (_, trace) = StepTrace::record(|| {
        let a = x.exp();
        let read_early = a.mm(&x);
        let late_input = v.mm(&v);
        (&a * 2.0 * &late_input, read_early)
    })
    .unwrap();
    let whole = FusionPlan::from_trace(&trace);
    assert_eq!(names(&whole.groups()[0].operators), ["exp", "mul", "mul"]);
    let runnable = FusionPlan::generatable(&trace);
    let groups: Vec<Vec<&str>> = runnable
        .groups()
        .iter()
        .map(|g| names(&g.operators))
        .collect();
    assert_eq!(groups, [["mul", "mul"]]);
}

#[test]
fn the_trace_and_the_plan_of_a_small_model_are_the_same_on_every_recording() {
    let _serial = common::serial();
    let first = llama_step_trace();
    let second = llama_step_trace();
    let kernels = |t: &StepTrace| -> Vec<(String, bool)> {
        t.kernels()
            .iter()
            .map(|op| (op.name.clone(), op.backward))
            .collect()
    };
    assert_eq!(kernels(&first), kernels(&second));
    let (a, b) = (
        FusionPlan::from_trace(&first),
        FusionPlan::from_trace(&second),
    );
    // Tensor ids and addresses differ between recordings; the groups, and which of them are
    // generated, do not.
    let structure = |p: &FusionPlan| -> Vec<(Vec<String>, bool, bool)> {
        let groups = p.groups().iter();
        groups
            .map(|g| (g.operators.clone(), g.backward, g.kernel().is_ok()))
            .collect()
    };
    assert_eq!(structure(&a), structure(&b));
    assert_eq!(a.to_string(), b.to_string());
    // The decoder's RMSNorm, rotary embeddings and SwiGLU give groups in both passes.
    assert!(
        a.groups().iter().any(|g| g.backward) && a.groups().iter().any(|g| !g.backward),
        "{a}"
    );
    assert!(a.kernels_after() < a.kernels_before(), "{a}");
    println!("{a}");
}

#[test]
fn a_panic_in_the_traced_closure_leaves_no_trace_recording() {
    let _serial = common::serial();
    let caught = std::panic::catch_unwind(|| StepTrace::record(|| panic!("in the step")));
    assert!(caught.is_err());
    // The observer and the float arguments' callback were removed: a new recording starts and
    // sees only its own calls, with their exact floats.
    let x = Tensor::ones([2], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| x.g_mul_scalar(1.0 / 3.0)).unwrap();
    let kernels: Vec<&str> = trace.kernels().iter().map(|op| op.name.as_str()).collect();
    assert_eq!(kernels, ["aten::mul"]);
    assert_eq!(float_arguments(&trace, "aten::mul"), [1.0 / 3.0]);
}

#[test]
fn a_bencher_asked_for_a_fusion_plan_traces_the_second_eager_step_before_timing() {
    let _serial = common::serial();
    use speedkit::bench::{Bencher, Protocol, Size};
    use speedkit::config::{DeviceChoice, SpeedConfig};
    let config = SpeedConfig {
        device: DeviceChoice::Cpu,
        ..SpeedConfig::auto()
    };
    let ctx = speedkit::SpeedContext::new(&config).unwrap();
    let protocol = Protocol {
        warmup: 1,
        steps: 2,
        paranoid_sync: false,
    };
    let x = Tensor::randn([8, 16], (Kind::Float, CPU)).set_requires_grad(true);
    let mut steps = 0;
    let mut bencher = Bencher::new(Size::Tiny, &ctx, protocol).with_fusion_plan(true);
    bencher
        .run(|| -> speedkit::Result<Tensor> {
            steps += 1;
            let loss = (x.sigmoid() * 3.0 + 1.0).sum(Kind::Float);
            loss.backward();
            Ok(loss)
        })
        .unwrap();
    // An untraced step (the optimizer's state is made there), the traced one, the warm-up step
    // and the timed ones.
    assert_eq!(steps, 2 + 1 + 2);
    let plan = bencher.take_fusion_plan().unwrap();
    let forward = plan.groups().iter().find(|g| !g.backward).unwrap();
    assert_eq!(
        names(&forward.operators),
        ["sigmoid", "mul", "add", "sum"],
        "{plan}"
    );
    assert!(bencher.take_fusion_plan().is_none());
}

// ----- the generated kernels ---------------------------------------------------------------------

const HOPPER: speedkit::kernels::Arch = speedkit::kernels::Arch { major: 9, minor: 0 };

/// Asserts that `kernel`'s source compiles with NVRTC for Hopper, its source in the message
/// where it does not.
fn assert_compiles(kernel: &GeneratedKernel) {
    let bytes = speedkit::kernels::compile(module_of(kernel).name(), HOPPER)
        .unwrap_or_else(|e| panic!("{e}\n{}", kernel.source));
    assert!(bytes > 0);
}

/// Registers `kernel`'s source under its own name (the name every launch finds it by).
fn module_of(kernel: &GeneratedKernel) -> speedkit::cuda::CudaModule {
    speedkit::cuda::CudaModule::new(&format!("{}.cu", kernel.name), &kernel.source).unwrap()
}

#[test]
fn every_generated_kernel_of_a_small_model_compiles_with_nvrtc() {
    let _serial = common::serial();
    let plan = FusionPlan::from_trace(&llama_step_trace());
    let mut generated = 0;
    for group in plan.groups() {
        let kernel = match group.kernel() {
            Ok(kernel) => kernel,
            Err(why) => {
                println!("not generated: {why}");
                continue;
            }
        };
        assert_compiles(&kernel);
        generated += 1;
    }
    // The decoder's RMSNorm, SwiGLU, rotary and backward chains; the groups with a column
    // reduction wait for the next generator.
    println!("{generated} of {} groups generated", plan.groups().len());
    assert!(
        generated >= 4,
        "{generated} of {} groups:\n{plan}",
        plan.groups().len()
    );
}

/// Rotary embeddings as the Llama model writes them: the halves swapped by `narrow`, `neg` and
/// `cat`, then mixed with `cos` and `sin`.
fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let rotated = Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
    x * cos + rotated * sin
}

/// The kernel of the group of `chain`'s trace that holds operator `op`, compiled with NVRTC.
fn compiles_the_group_holding(op: &str, chain: impl FnOnce() -> Tensor) {
    let (_, trace) = StepTrace::record(chain).unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let group = plan
        .groups()
        .iter()
        .find(|g| g.calls().iter().any(|c| c.name == format!("aten::{op}")))
        .unwrap_or_else(|| panic!("no group holds {op}:\n{plan}"));
    let kernel = group.kernel().unwrap_or_else(|e| panic!("{op}: {e}"));
    assert_compiles(&kernel);
}

#[test]
fn a_rotary_embeddings_backward_is_one_group_though_its_halves_meet_at_the_end() {
    let _serial = common::serial();
    // The halves' gradients come from two chains that each add into the other's result: joined
    // one at a time, either would close a cycle through the other.
    let x = Tensor::randn([2, 4, 16, 8], (Kind::Float, CPU)).set_requires_grad(true);
    let (cos, sin) = (
        Tensor::randn([16, 8], (Kind::Float, CPU)),
        Tensor::randn([16, 8], (Kind::Float, CPU)),
    );
    let g = Tensor::randn([2, 4, 16, 8], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        (rotary(&(&x * 1.0), &cos, &sin) * &g)
            .sum(Kind::Float)
            .backward()
    })
    .unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let backward_group_of = |name: &str| {
        plan.groups()
            .iter()
            .position(|g| g.calls().iter().any(|c| c.backward && c.name == name))
            .unwrap_or_else(|| panic!("no group holds {name}:\n{plan}"))
    };
    let neg = backward_group_of("aten::neg");
    let halves = plan.groups()[neg]
        .calls()
        .iter()
        .filter(|c| c.name == "aten::slice_backward")
        .count();
    assert_eq!(halves, 2, "{plan}");
    assert!(plan.groups()[neg].kernel().is_ok(), "{plan}");
}

#[test]
fn cat_and_slice_backward_are_generated_as_index_arithmetic_that_nvrtc_compiles() {
    let _serial = common::serial();
    let x = Tensor::randn([5, 7, 10], (Kind::Float, CPU));
    let (cos, sin) = (Tensor::randn([7, 10], (Kind::Float, CPU)), x.sin());
    let g = Tensor::randn([5, 7, 3], (Kind::Float, CPU));
    compiles_the_group_holding("cat", || rotary(&x, &cos, &sin));
    // A strided slice's gradient whose end is past the dimension, as `x[..., 1::3]` gives it.
    compiles_the_group_holding("slice_backward", || {
        Tensor::slice_backward(&(&g * 2.0), [5, 7, 10], -1, 1, i64::MAX, 3).neg()
    });
}

#[test]
fn views_of_a_result_inside_the_group_are_read_at_coordinates_handed_over() {
    let _serial = common::serial();
    // The rotary embedding's halves: a `narrow` at an offset and a transposed view of `y`, a
    // result of the group, each read as `y`'s coordinates (one addition for the half's offset),
    // not as an index its function would divide into coordinates again.
    let x = Tensor::randn([2, 16, 4, 64], (Kind::BFloat16, CPU));
    let (cos, sin) = (
        Tensor::randn([16, 64], (Kind::BFloat16, CPU)),
        Tensor::randn([16, 64], (Kind::BFloat16, CPU)),
    );
    let kernel = kernel_of_chain(|| rotary(&(&x * 1.0).transpose(1, 2), &cos, &sin));
    let at_its_half = "Coords{{c[0], c[2], c[1], c[3] + 32}}";
    assert!(kernel.source.contains(at_its_half), "{}", kernel.source);
    assert_compiles(&kernel);
}

#[test]
fn a_mean_squared_errors_gradient_is_generated_with_its_neighbours() {
    let _serial = common::serial();
    let x = Tensor::randn([5, 7, 10], (Kind::Float, CPU));
    let grad = Tensor::from(0.5f32);
    compiles_the_group_holding("mse_loss_backward", || {
        x.mse_loss_backward(&grad, &x.tanh(), tch::Reduction::Mean) * 3.0
    });
}

#[test]
fn a_group_reducing_other_than_the_last_dimension_says_why_no_kernel_is_generated() {
    let _serial = common::serial();
    // A middle dimension: neither a row reduction nor a sum over columns (every dimension but
    // the last).
    let x = Tensor::randn([4, 16, 32], (Kind::Float, CPU));
    let (_, trace) =
        StepTrace::record(|| (x.exp().sum_dim_intlist(1, true, Kind::Float) + 1.0).sqrt()).unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let why = plan.groups()[0].kernel().unwrap_err();
    assert!(
        why.contains("aten::sum over other than the last dimension"),
        "{why}"
    );
}

/// Each float argument of the calls named `op` in `trace`, as traced.
fn float_arguments(trace: &StepTrace, op: &str) -> Vec<f64> {
    let calls = trace.ops().iter().filter(|call| call.name == op);
    calls
        .flat_map(|call| &call.inputs)
        .filter_map(|value| match value {
            TracedValue::Other { value, kind } if kind == "Double" => value.parse().ok(),
            _ => None,
        })
        .collect()
}

#[test]
fn float_arguments_are_traced_exactly_though_the_trace_file_rounds_them_to_six_decimals() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 5], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        let y = x.layer_norm([5], None::<Tensor>, None::<Tensor>, 1e-12, false);
        y.pow_tensor_scalar(1.0 / 3.0)
            .g_mul_scalar(0.088_388_347_648_318_45)
            .g_add_scalar(1e-8)
    })
    .unwrap();
    assert_eq!(float_arguments(&trace, "aten::native_layer_norm"), [1e-12]);
    assert_eq!(float_arguments(&trace, "aten::pow"), [1.0 / 3.0]);
    assert_eq!(
        float_arguments(&trace, "aten::mul"),
        [0.088_388_347_648_318_45]
    );
    assert_eq!(float_arguments(&trace, "aten::add"), [1e-8]);
}

#[test]
fn a_generated_kernel_bakes_in_a_small_epsilon_and_a_long_scale_as_they_were_passed() {
    let _serial = common::serial();
    let x = Tensor::randn([16, 32], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-8).rsqrt();
        (&x * rms).g_mul_scalar(1.0 / 3.0)
    })
    .unwrap();
    let kernel = FusionPlan::from_trace(&trace).groups()[0].kernel().unwrap();
    assert!(kernel.source.contains("1e-8f"), "{}", kernel.source);
    assert!(kernel.source.contains("0.33333334f"), "{}", kernel.source);
    assert_compiles(&kernel);
}

#[test]
fn a_layer_norm_row_that_fits_a_warps_registers_is_taken_by_a_warp_and_a_longer_one_by_a_block() {
    let _serial = common::serial();
    let kernel_of = |width: i64| {
        let x = Tensor::randn([20, width], (Kind::Float, CPU));
        let (_, trace) = StepTrace::record(|| {
            (&x + 1.0).layer_norm([width], None::<Tensor>, None::<Tensor>, 1e-5, false)
        })
        .unwrap();
        FusionPlan::from_trace(&trace).groups()[0].kernel().unwrap()
    };
    let warp = kernel_of(768);
    let entry = &warp.source[warp.source.find("extern \"C\"").unwrap()..];
    assert!(entry.contains("warp_sum(acc)"), "{entry}");
    assert!(!entry.contains("__syncthreads"), "{entry}");
    // 20 rows, eight a block of 256 threads.
    assert_eq!(warp.grid_and_block(), (3, 256));
    assert_compiles(&warp);
    let block = kernel_of(2048);
    assert!(
        block.source.contains("block_sum(acc, partial)"),
        "{}",
        block.source
    );
    assert_eq!(block.grid_and_block().0, 20);
    assert_compiles(&block);
}

#[test]
fn a_narrow_layer_norms_backward_runs_a_block_a_row_beyond_where_a_wide_ones_stops() {
    let _serial = common::serial();
    let backward_grid = |width: i64| {
        let plan = residual_layer_norm_backward(1500, width);
        let kernel = group_holding(&plan, "aten::native_layer_norm_backward")
            .kernel()
            .unwrap();
        assert_compiles(&kernel);
        kernel.grid_and_block()
    };
    // 96 columns: 32 threads a block, a block for each of the 3000 rows; 1024 columns: 256
    // threads, 1024 blocks.
    assert_eq!(backward_grid(96), (3000, 32));
    assert_eq!(backward_grid(1024), (1024, 256));
}

#[test]
fn rms_norm_forward_generates_one_kernel_that_nvrtc_compiles() {
    let _serial = common::serial();
    let x = Tensor::randn([16, 32], (Kind::Float, CPU));
    let w = Tensor::randn([32], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt();
        &x * rms * &w
    })
    .unwrap();
    let kernel = FusionPlan::from_trace(&trace).groups()[0].kernel().unwrap();
    // One block per row, the 16 rows of the input.
    assert_eq!(kernel.numel, 16);
    assert!(kernel.source.contains("in_red("), "{}", kernel.source);
    assert_compiles(&kernel);
}

#[test]
fn memory_the_step_made_and_only_its_group_reads_after_an_in_place_rewrite_is_not_written() {
    let _serial = common::serial();
    let (x, w) = (
        Tensor::randn([16, 16], (Kind::Float, CPU)),
        Tensor::randn([16, 16], (Kind::Float, CPU)),
    );
    let bias = Tensor::randn([16], (Kind::Float, CPU));
    // A layer's bias added in place to the GEMM's output, which only the group reads after, once
    // transposed: its new values stay in the kernel, so any thread may compute any of them.
    let (_, trace) = StepTrace::record(|| {
        let mut y = x.mm(&w);
        let _ = y.g_add_(&bias);
        (&y + y.tr()).exp()
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let group = (plan.groups().iter())
        .find(|g| g.calls().iter().any(|c| c.name == "aten::add_"))
        .unwrap_or_else(|| panic!("{plan}"));
    let kernel = group.kernel().unwrap();
    let outputs = (kernel.args.iter())
        .filter(|a| matches!(a, KernelArg::Output(_)))
        .count();
    assert_eq!(outputs, 1, "exp's result only:\n{}", kernel.source);
}

/// A pre-norm transformer's residual stream as autocast runs it: the block's bf16 output added
/// to the fp32 stream, layer-normalised over the last dimension (an odd width), cast to bf16 for
/// the next GEMM.
fn residual_layer_norm(stream: &Tensor, delta: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    (stream + delta)
        .layer_norm([stream.size()[2]], Some(w), Some(b), 1e-5, false)
        .to_kind(Kind::BFloat16)
}

/// The generatable plan of a step through [`residual_layer_norm`] of two samples of `rows` rows
/// of `width`, its backward included (the residual stream's gradient accumulated beside it).
fn residual_layer_norm_backward(rows: i64, width: i64) -> FusionPlan {
    let leaf = |shape: &[i64], kind| Tensor::randn(shape, (kind, CPU)).set_requires_grad(true);
    let (stream, delta) = (
        leaf(&[2, rows, width], Kind::Float),
        leaf(&[2, rows, width], Kind::BFloat16),
    );
    let (w, b) = (leaf(&[width], Kind::Float), leaf(&[width], Kind::Float));
    let (_, trace) = StepTrace::record(|| {
        let y = residual_layer_norm(&stream, &delta, &w, &b).to_kind(Kind::Float);
        ((&y * &y).mean(Kind::Float) + stream.sum(Kind::Float)).backward();
    })
    .unwrap();
    FusionPlan::generatable(&trace)
}

#[test]
fn a_layer_norm_joins_the_residual_add_before_it_and_its_cast_in_one_kernel_that_nvrtc_compiles() {
    let _serial = common::serial();
    // Rows of 77 (one element at a time) and of 96 (four, the row held in registers).
    for width in [77, 96] {
        let stream = Tensor::randn([3, 5, width], (Kind::Float, CPU));
        let delta = Tensor::randn([3, 5, width], (Kind::BFloat16, CPU));
        let (w, b) = (
            Tensor::randn([width], (Kind::Float, CPU)),
            Tensor::randn([width], (Kind::Float, CPU)),
        );
        let (_, trace) =
            StepTrace::record(|| residual_layer_norm(&stream, &delta, &w, &b)).unwrap();
        let plan = FusionPlan::from_trace(&trace);
        assert_eq!(plan.groups().len(), 1, "{plan}");
        let group = &plan.groups()[0];
        assert_eq!(
            names(&group.operators),
            ["add", "native_layer_norm", "_to_copy"],
            "{plan}"
        );
        let kernel = group.kernel().unwrap();
        // A block per row: 3 × 5 rows.
        assert_eq!(kernel.numel, 15);
        assert_compiles(&kernel);
    }
}

#[test]
fn a_cast_of_a_layer_norms_elements_that_the_group_does_not_store_is_not_recomputed_from_them() {
    let _serial = common::serial();
    // Large enough (2 MiB of fp32 a result) that the backward would recompute instead of saving.
    let stream = Tensor::randn([4, 129, 1000], (Kind::Float, CPU)).set_requires_grad(true);
    let delta = Tensor::randn([4, 129, 1000], (Kind::BFloat16, CPU)).set_requires_grad(true);
    let (w, b) = (
        Tensor::randn([1000], (Kind::Float, CPU)).set_requires_grad(true),
        Tensor::randn([1000], (Kind::Float, CPU)).set_requires_grad(true),
    );
    let (_, trace) = StepTrace::record(|| {
        let y = residual_layer_norm(&stream, &delta, &w, &b).to_kind(Kind::Float);
        (&y * &y).mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let norm = (plan.groups().iter())
        .find(|g| g.operators.iter().any(|o| o == "aten::native_layer_norm"))
        .unwrap_or_else(|| panic!("{plan}"));
    // The sum is recomputed from the stream and the block's output; the casts of the normalised
    // elements, which the group stores as its statistics only, are saved.
    assert_eq!(norm.recomputed, ["aten::add"], "{plan}");
}

#[test]
fn a_layer_norms_backward_joins_its_casts_and_the_gradients_sum_in_one_kernel_that_nvrtc_compiles()
{
    let _serial = common::serial();
    // Rows of 77 (one element at a time) and of 96 (four).
    for width in [77, 96] {
        let stream = Tensor::randn([3, 5, width], (Kind::Float, CPU)).set_requires_grad(true);
        let delta = Tensor::randn([3, 5, width], (Kind::BFloat16, CPU)).set_requires_grad(true);
        let (w, b) = (
            Tensor::randn([width], (Kind::Float, CPU)).set_requires_grad(true),
            Tensor::randn([width], (Kind::Float, CPU)).set_requires_grad(true),
        );
        let (_, trace) = StepTrace::record(|| {
            // The stream read twice, as the residual and by the norm: its gradient's two parts
            // summed after the norm's backward.
            let y = residual_layer_norm(&stream, &delta, &w, &b).to_kind(Kind::Float);
            ((&y * &y).mean(Kind::Float) + stream.sum(Kind::Float)).backward();
        })
        .unwrap();
        let plan = FusionPlan::from_trace(&trace);
        let backward = (plan.groups().iter())
            .find(|g| {
                g.operators
                    .iter()
                    .any(|o| o == "aten::native_layer_norm_backward")
            })
            .unwrap_or_else(|| panic!("{plan}"));
        let names = names(&backward.operators);
        assert!(names.contains(&"_to_copy"), "{plan}");
        let kernel = backward.kernel().unwrap();
        // A block per row; the weight's and bias's gradients summed over its columns.
        assert_eq!(kernel.numel, 15);
        assert!(kernel.source.contains("ln_terms("), "{}", kernel.source);
        assert!(kernel.source.contains("_columns("), "{}", kernel.source);
        assert_compiles(&kernel);
    }
}

/// The group of `plan` that holds `operator`.
fn group_holding<'p>(plan: &'p FusionPlan, operator: &str) -> &'p speedkit::fusion::FusedGroup {
    (plan.groups().iter())
        .find(|g| g.operators.iter().any(|o| o == operator))
        .unwrap_or_else(|| panic!("no group holds {operator}:\n{plan}"))
}

#[test]
fn a_bias_gradients_column_sum_joins_the_layer_norms_backward_and_cast_that_make_it() {
    let _serial = common::serial();
    // Rows of 77 (one element at a time) and of 96 (four).
    for width in [77, 96] {
        let stream = Tensor::randn([3, 5, width], (Kind::Float, CPU)).set_requires_grad(true);
        let bias = Tensor::randn([width], (Kind::Float, CPU)).set_requires_grad(true);
        let (w, b) = (
            Tensor::randn([width], (Kind::Float, CPU)).set_requires_grad(true),
            Tensor::randn([width], (Kind::Float, CPU)).set_requires_grad(true),
        );
        let (_, trace) = StepTrace::record(|| {
            // A pre-norm block's stream: a linear's output (its bias added) normalised; the
            // norm's backward makes the gradient whose cast the linear's bias sums.
            let h = common::bias_add(&stream, &bias, Kind::BFloat16);
            let y = h.layer_norm([width], Some(&w), Some(&b), 1e-5, false);
            (&y * &y).mean(Kind::Float).backward();
        })
        .unwrap();
        let plan = FusionPlan::generatable(&trace);
        let backward = group_holding(&plan, "aten::native_layer_norm_backward");
        let names = names(&backward.operators);
        assert!(names.contains(&"_to_copy"), "{plan}");
        assert!(names.contains(&"speedkit::column_sums"), "{plan}");
        let kernel = backward.kernel().unwrap();
        // The norm's two sums over columns and the bias's, each its own.
        assert!(kernel.source.contains("cols2["), "{}", kernel.source);
        assert_compiles(&kernel);
    }
}

#[test]
fn a_bias_gradient_over_a_channels_last_image_sums_columns_in_the_norms_backward() {
    let _serial = common::serial();
    // Channels of 77 (one element at a time) and of 96 (four), over an odd image.
    for channels in [77, 96] {
        let pixels = Tensor::randn([3, 7, 5, channels], (Kind::BFloat16, CPU));
        let image = pixels.permute([0, 3, 1, 2]).set_requires_grad(true);
        let bias = Tensor::randn([channels], (Kind::Float, CPU)).set_requires_grad(true);
        let (w, b) = (
            Tensor::randn([channels], (Kind::Float, CPU)).set_requires_grad(true),
            Tensor::randn([channels], (Kind::Float, CPU)).set_requires_grad(true),
        );
        let (_, trace) = StepTrace::record(|| {
            // ConvNeXt's convolution bias over a channels-last image, then its norm over the
            // channels of each pixel: the bias's gradient sums all but the innermost dimension.
            let biased = &image + bias.to_kind(Kind::BFloat16).view([1, channels, 1, 1]);
            let pixels = biased.permute([0, 2, 3, 1]).to_kind(Kind::Float);
            let y = pixels.layer_norm([channels], Some(&w), Some(&b), 1e-6, false);
            (&y * &y).mean(Kind::Float).backward();
        })
        .unwrap();
        let plan = FusionPlan::generatable(&trace);
        let backward = group_holding(&plan, "aten::native_layer_norm_backward");
        assert!(names(&backward.operators).contains(&"sum"), "{plan}");
        let kernel = backward.kernel().unwrap();
        // The norm's two sums over columns and the bias's, each its own.
        assert!(kernel.source.contains("cols2["), "{}", kernel.source);
        assert_compiles(&kernel);
    }
}

#[test]
fn a_bias_gradients_column_sum_joins_the_gelu_backward_that_makes_it() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 37, 53], (Kind::BFloat16, CPU)).set_requires_grad(true);
    let bias = Tensor::randn([53], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        let h = common::bias_add(&x, &bias, Kind::BFloat16).gelu("tanh");
        h.to_kind(Kind::Float).square().mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let group = group_holding(&plan, "speedkit::column_sums");
    assert!(names(&group.operators).contains(&"gelu_backward"), "{plan}");
    let kernel = group.kernel().unwrap();
    assert!(kernel.source.contains("_columns("), "{}", kernel.source);
    assert_compiles(&kernel);
}

#[test]
fn a_dropout_and_its_gradient_join_their_chains_in_kernels_that_nvrtc_compiles() {
    let _serial = common::serial();
    // Rows of 40 bf16 (ATen's kernel takes eight elements a thread) and an odd 7 × 5 (one).
    for (shape, kind) in [([6i64, 40], Kind::BFloat16), ([7, 5], Kind::Float)] {
        let x = Tensor::randn(shape, (kind, CPU)).set_requires_grad(true);
        let w = Tensor::randn([shape[1]], (kind, CPU));
        let (_, trace) = StepTrace::record(|| {
            // On the CPU `dropout` draws through `bernoulli_`; CUDA's is `native_dropout`.
            let (y, _) = (&x * 1.5).native_dropout(0.1, true);
            (y + &w)
                .gelu("none")
                .to_kind(Kind::Float)
                .sum(Kind::Float)
                .backward();
        })
        .unwrap();
        let plan = FusionPlan::generatable(&trace);
        let forward = group_holding(&plan, "aten::native_dropout");
        let forward_names = names(&forward.operators);
        assert!(
            forward_names.contains(&"mul") && forward_names.contains(&"gelu"),
            "{plan}"
        );
        let kernel = forward.kernel().unwrap();
        // The mask, which the backward reads, is stored with the result.
        assert!(kernel.source.contains("bool* out"), "{}", kernel.source);
        assert!(kernel.source.contains("dropout_keep0"), "{}", kernel.source);
        assert_compiles(&kernel);
        let backward = group_holding(&plan, "aten::native_dropout_backward");
        assert!(
            names(&backward.operators).contains(&"gelu_backward"),
            "{plan}"
        );
        assert_compiles(&backward.kernel().unwrap());
    }
}

#[test]
fn a_layer_norm_joins_the_residual_dropout_before_it_in_one_vectorised_kernel() {
    let _serial = common::serial();
    let stream = Tensor::randn([6, 17, 96], (Kind::Float, CPU));
    let delta = Tensor::randn([6, 17, 96], (Kind::BFloat16, CPU));
    let (_, trace) = StepTrace::record(|| {
        // A pre-LN block's residual: the sublayer's output dropped out, added, normed.
        let (dropped, _) = delta.native_dropout(0.1, true);
        (&stream + dropped).layer_norm([96], None::<Tensor>, None::<Tensor>, 1e-5, false)
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let group = group_holding(&plan, "aten::native_layer_norm");
    assert!(
        names(&group.operators).contains(&"native_dropout"),
        "{plan}"
    );
    let kernel = group.kernel().unwrap();
    // Its rows four columns a thread, the mask stored four at once.
    assert!(kernel.source.contains("store4(a.out"), "{}", kernel.source);
    assert_compiles(&kernel);
}

#[test]
fn a_bias_gradients_column_sum_does_not_join_the_cat_of_a_splits_gradients() {
    let _serial = common::serial();
    let x = Tensor::randn([2, 16, 96], (Kind::BFloat16, CPU)).set_requires_grad(true);
    let bias = Tensor::randn([96], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        // A qkv projection's output split in three: the split's backward concatenates the
        // parts' gradients, which the bias's sum reads.
        let parts = common::bias_add(&x, &bias, Kind::BFloat16).split(32, -1);
        let loss = parts[0].silu() * &parts[1] + parts[2].square();
        loss.to_kind(Kind::Float).mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let holds = |g: &speedkit::fusion::FusedGroup, op: &str| g.operators.iter().any(|o| o == op);
    assert!(
        (plan.groups().iter()).any(|g| holds(g, "aten::cat")),
        "the parts' gradients join the cat:\n{plan}"
    );
    assert!(
        !(plan.groups().iter()).any(|g| holds(g, "aten::cat") && holds(g, "speedkit::column_sums")),
        "{plan}"
    );
}

#[test]
fn a_layer_scales_gradient_sums_in_the_kernel_of_the_bias_gradient_it_sits_beside() {
    let _serial = common::serial();
    // Channels-last memory, as a convolution with channels-last weights makes it.
    let x = Tensor::randn([2, 7, 5, 96], (Kind::Float, CPU))
        .permute([0, 3, 1, 2])
        .set_requires_grad(true);
    let parameter = || Tensor::randn([96], (Kind::Float, CPU)).set_requires_grad(true);
    let (biases, scales) = ([parameter(), parameter()], [parameter(), parameter()]);
    let (_, trace) = StepTrace::record(|| {
        // ConvNeXt's blocks: a channels-last linear's output times a parameter per channel
        // (layer scale), added to the residual stream. The parameter's gradient is a sum over
        // every pixel, which autograd views and casts as the parameter after the sum.
        let mut stream = x.shallow_clone();
        for (bias, scale) in biases.iter().zip(&scales) {
            let pixels = stream.permute([0, 2, 3, 1]).to_kind(Kind::BFloat16);
            let h = common::bias_add(&pixels, bias, Kind::BFloat16) * scale;
            stream = &stream + h.permute([0, 3, 1, 2]);
        }
        // Read channels-last, as the next block reads it: its gradient is channels-last too.
        stream
            .permute([0, 2, 3, 1])
            .square()
            .mean(Kind::Float)
            .backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let group = group_holding(&plan, "aten::sum");
    assert!(
        names(&group.operators).contains(&"speedkit::column_sums"),
        "{plan}"
    );
    let kernel = group.kernel().unwrap_or_else(|e| panic!("{e}:\n{plan}"));
    assert_compiles(&kernel);
}

#[test]
fn a_bias_gradients_column_sum_alone_is_left_to_its_own_kernel_with_the_reason() {
    let _serial = common::serial();
    let x = Tensor::randn([4, 40], (Kind::Float, CPU)).set_requires_grad(true);
    let bias = Tensor::randn([40], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        // The loss's gradient comes from the matmul's backward: a library kernel, nothing to
        // fuse the sum with.
        let y = common::bias_add(&x, &bias, Kind::Float).matmul(&x.tr());
        y.sum(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let sum = (plan.left_to_aten().iter())
        .find(|l| l.operator == "speedkit::column_sums")
        .unwrap_or_else(|| panic!("{plan}"));
    assert_eq!(sum.calls, 1);
    assert_eq!(sum.reason, "nothing to fuse with where it runs");
}

#[test]
fn a_layer_norms_backward_without_its_weights_gradient_is_left_to_aten() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 5, 96], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        let y = x
            .exp()
            .layer_norm([96], None::<Tensor>, None::<Tensor>, 1e-5, false)
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        (&y * &y).mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let generated =
        |name: &str| (plan.groups().iter()).any(|g| g.operators.iter().any(|o| o == name));
    assert!(generated("aten::native_layer_norm"), "{plan}");
    assert!(!generated("aten::native_layer_norm_backward"), "{plan}");
}

#[test]
fn a_layer_norm_over_more_than_its_last_dimension_is_not_generated() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 5, 8], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        x.exp()
            .layer_norm([5, 8], None::<Tensor>, None::<Tensor>, 1e-5, false)
            .exp()
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    assert!(
        plan.groups()
            .iter()
            .all(|g| g.operators.iter().all(|o| o != "aten::native_layer_norm")),
        "{plan}"
    );
}

/// A diffusion U-Net's norm as autocast runs it: the convolution's bf16 output cast to fp32,
/// group-normalised (two channels a group, odd spatial sizes), SiLU, cast back.
fn group_norm_silu(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    x.to_kind(Kind::Float)
        .group_norm(4, Some(w), Some(b), 1e-5, false)
        .silu()
        .to_kind(Kind::BFloat16)
}

#[test]
fn a_group_norm_joins_its_cast_and_silu_in_one_kernel_that_nvrtc_compiles() {
    let _serial = common::serial();
    // Rows of two channels of 5 × 7 (one element at a time) and of 6 × 6 (four, the row held in
    // registers).
    for shape in [[3, 8, 5, 7], [3, 8, 6, 6]] {
        let x = Tensor::randn(shape, (Kind::BFloat16, CPU));
        let (w, b) = (
            Tensor::randn([8], (Kind::Float, CPU)),
            Tensor::randn([8], (Kind::Float, CPU)),
        );
        let (_, trace) = StepTrace::record(|| group_norm_silu(&x, &w, &b)).unwrap();
        let plan = FusionPlan::from_trace(&trace);
        assert_eq!(plan.groups().len(), 1, "{plan}");
        let group = &plan.groups()[0];
        assert_eq!(
            names(&group.operators),
            ["_to_copy", "native_group_norm", "silu", "_to_copy"],
            "{plan}"
        );
        let kernel = group.kernel().unwrap();
        // A block per row: 3 samples × 4 groups.
        assert_eq!(kernel.numel, 12);
        assert!(kernel.source.contains("block_sum("), "{}", kernel.source);
        assert_compiles(&kernel);
    }
}

#[test]
fn a_group_norms_16_bit_input_that_the_group_also_stores_is_stored_from_the_row_it_holds() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 8, 6, 6], (Kind::BFloat16, CPU));
    let (w, b) = (
        Tensor::randn([8], (Kind::Float, CPU)),
        Tensor::randn([8], (Kind::Float, CPU)),
    );
    let m = Tensor::randn([6, 6], (Kind::BFloat16, CPU));
    // The sum, which a product outside reads, is a result of the group; its fp32 cast is the
    // norm's row, held.
    let (_, trace) = StepTrace::record(|| {
        let sum = &x + 1.0;
        let y = group_norm_silu(&sum, &w, &b);
        (sum.matmul(&m), y)
    })
    .unwrap();
    let plan = FusionPlan::from_trace(&trace);
    assert_eq!(plan.groups().len(), 1, "{plan}");
    let kernel = plan.groups()[0].kernel().unwrap();
    assert!(
        kernel.source.contains("[k] = a.own0;"),
        "the sum computed again\n{}",
        kernel.source
    );
    assert_compiles(&kernel);
}

#[test]
fn a_group_norm_read_at_another_rows_element_is_not_generated() {
    let _serial = common::serial();
    let x = Tensor::randn([2, 8, 6, 6], (Kind::Float, CPU));
    let (_, trace) = StepTrace::record(|| {
        let y = x.group_norm(4, None::<Tensor>, None::<Tensor>, 1e-5, false);
        &y * y.transpose(2, 3)
    })
    .unwrap();
    let plan = FusionPlan::from_trace(&trace);
    let why = plan.groups()[0].kernel().unwrap_err();
    assert!(why.contains("read at another element"), "{why}");
}

#[test]
fn a_group_norms_normalised_elements_are_recomputed_in_the_backward_from_its_statistics() {
    let _serial = common::serial();
    // 4 MiB of fp32 normalised elements, which SiLU's backward reads.
    let x = Tensor::randn([4, 32, 64, 128], (Kind::BFloat16, CPU)).set_requires_grad(true);
    let w = Tensor::ones([32], (Kind::Float, CPU)).set_requires_grad(true);
    let b = Tensor::zeros([32], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        let y = group_norm_silu(&x, &w, &b).to_kind(Kind::Float);
        (&y * &y).mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let recomputed: Vec<String> = (plan.groups().iter())
        .flat_map(|g| g.recomputed.clone())
        .collect();
    assert!(
        recomputed.iter().any(|r| r == "aten::native_group_norm"),
        "{recomputed:?}\n{plan}"
    );
}

/// The trace of a step through a bf16 tensor of `shape` plus a convolution-style bias (whose
/// gradient sums each channel, and whose output's gradient a call outside reads, as the
/// convolution's backward does), cast to fp32, group-normalised in `groups` groups, SiLU, a loss.
fn biased_group_norm_silu_step(shape: [i64; 4], groups: i64) -> StepTrace {
    let x = Tensor::randn(shape, (Kind::BFloat16, CPU)).set_requires_grad(true);
    let [w, b, bias] =
        [0, 1, 2].map(|_| Tensor::randn([shape[1]], (Kind::Float, CPU)).set_requires_grad(true));
    let (_, trace) = StepTrace::record(|| {
        let biased = &x * 2.0 + bias.to_kind(Kind::BFloat16).view([shape[1], 1, 1]);
        let y = (biased.to_kind(Kind::Float))
            .group_norm(groups, Some(&w), Some(&b), 1e-5, false)
            .silu();
        (&y * &y).mean(Kind::Float).backward();
    })
    .unwrap();
    trace
}

#[test]
fn a_group_norms_backward_joins_silus_backward_in_one_kernel_that_nvrtc_compiles() {
    let _serial = common::serial();
    // Rows of three channels of 5 × 7 (one element at a time) and of two of 6 × 6 (four).
    for (shape, groups) in [([3, 12, 5, 7], 4), ([2, 8, 6, 6], 4)] {
        let plan = FusionPlan::generatable(&biased_group_norm_silu_step(shape, groups));
        let group = (plan.groups().iter())
            .find(|g| (g.calls().iter()).any(|c| c.name == "aten::native_group_norm_backward"))
            .unwrap_or_else(|| panic!("{plan}"));
        let operators = names(&group.operators);
        assert!(operators.contains(&"silu_backward"), "{plan}");
        assert!(operators.contains(&"sum"), "the bias's gradient: {plan}");
        let kernel = group.kernel().unwrap();
        // A block per row, its sample's group of channels.
        assert_eq!(kernel.numel, (shape[0] * groups) as u64);
        // The weight's and bias's gradients, which outlive the step, the bias's sum and the
        // gradient doubled (the leaves'); not the input's gradient, fp32 or cast back to bf16,
        // which only the group reads.
        let outputs: Vec<(&str, u64)> = (kernel.args.iter())
            .filter_map(|a| match a {
                KernelArg::Output(t) => Some((t.dtype.as_str(), t.numel)),
                _ => None,
            })
            .collect();
        let elements = shape.iter().product::<i64>() as u64;
        let channels = shape[1] as u64;
        assert_eq!(
            outputs,
            [
                ("float", channels),
                ("float", channels),
                ("c10::BFloat16", channels),
                ("c10::BFloat16", elements)
            ],
            "{plan}"
        );
        assert_compiles(&kernel);
    }
}

/// A decoder's up-sampling as a tch user writes it: the input computed (so that the up-sampling
/// has a producer to join; nothing of the smaller size is stored, which a kernel over the larger
/// one cannot write), up-sampled to `size`, cast to bf16 for a convolution; its backward.
fn upsampling_step(shape: [i64; 4], size: [i64; 2]) -> StepTrace {
    let x = Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        let up = (&x * 2.0 + 1.0).upsample_nearest2d(size, None, None);
        let y = up.to_kind(Kind::BFloat16);
        (y.to_kind(Kind::Float) * 3.0).sum(Kind::Float).backward();
    })
    .unwrap();
    trace
}

#[test]
fn an_operator_autocast_runs_in_fp32_is_traced_as_its_casts_and_the_call_below_them() {
    let _serial = common::serial();
    let [x, y] = [0, 1].map(|_| Tensor::randn([4, 8], (Kind::BFloat16, Device::Cpu)));
    // Autocast runs `mse_loss` in fp32: its wrapper casts both inputs and calls it again, and
    // below autograd, where the kernels run, only the casts and the inner call are seen.
    let (_, trace) = StepTrace::record(|| {
        speedkit::amp::autocast::autocast(Device::Cpu, Kind::BFloat16, || {
            x.mse_loss(&y, tch::Reduction::Mean)
        })
        .unwrap()
    })
    .unwrap();
    let kernels = trace.kernels();
    let names: Vec<&str> = kernels.iter().map(|op| op.name.as_str()).collect();
    assert_eq!(
        names,
        ["aten::_to_copy", "aten::_to_copy", "aten::mse_loss"]
    );
    let loss = kernels[2];
    assert!(loss.input_tensors().all(|t| t.dtype == "float"), "{loss:?}");
}

#[test]
fn nearest_up_sampling_and_its_backward_join_their_chains_in_kernels_that_nvrtc_compiles() {
    let _serial = common::serial();
    // Twice the size, and a ratio that is not a whole number (5 x 7 to 12 x 9).
    for size in [[10, 14], [12, 9]] {
        let plan = FusionPlan::generatable(&upsampling_step([2, 3, 5, 7], size));
        for operator in [
            "aten::upsample_nearest2d",
            "aten::upsample_nearest2d_backward",
        ] {
            let group = (plan.groups().iter())
                .find(|g| (g.calls().iter()).any(|c| c.name == operator))
                .unwrap_or_else(|| panic!("{operator} {size:?}: {plan}"));
            assert!(group.calls().len() > 1, "{operator} alone: {plan}");
            assert_compiles(&group.kernel().unwrap());
        }
    }
}

#[test]
fn a_group_norms_backward_on_small_maps_takes_its_row_whole() {
    let _serial = common::serial();
    // Channels of 16 × 16 (a warp's 128 elements divide them) and of 4 × 4 (a channel is four
    // lanes): channel by channel, most of a block's threads would wait.
    for shape in [[2, 32, 16, 16], [2, 32, 4, 4]] {
        let plan = FusionPlan::generatable(&biased_group_norm_silu_step(shape, 4));
        let group = (plan.groups().iter())
            .find(|g| (g.calls().iter()).any(|c| c.name == "aten::native_group_norm_backward"))
            .unwrap_or_else(|| panic!("{plan}"));
        let kernel = group.kernel().unwrap();
        let lanes = (shape[2] * shape[3] / 4).min(32);
        assert!(
            kernel.source.contains(&format!("lane_sum<{lanes}>")),
            "{shape:?}: the row's slots not summed in chunks of {lanes} lanes\n{}",
            kernel.source
        );
        let sums = names(&group.operators).contains(&"sum");
        assert!(sums, "the bias's gradient: {plan}");
        assert_compiles(&kernel);
    }
}

#[test]
fn a_gradient_a_channel_sum_reads_is_written_though_nothing_else_reads_it() {
    let _serial = common::serial();
    let shape = [2, 8, 6, 6];
    // The bias added to a leaf: autograd hands the sum's input on as the leaf's gradient, which no
    // call of the step reads. In bf16, the sum reads the cast of the norm's input gradient; in
    // fp32, the norm's backward's own first result.
    for (kind, dtype) in [(Kind::BFloat16, "c10::BFloat16"), (Kind::Float, "float")] {
        let x = Tensor::randn(shape, (kind, CPU)).set_requires_grad(true);
        let [w, b, bias] = [0, 1, 2]
            .map(|_| Tensor::randn([shape[1]], (Kind::Float, CPU)).set_requires_grad(true));
        let (_, trace) = StepTrace::record(|| {
            let biased = &x + bias.to_kind(kind).view([shape[1], 1, 1]);
            let y = biased
                .to_kind(Kind::Float)
                .group_norm(4, Some(&w), Some(&b), 1e-5, false)
                .silu();
            (&y * &y).mean(Kind::Float).backward();
        })
        .unwrap();
        let plan = FusionPlan::generatable(&trace);
        let group = (plan.groups().iter())
            .find(|g| (g.calls().iter()).any(|c| c.name == "aten::sum"))
            .unwrap_or_else(|| panic!("{plan}"));
        let kernel = group.kernel().unwrap();
        let elements = shape.iter().product::<i64>() as u64;
        let written = (kernel.args.iter())
            .any(|a| matches!(a, KernelArg::Output(t) if t.numel == elements && t.dtype == dtype));
        assert!(written, "{kind:?}: the leaf's gradient:\n{}", kernel.source);
    }
}

#[test]
fn an_in_place_accumulation_joins_its_chain_and_writes_the_memory_it_rewrites() {
    let _serial = common::serial();
    let x = Tensor::randn([16, 32], (Kind::Float, CPU));
    let accumulated = Tensor::randn([16, 32], (Kind::Float, CPU));
    // As autograd accumulates a gradient read by two operators: `add_` into memory from outside.
    let (_, trace) = StepTrace::record(|| {
        let _ = accumulated.shallow_clone().g_add_(&(&x * 3.0).silu());
        accumulated.exp()
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    assert_eq!(plan.groups().len(), 1, "{plan}");
    assert_eq!(
        names(&plan.groups()[0].operators),
        ["mul", "silu", "add_", "exp"]
    );
    let group = &plan.groups()[0];
    let kernel = group.kernel().unwrap();
    let add = group
        .calls()
        .iter()
        .find(|c| c.name == "aten::add_")
        .unwrap();
    let target = add.input_tensors().next().unwrap().storage;
    let written: Vec<&speedkit::trace::TracedTensor> = kernel
        .args
        .iter()
        .filter_map(|a| match a {
            KernelArg::Output(t) => Some(t),
            _ => None,
        })
        .collect();
    assert_eq!(written.len(), 2, "the rewritten memory and exp's result");
    assert!(written.iter().any(|t| t.storage == target), "{written:?}");
    assert_compiles(&kernel);
}

#[test]
fn memory_rewritten_in_place_and_read_at_other_elements_is_not_generated() {
    let _serial = common::serial();
    let x = Tensor::randn([32, 16], (Kind::Float, CPU));
    let accumulated = Tensor::randn([16, 32], (Kind::Float, CPU));
    // `y` reads the accumulated memory transposed: element (i, j) of one thread is element (j, i)
    // that another thread rewrites.
    let (_, trace) = StepTrace::record(|| {
        let y = (&x + accumulated.tr()).exp();
        accumulated.shallow_clone().g_add_(&y.tr())
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    assert_eq!(plan.groups().len(), 1, "{plan}");
    let why = plan.groups()[0].kernel().unwrap_err();
    assert!(why.contains("in-place operator rewrites"), "{why}");
}

/// The operators whose results the runnable plan of SwiGLU's step (on leaves of `rows` rows)
/// recomputes in the backward; `gate_read_again`: the forward reads the gate once more.
fn recomputed_in_swiglu(rows: i64, gate_read_again: bool) -> Vec<String> {
    tch::manual_seed(0);
    let leaf = |r, c| (Tensor::randn([r, c], (Kind::Float, CPU)) * 0.05).set_requires_grad(true);
    let (x, w1, w3, w2) = (
        leaf(rows, 256),
        leaf(256, 1024),
        leaf(256, 1024),
        leaf(1024, 256),
    );
    let (_, trace) = StepTrace::record(|| {
        let gate = x.matmul(&w1).silu();
        let loss = (&gate * x.matmul(&w3))
            .matmul(&w2)
            .square()
            .mean(Kind::Float);
        let loss = match gate_read_again {
            true => loss + gate.sum(Kind::Float),
            false => loss,
        };
        loss.backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    plan.groups()
        .iter()
        .flat_map(|g| g.recomputed.clone())
        .collect()
}

#[test]
fn swiglus_backward_is_one_group_though_the_up_projection_reads_its_result_first() {
    let _serial = common::serial();
    tch::manual_seed(0);
    let leaf =
        |shape: &[i64]| (Tensor::randn(shape, (Kind::Float, CPU)) * 0.05).set_requires_grad(true);
    let (x, w1, w3, w2) = (
        leaf(&[4, 128, 256]),
        leaf(&[256, 1024]),
        leaf(&[256, 1024]),
        leaf(&[1024, 256]),
    );
    let (_, trace) = StepTrace::record(|| {
        let gate = x.matmul(&w1).silu();
        let product = &gate * x.matmul(&w3);
        product.matmul(&w2).square().mean(Kind::Float).backward();
    })
    .unwrap();
    // The product's backward makes the up-projection's gradient, which its GEMMs read, then
    // the gate's, which `silu_backward` reads with the gate's input: the forward's `silu` held
    // that input long before, and the kernel takes it from there, so it runs before the GEMMs.
    let plan = FusionPlan::generatable(&trace);
    let backward = (plan.groups().iter())
        .find(|g| g.operators.iter().any(|o| o == "aten::silu_backward"))
        .unwrap_or_else(|| panic!("silu_backward in no group: {plan}"));
    let computed: Vec<&str> = names(&backward.operators)
        .into_iter()
        .filter(|o| ["mul", "silu_backward"].contains(o))
        .collect();
    assert_eq!(computed, ["mul", "mul", "silu_backward"], "{plan}");
    assert!(backward.kernel().is_ok(), "{plan}");
}

#[test]
fn swiglus_gate_is_recomputed_in_the_backward_instead_of_saved() {
    let _serial = common::serial();
    // The gate (512 x 1024 fp32, 2 MiB) is read by the product, then by its backward only; its
    // kernel reads what silu's backward keeps anyway.
    assert_eq!(recomputed_in_swiglu(512, false), ["aten::silu"]);
}

#[test]
fn a_result_the_forward_reads_again_is_saved() {
    let _serial = common::serial();
    assert!(recomputed_in_swiglu(512, true).is_empty());
}

#[test]
fn a_result_too_small_for_a_kernel_of_its_own_is_saved() {
    let _serial = common::serial();
    // 64 x 1024 fp32: 256 KiB.
    assert!(recomputed_in_swiglu(64, false).is_empty());
}

#[test]
fn a_generated_kernel_is_named_by_its_source() {
    let _serial = common::serial();
    let kernel_of = |rows: i64| {
        let x = Tensor::randn([rows, 8], (Kind::Float, CPU));
        let (_, trace) = StepTrace::record(|| (&x * 2.0).exp()).unwrap();
        FusionPlan::from_trace(&trace).groups()[0].kernel().unwrap()
    };
    let (a, b, c) = (kernel_of(4), kernel_of(4), kernel_of(5));
    assert_eq!(a, b);
    assert_ne!(a.name, c.name);
    assert!(a.source.contains(&format!("void {}(", a.name)));
}

/// `chain` traced on `inputs` (in `kind`) on the GPU, its one group generated, compiled and run on
/// the same inputs; its result against ATen's.
fn generated_matches_aten(
    kind: Kind,
    inputs: &[Tensor],
    chain: impl Fn(&[Tensor]) -> Tensor,
) -> f64 {
    let (expected, trace) = StepTrace::record(|| chain(inputs)).unwrap();
    let plan = FusionPlan::from_trace(&trace);
    assert_eq!(plan.groups().len(), 1, "{plan}");
    let kernel = plan.groups()[0].kernel().unwrap();
    let device = expected.device();
    let launcher = module_of(&kernel)
        .kernel(&kernel.name, &kernel.params(), device)
        .unwrap();
    // The kernel writes each result in its traced layout (a transposed read may give a
    // transposed result): a dense buffer, seen through the result's strides.
    let buffer = Tensor::empty([expected.numel() as i64], (expected.kind(), device));
    let output = buffer.as_strided(expected.size(), expected.stride(), 0);
    let by_shape = |t: &speedkit::trace::TracedTensor| {
        inputs
            .iter()
            .find(|i| i.size() == t.shape && i.device() == device)
            .unwrap()
    };
    let mut args: Vec<speedkit::cuda::Arg> = Vec::new();
    for arg in &kernel.args {
        args.push(match arg {
            KernelArg::Input(t) => by_shape(t).into(),
            KernelArg::Scalar(_) => panic!("no CPU scalar in these chains"),
            KernelArg::Output(_) => (&buffer).into(),
        });
    }
    args.push((kernel.numel as i64).into());
    launcher.launch(132, 256, 0, &args).unwrap();
    assert_eq!(output.kind(), kind);
    let gap = (&output.to_kind(Kind::Float) - expected.to_kind(Kind::Float))
        .abs()
        .max();
    gap.double_value(&[])
}

/// The one group of `chain`'s trace on the CPU, generated.
fn kernel_of_chain(chain: impl FnOnce() -> Tensor) -> GeneratedKernel {
    let (_, trace) = StepTrace::record(chain).unwrap();
    let plan = FusionPlan::from_trace(&trace);
    assert_eq!(plan.groups().len(), 1, "{plan}");
    plan.groups()[0].kernel().unwrap()
}

#[test]
fn a_pointwise_kernel_of_16_bit_tensors_takes_eight_elements_a_thread() {
    let _serial = common::serial();
    let chain = |kind: Kind| {
        let x = Tensor::randn([40, 64], (kind, CPU));
        let row = Tensor::randn([64], (kind, CPU));
        move || (&x * &row + 1.5).silu() * &x
    };
    let bf16 = kernel_of_chain(chain(Kind::BFloat16));
    assert!(bf16.source.contains("store8(a."), "{}", bf16.source);
    let (grid, _) = bf16.grid_and_block();
    assert_eq!(grid, (40 * 64u32).div_ceil(256 * 8));
    // fp32's four elements are 16 bytes already.
    let fp32 = kernel_of_chain(chain(Kind::Float));
    assert!(fp32.source.contains("store4(a.") && !fp32.source.contains("store8(a."));
    assert_compiles(&bf16);
    assert_compiles(&fp32);
}

#[test]
fn a_16_bit_kernel_whose_elements_come_in_no_groups_of_eight_takes_four() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 44], (Kind::BFloat16, CPU));
    let kernel = kernel_of_chain(|| (&x * 2.0).silu());
    assert!(kernel.source.contains("store4(a."), "{}", kernel.source);
}

#[test]
fn generated_pointwise_kernels_give_atens_values_in_fp32_bf16_and_fp16() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("generated_pointwise_kernels_give_atens_values_in_fp32_bf16_and_fp16")
    else {
        return;
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        // Odd sizes, a broadcast row, and a transposed view of a result inside the group (index
        // arithmetic, no copy). The inputs differ in shape: the test finds them by it.
        let x = Tensor::randn([37, 53], (kind, device));
        let row = Tensor::randn([53], (kind, device));
        let other = Tensor::randn([53, 37], (kind, device));
        let inputs = [x, row, other];
        let forward = generated_matches_aten(kind, &inputs, |t| {
            let y = (&t[0] * &t[1] + 1.5).silu() - (&t[2] * 2.0).tr().sigmoid();
            y.where_self(&t[0].gt(0.0), &(&t[0] * 0.5)).tanh()
        });
        let backward = generated_matches_aten(kind, &inputs, |t| {
            let g = &t[0] * &t[1];
            let u = (&t[2] - 0.25).tr();
            g.silu_backward(&u) * Tensor::sigmoid_backward(&t[0], &u.sigmoid())
        });
        // A row reduction with work before and after it: RMSNorm, and a max-subtraction.
        let rms_norm = generated_matches_aten(kind, &inputs, |t| {
            let rms = (t[0].pow_tensor_scalar(2).mean_dim(-1, true, kind) + 1e-6).rsqrt();
            &t[0] * rms * &t[1]
        });
        let max_shift = generated_matches_aten(kind, &inputs, |t| {
            let y = &t[0] * 2.0;
            (&y - y.amax(-1, true)).exp()
        });
        // ATen rounds each operator's result to `kind` as the kernel does; what is left is the
        // last bit of the transcendental functions and the order of a reduction's sums.
        let tolerance = if kind == Kind::Float { 1e-5 } else { 1e-2 };
        let gaps = [forward, backward, rms_norm, max_shift];
        assert!(gaps.iter().all(|&g| g < tolerance), "{kind:?}: {gaps:?}");
    }
}

#[test]
fn generated_16_bit_kernels_eight_elements_a_thread_give_atens_values() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("generated_16_bit_kernels_eight_elements_a_thread_give_atens_values")
    else {
        return;
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        // Groups of eight: each thread's own elements loaded 16 bytes at once, beside a broadcast
        // row, a transposed view and the halves of a rotary embedding read element by element.
        let x = Tensor::randn([40, 64], (kind, device));
        let row = Tensor::randn([64], (kind, device));
        let other = Tensor::randn([64, 40], (kind, device));
        let inputs = [x, row, other];
        let pointwise = generated_matches_aten(kind, &inputs, |t| {
            (&t[0] * &t[1] + 1.5).silu() - (&t[2] * 2.0).tr().sigmoid()
        });
        let rotary = generated_matches_aten(kind, &inputs, |t| {
            let y = &t[0] * 0.5;
            let rotated = Tensor::cat(&[-y.narrow(-1, 32, 32), y.narrow(-1, 0, 32)], -1);
            &y + rotated * &t[1]
        });
        let gaps = [pointwise, rotary];
        assert!(gaps.iter().all(|&g| g < 1e-2), "{kind:?}: {gaps:?}");
    }
}

#[test]
fn a_result_read_in_its_group_and_handed_to_a_leaf_as_its_gradient_is_written() {
    let _serial = common::serial();
    let [x, w] = [0, 1].map(|_| Tensor::randn([6, 10], (Kind::Float, CPU)).set_requires_grad(true));
    // `sub`'s backward hands its gradient on as it is to the leaf `x`, which no call of the step
    // reads, and negated to `silu`'s backward, in the group that makes it.
    let (_, trace) = StepTrace::record(|| {
        let z = &x - (&w * 3.0).silu();
        (&z * 3.0).silu().sum(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let handed_to_x = (trace.ops().iter())
        .find(|op| op.name.ends_with("AccumulateGrad") && op.input_tensors().count() == 1)
        .and_then(|op| op.input_tensors().next())
        .map(|t| t.storage);
    let group = (plan.groups().iter())
        .find(|g| g.backward)
        .unwrap_or_else(|| panic!("{plan}"));
    let kernel = group.kernel().unwrap();
    let written: Vec<u64> = (kernel.args.iter())
        .filter_map(|a| match a {
            KernelArg::Output(t) => Some(t.storage),
            _ => None,
        })
        .collect();
    let handed_to_x = handed_to_x.expect("the leaf's gradient");
    assert!(written.contains(&handed_to_x), "{plan}\n{}", kernel.source);
}

#[test]
fn a_weights_sum_over_rows_joins_its_norms_backward_in_one_kernel_that_nvrtc_compiles() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 37, 53], (Kind::Float, CPU)).set_requires_grad(true);
    let w = Tensor::randn([53], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt();
        let y = &x * rms * &w;
        (&y * &y).sum(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let sums_columns = |c: &TracedOp| {
        c.name == "aten::sum" && c.output_tensors().next().is_some_and(|t| t.numel == 53)
    };
    let group = (plan.groups().iter())
        .find(|g| g.calls().iter().any(sums_columns))
        .unwrap_or_else(|| panic!("the weight's gradient is left to ATen: {plan}"));
    // With the row sums of the input's gradient.
    let row_sum = |c: &TracedOp| {
        c.name == "aten::sum" && c.output_tensors().next().is_some_and(|t| t.numel == 3 * 37)
    };
    assert!(group.calls().iter().any(row_sum), "{plan}");
    let kernel = group.kernel().unwrap();
    let outputs: Vec<u64> = (kernel.args.iter())
        .filter_map(|a| match a {
            KernelArg::Output(t) => Some(t.numel),
            _ => None,
        })
        .collect();
    // The input's gradient and the weight's: not the product the weight's sums, which only the
    // kernel reads.
    assert_eq!(
        outputs.iter().filter(|&&n| n == 53).count(),
        1,
        "{}",
        kernel.source
    );
    assert_eq!(
        outputs.iter().filter(|&&n| n == 3 * 37 * 53).count(),
        1,
        "{}",
        kernel.source
    );
    assert_compiles(&kernel);
}

#[test]
fn a_layer_scales_gradient_over_a_pooled_images_gradient_leaves_its_sum_and_fuses_the_rest() {
    let _serial = common::serial();
    let x = Tensor::randn([3, 77, 5, 7], (Kind::Float, CPU)).set_requires_grad(true);
    let pixels = Tensor::randn([3, 5, 7, 77], (Kind::BFloat16, CPU)).set_requires_grad(true);
    let scale = Tensor::randn([77], (Kind::Float, CPU)).set_requires_grad(true);
    let (_, trace) = StepTrace::record(|| {
        // A ConvNeXt block's scaled MLP added to an NCHW image, then pooled: the gradient the
        // scale's sum reads is the pool's, expanded over the pixels and permuted, so no row of
        // it lies in memory as the sum's columns.
        let y = &x + (&pixels * &scale).permute([0, 3, 1, 2]);
        let pooled = y.mean_dim([2, 3].as_slice(), false, Kind::Float);
        pooled.square().mean(Kind::Float).backward();
    })
    .unwrap();
    let plan = FusionPlan::generatable(&trace);
    let products = group_holding(&plan, "aten::_to_copy");
    assert!(!names(&products.operators).contains(&"sum"), "{plan}");
    assert_compiles(&products.kernel().unwrap());
    let sum = (plan.left_to_aten().iter())
        .find(|l| l.operator == "aten::sum")
        .unwrap_or_else(|| panic!("{plan}"));
    assert_eq!(sum.calls, 1, "{plan}");
}

#[test]
fn a_layer_norms_backward_for_a_gpu_runs_one_wave_of_the_blocks_its_sms_hold() {
    let _serial = common::serial();
    let plan = residual_layer_norm_backward(3000, 768);
    let group = group_holding(&plan, "aten::native_layer_norm_backward");
    // 192 threads a block, at most 40 registers a thread: 8 blocks an SM.
    let h200 = group.kernel_for(132).unwrap();
    assert_compiles(&h200);
    assert_eq!(h200.grid_and_block(), (1056, 192));
    assert!(
        h200.source.contains("__launch_bounds__(192, 8)"),
        "the kernel asks for the registers of 8 blocks an SM"
    );
    assert_eq!(group.kernel_for(108).unwrap().grid_and_block(), (864, 192));
    // Without a GPU to plan for: a block a row up to 1365 blocks of 192 threads.
    assert_eq!(group.kernel().unwrap().grid_and_block(), (1365, 192));
}

#[test]
fn a_narrow_layer_norms_backward_for_a_gpu_keeps_its_blocks_as_without_one() {
    let _serial = common::serial();
    let plan = residual_layer_norm_backward(3000, 384);
    let group = group_holding(&plan, "aten::native_layer_norm_backward");
    // 96 threads a block: 2730 blocks (1024 × 256 / 96), on any GPU.
    let h200 = group.kernel_for(132).unwrap();
    assert_eq!(h200.grid_and_block(), (2730, 96));
    assert_eq!(h200.source, group.kernel().unwrap().source);
}
