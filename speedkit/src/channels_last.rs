//! Whether channels-last weights stay: the first step decides.
//!
//! `channels_last: auto` lays conv weights out channels-last where Tensor Cores run the
//! convolutions, which is right for a network of convolutions and BatchNorm (`resnet` is 2.7x
//! faster for it on an H200). But ATen's GroupNorm takes only NCHW input: on channels-last
//! activations it copies each input to NCHW and its output stays NCHW, so a diffusion-style U-Net
//! (GroupNorm before every convolution) runs 1.32x slower channels-last (`unet_tch`, H200).
//! [`ChannelsLastProbe`] counts such GroupNorm calls during the first backward's step, and the
//! context lays the weights (and their gradients) out NCHW again when it saw any, before the first
//! optimizer step makes state in their layout and before a graph is captured.
//!
//! cuDNN's autotuning waits for the census to end: what `cudnn.benchmark` would pick for the
//! census step's channels-last convolutions is thrown away where the weights go back to NCHW
//! (3 s of `unet_tch`'s first step on an H200 whose driver had JIT-compiled cuDNN's kernels
//! before, more on one that had not). The census step runs cuDNN's heuristics instead, with
//! `cudnn.deterministic` on: ATen keeps the plan it ran for each convolution, keyed by that flag
//! among others, and later steps, with the flag off again, would otherwise run the heuristics'
//! plan forever instead of tuning their own (`resnet`, which stays channels-last, ran 9% slower).
//! speedkit's own convolutions run, in the census step, the plans an earlier run kept where it kept
//! any ([`KeptPlansOnly`]): they time nothing, where cuDNN's heuristics would compile kernels again
//! (`convnext_tch`'s depthwise convolutions: its second run's warm-up took 5.4 s instead of 1.5 on
//! an H200).

use tch::Tensor;

use crate::error::Result;
use crate::ffi;
use crate::ffi::convolution::KeptPlansOnly;
use crate::flags::{Flag, FlagGuard, FlagSetting, FlagValue};

/// Why the census step's convolutions run cuDNN's heuristics.
const PAUSED: &str = "the first step's convolutions, channels-last until it decides, run cuDNN's \
                      heuristics (their plans kept apart from later steps' tuned ones)";

/// The census of the first step, with the weights it may lay out NCHW again. Dropping it stops
/// the census (its RecordFunction callback is gone on every exit path) and puts cuDNN's
/// autotuning back.
pub(crate) struct ChannelsLastProbe {
    weights: Vec<Tensor>,
    counting: bool,
    /// `cudnn.benchmark` off and `cudnn.deterministic` on for the census step, where
    /// autotuning was on and determinism off.
    autotuning_paused: Option<FlagGuard>,
    /// Held while autotuning is paused.
    kept_plans_only: Option<KeptPlansOnly>,
}

impl ChannelsLastProbe {
    /// Starts the census for `weights`, laid out channels-last by `prepare`.
    pub(crate) fn start(weights: Vec<Tensor>) -> Result<Self> {
        let tuning = Flag::CudnnBenchmark.get()? == FlagValue::Bool(true)
            && Flag::CudnnDeterministic.get()? == FlagValue::Bool(false);
        let autotuning_paused = match tuning {
            true => Some(FlagGuard::apply(&[
                FlagSetting::new(Flag::CudnnBenchmark, FlagValue::Bool(false), PAUSED),
                FlagSetting::new(Flag::CudnnDeterministic, FlagValue::Bool(true), PAUSED),
            ])?),
            false => None,
        };
        ffi::optim::channels_last_census_start()?;
        let kept_plans_only = autotuning_paused.is_some().then(KeptPlansOnly::hold);
        Ok(Self {
            weights,
            counting: true,
            autotuning_paused,
            kept_plans_only,
        })
    }

    /// Stops the census: the GroupNorm calls that read channels-last activations since it started.
    /// cuDNN's autotuning is back where it was paused.
    pub(crate) fn stop(&mut self) -> Result<i64> {
        self.counting = false;
        let calls = ffi::optim::channels_last_census_stop();
        self.kept_plans_only.take();
        if let Some(paused) = self.autotuning_paused.take() {
            paused.restore()?;
        }
        calls
    }

    /// Whether it paused cuDNN's autotuning until the census ends.
    pub(crate) fn pauses_autotuning(&self) -> bool {
        self.autotuning_paused.is_some()
    }

    /// Lays every weight, and its gradient where it has one, out NCHW again (the same tensors).
    pub(crate) fn revert(&self) -> Result<()> {
        for w in &self.weights {
            ffi::optim::to_contiguous_(w)?;
            let grad = w.grad();
            if grad.defined() {
                ffi::optim::to_contiguous_(&grad)?;
            }
        }
        Ok(())
    }

    /// How many weights it holds.
    pub(crate) fn len(&self) -> usize {
        self.weights.len()
    }
}

impl Drop for ChannelsLastProbe {
    fn drop(&mut self) {
        if self.counting {
            let _ = ffi::optim::channels_last_census_stop();
        }
    }
}
