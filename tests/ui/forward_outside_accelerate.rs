// Outside an #[speedkit::accelerate] function there is no speed context to autocast with.
#[speedkit::forward]
fn forward_pass(x: &tch::Tensor) -> tch::Tensor {
    x * 2
}

fn main() {
    let _ = forward_pass(&tch::Tensor::from(1.0));
}
