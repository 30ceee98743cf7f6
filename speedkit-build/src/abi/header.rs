//! The header's lines into statements: `// @module` sections, `///` docs, C++-only blocks skipped,
//! and a declaration that spans several lines joined into one.

use super::declarations::{AbiError, Module};
use super::statement::{is_identifier, parse_statement};

/// Reads the header's modules and declarations.
///
/// ```
/// let modules = speedkit_build::abi::parse("// @module nvtx: ranges\nvoid sk_nvtx_pop(void);\n")?;
/// assert_eq!(modules[0].name, "nvtx");
/// # Ok::<(), speedkit_build::abi::AbiError>(())
/// ```
pub fn parse(header: &str) -> Result<Vec<Module>, AbiError> {
    let mut modules: Vec<Module> = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    let mut statement = String::new();
    let mut statement_line = 0;
    let mut conditions = Conditions::default();
    for (index, raw) in header.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.trim();
        if conditions.skips(line) {
            continue;
        }
        if statement.is_empty() {
            if let Some(rest) = line.strip_prefix("// @module ") {
                let (name, summary) = rest.split_once(':').unwrap_or((rest, ""));
                let name = name.trim();
                if !is_identifier(name) {
                    return Err(error(
                        line_no,
                        format!("module name {name:?} is not an identifier"),
                    ));
                }
                modules.push(Module {
                    name: name.to_owned(),
                    summary: summary.trim().to_owned(),
                    items: Vec::new(),
                });
                doc.clear();
                continue;
            }
            if let Some(text) = line.strip_prefix("///") {
                doc.push(text.strip_prefix(' ').unwrap_or(text).to_owned());
                continue;
            }
            let code = strip_line_comment(line);
            if code.is_empty() || is_not_a_declaration(code) {
                if line.is_empty() {
                    doc.clear();
                }
                continue;
            }
            statement_line = line_no;
        }
        statement.push(' ');
        statement.push_str(strip_line_comment(line));
        if !is_complete(&statement) {
            continue;
        }
        let text = std::mem::take(&mut statement);
        let item = parse_statement(text.trim(), std::mem::take(&mut doc))
            .map_err(|message| error(statement_line, message))?;
        let Some(module) = modules.last_mut() else {
            return Err(error(
                statement_line,
                "a declaration before the first `// @module` line".into(),
            ));
        };
        module.items.push(item);
    }
    if !statement.trim().is_empty() {
        return Err(error(
            statement_line,
            "a declaration without its closing `;`".into(),
        ));
    }
    Ok(modules)
}

/// An error at the 1-based `line`.
fn error(line: usize, message: String) -> AbiError {
    AbiError { line, message }
}

/// The preprocessor conditionals around a line: what `#ifdef __cplusplus` encloses is C++ only
/// and declares nothing for Rust; its `#else` branch and every other conditional's lines are read.
#[derive(Default)]
struct Conditions {
    /// One entry per open conditional: whether its current branch is C++ only.
    open: Vec<bool>,
}

impl Conditions {
    /// Follows `line` if it is a conditional directive; whether the line is to be skipped.
    fn skips(&mut self, line: &str) -> bool {
        let directive = line.strip_prefix('#').map(str::trim_start);
        match directive {
            Some(d) if d.starts_with("if") => {
                self.open
                    .push(d.split_whitespace().eq(["ifdef", "__cplusplus"]));
                true
            }
            Some(d) if d.starts_with("else") => {
                if let Some(top) = self.open.last_mut() {
                    *top = false;
                }
                true
            }
            Some(d) if d.starts_with("endif") => {
                self.open.pop();
                true
            }
            Some(_) => true,
            None => self.open.iter().any(|&cplusplus_only| cplusplus_only),
        }
    }
}

/// Lines outside C++-only blocks that are part of the header but declare nothing for Rust.
fn is_not_a_declaration(line: &str) -> bool {
    line == "}"
        || (line.starts_with("typedef ") && line.trim_end_matches(';').ends_with(" sk_tensor"))
}

/// A statement ends at a `;` outside every brace (a struct's fields end in `;` too).
fn is_complete(statement: &str) -> bool {
    statement.trim_end().ends_with(';')
        && statement.matches('{').count() == statement.matches('}').count()
}

/// `line` without its trailing `//` comment.
fn strip_line_comment(line: &str) -> &str {
    match line.find("//") {
        Some(at) => line[..at].trim_end(),
        None => line,
    }
}
