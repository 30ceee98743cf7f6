//! A step's profile from the profiler's events: its rows by name and category, device busy time
//! and idle gaps, CPU ops' self times.

use std::collections::BTreeMap;

use super::recording::{range_name, StepTiming};
use super::{
    shorten_kernel_name, Category, CategoryRow, Communication, IdleGaps, OpRow, StepProfile,
};
use crate::error::{Result, SpeedkitError};
use crate::ffi::profiler::ProfilerEvent;

/// libkineto activity types (`kineto/ActivityType.h`).
const CPU_OP: i32 = 0;
const GPU_MEMCPY: i32 = 3;
const GPU_MEMSET: i32 = 4;
const GPU_KERNEL: i32 = 5;

/// Step `t`'s profile from the events recorded within its range.
pub(super) fn analyse_step(
    t: &StepTiming,
    events: &[ProfilerEvent],
    cuda: bool,
) -> Result<StepProfile> {
    let name = range_name(t.index);
    let range = events
        .iter()
        .find(|e| e.device_type == 0 && e.name == name)
        .ok_or_else(|| {
            SpeedkitError::Torch(format!(
                "the profiler recorded no range `{name}` (is another profiler running?)"
            ))
        })?;
    let (from, to) = (range.start_ns, range.start_ns + range.duration_ns);
    let within = |e: &&ProfilerEvent| e.start_ns >= from && e.start_ns <= to;
    let mut step = StepProfile {
        step: t.index,
        kind: t.kind,
        host_ms: t.host_ms,
        cuda_event_ms: t.cuda_event_ms,
        device_busy_ms: None,
        idle_gaps: None,
        communication: None,
        peak_memory_bytes: t.peak_memory_bytes,
        rows: Vec::new(),
        categories: Vec::new(),
    };
    let timed: Vec<(String, f64)> = if cuda {
        let device: Vec<&ProfilerEvent> = events
            .iter()
            .filter(within)
            .filter(|e| matches!(e.activity_type, GPU_KERNEL | GPU_MEMCPY | GPU_MEMSET))
            .collect();
        let intervals: Vec<(u64, u64)> = device
            .iter()
            .map(|e| (e.start_ns, e.start_ns + e.duration_ns))
            .collect();
        let (busy_ns, gaps) = busy_and_gaps(intervals.clone());
        step.device_busy_ms = Some(busy_ns as f64 / 1e6);
        step.idle_gaps = Some(gaps);
        let collective: Vec<bool> = device
            .iter()
            .map(|e| Category::of(&e.name) == Category::Communication)
            .collect();
        step.communication = communication(&intervals, &collective);
        device
            .iter()
            .map(|e| (e.name.clone(), e.duration_ns as f64 / 1e6))
            .collect()
    } else {
        let ops: Vec<&ProfilerEvent> = events
            .iter()
            .filter(within)
            .filter(|e| e.device_type == 0 && e.activity_type == CPU_OP && e.name != name)
            .collect();
        let self_ns = self_times(&ops);
        ops.iter()
            .zip(self_ns)
            .map(|(e, ns)| (e.name.clone(), ns as f64 / 1e6))
            .collect()
    };
    step.rows = rows(&timed, cuda, step.step_ms());
    step.categories = categories(&step.rows, step.step_ms());
    Ok(step)
}

/// Groups timed events by (shortened) name, longest total first.
fn rows(timed: &[(String, f64)], cuda: bool, step_ms: f64) -> Vec<OpRow> {
    let mut by_name: BTreeMap<String, OpRow> = BTreeMap::new();
    for (full, ms) in timed {
        let short = if cuda {
            shorten_kernel_name(full)
        } else {
            full.clone()
        };
        let row = by_name.entry(short.clone()).or_insert_with(|| OpRow {
            name: short,
            category: Category::of(full),
            calls: 0,
            total_ms: 0.0,
            mean_us: 0.0,
            share_percent: 0.0,
            full_name: full.clone(),
        });
        row.calls += 1;
        row.total_ms += ms;
    }
    let mut rows: Vec<OpRow> = by_name.into_values().collect();
    for row in &mut rows {
        row.mean_us = row.total_ms * 1e3 / row.calls as f64;
        row.share_percent = percent(row.total_ms, step_ms);
    }
    rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    rows
}

/// `rows` summed by category, in [`Category::ALL`] order.
fn categories(rows: &[OpRow], step_ms: f64) -> Vec<CategoryRow> {
    Category::ALL
        .iter()
        .filter_map(|&category| {
            let of: Vec<&OpRow> = rows.iter().filter(|r| r.category == category).collect();
            let total_ms: f64 = of.iter().map(|r| r.total_ms).sum();
            (!of.is_empty()).then(|| CategoryRow {
                category,
                calls: of.iter().map(|r| r.calls).sum(),
                total_ms,
                share_percent: percent(total_ms, step_ms),
            })
        })
        .collect()
}

/// `part` as a percentage of `whole` (0 where `whole` is not positive).
pub(super) fn percent(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        100.0 * part / whole
    } else {
        0.0
    }
}

/// The time covered by at least one interval, and the gaps between the merged intervals.
fn busy_and_gaps(mut intervals: Vec<(u64, u64)>) -> (u64, IdleGaps) {
    intervals.sort_unstable();
    let mut busy = 0u64;
    let mut gaps = IdleGaps {
        total_ms: 0.0,
        count: 0,
        largest_ms: 0.0,
    };
    let mut current: Option<(u64, u64)> = None;
    for (start, end) in intervals {
        match current {
            Some((s, e)) if start <= e => current = Some((s, e.max(end))),
            Some((s, e)) => {
                busy += e - s;
                let gap_ms = (start - e) as f64 / 1e6;
                gaps.total_ms += gap_ms;
                gaps.count += 1;
                gaps.largest_ms = gaps.largest_ms.max(gap_ms);
                current = Some((start, end));
            }
            None => current = Some((start, end)),
        }
    }
    if let Some((s, e)) = current {
        busy += e - s;
    }
    (busy, gaps)
}

/// The collectives among `intervals` (`collective[i]` says whether interval `i` is one) and the
/// time they ran with nothing else beside them: the time of all intervals together less that of
/// the others. `None` where there is no collective.
fn communication(intervals: &[(u64, u64)], collective: &[bool]) -> Option<Communication> {
    let pick = |want: bool| -> Vec<(u64, u64)> {
        intervals
            .iter()
            .zip(collective)
            .filter(|&(_, &c)| c == want)
            .map(|(&i, _)| i)
            .collect()
    };
    let collectives = pick(true);
    if collectives.is_empty() {
        return None;
    }
    let calls = collectives.len();
    let (all_ns, _) = busy_and_gaps(intervals.to_vec());
    let (others_ns, _) = busy_and_gaps(pick(false));
    let (collectives_ns, _) = busy_and_gaps(collectives);
    Some(Communication {
        calls,
        busy_ms: collectives_ns as f64 / 1e6,
        exposed_ms: all_ns.saturating_sub(others_ns) as f64 / 1e6,
    })
}

/// Each op's duration minus the durations of the ops directly nested in it (same thread), so that
/// `aten::linear` is not counted again inside its `aten::addmm`.
fn self_times(ops: &[&ProfilerEvent]) -> Vec<u64> {
    let mut self_ns: Vec<u64> = ops.iter().map(|e| e.duration_ns).collect();
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| {
        (
            ops[i].thread_id,
            ops[i].start_ns,
            std::cmp::Reverse(ops[i].duration_ns),
        )
    });
    // Open ops of the current thread, innermost last: (index, end).
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut thread = None;
    for i in order {
        let e = ops[i];
        if thread != Some(e.thread_id) {
            open.clear();
            thread = Some(e.thread_id);
        }
        while open.last().is_some_and(|&(_, end)| end <= e.start_ns) {
            open.pop();
        }
        if let Some(&(parent, _)) = open.last() {
            self_ns[parent] = self_ns[parent].saturating_sub(e.duration_ns);
        }
        open.push((i, e.start_ns + e.duration_ns));
    }
    self_ns
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str, thread: u64, start: u64, duration: u64) -> ProfilerEvent {
        ProfilerEvent {
            name: name.into(),
            device_type: 0,
            activity_type: CPU_OP,
            start_ns: start,
            duration_ns: duration,
            thread_id: thread,
        }
    }

    #[test]
    fn self_time_subtracts_only_direct_children() {
        let events = [
            op("aten::linear", 1, 0, 100),
            op("aten::addmm", 1, 10, 60),
            op("aten::copy_", 1, 20, 10),
            op("aten::relu", 1, 80, 15),
            op("aten::mul", 2, 5, 50),
        ];
        let refs: Vec<&ProfilerEvent> = events.iter().collect();
        assert_eq!(self_times(&refs), vec![25, 50, 10, 15, 50]);
    }

    #[test]
    fn busy_time_merges_overlaps_and_gaps_lie_between() {
        let (busy, gaps) = busy_and_gaps(vec![(0, 10), (5, 20), (30, 40), (45, 50)]);
        assert_eq!(busy, 35);
        assert_eq!(gaps.count, 2);
        assert!((gaps.total_ms - 15e-6).abs() < 1e-12);
        assert!((gaps.largest_ms - 10e-6).abs() < 1e-12);
    }

    #[test]
    fn collectives_are_exposed_only_where_no_other_kernel_runs() {
        // A collective at 10..40 beside compute at 0..20 and 30..35, another alone at 50..60.
        let intervals = [(0, 20), (10, 40), (30, 35), (50, 60)];
        let c = communication(&intervals, &[false, true, false, true]).unwrap();
        assert_eq!(c.calls, 2);
        assert!((c.busy_ms - 40e-6).abs() < 1e-12);
        assert!((c.exposed_ms - 25e-6).abs() < 1e-12, "{c:?}");
    }

    #[test]
    fn a_step_without_collectives_has_no_communication() {
        assert!(communication(&[(0, 10)], &[false]).is_none());
    }

    #[test]
    fn rows_group_by_short_name_longest_first() {
        let timed = vec![
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int)".to_string(), 1.0),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int)".to_string(), 2.0),
            ("sm90_xmma_gemm_bf16bf16_bf16f32".to_string(), 4.0),
        ];
        let rows = rows(&timed, true, 10.0);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].name, "sm90_xmma_gemm_bf16bf16_bf16f32");
        assert_eq!(rows[0].category, Category::Gemm);
        assert_eq!(
            rows[1].name,
            "vectorized_elementwise_kernel<CUDAFunctor_add>"
        );
        assert_eq!(rows[1].calls, 2);
        assert!((rows[1].share_percent - 30.0).abs() < 1e-9);
        assert!((rows[1].mean_us - 1500.0).abs() < 1e-9);
    }
}
