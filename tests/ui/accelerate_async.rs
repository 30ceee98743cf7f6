// The flag guard must not be held across `.await`.
#[speedkit::accelerate]
async fn train() {}

fn main() {
    let _ = train();
}
