//! speedkit's attributes in syn's trees: recognising them, and taking `#[speedkit::forward]` off
//! a statement or expression.

use syn::{Attribute, Expr, Item, Meta, Stmt};

use crate::ctxt::Ctxt;

/// Whether `attr` is `#[speedkit::NAME]`, `#[::speedkit::NAME]` or `#[NAME]` (imported with
/// `use speedkit::NAME`).
pub(crate) fn is_speedkit_attr(attr: &Attribute, name: &str) -> bool {
    let segments: Vec<String> = attr
        .path()
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    match segments.as_slice() {
        [only] => attr.path().leading_colon.is_none() && only == name,
        [krate, last] => krate == "speedkit" && last == name,
        _ => false,
    }
}

/// Removes every `#[speedkit::forward]` from `attrs`, reporting arguments and repetitions, and
/// returns the first one.
pub(super) fn take_forward(attrs: &mut Vec<Attribute>, cx: &Ctxt) -> Option<Attribute> {
    let mut first: Option<Attribute> = None;
    attrs.retain(|attr| {
        if !is_speedkit_attr(attr, "forward") {
            return true;
        }
        if !matches!(attr.meta, Meta::Path(_)) {
            cx.error_spanned_by(
                attr,
                "#[speedkit::forward] takes no arguments: the autocast dtype comes from the \
                 speed config of the enclosing #[speedkit::accelerate]",
            );
        }
        if first.is_some() {
            cx.error_spanned_by(
                attr,
                "#[speedkit::forward] is given twice on this statement; remove one",
            );
        } else {
            first = Some(attr.clone());
        }
        false
    });
    first
}

/// The attributes of a statement, where it can have any.
pub(super) fn stmt_attrs_mut(stmt: &mut Stmt) -> Option<&mut Vec<Attribute>> {
    match stmt {
        Stmt::Local(local) => Some(&mut local.attrs),
        Stmt::Macro(mac) => Some(&mut mac.attrs),
        Stmt::Expr(expr, _) => expr_attrs_mut(expr),
        Stmt::Item(item) => item_attrs_mut(item),
    }
}

/// The attributes of an item, where it can have any.
fn item_attrs_mut(item: &mut Item) -> Option<&mut Vec<Attribute>> {
    Some(match item {
        Item::Const(i) => &mut i.attrs,
        Item::Enum(i) => &mut i.attrs,
        Item::ExternCrate(i) => &mut i.attrs,
        Item::Fn(i) => &mut i.attrs,
        Item::ForeignMod(i) => &mut i.attrs,
        Item::Impl(i) => &mut i.attrs,
        Item::Macro(i) => &mut i.attrs,
        Item::Mod(i) => &mut i.attrs,
        Item::Static(i) => &mut i.attrs,
        Item::Struct(i) => &mut i.attrs,
        Item::Trait(i) => &mut i.attrs,
        Item::TraitAlias(i) => &mut i.attrs,
        Item::Type(i) => &mut i.attrs,
        Item::Union(i) => &mut i.attrs,
        Item::Use(i) => &mut i.attrs,
        _ => return None,
    })
}

/// The attributes of an expression, where it can have any.
pub(super) fn expr_attrs_mut(expr: &mut Expr) -> Option<&mut Vec<Attribute>> {
    Some(match expr {
        Expr::Array(e) => &mut e.attrs,
        Expr::Assign(e) => &mut e.attrs,
        Expr::Async(e) => &mut e.attrs,
        Expr::Await(e) => &mut e.attrs,
        Expr::Binary(e) => &mut e.attrs,
        Expr::Block(e) => &mut e.attrs,
        Expr::Break(e) => &mut e.attrs,
        Expr::Call(e) => &mut e.attrs,
        Expr::Cast(e) => &mut e.attrs,
        Expr::Closure(e) => &mut e.attrs,
        Expr::Const(e) => &mut e.attrs,
        Expr::Continue(e) => &mut e.attrs,
        Expr::Field(e) => &mut e.attrs,
        Expr::ForLoop(e) => &mut e.attrs,
        Expr::Group(e) => &mut e.attrs,
        Expr::If(e) => &mut e.attrs,
        Expr::Index(e) => &mut e.attrs,
        Expr::Infer(e) => &mut e.attrs,
        Expr::Let(e) => &mut e.attrs,
        Expr::Lit(e) => &mut e.attrs,
        Expr::Loop(e) => &mut e.attrs,
        Expr::Macro(e) => &mut e.attrs,
        Expr::Match(e) => &mut e.attrs,
        Expr::MethodCall(e) => &mut e.attrs,
        Expr::Paren(e) => &mut e.attrs,
        Expr::Path(e) => &mut e.attrs,
        Expr::Range(e) => &mut e.attrs,
        Expr::Reference(e) => &mut e.attrs,
        Expr::Repeat(e) => &mut e.attrs,
        Expr::Return(e) => &mut e.attrs,
        Expr::Struct(e) => &mut e.attrs,
        Expr::Try(e) => &mut e.attrs,
        Expr::TryBlock(e) => &mut e.attrs,
        Expr::Tuple(e) => &mut e.attrs,
        Expr::Unary(e) => &mut e.attrs,
        Expr::Unsafe(e) => &mut e.attrs,
        Expr::While(e) => &mut e.attrs,
        Expr::Yield(e) => &mut e.attrs,
        _ => return None,
    })
}
