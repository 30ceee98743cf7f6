//! Sharded checkpoints in one process: what they restore, and what they refuse without changing
//! the model. (Between world sizes and under ZeRO-3: tests/distributed/checkpoints.rs.)

use std::path::PathBuf;

use speedkit::optim::{AdamW, AdamWOptimizer};
use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "speedkit-sharded-checkpoint-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn context() -> SpeedContext {
    SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap()
}

fn two_layers(vs: &nn::VarStore, hidden: i64) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(vs.root() / "a", 6, hidden, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "b", hidden, 1, Default::default()))
}

fn train(ctx: &SpeedContext, net: &nn::Sequential, opt: &mut AdamWOptimizer, steps: i64) {
    for _ in 0..steps {
        let x = Tensor::randn([8, 6], (Kind::Float, Device::Cpu));
        let loss = net.forward(&x).square().mean(Kind::Float);
        ctx.backward_step(&loss, opt).unwrap();
    }
}

fn snapshot(vs: &nn::VarStore, opt: &AdamWOptimizer) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    named.extend(
        opt.state_tensors()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.copy())),
    );
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

fn assert_equal(got: &[(String, Tensor)], want: &[(String, Tensor)]) {
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(want) {
        assert!(g.equal(w), "{name} differs");
    }
}

#[test]
fn a_sharded_checkpoint_restores_the_model_and_the_optimizer_state() {
    let dir = scratch("restore");
    let ctx = context();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = two_layers(&vs, 16);
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-2,
                ..Default::default()
            },
        )
        .unwrap();
    train(&ctx, &net, &mut opt, 2);
    ctx.save_sharded(&vs, Some(&opt), &dir).unwrap();
    let saved = snapshot(&vs, &opt);
    opt.set_lr(5e-3).unwrap();
    train(&ctx, &net, &mut opt, 2);
    ctx.load_sharded(&vs, Some(&mut opt), &dir).unwrap();
    assert_equal(&snapshot(&vs, &opt), &saved);
    assert_eq!(
        opt.lrs(),
        vec![1e-2; opt.lrs().len()],
        "the learning rates it was saved with"
    );
}

#[test]
fn a_checkpoint_of_another_shape_is_refused_naming_the_variable_and_changes_nothing() {
    let dir = scratch("shape");
    let ctx = context();
    let other = nn::VarStore::new(Device::Cpu);
    let _wider = two_layers(&other, 32);
    ctx.save_sharded(&other, None, &dir).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = two_layers(&vs, 16);
    let before: Vec<Tensor> = vs.trainable_variables().iter().map(Tensor::copy).collect();
    let err = ctx.load_sharded(&vs, None, &dir).unwrap_err().to_string();
    assert!(
        err.contains("`a.bias` is [32] in the checkpoint and [16] in the model"),
        "{err}"
    );
    for (b, now) in before.iter().zip(vs.trainable_variables()) {
        assert!(b.equal(&now));
    }
}

#[test]
fn a_checkpoint_saved_without_the_optimizer_is_refused_for_one_and_changes_nothing() {
    let dir = scratch("no-optimizer");
    let ctx = context();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = two_layers(&vs, 16);
    let mut opt = ctx.adamw(&vs, Default::default()).unwrap();
    ctx.save_sharded(&vs, None, &dir).unwrap();
    train(&ctx, &net, &mut opt, 1);
    let before = snapshot(&vs, &opt);
    let err = ctx
        .load_sharded(&vs, Some(&mut opt), &dir)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("has no `exp_avg/a.bias`") && err.contains("saved without the optimizer"),
        "{err}"
    );
    assert_equal(&snapshot(&vs, &opt), &before);
}

#[test]
fn a_checkpoint_missing_a_ranks_file_is_refused() {
    let dir = scratch("missing-rank");
    let ctx = context();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = two_layers(&vs, 16);
    ctx.save_sharded(&vs, None, &dir).unwrap();
    // What is left of a checkpoint of two ranks, the second rank's file lost.
    std::fs::create_dir_all(dir.join("two")).unwrap();
    std::fs::copy(
        dir.join("rank00000-of-00001.safetensors"),
        dir.join("two/rank00000-of-00002.safetensors"),
    )
    .unwrap();
    let err = ctx
        .load_sharded(&vs, None, dir.join("two"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not one whole sharded checkpoint") && err.contains("1 rank file(s)"),
        "{err}"
    );
}

#[test]
fn a_directory_without_a_checkpoint_is_refused_saying_what_one_holds() {
    let dir = scratch("empty");
    std::fs::create_dir_all(&dir).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = two_layers(&vs, 16);
    let err = context()
        .load_sharded(&vs, None, &dir)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds no sharded checkpoint") && err.contains("rank*-of-*.safetensors"),
        "{err}"
    );
}
