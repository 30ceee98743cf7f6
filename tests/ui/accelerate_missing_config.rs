// A config file that does not exist: the error names the full path that was tried.
#[speedkit::accelerate(config = "no_such_speed.yaml")]
fn train() {}

fn main() {
    train();
}
