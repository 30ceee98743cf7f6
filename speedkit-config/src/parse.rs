//! Turning YAML/JSON text into a `SpeedConfig`, and parser errors into `ConfigError`s.
//!
//! serde reports unknown keys, unknown enum values and type mismatches only as text (serde's
//! standard `de::Error` messages); [`parse_serde_message`] reads those texts back into data, and
//! `serde_path_to_error` supplies the dotted path of the offending key.

use serde_path_to_error::Segment;

use crate::error::{closest, excerpt, ConfigError, Format, Location};
use crate::types::Section;
use crate::{duplicates, nesting, SpeedConfig};

/// Parses (without validating) a YAML document; an empty or `null` document is the default.
pub(crate) fn yaml(text: &str) -> Result<SpeedConfig, ConfigError> {
    nesting::check(text, Format::Yaml)?;
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    match serde_path_to_error::deserialize::<_, Section<SpeedConfig>>(deserializer) {
        Ok(Section(config)) => Ok(config),
        Err(err) => {
            let location = err.inner().location().map(|l| Location {
                line: l.line(),
                column: l.column(),
            });
            let message = strip_location(&err.inner().to_string(), location);
            let location = match parse_serde_message(&message) {
                SerdeMessage::DuplicateField { field } => {
                    duplicates::locate_yaml(text, field).or(location)
                }
                _ => location,
            };
            Err(classify(
                Format::Yaml,
                &dotted(err.path()),
                &message,
                location,
            ))
        }
    }
}

/// Parses (without validating) a JSON document; `null` is the default.
pub(crate) fn json(text: &str) -> Result<SpeedConfig, ConfigError> {
    nesting::check(text, Format::Json)?;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let config =
        match serde_path_to_error::deserialize::<_, Section<SpeedConfig>>(&mut deserializer) {
            Ok(Section(config)) => config,
            Err(err) => {
                let path = dotted(err.path());
                return Err(json_error(&path, err.inner()));
            }
        };
    // Trailing characters after the document are a syntax error, as in `serde_json::from_str`.
    deserializer.end().map_err(|err| json_error("", &err))?;
    Ok(config)
}

fn json_error(path: &str, err: &serde_json::Error) -> ConfigError {
    // serde_json uses line 0 for "no position".
    let location = (err.line() > 0).then(|| Location {
        line: err.line(),
        column: err.column(),
    });
    let message = strip_location(&err.to_string(), location);
    if err.is_data() {
        classify(Format::Json, path, &message, location)
    } else {
        ConfigError::Syntax {
            format: Format::Json,
            message,
            location,
        }
    }
}

/// Removes the parser's own ` at line L column C` (we show the location ourselves).
fn strip_location(message: &str, location: Option<Location>) -> String {
    match location {
        Some(l) => message.replacen(&format!(" at line {} column {}", l.line, l.column), "", 1),
        None => message.to_owned(),
    }
}

/// `cudnn.benchmark`, `a.b[2].c`; empty for the document itself.
fn dotted(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } => push_key(&mut out, key),
            Segment::Enum { variant } => push_key(&mut out, variant),
            Segment::Unknown => push_key(&mut out, "?"),
        }
    }
    out
}

fn push_key(out: &mut String, key: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    out.push_str(key);
}

/// Builds the `ConfigError` for a deserialization error at `path` with serde's `message`.
fn classify(format: Format, path: &str, message: &str, location: Option<Location>) -> ConfigError {
    match parse_serde_message(message) {
        SerdeMessage::UnknownField { field, expected } => {
            let full = key_path(path, field);
            ConfigError::UnknownKey {
                key: excerpt(field),
                path: excerpt(&full),
                location,
                suggestion: closest(field, expected.iter().map(String::as_str)),
                expected,
            }
        }
        SerdeMessage::UnknownVariant { variant, expected } => ConfigError::BadValue {
            path: path.to_owned(),
            value: excerpt(variant),
            suggestion: closest(variant, expected.iter().map(String::as_str)),
            expected,
            location,
        },
        SerdeMessage::InvalidType { found, expected } => ConfigError::WrongType {
            path: path.to_owned(),
            found: shorten_found(found),
            expected: describe_expected(expected),
            location,
        },
        SerdeMessage::InvalidValue { found, expected } => ConfigError::BadValue {
            path: path.to_owned(),
            value: excerpt(literal(found)),
            expected: vec![describe_expected(expected)],
            suggestion: None,
            location,
        },
        SerdeMessage::DuplicateField { field } => {
            let full = key_path(path, field);
            ConfigError::Syntax {
                format,
                message: format!(
                    "duplicate key `{}`: each key may appear only once",
                    excerpt(&full)
                ),
                location,
            }
        }
        SerdeMessage::Other => ConfigError::Syntax {
            format,
            message: message.to_owned(),
            location,
        },
    }
}

/// The dotted path of `key` in the mapping at `path`. serde_path_to_error usually has recorded
/// the key already (it sees the key before serde rejects it), but not always (duplicates).
fn key_path(path: &str, key: &str) -> String {
    let recorded = path == key || path.strip_suffix(key).is_some_and(|p| p.ends_with('.'));
    let mut full = path.to_owned();
    if !recorded {
        push_key(&mut full, key);
    }
    full
}

/// Turns serde's type names in "expected ..." into words.
fn describe_expected(expected: &str) -> String {
    match expected {
        "u32" => "a whole number from 0 to 4294967295".to_owned(),
        "f64" => "a number".to_owned(),
        "a boolean" => "a boolean (true or false)".to_owned(),
        "field identifier" => "a key name".to_owned(),
        other => other.to_owned(),
    }
}

/// serde's `Unexpected` text with a long string value cut short: `string "xxx… (N characters)"`.
fn shorten_found(found: &str) -> String {
    match found
        .strip_prefix("string \"")
        .and_then(|s| s.strip_suffix('"'))
    {
        Some(text) => format!("string \"{}\"", excerpt(text)),
        None => excerpt(found),
    }
}

/// The value inside serde's `Unexpected` text: `integer \`5\`` → `5`, `string "x"` → `x`.
fn literal(unexpected: &str) -> &str {
    if let Some(quoted) = unexpected.strip_prefix("string \"") {
        return quoted.strip_suffix('"').unwrap_or(quoted);
    }
    match (unexpected.find('`'), unexpected.rfind('`')) {
        (Some(start), Some(end)) if start < end => &unexpected[start + 1..end],
        _ => unexpected,
    }
}

/// A serde `de::Error` message, read back into data.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SerdeMessage<'a> {
    /// `unknown field `x`, expected one of `a`, `b``.
    UnknownField {
        field: &'a str,
        expected: Vec<String>,
    },
    /// `unknown variant `x`, expected one of `a`, `b``.
    UnknownVariant {
        variant: &'a str,
        expected: Vec<String>,
    },
    /// `invalid type: FOUND, expected EXPECTED`.
    InvalidType { found: &'a str, expected: &'a str },
    /// `invalid value: FOUND, expected EXPECTED`.
    InvalidValue { found: &'a str, expected: &'a str },
    /// `duplicate field `x``.
    DuplicateField { field: &'a str },
    /// Anything else (parser errors, limits, ...).
    Other,
}

/// Reads serde's standard `de::Error` texts (serde's `Error::unknown_field`, `unknown_variant`,
/// `invalid_type`, `invalid_value`, `duplicate_field`); a prefix such as serde_yaml_ng's
/// `path: ` before the text is skipped.
///
/// Expected lists are written by serde as `` `a` ``, `` `a` or `b` `` or `` one of `a`, `b` ``;
/// the names are ours and contain no backtick, while the offending text may contain anything, so
/// it is cut at the *last* `` `, expected `` / `, expected `.
pub(crate) fn parse_serde_message(message: &str) -> SerdeMessage<'_> {
    const PREFIXES: [&str; 5] = [
        "unknown field `",
        "unknown variant `",
        "invalid type: ",
        "invalid value: ",
        "duplicate field `",
    ];
    let Some((start, prefix)) = PREFIXES
        .iter()
        .filter_map(|p| message.find(p).map(|i| (i, *p)))
        .min_by_key(|(i, _)| *i)
    else {
        return SerdeMessage::Other;
    };
    let rest = &message[start + prefix.len()..];
    match prefix {
        "unknown field `" | "unknown variant `" => {
            let (name, expected) = if let Some(i) = rest.rfind("`, expected ") {
                (&rest[..i], backticked(&rest[i + "`, expected ".len()..]))
            } else if let Some(name) = rest
                .strip_suffix("`, there are no fields")
                .or_else(|| rest.strip_suffix("`, there are no variants"))
            {
                (name, Vec::new())
            } else {
                return SerdeMessage::Other;
            };
            if prefix == "unknown field `" {
                SerdeMessage::UnknownField {
                    field: name,
                    expected,
                }
            } else {
                SerdeMessage::UnknownVariant {
                    variant: name,
                    expected,
                }
            }
        }
        "invalid type: " | "invalid value: " => {
            let Some(i) = rest.rfind(", expected ") else {
                return SerdeMessage::Other;
            };
            let (found, expected) = (&rest[..i], &rest[i + ", expected ".len()..]);
            if prefix == "invalid type: " {
                SerdeMessage::InvalidType { found, expected }
            } else {
                SerdeMessage::InvalidValue { found, expected }
            }
        }
        _ => match rest.strip_suffix('`') {
            Some(field) => SerdeMessage::DuplicateField { field },
            None => SerdeMessage::Other,
        },
    }
}

/// The backtick-quoted names in `` one of `a`, `b` ``.
fn backticked(list: &str) -> Vec<String> {
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{literal, parse_serde_message, SerdeMessage};

    #[test]
    fn reads_unknown_field_with_list() {
        assert_eq!(
            parse_serde_message("unknown field `benchmrk`, expected one of `enabled`, `benchmark`"),
            SerdeMessage::UnknownField {
                field: "benchmrk",
                expected: vec!["enabled".into(), "benchmark".into()],
            }
        );
    }

    #[test]
    fn reads_unknown_field_with_two_names() {
        assert_eq!(
            parse_serde_message("unknown field `nme`, expected `name` or `fused`"),
            SerdeMessage::UnknownField {
                field: "nme",
                expected: vec!["name".into(), "fused".into()],
            }
        );
    }

    #[test]
    fn reads_unknown_field_with_no_fields() {
        assert_eq!(
            parse_serde_message("unknown field `x`, there are no fields"),
            SerdeMessage::UnknownField {
                field: "x",
                expected: vec![],
            }
        );
    }

    #[test]
    fn reads_unknown_field_whose_name_contains_the_separator() {
        assert_eq!(
            parse_serde_message("unknown field `a`, expected `b`, expected `c`"),
            SerdeMessage::UnknownField {
                field: "a`, expected `b",
                expected: vec!["c".into()],
            }
        );
    }

    #[test]
    fn reads_unknown_variant_after_path_prefix() {
        assert_eq!(
            parse_serde_message(
                "precision: unknown variant `bf61`, expected one of `auto`, `bf16`"
            ),
            SerdeMessage::UnknownVariant {
                variant: "bf61",
                expected: vec!["auto".into(), "bf16".into()],
            }
        );
    }

    #[test]
    fn reads_invalid_type() {
        assert_eq!(
            parse_serde_message("invalid type: string \"a, expected b\", expected a boolean"),
            SerdeMessage::InvalidType {
                found: "string \"a, expected b\"",
                expected: "a boolean",
            }
        );
    }

    #[test]
    fn reads_invalid_value() {
        assert_eq!(
            parse_serde_message("invalid value: integer `-1`, expected u32"),
            SerdeMessage::InvalidValue {
                found: "integer `-1`",
                expected: "u32",
            }
        );
    }

    #[test]
    fn reads_duplicate_field() {
        assert_eq!(
            parse_serde_message("duplicate field `precision`"),
            SerdeMessage::DuplicateField { field: "precision" }
        );
    }

    #[test]
    fn other_messages_are_other() {
        assert_eq!(
            parse_serde_message("did not find expected key"),
            SerdeMessage::Other
        );
    }

    #[test]
    fn truncated_message_is_other() {
        assert_eq!(parse_serde_message("unknown field `x"), SerdeMessage::Other);
    }

    #[test]
    fn literal_strips_type_words() {
        assert_eq!(literal("integer `-1`"), "-1");
        assert_eq!(literal("string \"yes\""), "yes");
        assert_eq!(literal("sequence"), "sequence");
    }
}
