use speedkit::bench::Bencher;

#[speedkit::bench(sizes = ["tiny", "huge", "tiny"])]
fn typo_and_repeat(_b: &mut Bencher) {}

#[speedkit::bench(sizes = [])]
fn empty(_b: &mut Bencher) {}

fn main() {}
