//! `spelled_enum!`: the choice enums' file spellings, one list per enum.

/// Implements `VALUES`, `as_str`, `Display`, serde and `FromStr` for a unit-variant enum, with
/// the given file spellings.
macro_rules! spelled_enum {
    ($ty:ident, $key:literal, [$($variant:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// The spellings accepted in files, in declaration order.
            pub const VALUES: &'static [&'static str] = &[$($name),+];

            /// The spelling used in files.
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::serde::Serialize for $ty {
            fn serialize<S: ::serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        // By hand rather than derived: a derived enum reports a list or a map given for it with
        // the format's enum jargon (YAML: "expected a YAML tag starting with '!'"), this one
        // with the allowed spellings.
        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Visitor;
                impl ::serde::de::Visitor<'_> for Visitor {
                    type Value = $ty;
                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        f.write_str("one of `")?;
                        f.write_str(&$ty::VALUES.join("`, `"))?;
                        f.write_str("`")
                    }
                    fn visit_str<E: ::serde::de::Error>(self, v: &str) -> Result<$ty, E> {
                        match v {
                            $($name => Ok($ty::$variant),)+
                            _ => Err(E::unknown_variant(v, $ty::VALUES)),
                        }
                    }
                }
                deserializer.deserialize_str(Visitor)
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::error::ConfigError;

            fn from_str(s: &str) -> Result<Self, $crate::error::ConfigError> {
                match s {
                    $($name => Ok(Self::$variant),)+
                    _ => Err($crate::error::ConfigError::bad_value($key, s, Self::VALUES)),
                }
            }
        }
    };
}
