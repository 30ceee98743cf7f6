//! A profile printed as tables.

use std::fmt::{self, Write as _};

use super::analysis::percent;
use super::{Profile, Rows, StepProfile};
use crate::report::table;

/// Rows shown per step when printing (the JSON keeps them all).
const SHOWN_ROWS: usize = 25;

/// `bytes` in GiB, or in MiB below one GiB.
fn format_bytes(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

impl fmt::Display for StepProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut head = format!(
            "step {} ({}): host {:.3} ms",
            self.step, self.kind, self.host_ms
        );
        if let Some(event_ms) = self.cuda_event_ms {
            let _ = write!(head, ", device {event_ms:.3} ms (CUDA events)");
        }
        if let Some(busy) = self.device_busy_ms {
            let _ = write!(
                head,
                ", kernels busy {busy:.3} ms ({:.1}%)",
                percent(busy, self.step_ms())
            );
        }
        if let Some(g) = &self.idle_gaps {
            let _ = write!(
                head,
                ", idle between kernels {:.3} ms in {} gaps (largest {:.1} µs)",
                g.total_ms,
                g.count,
                g.largest_ms * 1e3
            );
        }
        if let Some(c) = &self.communication {
            let _ = write!(
                head,
                ", collectives {:.3} ms ({:.3} ms exposed)",
                c.busy_ms, c.exposed_ms
            );
        }
        if let Some(peak) = self.peak_memory_bytes {
            let _ = write!(head, ", peak memory {}", format_bytes(peak));
        }
        writeln!(f, "{head}")?;
        let shown: Vec<Vec<String>> = self
            .rows
            .iter()
            .take(SHOWN_ROWS)
            .map(|r| {
                vec![
                    r.category.to_string(),
                    r.name.clone(),
                    r.calls.to_string(),
                    format!("{:.3}", r.total_ms),
                    format!("{:.1}", r.mean_us),
                    format!("{:.1}", r.share_percent),
                ]
            })
            .collect();
        let what = if self.cuda_event_ms.is_some() {
            "kernel"
        } else {
            "CPU op (self time)"
        };
        f.write_str(&table(
            &[
                "category",
                what,
                "calls",
                "total ms",
                "mean µs",
                "% of step",
            ],
            &shown,
        ))?;
        if self.rows.len() > SHOWN_ROWS {
            let rest = &self.rows[SHOWN_ROWS..];
            let rest_ms: f64 = rest.iter().map(|r| r.total_ms).sum();
            writeln!(
                f,
                "  … {} more ({rest_ms:.3} ms; all in the JSON)",
                rest.len()
            )?;
        }
        let by_category: Vec<Vec<String>> = self
            .categories
            .iter()
            .map(|c| {
                vec![
                    c.category.to_string(),
                    c.calls.to_string(),
                    format!("{:.3}", c.total_ms),
                    format!("{:.1}", c.share_percent),
                ]
            })
            .collect();
        f.write_str(&table(
            &["category", "calls", "total ms", "% of step"],
            &by_category,
        ))
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.rows {
            Rows::CudaKernels => "CUDA kernels",
            Rows::CpuOps => "CPU ops",
        };
        writeln!(f, "{} step(s) on {}, {what}", self.steps.len(), self.device)?;
        if let Some(m) = &self.memory {
            writeln!(
                f,
                "memory: held between steps {} (parameters {}, gradients {}, optimizer state {}, \
                 weight copies {}, other {}); the step's peak adds {}; cached {}; graph pools {}",
                format_bytes(m.held()),
                format_bytes(m.parameters),
                format_bytes(m.gradients),
                format_bytes(m.optimizer_state),
                format_bytes(m.weight_copies),
                format_bytes(m.other_held),
                format_bytes(m.activations),
                format_bytes(m.cached),
                format_bytes(m.graph_pools),
            )?;
        }
        for step in &self.steps {
            writeln!(f)?;
            write!(f, "{step}")?;
        }
        Ok(())
    }
}
