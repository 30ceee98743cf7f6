//! Phase 1 of `#[speedkit::accelerate]`: the attribute's arguments, as syntax.
//!
//! `config = "file"` and `ctx = name` are the attribute's own arguments; every other `key = value`
//! or `group(key = value, ...)` is an inline speed-config key. Whether an inline key exists is not
//! decided here but by `speedkit-config` itself (see `validate.rs`), so the schema has exactly one
//! source of truth.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, ExprUnary, Ident, Lit, LitStr, Meta, Token, UnOp};

use crate::ctxt::Ctxt;

/// The parsed arguments of one `#[speedkit::accelerate(...)]`.
pub(crate) struct AccelerateArgs {
    /// `config = "path/to/speed.yaml"`.
    pub(crate) config: Option<ConfigArg>,
    /// `ctx = name`.
    pub(crate) ctx: Option<Ident>,
    /// Inline config keys, in source order.
    pub(crate) inline: Vec<InlineEntry>,
    /// All argument tokens, to point at the attribute as a whole.
    pub(crate) tokens: TokenStream,
}

/// `config = "..."`.
pub(crate) struct ConfigArg {
    /// The `config` key, to point at when the argument conflicts with others.
    pub(crate) key: Ident,
    /// The path as written (relative to `CARGO_MANIFEST_DIR`).
    pub(crate) path: LitStr,
}

/// One inline config key: `key = literal` or `key(nested, ...)`.
pub(crate) struct InlineEntry {
    /// The key as written.
    pub(crate) key: Ident,
    /// Its value.
    pub(crate) value: InlineValue,
    /// The whole `key = value` / `key(...)`, for errors about the entry.
    pub(crate) tokens: TokenStream,
}

/// The value of an inline key.
pub(crate) enum InlineValue {
    /// A literal, already written as JSON.
    Scalar(String),
    /// A nested group such as `cudnn(benchmark = true)`.
    Group(Vec<InlineEntry>),
}

/// Parses the attribute arguments; syntax problems are pushed to `cx` and the offending argument
/// is skipped, so that later phases still see (and check) the others.
pub(crate) fn parse(args: TokenStream, cx: &Ctxt) -> AccelerateArgs {
    let mut out = AccelerateArgs {
        config: None,
        ctx: None,
        inline: Vec::new(),
        tokens: args.clone(),
    };
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(args) {
        Ok(metas) => metas,
        Err(err) => {
            cx.push(err);
            return out;
        }
    };
    for meta in metas {
        let Some(key) = meta_key(&meta, cx) else {
            continue;
        };
        match key.to_string().as_str() {
            "config" => {
                if out.config.is_some() {
                    cx.error_spanned_by(&key, "`config` is given twice; remove one");
                } else if let Some(path) = config_path(&meta, cx) {
                    out.config = Some(ConfigArg { key, path });
                }
            }
            "ctx" => {
                if let Some(first) = &out.ctx {
                    cx.error_spanned_by(
                        &meta,
                        format!("`ctx` is given twice (first as `ctx = {first}`); remove one"),
                    );
                } else if let Some(name) = ctx_name(&meta, cx) {
                    out.ctx = Some(name);
                }
            }
            _ => push_inline(&mut out.inline, meta, key, cx),
        }
    }
    out
}

/// The single identifier naming an argument.
fn meta_key(meta: &Meta, cx: &Ctxt) -> Option<Ident> {
    let path = meta.path();
    match path.get_ident() {
        Some(ident) => Some(ident.clone()),
        None => {
            cx.error_spanned_by(
                path,
                "expected an argument name such as `config` or `precision`, not a path",
            );
            None
        }
    }
}

fn config_path(meta: &Meta, cx: &Ctxt) -> Option<LitStr> {
    const HINT: &str =
        "`config` takes a path relative to the crate's Cargo.toml: `config = \"speed.yaml\"`";
    match meta {
        Meta::NameValue(nv) => match &nv.value {
            Expr::Lit(ExprLit {
                lit: Lit::Str(path),
                ..
            }) => Some(path.clone()),
            other => {
                cx.error_spanned_by(other, HINT);
                None
            }
        },
        _ => {
            cx.error_spanned_by(meta, HINT);
            None
        }
    }
}

fn ctx_name(meta: &Meta, cx: &Ctxt) -> Option<Ident> {
    const HINT: &str =
        "`ctx` takes the name to bind the SpeedContext to, without quotes: `ctx = ctx`";
    if let Meta::NameValue(nv) = meta {
        if let Expr::Path(path) = &nv.value {
            if path.attrs.is_empty() && path.qself.is_none() {
                // `self`, `crate`, ... parse as paths but cannot be bound by `let`.
                if let Some(ident) = path.path.get_ident().filter(|i| {
                    !matches!(i.to_string().as_str(), "self" | "Self" | "super" | "crate")
                }) {
                    return Some(ident.clone());
                }
            }
        }
        cx.error_spanned_by(&nv.value, HINT);
    } else {
        cx.error_spanned_by(meta, HINT);
    }
    None
}

/// Adds `meta` as an inline entry unless it is malformed or repeats a key of `entries`.
fn push_inline(entries: &mut Vec<InlineEntry>, meta: Meta, key: Ident, cx: &Ctxt) {
    if entries.iter().any(|e| e.key == key) {
        cx.error_spanned_by(&key, format!("`{key}` is given twice; remove one"));
        return;
    }
    let tokens = meta.to_token_stream();
    let value = match meta {
        Meta::Path(_) => {
            cx.error_spanned_by(
                &key,
                format!("`{key}` needs a value, e.g. `{key} = true`, `{key} = \"auto\"` or `{key}(...)` for a group"),
            );
            return;
        }
        Meta::NameValue(nv) => match json_scalar(&nv.value) {
            Some(json) => InlineValue::Scalar(json),
            None => {
                cx.error_spanned_by(
                    &nv.value,
                    format!(
                        "the value of `{key}` must be a literal: a string, `true`/`false` or a number \
                         (it is checked at compile time)"
                    ),
                );
                return;
            }
        },
        Meta::List(list) => {
            match list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated) {
                Ok(nested) => {
                    let mut group = Vec::new();
                    for meta in nested {
                        if let Some(key) = meta_key(&meta, cx) {
                            push_inline(&mut group, meta, key, cx);
                        }
                    }
                    InlineValue::Group(group)
                }
                Err(err) => {
                    cx.push(err);
                    return;
                }
            }
        }
    };
    entries.push(InlineEntry { key, value, tokens });
}

/// The JSON text of a literal value, or `None` for anything that is not a plain literal.
fn json_scalar(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Lit(ExprLit { lit, attrs }) if attrs.is_empty() => match lit {
            Lit::Str(s) => Some(json_string(&s.value())),
            Lit::Bool(b) => Some(b.value.to_string()),
            Lit::Int(i) => Some(i.base10_digits().to_owned()),
            Lit::Float(f) => Some(json_float(f.base10_digits())),
            _ => None,
        },
        // Negative numbers are a unary minus applied to a literal.
        Expr::Unary(ExprUnary {
            op: UnOp::Neg(_),
            expr,
            attrs,
        }) if attrs.is_empty() => match &**expr {
            Expr::Lit(ExprLit {
                lit: Lit::Int(i), ..
            }) => Some(format!("-{}", i.base10_digits())),
            Expr::Lit(ExprLit {
                lit: Lit::Float(f), ..
            }) => Some(format!("-{}", json_float(f.base10_digits()))),
            _ => None,
        },
        Expr::Group(group) => json_scalar(&group.expr),
        _ => None,
    }
}

/// Rust allows `1.` and `1e3`; JSON wants a digit after the point.
fn json_float(digits: &str) -> String {
    match digits.find(['e', 'E']) {
        Some(exp) if digits[..exp].ends_with('.') => {
            format!("{}0{}", &digits[..exp], &digits[exp..])
        }
        None if digits.ends_with('.') => format!("{digits}0"),
        _ => digits.to_owned(),
    }
}

/// A JSON string literal.
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The compact JSON object of `entries` (whose dotted path starts with `prefix`), leaving out the
/// keys whose dotted paths are in `skip`: `{"precision":"bf16","cudnn":{"benchmark":true}}`.
pub(crate) fn json_object(entries: &[InlineEntry], prefix: &str, skip: &[String]) -> String {
    let mut members = Vec::new();
    for entry in entries {
        let path = dotted(prefix, &entry.key.to_string());
        if skip.contains(&path) {
            continue;
        }
        let value = match &entry.value {
            InlineValue::Scalar(json) => json.clone(),
            InlineValue::Group(children) => json_object(children, &path, skip),
        };
        members.push(format!("{}:{value}", json_string(&entry.key.to_string())));
    }
    format!("{{{}}}", members.join(","))
}

/// `prefix.key`, or `key` at the top level.
pub(crate) fn dotted(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse_ok(tokens: TokenStream) -> AccelerateArgs {
        let cx = Ctxt::new();
        let args = parse(tokens, &cx);
        if let Err(err) = cx.check() {
            panic!("unexpected errors: {err}");
        }
        args
    }

    fn parse_err(tokens: TokenStream) -> Vec<String> {
        let cx = Ctxt::new();
        let _ = parse(tokens, &cx);
        cx.check()
            .expect_err("expected errors")
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn empty_arguments() {
        let args = parse_ok(quote!());
        assert!(args.config.is_none() && args.ctx.is_none() && args.inline.is_empty());
    }

    #[test]
    fn config_and_ctx() {
        let args = parse_ok(quote!(config = "speed.yaml", ctx = my_ctx));
        assert_eq!(
            args.config.map(|c| c.path.value()).as_deref(),
            Some("speed.yaml")
        );
        assert_eq!(args.ctx.map(|c| c.to_string()).as_deref(), Some("my_ctx"));
    }

    #[test]
    fn inline_keys_become_json() {
        let args = parse_ok(quote!(
            precision = "bf16",
            deterministic = true,
            cudnn(benchmark = true, allow_tf32 = "auto"),
            grad_scaler(
                init_scale = 1024.0,
                growth_interval = 0x10,
                backoff_factor = -1.
            ),
        ));
        assert_eq!(
            json_object(&args.inline, "", &[]),
            r#"{"precision":"bf16","deterministic":true,"cudnn":{"benchmark":true,"allow_tf32":"auto"},"grad_scaler":{"init_scale":1024.0,"growth_interval":16,"backoff_factor":-1.0}}"#
        );
    }

    #[test]
    fn skipped_keys_are_left_out() {
        let args = parse_ok(quote!(
            precision = "x",
            cudnn(benchmark = true, enabled = true)
        ));
        let skip = ["precision".to_owned(), "cudnn.enabled".to_owned()];
        assert_eq!(
            json_object(&args.inline, "", &skip),
            r#"{"cudnn":{"benchmark":true}}"#
        );
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
        assert_eq!(json_float("1.e3"), "1.0e3");
        assert_eq!(json_float("2e-3"), "2e-3");
    }

    #[test]
    fn syntax_errors_are_all_reported() {
        let errors = parse_err(quote!(
            config = speed_yaml,
            ctx = "ctx",
            ctx = self,
            precision = some_const,
            deterministic,
            a::b = 1,
            cudnn(benchmark = true, benchmark = false),
            device = "cpu",
            device = "cuda",
        ));
        assert_eq!(
            errors,
            [
                "`config` takes a path relative to the crate's Cargo.toml: `config = \"speed.yaml\"`",
                "`ctx` takes the name to bind the SpeedContext to, without quotes: `ctx = ctx`",
                "`ctx` takes the name to bind the SpeedContext to, without quotes: `ctx = ctx`",
                "the value of `precision` must be a literal: a string, `true`/`false` or a number (it is checked at compile time)",
                "`deterministic` needs a value, e.g. `deterministic = true`, `deterministic = \"auto\"` or `deterministic(...)` for a group",
                "expected an argument name such as `config` or `precision`, not a path",
                "`benchmark` is given twice; remove one",
                "`device` is given twice; remove one",
            ]
        );
    }

    #[test]
    fn repeated_config_and_ctx() {
        let errors = parse_err(quote!(
            config = "a.yaml",
            ctx = a,
            config = "b.yaml",
            ctx = b
        ));
        assert_eq!(
            errors,
            [
                "`config` is given twice; remove one",
                "`ctx` is given twice (first as `ctx = a`); remove one",
            ]
        );
    }
}
