//! Norms as the generator takes them: a group norm's and a layer norm's forward rows (a sample's
//! group of channels, a row of the last dimension) and their statistics, a group norm's backward's
//! rows with the weight's and bias's gradients, and a sum over each channel of the backward's
//! results (a convolution bias's gradient).

use std::fmt::Write;

use tch::Kind;

use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::{
    c_type, check_contiguous, coordinates_of, integer, kind_of, row_major, sums_columns,
    sums_in_own_type, ArgSource, Generator, KernelArg, RowReduction,
};

/// A norm's rows as the generator takes them: `native_group_norm` of a tensor of samples ×
/// channels × `hxw` elements, in `rows` = samples × groups rows of `width` elements, or
/// `native_layer_norm` over the last dimension, in rows of that dimension; its three results
/// (normalised elements, means, reciprocal standard deviations) of stored types and contiguous,
/// the first in its input's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct NormRows {
    rows: u64,
    width: u64,
    eps: f64,
    /// The dimension of the normalised result whose coordinate picks an element's weight and
    /// bias: a group norm's channels, a layer norm's last.
    parameter_dim: usize,
    /// The position of the weight among the call's arguments, the bias's the next.
    weight_position: usize,
    /// ATen's formula of a layer norm (`(x - mean) * rstd * w + b`) rather than of a group norm.
    layer: bool,
}

/// `op`'s rows where it is a norm the generator takes ([`NormRows`]).
pub(super) fn normalizes_rows(op: &TracedOp) -> Option<NormRows> {
    normalizes_groups(op).or_else(|| normalizes_last_dimension(op))
}

/// `op`'s rows where it is a group norm the generator takes.
fn normalizes_groups(op: &TracedOp) -> Option<NormRows> {
    if op.name != "aten::native_group_norm" {
        return None;
    }
    let (input, [out, mean, rstd]) = norm_tensors(op).ok()?;
    let (samples, channels, hxw, groups) = sizes_from(op, 3)?;
    let eps = float(op.inputs.get(7))?;
    let rows = (samples * groups) as u64;
    let sized = groups > 0
        && channels % groups == 0
        && input.shape.len() >= 2
        && input.shape[1] == channels
        && input.numel == (samples * channels * hxw) as u64
        && out.shape == input.shape
        && mean.numel == rows
        && rstd.numel == rows;
    (sized && stored_and_contiguous(input, [out, mean, rstd])).then_some(NormRows {
        rows,
        width: (channels / groups * hxw) as u64,
        eps,
        parameter_dim: 1,
        weight_position: 1,
        layer: false,
    })
}

/// `op`'s rows where it is a layer norm over the last dimension alone (`normalized_shape` of one
/// size, as `nn::layer_norm(.., vec![d], ..)` makes) the generator takes.
fn normalizes_last_dimension(op: &TracedOp) -> Option<NormRows> {
    if op.name != "aten::native_layer_norm" {
        return None;
    }
    let (input, [out, mean, rstd]) = norm_tensors(op).ok()?;
    let width = last_dimension(op, 1, input)?;
    let eps = float(op.inputs.get(4))?;
    let rows = input.numel / width as u64;
    let sized = out.shape == input.shape && mean.numel == rows && rstd.numel == rows;
    (sized && stored_and_contiguous(input, [out, mean, rstd])).then_some(NormRows {
        rows,
        width: width as u64,
        eps,
        parameter_dim: input.shape.len() - 1,
        weight_position: 2,
        layer: true,
    })
}

/// `op`'s tensor argument `position`, where it is one.
fn tensor_argument(op: &TracedOp, position: usize) -> Option<&TracedTensor> {
    match op.inputs.get(position) {
        Some(TracedValue::Tensor(t)) => Some(t),
        _ => None,
    }
}

/// The width a layer norm normalises, from its `normalized_shape` (argument `position`): one
/// size, `input`'s last.
fn last_dimension(op: &TracedOp, position: usize, input: &TracedTensor) -> Option<i64> {
    let normalized: Vec<i64> = match op.inputs.get(position)? {
        TracedValue::Other { value, .. } => serde_json::from_str(value).ok()?,
        _ => return None,
    };
    let [width] = normalized[..] else {
        return None;
    };
    (width > 0 && input.shape.last() == Some(&width)).then_some(width)
}

/// A float argument (a norm's epsilon).
fn float(value: Option<&TracedValue>) -> Option<f64> {
    match value? {
        TracedValue::Other { value, .. } => value.trim_matches('"').parse::<f64>().ok(),
        _ => None,
    }
}

/// Whether a norm's input and results are of types the generator stores, the results contiguous.
fn stored_and_contiguous(input: &TracedTensor, results: [&TracedTensor; 3]) -> bool {
    let stored = std::iter::once(input)
        .chain(results)
        .all(|t| kind_of(&t.dtype).is_some_and(|k| k != Kind::Bool));
    stored && results.iter().all(|t| check_contiguous(t).is_ok())
}

/// A layer norm's backward as the generator takes it: `native_layer_norm_backward` over the last
/// dimension alone (as [`NormRows`] takes its forward), the gradient and input of one shape, the
/// forward's stored statistics (contiguous, one per row), and all three gradients (the input's
/// contiguous in its shape, the weight's and bias's one per column): `rows` rows of `width`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct LayerNormGradients {
    rows: u64,
    width: u64,
}

/// `op`'s rows where it is a layer norm's backward the generator takes ([`LayerNormGradients`]).
pub(super) fn layer_norm_gradients(op: &TracedOp) -> Option<LayerNormGradients> {
    if op.name != "aten::native_layer_norm_backward" {
        return None;
    }
    let tensor = |i: usize| tensor_argument(op, i);
    let (grad, input, mean, rstd) = (tensor(0)?, tensor(1)?, tensor(3)?, tensor(4)?);
    let width = last_dimension(op, 2, input)?;
    let [TracedValue::Tensor(dx), TracedValue::Tensor(dw), TracedValue::Tensor(db)] =
        op.outputs.as_slice()
    else {
        return None;
    };
    let rows = input.numel / width as u64;
    let sized = grad.shape == input.shape
        && dx.shape == input.shape
        && [mean, rstd].iter().all(|t| t.numel == rows)
        && [dw, db].iter().all(|t| t.numel == width as u64);
    // A gradient not asked for (no weight or bias, or a frozen one) is an undefined tensor, of no
    // element type: such a backward stays ATen's.
    let stored = [grad, input, mean, rstd, dx, dw, db]
        .iter()
        .all(|t| kind_of(&t.dtype).is_some_and(|k| k != Kind::Bool));
    let contiguous = [mean, rstd, dx, dw, db]
        .iter()
        .all(|t| check_contiguous(t).is_ok());
    (sized && stored && contiguous).then_some(LayerNormGradients {
        rows,
        width: width as u64,
    })
}

/// A group norm's backward as the generator takes it: `native_group_norm_backward` of the
/// gradient and input of a tensor of `samples` × `channels` × `hxw` elements in `groups` groups,
/// with the forward's stored statistics (contiguous, one per row), and all three gradients (the
/// input's contiguous in its shape, the weight's and bias's one per channel) of stored types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct GroupNormGradients {
    pub(super) samples: u64,
    pub(super) channels: u64,
    pub(super) groups: u64,
    pub(super) hxw: u64,
}

impl GroupNormGradients {
    pub(super) fn rows(&self) -> u64 {
        self.samples * self.groups
    }

    pub(super) fn channels_per_group(&self) -> u64 {
        self.channels / self.groups
    }

    pub(super) fn width(&self) -> u64 {
        self.channels_per_group() * self.hxw
    }
}

/// A norm's input, and its three results: the normalised elements, means and reciprocal standard
/// deviations.
fn norm_tensors(op: &TracedOp) -> Result<(&TracedTensor, [&TracedTensor; 3]), String> {
    match (op.inputs.first(), op.outputs.as_slice()) {
        (
            Some(TracedValue::Tensor(input)),
            [TracedValue::Tensor(out), TracedValue::Tensor(mean), TracedValue::Tensor(rstd)],
        ) => Ok((input, [out, mean, rstd])),
        _ => Err(format!("{} without its input and three results", op.name)),
    }
}

/// A group norm's samples, channels, elements a channel and groups: its integer arguments from
/// position `first` on.
fn sizes_from(op: &TracedOp, first: usize) -> Option<(i64, i64, i64, i64)> {
    let size = |i: usize| integer(op.inputs.get(first + i));
    Some((size(0)?, size(1)?, size(2)?, size(3)?))
}

/// `op`'s shape where it is a group norm's backward the generator takes ([`GroupNormGradients`]).
pub(super) fn group_norm_gradients(op: &TracedOp) -> Option<GroupNormGradients> {
    if op.name != "aten::native_group_norm_backward" {
        return None;
    }
    let tensor = |i: usize| tensor_argument(op, i);
    let (grad, input, mean, rstd) = (tensor(0)?, tensor(1)?, tensor(2)?, tensor(3)?);
    let [TracedValue::Tensor(dx), TracedValue::Tensor(dw), TracedValue::Tensor(db)] =
        op.outputs.as_slice()
    else {
        return None;
    };
    let (samples, channels, hxw, groups) = sizes_from(op, 5)?;
    if samples <= 0 || channels <= 0 || hxw <= 0 || groups <= 0 || channels % groups != 0 {
        return None;
    }
    let shape = GroupNormGradients {
        samples: samples as u64,
        channels: channels as u64,
        groups: groups as u64,
        hxw: hxw as u64,
    };
    let sized = input.shape.len() >= 2
        && input.shape[1] == channels
        && input.numel == shape.rows() * shape.width()
        && grad.shape == input.shape
        && dx.shape == input.shape
        && [mean, rstd].iter().all(|t| t.numel == shape.rows())
        && [dw, db].iter().all(|t| t.numel == shape.channels);
    let stored = [grad, input, mean, rstd, dx, dw, db]
        .iter()
        .all(|t| t.item_bytes > 0 && kind_of(&t.dtype).is_some_and(|k| k != Kind::Bool));
    let contiguous = [mean, rstd, dx, dw, db]
        .iter()
        .all(|t| check_contiguous(t).is_ok());
    (sized && stored && contiguous).then_some(shape)
}

/// Whether `op` sums every element of each channel (all dimensions but the second) of a tensor
/// of at least three dimensions, in its own type: the gradient of a bias broadcast over a
/// convolution's output, as autograd sums it. Over a channels-last image, whose memory holds rows
/// of channels, it is a sum over columns instead ([`sums_columns`]).
pub(crate) fn sums_channels(op: &TracedOp) -> bool {
    !sums_columns(op)
        && sums_in_own_type(op).is_some_and(|(rank, dims)| {
            let all_but_channels: Vec<i64> = (0..rank as i64).filter(|&d| d != 1).collect();
            rank >= 3 && dims == all_but_channels
        })
}

/// A group norm's backward's rows ([`GroupNormGradients`]) and the arguments its row loop reads
/// itself: the statistics, one per row, and the weight (its argument and stride), if any.
#[derive(Clone, Debug)]
pub(super) struct GradientRows {
    pub(super) shape: GroupNormGradients,
    pub(super) mean: usize,
    pub(super) rstd: usize,
    pub(super) weight: Option<(usize, i64)>,
    /// The elements summed over each channel ([`Generator::channel_sum`]), as read at `p`.
    pub(super) channel_sums: Vec<String>,
}

/// The read of a per-channel argument (`channel_argument`'s: its index and stride) at `channel`,
/// or `absent` where there is none.
pub(super) fn channel_read(argument: Option<(usize, i64)>, channel: &str, absent: &str) -> String {
    match argument {
        Some((i, stride)) => format!("to_float_any(a.in{i}[{channel} * {stride}])"),
        None => absent.into(),
    }
}

impl Generator {
    /// A norm ([`NormRows`]): its input read at row `row`, column `col` (a group norm's row: a
    /// sample's group of channels one after the other, each channel's elements in order), and
    /// three functions: the normalised element, scaled and shifted by its weight and bias as ATen
    /// does, and the row's mean and reciprocal standard deviation.
    pub(super) fn norm(&mut self, op: &TracedOp) -> Result<(), String> {
        let shape = normalizes_rows(op).ok_or("a norm of a shape not generated")?;
        if self.stored_statistics {
            return self.norm_from_statistics(op, shape);
        }
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let (input, [out, mean, rstd]) = norm_tensors(op)?;
        let mut body = String::new();
        writeln!(body, "  const idx_t p = row * {} + col;", shape.width).unwrap();
        body.push_str(&coordinates_of(&row_major(input)));
        self.row_input(op, "in_red", 0, body)?;
        self.held_function = self.own_producer(input, &row_major(input));
        let body = self.normalised(op, shape, input, out, |_| ["red.x".into(), "red.y".into()])?;
        self.read_row_element = true;
        self.define(op, out, &body);
        // A row's statistics too are its own block's only.
        for (statistic, t) in [("red.x", mean), ("red.y", rstd)] {
            let kind = kind_of(&t.dtype).unwrap_or(Kind::Float);
            let body = format!("  return round_to<{}>({statistic});\n", c_type(kind));
            self.read_row_element = true;
            self.define(op, t, &body);
        }
        self.reduction = Some(RowReduction {
            rows: shape.rows,
            width: shape.width,
            op: "moments",
            eps: shape.eps,
            gradients: None,
            column_sums: Vec::new(),
        });
        Ok(())
    }

    /// A norm's normalised elements from its stored statistics (results 1 and 2, one per row of
    /// `width` elements): a pointwise function, computed as the reduction's is.
    fn norm_from_statistics(&mut self, op: &TracedOp, shape: NormRows) -> Result<(), String> {
        let width = shape.width;
        let (input, [out, mean, rstd]) = norm_tensors(op)?;
        let body = self.normalised(op, shape, input, out, |g| {
            [(mean, 1), (rstd, 2)].map(|(t, position)| {
                let i = g.result_argument(t, position);
                format!("to_float_any(a.in{i}[ROW_OF(p, {width})])")
            })
        })?;
        self.define(op, out, &body);
        Ok(())
    }

    /// A group norm's backward ([`GroupNormGradients`]) as ATen computes it: per row, the sums of
    /// `dy * x` and `dy` over each of its channels; the input's gradient
    /// `rstd * w * dy + c2 * x + c3`, with `c2` and `c3` of the row's channel sums weighted by
    /// `w` (`red`); the weight's and bias's, the sums over samples of each channel's
    /// `(sum(dy * x) - sum(dy) * mean) * rstd` and `sum(dy)`, by the kernel's last block.
    pub(super) fn group_norm_backward(&mut self, op: &TracedOp) -> Result<(), String> {
        let shape = group_norm_gradients(op).ok_or("a group norm's backward not generated")?;
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let (
            [Some(TracedValue::Tensor(grad)), Some(TracedValue::Tensor(input)), Some(TracedValue::Tensor(mean)), Some(TracedValue::Tensor(rstd))],
            [TracedValue::Tensor(dx), TracedValue::Tensor(dw), TracedValue::Tensor(db)],
        ) = (
            [0, 1, 2, 3].map(|i| op.inputs.get(i)),
            op.outputs.as_slice(),
        )
        else {
            return Err(
                "native_group_norm_backward without its four inputs and three results".into(),
            );
        };
        let width = shape.width();
        self.gradient_rows(op, width, grad, input)?;
        let [mean, rstd] = self.statistics(op, [(2, mean), (3, rstd)])?;
        let weight = self.channel_argument(op, 4)?;
        let mut body = coordinates_of(dx);
        self.position = 0;
        let dy = format!("OWN(0, {})", self.read(grad, dx)?);
        self.position = 1;
        let x = self.read(input, dx)?;
        let w = channel_read(weight, "c[1]", "1.f");
        let kind = kind_of(&dx.dtype).unwrap_or(Kind::Float);
        writeln!(
            body,
            "  return round_to<{}>(to_float_any(a.in{rstd}[ROW_OF(p, {width})]) * {w} * {dy} + red.x * {x} + red.y);",
            c_type(kind)
        )
        .unwrap();
        // Computed with its row's sums, it is its own block's only.
        self.read_row_element = true;
        self.define(op, dx, &body);
        for (which, t) in [dw, db].into_iter().enumerate() {
            self.note_extent(t);
            self.results
                .insert(t.key(), (usize::MAX, t.clone(), self.call, which + 1));
            self.channel_results.insert(t.key(), which);
        }
        self.reduction = Some(RowReduction {
            rows: shape.rows(),
            width,
            op: "group_norm_backward",
            eps: 0.0,
            gradients: Some(GradientRows {
                shape,
                mean,
                rstd,
                weight,
                channel_sums: Vec::new(),
            }),
            column_sums: Vec::new(),
        });
        Ok(())
    }

    /// A norm's backward's row inputs: its gradient (`in_dy`, argument 0) and its input (`in_x`,
    /// argument 1) at a row and a column, rows of `width`.
    fn gradient_rows(
        &mut self,
        op: &TracedOp,
        width: u64,
        grad: &TracedTensor,
        input: &TracedTensor,
    ) -> Result<(), String> {
        for (name, position, t) in [("in_dy", 0, grad), ("in_x", 1, input)] {
            let mut body = format!("  const idx_t p = row * {width} + col;\n");
            body.push_str(&coordinates_of(&row_major(t)));
            self.row_input(op, name, position, body)?;
        }
        Ok(())
    }

    /// The arguments of a norm's backward's stored statistics (mean and reciprocal standard
    /// deviation, at their positions), which the forward made: not in the group.
    fn statistics(
        &mut self,
        op: &TracedOp,
        statistics: [(usize, &TracedTensor); 2],
    ) -> Result<[usize; 2], String> {
        let [mean, rstd] = statistics.map(|(position, t)| {
            self.position = position;
            self.note_extent(t);
            (!self.inside.contains(&(self.call, t.storage)))
                .then(|| self.argument(t, KernelArg::Input(t.clone())))
        });
        match (mean, rstd) {
            (Some(mean), Some(rstd)) => Ok([mean, rstd]),
            _ => Err(format!(
                "{}'s statistics computed in the group of its backward",
                op.name
            )),
        }
    }

    /// A layer norm's backward ([`LayerNormGradients`]) as ATen computes it: per row, the sums of
    /// `dy * w` and of `dy * w * xhat` (`ln_terms`), over the width as `red`; the input's gradient
    /// `rstd * (dy * w - red.x - xhat * red.y)`; the weight's and bias's, the sums over rows of
    /// `dy * xhat` and `dy`, summed over columns as the kernel writes its rows.
    pub(super) fn layer_norm_backward(&mut self, op: &TracedOp) -> Result<(), String> {
        let shape = layer_norm_gradients(op).ok_or("a layer norm's backward not generated")?;
        if self.reduction.is_some() {
            return Err("a second reduction in one group".into());
        }
        let (
            [Some(TracedValue::Tensor(grad)), Some(TracedValue::Tensor(input)), Some(TracedValue::Tensor(mean)), Some(TracedValue::Tensor(rstd))],
            [TracedValue::Tensor(dx), dw, db],
        ) = (
            [0, 1, 3, 4].map(|i| op.inputs.get(i)),
            op.outputs.as_slice(),
        )
        else {
            return Err("native_layer_norm_backward without its inputs and three results".into());
        };
        let width = shape.width;
        self.gradient_rows(op, width, grad, input)?;
        let [mean, rstd] = self.statistics(op, [(3, mean), (4, rstd)])?;
        let weight = self.channel_argument(op, 5)?;
        writeln!(
            self.functions,
            "// the terms of the row sums of {}\n__device__ __forceinline__ float2 ln_terms(const Args& a, idx_t row, idx_t col) {{\n  const float dyw = in_dy(a, row, col, NO_ROW) * {};\n  const float xhat = (in_x(a, row, col, NO_ROW) - to_float_any(a.in{mean}[row])) * to_float_any(a.in{rstd}[row]);\n  return make_float2(dyw, dyw * xhat);\n}}\n",
            op.schema,
            channel_read(weight, "col", "1.f")
        )
        .unwrap();
        let statistic = |i: usize| format!("to_float_any(a.in{i}[ROW_OF(p, {width})])");
        let (mean_at, rstd_at) = (statistic(mean), statistic(rstd));
        let mut body = coordinates_of(dx);
        self.position = 0;
        let dy = self.read(grad, dx)?;
        self.position = 1;
        let x = self.read(input, dx)?;
        let last = dx.shape.len() - 1;
        let w = channel_read(weight, &format!("c[{last}]"), "1.f");
        let kind = kind_of(&dx.dtype).unwrap_or(Kind::Float);
        writeln!(body, "  const float xhat = ({x} - {mean_at}) * {rstd_at};").unwrap();
        writeln!(
            body,
            "  return round_to<{}>({rstd_at} * ({dy} * {w} - red.x - xhat * red.y));",
            c_type(kind)
        )
        .unwrap();
        // Computed with its row's sums, it is its own block's only.
        self.read_row_element = true;
        self.define(op, dx, &body);
        let column_sums =
            self.layer_norm_parameter_gradients(op, grad, input, &mean_at, &rstd_at, [dw, db])?;
        self.reduction = Some(RowReduction {
            rows: shape.rows,
            width,
            op: "layer_norm_backward",
            eps: 0.0,
            gradients: None,
            column_sums,
        });
        Ok(())
    }

    /// The sums over columns of a layer norm's backward's weight and bias gradients (`dy * xhat`
    /// and `dy` at each element, read where the kernel writes it), each its result's: the values
    /// to sum.
    fn layer_norm_parameter_gradients(
        &mut self,
        op: &TracedOp,
        grad: &TracedTensor,
        input: &TracedTensor,
        mean: &str,
        rstd: &str,
        gradients: [&TracedValue; 2],
    ) -> Result<Vec<String>, String> {
        let elsewhere =
            "a layer norm's backward reading its gradient or input elsewhere than its own element";
        self.position = 0;
        let dy = self.read(grad, &row_major(grad))?;
        self.position = 1;
        let x = self.read(input, &row_major(input))?;
        if dy.contains("c[") || x.contains("c[") {
            return Err(elsewhere.into());
        }
        // Functions, not expressions: an input's read is settled with the others' once the
        // kernel knows which it loads four at a time.
        writeln!(
            self.functions,
            "// the terms of the parameters' gradients of {}\n__device__ __forceinline__ float ln_dy(const Args& a, idx_t p, float2 red) {{\n  return {dy};\n}}\n__device__ __forceinline__ float ln_xhat(const Args& a, idx_t p, float2 red) {{\n  return ({x} - {mean}) * {rstd};\n}}\n",
            op.schema
        )
        .unwrap();
        let mut sums = Vec::new();
        let dy = "ln_dy(a, p, red)".to_string();
        let values = [format!("{dy} * ln_xhat(a, p, red)"), dy];
        for (position, (value, t)) in values.into_iter().zip(gradients).enumerate() {
            let TracedValue::Tensor(t) = t else { continue };
            self.note_extent(t);
            self.results
                .insert(t.key(), (usize::MAX, t.clone(), self.call, position + 1));
            self.channel_results.insert(t.key(), sums.len());
            sums.push(value);
        }
        write!(self.signature, "{};", op.schema).unwrap();
        Ok(sums)
    }

    /// A sum of every element of each channel ([`sums_channels`]) of a result of the group's
    /// group norm's backward's rows, read at its own element: each block sums its row's channels
    /// as it writes them, and the last block sums the samples, as it does the weight's gradient.
    pub(super) fn channel_sum(&mut self, op: &TracedOp) -> Result<(), String> {
        let outside = "a sum over each channel outside a group norm's backward's rows";
        let Some(shape) = (self.reduction.as_ref())
            .and_then(|r| r.gradients.as_ref())
            .map(|g| g.shape)
        else {
            return Err(outside.into());
        };
        let (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) =
            (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err(format!("{} without its input and result", op.name));
        };
        let rows = input.shape.len() >= 3
            && input.shape[..2] == [shape.samples as i64, shape.channels as i64]
            && input.numel == shape.rows() * shape.width()
            && check_contiguous(input).is_ok()
            && out.numel == shape.channels
            && check_contiguous(out).is_ok();
        if !rows || !self.inside.contains(&(self.call, input.storage)) {
            return Err(outside.into());
        }
        let Some(value) = self.read_at_own_element(input)? else {
            return Err(outside.into());
        };
        let Some(gradients) = self.reduction.as_mut().and_then(|r| r.gradients.as_mut()) else {
            return Err(outside.into());
        };
        gradients.channel_sums.push(value);
        let which = 1 + gradients.channel_sums.len();
        self.summed_result(op, out, which);
        Ok(())
    }

    /// The body of a norm's normalised element `out[p]`, scaled and shifted as ATen does, from
    /// its row's mean and reciprocal standard deviation as `statistics` reads them (after the
    /// input, weight and bias).
    fn normalised(
        &mut self,
        op: &TracedOp,
        shape: NormRows,
        input: &TracedTensor,
        out: &TracedTensor,
        statistics: impl FnOnce(&mut Self) -> [String; 2],
    ) -> Result<String, String> {
        let mut body = coordinates_of(out);
        self.position = 0;
        let x = self.read(input, out)?;
        // The row's own input, held in registers where the kernel holds its row.
        let x = match self.stored_statistics {
            true => x,
            false => format!("OWN(0, {x})"),
        };
        let at = format!("c[{}]", shape.parameter_dim);
        let weight = self.read_parameter(op, shape.weight_position, &at, "1.f")?;
        let bias = self.read_parameter(op, shape.weight_position + 1, &at, "0.f")?;
        let [mean, rstd] = statistics(self);
        let out_kind = kind_of(&out.dtype).unwrap_or(Kind::Float);
        let value = match shape.layer {
            true => format!("({x} - {mean}) * {rstd} * {weight} + {bias}"),
            false => {
                writeln!(body, "  const float scale = {rstd} * {weight};").unwrap();
                format!("{x} * scale + ({bias} - {mean} * scale)")
            }
        };
        writeln!(body, "  return round_to<{}>({value});", c_type(out_kind)).unwrap();
        Ok(body)
    }

    /// The index of the argument reading result `position` of the call being generated (a
    /// statistic it stored), added on its first read.
    fn result_argument(&mut self, t: &TracedTensor, position: usize) -> usize {
        self.note_extent(t);
        let i = self.argument(t, KernelArg::Input(t.clone()));
        self.sources[i] = ArgSource {
            call: self.call,
            output: true,
            position,
            element: None,
        };
        i
    }

    /// A norm's one-dimensional argument `position` (its weight or bias) at coordinate `at` of
    /// the element being computed (a group norm's channel, a layer norm's column), or `absent`
    /// where the call has none.
    fn read_parameter(
        &mut self,
        op: &TracedOp,
        position: usize,
        at: &str,
        absent: &str,
    ) -> Result<String, String> {
        Ok(channel_read(
            self.channel_argument(op, position)?,
            at,
            absent,
        ))
    }

    /// The argument and stride of a group norm's per-channel argument `position` (its weight or
    /// bias), added on its first read; `None` where the call has none.
    fn channel_argument(
        &mut self,
        op: &TracedOp,
        position: usize,
    ) -> Result<Option<(usize, i64)>, String> {
        // An undefined tensor (none given) is traced as one of no element type.
        let t = match op.inputs.get(position) {
            Some(TracedValue::Tensor(t)) if t.item_bytes > 0 => t,
            _ => return Ok(None),
        };
        if t.shape.len() != 1 {
            return Err("a norm's weight or bias of other than one dimension".into());
        }
        if self.inside.contains(&(self.call, t.storage)) {
            return Err("a norm's weight or bias computed in the group".into());
        }
        let kind = kind_of(&t.dtype).ok_or_else(|| format!("a weight of type {}", t.dtype))?;
        if kind == Kind::Bool {
            return Err("a weight of type bool".into());
        }
        self.position = position;
        self.note_extent(t);
        let i = self.argument(t, KernelArg::Input(t.clone()));
        Ok(Some((i, t.strides[0])))
    }
}
