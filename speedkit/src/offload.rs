//! Saved activations parked in host memory while a step runs eagerly.
//!
//! An eager training step keeps every tensor autograd saves for the backward until the backward
//! reads it: at the end of the forward, all of them at once. A captured step with
//! [`fusion`](crate::fusion) saves far less (its generated kernels recompute what is cheap), so the
//! eager warm-up steps before the capture set the run's peak: `unet_tch`'s was twice its captured
//! step's. While [`ParkedActivations`] is alive, the tensors autograd saves on this thread move to
//! host memory (pinned, for CUDA tensors) as soon as nothing but autograd holds them, and come back
//! when the backward reads them (`torch.autograd.graph.save_on_cpu`, with two differences: nothing
//! is copied while the forward still holds the tensor, and small tensors stay where they are). A
//! step under it computes what it computes without it, bit for bit; the backward reads the bytes
//! that were saved.
//!
//! Graph mode parks its eager warm-up steps this way where `compile.warmup_offload` says so (`auto`:
//! with `compile.fusion`, whose captured step saves less than an eager step), and the audit's
//! `eager warm-up:` note says how much it parked.
//!
//! Autograd's checks stay: a saved tensor changed in place before the backward reads it fails the
//! backward with autograd's error. Each pack and unpack is marked in an
//! [execution trace](crate::trace::StepTrace), which gives the backward's reads the identities of
//! the forward's tensors again, so a step traced under it is traced as without it.
//!
//! libtorch asks its default autograd engine for the hooks it gives saved tensors, so a
//! [`ParkedActivations`] puts an engine of speedkit's in place (it runs every backward on libtorch's
//! own) and puts libtorch's back when dropped, panics included. One at a time per process.
//!
//! ```
//! use speedkit::offload::ParkedActivations;
//! use tch::{Device, Kind, Tensor};
//!
//! let w = Tensor::randn([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
//! let parked = ParkedActivations::start(1 << 16)?;
//! let hidden = Tensor::randn([512, 256], (Kind::Float, Device::Cpu)).matmul(&w).tanh();
//! let loss = hidden.matmul(&w).square().mean(Kind::Float);
//! drop(hidden); // only autograd holds the tanh's result now: it moves to host memory
//! loss.backward(); // and comes back for tanh's and matmul's backward
//! let parked = parked.finish()?;
//! assert!(parked.bytes >= 512 * 256 * 4);
//! assert!(w.grad().defined());
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use crate::error::Result;
use crate::ffi;

/// What a [`ParkedActivations`] moved to host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parked {
    /// How many storages (a tensor and its views share one).
    pub storages: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Saved tensors of this thread parked in host memory until the backward reads them, while alive;
/// see the [module docs](self).
pub struct ParkedActivations {
    session: ffi::saved_offload::Session,
}

impl ParkedActivations {
    /// Starts parking the tensors autograd saves on this thread whose storages hold at least
    /// `min_bytes` (smaller ones are not worth a copy each way). Fails while another
    /// [`ParkedActivations`] is alive, or in a process whose autograd engine is not libtorch's own
    /// (a Python interpreter's).
    ///
    /// ```
    /// let parked = speedkit::offload::ParkedActivations::start(1 << 20)?;
    /// assert!(speedkit::offload::ParkedActivations::start(1 << 20).is_err()); // one at a time
    /// drop(parked);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn start(min_bytes: u64) -> Result<Self> {
        Ok(Self {
            session: ffi::saved_offload::Session::begin(min_bytes)?,
        })
    }

    /// Stops parking and says what was parked. Tensors saved before stay where they are and come
    /// back when read, whenever that is.
    ///
    /// ```
    /// let parked = speedkit::offload::ParkedActivations::start(1 << 20)?.finish()?;
    /// assert_eq!(parked, speedkit::offload::Parked::default());
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn finish(self) -> Result<Parked> {
        let (storages, bytes) = self.session.end()?;
        Ok(Parked { storages, bytes })
    }

    /// Whether a [`ParkedActivations`] is alive in this process (autograd's default engine is
    /// speedkit's).
    ///
    /// ```
    /// use speedkit::offload::ParkedActivations;
    /// assert!(!ParkedActivations::active()?);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn active() -> Result<bool> {
        ffi::saved_offload::active()
    }
}

/// Gives the pinned host memory that [`ParkedActivations`] parked CUDA tensors in back to the
/// system: at once where no parked tensor still holds some, otherwise when the last one is read or
/// freed. Sessions keep it from one to the next (a warm-up step parks the same storages as the last
/// one); the next session that parks a CUDA tensor pins memory again. PyTorch's own pinned memory
/// is left as it is.
///
/// ```
/// speedkit::offload::release_host_cache()?;
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn release_host_cache() -> Result<()> {
    ffi::saved_offload::release_host_cache()
}
