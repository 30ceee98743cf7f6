//! The record a resolution builds: each decision in the order it is taken, with its reason.

use std::fmt;

use super::Decision;
use crate::config::AutoBool;

/// The decisions taken so far; they become [`super::Plan::decisions`].
#[derive(Default)]
pub(super) struct Decisions(pub(super) Vec<Decision>);

impl Decisions {
    pub(super) fn push(
        &mut self,
        key: &'static str,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) {
        self.0.push(Decision {
            key,
            value: value.into(),
            reason: reason.into(),
        });
    }

    /// Records an optional setting (`None` = "left as it is") and returns it.
    pub(super) fn set<T: fmt::Display + Copy>(
        &mut self,
        key: &'static str,
        v: Option<T>,
        reason: impl Into<String>,
    ) -> Option<T> {
        self.push(
            key,
            v.map_or_else(|| "unchanged".to_string(), |v| v.to_string()),
            reason,
        );
        v
    }

    /// A plain bool key: PyTorch's default value means "leave the flag as it is" (so a config does not
    /// undo what the process set elsewhere); any other value is applied.
    pub(super) fn default_or_set(
        &mut self,
        key: &'static str,
        v: bool,
        pytorch_default: bool,
        reason: &str,
    ) -> Option<bool> {
        if v == pytorch_default {
            self.set(key, None, "PyTorch's default: left as it is")
        } else {
            self.set(key, Some(v), reason)
        }
    }

    /// A flag speedkit sets only when the config names a value: `auto` leaves it as it is.
    pub(super) fn explicit_only(
        &mut self,
        key: &'static str,
        v: AutoBool,
        auto_reason: &str,
    ) -> Option<bool> {
        match v {
            AutoBool::Auto => self.set(key, None, auto_reason),
            v => self.set(key, Some(v == AutoBool::On), "set in the config"),
        }
    }
}
