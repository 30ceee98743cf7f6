//! CIFAR-10 in its binary distribution format (`cifar-10-batches-bin/`), and CIFAR-shaped
//! generated data for machines without the files.
//!
//! Each `data_batch_N.bin` (N = 1..5, the training set) and `test_batch.bin` holds 10 000
//! records of 3073 bytes: one label byte (0..9), then the 32×32 image as three 1024-byte planes
//! (red, green, blue), each row-major. Nothing is downloaded here: pass the directory you have.

use anyhow::{bail, ensure, Context};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Side of a CIFAR image.
pub const IMAGE_SIDE: i64 = 32;
/// Bytes of one image (3 planes of 32×32).
pub const IMAGE_BYTES: usize = 3 * 32 * 32;
/// Bytes of one record: the label byte and the image.
pub const RECORD_BYTES: usize = 1 + IMAGE_BYTES;
/// Number of classes.
pub const CLASSES: i64 = 10;
/// Class names, by label.
pub const CLASS_NAMES: [&str; 10] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];

/// Per-channel mean and standard deviation of the training set (for [`normalize`]).
const MEAN: [f64; 3] = [0.4914, 0.4822, 0.4465];
const STD: [f64; 3] = [0.2470, 0.2435, 0.2616];

/// Seed of the class patterns of [`Cifar10::synthetic`].
const SYNTHETIC_PATTERN_SEED: u64 = 10;

/// SplitMix64 (Steele, Lea and Flood 2014): tiny, fast, and good enough for generated images.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        // The top 24 bits: exactly representable in an f32.
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Which part of the data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `data_batch_*.bin`.
    Train,
    /// `test_batch.bin`.
    Test,
}

/// A set of CIFAR images with their labels.
#[derive(Debug)]
pub struct Cifar10 {
    /// `[N, 3, 32, 32]` bytes (`Kind::Uint8`), RGB planes as stored.
    pub images: Tensor,
    /// `[N]` class indices (`Kind::Int64`).
    pub labels: Tensor,
}

impl Cifar10 {
    /// Parses records from the bytes of one `.bin` file (any whole number of records).
    pub fn parse(bytes: &[u8]) -> anyhow::Result<Self> {
        ensure!(!bytes.is_empty(), "no records (empty input)");
        ensure!(
            bytes.chunks_exact(RECORD_BYTES).remainder().is_empty(),
            "{} bytes is not a whole number of {RECORD_BYTES}-byte CIFAR-10 records (1 label + 3072 pixels)",
            bytes.len()
        );
        let n = bytes.len() / RECORD_BYTES;
        let mut labels = Vec::with_capacity(n);
        let mut pixels = Vec::with_capacity(n * IMAGE_BYTES);
        for (i, record) in bytes.chunks_exact(RECORD_BYTES).enumerate() {
            let label = record[0];
            ensure!(
                i64::from(label) < CLASSES,
                "record {i} has label {label}; CIFAR-10 labels are 0..9"
            );
            labels.push(i64::from(label));
            pixels.extend_from_slice(&record[1..]);
        }
        let images =
            Tensor::f_from_slice(&pixels)?.f_view([n as i64, 3, IMAGE_SIDE, IMAGE_SIDE])?;
        Ok(Self {
            images,
            labels: Tensor::f_from_slice(&labels)?,
        })
    }

    /// Reads one `.bin` file.
    pub fn read_file(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&bytes).with_context(|| format!("parsing {}", path.display()))
    }

    /// Reads a split from `dir` (the `cifar-10-batches-bin` directory): every `data_batch_*.bin`
    /// in name order for [`Split::Train`], `test_batch.bin` for [`Split::Test`].
    pub fn load(dir: impl AsRef<Path>, split: Split) -> anyhow::Result<Self> {
        let dir = dir.as_ref();
        let files = match split {
            Split::Test => vec![dir.join("test_batch.bin")],
            Split::Train => train_files(dir)?,
        };
        let parts = files
            .iter()
            .map(Self::read_file)
            .collect::<anyhow::Result<Vec<_>>>()?;
        Self::concat(&parts)
    }

    /// Generated CIFAR-shaped data that can be learnt: `n` images whose pixels are a fixed random
    /// pattern per class plus uniform noise, labels uniform over the 10 classes. The class patterns
    /// are the same for every `seed` (so sets made with different seeds are a training and a test
    /// set of one task); labels and noise depend on `seed` only. Made with a small generator of its
    /// own: the same `seed` gives the same set whatever libtorch's random state or other threads do.
    pub fn synthetic(n: i64, seed: u64) -> anyhow::Result<Self> {
        ensure!(n > 0, "need at least one image, got {n}");
        let mut rng = SplitMix64(SYNTHETIC_PATTERN_SEED);
        let patterns: Vec<f32> = (0..CLASSES as usize * IMAGE_BYTES)
            .map(|_| rng.symmetric())
            .collect();
        let mut rng = SplitMix64(seed);
        let mut labels = Vec::with_capacity(n as usize);
        let mut pixels = Vec::with_capacity(n as usize * IMAGE_BYTES);
        for _ in 0..n {
            let label = (rng.next() % CLASSES as u64) as usize;
            labels.push(label as i64);
            let pattern = &patterns[label * IMAGE_BYTES..(label + 1) * IMAGE_BYTES];
            pixels.extend(
                pattern
                    .iter()
                    .map(|p| (128.0 + 16.0 * p + 64.0 * rng.symmetric()).clamp(0.0, 255.0) as u8),
            );
        }
        let images = Tensor::f_from_slice(&pixels)?.f_view([n, 3, IMAGE_SIDE, IMAGE_SIDE])?;
        Ok(Self {
            images,
            labels: Tensor::f_from_slice(&labels)?,
        })
    }

    /// Joins several sets (e.g. the five training files).
    pub fn concat(parts: &[Self]) -> anyhow::Result<Self> {
        ensure!(!parts.is_empty(), "nothing to join");
        let images: Vec<&Tensor> = parts.iter().map(|p| &p.images).collect();
        let labels: Vec<&Tensor> = parts.iter().map(|p| &p.labels).collect();
        Ok(Self {
            images: Tensor::f_cat(&images, 0)?,
            labels: Tensor::f_cat(&labels, 0)?,
        })
    }

    /// Number of images.
    pub fn len(&self) -> i64 {
        self.labels.size().first().copied().unwrap_or(0)
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same data on `device` (still bytes: a quarter of the memory of floats).
    pub fn to_device(&self, device: Device) -> anyhow::Result<Self> {
        Ok(Self {
            images: self.images.f_to_device(device)?,
            labels: self.labels.f_to_device(device)?,
        })
    }

    /// The images at `indices` as normalised floats, with their labels.
    pub fn batch(&self, indices: &Tensor) -> anyhow::Result<(Tensor, Tensor)> {
        let images = normalize(&self.images.f_index_select(0, indices)?)?;
        Ok((images, self.labels.f_index_select(0, indices)?))
    }
}

/// Byte images `[B, 3, H, W]` → floats scaled to 0..1 and standardised per channel with the
/// training set's mean and standard deviation.
pub fn normalize(images: &Tensor) -> anyhow::Result<Tensor> {
    let opts = (Kind::Float, images.device());
    let mean = Tensor::f_from_slice(&MEAN)?
        .f_to_kind(Kind::Float)?
        .f_to_device(opts.1)?
        .f_view([1, 3, 1, 1])?;
    let std = Tensor::f_from_slice(&STD)?
        .f_to_kind(Kind::Float)?
        .f_to_device(opts.1)?
        .f_view([1, 3, 1, 1])?;
    let x = images.f_to_kind(opts.0)?.f_div_scalar(255.0)?;
    Ok(x.f_sub(&mean)?.f_div(&std)?)
}

fn train_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("reading directory {}", dir.display()))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .with_context(|| format!("reading directory {}", dir.display()))?
            .path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("data_batch_") && name.ends_with(".bin") {
            files.push(path);
        }
    }
    if files.is_empty() {
        bail!(
            "no data_batch_*.bin in {}: pass the `cifar-10-batches-bin` directory of the binary version of CIFAR-10",
            dir.display()
        );
    }
    files.sort();
    Ok(files)
}
