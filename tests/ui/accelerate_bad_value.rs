// Bad values, in a file (at the path literal, with line and column) and inline (at the key);
// every inline problem is reported, not only the first.
#[speedkit::accelerate(config = "../../../../tests/ui/configs/bad_value.yaml")]
fn from_file() {}

#[speedkit::accelerate(precision = "bf61", cudnn(benchmark = "yes"), grad_scaler(init_scale = -1.0))]
fn inline() {}

fn main() {
    from_file();
    inline();
}
