// A config file and inline keys at once: choose one.
#[speedkit::accelerate(config = "speed.yaml", precision = "bf16")]
fn train() {}

fn main() {
    train();
}
