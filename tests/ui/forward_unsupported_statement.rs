// #[speedkit::forward] wraps a `let` with an initializer or a block, nothing else.
#[speedkit::accelerate]
fn train(x: &tch::Tensor) {
    #[speedkit::forward]
    let y;
    y = x * 2;
    #[speedkit::forward]
    x.print();
    #[speedkit::forward]
    println!("forward");
    let _ = y;
    #[speedkit::forward]
    fn helper() {}
    helper();
}

fn main() {
    train(&tch::Tensor::from(1.0));
}
