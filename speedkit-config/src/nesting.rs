//! The nesting limit, checked on the raw text before a parser sees it.
//!
//! serde_yaml_ng has libyaml scan the whole document before anything is deserialized, and
//! libyaml's scanner revisits every open bracket for every token, so its time grows with the
//! square of the bracket depth: 100 000 levels of `a: {` take most of a minute. (The parsers' own
//! recursion limits never come into play: the config's types stop descending after two levels.)
//! A config needs two levels, so a generous limit costs nothing, and one pass over the text
//! finds where it is broken.

use crate::error::{ConfigError, Format, Location};

/// The deepest bracket nesting a config text may have.
pub(crate) const MAX_DEPTH: usize = 32;

/// Fails with [`ConfigError::TooDeep`] at the first bracket that opens level `MAX_DEPTH + 1`.
///
/// Brackets count outside comments and quoted text. This is a bound, not a YAML lexer: brackets
/// inside plain text also count, which can only reject texts that are no config anyway (no config
/// value is free text), while a valid config's brackets, quotes and comments are counted exactly.
pub(crate) fn check(text: &str, format: Format) -> Result<(), ConfigError> {
    let mut cursor = Cursor::new(format);
    let mut depth = 0usize;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let at = cursor.location();
        let token_start = cursor.token_start();
        cursor.advance(c);
        match c {
            '#' if cursor.after_blank() => {
                while let Some(next) = chars.next_if(|&n| n != '\n') {
                    cursor.advance(next);
                }
            }
            '"' | '\'' if token_start => skip_quoted(c, &mut chars, &mut cursor),
            '[' | '{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(ConfigError::TooDeep {
                        format,
                        limit: MAX_DEPTH,
                        location: at,
                    });
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Skips a quoted scalar up to its closing `quote`: `\` escapes in double quotes (as in JSON),
/// `''` stands for one `'` in single quotes.
fn skip_quoted(
    quote: char,
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    cursor: &mut Cursor,
) {
    while let Some(c) = chars.next() {
        cursor.advance(c);
        if quote == '"' && c == '\\' {
            if let Some(escaped) = chars.next() {
                cursor.advance(escaped);
            }
        } else if c == quote {
            let doubled = quote == '\'' && chars.next_if_eq(&'\'').is_some();
            if !doubled {
                return;
            }
            cursor.advance(quote);
        }
    }
}

/// Line and column of the next character, and what came just before it.
struct Cursor {
    format: Format,
    line: usize,
    column: usize,
    /// The character before the current one (`'\n'` at the start of the text).
    previous: char,
    /// The one before that.
    before_previous: char,
}

impl Cursor {
    fn new(format: Format) -> Self {
        Self {
            format,
            line: 1,
            column: 1,
            previous: '\n',
            before_previous: '\n',
        }
    }

    fn location(&self) -> Location {
        Location {
            line: self.line,
            column: self.column,
        }
    }

    /// Whether a quoted scalar can start here: after a blank, at a line start, or after a flow
    /// indicator or `:` (`{"a":"b"}`).
    fn token_start(&self) -> bool {
        matches!(
            self.previous,
            ' ' | '\t' | '\n' | '\r' | '[' | '{' | ',' | ':'
        )
    }

    /// Whether the character just passed followed a blank or a line start (a `#` there starts
    /// a comment).
    fn after_blank(&self) -> bool {
        matches!(self.before_previous, ' ' | '\t' | '\n' | '\r')
    }

    fn advance(&mut self, c: char) {
        self.before_previous = self.previous;
        self.previous = c;
        if c == '\n' {
            self.line += 1;
            self.column = 1;
        } else {
            // Location columns are characters in YAML, bytes in JSON (as the parsers count).
            self.column += match self.format {
                Format::Yaml => 1,
                Format::Json => c.len_utf8(),
            };
        }
    }
}
