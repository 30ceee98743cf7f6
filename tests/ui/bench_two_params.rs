use speedkit::bench::Bencher;

#[speedkit::bench]
fn two(_b: &mut Bencher, _n: usize) {}

fn main() {}
