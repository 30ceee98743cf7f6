//! `#[speedkit::accelerate]`, in phases: [`args`] (attribute syntax) → [`validate`] (signature,
//! config) → [`body`] (forward sites, loss routing) → [`expand`] (generated code).
//!
//! Errors of every phase are collected in one [`Ctxt`]; on errors the output is the best-effort
//! expansion (default config, misplaced attributes removed) plus the `compile_error!`s, so that
//! the user sees the real problems and not a cascade caused by a missing `ctx` binding or by
//! leftover `#[speedkit::forward]` attributes.

pub(crate) mod args;
mod attrs;
pub(crate) mod body;
pub(crate) mod expand;
mod misplaced;
mod patterns;
pub(crate) mod validate;

use std::path::{Path, PathBuf};

use proc_macro2::{Ident, Span, TokenStream};
use syn::ItemFn;

use crate::ctxt::Ctxt;

/// The `#[speedkit::accelerate]` entry, reading `CARGO_MANIFEST_DIR` of the crate being compiled.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    with_errors(try_expand(args, item, manifest_dir.as_deref()))
}

/// Appends the errors, if any, to the expansion.
pub(crate) fn with_errors((tokens, result): (TokenStream, syn::Result<()>)) -> TokenStream {
    match result {
        Ok(()) => tokens,
        Err(err) => {
            let mut out = err.to_compile_error();
            out.extend(tokens);
            out
        }
    }
}

/// The expansion (best effort when there are errors) and the combined errors.
pub(crate) fn try_expand(
    args: TokenStream,
    item: TokenStream,
    manifest_dir: Option<&Path>,
) -> (TokenStream, syn::Result<()>) {
    let Ok(mut func) = syn::parse2::<ItemFn>(item.clone()) else {
        let err = syn::Error::new(
            Span::call_site(),
            "#[speedkit::accelerate] goes on a function with a body (a free function or a method)",
        );
        return (item, Err(err));
    };
    let cx = Ctxt::new();
    let args = args::parse(args, &cx);
    let sig = validate::signature(&func.sig, &cx);
    let source = validate::config_source(&args, manifest_dir, &cx);
    if func.sig.constness.is_some() {
        // Any expansion would add "cannot call non-const fn" errors; keep the function as is.
        return (item, cx.check());
    }
    // Hidden (`mixed_site`) unless named: user code can neither see nor shadow it.
    let ctx = args
        .ctx
        .clone()
        .unwrap_or_else(|| Ident::new("__sk_ctx", Span::mixed_site()));
    body::rewrite(&mut func.block, &func.sig, &ctx, &cx);
    let tokens = expand::accelerated_fn(func, &ctx, expand::config_source(&source), &sig);
    (tokens, cx.check())
}

#[cfg(test)]
mod tests;
