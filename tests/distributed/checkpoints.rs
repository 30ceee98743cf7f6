//! Sharded checkpoints between world sizes: one process's checkpoint resumed by ZeRO-3 ranks as
//! the process would have gone on, and the checkpoint ZeRO-3 ranks wrote read whole by one process.

use crate::common;
use crate::fixture::{adamw, blocks_model, config, data, GLOBAL_BATCH, STEPS, WORLD};
use crate::processes::{load, run_launcher, scratch, text};
use speedkit::{apply_speedups, SpeedContext};
use tch::nn::{self, Module};
use tch::{Device, Tensor};

/// One process trains `blocks_model` on the whole global batches from rank 0's initialisation,
/// calling `halfway` after the first half of the steps; its variables at the end, by name.
fn one_process_training(
    halfway: impl FnOnce(&SpeedContext, &nn::VarStore, &speedkit::optim::AdamWOptimizer),
) -> Vec<(String, Tensor)> {
    let _lock = common::serial();
    let (x, y) = data();
    tch::manual_seed(100);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = blocks_model(&vs);
    let ctx = apply_speedups(&mut vs, &config(1)).unwrap();
    let mut opt = ctx.adamw(&vs, adamw()).unwrap();
    let mut halfway = Some(halfway);
    for step in 0..STEPS {
        if step == STEPS / 2 {
            (halfway.take().unwrap())(&ctx, &vs, &opt);
        }
        let (xb, yb) = (
            x.narrow(0, step * GLOBAL_BATCH, GLOBAL_BATCH),
            y.narrow(0, step * GLOBAL_BATCH, GLOBAL_BATCH),
        );
        let loss = ctx.autocast(|| net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean));
        ctx.backward_step(&loss, &mut opt).unwrap();
    }
    sorted(vs.variables().into_iter().collect())
}

/// The model `build` makes, and an AdamW over it, in one process, read from the sharded checkpoint
/// in `dir`: the variables by name, and the steps the optimizer's state counts.
fn loaded_into_one_process(
    build: fn(&nn::VarStore) -> Box<dyn Module>,
    dir: &std::path::Path,
) -> (Vec<(String, Tensor)>, i64) {
    let _lock = common::serial();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let _net = build(&vs);
    let ctx = apply_speedups(&mut vs, &config(1)).unwrap();
    let mut opt = ctx.adamw(&vs, adamw()).unwrap();
    ctx.load_sharded(&vs, Some(&mut opt), dir).unwrap();
    let steps = opt.steps_taken().unwrap();
    (sorted(vs.variables().into_iter().collect()), steps)
}

fn sorted(mut named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

fn assert_same_model(
    got: &[(String, Tensor)],
    want: &[(String, Tensor)],
    tolerance: f64,
    what: &str,
) {
    let names = |m: &[(String, Tensor)]| m.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}");
    for ((name, g), (_, w)) in got.iter().zip(want) {
        let err = common::rel_err(g, w);
        assert!(err <= tolerance, "{what}: {name} differs by {err:e}");
    }
}

#[test]
fn a_checkpoint_one_process_wrote_resumes_on_zero3_ranks_as_the_process_went_on() {
    let out = scratch("resume-sharded-parameters");
    // Model and AdamW state (moments and step counts) at half the steps, in one rank's file.
    let reference = one_process_training(|ctx, vs, opt| {
        ctx.save_sharded(vs, Some(opt), out.join("one")).unwrap();
    });
    let output = run_launcher("resume_sharded_parameters", &out);
    assert!(output.status.success(), "{}", text(&output));
    for rank in 0..WORLD {
        let resumed = load(&out.join(format!("rank{rank}.ot")));
        assert_same_model(&resumed, &reference, 1e-5, &format!("rank {rank}"));
    }
}

#[test]
fn a_checkpoint_zero3_ranks_wrote_reads_whole_in_one_process() {
    let out = scratch("sharded-checkpoint-whole");
    let output = run_launcher("train_sharded_parameters", &out);
    assert!(output.status.success(), "{}", text(&output));
    // What the ranks trained, gathered for the save.
    let trained = load(&out.join("rank0.ot"));
    let dir = out.join("sharded");
    assert!(
        dir.join("rank00000-of-00002.safetensors").exists()
            && dir.join("rank00001-of-00002.safetensors").exists()
    );

    let assembled = sorted(speedkit::dist::read_sharded_checkpoint(&dir).unwrap());
    assert_same_model(&assembled, &trained, 0.0, "assembled from the ranks' files");

    let (loaded, _) = loaded_into_one_process(|vs| Box::new(blocks_model(vs)), &dir);
    assert_same_model(&loaded, &trained, 0.0, "loaded into one process");
}

#[test]
fn a_checkpoint_zero1_ranks_wrote_holds_the_model_and_every_piece_of_the_optimizer_state() {
    let out = scratch("sharded-optimizer-checkpoint");
    let output = run_launcher("train_sharded", &out);
    assert!(output.status.success(), "{}", text(&output));
    let trained = load(&out.join("rank0.ot"));
    let dir = out.join("sharded");
    let assembled = sorted(speedkit::dist::read_sharded_checkpoint(&dir).unwrap());
    assert_same_model(
        &assembled,
        &trained,
        0.0,
        "assembled from the ranks' pieces",
    );

    // Every element of AdamW's state is in one rank's file or the other's: one process reads it
    // all (a stretch missing would be an error).
    let (loaded, steps) = loaded_into_one_process(|vs| Box::new(crate::fixture::model(vs)), &dir);
    assert_same_model(&loaded, &trained, 0.0, "loaded into one process");
    assert_eq!(steps, STEPS, "the step count the ranks reached");
}
