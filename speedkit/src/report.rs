//! What speedkit did, for people (tables) and programs (JSON): the [`Audit`] of a
//! [`SpeedContext`](crate::SpeedContext) and the [`Report`] behind `speedkit report`.

use serde::Serialize;
use std::fmt::{self, Write as _};

use crate::config::SpeedConfig;
use crate::error::Result;
use crate::flags::{Flag, FlagChange, FlagGuard, FlagState, FlagValue};
use crate::hardware::Hardware;
use crate::overrides::OverrideRecord;
use crate::plan::{Decision, Plan};

/// The audit trail: the hardware planned for, every decision with its reason, every flag changed
/// (before → after, read back from libtorch) and notes on anything else done.
#[derive(Clone, Debug, Serialize)]
pub struct Audit {
    /// The machine.
    pub hardware: Hardware,
    /// Resolved settings with reasons.
    pub decisions: Vec<Decision>,
    /// Flags set, in the order applied.
    pub flag_changes: Vec<FlagChange>,
    /// Operators whose implementation the context replaced with a kernel of yours
    /// ([`SpeedContext::override_operator`](crate::SpeedContext::override_operator)).
    pub operator_overrides: Vec<OverrideRecord>,
    /// Other actions (parameters moved, graphs captured, fall-backs).
    pub notes: Vec<String>,
}

impl Audit {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

impl fmt::Display for Audit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "speedkit settings")?;
        f.write_str(&decisions_table(&self.decisions))?;
        writeln!(f, "\nflags changed (restored when the context drops)")?;
        f.write_str(&changes_table(&self.flag_changes))?;
        if !self.operator_overrides.is_empty() {
            writeln!(f, "\noperators overridden (removed when the context drops)")?;
            f.write_str(&overrides_table(&self.operator_overrides))?;
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }
}

/// Renders rows as an aligned text table with a header rule.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        let parts: Vec<String> = cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}", w = *w))
            .collect();
        let _ = writeln!(out, "  {}", parts.join("  ").trim_end());
    };
    line(&mut out, &mut headers.iter().copied());
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    let _ = writeln!(out, "  {}", rule.join("  "));
    for row in rows {
        line(&mut out, &mut row.iter().map(String::as_str));
    }
    out
}

fn decisions_table(decisions: &[Decision]) -> String {
    let rows: Vec<Vec<String>> = decisions
        .iter()
        .map(|d| vec![d.key.to_string(), d.value.clone(), d.reason.clone()])
        .collect();
    table(&["setting", "value", "reason"], &rows)
}

fn changes_table(changes: &[FlagChange]) -> String {
    if changes.is_empty() {
        return "  (none)\n".into();
    }
    let reasons = reasons_once(changes.iter().map(|c| (c.name, c.reason.as_str())));
    let rows: Vec<Vec<String>> = changes
        .iter()
        .zip(reasons)
        .map(|(c, reason)| {
            let arrow = if c.changed() { "->" } else { "==" };
            vec![
                c.name.to_string(),
                format!("{} {arrow} {}", c.before, c.after),
                reason,
            ]
        })
        .collect();
    table(&["flag", "before -> after", "reason"], &rows)
}

/// Each `(flag, reason)`'s reason as a table prints it: a reason shared by several flags (every
/// override group's comes from the one `overrides` setting) in full once, then "as for `<flag>`".
fn reasons_once<'a>(rows: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut first_with: Vec<(&str, &str)> = Vec::new();
    rows.map(
        |(flag, reason)| match first_with.iter().find(|(seen, _)| *seen == reason) {
            Some((_, first)) if !reason.is_empty() => format!("as for {first}"),
            _ => {
                first_with.push((reason, flag));
                reason.to_string()
            }
        },
    )
    .collect()
}

fn overrides_table(overrides: &[OverrideRecord]) -> String {
    let rows: Vec<Vec<String>> = overrides
        .iter()
        .map(|o| {
            vec![
                format!("{} @ {}", o.operator, o.key),
                o.location.clone(),
                format!("{} ran, {} declined", o.stats.ran, o.stats.declined),
                o.reason.clone(),
            ]
        })
        .collect();
    table(&["operator", "registered at", "calls", "reason"], &rows)
}

/// One flag across the report's three moments.
#[derive(Clone, Debug, Serialize)]
pub struct FlagRow {
    /// PyTorch's spelling.
    pub flag: &'static str,
    /// Before anything was applied.
    pub before: FlagValue,
    /// With the plan applied (`None` without `--apply`).
    pub applied: Option<FlagValue>,
    /// After restoring (`None` without `--restore`).
    pub restored: Option<FlagValue>,
    /// Why speedkit sets it (empty when it leaves the flag alone).
    pub reason: String,
}

/// What `speedkit report` shows: hardware, the plan with reasons, and every flag before / applied /
/// restored, with the check that restoring gave back the state found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The machine.
    pub hardware: Hardware,
    /// The config reported on.
    pub config: SpeedConfig,
    /// The resolved plan.
    pub plan: Plan,
    /// Every flag in the registry.
    pub flags: Vec<FlagRow>,
    /// Whether the plan was applied.
    pub applied: bool,
    /// `Some(true)` when, after restoring, every flag reads back as before.
    pub restored_equals_before: Option<bool>,
}

impl Report {
    /// Builds the report for `config` on this machine; with `apply`, applies the plan through a
    /// [`FlagGuard`]; with `restore` as well, restores and checks the state read back.
    pub fn build(config: &SpeedConfig, apply: bool, restore: bool) -> Result<Report> {
        let hardware = Hardware::detect()?;
        let plan = Plan::resolve(config, &hardware)?;
        let before = FlagState::capture()?;
        let mut applied_state = None;
        let mut restored_state = None;
        let mut reasons: Vec<(Flag, String)> = Vec::new();
        for s in plan.flag_settings() {
            reasons.push((s.flag, s.reason));
        }
        if apply {
            let guard = FlagGuard::apply(&plan.flag_settings())?;
            for c in guard.changes() {
                if !reasons.iter().any(|(f, _)| *f == c.flag) {
                    reasons.push((c.flag, c.reason.clone()));
                }
            }
            applied_state = Some(FlagState::capture()?);
            if restore {
                restored_state = Some(guard.restore()?);
            } else {
                // `report --apply` without `--restore` shows the applied state; the process ends
                // right after, and the guard still restores on the way out.
                drop(guard);
            }
        }
        let flags = Flag::all()
            .into_iter()
            .map(|flag| FlagRow {
                flag: flag.name(),
                before: before.get(flag).unwrap_or(FlagValue::Bool(false)),
                applied: applied_state.as_ref().and_then(|s| s.get(flag)),
                restored: restored_state.as_ref().and_then(|s| s.get(flag)),
                reason: reasons
                    .iter()
                    .find(|(f, _)| *f == flag)
                    .map(|(_, r)| r.clone())
                    .unwrap_or_default(),
            })
            .collect();
        Ok(Report {
            hardware,
            config: config.clone(),
            plan,
            flags,
            applied: apply,
            restored_equals_before: restored_state.map(|s| s == before),
        })
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "== hardware")?;
        writeln!(f, "{}", self.hardware)?;
        writeln!(f, "\n== resolved settings")?;
        f.write_str(&decisions_table(&self.plan.decisions))?;
        writeln!(f, "\n== flags")?;
        let mut headers = vec!["flag", "before"];
        if self.applied {
            headers.push("applied");
        }
        let show_restored = self.restored_equals_before.is_some();
        if show_restored {
            headers.push("restored");
        }
        headers.push("reason");
        let reasons = reasons_once(self.flags.iter().map(|r| (r.flag, r.reason.as_str())));
        let rows: Vec<Vec<String>> = self
            .flags
            .iter()
            .zip(reasons)
            .map(|(r, reason)| {
                let mut row = vec![r.flag.to_string(), r.before.to_string()];
                if let Some(a) = r.applied {
                    let mark = if a != r.before { " *" } else { "" };
                    row.push(format!("{a}{mark}"));
                }
                if let Some(x) = r.restored {
                    row.push(x.to_string());
                }
                row.push(reason);
                row
            })
            .collect();
        f.write_str(&table(&headers, &rows))?;
        if self.applied {
            writeln!(f, "  (* = changed by speedkit)")?;
        }
        match self.restored_equals_before {
            Some(true) => writeln!(f, "\nrestored: every flag reads back as before")?,
            Some(false) => writeln!(f, "\nrestored: MISMATCH - some flag differs from before")?,
            None if self.applied => writeln!(
                f,
                "\n(applied for this report; restored as the command exits)"
            )?,
            None => writeln!(f, "\n(dry run: nothing applied; use --apply [--restore])")?,
        }
        Ok(())
    }
}
