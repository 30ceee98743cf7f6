//! `ConfigError` and the pieces it is made of.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// A 1-based position in a config text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    /// Line, starting at 1.
    pub line: usize,
    /// Column (in characters for YAML, bytes for JSON), starting at 1.
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// The text format a config was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// YAML (`.yaml` / `.yml`).
    Yaml,
    /// JSON.
    Json,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Yaml => "YAML",
            Self::Json => "JSON",
        })
    }
}

/// One rule a parsed config breaks (see [`SpeedConfig::validate`](crate::SpeedConfig::validate)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the key to change, e.g. `grad_scaler.init_scale`.
    pub path: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.path, self.message)
    }
}

/// Why a speed config could not be read, parsed or accepted.
///
/// Each variant carries the data a program needs (dotted key path, location, allowed values) and
/// displays as a sentence that says what to change.
///
/// ```
/// use speedkit_config::{ConfigError, Location, SpeedConfig};
///
/// let err = SpeedConfig::from_yaml_str("cudnn:\n  benchmrk: true\n").unwrap_err();
/// assert_eq!(err.location(), Some(Location { line: 2, column: 3 }));
/// match &err {
///     ConfigError::UnknownKey { path, suggestion, .. } => {
///         assert_eq!(path, "cudnn.benchmrk");
///         assert_eq!(suggestion.as_deref(), Some("benchmark"));
///     }
///     other => panic!("unexpected error: {other}"),
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read speed config `{}`: {source}", path.display())]
    Io {
        /// The file that was asked for.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// The text is not well-formed YAML/JSON, or breaks a rule of the format (duplicate keys, ...).
    #[error("malformed {format}{}: {message}", At(location))]
    Syntax {
        /// Which parser complained.
        format: Format,
        /// The parser's explanation, without the location.
        message: String,
        /// Where the parser stopped, when it knows.
        location: Option<Location>,
    },

    /// A key that does not exist at this place of the config (usually a typo).
    #[error(fmt = fmt_unknown_key)]
    UnknownKey {
        /// The key as written (a key of more than 60 characters shortened to its first 60, `…`
        /// and its length).
        key: String,
        /// Dotted path of the key, e.g. `cudnn.benchmrk` (shortened as `key`).
        path: String,
        /// Where the key is.
        location: Option<Location>,
        /// The closest valid key, when one is close enough to be a likely typo.
        suggestion: Option<String>,
        /// Every key valid at this place.
        expected: Vec<String>,
    },

    /// A value of the right type that is not one of the allowed values.
    #[error(fmt = fmt_bad_value)]
    BadValue {
        /// Dotted path of the key whose value is bad.
        path: String,
        /// The value as written (a value of more than 60 characters shortened to its first 60,
        /// `…` and its length).
        value: String,
        /// The allowed values, or a one-entry description of them (e.g. a number range).
        expected: Vec<String>,
        /// The closest allowed value, when one is close enough to be a likely typo.
        suggestion: Option<String>,
        /// Where the value is.
        location: Option<Location>,
    },

    /// A value of the wrong type (a list where a boolean belongs, a quoted `"true"`, ...).
    #[error(
        "wrong type for {}{}: found {found}, expected {expected}",
        Key(path),
        At(location)
    )]
    WrongType {
        /// Dotted path of the key; empty for the document itself.
        path: String,
        /// What was found, e.g. `string "yes"` (a long string shortened as in `BadValue`).
        found: String,
        /// What belongs there.
        expected: String,
        /// Where the value is.
        location: Option<Location>,
    },

    /// The config parsed, but breaks one or more rules; every broken rule is listed.
    #[error(fmt = fmt_invalid)]
    Invalid {
        /// The broken rules, in key order.
        problems: Vec<Problem>,
    },

    /// [`SpeedConfig::preset`](crate::SpeedConfig::preset) was given an unknown name.
    #[error(fmt = fmt_unknown_preset)]
    UnknownPreset {
        /// The name asked for (shortened as the value in `BadValue`).
        name: String,
        /// The closest preset name, if any is close.
        suggestion: Option<String>,
        /// All preset names.
        presets: Vec<String>,
    },

    /// Brackets nest deeper than a config ever needs (checked before the text is parsed, so that
    /// a runaway nesting fails at once).
    #[error(
        "{format} nested too deeply at {location}: more than {limit} levels of brackets, while a \
         speed config needs two (a section and its keys)"
    )]
    TooDeep {
        /// The text's format.
        format: Format,
        /// The deepest nesting accepted.
        limit: usize,
        /// The bracket that opens one level too many.
        location: Location,
    },

    /// The config could not be written out (not expected to happen for these types).
    #[error("cannot write speed config as {format}: {message}")]
    Serialize {
        /// The target format.
        format: Format,
        /// The serializer's explanation.
        message: String,
    },
}

impl ConfigError {
    /// Where in the text the error is, when known.
    #[must_use]
    pub fn location(&self) -> Option<Location> {
        match self {
            Self::Syntax { location, .. }
            | Self::UnknownKey { location, .. }
            | Self::BadValue { location, .. }
            | Self::WrongType { location, .. } => *location,
            Self::TooDeep { location, .. } => Some(*location),
            _ => None,
        }
    }

    /// A `BadValue` without location, with a suggestion among `allowed`.
    pub(crate) fn bad_value(path: &str, value: &str, allowed: &[&str]) -> Self {
        Self::BadValue {
            path: path.to_owned(),
            value: excerpt(value),
            expected: allowed.iter().map(|s| (*s).to_owned()).collect(),
            suggestion: closest(value, allowed.iter().copied()),
            location: None,
        }
    }
}

/// ` at line L, column C`, or nothing.
struct At<'a>(&'a Option<Location>);

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(location) => write!(f, " at {location}"),
            None => Ok(()),
        }
    }
}

/// `` `path` ``, or "the top level" for the empty path.
struct Key<'a>(&'a str);

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("the top level")
        } else {
            write!(f, "`{}`", self.0)
        }
    }
}

fn fmt_unknown_key(
    _key: &str,
    path: &str,
    location: &Option<Location>,
    suggestion: &Option<String>,
    expected: &[String],
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    write!(f, "unknown key `{path}`{}", At(location))?;
    if let Some(suggestion) = suggestion {
        write!(f, "; did you mean `{suggestion}`?")?;
    }
    if expected.is_empty() {
        f.write_str(" (no keys are allowed here)")
    } else {
        write!(f, " (valid keys here: {})", expected.join(", "))
    }
}

fn fmt_bad_value(
    path: &str,
    value: &str,
    expected: &[String],
    suggestion: &Option<String>,
    location: &Option<Location>,
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    write!(f, "bad value `{value}` for {}{}", Key(path), At(location))?;
    match expected {
        [] => {}
        [only] => write!(f, "; expected {only}")?,
        many => write!(f, "; expected one of: {}", many.join(", "))?,
    }
    match suggestion {
        Some(suggestion) => write!(f, "; did you mean `{suggestion}`?"),
        None => Ok(()),
    }
}

fn fmt_invalid(problems: &[Problem], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match problems {
        [only] => write!(f, "invalid speed config: {only}"),
        _ => {
            write!(f, "invalid speed config ({} problems):", problems.len())?;
            for problem in problems {
                write!(f, "\n  - {problem}")?;
            }
            Ok(())
        }
    }
}

fn fmt_unknown_preset(
    name: &str,
    suggestion: &Option<String>,
    presets: &[String],
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    write!(f, "unknown preset `{name}`")?;
    if let Some(suggestion) = suggestion {
        write!(f, "; did you mean `{suggestion}`?")?;
    }
    write!(f, " (presets: {})", presets.join(", "))
}

/// How many characters of a value from the text an error shows.
const ECHO_CHARS: usize = 60;

/// `text` as an error shows it: whole when short, else its first [`ECHO_CHARS`] characters, `…`
/// and its length, so that a runaway value (a whole file pasted into one key) keeps the message
/// readable.
pub(crate) fn excerpt(text: &str) -> String {
    match text.char_indices().nth(ECHO_CHARS) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}… ({} characters)", &text[..cut], text.chars().count()),
    }
}

/// The candidate most similar to `got`, if it is similar enough to be a likely typo: the
/// "did you mean" of config errors, and of `#[speedkit::accelerate]`'s and `#[speedkit::bench]`'s
/// compile errors, so that every suggestion follows one rule.
///
/// Similarity is the normalized Damerau-Levenshtein similarity (a swap of two letters is one
/// edit), case-insensitive, and must be at least 0.6. A single edit, or `got` being a prefix of
/// at least three characters, always qualifies: short keys such as `math` would otherwise miss
/// the threshold on one typo.
///
/// ```
/// let keys = ["precision", "device", "ctx"];
/// assert_eq!(speedkit_config::closest("precison", keys).as_deref(), Some("precision"));
/// assert_eq!(speedkit_config::closest("learning_rate", keys), None);
/// ```
pub fn closest<'a>(got: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let got = got.to_lowercase();
    let got_chars = got.chars().count();
    let mut best: Option<(f64, &str)> = None;
    for candidate in candidates {
        let lower = candidate.to_lowercase();
        // The edit distance costs time and memory in the product of the lengths; skip it
        // where the lengths alone rule a typo out.
        if !lengths_allow_typo(got_chars, lower.chars().count()) {
            continue;
        }
        let mut score = strsim::normalized_damerau_levenshtein(&got, &lower);
        let one_edit = strsim::damerau_levenshtein(&got, &lower) <= 1 && !got.is_empty();
        let prefix = got.chars().count() >= 3 && lower.starts_with(&got);
        if one_edit || prefix {
            score = score.max(0.6);
        }
        if score >= 0.6 && best.is_none_or(|(b, _)| score > b) {
            best = Some((score, candidate));
        }
    }
    best.map(|(_, candidate)| candidate.to_owned())
}

/// Whether a `got` of `got_chars` characters can pass [`closest`]'s test against a candidate of
/// `candidate_chars`: a prefix is no longer than the candidate, one edit changes the length by
/// at most one, and a similarity of 0.6 allows at most 0.4 × the longer length of edits, which
/// for a longer `got` means `got_chars - candidate_chars <= 0.4 × got_chars`.
fn lengths_allow_typo(got_chars: usize, candidate_chars: usize) -> bool {
    got_chars <= candidate_chars + 1 || 3 * got_chars <= 5 * candidate_chars
}

#[cfg(test)]
mod tests {
    use super::{closest, excerpt, lengths_allow_typo};

    const KEYS: &[&str] = &["flash", "mem_efficient", "math", "cudnn"];

    #[test]
    fn closest_suggests_single_typo_in_short_key() {
        assert_eq!(
            closest("mth", KEYS.iter().copied()).as_deref(),
            Some("math")
        );
    }

    #[test]
    fn closest_suggests_for_prefix() {
        assert_eq!(
            closest("mem", KEYS.iter().copied()).as_deref(),
            Some("mem_efficient")
        );
    }

    #[test]
    fn closest_ignores_case() {
        assert_eq!(
            closest("FLASH", KEYS.iter().copied()).as_deref(),
            Some("flash")
        );
    }

    #[test]
    fn closest_gives_nothing_for_unrelated_word() {
        assert_eq!(closest("learning_rate", KEYS.iter().copied()), None);
    }

    #[test]
    fn length_bound_keeps_every_qualifying_pair() {
        let words = [
            "a",
            "ab",
            "abc",
            "abcd",
            "abcde",
            "abcdef",
            "abcdefgh",
            "abcdefghijkl",
        ];
        for got in words {
            for candidate in words {
                let (g, c) = (got.len(), candidate.len());
                if closest(got, [candidate]).is_some() {
                    assert!(lengths_allow_typo(g, c), "{got} / {candidate}");
                }
            }
        }
        // 0.6 similarity at the edge: 5 characters against 3 (two deletions of five).
        assert_eq!(closest("fp16x", ["fp1"]).as_deref(), Some("fp1"));
        assert!(!lengths_allow_typo(6, 3));
    }

    #[test]
    fn excerpt_keeps_short_text_whole() {
        assert_eq!(excerpt("bf61"), "bf61");
        assert_eq!(excerpt(&"é".repeat(60)), "é".repeat(60));
    }

    #[test]
    fn excerpt_cuts_long_text_and_gives_its_length() {
        assert_eq!(
            excerpt(&"é".repeat(61)),
            format!("{}… (61 characters)", "é".repeat(60))
        );
    }

    #[test]
    fn closest_gives_nothing_for_empty_input() {
        assert_eq!(closest("", KEYS.iter().copied()), None);
    }
}
