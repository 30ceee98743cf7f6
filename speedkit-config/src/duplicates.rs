//! Where a duplicate YAML key is.
//!
//! serde's derived structs notice a repeated key only after the key has been read, so
//! serde_yaml_ng places the error at the start of the enclosing mapping (line 1, column 1 for a
//! top-level key). A second walk over the document, run only for that error, rejects the repeated
//! key while it is being read, which gives the key's own place.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::Location;

/// The place of the first repeated `key` of any mapping in the YAML `text`, or `None` when the
/// first repeated key has another name (or the walk fails for another reason).
pub(crate) fn locate_yaml(text: &str, key: &str) -> Option<Location> {
    let err = Node
        .deserialize(serde_yaml_ng::Deserializer::from_str(text))
        .err()?;
    let location = err.location()?;
    // serde_yaml_ng puts the path of a nested key before the message.
    err.to_string()
        .contains(&repeated_message(key))
        .then(|| Location {
            line: location.line(),
            column: location.column(),
        })
}

fn repeated_message(key: &str) -> String {
    format!("repeated key `{key}`")
}

/// Any node; mappings are checked for repeated keys, recursively.
struct Node;

impl<'de> DeserializeSeed<'de> for Node {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Node)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while map.next_key_seed(Key { seen: &mut seen })?.is_some() {
            map.next_value_seed(Node)?;
        }
        Ok(())
    }
}

/// A mapping's key; a text key already in `seen` is rejected while it is read.
struct Key<'a> {
    seen: &'a mut HashSet<String>,
}

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<(), E> {
        if self.seen.insert(key.to_owned()) {
            Ok(())
        } else {
            Err(E::custom(repeated_message(key)))
        }
    }

    // Keys that are not text cannot be config keys; serde reports them before any duplicate.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        Node.visit_seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Node.visit_map(map)
    }
}

#[cfg(test)]
mod tests {
    use super::locate_yaml;
    use crate::error::Location;

    #[test]
    fn finds_a_repeated_nested_key() {
        let text = "cudnn:\n  enabled: true\n  benchmark: true\n  enabled: false\n";
        assert_eq!(
            locate_yaml(text, "enabled"),
            Some(Location { line: 4, column: 3 })
        );
    }

    #[test]
    fn a_first_repeat_of_another_name_gives_nothing() {
        assert_eq!(locate_yaml("a: 1\na: 2\nb: 1\nb: 2\n", "b"), None);
    }

    #[test]
    fn the_same_key_in_two_mappings_is_no_repeat() {
        assert_eq!(
            locate_yaml(
                "cudnn: {enabled: true}\ncompile: {enabled: true}\n",
                "enabled"
            ),
            None
        );
    }
}
