//! [`AdamW`]'s hyper-parameters, and the [`ParamGroup`]s an optimizer is made of.

use tch::Tensor;

/// AdamW's hyper-parameters (PyTorch's defaults): its configuration, as `tch::nn::Adam` is tch's.
/// The optimizer is [`AdamWOptimizer`](crate::optim::AdamWOptimizer), made by
/// [`crate::SpeedContext::adamw`] or [`AdamWOptimizer::new`](crate::optim::AdamWOptimizer::new).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Denominator epsilon (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub wd: f64,
    /// Exclude biases and norm weights (every parameter with fewer than 2 dimensions) from weight
    /// decay, as GPT-style recipes do. Off by default, as in PyTorch.
    pub exclude_from_decay: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            wd: 0.01,
            exclude_from_decay: false,
        }
    }
}

/// Parameters sharing a learning rate and weight decay.
#[derive(Debug)]
pub struct ParamGroup {
    /// The parameters (tensors that require grad).
    pub params: Vec<Tensor>,
    /// Learning rate of this group.
    pub lr: f64,
    /// Weight decay of this group.
    pub weight_decay: f64,
}

/// `params` (each with whether it is a matrix) in one group, or two where biases and norm weights
/// are excluded from weight decay.
pub(super) fn param_groups(params: Vec<(Tensor, bool)>, config: &AdamW) -> Vec<ParamGroup> {
    let group = |params: Vec<(Tensor, bool)>, weight_decay| ParamGroup {
        params: params.into_iter().map(|(t, _)| t).collect(),
        lr: config.lr,
        weight_decay,
    };
    if !config.exclude_from_decay {
        return vec![group(params, config.wd)];
    }
    let (decay, no_decay): (Vec<_>, Vec<_>) = params.into_iter().partition(|(_, matrix)| *matrix);
    vec![group(decay, config.wd), group(no_decay, 0.0)]
}
