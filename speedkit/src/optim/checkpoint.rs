//! An [`AdamWOptimizer`]'s state as named tensors, saved to and loaded from a file.

use std::path::Path;

use tch::Tensor;

use super::adamw::AdamWOptimizer;
use super::state::{Bucket, BucketState};
use crate::error::{Result, SpeedkitError};

impl AdamWOptimizer {
    /// The optimizer state as named tensors (exp_avg, exp_avg_sq, step per parameter; lr per
    /// group). Before the first step, which makes the state, its moments and steps are fresh zeros:
    /// what that step starts from.
    ///
    /// ```
    /// use speedkit::optim::{AdamW, AdamWOptimizer};
    /// use tch::{nn, Device};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let _layer = nn::linear(vs.root(), 4, 2, Default::default());
    /// let opt = AdamWOptimizer::new(&vs, AdamW::default(), false)?;
    /// let state = opt.state_tensors()?;
    /// // A learning rate, and three tensors for each of the weight and the bias.
    /// assert_eq!(state.len(), 1 + 2 * 3);
    /// assert_eq!(opt.memory().state, 4, "only the learning rate is allocated yet");
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (gi, g) in self.groups.iter().enumerate() {
            for (bi, b) in g.buckets.iter().enumerate() {
                out.push((format!("group{gi}.bucket{bi}.lr"), b.lr.shallow_clone()));
                let mut made = None;
                let state = state_or_zeros(b, &mut made)?;
                for i in 0..b.params.len() {
                    let prefix = format!("group{gi}.bucket{bi}.param{i}");
                    for (name, t) in [
                        ("exp_avg", &state.exp_avgs[i]),
                        ("exp_avg_sq", &state.exp_avg_sqs[i]),
                        ("step", &state.steps[i]),
                    ] {
                        out.push((format!("{prefix}.{name}"), t.shallow_clone()));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Writes the state to `path` (libtorch's format, as `Tensor::save_multi`).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let named = self.state_tensors()?;
        let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::save_multi(&refs, path.as_ref())?;
        Ok(())
    }

    /// Reads a state written by [`save`](Self::save) for an optimizer over the same parameters.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let loaded = Tensor::load_multi(path.as_ref())?;
        // The state the file's values go into, made now where no step has made it yet.
        self.make_state()?;
        let mine = self.state_tensors()?;
        if loaded.len() != mine.len() {
            return Err(SpeedkitError::Misuse(format!(
                "optimizer state in {} has {} tensors, this optimizer has {}: not the same parameters",
                path.as_ref().display(),
                loaded.len(),
                mine.len()
            )));
        }
        for (name, mut dst) in mine {
            let src = loaded
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| SpeedkitError::Misuse(format!("optimizer state lacks `{name}`")))?;
            tch::no_grad(|| dst.f_copy_(src))?;
        }
        self.groups.iter_mut().try_for_each(|g| -> Result<()> {
            if let Some(b) = g.buckets.first() {
                g.lr = b.lr.f_double_value(&[])?;
            }
            Ok(())
        })
    }
}

impl AdamWOptimizer {
    /// Each parameter it updates with its state: `[parameter, exp_avg, exp_avg_sq, step]`, the
    /// state fresh zeros (what the first step starts from) where no step has made it yet.
    pub(crate) fn param_states(&self) -> Result<Vec<[Tensor; 4]>> {
        let mut out = Vec::new();
        for b in self.groups.iter().flat_map(|g| &g.buckets) {
            let mut made = None;
            let state = state_or_zeros(b, &mut made)?;
            for (i, p) in b.params.iter().enumerate() {
                out.push([
                    p.shallow_clone(),
                    state.exp_avgs[i].shallow_clone(),
                    state.exp_avg_sqs[i].shallow_clone(),
                    state.steps[i].shallow_clone(),
                ]);
            }
        }
        Ok(out)
    }

    /// [`param_states`](Self::param_states) with the state made first, to be written into.
    pub(crate) fn make_param_states(&mut self) -> Result<Vec<[Tensor; 4]>> {
        self.make_state()?;
        self.param_states()
    }
}

/// `b`'s state, or (where no step has made it yet) fresh zeros kept in `made`: what the first step
/// starts from.
fn state_or_zeros<'a>(b: &'a Bucket, made: &'a mut Option<BucketState>) -> Result<&'a BucketState> {
    if b.has_state() {
        return Ok(&b.state);
    }
    Ok(made.insert(BucketState::zeros(&b.params)?))
}
