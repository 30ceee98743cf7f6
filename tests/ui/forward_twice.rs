use speedkit::forward;

#[speedkit::accelerate]
fn train(x: &tch::Tensor) -> f64 {
    #[speedkit::forward]
    #[forward]
    let y = x * 2;
    y.double_value(&[])
}

fn main() {
    train(&tch::Tensor::from(1.0));
}
