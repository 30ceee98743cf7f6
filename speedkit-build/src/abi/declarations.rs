//! What the header declares, as [`parse`](super::parse) reads it, and what is wrong where it
//! cannot.

use std::fmt;

/// A declaration the header holds that is not in the shape described in the [module docs](crate::abi).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbiError {
    /// The 1-based line where the declaration starts.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for AbiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for AbiError {}

/// A C type of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CType {
    /// `void` (only as a return type or a pointee).
    Void,
    /// A scalar or a named type, by its C spelling (`int`, `int64_t`, `sk_tensor`, a struct).
    Named(String),
    /// A pointer; `to_const` when the pointee is `const`.
    Pointer {
        /// What it points to.
        to: Box<CType>,
        /// Whether the pointee is read only.
        to_const: bool,
    },
}

/// One parameter or struct field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// Its name.
    pub name: String,
    /// Its type.
    pub ty: CType,
    /// The length, for an array field (`char name[256]`).
    pub array: Option<usize>,
}

/// One declaration of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// `RET name(params);`
    Function {
        /// Its `///` lines.
        doc: Vec<String>,
        /// Its name.
        name: String,
        /// Its parameters.
        params: Vec<Field>,
        /// Its return type.
        ret: CType,
    },
    /// `typedef struct name { fields } name;`
    Struct {
        /// Its `///` lines.
        doc: Vec<String>,
        /// Its name.
        name: String,
        /// Its fields.
        fields: Vec<Field>,
    },
    /// `enum name { A = 1, ... };`: integer constants.
    Constants {
        /// Its `///` lines.
        doc: Vec<String>,
        /// `(name, value)` pairs.
        values: Vec<(String, i64)>,
    },
    /// `typedef RET (*name)(params);`
    Callback {
        /// Its `///` lines.
        doc: Vec<String>,
        /// Its name.
        name: String,
        /// Its parameters.
        params: Vec<Field>,
        /// Its return type.
        ret: CType,
    },
}

/// The declarations of one `// @module` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The module's name (a Rust identifier).
    pub name: String,
    /// What the `// @module NAME:` line says after the colon.
    pub summary: String,
    /// Its declarations, in header order.
    pub items: Vec<Item>,
}
