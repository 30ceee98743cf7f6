//! Phase 3 of `#[speedkit::accelerate]`: the function body.
//!
//! Finds the `#[speedkit::forward]` statements and wraps them in an autocast scope, and routes the
//! losses they bind through the GradScaler (`loss.backward()`, `opt.step()`,
//! `opt.backward_step(&loss)`). Everything is syntactic and lexical; the precise rules are in the
//! rustdoc of `accelerate` in `lib.rs`. Nothing that is neither annotated nor matched by those
//! rules is touched.

use std::collections::HashSet;

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{
    parse_quote, parse_quote_spanned, Attribute, Block, Expr, ExprClosure, ExprMethodCall, FnArg,
    Item, Local, Pat, Signature, Stmt,
};

use super::attrs::{expr_attrs_mut, is_speedkit_attr, stmt_attrs_mut, take_forward};
pub(crate) use super::misplaced::forward_outside_accelerate;
use super::misplaced::{NestedItems, IN_ASYNC, IN_NESTED_FN};
use super::patterns::{bound_names, is_mut_ref, let_patterns, path_ident, plain_ident};
use crate::ctxt::Ctxt;

/// The start of every message about a `#[speedkit::forward]` in the wrong place.
const PLACEMENT: &str =
    "#[speedkit::forward] goes on a `let` statement with an initializer or on a block `{ ... }`";

/// Rewrites `block`, the body of the function with signature `sig`; `ctx` names the
/// `SpeedContext` in generated code. Misuses are pushed to `cx`; the offending attributes are
/// removed anyway, so the best-effort output does not add errors of its own.
pub(crate) fn rewrite(block: &mut Block, sig: &Signature, ctx: &proc_macro2::Ident, cx: &Ctxt) {
    let mut root = Scope::default();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => {
                if is_mut_ref(&receiver.ty) {
                    root.mut_refs.insert("self".to_owned());
                }
            }
            FnArg::Typed(typed) => {
                if let Some(name) = plain_ident(&typed.pat) {
                    if is_mut_ref(&typed.ty) {
                        root.mut_refs.insert(name);
                    }
                }
            }
        }
    }
    let mut rewriter = BodyRewriter {
        cx,
        ctx: ctx.clone(),
        scopes: vec![root],
        rewrites: 0,
        imported_forward: Vec::new(),
    };
    rewriter.visit_block_mut(block);
}

/// What is known at one point of the body, lexically.
#[derive(Clone, Default)]
struct Scope {
    /// Names bound by a `#[speedkit::forward] let NAME = ...` and not rebound since.
    losses: HashSet<String>,
    /// Names known to hold a `&mut` (parameters `x: &mut T`, `&mut self`, `let x = &mut ...`),
    /// which are reborrowed (`&mut *x`) rather than borrowed again (`&mut x`, which would need
    /// the binding itself to be `mut`).
    mut_refs: HashSet<String>,
    /// A statement `loss.backward()` of a tracked loss came earlier in this block (or an enclosing
    /// one): later `IDENT.step()` statements go through the scaler.
    after_backward: bool,
}

struct BodyRewriter<'a> {
    cx: &'a Ctxt,
    ctx: proc_macro2::Ident,
    scopes: Vec<Scope>,
    /// Sites rewritten so far (each one refers to the context).
    rewrites: usize,
    /// Per block being visited: the first `#[forward]` written without a path, if any. Removing
    /// the attribute would leave the user's `use speedkit::forward;` unused (a warning, an error
    /// under `deny(warnings)`), so the block gets a `use forward as _;` that uses the import.
    imported_forward: Vec<Option<proc_macro2::Ident>>,
}

impl BodyRewriter<'_> {
    fn scope(&mut self) -> &mut Scope {
        // The root scope is pushed in `rewrite` and never popped.
        let last = self.scopes.len() - 1;
        &mut self.scopes[last]
    }

    fn push_scope(&mut self) {
        let top = self.scope().clone();
        self.scopes.push(top);
    }

    fn pop_scope(&mut self) {
        self.scopes.pop();
    }

    /// `pat` binds new names: they no longer refer to tracked losses or `&mut`s.
    fn shadow(&mut self, pat: &Pat) {
        let mut names = Vec::new();
        bound_names(pat, &mut names);
        let scope = self.scope();
        for name in names {
            scope.losses.remove(&name);
            scope.mut_refs.remove(&name);
        }
    }

    /// Removes the `#[speedkit::forward]`s of `attrs` (see [`take_forward`]), remembering an
    /// imported `#[forward]` for the current block.
    fn take_forward(&mut self, attrs: &mut Vec<Attribute>) -> Option<Attribute> {
        let imported = attrs
            .iter()
            .filter(|attr| is_speedkit_attr(attr, "forward"))
            .find_map(|attr| attr.path().get_ident().cloned());
        if let (Some(ident), Some(slot @ None)) = (imported, self.imported_forward.last_mut()) {
            *slot = Some(ident);
        }
        take_forward(attrs, self.cx)
    }

    /// `let __sk_autocast = ::speedkit::__private::autocast_scope(&ctx);`
    fn autocast_guard(&mut self, span: Span) -> Stmt {
        self.rewrites += 1;
        let guard = proc_macro2::Ident::new("__sk_autocast", Span::mixed_site());
        let ctx = &self.ctx;
        parse_quote_spanned! {span=>
            let #guard = ::speedkit::__private::autocast_scope(&#ctx);
        }
    }

    fn tracked_loss<'e>(&self, expr: &'e Expr) -> Option<&'e proc_macro2::Ident> {
        let ident = path_ident(expr)?;
        let scope = self.scopes.last()?;
        scope.losses.contains(&ident.to_string()).then_some(ident)
    }

    fn is_tracked_backward(&self, expr: &Expr) -> bool {
        matches!(expr, Expr::MethodCall(call)
            if call.method == "backward"
                && call.args.is_empty()
                && call.turbofish.is_none()
                && self.tracked_loss(&call.receiver).is_some())
    }

    /// `&mut RECV` for the scaler helpers, written as a method call would autoref it.
    fn mut_borrow(&self, recv: &Expr) -> TokenStream {
        let mut inner = recv;
        while let Expr::Paren(paren) = inner {
            inner = &paren.expr;
        }
        let is_mut_ref = |ident: &proc_macro2::Ident| {
            self.scopes
                .last()
                .is_some_and(|s| s.mut_refs.contains(&ident.to_string()))
        };
        match inner {
            Expr::Reference(reference) if reference.mutability.is_some() => quote!(#inner),
            Expr::Path(_) if path_ident(inner).is_some_and(is_mut_ref) => quote!(&mut *#inner),
            Expr::Path(_)
            | Expr::Field(_)
            | Expr::MethodCall(_)
            | Expr::Call(_)
            | Expr::Index(_)
            | Expr::Macro(_)
            | Expr::Try(_) => quote!(&mut #inner),
            _ => quote!(&mut (#inner)),
        }
    }

    /// `RECV.backward_step(&loss)` / `(loss)` of a tracked loss → the scaled helper.
    fn rewrite_backward_step(&mut self, call: &ExprMethodCall) -> Option<Expr> {
        if call.method != "backward_step" || call.args.len() != 1 || call.turbofish.is_some() {
            return None;
        }
        let arg = &call.args[0];
        let loss_expr = match arg {
            Expr::Reference(reference) if reference.mutability.is_none() => &*reference.expr,
            other => other,
        };
        let loss = self.tracked_loss(loss_expr)?.clone();
        let recv = self.mut_borrow(&call.receiver);
        let ctx = &self.ctx;
        self.rewrites += 1;
        Some(parse_quote_spanned! {call.method.span()=>
            ::speedkit::__private::backward_step(&#ctx, #recv, &#loss)
        })
    }

    /// `IDENT.step()` as a statement after a tracked `loss.backward()` → the scaled helper.
    fn rewrite_step(&mut self, expr: &Expr) -> Option<Expr> {
        let Expr::MethodCall(call) = expr else {
            return None;
        };
        if call.method != "step" || !call.args.is_empty() || call.turbofish.is_some() {
            return None;
        }
        let ident = path_ident(&call.receiver)?;
        if ident == "self" {
            return None;
        }
        let opt = self.mut_borrow(&call.receiver);
        let ctx = &self.ctx;
        self.rewrites += 1;
        Some(parse_quote_spanned! {call.method.span()=>
            ::speedkit::__private::step(&#ctx, #opt)
        })
    }

    fn rewrite_stmt(&mut self, stmt: &mut Stmt) {
        let forward = match stmt_attrs_mut(stmt) {
            Some(attrs) => self.take_forward(attrs),
            None => None,
        };
        match stmt {
            Stmt::Local(local) => self.rewrite_local(local, forward),
            Stmt::Expr(expr, _) => {
                if let Some(attr) = forward {
                    let block = match expr {
                        Expr::Block(block) => Some(&mut block.block),
                        Expr::Unsafe(block) => Some(&mut block.block),
                        _ => None,
                    };
                    if let Some(block) = block {
                        self.visit_block_mut(block);
                        let guard = self.autocast_guard(attr.span());
                        block.stmts.insert(0, guard);
                    } else {
                        self.cx.error_spanned_by(
                            &attr,
                            format!(
                                "{PLACEMENT}: wrap the expression in a block, \
                                 `#[speedkit::forward] {{ ... }}`, or bind its value with \
                                 `#[speedkit::forward] let x = ...;`"
                            ),
                        );
                        self.visit_expr_mut(expr);
                    }
                    return;
                }
                if self.scope().after_backward {
                    if let Some(step) = self.rewrite_step(expr) {
                        *expr = step;
                        return;
                    }
                }
                let backward = self.is_tracked_backward(expr);
                self.visit_expr_mut(expr);
                if backward {
                    self.scope().after_backward = true;
                }
            }
            Stmt::Item(item) => {
                if let Some(attr) = forward {
                    self.cx.error_spanned_by(
                        &attr,
                        format!(
                            "{PLACEMENT}: an item (`fn`, `struct`, `use`, ...) runs no tensor \
                             code where it is declared"
                        ),
                    );
                }
                self.visit_item_mut(item);
            }
            Stmt::Macro(_) => {
                if let Some(attr) = forward {
                    self.cx.error_spanned_by(
                        &attr,
                        format!(
                            "{PLACEMENT}: a macro statement cannot be wrapped; put it in a block, \
                             `#[speedkit::forward] {{ mac!(...); }}`"
                        ),
                    );
                }
            }
        }
    }

    fn rewrite_local(&mut self, local: &mut Local, forward: Option<Attribute>) {
        // The initializer is evaluated before the new bindings exist.
        if let Some(init) = &mut local.init {
            self.visit_expr_mut(&mut init.expr);
            if let Some((_, diverge)) = &mut init.diverge {
                self.visit_expr_mut(diverge);
            }
        }
        self.shadow(&local.pat);
        let name = plain_ident(&local.pat);
        match (forward, &mut local.init) {
            (Some(attr), Some(init)) => {
                let guard = self.autocast_guard(attr.span());
                let expr = &init.expr;
                // `let PAT = { ... } else { ... }` is rejected by the parser: parenthesize.
                *init.expr = if init.diverge.is_some() {
                    parse_quote!(({ #guard #expr }))
                } else {
                    parse_quote!({ #guard #expr })
                };
                if let Some(name) = name {
                    self.scope().losses.insert(name);
                }
            }
            (Some(attr), None) => self.cx.error_spanned_by(
                &attr,
                format!(
                    "{PLACEMENT}: this `let` has no initializer; write \
                     `#[speedkit::forward] let x = ...;`"
                ),
            ),
            (None, init) => {
                let is_mut_ref = match (&local.pat, init) {
                    (Pat::Type(typed), _) => is_mut_ref(&typed.ty),
                    (_, Some(init)) => {
                        matches!(&*init.expr, Expr::Reference(r) if r.mutability.is_some())
                    }
                    _ => false,
                };
                if let (Some(name), true) = (name, is_mut_ref) {
                    self.scope().mut_refs.insert(name);
                }
            }
        }
    }

    fn visit_closure(&mut self, closure: &mut ExprClosure) -> bool {
        let before = self.rewrites;
        self.push_scope();
        for input in &closure.inputs {
            self.shadow(input);
        }
        self.visit_expr_mut(&mut closure.body);
        self.pop_scope();
        closure.capture.is_some() && self.rewrites > before
    }
}

impl VisitMut for BodyRewriter<'_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        self.push_scope();
        self.imported_forward.push(None);
        for stmt in &mut block.stmts {
            self.rewrite_stmt(stmt);
        }
        if let Some(Some(forward)) = self.imported_forward.pop() {
            // Spanned at the user's `forward`: without the import, "unresolved import" points
            // there, as it would for any attribute used without importing it.
            block.stmts.insert(
                0,
                parse_quote_spanned! {forward.span()=>
                    #[allow(unused_imports)]
                    use #forward as _;
                },
            );
        }
        self.pop_scope();
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        // Statements had their attribute taken already: one left here is on a sub-expression.
        if let Some(attrs) = expr_attrs_mut(expr) {
            if let Some(attr) = self.take_forward(attrs) {
                self.cx.error_spanned_by(
                    &attr,
                    format!(
                        "{PLACEMENT}, as a statement of its own, not on an expression inside \
                         another statement"
                    ),
                );
            }
        }
        match expr {
            Expr::MethodCall(call) => {
                self.visit_expr_mut(&mut call.receiver);
                for arg in &mut call.args {
                    self.visit_expr_mut(arg);
                }
                if let Some(rewritten) = self.rewrite_backward_step(call) {
                    *expr = rewritten;
                } else if self.is_tracked_backward(expr) {
                    if let Expr::MethodCall(call) = &*expr {
                        let loss = &call.receiver;
                        let ctx = &self.ctx;
                        let rewritten = parse_quote_spanned! {call.method.span()=>
                            ::speedkit::__private::backward(&#ctx, &#loss)
                        };
                        self.rewrites += 1;
                        *expr = rewritten;
                    }
                }
            }
            // The autocast guard must not be held across `.await`.
            Expr::Async(_) => NestedItems::new(self.cx, IN_ASYNC).visit_expr_mut(expr),
            Expr::Closure(closure) if closure.asyncness.is_some() => {
                NestedItems::new(self.cx, IN_ASYNC).visit_expr_mut(expr);
            }
            Expr::Closure(closure) => {
                if self.visit_closure(closure) {
                    // A `move` closure would move the context into itself; give it a reference.
                    let ctx = &self.ctx;
                    let closure = closure.clone();
                    *expr = parse_quote!({
                        let #ctx = &#ctx;
                        #closure
                    });
                }
            }
            Expr::ForLoop(for_loop) => {
                self.visit_expr_mut(&mut for_loop.expr);
                self.push_scope();
                self.shadow(&for_loop.pat);
                self.visit_block_mut(&mut for_loop.body);
                self.pop_scope();
            }
            Expr::Match(match_expr) => {
                self.visit_expr_mut(&mut match_expr.expr);
                for arm in &mut match_expr.arms {
                    self.push_scope();
                    self.shadow(&arm.pat);
                    if let Some((_, guard)) = &mut arm.guard {
                        self.visit_expr_mut(guard);
                    }
                    self.visit_expr_mut(&mut arm.body);
                    self.pop_scope();
                }
            }
            Expr::If(if_expr) => {
                // `if let PAT = ...` (also in `&&` chains) binds PAT in the then-branch only.
                self.visit_expr_mut(&mut if_expr.cond);
                self.push_scope();
                for pat in let_patterns(&if_expr.cond) {
                    self.shadow(pat);
                }
                self.visit_block_mut(&mut if_expr.then_branch);
                self.pop_scope();
                if let Some((_, else_branch)) = &mut if_expr.else_branch {
                    self.visit_expr_mut(else_branch);
                }
            }
            Expr::While(while_expr) => {
                self.visit_expr_mut(&mut while_expr.cond);
                self.push_scope();
                for pat in let_patterns(&while_expr.cond) {
                    self.shadow(pat);
                }
                self.visit_block_mut(&mut while_expr.body);
                self.pop_scope();
            }
            _ => visit_mut::visit_expr_mut(self, expr),
        }
    }

    fn visit_item_mut(&mut self, item: &mut Item) {
        // Items inside the body are not part of the accelerated function: no context there.
        NestedItems::new(self.cx, IN_NESTED_FN).visit_item_mut(item);
    }
}
