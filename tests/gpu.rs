//! CUDA behaviour of the flag layer, detection, optimizer, scaler, attention and the benchmark's
//! clock readings. Each test prints why it is skipped on a machine without a GPU; they run on the
//! GPU host.

mod common;

use speedkit::amp::{autocast, GradScaler};
use speedkit::bench::{Bencher, Protocol, Size};
use speedkit::config::{MatmulPrecision, SpeedConfig};
use speedkit::flags::{Flag, FlagState, FlagValue};
use speedkit::hardware::Hardware;
use speedkit::nn::{attention, attention_backend, SdpBackend};
use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::plan::ScalerSettings;
use speedkit::report::Report;
use speedkit::SpeedContext;
use tch::{nn, Device, Kind, Tensor};

#[test]
fn cuda_detection_reads_the_device() {
    // One at a time: others reseed the generator and switch attention backends off.
    let _lock = common::serial();
    let Some(_) = common::cuda_or_skip("cuda_detection_reads_the_device") else {
        return;
    };
    let hw = Hardware::detect().unwrap();
    let gpu = hw.primary_gpu().expect("a GPU");
    eprintln!("{hw}");
    assert!(gpu.multiprocessors > 0 && gpu.total_memory_bytes > 0);
    assert!(hw.cuda_runtime.is_some() && hw.built_with_cuda);
}

#[test]
fn report_applies_tf32_on_ampere_or_newer_and_restores_it() {
    let _lock = common::serial();
    let Some(_) = common::cuda_or_skip("report_applies_tf32_on_ampere_or_newer_and_restores_it")
    else {
        return;
    };
    let report = Report::build(&SpeedConfig::auto(), true, true).unwrap();
    eprintln!("{report}");
    assert_eq!(report.restored_equals_before, Some(true));
    if report.hardware.primary_gpu().unwrap().supports_tf32() {
        let row = |name: &str| {
            report
                .flags
                .iter()
                .find(|r| r.flag == name)
                .unwrap()
                .clone()
        };
        let tf32 = row(Flag::CudaMatmulAllowTf32.name());
        assert_eq!(tf32.applied, Some(FlagValue::Bool(true)));
        let prec = row(Flag::Float32MatmulPrecision.name());
        assert_eq!(
            prec.applied,
            Some(FlagValue::MatmulPrecision(MatmulPrecision::High))
        );
        assert_eq!(prec.restored, Some(prec.before));
    }
}

#[test]
fn context_restores_flags_after_a_cuda_plan() {
    let _lock = common::serial();
    let Some(_) = common::cuda_or_skip("context_restores_flags_after_a_cuda_plan") else {
        return;
    };
    let before = FlagState::capture().unwrap();
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    assert!(!ctx.audit().flag_changes.is_empty());
    assert_eq!(ctx.restore().unwrap(), before);
}

#[test]
fn cuda_autocast_runs_matmul_in_bf16() {
    // One at a time: others reseed the generator and switch attention backends off.
    let _lock = common::serial();
    let Some(d) = common::cuda_or_skip("cuda_autocast_runs_matmul_in_bf16") else {
        return;
    };
    let a = Tensor::randn([64, 64], (Kind::Float, d));
    assert_eq!(
        autocast(d, Kind::BFloat16, || a.matmul(&a)).unwrap().kind(),
        Kind::BFloat16
    );
    assert_eq!(
        autocast(d, Kind::Half, || a.matmul(&a)).unwrap().kind(),
        Kind::Half
    );
}

#[test]
fn cuda_fused_and_foreach_adamw_agree() {
    // One at a time: others reseed the generator and switch attention backends off.
    let _lock = common::serial();
    let Some(d) = common::cuda_or_skip("cuda_fused_and_foreach_adamw_agree") else {
        return;
    };
    let run = |fused: bool| {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(d);
        let p = vs.root().randn("p", &[256, 128], 0.0, 1.0);
        let mut opt = AdamWOptimizer::new(
            &vs,
            AdamW {
                lr: 1e-2,
                wd: 0.1,
                ..Default::default()
            },
            fused,
        )
        .unwrap();
        for i in 0..10 {
            opt.zero_grad().unwrap();
            ((&p * (i as f64 + 1.0)).sin().sum(None)).backward();
            opt.step().unwrap();
        }
        p.detach().copy()
    };
    let err = common::rel_err(&run(true), &run(false));
    eprintln!("fused vs foreach AdamW on CUDA, 10 steps: rel. error {err:.2e}");
    assert!(err < 1e-5);
}

#[test]
fn cuda_fused_scaler_step_skips_inf_on_the_device() {
    // One at a time: others reseed the generator and switch attention backends off.
    let _lock = common::serial();
    let Some(d) = common::cuda_or_skip("cuda_fused_scaler_step_skips_inf_on_the_device") else {
        return;
    };
    let settings = ScalerSettings {
        init_scale: 1024.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2000,
    };
    let scaler = GradScaler::new(Some(settings), d).unwrap();
    let vs = nn::VarStore::new(d);
    let w = vs.root().randn("w", &[4], 0.0, 1.0);
    let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), true).unwrap();
    let before = w.copy();
    let g = Tensor::from_slice(&[1.0f32, f32::NAN, 2.0, 3.0]).to_device(d);
    scaler.scale(&(&w * &g).sum(None)).unwrap().backward();
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    assert_eq!(w, before);
    assert_eq!(scaler.scale_value().unwrap(), 512.0);
    // A clean step goes through and the fused kernel unscales: one Adam step moves by ~lr.
    opt.zero_grad().unwrap();
    scaler.scale(&w.sum(None)).unwrap().backward();
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    let moved = (&before - &w).abs().mean(None).double_value(&[]);
    assert!((moved - 1e-3).abs() < 2e-4, "moved {moved}");
}

#[test]
fn cuda_attention_uses_a_fused_backend_for_bf16_causal_on_sm80_plus() {
    // One at a time: others reseed the generator and switch attention backends off.
    let _lock = common::serial();
    let Some(d) =
        common::cuda_or_skip("cuda_attention_uses_a_fused_backend_for_bf16_causal_on_sm80_plus")
    else {
        return;
    };
    let q = Tensor::randn([4, 12, 512, 64], (Kind::BFloat16, d));
    let backend = attention_backend(&q, &q, &q, true).unwrap();
    eprintln!("SDPA backend for bf16 [4,12,512,64] causal: {backend}");
    // PyTorch 2.11 ranks cuDNN attention first on Hopper, flash elsewhere; either way not math.
    if Hardware::detect()
        .unwrap()
        .primary_gpu()
        .unwrap()
        .supports_flash_attention()
    {
        assert!(
            matches!(
                backend,
                SdpBackend::Flash | SdpBackend::Cudnn | SdpBackend::MemEfficient
            ),
            "{backend}"
        );
    }
    let out = attention(&q, &q, &q, true).unwrap();
    let reference = attention(
        &q.to_kind(Kind::Float),
        &q.to_kind(Kind::Float),
        &q.to_kind(Kind::Float),
        true,
    )
    .unwrap();
    let err = common::rel_err(&out, &reference);
    eprintln!("fused SDPA ({backend}) in bf16 vs fp32 attention: rel. error {err:.2e}");
    assert!(err < 2e-2);
}

#[test]
fn attention_with_every_backend_disabled_is_a_clear_error() {
    let _lock = common::serial();
    let device = if tch::Cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    let mut config = SpeedConfig::auto();
    config.sdp_backend.flash = false;
    config.sdp_backend.mem_efficient = false;
    config.sdp_backend.cudnn = false;
    let ctx = SpeedContext::new(&config).unwrap();
    // Math alone still works.
    let q = Tensor::randn([1, 2, 8, 4], (Kind::Float, device));
    let _ = attention(&q, &q, &q, false).unwrap();
    Flag::SdpMath.set(FlagValue::Bool(false)).unwrap();
    let err = attention(&q, &q, &q, false).unwrap_err().to_string();
    Flag::SdpMath.set(FlagValue::Bool(true)).unwrap();
    drop(ctx);
    assert!(err.contains("every SDPA backend is disabled"), "{err}");
}

#[test]
fn cuda_prepare_moves_parameters_and_lays_conv_weights_channels_last() {
    let _lock = common::serial();
    let Some(d) =
        common::cuda_or_skip("cuda_prepare_moves_parameters_and_lays_conv_weights_channels_last")
    else {
        return;
    };
    let mut vs = nn::VarStore::new(Device::Cpu);
    let conv = nn::conv2d(vs.root(), 3, 16, 3, Default::default());
    let ctx = speedkit::apply_speedups(&mut vs, &SpeedConfig::auto()).unwrap();
    assert_eq!(conv.ws.device(), d);
    assert!(speedkit::nn::is_channels_last(&conv.ws).unwrap());
    assert!(ctx
        .audit()
        .notes
        .iter()
        .any(|n| n.contains("channels-last")));
}

/// The first backward of a conv → norm → SiLU block as a tch user writes it, under `config`:
/// the conv layer (its weight as the context left it) and the context's audit notes.
fn first_backward_of_a_conv_block(config: &SpeedConfig, group_norm: bool) -> (nn::Conv2D, String) {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let conv = nn::conv2d(vs.root() / "conv", 8, 32, 3, Default::default());
    let ctx = speedkit::apply_speedups(&mut vs, config).unwrap();
    assert!(speedkit::nn::is_channels_last(&conv.ws).unwrap());
    let images = Tensor::randn([4, 8, 16, 16], (Kind::Float, ctx.device()));
    let x = ctx.autocast(|| images.apply(&conv));
    let normalised = if group_norm {
        x.group_norm(8, None::<Tensor>, None::<Tensor>, 1e-5, false)
    } else {
        let none = || None::<Tensor>;
        x.batch_norm(none(), none(), none(), none(), true, 0.1, 1e-5, false)
    };
    ctx.backward(&normalised.silu().square().mean(Kind::Float))
        .unwrap();
    (conv, ctx.audit().notes.join("\n"))
}

#[test]
fn conv_weights_go_back_to_nchw_when_the_first_step_runs_group_norm_on_channels_last() {
    let _lock = common::serial();
    let test = "conv_weights_go_back_to_nchw_when_the_first_step_runs_group_norm_on_channels_last";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let (conv, notes) = first_backward_of_a_conv_block(&SpeedConfig::auto(), true);
    assert!(!speedkit::nn::is_channels_last(&conv.ws).unwrap());
    assert!(conv.ws.is_contiguous() && conv.ws.grad().is_contiguous());
    assert!(
        notes.contains(
            "1 conv weight(s) laid out NCHW again after the first backward: 1 GroupNorm call(s)"
        ),
        "{notes}"
    );
}

#[test]
fn conv_weights_stay_channels_last_when_the_first_step_runs_batch_norm() {
    let _lock = common::serial();
    let test = "conv_weights_stay_channels_last_when_the_first_step_runs_batch_norm";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let (conv, notes) = first_backward_of_a_conv_block(&SpeedConfig::auto(), false);
    assert!(speedkit::nn::is_channels_last(&conv.ws).unwrap());
    assert!(!notes.contains("NCHW again"), "{notes}");
}

#[test]
fn channels_last_set_in_the_config_stays_with_group_norm() {
    let _lock = common::serial();
    let test = "channels_last_set_in_the_config_stays_with_group_norm";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let config = SpeedConfig {
        channels_last: speedkit::config::AutoBool::On,
        ..SpeedConfig::auto()
    };
    let (conv, _) = first_backward_of_a_conv_block(&config, true);
    assert!(speedkit::nn::is_channels_last(&conv.ws).unwrap());
}

/// A context under `auto` for a model of one convolution, which it lays out channels-last until
/// the first backward decides: the context and the layer.
fn context_with_a_conv() -> (SpeedContext, nn::Conv2D) {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let conv = nn::conv2d(vs.root() / "conv", 8, 32, 3, Default::default());
    (
        speedkit::apply_speedups(&mut vs, &SpeedConfig::auto()).unwrap(),
        conv,
    )
}

/// cuDNN's autotuning and determinism flags, as they are now.
fn cudnn_tuning() -> [FlagValue; 2] {
    [Flag::CudnnBenchmark, Flag::CudnnDeterministic].map(|f| f.get().unwrap())
}

/// Asserts that every flag is as `before` says.
fn assert_flags_are(before: &FlagState) {
    let diff = before.diff(&FlagState::capture().unwrap());
    assert!(diff.is_empty(), "{diff:?}");
}

#[test]
fn cudnn_runs_its_heuristics_until_the_first_backward_decides_the_layout() {
    let _lock = common::serial();
    let test = "cudnn_runs_its_heuristics_until_the_first_backward_decides_the_layout";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let before = FlagState::capture().unwrap();
    let (ctx, conv) = context_with_a_conv();
    assert_eq!(
        cudnn_tuning(),
        [FlagValue::Bool(false), FlagValue::Bool(true)]
    );
    let images = Tensor::randn([4, 8, 16, 16], (Kind::Float, ctx.device()));
    let x = ctx.autocast(|| images.apply(&conv));
    let y = x.group_norm(8, None::<Tensor>, None::<Tensor>, 1e-5, false);
    ctx.backward(&y.silu().square().mean(Kind::Float)).unwrap();
    assert_eq!(
        cudnn_tuning(),
        [FlagValue::Bool(true), FlagValue::Bool(false)]
    );
    let notes = ctx.audit().notes.join("\n");
    assert!(notes.contains("cuDNN runs its heuristics"), "{notes}");
    drop(ctx);
    assert_flags_are(&before);
}

#[test]
fn a_context_dropped_before_its_first_backward_puts_cudnn_autotuning_back() {
    let _lock = common::serial();
    let test = "a_context_dropped_before_its_first_backward_puts_cudnn_autotuning_back";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let before = FlagState::capture().unwrap();
    let (ctx, _conv) = context_with_a_conv();
    assert_eq!(cudnn_tuning()[0], FlagValue::Bool(false));
    drop(ctx);
    assert_flags_are(&before);
}

#[test]
fn a_panic_in_the_first_step_puts_cudnn_autotuning_back() {
    let _lock = common::serial();
    let test = "a_panic_in_the_first_step_puts_cudnn_autotuning_back";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let before = FlagState::capture().unwrap();
    let panicked = std::panic::catch_unwind(|| {
        let _context = context_with_a_conv();
        panic!("the user's forward fails");
    });
    assert!(panicked.is_err());
    assert_flags_are(&before);
}

#[test]
fn a_timed_run_on_a_gpu_reads_its_clock_and_power() {
    let Some(device) = common::cuda_or_skip("a_timed_run_on_a_gpu_reads_its_clock_and_power")
    else {
        return;
    };
    let ctx = SpeedContext::new(
        &SpeedConfig::from_yaml_str("device: cuda\ncompile:\n  enabled: false\n").unwrap(),
    )
    .unwrap();
    let protocol = Protocol {
        warmup: 2,
        steps: 40,
        paranoid_sync: true,
    };
    let a = Tensor::randn([4096, 4096], (Kind::Float, device));
    let mut b = Bencher::new(Size::Bench, &ctx, protocol);
    b.run(|| a.matmul(&a).sum(Kind::Float)).unwrap();
    let m = b.take_measurement().unwrap();
    let clocks = m
        .clocks
        .unwrap_or_else(|| panic!("clocks not read: {:?}", m.clocks_unread));
    eprintln!("{clocks:?}");
    assert!(clocks.readings >= 1);
    assert!(0 < clocks.min_sm_mhz && clocks.min_sm_mhz <= clocks.top_sm_mhz);
    assert!(clocks.top_sm_mhz <= clocks.max_sm_mhz);
    assert!(clocks.mean_power_w > 0.0 && clocks.power_limit_w > 0.0);
    assert!((0.0..=1.0).contains(&clocks.power_capped));
}
