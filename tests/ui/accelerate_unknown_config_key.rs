// An unknown key in the config file: the error names the file, the line and column of the key and
// the closest valid key. Paths are relative to the Cargo.toml of the crate being compiled, which
// for trybuild is its generated project in target/tests/trybuild/<crate>/.
#[speedkit::accelerate(config = "../../../../tests/ui/configs/unknown_key.yaml")]
fn train() {}

fn main() {
    train();
}
