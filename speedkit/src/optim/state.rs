//! The parameters an optimizer updates, bucketed as its kernels take them, with AdamW's state.

use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// Parameters of one device and dtype with their state: what one kernel launch updates.
pub(super) struct Bucket {
    pub(super) params: Vec<Tensor>,
    /// Empty until the first step makes it ([`AdamWOptimizer::make_state`](super::AdamWOptimizer::make_state)), as torch.optim makes
    /// its state: the first forward and backward, which allocate every gradient anew and cuDNN's
    /// autotuning workspaces, then run without two fp32 copies of the parameters beside them.
    pub(super) state: BucketState,
    pub(super) lr: Tensor,
}

impl Bucket {
    pub(super) fn has_state(&self) -> bool {
        self.state.steps.len() == self.params.len()
    }
}

/// AdamW's state of one bucket's parameters: both moments and the step count of each.
#[derive(Default)]
pub(super) struct BucketState {
    pub(super) exp_avgs: Vec<Tensor>,
    pub(super) exp_avg_sqs: Vec<Tensor>,
    pub(super) steps: Vec<Tensor>,
}

impl BucketState {
    /// The state `params` start from: zeros.
    pub(super) fn zeros(params: &[Tensor]) -> Result<Self> {
        let mut state = BucketState {
            exp_avgs: Vec::with_capacity(params.len()),
            exp_avg_sqs: Vec::with_capacity(params.len()),
            steps: Vec::with_capacity(params.len()),
        };
        for p in params {
            state.exp_avgs.push(Tensor::f_zeros_like(p)?);
            state.exp_avg_sqs.push(Tensor::f_zeros_like(p)?);
            // PyTorch keeps step counts as float32 device tensors for the fused and capturable paths.
            state
                .steps
                .push(Tensor::f_zeros([] as [i64; 0], (Kind::Float, p.device()))?);
        }
        Ok(state)
    }

    pub(super) fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.exp_avgs
            .iter()
            .chain(&self.exp_avg_sqs)
            .chain(&self.steps)
    }
}

/// Parameters sharing a learning rate and weight decay, in buckets.
pub(super) struct Group {
    pub(super) lr: f64,
    pub(super) weight_decay: f64,
    pub(super) buckets: Vec<Bucket>,
}

/// `params` in one bucket per device and dtype, each with the learning rate `lr` as a device tensor.
pub(super) fn make_buckets(params: Vec<Tensor>, lr: f64) -> Result<Vec<Bucket>> {
    let mut buckets: Vec<((Device, Kind), Bucket)> = Vec::new();
    for p in params {
        let key = (p.device(), p.kind());
        match buckets.iter_mut().find(|(k, _)| *k == key) {
            Some((_, b)) => b.params.push(p),
            None => {
                let lr_t = Tensor::f_full([] as [i64; 0], lr, (Kind::Float, key.0))?;
                buckets.push((
                    key,
                    Bucket {
                        params: vec![p],
                        state: BucketState::default(),
                        lr: lr_t,
                    },
                ));
            }
        }
    }
    Ok(buckets.into_iter().map(|(_, b)| b).collect())
}
