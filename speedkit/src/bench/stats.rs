//! Whether one set of step times is faster or slower than another: the ratio of their medians,
//! a 95% percentile-bootstrap confidence interval around it, and a verdict that also ignores
//! changes smaller than a noise threshold.
//!
//! The bootstrap draws from an in-crate SplitMix64 generator with a fixed seed, so the same two
//! samples always give the same interval (a baseline compared twice gives the same verdict twice).
//!
//! ```
//! use speedkit::bench::stats::{compare_medians, Verdict};
//! let baseline = [10.0, 10.1, 9.9, 10.05, 9.95, 10.0, 10.02, 9.98];
//! let slower: Vec<f64> = baseline.iter().map(|t| t * 1.5).collect();
//! let change = compare_medians(&baseline, &slower).unwrap();
//! assert!((change.ratio - 1.5).abs() < 1e-9);
//! assert_eq!(change.verdict(0.01), Verdict::Slower);
//! assert_eq!(compare_medians(&baseline, &baseline).unwrap().verdict(0.01), Verdict::NoChange);
//! ```

use serde::Serialize;
use std::fmt;

/// Resamples drawn for each confidence interval.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// Seed of the bootstrap's generator (fixed: intervals are reproducible).
pub const BOOTSTRAP_SEED: u64 = 0x5eed_5eed_5eed_5eed;

/// SplitMix64 (Steele, Lea and Flood 2014): a small, fast generator with a 64-bit state that passes
/// BigCrush, which is all a bootstrap needs.
///
/// ```
/// use speedkit::bench::stats::SplitMix64;
/// let (mut a, mut b) = (SplitMix64::new(7), SplitMix64::new(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(10) < 10);
/// ```
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform index in `0..n` (`n > 0`), by Lemire's multiply-shift (bias below 2^-32 for the
    /// sample sizes of a benchmark).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// The median of `samples` (mean of the two middle values for an even count); `NaN` when empty.
///
/// ```
/// use speedkit::bench::stats::median;
/// assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
/// assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
/// ```
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    median_of_sorted(&sorted)
}

fn median_of_sorted(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// What a comparison concludes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The whole interval lies below `1 − noise`.
    Faster,
    /// The whole interval lies above `1 + noise`.
    Slower,
    /// The interval reaches into `[1 − noise, 1 + noise]`: no change distinguishable from noise.
    NoChange,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Faster => "faster",
            Verdict::Slower => "slower",
            Verdict::NoChange => "no change",
        })
    }
}

/// `median(current) / median(baseline)` with its 95% confidence interval: above 1 is slower.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MedianRatio {
    /// The ratio of the two medians.
    pub ratio: f64,
    /// 2.5th percentile of the bootstrapped ratios.
    pub low: f64,
    /// 97.5th percentile of the bootstrapped ratios.
    pub high: f64,
}

impl MedianRatio {
    /// Slower or faster when the whole interval lies beyond `noise` (a fraction, e.g. 0.01) of
    /// 1, no change otherwise.
    pub fn verdict(&self, noise: f64) -> Verdict {
        if self.high < 1.0 - noise {
            Verdict::Faster
        } else if self.low > 1.0 + noise {
            Verdict::Slower
        } else {
            Verdict::NoChange
        }
    }

    /// Whether the step is slower than the baseline by more than `fraction` (e.g. 0.05 for 5%)
    /// with 95% confidence: the interval's lower end lies above `1 + fraction`.
    pub fn slower_beyond(&self, fraction: f64) -> bool {
        self.low > 1.0 + fraction
    }
}

/// The ratio of medians of `current` over `baseline` with a percentile-bootstrap 95% interval
/// ([`BOOTSTRAP_RESAMPLES`] resamples of both samples, seeded with [`BOOTSTRAP_SEED`]); `None`
/// when either sample is empty or a median is not positive.
pub fn compare_medians(baseline: &[f64], current: &[f64]) -> Option<MedianRatio> {
    let (base_median, current_median) = (median(baseline), median(current));
    if !(base_median > 0.0 && current_median > 0.0) {
        return None;
    }
    let mut rng = SplitMix64::new(BOOTSTRAP_SEED);
    let mut ratios: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| resampled_median(current, &mut rng) / resampled_median(baseline, &mut rng))
        .collect();
    ratios.sort_by(f64::total_cmp);
    Some(MedianRatio {
        ratio: current_median / base_median,
        low: super::percentile(&ratios, 2.5),
        high: super::percentile(&ratios, 97.5),
    })
}

/// The median of one resample (with replacement, same size) of `samples`.
fn resampled_median(samples: &[f64], rng: &mut SplitMix64) -> f64 {
    let mut draw: Vec<f64> = (0..samples.len())
        .map(|_| samples[rng.below(samples.len())])
        .collect();
    draw.sort_by(f64::total_cmp);
    median_of_sorted(&draw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples around `center` with a deterministic ±2% spread.
    fn noisy(center: f64, n: usize, seed: u64) -> Vec<f64> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|_| center * (0.98 + 0.04 * (rng.next_u64() as f64 / u64::MAX as f64)))
            .collect()
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs for seed 1234567 from the reference C implementation (Vigna, xoshiro site).
        let mut rng = SplitMix64::new(1234567);
        assert_eq!(rng.next_u64(), 6457827717110365317);
        assert_eq!(rng.next_u64(), 3203168211198807973);
    }

    #[test]
    fn below_stays_in_range_and_reaches_every_index() {
        let mut rng = SplitMix64::new(1);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            seen[rng.below(7)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn identical_samples_give_ratio_one_and_no_change() {
        let times = noisy(10.0, 50, 3);
        let r = compare_medians(&times, &times).unwrap();
        assert_eq!(r.ratio, 1.0);
        assert!(r.low <= 1.0 && r.high >= 1.0, "{r:?}");
        assert_eq!(r.verdict(0.01), Verdict::NoChange);
    }

    #[test]
    fn a_clearly_slower_sample_is_slower_and_beyond_a_small_threshold() {
        let r = compare_medians(&noisy(10.0, 50, 3), &noisy(12.0, 50, 4)).unwrap();
        assert!((r.ratio - 1.2).abs() < 0.02, "{r:?}");
        assert!(r.low < r.ratio && r.ratio < r.high);
        assert_eq!(r.verdict(0.01), Verdict::Slower);
        assert!(r.slower_beyond(0.10));
        assert!(!r.slower_beyond(0.30));
    }

    #[test]
    fn a_clearly_faster_sample_is_faster() {
        let r = compare_medians(&noisy(10.0, 50, 3), &noisy(8.0, 50, 4)).unwrap();
        assert_eq!(r.verdict(0.01), Verdict::Faster);
        assert!(!r.slower_beyond(0.0));
    }

    #[test]
    fn a_change_inside_the_noise_threshold_is_no_change() {
        // 0.5% slower with almost no spread: significant, but below a 1% threshold.
        let base: Vec<f64> = (0..50).map(|i| 10.0 + 1e-4 * i as f64).collect();
        let slower: Vec<f64> = base.iter().map(|t| t * 1.005).collect();
        let r = compare_medians(&base, &slower).unwrap();
        assert!(r.low > 1.0);
        assert_eq!(r.verdict(0.01), Verdict::NoChange);
        assert_eq!(r.verdict(0.0), Verdict::Slower);
    }

    #[test]
    fn the_interval_is_reproducible() {
        let (a, b) = (noisy(10.0, 30, 5), noisy(10.3, 30, 6));
        assert_eq!(compare_medians(&a, &b), compare_medians(&a, &b));
    }

    #[test]
    fn empty_or_zero_samples_give_no_ratio() {
        assert_eq!(compare_medians(&[], &[1.0]), None);
        assert_eq!(compare_medians(&[0.0], &[1.0]), None);
    }
}
