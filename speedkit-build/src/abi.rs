//! The shim's C ABI, read from its one header and written out as Rust declarations.
//!
//! speedkit's C++ shim declares every function Rust may call in one C header
//! (`speedkit/shim/speedkit.h`), which every shim file includes, so the C++ compiler rejects a
//! definition that differs from its declaration. speedkit's build script turns the same header
//! into the Rust `extern "C"` declarations ([`rust_bindings`]), so neither side can drift from it.
//!
//! The header is plain C in a small, fixed shape, and anything outside that shape is an error
//! naming the line, never a silently skipped declaration:
//! - `// @module NAME: what it is` starts the declarations of one concept (one shim file);
//! - `/// text` documents the item after it;
//! - `RET sk_name(TYPE name, ...);` declares a function (`(void)` for none), over several lines
//!   if need be;
//! - `typedef struct NAME { TYPE field; ... } NAME;` declares a struct (`char name[256];` arrays);
//! - `enum NAME { CONSTANT = value, ... };` declares integer constants;
//! - `typedef RET (*NAME)(TYPE name, ...);` declares a callback type;
//! - preprocessor lines, what `#ifdef __cplusplus` encloses (up to its `#else`), a lone `}`
//!   (closing `extern "C"`), the `typedef` of `sk_tensor` and other `//` comments are not
//!   declarations.
//!
//! Types: `void`, `char`, `int`, `float`, `double`, `size_t`, `(u)int{8,32,64}_t`, `sk_tensor`
//! (libtorch's `at::Tensor*`, tch's `*mut C_tensor`), the header's own structs and callbacks, and
//! pointers to any of them, `const` where the pointee is read only.
//!
//! ```
//! let header = "// @module flags: PyTorch's flags\n/// Reads one.\nint sk_flag_get(int flag, int* out);\n";
//! let rust = speedkit_build::abi::rust_bindings(header).unwrap();
//! assert!(rust.contains("pub fn sk_flag_get(flag: ::std::ffi::c_int, out: *mut ::std::ffi::c_int) -> ::std::ffi::c_int;"));
//! ```

use std::fmt::{self, Write as _};

/// A declaration the header holds that is not in the shape described in the [module docs](self).
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

/// Reads the header's modules and declarations.
///
/// ```
/// let modules = speedkit_build::abi::parse("// @module nvtx: ranges\nvoid sk_nvtx_pop(void);\n")?;
/// assert_eq!(modules[0].name, "nvtx");
/// # Ok::<(), speedkit_build::abi::AbiError>(())
/// ```
pub fn parse(header: &str) -> Result<Vec<Module>, AbiError> {
    let mut modules: Vec<Module> = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    let mut statement = String::new();
    let mut statement_line = 0;
    let mut conditions = Conditions::default();
    for (index, raw) in header.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.trim();
        if conditions.skips(line) {
            continue;
        }
        if statement.is_empty() {
            if let Some(rest) = line.strip_prefix("// @module ") {
                let (name, summary) = rest.split_once(':').unwrap_or((rest, ""));
                let name = name.trim();
                if !is_identifier(name) {
                    return Err(error(
                        line_no,
                        format!("module name {name:?} is not an identifier"),
                    ));
                }
                modules.push(Module {
                    name: name.to_owned(),
                    summary: summary.trim().to_owned(),
                    items: Vec::new(),
                });
                doc.clear();
                continue;
            }
            if let Some(text) = line.strip_prefix("///") {
                doc.push(text.strip_prefix(' ').unwrap_or(text).to_owned());
                continue;
            }
            let code = strip_line_comment(line);
            if code.is_empty() || is_not_a_declaration(code) {
                if line.is_empty() {
                    doc.clear();
                }
                continue;
            }
            statement_line = line_no;
        }
        statement.push(' ');
        statement.push_str(strip_line_comment(line));
        if !is_complete(&statement) {
            continue;
        }
        let text = std::mem::take(&mut statement);
        let item = parse_statement(text.trim(), std::mem::take(&mut doc))
            .map_err(|message| error(statement_line, message))?;
        let Some(module) = modules.last_mut() else {
            return Err(error(
                statement_line,
                "a declaration before the first `// @module` line".into(),
            ));
        };
        module.items.push(item);
    }
    if !statement.trim().is_empty() {
        return Err(error(
            statement_line,
            "a declaration without its closing `;`".into(),
        ));
    }
    Ok(modules)
}

/// The Rust declarations of `header`: its structs, constants and callback types at the top level,
/// and one `pub mod NAME { extern "C" { ... } }` per `// @module`, with the header's `///` lines as
/// their docs. `sk_tensor` is tch's `*mut torch_sys::C_tensor`.
///
/// ```
/// let rust = speedkit_build::abi::rust_bindings(
///     "// @module device: devices\ntypedef struct sk_props { char name[8]; int major; } sk_props;\n\
///      int sk_props_get(int index, sk_props* out);\n",
/// )?;
/// assert!(rust.contains("pub name: [::std::ffi::c_char; 8],"));
/// assert!(rust.contains("pub fn sk_props_get(index: ::std::ffi::c_int, out: *mut sk_props) -> ::std::ffi::c_int;"));
/// # Ok::<(), speedkit_build::abi::AbiError>(())
/// ```
pub fn rust_bindings(header: &str) -> Result<String, AbiError> {
    let modules = parse(header)?;
    let mut out = String::from(
        "// Generated from speedkit/shim/speedkit.h by speedkit-build (abi::rust_bindings): edit the\n\
         // header, not this file.\n\n\
         /// libtorch's `at::Tensor*`, as tch passes tensors.\n\
         pub type sk_tensor = *mut ::torch_sys::C_tensor;\n",
    );
    for module in &modules {
        for item in &module.items {
            write_shared_item(&mut out, item);
        }
    }
    for module in &modules {
        let _ = writeln!(out, "\n/// {}", module.summary);
        let _ = writeln!(out, "pub mod {} {{", module.name);
        out.push_str("    #[allow(unused_imports)]\n    use super::*;\n    extern \"C\" {\n");
        for item in &module.items {
            if let Item::Function {
                doc,
                name,
                params,
                ret,
            } = item
            {
                write_doc(&mut out, doc, "        ");
                let _ = writeln!(
                    out,
                    "        pub fn {name}({}){};",
                    rust_params(params),
                    rust_return(ret)
                );
            }
        }
        out.push_str("    }\n}\n");
    }
    Ok(out)
}

fn write_shared_item(out: &mut String, item: &Item) {
    match item {
        Item::Function { .. } => {}
        Item::Struct { doc, name, fields } => {
            write_doc(out, doc, "");
            let _ = writeln!(
                out,
                "#[repr(C)]\n#[derive(Clone, Copy)]\npub struct {name} {{"
            );
            for field in fields {
                let ty = rust_type(&field.ty);
                match field.array {
                    Some(n) => {
                        let _ = writeln!(out, "    pub {}: [{ty}; {n}],", field.name);
                    }
                    None => {
                        let _ = writeln!(out, "    pub {}: {ty},", field.name);
                    }
                }
            }
            out.push_str("}\n");
        }
        Item::Constants { doc, values } => {
            for (name, value) in values {
                write_doc(out, doc, "");
                let _ = writeln!(out, "pub const {name}: ::std::ffi::c_int = {value};");
            }
        }
        Item::Callback {
            doc,
            name,
            params,
            ret,
        } => {
            write_doc(out, doc, "");
            let _ = writeln!(
                out,
                "pub type {name} = ::std::option::Option<unsafe extern \"C\" fn({}){}>;",
                rust_params(params),
                rust_return(ret)
            );
        }
    }
}

fn write_doc(out: &mut String, doc: &[String], indent: &str) {
    for line in doc {
        let _ = writeln!(out, "{indent}/// {line}");
    }
}

fn rust_params(params: &[Field]) -> String {
    params
        .iter()
        .map(|p| format!("{}: {}", p.name, rust_type(&p.ty)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn rust_return(ret: &CType) -> String {
    match ret {
        CType::Void => String::new(),
        other => format!(" -> {}", rust_type(other)),
    }
}

/// The Rust spelling of a C type the header may use (checked by [`parse`]).
fn rust_type(ty: &CType) -> String {
    match ty {
        CType::Void => "::std::ffi::c_void".into(),
        CType::Named(name) => match name.as_str() {
            "char" => "::std::ffi::c_char".into(),
            "int" => "::std::ffi::c_int".into(),
            "float" => "f32".into(),
            "double" => "f64".into(),
            "size_t" => "usize".into(),
            "int8_t" => "i8".into(),
            "uint8_t" => "u8".into(),
            "int32_t" => "i32".into(),
            "uint32_t" => "u32".into(),
            "int64_t" => "i64".into(),
            "uint64_t" => "u64".into(),
            other => other.into(),
        },
        CType::Pointer { to, to_const } => {
            format!(
                "*{} {}",
                if *to_const { "const" } else { "mut" },
                rust_type(to)
            )
        }
    }
}

const SCALARS: [&str; 11] = [
    "char", "int", "float", "double", "size_t", "int8_t", "uint8_t", "int32_t", "uint32_t",
    "int64_t", "uint64_t",
];

fn error(line: usize, message: String) -> AbiError {
    AbiError { line, message }
}

fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The preprocessor conditionals around a line: what `#ifdef __cplusplus` encloses is C++ only
/// and declares nothing for Rust; its `#else` branch and every other conditional's lines are read.
#[derive(Default)]
struct Conditions {
    /// One entry per open conditional: whether its current branch is C++ only.
    open: Vec<bool>,
}

impl Conditions {
    /// Follows `line` if it is a conditional directive; whether the line is to be skipped.
    fn skips(&mut self, line: &str) -> bool {
        let directive = line.strip_prefix('#').map(str::trim_start);
        match directive {
            Some(d) if d.starts_with("if") => {
                self.open
                    .push(d.split_whitespace().eq(["ifdef", "__cplusplus"]));
                true
            }
            Some(d) if d.starts_with("else") => {
                if let Some(top) = self.open.last_mut() {
                    *top = false;
                }
                true
            }
            Some(d) if d.starts_with("endif") => {
                self.open.pop();
                true
            }
            Some(_) => true,
            None => self.open.iter().any(|&cplusplus_only| cplusplus_only),
        }
    }
}

/// Lines outside C++-only blocks that are part of the header but declare nothing for Rust.
fn is_not_a_declaration(line: &str) -> bool {
    line == "}"
        || (line.starts_with("typedef ") && line.trim_end_matches(';').ends_with(" sk_tensor"))
}

/// A statement ends at a `;` outside every brace (a struct's fields end in `;` too).
fn is_complete(statement: &str) -> bool {
    statement.trim_end().ends_with(';')
        && statement.matches('{').count() == statement.matches('}').count()
}

fn strip_line_comment(line: &str) -> &str {
    match line.find("//") {
        Some(at) => line[..at].trim_end(),
        None => line,
    }
}

fn parse_statement(text: &str, doc: Vec<String>) -> Result<Item, String> {
    let text = text.trim_end_matches(';').trim();
    if let Some(rest) = text.strip_prefix("typedef struct ") {
        return parse_struct(rest, doc);
    }
    if let Some(rest) = text.strip_prefix("enum ") {
        return parse_enum(rest, doc);
    }
    if let Some(rest) = text.strip_prefix("typedef ") {
        return parse_callback(rest, doc);
    }
    let (head, params) = split_call(text)?;
    let (ret, name) = split_declarator(head)?;
    if !name.starts_with("sk_") {
        return Err(format!("function {name} must be named sk_*"));
    }
    Ok(Item::Function {
        doc,
        name,
        params: parse_params(params)?,
        ret: parse_type(&ret, true)?,
    })
}

fn parse_struct(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    let (name, after) = rest
        .split_once('{')
        .ok_or_else(|| format!("struct {rest:?} has no body"))?;
    let name = name.trim();
    let (body, alias) = after
        .rsplit_once('}')
        .ok_or_else(|| format!("struct {name} has no closing brace"))?;
    if alias.trim() != name {
        return Err(format!(
            "struct {name} must be typedef'd as {name}, not {:?}",
            alias.trim()
        ));
    }
    let fields = body
        .split(';')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .map(parse_field)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Item::Struct {
        doc,
        name: name.to_owned(),
        fields,
    })
}

fn parse_enum(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    let (_, after) = rest
        .split_once('{')
        .ok_or_else(|| format!("enum {rest:?} has no body"))?;
    let (body, tail) = after
        .rsplit_once('}')
        .ok_or_else(|| "enum without its closing brace".to_owned())?;
    if !tail.trim().is_empty() {
        return Err(format!(
            "unexpected {:?} after the enum's body",
            tail.trim()
        ));
    }
    let values = body
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|entry| {
            let (name, value) = entry
                .split_once('=')
                .ok_or_else(|| format!("enum constant {entry:?} needs an explicit value"))?;
            let value: i64 = value
                .trim()
                .parse()
                .map_err(|_| format!("enum constant {entry:?}: the value is not an integer"))?;
            Ok((name.trim().to_owned(), value))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Item::Constants { doc, values })
}

fn parse_callback(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    // RET (*NAME)(PARAMS)
    let (ret, after) = rest
        .split_once("(*")
        .ok_or_else(|| format!("typedef {rest:?} is not a callback `RET (*name)(params)`"))?;
    let (name, params) = after
        .split_once(")(")
        .ok_or_else(|| format!("callback typedef {rest:?} is not `RET (*name)(params)`"))?;
    let params = params
        .strip_suffix(')')
        .ok_or_else(|| format!("callback {name}: no closing parenthesis"))?;
    Ok(Item::Callback {
        doc,
        name: name.trim().to_owned(),
        params: parse_params(params)?,
        ret: parse_type(ret.trim(), true)?,
    })
}

/// `head(params)` → (head, params).
fn split_call(text: &str) -> Result<(&str, &str), String> {
    let open = text
        .find('(')
        .ok_or_else(|| format!("{text:?} is not a function declaration"))?;
    let params = text[open + 1..]
        .strip_suffix(')')
        .ok_or_else(|| format!("{text:?}: the parameter list does not end the declaration"))?;
    if params.contains('(') {
        return Err(format!(
            "{text:?}: a function-pointer parameter needs a callback typedef"
        ));
    }
    Ok((&text[..open], params))
}

/// `TYPE name` → (TYPE, name), the name being the last identifier.
fn split_declarator(text: &str) -> Result<(String, String), String> {
    let text = text.trim();
    let cut = text
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let (ty, name) = (text[..cut].trim(), &text[cut..]);
    if ty.is_empty() || !is_identifier(name) {
        return Err(format!("{text:?} is not `type name`"));
    }
    Ok((ty.to_owned(), name.to_owned()))
}

fn parse_params(params: &str) -> Result<Vec<Field>, String> {
    let params = params.trim();
    if params == "void" {
        return Ok(Vec::new());
    }
    if params.is_empty() {
        return Err("an empty parameter list must be written (void) in C".into());
    }
    params.split(',').map(parse_field).collect()
}

fn parse_field(text: &str) -> Result<Field, String> {
    let text = text.trim();
    let (text, array) = match text.strip_suffix(']') {
        Some(head) => {
            let (head, len) = head
                .rsplit_once('[')
                .ok_or_else(|| format!("{text:?}: unbalanced brackets"))?;
            let len = len
                .trim()
                .parse()
                .map_err(|_| format!("{text:?}: the array length is not a number"))?;
            (head, Some(len))
        }
        None => (text, None),
    };
    let (ty, name) = split_declarator(text)?;
    Ok(Field {
        name,
        ty: parse_type(&ty, false)?,
        array,
    })
}

/// `const T * const * ...` into a [`CType`]; `void` alone only where `void_allowed`.
fn parse_type(text: &str, void_allowed: bool) -> Result<CType, String> {
    let spaced = text.replace('*', " * ");
    let mut tokens = spaced.split_whitespace().peekable();
    let mut base_const = false;
    if tokens.peek() == Some(&"const") {
        base_const = true;
        tokens.next();
    }
    let base = tokens
        .next()
        .ok_or_else(|| format!("{text:?} names no type"))?;
    if tokens.peek() == Some(&"const") {
        base_const = true;
        tokens.next();
    }
    let known = base == "void"
        || SCALARS.contains(&base)
        || (base.starts_with("sk_") && is_identifier(base));
    if !known {
        return Err(format!(
            "type {base:?} in {text:?} is not one the ABI takes (C scalars, sk_* types)"
        ));
    }
    let mut ty = if base == "void" {
        CType::Void
    } else {
        CType::Named(base.to_owned())
    };
    let mut pointee_const = base_const;
    let mut pointers = 0;
    while let Some(token) = tokens.next() {
        if token != "*" {
            return Err(format!("unexpected {token:?} in type {text:?}"));
        }
        pointers += 1;
        ty = CType::Pointer {
            to: Box::new(ty),
            to_const: pointee_const,
        };
        pointee_const = false;
        if tokens.peek() == Some(&"const") {
            pointee_const = true;
            tokens.next();
        }
    }
    if ty == CType::Void && !void_allowed {
        return Err(format!("{text:?}: a parameter cannot be void"));
    }
    if pointers == 0 && base_const {
        return Err(format!(
            "{text:?}: `const` on a value parameter says nothing to Rust"
        ));
    }
    Ok(ty)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(header: &str) -> Item {
        parse(&format!("// @module m: test\n{header}"))
            .unwrap()
            .remove(0)
            .items
            .remove(0)
    }

    #[test]
    fn pointers_keep_the_constness_of_their_pointees() {
        let rust = rust_bindings(
            "// @module m: test\nint sk_f(const char* const* names, const sk_tensor* tensors, sk_tensor* out);\n",
        )
        .unwrap();
        assert!(rust.contains(
            "pub fn sk_f(names: *const *const ::std::ffi::c_char, tensors: *const sk_tensor, out: *mut sk_tensor) -> ::std::ffi::c_int;"
        ));
    }

    #[test]
    fn a_declaration_may_span_lines_and_carries_its_doc() {
        let item = function("/// Adds.\n/// Twice.\nint sk_add(int a,\n           int b);\n");
        let Item::Function { doc, params, .. } = item else {
            panic!("not a function")
        };
        assert_eq!(doc, ["Adds.", "Twice."]);
        assert_eq!(params.len(), 2);
    }

    #[test]
    fn void_parameter_lists_and_returns() {
        let rust = rust_bindings("// @module m: test\nvoid sk_pop(void);\n").unwrap();
        assert!(rust.contains("pub fn sk_pop();"));
    }

    #[test]
    fn empty_parentheses_are_refused_as_c_reads_them_as_unknown_parameters() {
        let err = parse("// @module m: test\nint sk_f();\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(err.message.contains("(void)"), "{err}");
    }

    #[test]
    fn an_unknown_type_is_an_error_naming_the_line() {
        let err = parse("// @module m: test\n\nint sk_f(long x);\n").unwrap_err();
        assert_eq!(err.line, 3);
        assert!(err.message.contains("\"long\""), "{err}");
    }

    #[test]
    fn a_declaration_outside_a_module_is_an_error() {
        let err = parse("int sk_f(int x);\n").unwrap_err();
        assert!(err.message.contains("@module"), "{err}");
    }

    #[test]
    fn a_function_outside_the_sk_namespace_is_an_error() {
        let err = parse("// @module m: test\nint at_f(int x);\n").unwrap_err();
        assert!(err.message.contains("sk_*"), "{err}");
    }

    #[test]
    fn enums_become_integer_constants() {
        let rust = rust_bindings(
            "// @module m: test\nenum sk_scalar_type { SK_HALF = 5, SK_FLOAT = 6, SK_NONE = -1 };\n",
        )
        .unwrap();
        assert!(rust.contains("pub const SK_HALF: ::std::ffi::c_int = 5;"));
        assert!(rust.contains("pub const SK_NONE: ::std::ffi::c_int = -1;"));
    }

    #[test]
    fn callbacks_become_optional_extern_fn_pointers() {
        let rust = rust_bindings(
            "// @module m: test\ntypedef int (*sk_backward_fn)(void* state, int64_t n);\n",
        )
        .unwrap();
        assert!(rust.contains(
            "pub type sk_backward_fn = ::std::option::Option<unsafe extern \"C\" fn(state: *mut ::std::ffi::c_void, n: i64) -> ::std::ffi::c_int>;"
        ));
    }

    #[test]
    fn cplusplus_only_lines_declare_nothing() {
        let modules = parse(
            "#ifdef __cplusplus\nnamespace at {\nclass Tensor;\n}\ntypedef at::Tensor* sk_tensor;\n\
             extern \"C\" {\n#else\ntypedef struct sk_tensor_opaque* sk_tensor;\n#endif\n\
             // @module m: test\nint sk_f(sk_tensor t);\n#ifdef __cplusplus\n}  // extern \"C\"\n#endif\n",
        )
        .unwrap();
        assert_eq!(modules.len(), 1);
        assert_eq!(modules[0].items.len(), 1);
    }

    #[test]
    fn a_changed_parameter_type_changes_the_rust_declaration() {
        let before = rust_bindings("// @module m: test\nint sk_f(int x);\n").unwrap();
        let after = rust_bindings("// @module m: test\nint sk_f(int64_t x);\n").unwrap();
        assert!(before.contains("x: ::std::ffi::c_int"));
        assert!(after.contains("x: i64"));
    }
}
