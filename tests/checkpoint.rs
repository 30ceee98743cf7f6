//! Activation checkpointing (`speedkit::checkpoint`): gradients equal to the plain forward's, the
//! same random numbers in the recomputation, parameters reached when no input needs a gradient, and a
//! backward after the scope refused.

mod common;

use speedkit::{SpeedConfig, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn cpu_context() -> SpeedContext {
    SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n").unwrap()).unwrap()
}

/// Two MLP blocks; the same weights for the plain and the checkpointed run.
fn blocks(vs: &nn::VarStore) -> Vec<nn::Sequential> {
    (0..2)
        .map(|i| {
            let p = vs.root() / format!("block{i}");
            nn::seq()
                .add(nn::linear(&p / "fc1", 16, 64, Default::default()))
                .add_fn(|x| x.gelu("tanh"))
                .add(nn::linear(&p / "fc2", 64, 16, Default::default()))
        })
        .collect()
}

/// The trainable variables' gradients, by name (buffers such as FP8 amax histories have none).
fn gradients(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut named: Vec<_> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, t)| t.grad().copy()).collect()
}

#[test]
fn checkpointed_gradients_equal_the_plain_ones() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = blocks(&vs);
    let x = Tensor::randn([8, 16], CPU).set_requires_grad(true);

    let mut y = x.shallow_clone();
    for block in &model {
        y = &y + block.forward(&y);
    }
    y.square().mean(Kind::Float).backward();
    let (plain, plain_x) = (gradients(&vs), x.grad().copy());
    for p in vs.trainable_variables() {
        let _ = p.grad().zero_();
    }
    let _ = x.grad().zero_();

    ctx.checkpointed(|ck| -> speedkit::Result<()> {
        let mut y = x.shallow_clone();
        for block in &model {
            let out = ck.checkpoint(&[&y], |i| Ok(vec![&i[0] + block.forward(&i[0])]))?;
            y = out.into_iter().next().expect("one output");
        }
        y.square().mean(Kind::Float).backward();
        Ok(())
    })
    .unwrap();
    for (a, b) in plain.iter().zip(gradients(&vs)) {
        assert!(a.allclose(&b, 1e-6, 1e-6, false));
    }
    assert!(plain_x.allclose(&x.grad(), 1e-6, 1e-6, false));
}

#[test]
fn the_recomputation_draws_the_same_random_numbers() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let x = Tensor::ones([64, 64], CPU).set_requires_grad(true);
    ctx.checkpointed(|ck| -> speedkit::Result<()> {
        let y = ck
            .checkpoint(&[&x], |i| Ok(vec![i[0].dropout(0.5, true)]))?
            .remove(0);
        let mask_forward = y.detach().ne(0.0);
        y.sum(Kind::Float).backward();
        // dropout's gradient is its mask scaled: nonzero exactly where the forward kept a value.
        assert!(x.grad().ne(0.0).equal(&mask_forward));
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_backward_after_the_scope_ended_is_an_error() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::randn([2, 4], CPU).set_requires_grad(true);
    let y = ctx
        .checkpointed(|ck| ck.checkpoint(&[&x], |i| Ok(vec![layer.forward(&i[0])])))
        .unwrap()
        .remove(0);
    let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(
        err.contains("after its `checkpointed` scope ended"),
        "{err}"
    );
}

#[test]
fn a_second_derivative_through_a_checkpoint_is_an_error() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::randn([2, 4], CPU).set_requires_grad(true);
    let err = ctx
        .checkpointed(
            |ck| -> speedkit::Result<Result<Vec<Tensor>, tch::TchError>> {
                let y = ck.checkpoint(&[&x], |i| Ok(vec![layer.forward(&i[0]).tanh()]))?;
                let loss = y[0].sum(Kind::Float);
                Ok(Tensor::f_run_backward(&[loss], &[&x], true, true))
            },
        )
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("speedkit::checkpoint does not support a second derivative"),
        "{err}"
    );
}

#[test]
fn a_checkpoint_without_grad_mode_just_runs_the_function() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::randn([2, 4], CPU);
    let y = tch::no_grad(|| {
        ctx.checkpointed(|ck| ck.checkpoint(&[&x], |i| Ok(vec![layer.forward(&i[0])])))
    })
    .unwrap()
    .remove(0);
    assert!(!y.requires_grad());
    assert!(y.allclose(&layer.forward(&x), 1e-6, 1e-6, false));
}

#[test]
fn parameters_get_their_gradients_when_no_input_requires_grad() {
    let _serial = common::serial();
    let ctx = cpu_context();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::randn([2, 4], CPU);

    layer.forward(&x).square().sum(Kind::Float).backward();
    let plain = layer.ws.grad().copy();
    let _ = layer.ws.grad().zero_();

    ctx.checkpointed(|ck| -> speedkit::Result<()> {
        let y = ck
            .checkpoint(&[&x], |i| Ok(vec![layer.forward(&i[0])]))?
            .remove(0);
        assert!(y.requires_grad());
        y.square().sum(Kind::Float).backward();
        Ok(())
    })
    .unwrap();
    assert!(plain.allclose(&layer.ws.grad(), 1e-6, 1e-6, false));
    assert!(!x.grad().defined());
}

#[test]
fn a_transformer_with_every_block_checkpointed_has_the_plain_loss_and_gradients() {
    use speedkit_suite::models::{Transformer, TransformerConfig};
    let _serial = common::serial();
    let ctx = cpu_context();
    let config = TransformerConfig::tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Transformer::new(&vs.root(), &config).unwrap();
    let (tokens, targets) =
        speedkit_suite::data::tokens(config.batch, config.seq_len, config.vocab, Device::Cpu)
            .unwrap();

    let plain_loss = model.loss(&tokens, &targets).unwrap();
    plain_loss.backward();
    let plain = gradients(&vs);
    for p in vs.trainable_variables() {
        let _ = p.grad().zero_();
    }
    let loss = ctx
        .checkpointed(|ck| -> speedkit::Result<Tensor> {
            let loss = model.loss_checkpointed(ck, &tokens, &targets)?;
            loss.backward();
            Ok(loss)
        })
        .unwrap();
    assert!(loss.allclose(&plain_loss, 1e-6, 1e-6, false));
    for (a, b) in plain.iter().zip(gradients(&vs)) {
        assert!(a.allclose(&b, 1e-5, 1e-6, false));
    }
}
