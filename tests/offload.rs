//! Saved activations parked in host memory (`speedkit::offload`): the step computes what it computes
//! without parking, autograd's checks stay, the engine is libtorch's again on every exit path, and
//! a step traced while parking is traced and planned as without.
//!
//! Each test holds `common::serial()`: parking swaps a process-wide engine, and the execution
//! trace observer must not see another thread's operator in flight when a recording ends.

mod common;

use speedkit::fusion::FusionPlan;
use speedkit::offload::ParkedActivations;
use speedkit::trace::StepTrace;
use speedkit_suite::data;
use speedkit_suite::models::llama_tch::{LlamaConfig, LlamaTch};
use speedkit_suite::models::unet_tch::{UnetConfig, UnetTch};
use tch::{nn, Device, Kind, Tensor};

/// Every storage parked, however small.
const ALL: u64 = 0;

/// A small U-Net's training step on `device`: its loss and its parameters' gradients.
fn unet_step(device: Device, parked: bool) -> (Tensor, Vec<Tensor>, u64) {
    unet_step_with(device, parked, || {})
}

/// [`unet_step`], with `between` run after the forward (and the parking session's end, where it
/// parked) and before the backward.
fn unet_step_with(
    device: Device,
    parked: bool,
    between: impl FnOnce(),
) -> (Tensor, Vec<Tensor>, u64) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = UnetTch::new(&vs.root(), &UnetConfig::tiny()).unwrap();
    let images = Tensor::randn([2, 3, 16, 16], (Kind::Float, device));
    let noise = Tensor::randn([2, 3, 16, 16], (Kind::Float, device));
    let parking = parked.then(|| ParkedActivations::start(ALL).unwrap());
    let loss = model.loss(&images, &noise).unwrap();
    let bytes = parking.map_or(0, |p| p.finish().unwrap().bytes);
    between();
    loss.backward();
    let grads = vs.trainable_variables().iter().map(|p| p.grad()).collect();
    (loss.detach(), grads, bytes)
}

/// Asserts that a parked CUDA step's loss and gradients are the unparked step's. The convolutions
/// run in TF32 on algorithms cuDNN picks per run, which sum in other orders (2e-5 apart between two
/// runs on an H200); bytes parked or brought back wrong are off by orders of magnitude more.
fn assert_cuda_step_matches(
    parked: &(Tensor, Vec<Tensor>, u64),
    eager: &(Tensor, Vec<Tensor>, u64),
) {
    assert!(parked.2 > 0, "nothing was parked");
    assert!(common::rel_err(&parked.0, &eager.0) < 1e-4);
    assert_eq!(parked.1.len(), eager.1.len());
    for (p, g) in parked.1.iter().zip(&eager.1) {
        let gap = common::rel_err(p, g);
        assert!(gap < 1e-3, "a gradient differs by {gap:e}");
    }
}

#[test]
fn a_step_with_parked_activations_gives_the_same_loss_and_gradients_bit_for_bit() {
    let _serial = common::serial();
    let (loss, grads, _) = unet_step(Device::Cpu, false);
    let (parked_loss, parked_grads, parked_bytes) = unet_step(Device::Cpu, true);
    assert!(parked_bytes > 0, "nothing was parked");
    assert!(loss.equal(&parked_loss));
    assert_eq!(grads.len(), parked_grads.len());
    for (g, p) in grads.iter().zip(&parked_grads) {
        assert!(g.equal(p), "a gradient differs");
    }
}

#[test]
fn a_saved_tensor_is_parked_only_once_nothing_but_autograd_holds_it() {
    let _serial = common::serial();
    let w = Tensor::randn([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let parked = ParkedActivations::start(ALL).unwrap();
    let hidden = Tensor::randn([128, 64], (Kind::Float, Device::Cpu))
        .matmul(&w)
        .tanh();
    // `hidden` is still the forward's: saved by tanh and by the matmul below, parked by neither.
    let out = hidden.matmul(&w);
    let before = hidden.copy();
    let loss = (&out * &out).mean(Kind::Float);
    assert!(
        hidden.equal(&before),
        "a tensor the forward holds was touched"
    );
    drop(hidden);
    loss.backward();
    let parked = parked.finish().unwrap();
    // The first matmul's input and `hidden` (after the drop); `out` is held until after the backward.
    assert_eq!(parked.bytes, 2 * 128 * 64 * 4, "{parked:?}");
    assert!(w.grad().defined());
}

#[test]
fn a_saved_tensor_changed_in_place_fails_the_backward_with_autograds_error() {
    let _serial = common::serial();
    let x = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let parked = ParkedActivations::start(ALL).unwrap();
    let mut y = x.exp();
    let loss = (&y * 2.0).sum(Kind::Float); // exp saves its result, y
    let _ = y.g_add_scalar_(1.0);
    let err = loss.f_backward().unwrap_err().to_string();
    drop(parked);
    assert!(err.contains("modified by an inplace operation"), "{err}");
}

#[test]
fn autograds_engine_is_libtorchs_again_when_parking_ends_by_finish_drop_or_panic() {
    let _serial = common::serial();
    assert!(!ParkedActivations::active().unwrap());
    let parked = ParkedActivations::start(ALL).unwrap();
    assert!(ParkedActivations::active().unwrap());
    parked.finish().unwrap();
    assert!(!ParkedActivations::active().unwrap());
    drop(ParkedActivations::start(ALL).unwrap());
    assert!(!ParkedActivations::active().unwrap());
    let panicked = std::panic::catch_unwind(|| {
        let _parked = ParkedActivations::start(ALL).unwrap();
        panic!("in the step");
    });
    assert!(panicked.is_err());
    assert!(!ParkedActivations::active().unwrap());
}

#[test]
fn a_second_parking_while_one_runs_fails_and_leaves_the_first_in_place() {
    let _serial = common::serial();
    let first = ParkedActivations::start(ALL).unwrap();
    let err = ParkedActivations::start(ALL).err().unwrap().to_string();
    assert!(err.contains("already"), "{err}");
    assert!(ParkedActivations::active().unwrap());
    first.finish().unwrap();
    assert!(!ParkedActivations::active().unwrap());
}

#[test]
fn another_threads_saved_tensors_stay_where_they_are() {
    let _serial = common::serial();
    let parked = ParkedActivations::start(ALL).unwrap();
    std::thread::spawn(|| {
        let x = Tensor::randn([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        x.exp().sum(Kind::Float).backward();
    })
    .join()
    .unwrap();
    assert_eq!(parked.finish().unwrap().bytes, 0);
}

#[test]
fn a_function_whose_backward_may_overwrite_what_it_saved_decides_as_without_parking() {
    let _serial = common::serial();
    let may_overwrite = |parked: bool| {
        let said = std::sync::Arc::new(std::sync::Mutex::new(None));
        let x = Tensor::randn([512, 512], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let parking = parked.then(|| ParkedActivations::start(ALL).unwrap());
        let function = common::ExpInPlace(std::sync::Arc::clone(&said));
        let y = speedkit::function::apply(function, &[&x])
            .unwrap()
            .remove(0);
        let loss = y.sum(Kind::Float);
        drop(y);
        // Another save: where y's were parked, this one would park it.
        let other = Tensor::randn([512, 512], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let _ = other.exp();
        loss.backward();
        drop(parking);
        let said = *said.lock().unwrap();
        said
    };
    assert_eq!(may_overwrite(false), Some(true));
    assert_eq!(may_overwrite(true), Some(true));
}

/// Per kernel of `trace`, per tensor argument: the kernel that made it, if one did.
fn producers(trace: &StepTrace) -> Vec<Vec<Option<usize>>> {
    let kernels = trace.kernels();
    let made_before = |i: usize, key: (u64, u64)| {
        (0..i)
            .rev()
            .find(|&j| kernels[j].output_tensors().any(|o| o.key() == key))
    };
    (0..kernels.len())
        .map(|i| {
            (kernels[i].input_tensors())
                .map(|t| made_before(i, t.key()))
                .collect()
        })
        .collect()
}

/// Traces a fresh model's step (`step` builds the model and runs it) without parking and with,
/// and checks that both have the same kernels, each reading what the same kernel made, and the
/// same fusion plan. Without parking, a tensor autograd saves as a result is read in the backward
/// through another object (`tensor_data`), which no call made; with parking, such a read is
/// of the forward's tensor.
fn assert_traced_as_without_parking(step: impl Fn()) {
    let (_, plain) = StepTrace::record(&step).unwrap();
    let (_, parked) = StepTrace::record(|| {
        let parking = ParkedActivations::start(ALL).unwrap();
        step();
        assert!(parking.finish().unwrap().bytes > 0, "nothing was parked");
    })
    .unwrap();
    assert_eq!(parked.unmatched_parked_reads(), 0);
    let names =
        |t: &StepTrace| -> Vec<String> { t.kernels().iter().map(|op| op.name.clone()).collect() };
    assert_eq!(names(&plain), names(&parked));
    let (a, b) = (producers(&plain), producers(&parked));
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        for (j, (a, b)) in a.iter().zip(b).enumerate() {
            assert!(
                a.is_none() || a == b,
                "argument {j} of kernel {i} ({}): made by kernel {a:?} without parking, {b:?} with",
                plain.kernels()[i].name
            );
        }
    }
    assert_eq!(
        FusionPlan::from_trace(&plain).to_string(),
        FusionPlan::from_trace(&parked).to_string()
    );
}

#[test]
fn a_decoder_step_traced_while_parking_is_traced_as_without() {
    let _serial = common::serial();
    assert_traced_as_without_parking(|| {
        tch::manual_seed(0);
        let config = LlamaConfig::tiny();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = LlamaTch::new(&vs.root(), &config).unwrap();
        let (tokens, targets) =
            data::tokens(config.batch, config.seq_len, config.vocab, Device::Cpu).unwrap();
        model.loss(&tokens, &targets).unwrap().backward();
    });
}

#[test]
fn a_u_net_step_traced_while_parking_is_traced_as_without() {
    let _serial = common::serial();
    assert_traced_as_without_parking(|| {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = UnetTch::new(&vs.root(), &UnetConfig::tiny()).unwrap();
        let images = Tensor::randn([2, 3, 16, 16], (Kind::Float, Device::Cpu));
        let noise = Tensor::randn([2, 3, 16, 16], (Kind::Float, Device::Cpu));
        model.loss(&images, &noise).unwrap().backward();
    });
}

#[test]
fn parked_activations_lower_an_eager_cuda_steps_peak_and_keep_its_gradients() {
    let _serial = common::serial();
    let Some(cuda) = common::cuda_or_skip("parked_activations_lower_an_eager_cuda_steps_peak")
    else {
        return;
    };
    let peak = |parked: bool| {
        speedkit::memory::release_cached(cuda).unwrap();
        tch::Cuda::synchronize(0);
        speedkit::memory::reset_peaks(cuda).unwrap();
        let (loss, grads, bytes) = unet_step(cuda, parked);
        tch::Cuda::synchronize(0);
        let peak = speedkit::memory::MemoryUse::now(cuda)
            .unwrap()
            .peak_allocated;
        (loss, grads, bytes, peak)
    };
    let (loss, grads, _, eager_peak) = peak(false);
    let (parked_loss, parked_grads, bytes, parked_peak) = peak(true);
    println!("peak {eager_peak} B eager, {parked_peak} B parking ({bytes} B parked)");
    assert!(parked_peak < eager_peak);
    assert_cuda_step_matches(&(parked_loss, parked_grads, bytes), &(loss, grads, 0));
}

#[test]
fn cuda_steps_parked_one_after_another_in_the_same_host_memory_keep_their_gradients() {
    let _serial = common::serial();
    let Some(cuda) = common::cuda_or_skip("cuda_steps_parked_one_after_another") else {
        return;
    };
    let eager = unet_step(cuda, false);
    // The second and third steps park in the blocks the first gave back.
    for _ in 0..3 {
        assert_cuda_step_matches(&unet_step(cuda, true), &eager);
    }
    speedkit::offload::release_host_cache().unwrap();
}

#[test]
fn host_memory_released_while_parked_tensors_wait_for_the_backward_is_unpinned_after_it() {
    let _serial = common::serial();
    let Some(cuda) = common::cuda_or_skip("host_memory_released_while_parked_tensors_wait") else {
        return;
    };
    let eager = unet_step(cuda, false);
    let release = || speedkit::offload::release_host_cache().unwrap();
    assert_cuda_step_matches(&unet_step_with(cuda, true, release), &eager);
    // A session after the release pins afresh.
    assert_cuda_step_matches(&unet_step(cuda, true), &eager);
    release();
}
