//! [`Shard`]: each rank's part of a data set, reshuffled every epoch with a seed all ranks share,
//! as PyTorch's `DistributedSampler` (with `drop_last`) does.

/// One rank's view of a data set of `len` items.
///
/// ```
/// use speedkit::dist::Shard;
/// let (a, b) = (Shard::new(0, 2, 7), Shard::new(1, 2, 7));
/// let (ea, eb) = (a.indices(10, 0), b.indices(10, 0));
/// assert_eq!((ea.len(), eb.len()), (5, 5));
/// assert!(ea.iter().all(|i| !eb.contains(i)));          // disjoint
/// assert_ne!(a.indices(10, 0), a.indices(10, 1));       // reshuffled per epoch
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    rank: usize,
    world_size: usize,
    seed: u64,
}

impl Shard {
    /// Rank `rank` of `world_size`, shuffling with `seed` (the same on every rank).
    ///
    /// # Panics
    /// If `rank >= world_size` (a programming error; [`LaunchEnv`](super::LaunchEnv) never
    /// yields that).
    pub fn new(rank: usize, world_size: usize, seed: u64) -> Self {
        assert!(
            rank < world_size,
            "rank {rank} is not below world size {world_size}"
        );
        Self {
            rank,
            world_size,
            seed,
        }
    }

    /// The shard of this process (rank 0 of 1 without a launcher).
    ///
    /// ```
    /// let shard = speedkit::dist::Shard::from_env(0)?;
    /// let mine = shard.indices(1000, 0);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn from_env(seed: u64) -> crate::Result<Self> {
        Ok(match super::LaunchEnv::from_env()? {
            Some(env) => Self::new(env.rank, env.world_size, seed),
            None => Self::new(0, 1, seed),
        })
    }

    /// This rank's item indices for `epoch`: a permutation of `0..len` drawn from `(seed,
    /// epoch)`, cut to a multiple of the world size (every rank gets the same number, so every rank
    /// runs the same number of steps), and every `world_size`-th entry from `rank` on.
    pub fn indices(&self, len: usize, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..len).collect();
        let mut rng = SplitMix64(self.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for i in (1..len).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let usable = len - len % self.world_size;
        order[..usable]
            .iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .copied()
            .collect()
    }

    /// This rank's batches of `batch_size` items for `epoch` (the last partial batch dropped, so
    /// every rank runs the same number of steps).
    pub fn batches(&self, len: usize, batch_size: usize, epoch: u64) -> Vec<Vec<usize>> {
        self.indices(len, epoch)
            .chunks_exact(batch_size.max(1))
            .map(<[usize]>::to_vec)
            .collect()
    }
}

/// A tiny, well-mixed generator: reproducible across platforms and builds, unlike a library RNG
/// whose algorithm may change between versions.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
