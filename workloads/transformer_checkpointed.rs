//! `transformer_checkpointed`: the main workload with every block checkpointed, the memory a user
//! near the limit trades for one more forward of each block.

use speedkit::bench::Bencher;
use speedkit_suite::models::{Transformer, TransformerConfig};
use speedkit_suite::REFERENCE_ADAMW;
use tch::Tensor;

/// `transformer`, each block's activations recomputed in the backward
/// ([`speedkit::checkpoint`]): one block's activations alive at a time.
#[speedkit::bench(tags = ["transformer", "checkpoint", "memory"])]
fn transformer_checkpointed(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b
        .size()
        .pick(TransformerConfig::tiny(), TransformerConfig::bench());
    let d = super::transformer_data(b, config)?;
    let model = Transformer::new(&d.vs.root(), &d.config)?;
    let ctx = b.ctx();
    ctx.data_parallel(&d.vs)?;
    let mut opt = ctx.adamw(&d.vs, REFERENCE_ADAMW)?;
    b.run(|| -> speedkit::Result<Tensor> {
        // The scope holds the whole step: the backward runs the checkpointed blocks again.
        ctx.checkpointed(|ck| {
            opt.zero_grad()?;
            let loss = ctx.autocast(|| model.loss_checkpointed(ck, &d.tokens, &d.targets))?;
            ctx.backward(&loss)?;
            ctx.step(&mut opt)?;
            Ok(loss)
        })
    })?;
    Ok(())
}
