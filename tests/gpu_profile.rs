//! The step profiler on a GPU: the kernel table of a `transformer` training step under `auto`.
//! Skipped, with the reason printed, without a GPU.

mod common;

#[path = "../workloads/mod.rs"]
mod workloads;

use speedkit::bench::{Bencher, Protocol, Size, Workload};
use speedkit::config::{AutoBool, SpeedConfig};
use speedkit::graph::StepKind;
use speedkit::profile::{Category, Profile};
use speedkit::SpeedContext;

fn profile_transformer(config: &SpeedConfig) -> Profile {
    let workload = Workload::named("transformer").expect("the transformer workload is registered");
    let ctx = SpeedContext::new(config).unwrap();
    let protocol = Protocol {
        warmup: 3,
        steps: 3,
        paranoid_sync: true,
    };
    let mut b = Bencher::new(Size::Bench, &ctx, protocol).with_profile(Some(2));
    (workload.run)(&mut b).unwrap();
    let profile = b.take_profile().expect("a profile");
    println!("{profile}");
    profile
}

#[test]
fn transformer_replay_kernels_account_for_the_step_and_name_the_sdpa_kernel() {
    let Some(_) = common::cuda_or_skip("transformer_replay_kernels_account_for_the_step") else {
        return;
    };
    let _serial = common::serial();
    let profile = profile_transformer(&SpeedConfig::auto());
    for step in &profile.steps {
        assert_eq!(step.kind, StepKind::GraphReplay);
        let event_ms = step.cuda_event_ms.expect("CUDA-event time");
        let share = step.rows_total_ms() / event_ms;
        println!(
            "step {}: kernels {:.3} ms of {event_ms:.3} ms CUDA-event time ({:.1}%)",
            step.step,
            step.rows_total_ms(),
            100.0 * share
        );
        assert!(
            share >= 0.95,
            "the kernel table covers {:.1}%",
            100.0 * share
        );
        let attention: Vec<&str> = step
            .rows
            .iter()
            .filter(|r| r.category == Category::Attention)
            .map(|r| r.full_name.as_str())
            .collect();
        println!("SDPA kernels: {attention:#?}");
        assert!(!attention.is_empty(), "no attention kernel named:\n{step}");
    }
}

#[test]
fn transformer_eager_step_is_profiled_as_eager() {
    let Some(_) = common::cuda_or_skip("transformer_eager_step_is_profiled_as_eager") else {
        return;
    };
    let _serial = common::serial();
    let mut config = SpeedConfig::auto();
    config.compile.enabled = AutoBool::Off;
    let profile = profile_transformer(&config);
    for step in &profile.steps {
        assert_eq!(step.kind, StepKind::Eager);
        assert!(step.rows.iter().any(|r| r.category == Category::Attention));
        let event_ms = step.cuda_event_ms.expect("CUDA-event time");
        println!(
            "eager step {}: kernels {:.3} ms of {event_ms:.3} ms ({:.1}%), idle {:?}",
            step.step,
            step.rows_total_ms(),
            100.0 * step.rows_total_ms() / event_ms,
            step.idle_gaps
        );
    }
}
