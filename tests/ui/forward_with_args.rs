// The autocast dtype comes from the speed config, not from the attribute.
#[speedkit::accelerate(precision = "bf16")]
fn train(x: &tch::Tensor) -> tch::Tensor {
    #[speedkit::forward(fp16)]
    let y = x * 2;
    y
}

fn main() {
    let _ = train(&tch::Tensor::from(1.0));
}
