//! `device:`, where to train.

use std::fmt;
use std::str::FromStr;

use serde::de;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ConfigError;

/// Where to train. Spelled `auto`, `cpu`, `cuda` (= `cuda:0`) or `cuda:N` in files.
///
/// ```
/// use speedkit_config::DeviceChoice;
///
/// assert_eq!("cuda".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(0));
/// assert_eq!("cuda:3".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(3));
/// assert_eq!(DeviceChoice::Cuda(1).to_string(), "cuda:1");
/// assert!("gpu".parse::<DeviceChoice>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceChoice {
    /// `cuda:0` if a GPU is present, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// The CUDA device with this index.
    Cuda(usize),
}

impl DeviceChoice {
    /// The accepted forms, as error messages list them.
    pub const FORMS: &'static [&'static str] = &["auto", "cpu", "cuda", "cuda:N"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "cpu" => Some(Self::Cpu),
            "cuda" => Some(Self::Cuda(0)),
            // Digits only: `usize::from_str` would also take a leading `+`.
            _ => s
                .strip_prefix("cuda:")
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        Self::parse(s).ok_or_else(|| ConfigError::bad_value("device", s, Self::FORMS))
    }
}

impl Serialize for DeviceChoice {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = DeviceChoice;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a device string: `auto`, `cpu`, `cuda` or `cuda:N`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceChoice, E> {
                // `unknown_variant` so that the error lists the accepted forms.
                DeviceChoice::parse(v).ok_or_else(|| E::unknown_variant(v, DeviceChoice::FORMS))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}
