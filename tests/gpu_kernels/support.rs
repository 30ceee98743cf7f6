//! Helpers the kernel tests share: shapes, tolerances, comparisons, a Linear's context and pass.

use speedkit::config::{DeviceChoice, Precision, SpeedConfig};
use speedkit::nn::Linear;
use speedkit::SpeedContext;
use tch::nn;
use tch::{Device, Kind, Tensor};

pub const ROWS: [i64; 3] = [1, 7, 1000];
pub const WIDTHS: [i64; 5] = [1, 33, 768, 1023, 8192];
pub const KINDS: [Kind; 3] = [Kind::Float, Kind::BFloat16, Kind::Half];

pub fn output_tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 1e-2,
        Kind::Half => 2e-3,
        _ => 1e-5,
    }
}

/// The kernels ran: no op has taken the ATen path (the message says why one did).
pub fn assert_no_fallback() {
    let notes = speedkit::kernels::fallbacks();
    assert!(notes.is_empty(), "ATen fallbacks: {notes:?}");
}

pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shapes differ");
    let got = got.to_kind(Kind::Double).to_device(Device::Cpu);
    let want = want.to_kind(Kind::Double).to_device(Device::Cpu);
    let gap = (&got - &want).norm().double_value(&[]);
    let scale = want.norm().double_value(&[]).max(1.0);
    assert!(
        gap <= tol * scale,
        "{what}: ‖got − want‖ = {gap:.3e} > {tol:.0e} · {scale:.3e}"
    );
}

/// A context on the first GPU computing in fp32, or under bf16 autocast when `autocast`.
pub fn context_for(autocast: bool) -> SpeedContext {
    SpeedContext::new(&SpeedConfig {
        device: DeviceChoice::Cuda(0),
        precision: if autocast {
            Precision::Bf16
        } else {
            Precision::Fp32
        },
        ..SpeedConfig::auto()
    })
    .unwrap()
}

/// Puts the parameters of `vs` in `kind`, unless autocast keeps them in fp32.
pub fn store_in(vs: &mut nn::VarStore, kind: Kind, autocast: bool) {
    match kind {
        _ if autocast => {}
        Kind::BFloat16 => vs.bfloat16(),
        Kind::Half => vs.half(),
        _ => {}
    }
}

/// Runs `forward` inside `ctx` on a random input of shape `input` in `kind`, checks that the
/// kernels ran and that the output is in `kind`, and backpropagates a random `outputs`-wide
/// gradient. Returns the input, the output and that gradient.
pub fn forward_backward(
    ctx: &SpeedContext,
    input: [i64; 2],
    outputs: i64,
    kind: Kind,
    forward: impl Fn(&Tensor) -> speedkit::Result<Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let device = Device::Cuda(0);
    let x = Tensor::randn(input, (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let y = ctx.autocast(|| forward(&x)).unwrap();
    assert_no_fallback();
    assert_eq!(y.kind(), kind);
    let dy = Tensor::randn([input[0], outputs], (Kind::Float, device)).to_kind(kind);
    (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    (x, y, dy)
}

/// `t`'s value rounded to `kind`, as an fp32 leaf of the reference computation.
pub fn rounded_leaf(t: &Tensor, kind: Kind) -> Tensor {
    t.detach()
        .to_kind(kind)
        .to_kind(Kind::Float)
        .set_requires_grad(true)
}

/// The layer's output on speedkit's path equals ATen's `linear` on the weights as they are now.
pub fn assert_linear_uses_current_weights(ctx: &SpeedContext, fc: &Linear, x: &Tensor, what: &str) {
    let y = ctx.autocast(|| fc.forward_t(x)).unwrap();
    let want = ctx.autocast(|| x.linear(&fc.ws, fc.bs.as_ref()));
    assert_close(what, &y, &want, 1e-6);
}
