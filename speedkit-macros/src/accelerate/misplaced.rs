//! `#[speedkit::forward]` where the body's rewriter does not go: in items nested in the body, in
//! `async` code, and in functions that are not `#[speedkit::accelerate]` at all.

use proc_macro2::TokenStream;
use syn::visit_mut::{self, VisitMut};
use syn::{Attribute, Expr, ImplItemFn, ItemFn, Local, TraitItemFn};

use super::attrs::{expr_attrs_mut, is_speedkit_attr};
use crate::ctxt::Ctxt;

/// A `#[speedkit::forward]` in a fn nested in the body.
pub(super) const IN_NESTED_FN: &str =
    "#[speedkit::forward] inside a nested fn: that fn is not accelerated; \
                            mark it #[speedkit::accelerate] itself";

/// A `#[speedkit::forward]` in an `async` block or closure.
pub(super) const IN_ASYNC: &str =
    "#[speedkit::forward] inside an `async` block or closure: the autocast \
                        scope must not be held across `.await`; run the forward pass in \
                        synchronous code";

/// Reports (and removes) every `#[speedkit::forward]` in code the rewriter does not enter (items
/// nested in the body, `async` blocks), except inside functions that are
/// `#[speedkit::accelerate]` themselves (their own expansion handles them).
pub(super) struct NestedItems<'a> {
    cx: &'a Ctxt,
    message: &'static str,
}

impl<'a> NestedItems<'a> {
    pub(super) fn new(cx: &'a Ctxt, message: &'static str) -> Self {
        NestedItems { cx, message }
    }

    fn report(&self, attrs: &mut Vec<Attribute>) {
        attrs.retain(|attr| {
            if !is_speedkit_attr(attr, "forward") {
                return true;
            }
            self.cx.error_spanned_by(attr, self.message);
            false
        });
    }
}

impl VisitMut for NestedItems<'_> {
    fn visit_item_fn_mut(&mut self, item: &mut ItemFn) {
        if !item.attrs.iter().any(|a| is_speedkit_attr(a, "accelerate")) {
            visit_mut::visit_item_fn_mut(self, item);
        }
    }

    fn visit_impl_item_fn_mut(&mut self, item: &mut ImplItemFn) {
        if !item.attrs.iter().any(|a| is_speedkit_attr(a, "accelerate")) {
            visit_mut::visit_impl_item_fn_mut(self, item);
        }
    }

    fn visit_trait_item_fn_mut(&mut self, item: &mut TraitItemFn) {
        if !item.attrs.iter().any(|a| is_speedkit_attr(a, "accelerate")) {
            visit_mut::visit_trait_item_fn_mut(self, item);
        }
    }

    fn visit_local_mut(&mut self, local: &mut Local) {
        self.report(&mut local.attrs);
        visit_mut::visit_local_mut(self, local);
    }

    fn visit_stmt_macro_mut(&mut self, mac: &mut syn::StmtMacro) {
        self.report(&mut mac.attrs);
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if let Some(attrs) = expr_attrs_mut(expr) {
            self.report(attrs);
        }
        visit_mut::visit_expr_mut(self, expr);
    }
}

/// Expansion of `#[speedkit::forward]` used as an attribute of its own.
///
/// Inside an `#[speedkit::accelerate]` function the attribute is removed before the compiler sees
/// it, so this only runs where it is misplaced: on an item, or on a statement of a function that
/// is not accelerated (on stable, rustc rejects attribute macros on statements before even
/// calling this; that error is rustc's own). The item is kept as it is next to the error, so that
/// nothing else breaks.
pub(crate) fn forward_outside_accelerate(item: TokenStream) -> TokenStream {
    let mut out = syn::Error::new_spanned(
        &item,
        "#[speedkit::forward] only works inside a function marked #[speedkit::accelerate]: mark \
         the enclosing training function #[speedkit::accelerate(config = \"speed.yaml\")]",
    )
    .to_compile_error();
    out.extend(item);
    out
}
