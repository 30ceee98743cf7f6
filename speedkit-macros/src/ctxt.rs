//! Collects every error a macro invocation finds, so that the user sees all of them at once.
//!
//! Modelled on serde_derive's `Ctxt`: each phase pushes `syn::Error`s with the span of the
//! offending tokens and carries on with a best guess; the entry point checks once at the end and
//! turns the combined error into `compile_error!`s next to its best-effort output.

use std::cell::RefCell;
use std::fmt::Display;
use std::thread;

use quote::ToTokens;

/// An error collector shared (by `&`) between the phases of one macro invocation.
///
/// Dropping it without calling [`Ctxt::check`] panics: forgetting to report errors would make
/// the macro silently accept bad input.
pub(crate) struct Ctxt {
    // `None` once checked, so that a second check (or a push after it) is caught as a bug.
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Ctxt {
    /// A collector with no errors yet.
    pub(crate) fn new() -> Self {
        Ctxt {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    /// An error spanning the tokens of `tokens` (first to last token, as `syn` does on stable).
    pub(crate) fn error_spanned_by<T: ToTokens, M: Display>(&self, tokens: T, message: M) {
        self.push(syn::Error::new_spanned(tokens.into_token_stream(), message));
    }

    /// An error built elsewhere (a `syn` parse error, a combined error, ...).
    pub(crate) fn push(&self, error: syn::Error) {
        self.errors
            .borrow_mut()
            .as_mut()
            .expect("Ctxt used after check")
            .push(error);
    }

    /// Whether any error was pushed so far.
    pub(crate) fn has_errors(&self) -> bool {
        self.errors.borrow().as_ref().is_some_and(|e| !e.is_empty())
    }

    /// Consumes the collector: `Err` with every error combined (in push order) if there is any.
    pub(crate) fn check(self) -> syn::Result<()> {
        let errors = self.errors.borrow_mut().take().expect("Ctxt checked twice");
        let mut errors = errors.into_iter();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for rest in errors {
            combined.combine(rest);
        }
        Err(combined)
    }
}

impl Drop for Ctxt {
    fn drop(&mut self) {
        if !thread::panicking() && self.errors.borrow().is_some() {
            panic!("speedkit-macros bug: Ctxt dropped without check()");
        }
    }
}

pub(crate) use speedkit_config::closest;

/// `` `a`, `b`, `c` `` for an error message.
pub(crate) fn backticked_list<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::Span;

    #[test]
    fn check_combines_errors_in_push_order() {
        let cx = Ctxt::new();
        cx.push(syn::Error::new(Span::call_site(), "first"));
        cx.error_spanned_by(quote::quote!(a b), "second");
        assert!(cx.has_errors());
        let err = cx.check().unwrap_err();
        let messages: Vec<String> = err.into_iter().map(|e| e.to_string()).collect();
        assert_eq!(messages, ["first", "second"]);
    }

    #[test]
    fn check_without_errors_is_ok() {
        let cx = Ctxt::new();
        assert!(!cx.has_errors());
        assert!(cx.check().is_ok());
    }

    #[test]
    fn closest_finds_typos_and_prefixes() {
        let keys = ["config", "ctx", "precision", "device"];
        assert_eq!(closest("precison", keys).as_deref(), Some("precision"));
        assert_eq!(closest("cxt", keys).as_deref(), Some("ctx"));
        assert_eq!(closest("dev", keys).as_deref(), Some("device"));
        assert_eq!(closest("learning_rate", keys), None);
    }
}
