//! The header's declarations as Rust: `extern "C"` functions, `#[repr(C)]` structs, constants and
//! callback types.

use std::fmt::Write as _;

use super::declarations::{AbiError, CType, Field, Item};
use super::header::parse;

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
