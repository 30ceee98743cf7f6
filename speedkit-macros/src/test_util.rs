//! Helpers shared by the unit tests.

use proc_macro2::TokenStream;

/// The tokens as formatted Rust (they must form a file: items).
pub(crate) fn pretty(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens.clone()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(err) => panic!("expansion is not valid Rust ({err}):\n{tokens}"),
    }
}

/// The messages of every error in `result`, in order.
pub(crate) fn error_messages(result: syn::Result<()>) -> Vec<String> {
    match result {
        Ok(()) => panic!("expected errors, got none"),
        Err(err) => err.into_iter().map(|e| e.to_string()).collect(),
    }
}
