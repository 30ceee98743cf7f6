//! The GPU's clock and power while a run's steps are timed.
//!
//! A dense training step can hold a Hopper board at its power limit, and the board then lowers its
//! SM clock until the power fits: every kernel of the step, the same GEMMs on either side of a
//! comparison, runs slower by the same share. Two runs that both sit at the limit differ in the
//! energy their steps take rather than in their kernels' clock-for-clock speed. [`GpuClocks`] says
//! whether a run was there: the SM clock, the board's power (from its energy counter: NVML's power
//! reading is an average over the last second, longer than many runs' timed steps), the energy of
//! a step at that power, and how often the power cap held the clock down, read from the device's
//! sensors (NVML) every [`SAMPLE_EVERY`] on a thread of its own while the timed steps run.
//! PyTorch's reference (`docs/benchmarks/pytorch_reference.py`) reads the same sensors the same
//! way.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Result, SpeedkitError};
use crate::ffi;

/// How often the sampler reads the sensors.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// NVML's clock-event reasons that mean the board's power: its software power cap, and the
/// hardware power brake.
const POWER_REASONS: u64 = 0x4 | 0x80;
/// NVML's clock-event reasons that mean temperature: software and hardware thermal slowdown.
const THERMAL_REASONS: u64 = 0x20 | 0x40;

/// The GPU's clock and power over a run's timed steps.
///
/// ```
/// use speedkit::bench::GpuClocks;
/// let clocks = GpuClocks {
///     readings: 85,
///     mean_sm_mhz: 1695.0,
///     min_sm_mhz: 1665,
///     top_sm_mhz: 1710,
///     max_sm_mhz: 1980,
///     mean_power_w: 693.0,
///     power_limit_w: 700.0,
///     power_capped: 1.0,
///     thermal: 0.0,
/// };
/// // The clock the power cap left: 86% of the board's maximum.
/// assert_eq!((clocks.clock_share() * 100.0).round(), 86.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuClocks {
    /// How many readings these figures come from.
    pub readings: usize,
    /// The SM clock's mean over the readings, MHz.
    pub mean_sm_mhz: f64,
    /// The lowest SM clock read, MHz.
    pub min_sm_mhz: u32,
    /// The highest SM clock read, MHz.
    pub top_sm_mhz: u32,
    /// The device's maximum SM clock, MHz.
    pub max_sm_mhz: u32,
    /// The board's mean power draw, watts: the energy it counted between the first and the last
    /// update of its energy counter over the readings, divided by the time between them, where it
    /// counts its energy and updated it twice; else the mean of NVML's power readings (each an
    /// average over about a second on recent boards).
    pub mean_power_w: f64,
    /// The power limit the board enforces, watts.
    pub power_limit_w: f64,
    /// The share of readings whose clock the power cap (or the power brake) held down.
    pub power_capped: f64,
    /// The share of readings whose clock temperature held down.
    pub thermal: f64,
}

impl GpuClocks {
    /// The mean SM clock as a share of the device's maximum.
    pub fn clock_share(&self) -> f64 {
        self.mean_sm_mhz / f64::from(self.max_sm_mhz.max(1))
    }

    /// The column headings of [`cells`](Self::cells), for the runner's tables.
    pub const HEADINGS: [&'static str; 7] = [
        "SM MHz", "range", "of max", "power W", "limit W", "capped", "J/step",
    ];

    /// The figures as the runner's tables give them: the mean SM clock, its range, its share of
    /// the maximum, the mean power, the limit, the share of readings the power cap held down, and
    /// the energy of a step of `median_ms` at the mean power.
    ///
    /// ```
    /// # use speedkit::bench::GpuClocks;
    /// let clocks = GpuClocks {
    ///     readings: 2, mean_sm_mhz: 1810.4, min_sm_mhz: 1800, top_sm_mhz: 1830, max_sm_mhz: 1980,
    ///     mean_power_w: 692.2, power_limit_w: 700.0, power_capped: 1.0, thermal: 0.0,
    /// };
    /// let cells = clocks.cells(Some(18.0));
    /// assert_eq!(cells, ["1810", "1800-1830", "91%", "692", "700", "100%", "12.46"]);
    /// ```
    pub fn cells(&self, median_ms: Option<f64>) -> [String; 7] {
        let joules = median_ms.map(|ms| self.mean_power_w * ms * 1e-3);
        [
            format!("{:.0}", self.mean_sm_mhz),
            format!("{}-{}", self.min_sm_mhz, self.top_sm_mhz),
            format!("{:.0}%", 100.0 * self.clock_share()),
            format!("{:.0}", self.mean_power_w),
            format!("{:.0}", self.power_limit_w),
            format!("{:.0}%", 100.0 * self.power_capped),
            joules.map_or_else(|| "-".into(), |j| format!("{j:.2}")),
        ]
    }

    /// Sums up `readings`, each at its seconds since the first; `None` when there are none.
    fn from_readings(timed: &[(f64, ffi::sensors::GpuReading)]) -> Option<Self> {
        let readings = || timed.iter().map(|(_, r)| r);
        let n = timed.len();
        let (_, last) = timed.last()?;
        let share = |reasons: u64| {
            let held = readings().filter(|r| r.clock_event_reasons & reasons != 0);
            held.count() as f64 / n as f64
        };
        let mean = |value: fn(&ffi::sensors::GpuReading) -> u32| {
            readings().map(|r| f64::from(value(r))).sum::<f64>() / n as f64
        };
        let clocks = readings().map(|r| r.sm_clock_mhz);
        Some(Self {
            readings: n,
            mean_sm_mhz: mean(|r| r.sm_clock_mhz),
            min_sm_mhz: clocks.clone().min().unwrap_or(0),
            top_sm_mhz: clocks.max().unwrap_or(0),
            max_sm_mhz: last.max_sm_clock_mhz,
            mean_power_w: counted_power_w(timed).unwrap_or(mean(|r| r.power_mw) / 1e3),
            power_limit_w: f64::from(last.power_limit_mw) / 1e3,
            power_capped: share(POWER_REASONS),
            thermal: share(THERMAL_REASONS),
        })
    }
}

/// The mean power, watts, from the board's energy counter, where it counted some over a span of
/// `timed`: the energy between its first and its last update seen, over the time between them.
/// The counter moves in steps (every 100 ms on an H200), so the readings' own first and last would
/// be off by up to a step at either end of a run shorter than a second.
fn counted_power_w(timed: &[(f64, ffi::sensors::GpuReading)]) -> Option<f64> {
    let mut updates = (timed.windows(2))
        .filter(|pair| pair[1].1.energy_mj != pair[0].1.energy_mj)
        .map(|pair| pair[1]);
    let (t0, first) = updates.next()?;
    let (t1, last) = updates.next_back()?;
    let joules = last.energy_mj.checked_sub(first.energy_mj)? as f64 * 1e-3;
    (first.energy_mj > 0 && joules > 0.0 && t1 > t0).then(|| joules / (t1 - t0))
}

/// Reads a device's sensors every [`SAMPLE_EVERY`] on its own thread, from
/// [`start`](Self::start) until [`finish`](Self::finish) (or its drop).
pub(crate) struct ClockSampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<(f64, ffi::sensors::GpuReading)>>>,
}

impl ClockSampler {
    /// Starts sampling CUDA device `index`, after one reading here: an error says why the sensors
    /// cannot be read (no NVML on this host), and nothing runs.
    pub(crate) fn start(index: usize) -> Result<Self> {
        let first = ffi::sensors::gpu_reading(index)?;
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("speedkit-clocks".into())
            .spawn(move || {
                let mut readings = vec![(0.0, first)];
                while !stopped.load(Ordering::Relaxed) {
                    std::thread::sleep(SAMPLE_EVERY);
                    match ffi::sensors::gpu_reading(index) {
                        Ok(r) => readings.push((started.elapsed().as_secs_f64(), r)),
                        Err(_) => break,
                    }
                }
                readings
            })
            .map_err(|e| {
                SpeedkitError::Misuse(format!("no thread to read the GPU's clocks: {e}"))
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops sampling and sums up what was read.
    pub(crate) fn finish(mut self) -> Option<GpuClocks> {
        let readings = self.join();
        GpuClocks::from_readings(&readings)
    }

    fn join(&mut self) -> Vec<(f64, ffi::sensors::GpuReading)> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take();
        thread.and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for ClockSampler {
    /// A run that fails mid-way leaves no thread reading behind it.
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ffi::sensors::GpuReading;

    /// A reading of a board that does not count its energy.
    fn reading(mhz: u32, watts: u32, reasons: u64) -> (f64, GpuReading) {
        counted(0.0, 0, mhz, watts, reasons)
    }

    fn counted(at_s: f64, energy_mj: u64, mhz: u32, watts: u32, reasons: u64) -> (f64, GpuReading) {
        let r = GpuReading {
            sm_clock_mhz: mhz,
            max_sm_clock_mhz: 1980,
            power_mw: watts * 1000,
            power_limit_mw: 700_000,
            energy_mj,
            clock_event_reasons: reasons,
        };
        (at_s, r)
    }

    #[test]
    fn readings_sum_up_to_the_mean_clock_its_range_and_the_mean_power() {
        let clocks = [reading(1700, 690, 0x4), reading(1800, 700, 0x4)];
        let c = GpuClocks::from_readings(&clocks).expect("two readings");
        assert_eq!(
            (c.readings, c.mean_sm_mhz, c.min_sm_mhz, c.top_sm_mhz),
            (2, 1750.0, 1700, 1800)
        );
        assert_eq!(
            (c.max_sm_mhz, c.mean_power_w, c.power_limit_w),
            (1980, 695.0, 700.0)
        );
    }

    /// Readings every 10 ms of a board drawing `watts` whose counter adds a step every 100 ms.
    fn counter_steps(readings: usize, watts: u64) -> Vec<(f64, GpuReading)> {
        (0..readings)
            .map(|i| {
                let step = (i as u64 + 3) / 10;
                counted(
                    i as f64 * 0.01,
                    1_000_000 + step * watts * 100,
                    1700,
                    450,
                    0x4,
                )
            })
            .collect()
    }

    #[test]
    fn the_energy_counter_gives_the_mean_power_between_its_first_and_last_update() {
        // NVML's power readings (450 W here) lag a second behind; the counter does not.
        let c = GpuClocks::from_readings(&counter_steps(60, 700)).expect("readings");
        assert!((c.mean_power_w - 700.0).abs() < 1e-6, "{}", c.mean_power_w);
    }

    #[test]
    fn a_counter_updated_once_gives_way_to_the_power_readings() {
        let c = GpuClocks::from_readings(&counter_steps(15, 700)).expect("readings");
        assert_eq!(c.mean_power_w, 450.0);
    }

    #[test]
    fn the_power_cap_and_the_power_brake_count_as_power_and_idle_does_not() {
        let clocks = [
            reading(1700, 700, 0x4),
            reading(1700, 700, 0x80),
            reading(1980, 120, 0x1),
            reading(1980, 500, 0),
        ];
        let c = GpuClocks::from_readings(&clocks).expect("four readings");
        assert_eq!((c.power_capped, c.thermal), (0.5, 0.0));
    }

    #[test]
    fn thermal_slowdowns_are_counted_apart_from_power() {
        let clocks = [reading(1500, 600, 0x20), reading(1500, 600, 0x40 | 0x4)];
        let c = GpuClocks::from_readings(&clocks).expect("two readings");
        assert_eq!((c.power_capped, c.thermal), (0.5, 1.0));
    }

    #[test]
    fn no_readings_sum_up_to_nothing() {
        assert_eq!(GpuClocks::from_readings(&[]), None);
    }
}
