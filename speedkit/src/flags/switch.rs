//! Switches: process-wide on/off state owned by the layers above the flags (speedkit's kernel
//! switches, the operator overrides' registrations), held by the same guard stack as PyTorch's
//! flags so they are recorded, stacked, thread-checked and restored the same way.
//!
//! The flag layer names none of them: each owner declares a table of [`Switch`]es and submits it
//! with [`inventory::submit!`] as a [`SwitchTable`], and [`Flag::all`](super::Flag::all) lists
//! every submitted table after PyTorch's flags.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

use serde::{Serialize, Serializer};

use crate::error::Result;

/// One on/off switch: its name and how to read and write it.
///
/// ```
/// use speedkit::flags::{Flag, Switch};
/// fn read() -> speedkit::Result<bool> { Ok(true) }
/// fn write(_on: bool) -> speedkit::Result<()> { Ok(()) }
/// static ALWAYS_ON: Switch = Switch { name: "doc.always_on", get: read, set: write };
/// assert_eq!(Flag::Switch(&ALWAYS_ON).name(), "doc.always_on");
/// ```
pub struct Switch {
    /// The name reports show, e.g. `speedkit.kernels.layer_norm`; unique among all switches.
    pub name: &'static str,
    /// Reads the switch.
    pub get: fn() -> Result<bool>,
    /// Writes the switch: the setter and the restore alike, since a switch has one storage.
    pub set: fn(bool) -> Result<()>,
}

/// A table of switches one layer owns, submitted with [`inventory::submit!`]; `order` places it in
/// [`Flag::all`](super::Flag::all) (tables with a smaller order first).
pub struct SwitchTable {
    /// Where the table goes in reports.
    pub order: u32,
    /// The switches, in the order reports list them.
    pub switches: &'static [Switch],
}

inventory::collect!(SwitchTable);

/// Every submitted switch: tables by `order`, each in its own order.
pub(super) fn all() -> impl Iterator<Item = &'static Switch> {
    let mut tables: Vec<&'static SwitchTable> =
        inventory::iter::<SwitchTable>.into_iter().collect();
    tables.sort_by_key(|t| t.order);
    tables.into_iter().flat_map(|t| t.switches.iter())
}

// A switch is its name: the function pointers are how to reach it, not what it is.
impl PartialEq for Switch {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for Switch {}

impl PartialOrd for Switch {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Switch {
    fn cmp(&self, other: &Self) -> Ordering {
        self.name.cmp(other.name)
    }
}

impl Hash for Switch {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl fmt::Debug for Switch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl Serialize for Switch {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name)
    }
}
