//! Device memory on the GPU: a whole-step graph reserves about what the eager step does, a dropped
//! model leaves nothing behind, an out-of-memory step names its phase and the process trains on
//! with a smaller model, checkpointed blocks give the plain gradients under autocast and inside
//! a graphed step, a capture that frees idle cuBLAS workspaces leaves a live graph its own, a
//! graphed step's forward and backward share one cuBLAS workspace, and a
//! Linear keeps a weight copy only where its batch is at least as wide as the weight and never
//! inside a checkpointed function, and saves no weight where its input needs no gradient, and the
//! classifier's gradient takes the memory of logits nothing else holds, and a reduced
//! `mse_loss` keeps no memory of its input's size.
//! Skipped, with the reason printed, without a GPU.

mod common;

use common::{cuda_or_skip, rel_err, run_steps};
use speedkit::flags::FlagState;
use speedkit::memory::{self, MemoryUse};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext, SpeedkitError};
use speedkit_suite::data;
use speedkit_suite::models::{Transformer, TransformerConfig};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// The transformer workload at a size that fills a GPU's memory a little: peak reserved of `steps`
/// steps, graphed or eager, measured from an emptied cache.
fn transformer_peak_reserved(device: Device, graphed: bool) -> u64 {
    let mut config = SpeedConfig::auto();
    if !graphed {
        config.compile.enabled = speedkit::config::AutoBool::Off;
    }
    let ctx = SpeedContext::new(&config).unwrap();
    let model_config = TransformerConfig {
        batch: 8,
        ..TransformerConfig::bench()
    };
    let vs = nn::VarStore::new(device);
    let model = Transformer::new(&vs.root(), &model_config).unwrap();
    let (tokens, targets) = data::tokens(
        model_config.batch,
        model_config.seq_len,
        model_config.vocab,
        device,
    )
    .unwrap();
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    memory::release_cached(device).unwrap();
    tch::Cuda::synchronize(0);
    speedkit::memory::reset_peaks(device).unwrap();
    run_steps(
        &ctx,
        |_| {
            let loss = ctx.autocast(|| model.loss(&tokens, &targets))?;
            ctx.backward_step(&loss, &mut opt)?;
            Ok(Some(loss))
        },
        graphed,
        6,
    );
    MemoryUse::now(device).unwrap().peak_reserved
}

#[test]
fn a_whole_step_graph_reserves_about_what_the_eager_step_does() {
    let Some(device) = cuda_or_skip("a_whole_step_graph_reserves_about_what_the_eager_step_does")
    else {
        return;
    };
    let _serial = common::serial();
    let eager = transformer_peak_reserved(device, false);
    let graphed = transformer_peak_reserved(device, true);
    println!(
        "peak reserved: eager {}, graphed {}",
        memory::gib(eager),
        memory::gib(graphed)
    );
    assert!(
        graphed as f64 <= 1.25 * eager as f64,
        "eager {eager}, graphed {graphed}"
    );
}

/// One step of `layer`'s squared output as the loss, under autocast, with `opt`'s backward and
/// update: GEMMs in the forward (this thread's cuBLAS handle) and in the backward (autograd's).
fn square_loss_step(
    ctx: &SpeedContext,
    layer: &speedkit::nn::Linear,
    opt: &mut speedkit::optim::AdamWOptimizer,
    x: &Tensor,
) -> speedkit::Result<Option<Tensor>> {
    let loss = ctx
        .autocast(|| layer.forward_t(x))?
        .square()
        .mean(Kind::Float);
    ctx.backward_step(&loss, opt)?;
    Ok(Some(loss))
}

/// Builds a Linear and its AdamW under `auto`, trains 5 graphed steps, and drops it all.
fn train_and_drop(device: Device) {
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let vs = nn::VarStore::new(device);
    let layer = speedkit::nn::Linear::new(&(vs.root() / "fc"), 1024, 1024, true);
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    // As many rows as the layer has outputs, so that it keeps a copy (linear.cpp).
    let x = Tensor::randn([1024, 1024], (Kind::Float, device));
    run_steps(
        &ctx,
        |_| square_loss_step(&ctx, &layer, &mut opt, &x),
        true,
        5,
    );
    assert!(
        memory::weight_copies().unwrap().0 > 0,
        "the layer's bf16 copy is kept while it lives"
    );
}

#[test]
fn a_dropped_model_leaves_nothing_allocated() {
    let Some(device) = cuda_or_skip("a_dropped_model_leaves_nothing_allocated") else {
        return;
    };
    let _serial = common::serial();
    // The first run makes what a process keeps for good: cuBLAS's handles and workspaces per
    // stream, the kernel modules. What the second leaves beyond that is a leak.
    train_and_drop(device);
    memory::release_cached(device).unwrap();
    let before = MemoryUse::now(device).unwrap();
    train_and_drop(device);
    memory::release_cached(device).unwrap();
    let after = MemoryUse::now(device).unwrap();
    assert_eq!(after.weight_copies, 0);
    assert_eq!(
        after.allocated, before.allocated,
        "before {before}\nafter {after}"
    );
    assert_eq!(after.graph_pools.reserved, 0, "{after}");
}

/// Bytes a bf16 forward of speedkit's Linear ([out, in] fp32 weight, `rows` rows of input that
/// requires grad or not) leaves allocated for its backward, and the weight copies kept after it.
fn linear_forward_holds(device: Device, rows: i64, out: i64, input_grad: bool) -> (u64, u64) {
    let ctx = SpeedContext::new(&SpeedConfig {
        precision: speedkit::config::Precision::Bf16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let vs = nn::VarStore::new(device);
    let layer = speedkit::nn::Linear::new(&(vs.root() / "fc"), 1024, out, false);
    let x = Tensor::randn([rows, 1024], (Kind::Float, device)).set_requires_grad(input_grad);
    // A first pass makes what the process keeps for good (cuBLAS's workspace for the stream).
    let warm_up = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    warm_up.to_kind(Kind::Float).sum(Kind::Float).backward();
    drop(warm_up);
    memory::drop_weight_copies().unwrap();
    let before = MemoryUse::now(device).unwrap().allocated;
    let y = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    let held = MemoryUse::now(device).unwrap().allocated - before - y.numel() as u64 * 2;
    let copies = memory::weight_copies().unwrap().0;
    y.to_kind(Kind::Float).sum(Kind::Float).backward();
    (held, copies)
}

#[test]
fn a_layer_wider_than_its_batch_keeps_no_weight_copy() {
    let Some(device) = cuda_or_skip("a_layer_wider_than_its_batch_keeps_no_weight_copy") else {
        return;
    };
    let _serial = common::serial();
    let (_, narrow_batch) = linear_forward_holds(device, 64, 4096, true);
    let (_, wide_batch) = linear_forward_holds(device, 4096, 4096, true);
    assert_eq!(narrow_batch, 0, "64 rows through a [4096, 1024] weight");
    assert_eq!(wide_batch, 4096 * 1024 * 2, "4096 rows keep the bf16 copy");
}

#[test]
fn a_first_layer_keeps_no_weight_for_its_backward() {
    let Some(device) = cuda_or_skip("a_first_layer_keeps_no_weight_for_its_backward") else {
        return;
    };
    let _serial = common::serial();
    let weight_bf16 = 4096 * 1024 * 2;
    let (first_layer, _) = linear_forward_holds(device, 64, 4096, false);
    let (inner_layer, _) = linear_forward_holds(device, 64, 4096, true);
    assert!(
        first_layer < weight_bf16 / 4,
        "an input without gradient: {first_layer} bytes held"
    );
    assert!(
        inner_layer >= weight_bf16,
        "an input with gradient keeps the weight's cast: {inner_layer} bytes held"
    );
}

#[test]
fn a_checkpointed_function_keeps_no_weight_copies_and_the_next_forward_does() {
    let Some(device) =
        cuda_or_skip("a_checkpointed_function_keeps_no_weight_copies_and_the_next_forward_does")
    else {
        return;
    };
    let _serial = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig {
        precision: speedkit::config::Precision::Bf16,
        ..SpeedConfig::auto()
    })
    .unwrap();
    let vs = nn::VarStore::new(device);
    let layer = speedkit::nn::Linear::new(&(vs.root() / "fc"), 256, 256, false);
    let x = Tensor::randn([512, 256], (Kind::Float, device)).set_requires_grad(true);
    memory::drop_weight_copies().unwrap();
    ctx.checkpointed(|ck| -> speedkit::Result<()> {
        let y = ck
            .checkpoint(&[&x], |i| {
                Ok(vec![ctx.autocast(|| layer.forward_t(&i[0]))?])
            })?
            .remove(0);
        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        Ok(())
    })
    .unwrap();
    assert!(layer.ws.grad().defined(), "the checkpoint back-propagated");
    assert_eq!(
        memory::weight_copies().unwrap().0,
        0,
        "the checkpointed forward and its rerun cast the weight where they used it"
    );
    let _ = ctx.autocast(|| layer.forward_t(&x)).unwrap();
    assert_eq!(
        memory::weight_copies().unwrap().0,
        256 * 256 * 2,
        "outside the checkpoint the copy is kept again"
    );
}

#[test]
fn a_graphed_steps_forward_and_backward_share_one_blas_workspace() {
    let Some(device) =
        cuda_or_skip("a_graphed_steps_forward_and_backward_share_one_blas_workspace")
    else {
        return;
    };
    let _serial = common::serial();
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let vs = nn::VarStore::new(device);
    let layer = speedkit::nn::Linear::new(&(vs.root() / "fc"), 512, 512, true);
    let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
    let x = Tensor::randn([256, 512], (Kind::Float, device)).set_requires_grad(true);
    // Graphed steps, all on the graph's side stream. What the process keeps is read inside the
    // step, while its graph lives (the last graph to drop takes its workspaces with it).
    let kept = std::cell::Cell::new(Vec::new());
    run_steps(
        &ctx,
        |_| {
            let loss = square_loss_step(&ctx, &layer, &mut opt, &x)?;
            let mut seen = kept.take();
            seen.push(memory::blas_workspaces()?);
            kept.set(seen);
            Ok(loss)
        },
        true,
        5,
    );
    // The last call the step saw is the capture's.
    let captured = kept.take().pop().expect("the step ran");
    assert!(
        captured.workspaces < captured.entries,
        "{} (handle, stream) pairs, {} workspaces: none is shared",
        captured.entries,
        captured.workspaces
    );
}

#[test]
fn out_of_memory_names_the_phase_and_the_process_trains_on() {
    let Some(device) = cuda_or_skip("out_of_memory_names_the_phase_and_the_process_trains_on")
    else {
        return;
    };
    let _serial = common::serial();
    let flags_before = FlagState::capture().unwrap();
    let total = speedkit::hardware::Hardware::detect().unwrap().gpus[0].total_memory_bytes;
    let err = {
        let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
        let vs = nn::VarStore::new(device);
        let layer = nn::linear(vs.root(), 4096, 4096, Default::default());
        let mut opt = ctx.adamw(&vs, AdamW::default()).unwrap();
        // A batch whose activations alone are larger than the device.
        let rows = (total / (4096 * 4)) as i64 / 2;
        let x = Tensor::randn([rows, 4096], (Kind::BFloat16, device));
        let mut step = ctx.graphed(|_: &[Tensor]| -> speedkit::Result<Option<Tensor>> {
            let h = ctx.autocast(|| -> speedkit::Result<Tensor> {
                // Fallible ops throughout: tch's `Module::forward` panics on an error.
                let y = x.f_linear(&layer.ws, layer.bs.as_ref())?;
                Ok(y.f_gelu("tanh")?.f_mul(&y)?)
            })?;
            let loss = h.f_square()?.f_mean(Kind::Float)?;
            ctx.backward_step(&loss, &mut opt)?;
            Ok(Some(loss))
        });
        (0..3)
            .find_map(|_| step.run(&[]).err())
            .expect("the step runs out of memory")
    };
    assert!(matches!(err, SpeedkitError::OutOfMemory(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("warm-up") && text.contains("smaller batch"),
        "{text}"
    );
    assert_eq!(
        FlagState::capture().unwrap(),
        flags_before,
        "every flag is back"
    );

    // The same process builds a smaller model and trains.
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let vs = nn::VarStore::new(device);
    let layer = nn::linear(vs.root(), 256, 256, Default::default());
    let mut opt = ctx
        .adamw(
            &vs,
            AdamW {
                lr: 1e-2,
                ..Default::default()
            },
        )
        .unwrap();
    let x = Tensor::randn([64, 256], (Kind::Float, device));
    let losses = run_steps(
        &ctx,
        |_| {
            let loss = ctx
                .autocast(|| layer.forward(&x))
                .square()
                .mean(Kind::Float);
            ctx.backward_step(&loss, &mut opt)?;
            Ok(Some(loss))
        },
        true,
        10,
    );
    assert!(losses.last() < losses.first(), "{losses:?}");
}

/// Gradients of two residual MLP blocks over a fixed input, checkpointed or not, under bf16
/// autocast, graphed or eager.
fn block_gradients(device: Device, checkpointed: bool, graphed: bool) -> Vec<Tensor> {
    let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let blocks: Vec<nn::Sequential> = (0..2)
        .map(|i| {
            let p = vs.root() / format!("block{i}");
            nn::seq()
                .add(nn::linear(&p / "fc1", 128, 512, Default::default()))
                .add_fn(|x| x.gelu("tanh"))
                .add(nn::linear(&p / "fc2", 512, 128, Default::default()))
        })
        .collect();
    let params = vs.trainable_variables();
    let x = Tensor::randn([256, 128], (Kind::Float, device));
    run_steps(
        &ctx,
        |_| {
            // Gradients only (no optimizer): they stay to compare.
            for p in &params {
                let _ = p.grad().f_zero_();
            }
            ctx.checkpointed(|ck| -> speedkit::Result<Option<Tensor>> {
                let loss = ctx.autocast(|| -> speedkit::Result<Tensor> {
                    let mut y = x.shallow_clone();
                    for block in &blocks {
                        y = if checkpointed {
                            ck.checkpoint(&[&y], |i| Ok(vec![&i[0] + block.forward(&i[0])]))?
                                .remove(0)
                        } else {
                            &y + block.forward(&y)
                        };
                    }
                    Ok(y.square().mean(Kind::Float))
                })?;
                ctx.backward(&loss)?;
                Ok(Some(loss))
            })
        },
        graphed,
        4,
    );
    params.iter().map(|p| p.grad().copy()).collect()
}

#[test]
fn checkpointed_gradients_equal_the_plain_ones_under_autocast_and_in_a_graph() {
    let Some(device) =
        cuda_or_skip("checkpointed_gradients_equal_the_plain_ones_under_autocast_and_in_a_graph")
    else {
        return;
    };
    let _serial = common::serial();
    for graphed in [false, true] {
        let plain = block_gradients(device, false, graphed);
        let checkpointed = block_gradients(device, true, graphed);
        for (a, b) in plain.iter().zip(&checkpointed) {
            let e = rel_err(b, a);
            assert!(e < 1e-3, "graphed {graphed}: relative error {e:.2e}");
        }
    }
}

/// Trains two MLPs in turn, each step of each through its own whole-step graph when `graphed`: a
/// few steps of the first, then of the second, then of the first again; the losses in order.
fn two_models_in_turn(device: Device, graphed: bool) -> Vec<f64> {
    let config = if graphed {
        "device: cuda\n"
    } else {
        "device: cuda\ncompile: {enabled: false}\n"
    };
    let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str(config).unwrap()).unwrap();
    tch::manual_seed(7);
    let x = Tensor::randn([512, 384], (Kind::Float, device));
    let y = Tensor::randn([512, 96], (Kind::Float, device));
    let stores = [nn::VarStore::new(device), nn::VarStore::new(device)];
    let nets: Vec<_> = stores
        .iter()
        .map(|vs| {
            nn::seq()
                .add(nn::linear(vs.root() / "a", 384, 768, Default::default()))
                .add_fn(|t| t.gelu("tanh"))
                .add(nn::linear(vs.root() / "b", 768, 96, Default::default()))
        })
        .collect();
    let mut opts: Vec<_> = stores
        .iter()
        .map(|vs| ctx.adamw(vs, Default::default()).unwrap())
        .collect();
    let (first, second) = opts.split_at_mut(1);
    let step_of = |net: &nn::Sequential, opt: &mut speedkit::optim::AdamWOptimizer| {
        let loss = ctx.autocast(|| net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        ctx.backward_step(&loss, opt)?;
        Ok(Some(loss))
    };
    let mut a = ctx.graphed(|_: &[Tensor]| step_of(&nets[0], &mut first[0]));
    let mut b = ctx.graphed(|_: &[Tensor]| step_of(&nets[1], &mut second[0]));
    let loss = |l: speedkit::Result<Option<Tensor>>| l.unwrap().unwrap().double_value(&[]);
    let mut losses: Vec<f64> = (0..6).map(|_| loss(a.run(&[]))).collect();
    losses.extend((0..6).map(|_| loss(b.run(&[]))));
    losses.extend((0..6).map(|_| loss(a.run(&[]))));
    assert_eq!(
        a.is_graphed() && b.is_graphed(),
        graphed,
        "{:?}",
        a.fallback_reason()
    );
    losses
}

#[test]
fn a_capture_beside_a_live_graph_leaves_it_the_blas_workspace_it_replays_with() {
    // Each capture frees the cuBLAS workspaces that no live graph replays with; the first model's
    // graph, replayed after the second's capture, must still compute its own step.
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "a_capture_beside_a_live_graph_leaves_it_the_blas_workspace_it_replays_with",
    ) else {
        return;
    };
    let eager = two_models_in_turn(device, false);
    let graphed = two_models_in_turn(device, true);
    for (i, (g, e)) in graphed.iter().zip(&eager).enumerate() {
        assert!(
            (g - e).abs() <= 1e-5 * e.abs(),
            "step {i}: graphed {g} against eager {e}"
        );
    }
}

#[test]
fn a_memory_history_writes_a_snapshot_of_its_run_and_stops_when_dropped() {
    use speedkit::memory::MemoryHistory;
    let Some(device) =
        cuda_or_skip("a_memory_history_writes_a_snapshot_of_its_run_and_stops_when_dropped")
    else {
        return;
    };
    let _serial = common::serial();
    assert!(!MemoryHistory::is_recording().unwrap());
    let path = std::env::temp_dir().join(format!("speedkit-history-{}.pickle", std::process::id()));
    {
        let history = MemoryHistory::record(10_000).unwrap();
        assert!(MemoryHistory::is_recording().unwrap());
        // 3 MiB, a size no other allocation of this test has.
        let x = Tensor::ones([3 << 18], (Kind::Float, device));
        history.write(&path).unwrap();
        drop(x);
    }
    assert!(!MemoryHistory::is_recording().unwrap());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).ok();
    // Pickle protocol 2 or later opens with PROTO (0x80); the snapshot's top-level keys follow.
    assert_eq!(bytes.first(), Some(&0x80), "a pickle");
    let text = String::from_utf8_lossy(&bytes);
    for key in ["segments", "device_traces", "alloc"] {
        assert!(text.contains(key), "the snapshot names `{key}`");
    }
}

#[test]
fn a_memory_history_stops_when_a_panic_unwinds_through_it() {
    use speedkit::memory::MemoryHistory;
    if cuda_or_skip("a_memory_history_stops_when_a_panic_unwinds_through_it").is_none() {
        return;
    }
    let _serial = common::serial();
    let outcome = std::panic::catch_unwind(|| {
        let _history = MemoryHistory::record(100).unwrap();
        panic!("a training step fails");
    });
    assert!(outcome.is_err());
    assert!(!MemoryHistory::is_recording().unwrap());
}

#[test]
fn a_memory_history_leaves_a_recording_it_did_not_start_running() {
    use speedkit::memory::MemoryHistory;
    if cuda_or_skip("a_memory_history_leaves_a_recording_it_did_not_start_running").is_none() {
        return;
    }
    let _serial = common::serial();
    let outer = MemoryHistory::record(100).unwrap();
    drop(MemoryHistory::record(100).unwrap());
    assert!(
        MemoryHistory::is_recording().unwrap(),
        "the outer guard's recording goes on"
    );
    drop(outer);
    assert!(!MemoryHistory::is_recording().unwrap());
}

/// Logits `x · w` of `rows` rows over `vocab` classes in bf16 (`w` a leaf that needs its gradient),
/// with targets.
fn classifier_inputs(device: Device, rows: i64, vocab: i64) -> (Tensor, Tensor, Tensor) {
    tch::manual_seed(7);
    let x = Tensor::randn([rows, 64], (Kind::BFloat16, device));
    let w = (Tensor::randn([64, vocab], (Kind::BFloat16, device)) * 0.1).set_requires_grad(true);
    let targets = Tensor::randint(vocab, [rows], (Kind::Int64, device));
    (x, w, targets)
}

/// How the loss gets the logits.
#[derive(Clone, Copy)]
enum Logits {
    /// `x · w` itself, `[rows, vocab]`.
    Matrix,
    /// A `[rows, vocab]` view of `[1, rows, vocab]` logits, as a transformer's loss flattens its
    /// `[batch, seq, vocab]` ones.
    FlattenedView,
}

/// `w`'s gradient through speedkit's cross-entropy of `x · w`, with the logits dropped before the
/// backward (so its gradient may take their memory) or held by the caller (the 3-D ones, for a
/// flattened view), and how far the backward's peak rose above what was allocated when it began.
fn classifier_weight_gradient(
    device: Device,
    (x, w, targets): &(Tensor, Tensor, Tensor),
    logits: Logits,
    hold_logits: bool,
) -> (Tensor, Option<(Tensor, Tensor)>, u64) {
    let (caller_logits, loss) = match logits {
        Logits::Matrix => {
            let logits = x.mm(w);
            let loss = speedkit::nn::cross_entropy(&logits, targets);
            (logits, loss)
        }
        Logits::FlattenedView => {
            let logits = x.unsqueeze(0).matmul(w);
            let loss = speedkit::nn::cross_entropy(&logits.view([-1, w.size()[1]]), targets);
            (logits, loss)
        }
    };
    let held = if hold_logits {
        Some((caller_logits.copy(), caller_logits))
    } else {
        drop(caller_logits);
        None
    };
    tch::Cuda::synchronize(0);
    let before = MemoryUse::now(device).unwrap().allocated;
    memory::reset_peaks(device).unwrap();
    let grad = Tensor::run_backward(&[&loss], &[w], false, false).remove(0);
    tch::Cuda::synchronize(0);
    let rise = MemoryUse::now(device).unwrap().peak_allocated - before;
    (grad, held, rise)
}

/// The rise of the classifier's backward over its start, for a large vocabulary, and the bytes of
/// its logits.
fn classifier_backward_rise(device: Device, logits: Logits) -> (u64, u64) {
    let (rows, vocab) = (4096, 32000);
    let inputs = classifier_inputs(device, rows, vocab);
    let (_, _, rise) = classifier_weight_gradient(device, &inputs, logits, false);
    (rise, (rows * vocab * 2) as u64)
}

#[test]
fn the_classifiers_gradient_over_its_logits_equals_atens() {
    let Some(device) = cuda_or_skip("the_classifiers_gradient_over_its_logits_equals_atens") else {
        return;
    };
    let inputs = classifier_inputs(device, 1031, 5003);
    let (x, w, targets) = &inputs;
    let aten_loss = x.mm(w).log_softmax(-1, Kind::Float).nll_loss(targets);
    let aten = Tensor::run_backward(&[&aten_loss], &[w], false, false).remove(0);
    for logits in [Logits::Matrix, Logits::FlattenedView] {
        let (ours, _, _) = classifier_weight_gradient(device, &inputs, logits, false);
        assert!(rel_err(&ours, &aten) < 1e-2, "{}", rel_err(&ours, &aten));
    }
}

#[test]
fn the_classifiers_backward_allocates_no_second_logits_matrix() {
    let Some(device) = cuda_or_skip("the_classifiers_backward_allocates_no_second_logits_matrix")
    else {
        return;
    };
    let (rise, logits_bytes) = classifier_backward_rise(device, Logits::Matrix);
    assert!(
        rise < logits_bytes / 2,
        "the backward rose {rise} bytes above its start; the logits are {logits_bytes}"
    );
}

#[test]
fn flattened_logits_take_their_gradient_in_place_too() {
    let Some(device) = cuda_or_skip("flattened_logits_take_their_gradient_in_place_too") else {
        return;
    };
    let (rise, logits_bytes) = classifier_backward_rise(device, Logits::FlattenedView);
    assert!(
        rise < logits_bytes / 2,
        "the backward rose {rise} bytes above its start; the logits are {logits_bytes}"
    );
}

#[test]
fn logits_the_caller_holds_are_left_unchanged_by_the_backward() {
    let Some(device) = cuda_or_skip("logits_the_caller_holds_are_left_unchanged_by_the_backward")
    else {
        return;
    };
    let inputs = classifier_inputs(device, 1031, 5003);
    for logits in [Logits::Matrix, Logits::FlattenedView] {
        let (_, held, _) = classifier_weight_gradient(device, &inputs, logits, true);
        let (copy, logits) = held.unwrap();
        assert!(logits.equal(&copy));
    }
}

#[test]
fn a_kept_graph_gives_the_classifiers_gradient_again() {
    let Some(device) = cuda_or_skip("a_kept_graph_gives_the_classifiers_gradient_again") else {
        return;
    };
    let (x, w, targets) = classifier_inputs(device, 1031, 5003);
    let loss = speedkit::nn::cross_entropy(&x.mm(&w), &targets);
    let first = Tensor::run_backward(&[&loss], &[&w], true, false).remove(0);
    let second = Tensor::run_backward(&[&loss], &[&w], false, false).remove(0);
    assert!(first.equal(&second));
}

#[test]
fn a_reduced_mse_loss_keeps_no_memory_of_its_inputs_size() {
    let Some(device) = cuda_or_skip("a_reduced_mse_loss_keeps_no_memory_of_its_inputs_size") else {
        return;
    };
    let _ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
    let x = Tensor::randn([2048, 4096], (Kind::Float, device)).set_requires_grad(true);
    let target = Tensor::randn([2048, 4096], (Kind::Float, device));
    let input_bytes = (2048 * 4096 * 4) as u64;
    tch::Cuda::synchronize(0);
    let before = MemoryUse::now(device).unwrap().allocated;
    let loss = x.mse_loss(&target, tch::Reduction::Mean);
    tch::Cuda::synchronize(0);
    let held = MemoryUse::now(device).unwrap().allocated - before;
    assert!(held < input_bytes / 2, "the loss holds {held} bytes");
    let reference = (&x - &target).square().mean(Kind::Float);
    assert!(rel_err(&loss, &reference) < 1e-6);
    let grad = Tensor::run_backward(&[&loss], &[&x], false, false).remove(0);
    let expected = (&x - &target) * (2.0 / (2048.0 * 4096.0));
    assert!(rel_err(&grad, &expected) < 1e-5);
}
