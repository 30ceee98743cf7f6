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

mod declarations;
mod header;
mod rust;
mod statement;
#[cfg(test)]
mod tests;

pub use declarations::{AbiError, CType, Field, Item, Module};
pub use header::parse;
pub use rust::rust_bindings;
