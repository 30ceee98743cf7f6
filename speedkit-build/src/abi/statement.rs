//! One declaration of the header (a function, struct, enum or callback type) into an [`Item`],
//! its types checked against those the header may use.

use super::declarations::{CType, Field, Item};

/// The C scalar types the header may use.
const SCALARS: [&str; 11] = [
    "char", "int", "float", "double", "size_t", "int8_t", "uint8_t", "int32_t", "uint32_t",
    "int64_t", "uint64_t",
];

/// Whether `text` is a C identifier.
pub(super) fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// One complete statement (its `;` included), documented by `doc`.
pub(super) fn parse_statement(text: &str, doc: Vec<String>) -> Result<Item, String> {
    let text = text.trim_end_matches(';').trim();
    if let Some(rest) = text.strip_prefix("typedef struct ") {
        return parse_struct(rest, doc);
    }
    if let Some(rest) = text.strip_prefix("enum ") {
        return parse_enum(rest, doc);
    }
    if let Some(rest) = text.strip_prefix("typedef ") {
        return parse_callback(rest, doc);
    }
    let (head, params) = split_call(text)?;
    let (ret, name) = split_declarator(head)?;
    if !name.starts_with("sk_") {
        return Err(format!("function {name} must be named sk_*"));
    }
    Ok(Item::Function {
        doc,
        name,
        params: parse_params(params)?,
        ret: parse_type(&ret, true)?,
    })
}

fn parse_struct(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    let (name, after) = rest
        .split_once('{')
        .ok_or_else(|| format!("struct {rest:?} has no body"))?;
    let name = name.trim();
    let (body, alias) = after
        .rsplit_once('}')
        .ok_or_else(|| format!("struct {name} has no closing brace"))?;
    if alias.trim() != name {
        return Err(format!(
            "struct {name} must be typedef'd as {name}, not {:?}",
            alias.trim()
        ));
    }
    let fields = body
        .split(';')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .map(parse_field)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Item::Struct {
        doc,
        name: name.to_owned(),
        fields,
    })
}

fn parse_enum(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    let (_, after) = rest
        .split_once('{')
        .ok_or_else(|| format!("enum {rest:?} has no body"))?;
    let (body, tail) = after
        .rsplit_once('}')
        .ok_or_else(|| "enum without its closing brace".to_owned())?;
    if !tail.trim().is_empty() {
        return Err(format!(
            "unexpected {:?} after the enum's body",
            tail.trim()
        ));
    }
    let values = body
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|entry| {
            let (name, value) = entry
                .split_once('=')
                .ok_or_else(|| format!("enum constant {entry:?} needs an explicit value"))?;
            let value: i64 = value
                .trim()
                .parse()
                .map_err(|_| format!("enum constant {entry:?}: the value is not an integer"))?;
            Ok((name.trim().to_owned(), value))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Item::Constants { doc, values })
}

fn parse_callback(rest: &str, doc: Vec<String>) -> Result<Item, String> {
    // RET (*NAME)(PARAMS)
    let (ret, after) = rest
        .split_once("(*")
        .ok_or_else(|| format!("typedef {rest:?} is not a callback `RET (*name)(params)`"))?;
    let (name, params) = after
        .split_once(")(")
        .ok_or_else(|| format!("callback typedef {rest:?} is not `RET (*name)(params)`"))?;
    let params = params
        .strip_suffix(')')
        .ok_or_else(|| format!("callback {name}: no closing parenthesis"))?;
    Ok(Item::Callback {
        doc,
        name: name.trim().to_owned(),
        params: parse_params(params)?,
        ret: parse_type(ret.trim(), true)?,
    })
}

/// `head(params)` → (head, params).
fn split_call(text: &str) -> Result<(&str, &str), String> {
    let open = text
        .find('(')
        .ok_or_else(|| format!("{text:?} is not a function declaration"))?;
    let params = text[open + 1..]
        .strip_suffix(')')
        .ok_or_else(|| format!("{text:?}: the parameter list does not end the declaration"))?;
    if params.contains('(') {
        return Err(format!(
            "{text:?}: a function-pointer parameter needs a callback typedef"
        ));
    }
    Ok((&text[..open], params))
}

/// `TYPE name` → (TYPE, name), the name being the last identifier.
fn split_declarator(text: &str) -> Result<(String, String), String> {
    let text = text.trim();
    let cut = text
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let (ty, name) = (text[..cut].trim(), &text[cut..]);
    if ty.is_empty() || !is_identifier(name) {
        return Err(format!("{text:?} is not `type name`"));
    }
    Ok((ty.to_owned(), name.to_owned()))
}

fn parse_params(params: &str) -> Result<Vec<Field>, String> {
    let params = params.trim();
    if params == "void" {
        return Ok(Vec::new());
    }
    if params.is_empty() {
        return Err("an empty parameter list must be written (void) in C".into());
    }
    params.split(',').map(parse_field).collect()
}

fn parse_field(text: &str) -> Result<Field, String> {
    let text = text.trim();
    let (text, array) = match text.strip_suffix(']') {
        Some(head) => {
            let (head, len) = head
                .rsplit_once('[')
                .ok_or_else(|| format!("{text:?}: unbalanced brackets"))?;
            let len = len
                .trim()
                .parse()
                .map_err(|_| format!("{text:?}: the array length is not a number"))?;
            (head, Some(len))
        }
        None => (text, None),
    };
    let (ty, name) = split_declarator(text)?;
    Ok(Field {
        name,
        ty: parse_type(&ty, false)?,
        array,
    })
}

/// `const T * const * ...` into a [`CType`]; `void` alone only where `void_allowed`.
fn parse_type(text: &str, void_allowed: bool) -> Result<CType, String> {
    let spaced = text.replace('*', " * ");
    let mut tokens = spaced.split_whitespace().peekable();
    let mut base_const = false;
    if tokens.peek() == Some(&"const") {
        base_const = true;
        tokens.next();
    }
    let base = tokens
        .next()
        .ok_or_else(|| format!("{text:?} names no type"))?;
    if tokens.peek() == Some(&"const") {
        base_const = true;
        tokens.next();
    }
    let known = base == "void"
        || SCALARS.contains(&base)
        || (base.starts_with("sk_") && is_identifier(base));
    if !known {
        return Err(format!(
            "type {base:?} in {text:?} is not one the ABI takes (C scalars, sk_* types)"
        ));
    }
    let mut ty = if base == "void" {
        CType::Void
    } else {
        CType::Named(base.to_owned())
    };
    let mut pointee_const = base_const;
    let mut pointers = 0;
    while let Some(token) = tokens.next() {
        if token != "*" {
            return Err(format!("unexpected {token:?} in type {text:?}"));
        }
        pointers += 1;
        ty = CType::Pointer {
            to: Box::new(ty),
            to_const: pointee_const,
        };
        pointee_const = false;
        if tokens.peek() == Some(&"const") {
            pointee_const = true;
            tokens.next();
        }
    }
    if ty == CType::Void && !void_allowed {
        return Err(format!("{text:?}: a parameter cannot be void"));
    }
    if pointers == 0 && base_const {
        return Err(format!(
            "{text:?}: `const` on a value parameter says nothing to Rust"
        ));
    }
    Ok(ty)
}
