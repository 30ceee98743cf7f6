//! Phase 2 of `#[speedkit::accelerate]`: checks the function's signature and the speed config.
//!
//! The config — a file or inline keys — is parsed and validated at compile time by
//! `speedkit_config::SpeedConfig`, the same code the runtime parses it with, so a config that
//! compiles cannot fail to load (unknown keys, bad values and broken rules are compile errors).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use proc_macro2::{Span, TokenStream};
use speedkit_config::{ConfigError, SpeedConfig};
use syn::spanned::Spanned;
use syn::{LitStr, ReturnType, Signature, Type};

use super::args::{dotted, json_object, json_string, AccelerateArgs, InlineEntry, InlineValue};
use crate::ctxt::{backticked_list, closest, Ctxt};

/// What the signature tells the expansion.
pub(crate) struct SignatureInfo {
    /// The function returns a `Result`, so entering can fail with `?` instead of panicking.
    pub(crate) fallible: bool,
    /// Where to point "`?` couldn't convert the error" at: the return type.
    pub(crate) output_span: Span,
    /// Arguments whose type is a `VarStore` (by value or reference): under a data-parallel
    /// launcher their parameters are synchronised and their gradients averaged.
    pub(crate) var_stores: Vec<syn::Ident>,
}

/// Rejects signatures the flag guard cannot work with (`async fn`, `const fn`).
pub(crate) fn signature(sig: &Signature, cx: &Ctxt) -> SignatureInfo {
    if let Some(asyncness) = &sig.asyncness {
        cx.error_spanned_by(
            asyncness,
            "#[speedkit::accelerate] does not support `async fn`: PyTorch's speed flags are \
             process-global and the guard that restores them must not be held across `.await`; \
             accelerate a synchronous function and call it (e.g. from `spawn_blocking`)",
        );
    }
    if let Some(constness) = &sig.constness {
        cx.error_spanned_by(
            constness,
            "#[speedkit::accelerate] cannot go on a `const fn`: it sets PyTorch flags when the \
             function runs, which cannot happen at compile time; remove `const`",
        );
    }
    let (fallible, output_span) = match &sig.output {
        ReturnType::Default => (false, sig.ident.span()),
        ReturnType::Type(_, ty) => (is_result(ty), ty.span()),
    };
    let var_stores = sig
        .inputs
        .iter()
        .filter_map(|arg| match arg {
            syn::FnArg::Typed(pat) => match (&*pat.pat, is_var_store(&pat.ty)) {
                (syn::Pat::Ident(id), true) => Some(id.ident.clone()),
                _ => None,
            },
            syn::FnArg::Receiver(_) => None,
        })
        .collect();
    SignatureInfo {
        fallible,
        output_span,
        var_stores,
    }
}

/// `VarStore`, `nn::VarStore`, `&tch::nn::VarStore`, `&mut VarStore` (by the last path segment).
fn is_var_store(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) => is_var_store(&r.elem),
        Type::Path(path) => path
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident == "VarStore"),
        _ => false,
    }
}

/// Syntactically a `Result`: the last path segment is `Result` (`Result<T, E>`,
/// `anyhow::Result<T>`, `io::Result<()>`, ...). Type aliases with other names are not seen
/// through; such functions get the panicking entry.
fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Path(path) => path
            .path
            .segments
            .last()
            .is_some_and(|segment| segment.ident == "Result"),
        Type::Group(group) => is_result(&group.elem),
        Type::Paren(paren) => is_result(&paren.elem),
        _ => false,
    }
}

/// Where the function's speed config comes from, validated.
#[derive(Debug, PartialEq)]
pub(crate) enum ConfigSource {
    /// No arguments: the defaults (`auto` everywhere).
    Default,
    /// `config = "..."`, by absolute path (a path ending in `.json` is JSON, anything else YAML,
    /// the rule the runtime's `ConfigSource::Yaml` also follows).
    File(String),
    /// Inline keys, as compact JSON.
    Inline(String),
}

/// Resolves and validates the config named by `args`. On errors (pushed to `cx`) the result is
/// [`ConfigSource::Default`], so that the best-effort expansion still compiles.
pub(crate) fn config_source(
    args: &AccelerateArgs,
    manifest_dir: Option<&Path>,
    cx: &Ctxt,
) -> ConfigSource {
    match (&args.config, args.inline.as_slice()) {
        (None, []) => ConfigSource::Default,
        (Some(config), []) => match manifest_dir {
            Some(dir) => load_config_file(&config.path, dir).unwrap_or_else(|err| {
                cx.push(err);
                ConfigSource::Default
            }),
            None => {
                cx.error_spanned_by(
                    &config.path,
                    "cannot resolve the config path: CARGO_MANIFEST_DIR is not set (build with cargo)",
                );
                ConfigSource::Default
            }
        },
        (Some(config), [first, ..]) => {
            cx.error_spanned_by(
                &config.key,
                format!(
                    "choose one: `config = \"...\"` or inline keys (`{}` ...), not both; \
                     move the inline keys into the config file",
                    first.key
                ),
            );
            ConfigSource::Default
        }
        (None, entries) => check_inline(entries, &args.tokens, cx)
            .map_or(ConfigSource::Default, ConfigSource::Inline),
    }
}

/// Reads `config = "<lit>"` relative to `manifest_dir` and validates it: a path ending in `.json`
/// with `SpeedConfig::from_json_str`, anything else with `from_yaml_str`, as the runtime will.
/// Errors point at `lit`.
pub(crate) fn load_config_file(lit: &LitStr, manifest_dir: &Path) -> syn::Result<ConfigSource> {
    let path: PathBuf = manifest_dir.join(lit.value());
    let shown = path.display();
    let text = fs::read_to_string(&path).map_err(|err| {
        let message = match err.kind() {
            io::ErrorKind::NotFound => format!(
                "speed config file not found: `{shown}` (the path is relative to the directory of \
                 the crate's Cargo.toml, `{}`)",
                manifest_dir.display()
            ),
            _ => format!("cannot read speed config `{shown}`: {err}"),
        };
        syn::Error::new(lit.span(), message)
    })?;
    // The path is embedded in a string literal (for `include_str!`), so it must be UTF-8.
    let Some(abs) = path.to_str() else {
        return Err(syn::Error::new(
            lit.span(),
            format!("the speed config path `{shown}` is not valid UTF-8"),
        ));
    };
    let parsed = if abs.ends_with(".json") {
        SpeedConfig::from_json_str(&text)
    } else {
        SpeedConfig::from_yaml_str(&text)
    };
    match parsed {
        Ok(_) => Ok(ConfigSource::File(abs.to_owned())),
        Err(err) => Err(syn::Error::new(
            lit.span(),
            format!("invalid speed config `{shown}`: {err}"),
        )),
    }
}

/// The attribute's own arguments, listed in "unknown argument" errors before the config keys.
const OWN_ARGUMENTS: [&str; 2] = ["config", "ctx"];

/// Validates inline keys and returns their compact JSON, or `None` after pushing errors.
///
/// Each key is first parsed on its own (`{"cudnn":{"benchmark":true}}`), so that every unknown key
/// and bad value is reported at once and at its own span, not only the first one serde stops at;
/// then the whole object is parsed, which also checks the rules between keys.
///
/// When some keys are rejected on their own, the whole-object check still runs on the others, so
/// that a broken rule among them is reported in the same build. Leaving keys out only moves the
/// config towards the defaults, which satisfy every rule, so in practice this adds no spurious
/// errors.
fn check_inline(entries: &[InlineEntry], attr: &TokenStream, cx: &Ctxt) -> Option<String> {
    let mut rejected = Vec::new();
    check_entries(&mut Vec::new(), entries, cx, &mut rejected);
    let accepted = json_object(entries, "", &rejected);
    let whole = SpeedConfig::from_json_str(&accepted);
    if let Err(err) = &whole {
        report_whole(err, entries, attr, cx);
    }
    (rejected.is_empty() && whole.is_ok()).then_some(accepted)
}

/// Checks each key of `entries` (below the keys of `chain`) on its own, adding the dotted paths
/// of rejected keys to `rejected`; a group is checked as an empty group first, and its keys only
/// if the group itself is accepted.
fn check_entries<'a>(
    chain: &mut Vec<&'a InlineEntry>,
    entries: &'a [InlineEntry],
    cx: &Ctxt,
    rejected: &mut Vec<String>,
) {
    for entry in entries {
        chain.push(entry);
        let leaf = match &entry.value {
            InlineValue::Scalar(json) => json.clone(),
            InlineValue::Group(_) => "{}".to_owned(),
        };
        let json = chain.iter().rev().fold(leaf, |inner, e| {
            format!("{{{}:{inner}}}", json_string(&e.key.to_string()))
        });
        match SpeedConfig::from_json_str(&json) {
            // A lone key may break a rule that involves other keys' defaults; the whole object
            // is checked for those afterwards, so only per-key problems count here.
            Ok(_) | Err(ConfigError::Invalid { .. }) => {
                if let InlineValue::Group(children) = &entry.value {
                    check_entries(chain, children, cx, rejected);
                }
            }
            Err(err) => {
                let path = chain
                    .iter()
                    .fold(String::new(), |p, e| dotted(&p, &e.key.to_string()));
                rejected.push(path);
                report_entry(&err, chain, cx);
            }
        }
        chain.pop();
    }
}

/// Reports an error of a single-key check at the entry of `chain` its path names.
fn report_entry(err: &ConfigError, chain: &[&InlineEntry], cx: &Ctxt) {
    let path = error_path(err).unwrap_or_default();
    if let ConfigError::UnknownKey { expected, .. } = err {
        if chain.len() == 1 {
            // A top-level key is an argument of the attribute: list `config` and `ctx` too.
            let key = &chain[0].key;
            let name = key.to_string();
            let all = OWN_ARGUMENTS
                .iter()
                .copied()
                .chain(expected.iter().map(String::as_str));
            let hint = closest(&name, all)
                .map(|c| format!("; did you mean `{c}`?"))
                .unwrap_or_default();
            cx.error_spanned_by(
                key,
                format!(
                    "unknown argument `{name}` for #[speedkit::accelerate]{hint} (valid arguments: \
                     {}, and the speed config keys {})",
                    backticked_list(OWN_ARGUMENTS),
                    backticked_list(expected.iter().map(String::as_str)),
                ),
            );
            return;
        }
    }
    // The deepest entry whose dotted path is the error's path or a prefix of it.
    let mut target = chain[chain.len() - 1];
    let mut prefix = String::new();
    for entry in chain {
        prefix = dotted(&prefix, &entry.key.to_string());
        if path == prefix || path.starts_with(&format!("{prefix}.")) {
            target = entry;
        }
    }
    let spanned: &dyn quote::ToTokens = match err {
        // An unknown key is about the key itself, not its value.
        ConfigError::UnknownKey { .. } => &target.key,
        _ => &target.tokens,
    };
    cx.error_spanned_by(spanned, without_location(err));
}

/// Reports an error of the whole-object check, one error per broken rule.
fn report_whole(err: &ConfigError, entries: &[InlineEntry], attr: &TokenStream, cx: &Ctxt) {
    let target = |path: &str| -> TokenStream {
        find_entry(entries, path).map_or_else(|| attr.clone(), |e| e.tokens.clone())
    };
    match err {
        ConfigError::Invalid { problems } => {
            for problem in problems {
                cx.error_spanned_by(
                    target(&problem.path),
                    format!("invalid speed config: {problem}"),
                );
            }
        }
        other => cx.error_spanned_by(
            target(&error_path(other).unwrap_or_default()),
            without_location(other),
        ),
    }
}

/// The entry for a dotted path, or the deepest group on the way to it.
fn find_entry<'a>(entries: &'a [InlineEntry], path: &str) -> Option<&'a InlineEntry> {
    let (head, rest) = match path.split_once('.') {
        Some((head, rest)) => (head, Some(rest)),
        None => (path, None),
    };
    let entry = entries.iter().find(|e| e.key == head)?;
    match (&entry.value, rest) {
        (InlineValue::Group(children), Some(rest)) => find_entry(children, rest).or(Some(entry)),
        _ => Some(entry),
    }
}

/// The dotted key path an error is about, when it has one.
fn error_path(err: &ConfigError) -> Option<String> {
    match err {
        ConfigError::UnknownKey { path, .. }
        | ConfigError::BadValue { path, .. }
        | ConfigError::WrongType { path, .. } => Some(path.clone()),
        ConfigError::Invalid { problems } => problems.first().map(|p| p.path.clone()),
        _ => None,
    }
}

/// The error's message without its location: for inline keys the location is in JSON text the
/// user never wrote; the span says where the key is.
fn without_location(err: &ConfigError) -> String {
    let message = err.to_string();
    match err.location() {
        Some(location) => message.replacen(&format!(" at {location}"), "", 1),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accelerate::args;
    use quote::quote;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
    }

    fn lit(s: &str) -> LitStr {
        LitStr::new(s, Span::call_site())
    }

    fn inline(tokens: TokenStream) -> Result<ConfigSource, Vec<String>> {
        let cx = Ctxt::new();
        let parsed = args::parse(tokens, &cx);
        let source = config_source(&parsed, Some(&fixtures()), &cx);
        match cx.check() {
            Ok(()) => Ok(source),
            Err(err) => Err(err.into_iter().map(|e| e.to_string()).collect()),
        }
    }

    #[test]
    fn loads_valid_yaml_file() {
        let source = load_config_file(&lit("speed.yaml"), &fixtures()).unwrap();
        let expected = fixtures().join("speed.yaml");
        assert_eq!(
            source,
            ConfigSource::File(expected.to_str().unwrap().to_owned())
        );
    }

    #[test]
    fn loads_valid_json_file() {
        let source = load_config_file(&lit("speed.json"), &fixtures()).unwrap();
        let expected = fixtures().join("speed.json");
        assert_eq!(
            source,
            ConfigSource::File(expected.to_str().unwrap().to_owned())
        );
    }

    #[test]
    fn missing_file_names_the_full_path() {
        let err = load_config_file(&lit("nope.yaml"), &fixtures()).unwrap_err();
        let full = fixtures().join("nope.yaml");
        assert_eq!(
            err.to_string(),
            format!(
                "speed config file not found: `{}` (the path is relative to the directory of the \
                 crate's Cargo.toml, `{}`)",
                full.display(),
                fixtures().display()
            )
        );
    }

    #[test]
    fn unknown_key_in_file_has_location_and_suggestion() {
        let err = load_config_file(&lit("bad_key.yaml"), &fixtures()).unwrap_err();
        let full = fixtures().join("bad_key.yaml");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("invalid speed config `{}`: ", full.display())),
            "{message}"
        );
        assert!(message.contains("`cudnn.benchmrk`"), "{message}");
        assert!(message.contains("line 3, column 3"), "{message}");
        assert!(message.contains("did you mean `benchmark`?"), "{message}");
    }

    #[test]
    fn bad_value_in_file() {
        let err = load_config_file(&lit("bad_value.yaml"), &fixtures()).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("bad value `bf61` for `precision` at line 1"),
            "{message}"
        );
        assert!(message.contains("did you mean `bf16`?"), "{message}");
    }

    #[test]
    fn no_arguments_is_default() {
        assert_eq!(inline(quote!()), Ok(ConfigSource::Default));
        assert_eq!(inline(quote!(ctx = ctx)), Ok(ConfigSource::Default));
    }

    #[test]
    fn inline_keys_are_validated_json() {
        assert_eq!(
            inline(quote!(
                precision = "bf16",
                cudnn(benchmark = true),
                optimizer(fused = true)
            )),
            Ok(ConfigSource::Inline(
                r#"{"precision":"bf16","cudnn":{"benchmark":true},"optimizer":{"fused":true}}"#
                    .to_owned()
            ))
        );
    }

    #[test]
    fn config_file_and_inline_keys_conflict() {
        assert_eq!(
            inline(quote!(config = "speed.yaml", precision = "bf16")),
            Err(vec![
                "choose one: `config = \"...\"` or inline keys (`precision` ...), not both; move \
                 the inline keys into the config file"
                    .to_owned()
            ])
        );
    }

    #[test]
    fn every_inline_problem_is_reported() {
        let errors = inline(quote!(
            precison = "bf16",
            device = "gpu",
            cudnn(benchmrk = true, allow_tf32 = "sometimes"),
            compile = true,
        ))
        .unwrap_err();
        assert_eq!(errors.len(), 5, "{errors:#?}");
        assert!(
            errors[0].starts_with(
                "unknown argument `precison` for #[speedkit::accelerate]; did you mean \
                 `precision`? (valid arguments: `config`, `ctx`, and the speed config keys "
            ),
            "{}",
            errors[0]
        );
        assert!(
            errors[0].contains("`tf32_matmul_precision`"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].starts_with("bad value `gpu` for `device`"),
            "{}",
            errors[1]
        );
        assert!(
            errors[2].starts_with("unknown key `cudnn.benchmrk`; did you mean `benchmark`?"),
            "{}",
            errors[2]
        );
        assert!(
            errors[3].starts_with("bad value `sometimes` for `cudnn.allow_tf32`"),
            "{}",
            errors[3]
        );
        assert!(
            errors[4].starts_with("wrong type for `compile`"),
            "{}",
            errors[4]
        );
        assert!(
            errors.iter().all(|e| !e.contains(" at line ")),
            "{errors:#?}"
        );
    }

    #[test]
    fn broken_rules_are_reported_with_rejected_keys() {
        let errors =
            inline(quote!(precision = "bf61", grad_scaler(init_scale = -1.0))).unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:#?}");
        assert!(
            errors[0].starts_with("bad value `bf61` for `precision`"),
            "{}",
            errors[0]
        );
        assert_eq!(
            errors[1],
            "invalid speed config: `grad_scaler.init_scale`: is -1.0, but it must be a finite \
             number > 0 (default 65536.0 = 2^16)"
        );
    }

    #[test]
    fn rules_between_keys_point_at_the_key_they_name() {
        let cx = Ctxt::new();
        let parsed = args::parse(quote!(deterministic = true, cudnn(benchmark = true)), &cx);
        assert_eq!(config_source(&parsed, None, &cx), ConfigSource::Default);
        let err = cx.check().unwrap_err();
        assert!(
            err.to_string().starts_with(
                "invalid speed config: `cudnn.benchmark`: is true while `deterministic` is true"
            ),
            "{err}"
        );
        // (Its span, that of `benchmark = true`, is checked by the UI tests: spans made outside
        // a macro expansion cannot be compared.)
    }

    #[test]
    fn unknown_argument_without_close_match() {
        let errors = inline(quote!(learning_rate = 0.1)).unwrap_err();
        assert!(
            errors[0].starts_with(
                "unknown argument `learning_rate` for #[speedkit::accelerate] (valid arguments:"
            ),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn return_types() {
        let cx = Ctxt::new();
        for (sig, fallible) in [
            (quote!(fn f()), false),
            (quote!(fn f() -> Result<(), E>), true),
            (quote!(fn f() -> anyhow::Result<()>), true),
            (quote!(fn f() -> std::io::Result<u8>), true),
            (quote!(fn f() -> Option<()>), false),
            (quote!(fn f() -> impl Iterator<Item = u8>), false),
        ] {
            let sig: Signature = syn::parse2(sig).unwrap();
            assert_eq!(signature(&sig, &cx).fallible, fallible, "{}", quote!(#sig));
        }
        cx.check().unwrap();
    }

    #[test]
    fn async_and_const_are_rejected() {
        let cx = Ctxt::new();
        let sig: Signature = syn::parse2(quote!(async fn f())).unwrap();
        signature(&sig, &cx);
        let sig: Signature = syn::parse2(quote!(const fn f())).unwrap();
        signature(&sig, &cx);
        let errors: Vec<String> = cx
            .check()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert!(errors[0].starts_with("#[speedkit::accelerate] does not support `async fn`"));
        assert!(errors[1].starts_with("#[speedkit::accelerate] cannot go on a `const fn`"));
    }
}
