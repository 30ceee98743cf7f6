//! The header reader's and the Rust writer's cases.

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
