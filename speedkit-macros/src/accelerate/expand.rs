//! Phase 4 of `#[speedkit::accelerate]`: the generated code.
//!
//! The function is emitted as written (attributes, visibility, generics, receiver, ...) with one
//! statement prepended to its body: the binding of the `SpeedContext`. Its `FlagGuard` restores
//! the flags when the binding drops — on `return`, `?`, falling off the end and panic unwinding
//! alike — so the body is *not* wrapped in a closure (which would change what `?`, `return` and
//! borrows mean).

use proc_macro2::{Ident, Literal, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::{parse_quote, ItemFn, Stmt};

use super::validate::{ConfigSource, SignatureInfo};

/// The `::speedkit::__private::ConfigSource` expression for `source`.
pub(crate) fn config_source(source: &ConfigSource) -> TokenStream {
    match source {
        ConfigSource::Default => quote!(::speedkit::__private::ConfigSource::Default),
        // `include_str!` embeds the very text validated now and makes cargo rebuild when the
        // file changes.
        // (`.json` files too: the runtime picks the parser by the path's extension.)
        ConfigSource::File(path) => {
            let path = raw_str(path);
            quote! {
                ::speedkit::__private::ConfigSource::Yaml {
                    path: #path,
                    text: ::core::include_str!(#path),
                }
            }
        }
        ConfigSource::Inline(json) => {
            let json = raw_str(json);
            quote!(::speedkit::__private::ConfigSource::Json(#json))
        }
    }
}

/// A raw string literal (`r#"{"precision":"bf16"}"#`), which reads better in `cargo expand` than
/// one full of `\"`; a plain literal where a raw one cannot hold the text.
fn raw_str(text: &str) -> Literal {
    let mut hashes = String::new();
    while text.contains(&format!("\"{hashes}")) {
        hashes.push('#');
    }
    if text.contains('\r') {
        // Raw strings cannot hold a bare carriage return.
        return Literal::string(text);
    }
    format!("r{hashes}\"{text}\"{hashes}")
        .parse()
        .unwrap_or_else(|_| Literal::string(text))
}

/// `func` (body already rewritten) with `let <ctx> = enter(...)` prepended to its body.
pub(crate) fn accelerated_fn(
    mut func: ItemFn,
    ctx: &Ident,
    source: TokenStream,
    sig: &SignatureInfo,
) -> TokenStream {
    let name = func.sig.ident.unraw().to_string();
    let enter: Stmt = match (sig.fallible, sig.var_stores.as_slice()) {
        (true, []) => {
            // Plain `?` converts `SpeedkitError` with `From` (anyhow, `Box<dyn Error>`, ...); a
            // conversion error points at the return type.
            let question = quote_spanned!(sig.output_span=> ?);
            parse_quote! {
                let #ctx = ::speedkit::__private::enter(#source, #name) #question;
            }
        }
        (false, []) => parse_quote! {
            let #ctx = ::speedkit::__private::enter_or_panic(#source, #name);
        },
        // The plan knows the model the VarStore arguments hold.
        (true, stores) => {
            let question = quote_spanned!(sig.output_span=> ?);
            parse_quote! {
                let #ctx = ::speedkit::__private::enter_for_models(
                    #source,
                    #name,
                    &[#(::speedkit::__private::var_store(&#stores)),*],
                ) #question;
            }
        }
        (false, stores) => parse_quote! {
            let #ctx = ::speedkit::__private::enter_for_models_or_panic(
                #source,
                #name,
                &[#(::speedkit::__private::var_store(&#stores)),*],
            );
        },
    };
    // Under a data-parallel launcher, each VarStore argument takes rank 0's parameters and has its
    // gradients averaged (nothing happens in a single process).
    let attach: Vec<Stmt> = sig
        .var_stores
        .iter()
        .map(|vs| {
            if sig.fallible {
                let question = quote_spanned!(sig.output_span=> ?);
                parse_quote!(::speedkit::__private::data_parallel(&#ctx, &#vs) #question;)
            } else {
                parse_quote!(::speedkit::__private::data_parallel_or_panic(&#ctx, &#vs);)
            }
        })
        .collect();
    for (i, stmt) in std::iter::once(enter).chain(attach).enumerate() {
        func.block.stmts.insert(i, stmt);
    }
    func.into_token_stream()
}

#[cfg(test)]
mod tests {
    use super::raw_str;

    #[test]
    fn raw_strings_get_enough_hashes() {
        assert_eq!(raw_str("/a/speed.yaml").to_string(), r#"r"/a/speed.yaml""#);
        assert_eq!(raw_str(r#"{"a":1}"#).to_string(), r##"r#"{"a":1}"#"##);
        assert_eq!(
            raw_str(r##"{"a":"x"#"}"##).to_string(),
            r###"r##"{"a":"x"#"}"##"###
        );
        assert_eq!(raw_str("a\rb").to_string(), r#""a\rb""#);
    }
}
