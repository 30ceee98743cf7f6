//! `#[speedkit::bench]`: registers a workload with the benchmark runner.
//!
//! Parse (attribute arguments and signature) → validate (names, sizes, shape of the function) →
//! expand (the function as written, plus a shim and an `inventory::submit!` of a
//! `speedkit::bench::Workload` in an anonymous `const _`), collecting every error first.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, FnArg, GenericParam, ItemFn, Lit, LitStr, Meta, ReturnType, Token};

use crate::accelerate::with_errors;
use crate::ctxt::{backticked_list, closest, Ctxt};

/// The arguments of `#[speedkit::bench(...)]`, in the order error messages list them.
const ARGUMENTS: [&str; 4] = ["name", "tags", "sizes", "cuda_only"];

/// The problem sizes a workload can support, as spelled in `sizes = [...]`.
const SIZES: [(&str, &str); 2] = [("tiny", "Tiny"), ("bench", "Bench")];

/// Parsed and validated arguments.
#[derive(Default)]
struct BenchArgs {
    name: Option<LitStr>,
    tags: Vec<LitStr>,
    /// Variant names of `speedkit::bench::Size`; `None` means all.
    sizes: Option<Vec<&'static str>>,
    cuda_only: bool,
}

/// The `#[speedkit::bench]` entry.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    with_errors(try_expand(args, item))
}

/// The expansion and the combined errors; on errors the function is emitted unregistered.
pub(crate) fn try_expand(args: TokenStream, item: TokenStream) -> (TokenStream, syn::Result<()>) {
    let Ok(func) = syn::parse2::<ItemFn>(item.clone()) else {
        let err = syn::Error::new(
            Span::call_site(),
            "#[speedkit::bench] goes on a function `fn NAME(b: &mut speedkit::bench::Bencher)`",
        );
        return (item, Err(err));
    };
    let cx = Ctxt::new();
    let args = parse_args(args, &cx);
    check_signature(&func, &cx);
    if cx.has_errors() {
        return (item, cx.check());
    }
    (registration(&func, &args), cx.check())
}

fn parse_args(tokens: TokenStream, cx: &Ctxt) -> BenchArgs {
    let mut args = BenchArgs::default();
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(metas) => metas,
        Err(err) => {
            cx.push(err);
            return args;
        }
    };
    let mut seen: Vec<String> = Vec::new();
    for meta in metas {
        let path = meta.path();
        let Some(key) = path.get_ident().map(|i| i.unraw().to_string()) else {
            cx.error_spanned_by(path, unknown_argument(&path.to_token_stream().to_string()));
            continue;
        };
        if !ARGUMENTS.contains(&key.as_str()) {
            cx.error_spanned_by(path, unknown_argument(&key));
            continue;
        }
        if seen.contains(&key) {
            cx.error_spanned_by(path, format!("`{key}` is given twice; remove one"));
            continue;
        }
        seen.push(key.clone());
        match key.as_str() {
            "cuda_only" => match &meta {
                Meta::Path(_) => args.cuda_only = true,
                Meta::NameValue(nv) => match &nv.value {
                    Expr::Lit(ExprLit {
                        lit: Lit::Bool(b), ..
                    }) => args.cuda_only = b.value,
                    other => cx.error_spanned_by(
                        other,
                        "`cuda_only` is a flag: write `cuda_only` (or `cuda_only = true`/`false`)",
                    ),
                },
                Meta::List(_) => cx.error_spanned_by(
                    &meta,
                    "`cuda_only` is a flag: write `cuda_only` (or `cuda_only = true`/`false`)",
                ),
            },
            "name" => {
                if let Some(name) = string_value(&meta, "name = \"linear3\"", cx) {
                    if name.value().trim().is_empty() {
                        cx.error_spanned_by(&name, "the workload name cannot be empty");
                    } else {
                        args.name = Some(name);
                    }
                }
            }
            "tags" => {
                if let Some(tags) = string_list(&meta, "tags = [\"matmul\", \"seed\"]", cx) {
                    for (i, tag) in tags.iter().enumerate() {
                        if tags[..i].iter().any(|t| t.value() == tag.value()) {
                            cx.error_spanned_by(
                                tag,
                                format!("tag `{}` is given twice; remove one", tag.value()),
                            );
                        }
                    }
                    args.tags = tags;
                }
            }
            _ => args.sizes = sizes(&meta, cx),
        }
    }
    args
}

fn unknown_argument(key: &str) -> String {
    let hint = closest(key, ARGUMENTS)
        .map(|c| format!("; did you mean `{c}`?"))
        .unwrap_or_default();
    format!(
        "unknown argument `{key}` for #[speedkit::bench]{hint} (valid arguments: {})",
        backticked_list(ARGUMENTS)
    )
}

/// `key = "literal"`.
fn string_value(meta: &Meta, example: &str, cx: &Ctxt) -> Option<LitStr> {
    if let Meta::NameValue(nv) = meta {
        if let Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) = &nv.value
        {
            return Some(s.clone());
        }
        cx.error_spanned_by(&nv.value, format!("expected a string literal: `{example}`"));
    } else {
        cx.error_spanned_by(meta, format!("expected `{example}`"));
    }
    None
}

/// `key = ["a", "b"]`, or a single `key = "a"`.
fn string_list(meta: &Meta, example: &str, cx: &Ctxt) -> Option<Vec<LitStr>> {
    let Meta::NameValue(nv) = meta else {
        cx.error_spanned_by(meta, format!("expected `{example}`"));
        return None;
    };
    let elems: Vec<&Expr> = match &nv.value {
        Expr::Array(array) => array.elems.iter().collect(),
        single @ Expr::Lit(_) => vec![single],
        other => {
            cx.error_spanned_by(
                other,
                format!("expected a list of string literals: `{example}`"),
            );
            return None;
        }
    };
    let mut out = Vec::new();
    for elem in elems {
        match elem {
            Expr::Lit(ExprLit {
                lit: Lit::Str(s), ..
            }) => out.push(s.clone()),
            other => cx.error_spanned_by(
                other,
                format!("expected a string literal, as in `{example}`"),
            ),
        }
    }
    Some(out)
}

/// `sizes = [...]`: known names, no repeats, not empty.
fn sizes(meta: &Meta, cx: &Ctxt) -> Option<Vec<&'static str>> {
    let list = string_list(meta, "sizes = [\"tiny\", \"bench\"]", cx)?;
    if list.is_empty() {
        cx.error_spanned_by(
            meta,
            "`sizes` cannot be empty: list the sizes the workload supports, or leave `sizes` out \
             to support both `tiny` and `bench`",
        );
        return None;
    }
    let mut variants = Vec::new();
    for lit in &list {
        let value = lit.value();
        match SIZES.iter().find(|(spelling, _)| *spelling == value) {
            Some((_, variant)) if variants.contains(variant) => {
                cx.error_spanned_by(lit, format!("size `{value}` is given twice; remove one"))
            }
            Some((_, variant)) => variants.push(*variant),
            None => {
                let hint = closest(&value, SIZES.iter().map(|(s, _)| *s))
                    .map(|c| format!("; did you mean `{c}`?"))
                    .unwrap_or_default();
                cx.error_spanned_by(
                    lit,
                    format!("unknown size `{value}`{hint} (the sizes are `tiny` and `bench`)"),
                );
            }
        }
    }
    Some(variants)
}

fn check_signature(func: &ItemFn, cx: &Ctxt) {
    let sig = &func.sig;
    if let Some(asyncness) = &sig.asyncness {
        cx.error_spanned_by(
            asyncness,
            "#[speedkit::bench] does not support `async fn`: the runner calls workloads \
             synchronously and times them with device syncs",
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        cx.error_spanned_by(
            unsafety,
            "#[speedkit::bench] cannot register an `unsafe fn`: the runner would call it without \
             upholding its contract; make it safe and use `unsafe` blocks inside",
        );
    }
    let generic = sig
        .generics
        .params
        .iter()
        .any(|p| !matches!(p, GenericParam::Lifetime(_)));
    if generic {
        cx.error_spanned_by(
            &sig.generics,
            "#[speedkit::bench] cannot register a generic function: the runner needs one concrete \
             function; add a non-generic workload that calls it with concrete types",
        );
    }
    if let Some(FnArg::Receiver(receiver)) = sig.inputs.first() {
        cx.error_spanned_by(
            receiver,
            "#[speedkit::bench] goes on a free function, not a method with `self`",
        );
    } else if sig.inputs.len() != 1 {
        let message = format!(
            "#[speedkit::bench] expects a function with exactly one parameter, \
             `b: &mut speedkit::bench::Bencher`; this one has {}",
            sig.inputs.len()
        );
        if sig.inputs.is_empty() {
            cx.error_spanned_by(&sig.ident, message);
        } else {
            cx.error_spanned_by(&sig.inputs, message);
        }
    }
}

/// The function, plus its shim and registration.
fn registration(func: &ItemFn, args: &BenchArgs) -> TokenStream {
    let ident = &func.sig.ident;
    let name = args
        .name
        .as_ref()
        .map_or_else(|| ident.unraw().to_string(), LitStr::value);
    let tags = args.tags.iter().map(LitStr::value);
    let sizes = args
        .sizes
        .clone()
        .unwrap_or_else(|| SIZES.iter().map(|(_, v)| *v).collect())
        .into_iter()
        .map(|variant| {
            let variant = Ident::new(variant, Span::call_site());
            quote!(::speedkit::bench::Size::#variant)
        });
    let cuda_only = args.cuda_only;
    let run = Ident::new("__sk_run", Span::mixed_site());
    // Type errors about the parameter or the return type point at the user's signature.
    let param_span = sig_param_span(func);
    let bencher = Ident::new("b", Span::mixed_site().located_at(param_span));
    let output_span = match &func.sig.output {
        ReturnType::Default => ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let into_result = quote_spanned!(output_span=> ::speedkit::__private::into_bench_result);
    quote! {
        #func

        const _: () = {
            fn #run(
                #bencher: &mut ::speedkit::bench::Bencher,
            ) -> ::core::result::Result<(), ::speedkit::bench::BenchError> {
                #into_result(#ident(#bencher))
            }

            ::speedkit::__private::inventory::submit! {
                ::speedkit::bench::Workload {
                    name: #name,
                    tags: &[#(#tags),*],
                    sizes: &[#(#sizes),*],
                    cuda_only: #cuda_only,
                    file: ::core::file!(),
                    line: ::core::line!(),
                    run: #run,
                }
            }
        };
    }
}

fn sig_param_span(func: &ItemFn) -> Span {
    match func.sig.inputs.first() {
        Some(FnArg::Typed(typed)) => typed.ty.span(),
        _ => func.sig.ident.span(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{error_messages, pretty};

    fn expand_ok(args: TokenStream, item: TokenStream) -> String {
        let (tokens, result) = try_expand(args, item);
        if let Err(err) = result {
            panic!("unexpected errors: {err}");
        }
        pretty(tokens)
    }

    fn expand_err(args: TokenStream, item: TokenStream) -> Vec<String> {
        let (_, result) = try_expand(args, item);
        error_messages(result)
    }

    #[test]
    fn bench_without_arguments() {
        let out = expand_ok(
            quote!(),
            quote! {
                fn matmul(b: &mut speedkit::bench::Bencher) -> anyhow::Result<()> {
                    b.iter(|| ())
                }
            },
        );
        assert_eq!(
            out,
            r#"fn matmul(b: &mut speedkit::bench::Bencher) -> anyhow::Result<()> {
    b.iter(|| ())
}
const _: () = {
    fn __sk_run(
        b: &mut ::speedkit::bench::Bencher,
    ) -> ::core::result::Result<(), ::speedkit::bench::BenchError> {
        ::speedkit::__private::into_bench_result(matmul(b))
    }
    ::speedkit::__private::inventory::submit! {
        ::speedkit::bench::Workload { name : "matmul", tags : & [], sizes : &
        [::speedkit::bench::Size::Tiny, ::speedkit::bench::Size::Bench], cuda_only :
        false, file : ::core::file!(), line : ::core::line!(), run : __sk_run, }
    }
};
"#
        );
    }

    #[test]
    fn bench_with_arguments() {
        let out = expand_ok(
            quote!(
                name = "linear3",
                tags = ["matmul", "seed"],
                sizes = ["tiny"],
                cuda_only
            ),
            quote! {
                pub fn r#linear(b: &mut Bencher) {}
            },
        );
        assert_eq!(
            out,
            r#"pub fn r#linear(b: &mut Bencher) {}
const _: () = {
    fn __sk_run(
        b: &mut ::speedkit::bench::Bencher,
    ) -> ::core::result::Result<(), ::speedkit::bench::BenchError> {
        ::speedkit::__private::into_bench_result(r#linear(b))
    }
    ::speedkit::__private::inventory::submit! {
        ::speedkit::bench::Workload { name : "linear3", tags : & ["matmul", "seed"],
        sizes : & [::speedkit::bench::Size::Tiny], cuda_only : true, file :
        ::core::file!(), line : ::core::line!(), run : __sk_run, }
    }
};
"#
        );
    }

    #[test]
    fn argument_errors_are_all_reported() {
        let errors = expand_err(
            quote!(
                nme = "x",
                tags = [1, "a", "a"],
                sizes = ["tiny", "big", "tiny"],
                cuda_only = "yes",
                name = NAME,
                tags = [],
            ),
            quote!(
                fn f(b: &mut Bencher) {}
            ),
        );
        assert_eq!(
            errors,
            [
                "unknown argument `nme` for #[speedkit::bench]; did you mean `name`? (valid \
                 arguments: `name`, `tags`, `sizes`, `cuda_only`)",
                "expected a string literal, as in `tags = [\"matmul\", \"seed\"]`",
                "tag `a` is given twice; remove one",
                "unknown size `big` (the sizes are `tiny` and `bench`)",
                "size `tiny` is given twice; remove one",
                "`cuda_only` is a flag: write `cuda_only` (or `cuda_only = true`/`false`)",
                "expected a string literal: `name = \"linear3\"`",
                "`tags` is given twice; remove one",
            ]
        );
    }

    #[test]
    fn empty_sizes_and_typo() {
        assert_eq!(
            expand_err(quote!(sizes = []), quote!(fn f(b: &mut Bencher) {})),
            ["`sizes` cannot be empty: list the sizes the workload supports, or leave `sizes` out \
              to support both `tiny` and `bench`"]
        );
        assert_eq!(
            expand_err(
                quote!(sizes = ["tine"]),
                quote!(
                    fn f(b: &mut Bencher) {}
                )
            ),
            ["unknown size `tine`; did you mean `tiny`? (the sizes are `tiny` and `bench`)"]
        );
    }

    #[test]
    fn signature_errors_are_all_reported() {
        let errors = expand_err(
            quote!(),
            quote!(
                async unsafe fn f<T>(b: &mut Bencher, n: T) {}
            ),
        );
        assert_eq!(errors.len(), 4, "{errors:#?}");
        assert!(errors[0].starts_with("#[speedkit::bench] does not support `async fn`"));
        assert!(errors[1].starts_with("#[speedkit::bench] cannot register an `unsafe fn`"));
        assert!(errors[2].starts_with("#[speedkit::bench] cannot register a generic function"));
        assert_eq!(
            errors[3],
            "#[speedkit::bench] expects a function with exactly one parameter, \
             `b: &mut speedkit::bench::Bencher`; this one has 2"
        );
        assert_eq!(
            expand_err(
                quote!(),
                quote!(
                    fn f(&mut self) {}
                )
            ),
            ["#[speedkit::bench] goes on a free function, not a method with `self`"]
        );
        assert_eq!(
            expand_err(
                quote!(),
                quote!(
                    fn f() {}
                )
            ),
            [
                "#[speedkit::bench] expects a function with exactly one parameter, \
              `b: &mut speedkit::bench::Bencher`; this one has 0"
            ]
        );
        assert_eq!(
            expand_err(
                quote!(),
                quote!(
                    struct S;
                )
            ),
            ["#[speedkit::bench] goes on a function `fn NAME(b: &mut speedkit::bench::Bencher)`"]
        );
    }

    #[test]
    fn lifetimes_are_fine() {
        let (_, result) = try_expand(
            quote!(),
            quote!(
                fn f<'a>(b: &'a mut Bencher) {}
            ),
        );
        assert!(result.is_ok());
    }

    #[test]
    fn errors_keep_the_function_unregistered() {
        let item = quote!(
            fn f(b: &mut Bencher) {}
        );
        let out = expand(quote!(sizes = []), item);
        let text = out.to_string();
        assert!(text.contains("compile_error"), "{text}");
        assert!(!text.contains("submit"), "{text}");
        assert!(text.contains("fn f"), "{text}");
    }
}
