// Unknown arguments list the valid ones and suggest the closest; `ctx` still binds, so the body
// compiles and no follow-up error appears.
#[speedkit::accelerate(ctx = ctx, precison = "bf16", learning_rate = 0.1)]
fn train() {
    let _ = ctx.device();
}

fn main() {
    train();
}
