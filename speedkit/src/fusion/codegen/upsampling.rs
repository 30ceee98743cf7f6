//! Nearest up-sampling as the generator takes it: the forward a gather (each element of the result
//! reads the input element it copies), the backward a sum of each input element's window of the
//! gradient. Both index as ATen's CUDA kernels do (`UpSample.cuh`: a scale in `float`, the source
//! row `floor(dst * scale)`, the gradient's window from `ceil(dst * scale)`), so the values are
//! ATen's bit for bit; the backward sums each window in ATen's order, in `float`.
//!
//! A U-Net's decoder up-samples its activations: ATen runs a copy to make them contiguous, the
//! up-sampling, and a cast to bf16 for the convolution after it, each a pass over the up-sampled
//! tensor (0.57 ms of `unet_tch`'s 8.9 ms step on an H200, its backward included). Generated, the
//! up-sampling is index arithmetic inside the kernel that computes its input or reads its result.

use std::fmt::Write;

use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::Generator;

/// A nearest up-sampling of 4-dimensional tensors (samples × channels × rows × columns): the
/// result's and the input's sizes, and the scales ATen computes from them.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Nearest {
    /// The up-sampled side's rows and columns (the forward's result, the backward's gradient).
    large: [i64; 2],
    /// The other side's rows and columns (the forward's input, the backward's result).
    small: [i64; 2],
    /// Per dimension, the `float` scale ATen's kernel multiplies an index by.
    scale: [f32; 2],
}

/// `op`'s up-sampling where it is `upsample_nearest2d` of a 4-dimensional tensor.
pub(super) fn upsamples_nearest(op: &TracedOp) -> Option<Nearest> {
    nearest(op, "aten::upsample_nearest2d", Direction::Forward)
}

/// `op`'s up-sampling where it is `upsample_nearest2d_backward` of a 4-dimensional gradient.
pub(super) fn upsamples_nearest_backward(op: &TracedOp) -> Option<Nearest> {
    nearest(op, "aten::upsample_nearest2d_backward", Direction::Backward)
}

/// Which of the two an up-sampling call is: its first argument is the small side (forward) or
/// the large one (backward, the gradient of the forward's result).
#[derive(Clone, Copy, PartialEq)]
enum Direction {
    Forward,
    Backward,
}

/// `op`'s up-sampling where it is operator `name` of 4-dimensional tensors in `direction`.
fn nearest(op: &TracedOp, name: &str, direction: Direction) -> Option<Nearest> {
    if op.name != name {
        return None;
    }
    let (input, out) = input_and_result(op)?;
    // Its `float? scales_h, float? scales_w` follow the sizes (one list forward, two backward).
    let first = match direction {
        Direction::Forward => 2,
        Direction::Backward => 3,
    };
    let given = [
        optional_double(op.inputs.get(first))?,
        optional_double(op.inputs.get(first + 1))?,
    ];
    let (small, large) = match direction {
        Direction::Forward => same_planes(input, out)?,
        Direction::Backward => same_planes(out, input)?,
    };
    // compute_scales_value<float> (forward): the reciprocal of a given scale, else input over
    // output; compute_scales_value_backwards<float>: a given scale, else output over input.
    let scale = [0, 1].map(|d| match (given[d], direction) {
        (Some(s), Direction::Forward) if s > 0.0 => (1.0 / s) as f32,
        (Some(s), Direction::Backward) if s > 0.0 => s as f32,
        (_, Direction::Forward) => small[d] as f32 / large[d] as f32,
        (_, Direction::Backward) => large[d] as f32 / small[d] as f32,
    });
    Some(Nearest {
        large,
        small,
        scale,
    })
}

/// `op`'s first argument and its one result, both tensors.
fn input_and_result(op: &TracedOp) -> Option<(&TracedTensor, &TracedTensor)> {
    match (op.inputs.first(), op.outputs.as_slice()) {
        (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) => Some((input, out)),
        _ => None,
    }
}

/// The rows and columns of `small` and `large`, 4-dimensional tensors of the same samples and
/// channels, none of them empty.
fn same_planes(small: &TracedTensor, large: &TracedTensor) -> Option<([i64; 2], [i64; 2])> {
    let four = small.shape.len() == 4 && large.shape.len() == 4;
    (four && small.shape[..2] == large.shape[..2] && small.numel > 0 && large.numel > 0).then(
        || {
            (
                [small.shape[2], small.shape[3]],
                [large.shape[2], large.shape[3]],
            )
        },
    )
}

/// A traced `float?` argument: `Some(None)` where none was given, `None` where it is unreadable.
fn optional_double(value: Option<&TracedValue>) -> Option<Option<f64>> {
    match value {
        None => Some(None),
        Some(TracedValue::Other { value, .. }) => {
            let text = value.trim_matches('"');
            match text.parse::<f64>() {
                Ok(v) => Some(Some(v)),
                Err(_) if text.is_empty() || text.contains("None") || text == "null" => Some(None),
                Err(_) => None,
            }
        }
        Some(_) => None,
    }
}

/// A `float` literal that NVRTC reads back as `v` exactly (Rust prints the shortest such digits).
fn float_literal(v: f32) -> String {
    let digits = format!("{v:?}");
    match digits.contains(['.', 'e']) {
        true => format!("{digits}f"),
        false => format!("{digits}.f"),
    }
}

impl Generator {
    /// `upsample_nearest2d`'s element at the result's coordinates `c`: the input's element at
    /// `floor(c * scale)` (no further than its last) along rows and columns.
    pub(super) fn nearest(
        &mut self,
        op: &TracedOp,
        out: &TracedTensor,
        body: &mut String,
    ) -> Result<String, String> {
        let shape = upsamples_nearest(op).ok_or("an up-sampling not generated")?;
        let (input, _) = input_and_result(op).ok_or("upsample_nearest2d without its input")?;
        self.coords = "u".into();
        writeln!(body, "  idx_t u[4] = {{c[0], c[1], 0, 0}};").unwrap();
        for d in 0..2 {
            writeln!(
                body,
                "  u[{}] = min((idx_t)floorf((float)c[{}] * {}), (idx_t){});",
                d + 2,
                d + 2,
                float_literal(shape.scale[d]),
                shape.small[d] - 1
            )
            .unwrap();
        }
        self.position = 0;
        self.read(input, out)
    }

    /// `upsample_nearest2d_backward`'s element at the result's coordinates `c`: the sum, in
    /// `float`, of the gradient's window from `ceil(c * scale)` to `ceil((c + 1) * scale)` (no
    /// further than its last row or column), row by row as ATen sums it.
    pub(super) fn nearest_backward(
        &mut self,
        op: &TracedOp,
        out: &TracedTensor,
        body: &mut String,
    ) -> Result<String, String> {
        let shape =
            upsamples_nearest_backward(op).ok_or("an up-sampling's backward not generated")?;
        let (grad, _) =
            input_and_result(op).ok_or("upsample_nearest2d_backward without its gradient")?;
        let window = |d: usize, at: &str| {
            format!(
                "min((idx_t)ceilf((float)({at}) * {}), (idx_t){})",
                float_literal(shape.scale[d]),
                shape.large[d]
            )
        };
        writeln!(body, "  idx_t u[4] = {{c[0], c[1], 0, 0}};").unwrap();
        writeln!(body, "  float sum = 0.f;").unwrap();
        self.coords = "u".into();
        self.position = 0;
        let value = self.read(grad, out)?;
        writeln!(
            body,
            "  for (u[2] = {}; u[2] < {}; ++u[2])\n    for (u[3] = {}; u[3] < {}; ++u[3]) sum += {value};",
            window(0, "c[2]"),
            window(0, "c[2] + 1"),
            window(1, "c[3]"),
            window(1, "c[3] + 1"),
        )
        .unwrap();
        Ok("sum".into())
    }
}
