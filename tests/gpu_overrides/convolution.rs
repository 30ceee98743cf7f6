//! The convolution override under autocast against ATen's, the weight copy it saves, declines.

use crate::common;
use crate::support::channels_last;
use speedkit::config::{AutoBool, SpeedConfig};
use speedkit::flags::{Flag, FlagGuard, FlagSetting, FlagValue};
use speedkit::memory::MemoryUse;
use speedkit::overrides::{choose_depthwise, CudnnPlans, DepthwiseChoice, Override};
use speedkit::SpeedContext;
use tch::{Device, Kind, Tensor};

/// One convolution case: input and weight shapes, stride, padding, dilation (one value per spatial
/// dimension) and groups.
struct ConvCase {
    x: &'static [i64],
    w: &'static [i64],
    stride: &'static [i64],
    padding: &'static [i64],
    dilation: &'static [i64],
    groups: i64,
}

/// The convolution of `case` as tch's modules call it: `conv1d`, `conv2d` or `conv3d` by rank.
fn conv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, case: &ConvCase) -> Tensor {
    let (s, p, d, g) = (case.stride, case.padding, case.dilation, case.groups);
    match case.w.len() {
        3 => x.conv1d(w, b, s, p, d, g),
        4 => x.conv2d(w, b, s, p, d, g),
        _ => x.conv3d(w, b, s, p, d, g),
    }
}

/// y, dx, dweight, dbias of `case`'s convolution under CUDA autocast (bf16) for the upstream
/// gradient `dy`, and the bytes the forward left allocated besides `y`.
fn conv_pass(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    case: &ConvCase,
) -> (Vec<Tensor>, u64) {
    conv_pass_in(Kind::BFloat16, x, w, b, dy, case)
}

/// As [`conv_pass`], under autocast to `kind`.
fn conv_pass_in(
    kind: Kind,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    case: &ConvCase,
) -> (Vec<Tensor>, u64) {
    let x = x.detach().set_requires_grad(true);
    let w = w.detach().set_requires_grad(true);
    let b = b.map(|t| t.detach().set_requires_grad(true));
    let before = MemoryUse::now(x.device()).unwrap().allocated;
    let y = speedkit::amp::autocast(x.device(), kind, || conv(&x, &w, b.as_ref(), case)).unwrap();
    let held = MemoryUse::now(x.device()).unwrap().allocated - before;
    (y.to_kind(Kind::Float) * dy).sum(Kind::Float).backward();
    let db = b.as_ref().map_or_else(
        || Tensor::zeros([1], (Kind::Float, x.device())),
        Tensor::grad,
    );
    (vec![y.detach(), x.grad(), w.grad(), db], held)
}

#[test]
fn convolution_under_autocast_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "convolution_under_autocast_matches_atens_forward_and_backward_on_odd_shapes",
    ) else {
        return;
    };
    let cases = [
        ConvCase {
            x: &[3, 5, 17],
            w: &[7, 5, 3],
            stride: &[2],
            padding: &[1],
            dilation: &[1],
            groups: 1,
        },
        ConvCase {
            x: &[2, 6, 11, 9],
            w: &[10, 3, 3, 5],
            stride: &[1, 2],
            padding: &[1, 2],
            dilation: &[2, 1],
            groups: 2,
        },
        ConvCase {
            x: &[4, 16, 13, 13],
            w: &[33, 16, 3, 3],
            stride: &[1, 1],
            padding: &[1, 1],
            dilation: &[1, 1],
            groups: 1,
        },
        ConvCase {
            x: &[2, 3, 5, 6, 7],
            w: &[4, 3, 2, 3, 3],
            stride: &[1, 1, 2],
            padding: &[0, 1, 1],
            dilation: &[1, 1, 1],
            groups: 1,
        },
    ];
    for case in &cases {
        for (x_kind, last) in [
            (Kind::Float, false),
            (Kind::BFloat16, false),
            (Kind::Float, true),
        ] {
            for with_bias in [true, false] {
                let name = format!(
                    "x {:?} w {:?} {x_kind:?} channels-last {last} bias {with_bias}",
                    case.x, case.w
                );
                let fan_in: i64 = case.w[1..].iter().product();
                let mut x = Tensor::randn(case.x, (Kind::Float, device)).to_kind(x_kind);
                let mut w = Tensor::randn(case.w, (Kind::Float, device)) / (fan_in as f64).sqrt();
                if last {
                    x = channels_last(&x);
                    w = channels_last(&w);
                }
                let b = with_bias.then(|| Tensor::randn([case.w[0]], (Kind::Float, device)));
                let y_shape = {
                    let _off = common::hold_override(Override::Convolution, false);
                    conv(&x.to_kind(Kind::Float), &w, b.as_ref(), case).size()
                };
                let dy = Tensor::randn(y_shape.as_slice(), (Kind::Float, device));
                let (expected, _) = {
                    let _off = common::hold_override(Override::Convolution, false);
                    conv_pass(&x, &w, b.as_ref(), &dy, case)
                };
                let _on = common::hold_override(Override::Convolution, true);
                let (got, _) = conv_pass(&x, &w, b.as_ref(), &dy, case);
                let op = ["aten::conv1d", "aten::conv2d", "aten::conv3d"][case.w.len() - 3];
                let stats = Override::Convolution.stats(op).unwrap();
                assert_eq!((stats.ran, stats.declined), (1, 0), "{name}: {stats:?}");
                let kinds: Vec<Kind> = got.iter().map(Tensor::kind).collect();
                let expected_kinds: Vec<Kind> = expected.iter().map(Tensor::kind).collect();
                assert_eq!(kinds, expected_kinds, "{name}: the types autocast gives");
                // ATen's convolutions on the same bf16 operands; the weight is cast again in the
                // backward, to the same bf16 values.
                for (what, i) in [("y", 0), ("dx", 1), ("dw", 2), ("db", 3)] {
                    let err = common::rel_err(&got[i], &expected[i]);
                    assert!(err < 1e-2, "{name} {what}: relative error {err}");
                }
            }
        }
    }
}

#[test]
fn a_convolution_under_autocast_keeps_no_copy_of_its_weight_for_the_backward() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_convolution_under_autocast_keeps_no_copy_of_its_weight_for_the_backward",
    ) else {
        return;
    };
    // A wide weight over a small image: the weight's bf16 copy (4.5 MiB) outweighs the
    // activations that both paths keep.
    let case = ConvCase {
        x: &[2, 512, 6, 6],
        w: &[512, 512, 3, 3],
        stride: &[1, 1],
        padding: &[1, 1],
        dilation: &[1, 1],
        groups: 1,
    };
    let x = Tensor::randn(case.x, (Kind::Float, device));
    let w = Tensor::randn(case.w, (Kind::Float, device)) / 48.0;
    let dy = Tensor::randn([2, 512, 6, 6], (Kind::Float, device));
    let copy = (w.numel() * 2) as u64;
    let held_aten = {
        let _off = common::hold_override(Override::Convolution, false);
        conv_pass(&x, &w, None, &dy, &case);
        conv_pass(&x, &w, None, &dy, &case).1
    };
    let _on = common::hold_override(Override::Convolution, true);
    conv_pass(&x, &w, None, &dy, &case);
    let held = conv_pass(&x, &w, None, &dy, &case).1;
    assert!(
        held_aten >= copy,
        "autocast keeps the copy: {held_aten} bytes held"
    );
    assert!(
        held + copy <= held_aten,
        "the forward kept {held} bytes, autocast's {held_aten}"
    );
}

#[test]
fn convolution_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "convolution_operands_autocast_leaves_alone_run_autocasts_path_and_are_counted",
    ) else {
        return;
    };
    let x = Tensor::randn([2, 3, 8, 8], (Kind::Double, device));
    let w = Tensor::randn([4, 3, 3, 3], (Kind::Double, device));
    let run = || {
        speedkit::amp::autocast(device, Kind::BFloat16, || {
            x.conv2d(&w, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1)
        })
        .unwrap()
    };
    let expected = run();
    let _on = common::hold_override(Override::Convolution, true);
    let got = run();
    assert_eq!(got.kind(), Kind::Double);
    assert!(got.equal(&expected), "autocast's own path ran");
    let stats = Override::Convolution.stats("aten::conv2d").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    let last = stats.last_declined.unwrap_or_default();
    assert!(last.contains("Double operands"), "declined for {last}");
}

/// Holds `cudnn.benchmark` on while the guard lives: speedkit's cuDNN plans serve the convolutions
/// ATen would autotune.
fn hold_autotuning() -> FlagGuard {
    FlagGuard::apply(&[FlagSetting::new(
        Flag::CudnnBenchmark,
        FlagValue::Bool(true),
        "test",
    )])
    .expect("cudnn.benchmark is settable")
}

/// 2-D cases for the plans: grouped and dilated, strided, and a 1×1.
const PLAN_CASES: [ConvCase; 3] = [
    ConvCase {
        x: &[2, 6, 11, 9],
        w: &[10, 3, 3, 5],
        stride: &[1, 2],
        padding: &[1, 2],
        dilation: &[2, 1],
        groups: 2,
    },
    ConvCase {
        x: &[3, 8, 15, 17],
        w: &[40, 8, 3, 3],
        stride: &[2, 2],
        padding: &[1, 1],
        dilation: &[1, 1],
        groups: 1,
    },
    ConvCase {
        x: &[5, 32, 7, 7],
        w: &[16, 32, 1, 1],
        stride: &[1, 1],
        padding: &[0, 0],
        dilation: &[1, 1],
        groups: 1,
    },
];

/// `case`'s operands on `device`, channels-last where `last`: x, w, bias and the output's gradient.
fn plan_operands(case: &ConvCase, device: Device, last: bool) -> [Tensor; 4] {
    let fan_in: i64 = case.w[1..].iter().product();
    let mut x = Tensor::randn(case.x, (Kind::Float, device));
    let mut w = Tensor::randn(case.w, (Kind::Float, device)) / (fan_in as f64).sqrt();
    if last {
        x = channels_last(&x);
        w = channels_last(&w);
    }
    let b = Tensor::randn([case.w[0]], (Kind::Float, device));
    let y_shape = {
        let _off = common::hold_override(Override::Convolution, false);
        conv(&x, &w, Some(&b), case).size()
    };
    let dy = Tensor::randn(y_shape.as_slice(), (Kind::Float, device));
    [x, w, b, dy]
}

#[test]
fn convolutions_through_speedkits_cudnn_plans_match_atens_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "convolutions_through_speedkits_cudnn_plans_match_atens_on_odd_shapes",
    ) else {
        return;
    };
    let _tuned = hold_autotuning();
    for case in &PLAN_CASES {
        for kind in [Kind::BFloat16, Kind::Half] {
            for last in [false, true] {
                let name = format!(
                    "x {:?} w {:?} {kind:?} channels-last {last}",
                    case.x, case.w
                );
                let [x, w, b, dy] = plan_operands(case, device, last);
                let (expected, _) = {
                    let _off = common::hold_override(Override::Convolution, false);
                    conv_pass_in(kind, &x, &w, Some(&b), &dy, case)
                };
                let before = CudnnPlans::now();
                let _on = common::hold_override(Override::Convolution, true);
                let (got, _) = conv_pass_in(kind, &x, &w, Some(&b), &dy, case);
                let after = CudnnPlans::now();
                // A plan for each of the three passes, new to this process.
                let taken = (after.timed + after.from_disk) - (before.timed + before.from_disk);
                assert_eq!(taken, 3, "{name}: {before:?} then {after:?}");
                assert_eq!(after.to_aten, before.to_aten, "{name}");
                for (what, i) in [("y", 0), ("dx", 1), ("dw", 2), ("db", 3)] {
                    let err = common::rel_err(&got[i], &expected[i]);
                    assert!(err < 1e-2, "{name} {what}: relative error {err}");
                }
                assert_eq!(got[0].size(), expected[0].size(), "{name}");
                let layout = |t: &Tensor| t.stride();
                assert_eq!(layout(&got[0]), layout(&expected[0]), "{name}: y's layout");
            }
        }
    }
}

/// What the child processes of the tests below print before the plan counts (timed, from the
/// kernel cache, left to ATen).
const PLANS_LINE: &str = "cudnn plans:";

fn print_plan_counts() {
    let plans = CudnnPlans::now();
    println!(
        "{PLANS_LINE} {} {} {}",
        plans.timed, plans.from_disk, plans.to_aten
    );
}

/// Runs the ignored test `name` of this binary twice, as two processes sharing one empty kernel
/// cache: the plan counts each printed, in order.
fn plan_counts_of_two_processes(name: &str) -> [Vec<[u64; 3]>; 2] {
    let cache = std::env::temp_dir().join(format!(
        "speedkit-cudnn-plans-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&cache);
    let run = || {
        let exe = std::env::current_exe().expect("the test binary's path");
        let output = std::process::Command::new(exe)
            .args(["--exact", &format!("convolution::{name}")])
            .args(["--ignored", "--nocapture", "--test-threads=1"])
            .env("SPEEDKIT_KERNEL_CACHE", &cache)
            .output()
            .expect("the child process runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let counts: Vec<[u64; 3]> = (stdout.lines())
            .filter_map(|l| l.split_once(PLANS_LINE).map(|(_, counts)| counts))
            .map(|line| {
                let n: Vec<u64> = line
                    .split_whitespace()
                    .map(|n| n.parse().unwrap())
                    .collect();
                [n[0], n[1], n[2]]
            })
            .collect();
        assert!(
            output.status.success() && !counts.is_empty(),
            "{name}:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        counts
    };
    let counts = [run(), run()];
    let _ = std::fs::remove_dir_all(&cache);
    counts
}

#[test]
#[ignore = "a child process of a_later_process_builds_the_chosen_cudnn_plans_from_the_kernel_cache_without_timing"]
fn one_convolution_step_through_cudnn_plans() {
    let _serial = common::serial();
    let device = Device::Cuda(0);
    let _tuned = hold_autotuning();
    let _on = common::hold_override(Override::Convolution, true);
    let case = &PLAN_CASES[1];
    let [x, w, b, dy] = plan_operands(case, device, true);
    conv_pass_in(Kind::BFloat16, &x, &w, Some(&b), &dy, case);
    print_plan_counts();
}

#[test]
fn a_later_process_builds_the_chosen_cudnn_plans_from_the_kernel_cache_without_timing() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "a_later_process_builds_the_chosen_cudnn_plans_from_the_kernel_cache_without_timing",
    )
    .is_none()
    {
        return;
    }
    let [first, second] = plan_counts_of_two_processes("one_convolution_step_through_cudnn_plans");
    // The first process times the forward's, the data gradient's and the filter gradient's plans;
    // the second builds the same three from the files the first wrote.
    assert_eq!(first, [[3, 0, 0]], "the first process");
    assert_eq!(second, [[0, 3, 0]], "the second process");
}

#[test]
#[ignore = "a child process of the_first_steps_channels_last_convolutions_run_the_plans_an_earlier_run_kept"]
fn two_training_steps_of_a_channels_last_convolution() {
    let _serial = common::serial();
    let device = Device::Cuda(0);
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let mut vs = tch::nn::VarStore::new(device);
    let conv = tch::nn::conv2d(vs.root(), 8, 40, 3, Default::default());
    ctx.prepare(&mut vs).unwrap();
    // An input with a gradient, so that the backward runs both of its passes.
    let x = Tensor::randn([3, 8, 15, 17], (Kind::Float, device)).set_requires_grad(true);
    for _ in 0..2 {
        let y = ctx.autocast(|| x.apply(&conv));
        ctx.backward(&y.to_kind(Kind::Float).square().mean(Kind::Float))
            .unwrap();
        print_plan_counts();
    }
}

#[test]
fn the_first_steps_channels_last_convolutions_run_the_plans_an_earlier_run_kept() {
    let _serial = common::serial();
    if common::cuda_or_skip(
        "the_first_steps_channels_last_convolutions_run_the_plans_an_earlier_run_kept",
    )
    .is_none()
    {
        return;
    }
    let [first, second] =
        plan_counts_of_two_processes("two_training_steps_of_a_channels_last_convolution");
    // The first step runs while the channels-last census holds autotuning paused: the first
    // process's runs cuDNN's heuristics and times nothing, its second step times three plans; the
    // second process's first step builds those three from the kernel cache.
    assert_eq!(first, [[0, 0, 0], [3, 0, 0]], "the first process");
    assert_eq!(second, [[0, 3, 0], [0, 3, 0]], "the second process");
}

#[test]
fn a_channels_last_depthwise_convolution_runs_cudnn_plans_and_matches_atens() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_channels_last_depthwise_convolution_runs_cudnn_plans_and_matches_atens",
    ) else {
        return;
    };
    let _tuned = hold_autotuning();
    let _cudnn = choose_depthwise(DepthwiseChoice::Cudnn);
    // ATen gives a channels-last depthwise convolution to cuDNN. Its weight [C, 1, kh, kw] keeps
    // NCHW's strides, which the plans must describe as channels-last's, as ATen does.
    let case = ConvCase {
        x: &[3, 24, 9, 13],
        w: &[24, 1, 7, 7],
        stride: &[1, 1],
        padding: &[3, 3],
        dilation: &[1, 1],
        groups: 24,
    };
    let before = CudnnPlans::now();
    let runs = depthwise_pass_matches_atens(Kind::BFloat16, &case, device);
    let after = CudnnPlans::now();
    let taken = (after.timed + after.from_disk) - (before.timed + before.from_disk);
    assert_eq!(taken, 3, "{before:?} then {after:?}");
    assert_eq!(runs, 0, "passes on speedkit's depthwise kernel");
}

#[test]
fn a_convolution_first_met_during_a_graph_capture_runs_atens_and_its_replay_matches() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_convolution_first_met_during_a_graph_capture_runs_atens_and_its_replay_matches",
    ) else {
        return;
    };
    let mut config = SpeedConfig::auto();
    config.compile.enabled = AutoBool::On;
    config.compile.warmup_steps = 1;
    let ctx = SpeedContext::new(&config).unwrap();
    let _tuned = hold_autotuning();
    // The warm-up step convolves one shape, the captured step another: nothing may be timed
    // during a capture, so the second runs ATen's kernels, which ATen autotuned here before. Shapes
    // of no other test, whose plans this process would hold already.
    let warmup_case = &ConvCase {
        x: &[2, 12, 9, 7],
        w: &[20, 12, 3, 3],
        stride: &[1, 1],
        padding: &[1, 1],
        dilation: &[1, 1],
        groups: 1,
    };
    let captured_case = &ConvCase {
        x: &[4, 10, 13, 11],
        w: &[6, 5, 3, 3],
        stride: &[2, 2],
        padding: &[1, 0],
        dilation: &[1, 1],
        groups: 2,
    };
    let warmup_operands = plan_operands(warmup_case, device, true);
    let [x, w, b, dy] = plan_operands(captured_case, device, true);
    let flat = |results: Vec<Tensor>| {
        let flat: Vec<Tensor> = results
            .iter()
            .map(|t| t.to_kind(Kind::Float).flatten(0, -1))
            .collect();
        Tensor::cat(&flat, 0)
    };
    let expected = {
        let _off = common::hold_override(Override::Convolution, false);
        flat(conv_pass(&x, &w, Some(&b), &dy, captured_case).0)
    };
    let _on = common::hold_override(Override::Convolution, true);
    let before = CudnnPlans::now();
    let mut calls = 0;
    let mut g = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
        calls += 1;
        let results = if calls == 1 {
            let [x, w, b, dy] = &warmup_operands;
            conv_pass(x, w, Some(b), dy, warmup_case).0
        } else {
            conv_pass(&x, &w, Some(&b), &dy, captured_case).0
        };
        Ok(Some(flat(results)))
    });
    g.run(&[]).unwrap();
    let captured = g.run(&[]).unwrap().unwrap();
    let replayed = g.run(&[]).unwrap().unwrap();
    assert!(g.is_graphed(), "{:?}", g.fallback_reason());
    let after = CudnnPlans::now();
    // The forward, the data gradient and the filter gradient of the captured step.
    assert_eq!(
        after.to_aten - before.to_aten,
        3,
        "{before:?} then {after:?}"
    );
    for (what, got) in [("captured", &captured), ("replayed", &replayed)] {
        assert_eq!(got.size(), expected.size(), "{what}");
        let err = common::rel_err(got, &expected);
        assert!(err < 1e-2, "{what}: relative error {err}");
    }
}

/// Depthwise cases speedkit's kernel takes: every filter size, channels that fill no block of 32
/// (8, 40) and several, odd and non-square images, paddings from none to the filter's size less one,
/// different per dimension; one image smaller than the filter but for its padding.
const DEPTHWISE_CASES: [ConvCase; 6] = [
    ConvCase {
        x: &[3, 8, 9, 13],
        w: &[8, 1, 3, 3],
        stride: &[1, 1],
        padding: &[1, 1],
        dilation: &[1, 1],
        groups: 8,
    },
    ConvCase {
        x: &[2, 40, 17, 11],
        w: &[40, 1, 5, 5],
        stride: &[1, 1],
        padding: &[0, 4],
        dilation: &[1, 1],
        groups: 40,
    },
    ConvCase {
        x: &[2, 104, 33, 35],
        w: &[104, 1, 7, 7],
        stride: &[1, 1],
        padding: &[3, 2],
        dilation: &[1, 1],
        groups: 104,
    },
    ConvCase {
        x: &[5, 96, 8, 8],
        w: &[96, 1, 7, 7],
        stride: &[1, 1],
        padding: &[3, 3],
        dilation: &[1, 1],
        groups: 96,
    },
    ConvCase {
        x: &[1, 16, 4, 150],
        w: &[16, 1, 7, 7],
        stride: &[1, 1],
        padding: &[6, 0],
        dilation: &[1, 1],
        groups: 16,
    },
    ConvCase {
        x: &[2, 24, 3, 2],
        w: &[24, 1, 5, 5],
        stride: &[1, 1],
        padding: &[2, 2],
        dilation: &[1, 1],
        groups: 24,
    },
];

#[test]
fn depthwise_convolutions_on_speedkits_kernel_match_atens_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "depthwise_convolutions_on_speedkits_kernel_match_atens_on_odd_shapes",
    ) else {
        return;
    };
    let _tuned = hold_autotuning();
    let _kernel = choose_depthwise(DepthwiseChoice::Kernel);
    for case in &DEPTHWISE_CASES {
        for kind in [Kind::BFloat16, Kind::Half] {
            let runs = depthwise_pass_matches_atens(kind, case, device);
            assert_eq!(
                runs, 2,
                "x {:?} w {:?} {kind:?}: the forward and the input's gradient on the kernel",
                case.x, case.w
            );
        }
    }
}

/// Runs `case` under autocast to `kind` with the convolution override off (ATen's), then on, and
/// checks that every output agrees; returns how many passes ran on speedkit's depthwise kernel.
fn depthwise_pass_matches_atens(kind: Kind, case: &ConvCase, device: Device) -> u64 {
    let name = format!(
        "x {:?} w {:?} padding {:?} {kind:?}",
        case.x, case.w, case.padding
    );
    let [x, w, b, dy] = plan_operands(case, device, true);
    let (expected, _) = {
        let _off = common::hold_override(Override::Convolution, false);
        conv_pass_in(kind, &x, &w, Some(&b), &dy, case)
    };
    let before = CudnnPlans::now().depthwise_kernel_runs;
    let _on = common::hold_override(Override::Convolution, true);
    let (got, _) = conv_pass_in(kind, &x, &w, Some(&b), &dy, case);
    let runs = CudnnPlans::now().depthwise_kernel_runs - before;
    for (what, i) in [("y", 0), ("dx", 1), ("dw", 2), ("db", 3)] {
        let err = common::rel_err(&got[i], &expected[i]);
        assert!(err < 1e-2, "{name}: {what}: relative error {err}");
    }
    runs
}

#[test]
fn a_depthwise_pass_is_timed_once_per_shape_and_counted() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip("a_depthwise_pass_is_timed_once_per_shape_and_counted")
    else {
        return;
    };
    let _tuned = hold_autotuning();
    let _timed = choose_depthwise(DepthwiseChoice::Timed);
    // Shapes of no other test, so that this process has timed none of them.
    let case = ConvCase {
        x: &[4, 64, 21, 19],
        w: &[64, 1, 7, 7],
        stride: &[1, 1],
        padding: &[3, 3],
        dilation: &[1, 1],
        groups: 64,
    };
    let [x, w, b, dy] = plan_operands(&case, device, true);
    let timed = |p: &CudnnPlans| p.depthwise_on_kernels + p.depthwise_left;
    let _on = common::hold_override(Override::Convolution, true);
    let start = CudnnPlans::now();
    let (first, _) = conv_pass(&x, &w, Some(&b), &dy, &case);
    let after_first = CudnnPlans::now();
    let (second, _) = conv_pass(&x, &w, Some(&b), &dy, &case);
    let after_second = CudnnPlans::now();
    assert_eq!(
        timed(&after_first) - timed(&start),
        2,
        "{start:?} then {after_first:?}"
    );
    assert_eq!(
        timed(&after_second),
        timed(&after_first),
        "timed again: {after_second:?}"
    );
    for (what, i) in [("y", 0), ("dx", 1)] {
        let err = common::rel_err(&second[i], &first[i]);
        assert!(
            err < 1e-2,
            "{what}: relative error {err} between the two steps"
        );
    }
}

#[test]
fn a_depthwise_convolution_the_kernel_does_not_take_runs_the_other_path() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_depthwise_convolution_the_kernel_does_not_take_runs_the_other_path",
    ) else {
        return;
    };
    let _tuned = hold_autotuning();
    let _kernel = choose_depthwise(DepthwiseChoice::Kernel);
    // Strided, and a channel count no multiple of 8: cuDNN's or ATen's, even when the kernel is
    // asked for.
    for case in [
        ConvCase {
            x: &[2, 16, 12, 12],
            w: &[16, 1, 3, 3],
            stride: &[2, 2],
            padding: &[1, 1],
            dilation: &[1, 1],
            groups: 16,
        },
        ConvCase {
            x: &[2, 12, 9, 9],
            w: &[12, 1, 3, 3],
            stride: &[1, 1],
            padding: &[1, 1],
            dilation: &[1, 1],
            groups: 12,
        },
    ] {
        let runs = depthwise_pass_matches_atens(Kind::BFloat16, &case, device);
        assert_eq!(runs, 0, "{:?} on the kernel", case.x);
    }
}
