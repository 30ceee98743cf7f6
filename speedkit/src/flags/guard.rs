//! [`FlagGuard`]: applies settings, records each change with its reason, and restores on drop.

use serde::Serialize;
use std::fmt;
use std::marker::PhantomData;

use super::{registry, Flag, FlagSetting, FlagState, FlagValue};
use crate::error::{Result, SpeedkitError};

/// One recorded change, as a [`FlagGuard`] applied it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlagChange {
    /// The flag.
    pub flag: Flag,
    /// PyTorch's spelling (for JSON consumers).
    pub name: &'static str,
    /// Value before the guard.
    pub before: FlagValue,
    /// Value after the guard applied its settings (read back).
    pub after: FlagValue,
    /// Why. Flags that moved as a side effect of another setting say so.
    pub reason: String,
}

impl FlagChange {
    /// Whether the value actually changed.
    pub fn changed(&self) -> bool {
        self.before != self.after
    }
}

/// Applies flag settings, records them, and restores the previous values on drop — on return, on `?`,
/// and during panic unwinding — then reads every flag back to check that the state really is what it
/// was. Registered process-wide while alive: see the [module docs](super) for the thread rule.
#[must_use = "flags are restored when the guard drops; binding it to `_` restores at once"]
pub struct FlagGuard {
    id: u64,
    before: FlagState,
    changes: Vec<FlagChange>,
    restored: bool,
    _not_send: PhantomData<*const ()>,
}

impl FlagGuard {
    /// Applies `settings` in order. If any setting fails, every flag is written back from the state
    /// captured before the first write, and the error returned: a failed apply changes nothing.
    /// Refused with [`SpeedkitError::ThreadConflict`] when a guard of another thread is active and
    /// these settings would change a flag under it.
    pub fn apply(settings: &[FlagSetting]) -> Result<Self> {
        let mut active = registry::lock();
        let before = FlagState::capture()?;
        active.check_thread(settings, &before)?;
        let after = match apply_settings(settings).and_then(|()| FlagState::capture()) {
            Ok(after) => after,
            Err(e) => return Err(roll_back(&before, e)),
        };
        let id = active.push(before.clone(), settings);
        Ok(FlagGuard {
            id,
            changes: record_changes(settings, &before, &after),
            before,
            restored: false,
            _not_send: PhantomData,
        })
    }

    /// The changes this guard made, in the order applied.
    pub fn changes(&self) -> &[FlagChange] {
        &self.changes
    }

    /// The state found when the guard was created.
    pub fn state_before(&self) -> &FlagState {
        &self.before
    }

    /// Restores now and returns the state read back (the state before, unless guards created after
    /// this one are still active: their settings stay in force). Dropping the guard does the same
    /// silently.
    pub fn restore(mut self) -> Result<FlagState> {
        self.restore_inner()
    }

    fn restore_inner(&mut self) -> Result<FlagState> {
        self.restored = true;
        let mut active = registry::lock();
        active.remove(self.id)?;
        FlagState::capture()
    }
}

/// Writes `settings` in order, stopping at the first that fails.
pub(super) fn apply_settings(settings: &[FlagSetting]) -> Result<()> {
    for setting in settings {
        setting.flag.set(setting.value).map_err(|e| {
            SpeedkitError::Unsupported(format!(
                "cannot set {} to {}: {e}",
                setting.flag, setting.value
            ))
        })?;
    }
    Ok(())
}

/// Puts `before` back after a failed apply; the apply's error, with the rollback's if that failed too.
fn roll_back(before: &FlagState, error: SpeedkitError) -> SpeedkitError {
    match before.write_back() {
        Ok(()) => error,
        Err(restore) => SpeedkitError::Restore(format!("{error}; then, rolling back: {restore}")),
    }
}

/// One change per setting, then every flag that moved with them (some are coupled inside libtorch:
/// matmul precision `high` also reads back as `allow_tf32 = True`), so the audit shows every flag
/// that moved.
fn record_changes(
    settings: &[FlagSetting],
    before: &FlagState,
    after: &FlagState,
) -> Vec<FlagChange> {
    let change = |flag: Flag, reason: String| {
        Some(FlagChange {
            flag,
            name: flag.name(),
            before: before.get(flag)?,
            after: after.get(flag)?,
            reason,
        })
    };
    let mut changes: Vec<FlagChange> = settings
        .iter()
        .filter_map(|s| change(s.flag, s.reason.clone()))
        .collect();
    for (flag, _, _) in before.diff(after) {
        if !changes.iter().any(|c| c.flag == flag) {
            let reason = "follows from another setting above (coupled inside libtorch)".to_owned();
            changes.extend(change(flag, reason));
        }
    }
    changes
}

impl Drop for FlagGuard {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        if let Err(e) = self.restore_inner() {
            // Drop cannot return an error, and panicking here could abort during unwinding; say it
            // loudly instead, since a flag left changed silently is the one thing we must not do.
            eprintln!("speedkit: WARNING: {e}");
        }
    }
}

impl fmt::Debug for FlagGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlagGuard")
            .field("changes", &self.changes)
            .finish()
    }
}
