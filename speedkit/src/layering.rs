//! The layers' rule, checked: the bottom of the house (the global flags, the C ABI, graph capture,
//! memory accounting) knows nothing of the top (overrides, `nn`, the context, the plan, the
//! runner), so a change at the top never ripples down and no import circle runs through the bottom.
//! A test reads the sources, so the rule holds for code added later too.

use std::fs;
use std::path::{Path, PathBuf};

/// The modules at the bottom, as paths under `src/` (a file or a directory).
const BOTTOM: &[&str] = &["flags", "ffi", "graph.rs", "memory.rs"];

/// What the bottom must not name, as Rust paths written in code.
const TOP: &[&str] = &[
    "crate::overrides",
    "crate::nn",
    "crate::context",
    "crate::SpeedContext",
    "crate::plan",
    "crate::bench",
];

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files: Vec<PathBuf> = fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|entry| rust_files(&entry.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    files
}

/// `use crate::{a, b::c}` written out as `crate::a crate::b::c`, so grouped imports are checked
/// as single ones.
fn ungroup(code: &str) -> String {
    match code.split_once("crate::{") {
        Some((before, group)) => {
            let items = group.split(['}', ';']).next().unwrap_or("");
            let paths: Vec<String> = items
                .split(',')
                .map(|item| format!("crate::{}", item.trim()))
                .collect();
            format!("{before}{}", paths.join(" "))
        }
        None => code.to_owned(),
    }
}

/// Every `(file:line, path)` where a bottom module names a top one in code (comments, where doc
/// links may point anywhere, excluded).
fn upward_references() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in BOTTOM.iter().flat_map(|m| rust_files(&src.join(m))) {
        let text = fs::read_to_string(&file).unwrap_or_default();
        for (number, line) in text.lines().enumerate() {
            let code = ungroup(line.split("//").next().unwrap_or(""));
            for top in TOP.iter().filter(|top| code.contains(*top)) {
                let shown = file.strip_prefix(&src).unwrap_or(&file).display();
                found.push(format!("src/{shown}:{}: {top}", number + 1));
            }
        }
    }
    found
}

#[test]
fn the_bottom_layers_import_nothing_from_the_top() {
    let found = upward_references();
    assert!(
        found.is_empty(),
        "the bottom layers ({BOTTOM:?}) name the top:\n{}",
        found.join("\n")
    );
}

#[test]
fn grouped_imports_are_checked_one_by_one() {
    assert!(ungroup("use crate::{error, overrides::Value};").contains("crate::overrides"));
}

#[test]
fn the_check_sees_the_bottom_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for module in BOTTOM {
        assert!(
            !rust_files(&src.join(module)).is_empty(),
            "src/{module} has moved: update BOTTOM"
        );
    }
}
