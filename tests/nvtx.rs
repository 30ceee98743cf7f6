//! `profile.nvtx`: the NVTX ranges change nothing about a step's results.

mod common;

use speedkit::config::{DeviceChoice, SpeedConfig};
use speedkit::optim::AdamW;
use speedkit::{apply_speedups, SpeedContext};
use tch::{nn, nn::Module, Device, Kind, Tensor};

/// Three training steps of a small linear model from a fixed seed; the final loss.
fn train(nvtx: bool) -> f64 {
    let mut config = SpeedConfig {
        device: DeviceChoice::Cpu,
        ..SpeedConfig::auto()
    };
    config.profile.nvtx = nvtx;
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 8, 1, Default::default());
    let ctx: SpeedContext = apply_speedups(&mut vs, &config).unwrap();
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let x = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    let mut last = 0.0;
    for _ in 0..3 {
        let loss = ctx.autocast(|| model.forward(&x).square().mean(None));
        ctx.backward_step(&loss, &mut opt).unwrap();
        last = loss.double_value(&[]);
    }
    last
}

#[test]
fn nvtx_ranges_leave_the_training_results_unchanged() {
    let _serial = common::serial();
    assert_eq!(train(true), train(false));
}
