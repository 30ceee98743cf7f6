//! The process-wide record of active [`FlagGuard`](super::FlagGuard)s: a stack of layers, one per
//! guard, each holding the state it found and the settings it applied.
//!
//! PyTorch's flags are one process-wide state, so guards must compose as a stack whatever order they
//! drop in, and must not fight across threads. Every apply and restore holds this record's lock, so
//! the check, the writes and the record change together.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::{self, ThreadId};

use super::{FlagSetting, FlagState};
use crate::error::{Result, SpeedkitError};

/// One active guard.
pub(super) struct Layer {
    id: u64,
    thread: ThreadId,
    thread_name: String,
    /// The state just before this layer's settings were applied.
    before: FlagState,
    settings: Vec<FlagSetting>,
}

/// The active layers, oldest first.
pub(super) struct Active(Vec<Layer>);

static ACTIVE: Mutex<Active> = Mutex::new(Active(Vec::new()));
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Locks the record. A panic while it was held (inside a flag write) leaves it consistent, since
/// each change to it is a single push or remove, so a poisoned lock is taken as it is.
pub(super) fn lock() -> MutexGuard<'static, Active> {
    ACTIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Active {
    /// Refuses `settings` when a guard of another thread is active and they would change a flag
    /// under it; the same plan (no flag would move) is allowed.
    pub(super) fn check_thread(&self, settings: &[FlagSetting], now: &FlagState) -> Result<()> {
        let me = thread::current().id();
        let Some(other) = self.0.iter().find(|layer| layer.thread != me) else {
            return Ok(());
        };
        let moves: Vec<String> = settings
            .iter()
            .filter_map(|s| {
                let current = now.get(s.flag)?;
                (current != s.value).then(|| format!("{} from {current} to {}", s.flag, s.value))
            })
            .collect();
        if moves.is_empty() {
            return Ok(());
        }
        Err(SpeedkitError::ThreadConflict(format!(
            "speedkit's settings are already in force on thread {}, and these would change {}. \
             PyTorch's flags are process-wide, so two threads cannot run different plans at once: \
             use the same config on both threads, or drop the other thread's context first",
            other.thread_name,
            moves.join(", ")
        )))
    }

    /// Records a guard that has applied `settings` over `before`; returns its id.
    pub(super) fn push(&mut self, before: FlagState, settings: &[FlagSetting]) -> u64 {
        let current = thread::current();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.0.push(Layer {
            id,
            thread: current.id(),
            thread_name: match current.name() {
                Some(name) => format!("'{name}'"),
                None => format!("{:?}", current.id()),
            },
            before,
            settings: settings.to_vec(),
        });
        id
    }

    /// Removes guard `id` and leaves exactly the flags of the guards that remain: the state the
    /// guard found, with every later guard's settings applied again on top, in order. For the
    /// newest guard (the usual, nested case) that is simply the state it found.
    pub(super) fn remove(&mut self, id: u64) -> Result<()> {
        let Some(index) = self.0.iter().position(|layer| layer.id == id) else {
            return Err(SpeedkitError::Misuse(format!(
                "flag guard {id} is not active (restored twice?)"
            )));
        };
        let removed = self.0.remove(index);
        removed.before.write_back()?;
        for later in &mut self.0[index..] {
            later.before = FlagState::capture()?;
            super::guard::apply_settings(&later.settings)?;
        }
        Ok(())
    }
}
