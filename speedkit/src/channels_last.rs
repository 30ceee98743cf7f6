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

use tch::Tensor;

use crate::error::Result;
use crate::ffi;

/// The census of the first step, with the weights it may lay out NCHW again. Dropping it stops
/// the census (its RecordFunction callback is gone on every exit path).
pub(crate) struct ChannelsLastProbe {
    weights: Vec<Tensor>,
    counting: bool,
}

impl ChannelsLastProbe {
    /// Starts the census for `weights`, laid out channels-last by `prepare`.
    pub(crate) fn start(weights: Vec<Tensor>) -> Result<Self> {
        ffi::optim::channels_last_census_start()?;
        Ok(Self {
            weights,
            counting: true,
        })
    }

    /// Stops the census: the GroupNorm calls that read channels-last activations since it started.
    pub(crate) fn stop(&mut self) -> Result<i64> {
        self.counting = false;
        ffi::optim::channels_last_census_stop()
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
