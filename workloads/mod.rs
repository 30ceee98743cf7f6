//! The registered benchmark workloads of `docs/workloads.md`, each a `#[speedkit::bench]`
//! function over a [`speedkit::bench::Bencher`].
//!
//! Included, not compiled as a crate, by every target that runs them (`#[path] mod workloads;`):
//! the bench runner (`benches/workloads.rs`), its example twin (`examples/bench.rs`), the test
//! harness (`tests/workloads.rs`) and the ladder example.
//!
//! Training workloads build their model at `b.size()` on `b.device()` from the models of
//! `speedkit_suite`, train on fixed random data made once (seed 0), and time one full training
//! step per call through [`train_step`]. GPU "anatomy" workloads (`contiguity_*`, `sync_*`) show
//! single effects and are skipped without a GPU.

mod contiguity;
mod convnext_tch;
mod gpt2;
mod gpt2_tch;
mod linear3;
mod llama_tch;
mod matmul;
mod mlp;
mod mlp_block;
mod resnet;
mod sync_points;
mod transformer;
mod transformer_checkpointed;
mod transformer_tch;
mod unet_tch;
mod vit_tch;

use speedkit::bench::Bencher;
use speedkit_suite::REFERENCE_ADAMW;
use tch::nn::VarStore;
use tch::Tensor;

/// Times one full training step per call, as `docs/workloads.md` defines it: forward and loss
/// (`loss()`, under the plan's autocast) → `zero_grad` → backward (scaled when the plan has a
/// GradScaler) → AdamW step over `vs` (fused or foreach as the plan says), the last three through
/// `SpeedContext::backward_step`, as a user's step. Under `speedkit launch` every rank trains its
/// replica data-parallel: `vs` takes rank 0's values and its gradients are averaged across ranks in
/// each backward, the optimizer stepping each bucket as it lands (a single process: nothing
/// changes).
///
/// The step reads nothing on the host and returns the loss tensor, so the runner can capture it
/// as a CUDA graph when the plan enables graphs; `loss` must use static tensors made beforehand.
fn train_step(
    b: &mut Bencher<'_>,
    vs: &VarStore,
    mut loss: impl FnMut() -> speedkit::Result<Tensor>,
) -> anyhow::Result<()> {
    let ctx = b.ctx();
    ctx.data_parallel(vs)?;
    let mut opt = ctx.adamw(vs, REFERENCE_ADAMW)?;
    b.run(|| -> speedkit::Result<Tensor> {
        let loss = ctx.autocast(&mut loss)?;
        ctx.backward_step(&loss, &mut opt)?;
        Ok(loss)
    })?;
    Ok(())
}

/// A transformer workload's data, at `config` with the runner's batch (`Bencher::batch`): the
/// config as built, a fresh VarStore on the bench device, fixed random tokens and targets (seed 0),
/// and the step's FLOPs and tokens declared.
struct TransformerData {
    config: speedkit_suite::models::TransformerConfig,
    vs: VarStore,
    tokens: Tensor,
    targets: Tensor,
}

fn transformer_data(
    b: &mut Bencher<'_>,
    mut config: speedkit_suite::models::TransformerConfig,
) -> anyhow::Result<TransformerData> {
    config.batch = b.batch(config.batch);
    speedkit_suite::data::seed();
    let vs = VarStore::new(b.device());
    let (tokens, targets) =
        speedkit_suite::data::tokens(config.batch, config.seq_len, config.vocab, b.device())?;
    // The model's FLOPs (a checkpointed run's recomputation is not useful work: the TFLOP/s column
    // reads as model FLOP utilisation, comparable between the variants).
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.tokens_per_step() as f64, "tokens");
    Ok(TransformerData {
        config,
        vs,
        tokens,
        targets,
    })
}

/// The dtype a pure-matmul workload computes in: the autocast dtype of a bf16/fp16 plan, fp32
/// otherwise (TF32 or not, as the plan's flags say). Inputs are cast to it once, up front, so the
/// timed step is the kernel alone (what autocast would run, without its per-step casts).
fn compute_kind(b: &Bencher<'_>) -> tch::Kind {
    b.ctx()
        .plan()
        .precision
        .autocast_kind()
        .unwrap_or(tch::Kind::Float)
}

/// A standard-normal `[rows, cols]` matrix on the bench device in [`compute_kind`].
fn random_matrix(b: &Bencher<'_>, rows: i64, cols: i64) -> anyhow::Result<Tensor> {
    let t = Tensor::f_randn([rows, cols], (tch::Kind::Float, b.device()))?;
    Ok(t.f_to_kind(compute_kind(b))?)
}
