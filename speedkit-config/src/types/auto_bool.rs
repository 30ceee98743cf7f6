//! [`AutoBool`]: a switch that may be left to the runtime.

use std::fmt;

use serde::de::{self, Unexpected};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A switch that may be left to the runtime: `auto`, `true` or `false` in files.
///
/// Only the bare booleans and the string `auto` are accepted; a quoted `"true"` is rejected so that
/// a file means the same thing to every YAML reader.
///
/// ```
/// use speedkit_config::AutoBool;
///
/// assert!(AutoBool::Auto.resolve(true));
/// assert!(!AutoBool::Off.resolve(true));
/// assert_eq!(serde_json::to_string(&AutoBool::On).unwrap(), "true");
/// assert_eq!(serde_json::from_str::<AutoBool>("\"auto\"").unwrap(), AutoBool::Auto);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AutoBool {
    /// Let the runtime decide from the hardware and the rest of the config.
    #[default]
    Auto,
    /// Forced on (`true`).
    On,
    /// Forced off (`false`).
    Off,
}

impl AutoBool {
    /// The file spellings, in the order error messages list them.
    pub const VALUES: &'static [&'static str] = &["auto", "true", "false"];

    /// The concrete value: `auto_value` when this is `Auto`, else the forced value.
    #[must_use]
    pub fn resolve(self, auto_value: bool) -> bool {
        match self {
            Self::Auto => auto_value,
            Self::On => true,
            Self::Off => false,
        }
    }

    /// Whether the runtime decides.
    #[must_use]
    pub fn is_auto(self) -> bool {
        self == Self::Auto
    }

    /// The file spelling: `"auto"`, `"true"` or `"false"`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "true",
            Self::Off => "false",
        }
    }
}

impl From<bool> for AutoBool {
    fn from(value: bool) -> Self {
        if value {
            Self::On
        } else {
            Self::Off
        }
    }
}

impl From<Option<bool>> for AutoBool {
    /// `None` is `Auto`.
    fn from(value: Option<bool>) -> Self {
        value.map_or(Self::Auto, Self::from)
    }
}

impl fmt::Display for AutoBool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for AutoBool {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => serializer.serialize_str("auto"),
            Self::On => serializer.serialize_bool(true),
            Self::Off => serializer.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for AutoBool {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = AutoBool;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`auto`, `true` or `false` (booleans without quotes)")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<AutoBool, E> {
                Ok(AutoBool::from(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<AutoBool, E> {
                match v {
                    "auto" => Ok(AutoBool::Auto),
                    // A quoted boolean is a type mistake, not an unknown word.
                    "true" | "false" => Err(E::invalid_type(Unexpected::Str(v), &self)),
                    // `unknown_variant` so that the error lists the allowed spellings.
                    _ => Err(E::unknown_variant(v, AutoBool::VALUES)),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}
