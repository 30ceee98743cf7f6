//! [`DataParallel`]: one model replica per process kept identical. At attach, every rank checks
//! that all ranks run the same speed config and the same parameter shapes, and takes rank 0's
//! parameter values; during each backward pass c10d's `Reducer` (the engine of PyTorch's
//! `DistributedDataParallel`) all-reduces gradients bucket by bucket as they become ready, so
//! communication overlaps the rest of the backward pass, and averages them by the world size
//! before backward returns.

use tch::{nn::VarStore, Tensor};

use super::ProcessGroup;
use crate::config::SpeedConfig;
use crate::error::{Result, SpeedkitError};
use crate::ffi::distributed::RawReducer;

/// The gradient-averaging state of one model (see the module docs). Made by
/// [`SpeedContext::prepare`](crate::SpeedContext::prepare) under a launcher.
pub struct DataParallel {
    reducer: RawReducer,
    parameters: usize,
    parameter_bytes: i64,
}

impl DataParallel {
    /// Checks agreement, broadcasts rank 0's variables, and arms the Reducer over `vs`'s trainable
    /// variables with the given bucket sizes.
    pub(crate) fn attach(
        group: &ProcessGroup,
        vs: &VarStore,
        bucket_bytes: i64,
        first_bucket_bytes: i64,
    ) -> Result<Self> {
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        check_same_variables(group, &variables)?;

        // Detached views share the parameters' storage: the broadcast writes the values in place
        // without autograd seeing an in-place update of a leaf.
        let storage: Vec<Tensor> = variables.iter().map(|(_, t)| t.detach()).collect();
        group.broadcast_(&storage, 0)?;

        let trainable = vs.trainable_variables();
        let parameter_bytes = trainable
            .iter()
            .map(|t| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64)
            .sum();
        let reducer = RawReducer::new(group.raw(), &trainable, bucket_bytes, first_bucket_bytes)
            .map_err(|e| SpeedkitError::Distributed(format!("gradient reducer: {e}")))?;
        Ok(Self {
            reducer,
            parameters: trainable.len(),
            parameter_bytes,
        })
    }

    /// Arms the gradient hooks for the next backward pass; called right before it.
    pub(crate) fn before_backward(&self) -> Result<()> {
        self.reducer
            .prepare()
            .map_err(|e| SpeedkitError::Distributed(format!("gradient reducer: {e}")))
    }

    /// Number of trainable tensors whose gradients are averaged.
    pub fn parameters(&self) -> usize {
        self.parameters
    }

    /// Their total size in bytes (what each step all-reduces).
    pub fn parameter_bytes(&self) -> i64 {
        self.parameter_bytes
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("parameters", &self.parameters)
            .field("parameter_bytes", &self.parameter_bytes)
            .finish()
    }
}

/// Ranks whose fingerprint differs from rank 0's.
fn differing_ranks(group: &ProcessGroup, fingerprint_of_mine: u64) -> Result<Vec<usize>> {
    let all = group.all_gather_u64(fingerprint_of_mine)?;
    Ok((0..all.len()).filter(|&r| all[r] != all[0]).collect())
}

/// See [`super::check_same_config`]. Ranks with different configs would plan differently (one
/// with a GradScaler, one without; different buckets) and deadlock or diverge.
pub(super) fn check_same_config(group: &ProcessGroup, config: &SpeedConfig) -> Result<()> {
    let text = serde_json::to_string(config)
        .map_err(|e| SpeedkitError::Distributed(format!("cannot fingerprint the config: {e}")))?;
    let bad = differing_ranks(group, fingerprint(text.as_bytes()))?;
    if bad.is_empty() {
        return Ok(());
    }
    Err(SpeedkitError::Distributed(format!(
        "rank(s) {bad:?} run a different speed config than rank 0 (this is rank {}); every rank \
         must load the same config",
        group.rank()
    )))
}

/// Refuses to train when ranks disagree on the model's variables (names, shapes, dtypes): their
/// gradients could not be averaged meaningfully, and the Reducer would otherwise fail later with a
/// less helpful message, or hang on mismatched bucket sizes.
fn check_same_variables(group: &ProcessGroup, variables: &[(String, Tensor)]) -> Result<()> {
    let mut shapes = String::new();
    for (name, t) in variables {
        shapes.push_str(&format!("{name}:{:?}:{:?};", t.size(), t.kind()));
    }
    let bad_models = differing_ranks(group, fingerprint(shapes.as_bytes()))?;
    if !bad_models.is_empty() {
        return Err(SpeedkitError::Distributed(format!(
            "rank(s) {bad_models:?} have different parameter names, shapes or dtypes than rank 0 \
             (this is rank {}, {} variables); every rank must build the same model",
            group.rank(),
            variables.len()
        )));
    }
    Ok(())
}

/// FNV-1a, 64-bit: the same bytes give the same value in every process and build.
fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
