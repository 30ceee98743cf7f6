//! What expressions, patterns and types say about names, lexically: the body's rewriter tracks
//! losses and `&mut` optimizers by name.

use syn::{Expr, Pat, Type};

/// The single identifier of a path expression such as `loss` or `opt`.
pub(super) fn path_ident(expr: &Expr) -> Option<&proc_macro2::Ident> {
    match expr {
        Expr::Path(path) if path.qself.is_none() && path.attrs.is_empty() => path.path.get_ident(),
        _ => None,
    }
}

/// `NAME`, `mut NAME` or `NAME: Type` (not `ref NAME`, not `NAME @ ...`).
pub(super) fn plain_ident(pat: &Pat) -> Option<String> {
    match pat {
        Pat::Ident(ident) if ident.by_ref.is_none() && ident.subpat.is_none() => {
            Some(ident.ident.to_string())
        }
        Pat::Type(typed) => plain_ident(&typed.pat),
        _ => None,
    }
}

/// Whether `ty` is `&mut T` (parenthesised or not).
pub(super) fn is_mut_ref(ty: &Type) -> bool {
    match ty {
        Type::Reference(reference) => reference.mutability.is_some(),
        Type::Paren(paren) => is_mut_ref(&paren.elem),
        Type::Group(group) => is_mut_ref(&group.elem),
        _ => false,
    }
}

/// Every name a pattern binds.
pub(super) fn bound_names(pat: &Pat, out: &mut Vec<String>) {
    match pat {
        Pat::Ident(ident) => {
            out.push(ident.ident.to_string());
            if let Some((_, sub)) = &ident.subpat {
                bound_names(sub, out);
            }
        }
        Pat::Or(or) => or.cases.iter().for_each(|p| bound_names(p, out)),
        Pat::Paren(paren) => bound_names(&paren.pat, out),
        Pat::Reference(reference) => bound_names(&reference.pat, out),
        Pat::Slice(slice) => slice.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::Struct(strukt) => strukt
            .fields
            .iter()
            .for_each(|field| bound_names(&field.pat, out)),
        Pat::Tuple(tuple) => tuple.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::TupleStruct(tuple) => tuple.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::Type(typed) => bound_names(&typed.pat, out),
        _ => {}
    }
}

/// The patterns of the `let`s in an `if`/`while` condition (`let A = x && let B = y`).
pub(super) fn let_patterns(cond: &Expr) -> Vec<&Pat> {
    match cond {
        Expr::Let(expr_let) => vec![&*expr_let.pat],
        Expr::Binary(binary) if matches!(binary.op, syn::BinOp::And(_)) => {
            let mut pats = let_patterns(&binary.left);
            pats.extend(let_patterns(&binary.right));
            pats
        }
        Expr::Paren(paren) => let_patterns(&paren.expr),
        _ => Vec::new(),
    }
}
