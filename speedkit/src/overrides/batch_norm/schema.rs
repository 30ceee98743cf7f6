//! The ATen operators' schemas: each call's arguments, by their schema names, into the training
//! forward (the statistics, then the pending normalisation) and the backward.

use std::sync::Mutex;

use tch::{Kind, Tensor};

use super::fusion::{Normalized, Pointwise};
use super::launch::{Layout, FINISH};
use super::params::{
    flag, BackwardFinish, BackwardInput, BackwardPartials, StatsFinish, StatsPartials, BIAS,
    GRAD_BIAS, GRAD_WEIGHT, RUNNING, WEIGHT,
};
use crate::error::Result;
use crate::overrides::{OverrideCall, Reply};

/// A call's result, or why the kernels do not take it.
type Computed<const N: usize> = std::result::Result<[Tensor; N], String>;

/// The override's answer for a computed call (with `extra`, a last result, appended).
fn reply<const N: usize>(computed: Computed<N>, extra: Option<Tensor>) -> Reply {
    match computed {
        Ok(results) => Reply::Ran(results.into_iter().chain(extra).collect()),
        Err(why) => Reply::Declined(why),
    }
}

/// `native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)`
/// → (output, save_mean, save_invstd).
pub(super) fn native_forward(call: &OverrideCall<'_>) -> Result<Reply> {
    let args = ForwardArgs {
        x: call.tensor("input")?,
        weight: call.optional_tensor("weight")?,
        bias: call.optional_tensor("bias")?,
        running_mean: call.optional_tensor("running_mean")?,
        running_var: call.optional_tensor("running_var")?,
        training: call.bool("training")?,
        momentum: call.double("momentum")?,
        eps: call.double("eps")?,
    };
    Ok(reply(args.run()?, None))
}

/// `cudnn_batch_norm(input, weight, bias, running_mean, running_var, training,
/// exponential_average_factor, epsilon)` → (output, save_mean, save_invstd, reserve): the same
/// values, and an empty reserve (the backward below needs none).
pub(super) fn cudnn_forward(call: &OverrideCall<'_>) -> Result<Reply> {
    let x = call.tensor("input")?;
    let args = ForwardArgs {
        x,
        weight: Some(call.tensor("weight")?),
        bias: call.optional_tensor("bias")?,
        running_mean: call.optional_tensor("running_mean")?,
        running_var: call.optional_tensor("running_var")?,
        training: call.bool("training")?,
        momentum: call.double("exponential_average_factor")?,
        eps: call.double("epsilon")?,
    };
    let reserve = Tensor::f_empty([0], (Kind::Uint8, x.device()))?;
    Ok(reply(args.run()?, Some(reserve)))
}

/// `native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
/// save_invstd, train, eps, output_mask)` → (grad_input, grad_weight, grad_bias). A call that
/// does not ask for the input's gradient runs ATen's kernel.
pub(super) fn native_backward(call: &OverrideCall<'_>) -> Result<Reply> {
    if !call.bool("train")? {
        return Ok(Reply::Declined("eval mode".into()));
    }
    if !call.bools("output_mask")?.first().copied().unwrap_or(false) {
        return Ok(Reply::Declined("no input gradient asked for".into()));
    }
    let args = BackwardArgs {
        dy: call.tensor("grad_out")?,
        x: call.tensor("input")?,
        weight: call.optional_tensor("weight")?,
        save_mean: call.optional_tensor("save_mean")?,
        save_invstd: call.optional_tensor("save_invstd")?,
    };
    Ok(reply(args.run()?, None))
}

/// `cudnn_batch_norm_backward(input, grad_output, weight, running_mean, running_var, save_mean,
/// save_var, epsilon, reserveSpace)` → (grad_input, grad_weight, grad_bias); cuDNN's `save_var`
/// is the inverse standard deviation.
pub(super) fn cudnn_backward(call: &OverrideCall<'_>) -> Result<Reply> {
    let args = BackwardArgs {
        dy: call.tensor("grad_output")?,
        x: call.tensor("input")?,
        weight: Some(call.tensor("weight")?),
        save_mean: call.optional_tensor("save_mean")?,
        save_invstd: call.optional_tensor("save_var")?,
    };
    Ok(reply(args.run()?, None))
}

/// A forward call's arguments.
struct ForwardArgs<'a> {
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    bias: Option<&'a Tensor>,
    running_mean: Option<&'a Tensor>,
    running_var: Option<&'a Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
}

impl ForwardArgs<'_> {
    /// (output, save_mean, save_invstd): the batch's statistics (updating the running ones),
    /// then the normalisation.
    fn run(&self) -> Result<Computed<3>> {
        let x = self.x;
        if !self.training {
            return Ok(Err("eval mode (the running statistics normalise)".into()));
        }
        if self.running_mean.is_some() != self.running_var.is_some() {
            return Ok(Err("one running statistic without the other".into()));
        }
        let params = [self.weight, self.bias, self.running_mean, self.running_var];
        let Some(layout) = Layout::of(x, params.iter().flatten().copied())? else {
            return Ok(Err(Layout::declined(x)));
        };
        let flags = flag(self.weight.is_some(), WEIGHT)
            | flag(self.bias.is_some(), BIAS)
            | flag(self.running_mean.is_some(), RUNNING);
        let channels = layout.channels;
        let options = (Kind::Float, x.device());
        let (save_mean, save_invstd) = (
            Tensor::f_empty([channels], options)?,
            Tensor::f_empty([channels], options)?,
        );
        let coefficients = Tensor::f_empty([3, channels], options)?;
        let xm = layout.matrix(x)?;
        let partials = layout.partials()?;
        let kernel = &layout.kernels.stats_partials;
        kernel.launch(
            layout.partials_grid(&partials),
            layout.block(),
            0,
            &StatsPartials {
                x: kernel.ptr(&xm, layout.kind)?,
                partials: kernel.ptr(&partials.sums, Kind::Float)?,
                rows: layout.rows,
                strip_rows: partials.strip_rows,
                channels: channels as i32,
            },
        )?;
        let kernel = &layout.kernels.stats_finish;
        kernel.launch(
            layout.finish_grid(),
            (FINISH, FINISH),
            0,
            &StatsFinish {
                partials: kernel.ptr(&partials.sums, Kind::Float)?,
                x: kernel.ptr(&xm, layout.kind)?,
                weight: kernel.ptr_or_null(self.weight, Kind::Float)?,
                bias: kernel.ptr_or_null(self.bias, Kind::Float)?,
                save_mean: kernel.ptr(&save_mean, Kind::Float)?,
                save_invstd: kernel.ptr(&save_invstd, Kind::Float)?,
                running_mean: kernel.ptr_or_null(self.running_mean, Kind::Float)?,
                running_var: kernel.ptr_or_null(self.running_var, Kind::Float)?,
                coefficients: kernel.ptr(&coefficients, Kind::Float)?,
                rows: layout.rows,
                strips: partials.strips as i32,
                channels: channels as i32,
                eps: self.eps as f32,
                momentum: self.momentum as f32,
                flags,
            },
        )?;
        let y = Pointwise::output(Normalized {
            layout,
            tensors: Mutex::new((xm, coefficients)),
        })?;
        Ok(Ok([y, save_mean, save_invstd]))
    }
}

/// A backward call's arguments (training mode).
struct BackwardArgs<'a> {
    dy: &'a Tensor,
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    save_mean: Option<&'a Tensor>,
    save_invstd: Option<&'a Tensor>,
}

impl BackwardArgs<'_> {
    /// (grad_input, grad_weight, grad_bias). The parameters' gradients come from the pass that
    /// the input's needs anyway, so they are returned also where the call's mask leaves them out
    /// (autograd reads only what it asked for).
    fn run(&self) -> Result<Computed<3>> {
        let (dy, x) = (self.dy, self.x);
        let (Some(save_mean), Some(save_invstd)) = (self.save_mean, self.save_invstd) else {
            return Ok(Err("no saved statistics".into()));
        };
        let saved = [Some(save_mean), Some(save_invstd), self.weight];
        let Some(layout) = Layout::of(x, saved.iter().flatten().copied())? else {
            return Ok(Err(Layout::declined(x)));
        };
        if dy.kind() != x.kind() || dy.size() != x.size() || !layout.fits(dy) {
            return Ok(Err(format!(
                "a gradient of {:?} {:?} with strides {:?}, not laid out as the input",
                dy.kind(),
                dy.size(),
                dy.stride()
            )));
        }
        let channels = layout.channels;
        let options = (Kind::Float, x.device());
        let (dym, xm) = (layout.matrix(dy)?, layout.matrix(x)?);
        let partials = layout.partials()?;
        let kernel = &layout.kernels.backward_partials;
        kernel.launch(
            layout.partials_grid(&partials),
            layout.block(),
            0,
            &BackwardPartials {
                dy: kernel.ptr(&dym, layout.kind)?,
                x: kernel.ptr(&xm, layout.kind)?,
                mean: kernel.ptr(save_mean, Kind::Float)?,
                partials: kernel.ptr(&partials.sums, Kind::Float)?,
                rows: layout.rows,
                strip_rows: partials.strip_rows,
                channels: channels as i32,
            },
        )?;
        let (grad_weight, grad_bias) = (
            Tensor::f_empty([channels], options)?,
            Tensor::f_empty([channels], options)?,
        );
        let coefficients = Tensor::f_empty([4, channels], options)?;
        let flags = GRAD_WEIGHT | GRAD_BIAS | flag(self.weight.is_some(), WEIGHT);
        let kernel = &layout.kernels.backward_finish;
        kernel.launch(
            layout.finish_grid(),
            (FINISH, FINISH),
            0,
            &BackwardFinish {
                partials: kernel.ptr(&partials.sums, Kind::Float)?,
                save_mean: kernel.ptr(save_mean, Kind::Float)?,
                save_invstd: kernel.ptr(save_invstd, Kind::Float)?,
                weight: kernel.ptr_or_null(self.weight, Kind::Float)?,
                grad_weight: kernel.ptr(&grad_weight, Kind::Float)?,
                grad_bias: kernel.ptr(&grad_bias, Kind::Float)?,
                coefficients: kernel.ptr(&coefficients, Kind::Float)?,
                rows: layout.rows,
                strips: partials.strips as i32,
                channels: channels as i32,
                flags,
            },
        )?;
        let dxm = Tensor::f_empty(xm.size(), (x.kind(), x.device()))?;
        let kernel = &layout.kernels.backward_input;
        kernel.launch(
            layout.elementwise_grid(),
            layout.block(),
            0,
            &BackwardInput {
                dy: kernel.ptr(&dym, layout.kind)?,
                x: kernel.ptr(&xm, layout.kind)?,
                coefficients: kernel.ptr(&coefficients, Kind::Float)?,
                dx: kernel.ptr(&dxm, layout.kind)?,
                rows: layout.rows,
                channels: channels as i32,
            },
        )?;
        Ok(Ok([layout.unmatrix(&dxm)?, grad_weight, grad_bias]))
    }
}
