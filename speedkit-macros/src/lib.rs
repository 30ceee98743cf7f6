//! Procedural macros of [speedkit](https://example.invalid/speedkit): `#[speedkit::accelerate]`,
//! `#[speedkit::forward]` and `#[speedkit::bench]`.
//!
//! Use them through the `speedkit` crate, which re-exports them and documents them, with examples
//! that compile and run against the runtime (doc tests here could not: this crate cannot depend on
//! the runtime). The generated code names only
//! `::speedkit::__private::…`, `::speedkit::bench::…`, `::core::…` and `::std::…`, and every
//! identifier it introduces is hygienic (`Span::mixed_site`), so it cannot collide with yours.
//!
//! Every misuse is a compile error spanned at the offending tokens, and all of them are reported
//! together; the speed config itself is parsed and validated at compile time by
//! `speedkit-config`, the same code the runtime uses.

mod accelerate;
mod bench;
mod ctxt;
#[cfg(test)]
mod test_util;

use proc_macro::TokenStream;

/// The `accelerate` attribute as implemented by `speedkit-macros`. Use it as
/// `speedkit::accelerate`: the `speedkit` crate re-exports it with its documentation (arguments,
/// expansion, rewrite rules, and examples that compile and run against the runtime).
#[proc_macro_attribute]
pub fn accelerate(args: TokenStream, item: TokenStream) -> TokenStream {
    accelerate::expand(args.into(), item.into()).into()
}

/// The `forward` attribute as implemented by `speedkit-macros`. Use it as `speedkit::forward`:
/// the `speedkit` crate re-exports it with its documentation (where it goes, and an example that
/// compiles and runs against the runtime).
#[proc_macro_attribute]
pub fn forward(_args: TokenStream, item: TokenStream) -> TokenStream {
    accelerate::body::forward_outside_accelerate(item.into()).into()
}

/// The `bench` attribute as implemented by `speedkit-macros`. Use it as `speedkit::bench`: the
/// `speedkit` crate re-exports it with its documentation (arguments, expansion, and examples that
/// compile and run against the runtime).
#[proc_macro_attribute]
pub fn bench(args: TokenStream, item: TokenStream) -> TokenStream {
    bench::expand(args.into(), item.into()).into()
}
