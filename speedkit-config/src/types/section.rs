//! How a config section reads: a mapping, or nothing for all of its defaults.

use std::fmt;
use std::marker::PhantomData;

use serde::de;
use serde::{Deserialize, Deserializer};

/// A config section, or the whole config: a mapping, or nothing (`null`, `~`, an empty YAML
/// value, an empty file) for all defaults, so that commenting out every key of a section is
/// fine. Unlike derived struct impls it refuses lists: positional sections (`[true, false]`) in
/// JSON would be unreadable.
pub(crate) struct Section<T>(pub(crate) T);

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for Section<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Default> de::Visitor<'de> for Visitor<T> {
            type Value = Section<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping of settings (`key: value` lines)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Section<T>, E> {
                Ok(Section(T::default()))
            }
            fn visit_none<E: de::Error>(self) -> Result<Section<T>, E> {
                Ok(Section(T::default()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Section<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Section)
            }
        }
        deserializer.deserialize_any(Visitor(PhantomData))
    }
}

/// A section field's `deserialize_with`: the [`Section`]'s value.
pub(super) fn section<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    deserializer: D,
) -> Result<T, D::Error> {
    Section::deserialize(deserializer).map(|section| section.0)
}
