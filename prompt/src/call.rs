//! Parsing FunctionGemma's function calls:
//! `<start_function_call>call:NAME{key:<escape>text<escape>,key:12,key:true}<end_function_call>`.

use std::fmt;

/// Opens a call in the model's output.
pub const START_FUNCTION_CALL: &str = "<start_function_call>";
const END_FUNCTION_CALL: &str = "<end_function_call>";
const ESCAPE: &str = "<escape>";

/// A call the model asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Arguments in the order the model wrote them.
    pub args: Vec<(String, Value)>,
}

/// An argument value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `<escape>text<escape>`.
    Str(String),
    /// A JSON-style number (`12`, `-0.5`, `1e3`).
    Number(f64),
    /// `true` or `false`.
    Bool(bool),
}

impl FunctionCall {
    /// The value of argument `name`.
    pub fn arg(&self, name: &str) -> Option<&Value> {
        self.args.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
}

impl fmt::Display for Value {
    /// Strings quoted as Rust debug strings, whole numbers without a fraction.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Number(x) if x.fract() == 0.0 && x.abs() < 1e15 => write!(f, "{}", *x as i64),
            Value::Number(x) => write!(f, "{x}"),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

impl fmt::Display for FunctionCall {
    /// `name(key: value, ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.name)?;
        for (i, (k, v)) in self.args.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{k}: {v}")?;
        }
        f.write_str(")")
    }
}

/// Why a model output is not a function call. Offsets are bytes into the parsed text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The output holds no `<start_function_call>`.
    #[error("no function call in the output (no <start_function_call>)")]
    NoCall,
    /// The output ends inside a call: generation stopped before `<end_function_call>`.
    #[error("the output ends inside the call at byte {at} (expected {expected}); generation stopped before <end_function_call>")]
    Truncated { at: usize, expected: &'static str },
    /// Something other than what the syntax allows at this point.
    #[error("at byte {at}: expected {expected}, found `{found}`")]
    Expected {
        at: usize,
        expected: &'static str,
        found: String,
    },
    /// A function or argument name with characters a name cannot hold.
    #[error("at byte {at}: `{name}` is not a valid {what} name")]
    BadName {
        at: usize,
        what: &'static str,
        name: String,
    },
    /// A value that is neither a string, a number nor a boolean.
    #[error("at byte {at}: `{found}` is not a value (expected <escape>text<escape>, a number, true or false)")]
    BadValue { at: usize, found: String },
    /// The same argument given twice.
    #[error("at byte {at}: argument `{name}` is given twice")]
    DuplicateArgument { at: usize, name: String },
}

/// Parses the first function call in `text` (text before it is ignored).
pub fn parse_call(text: &str) -> Result<FunctionCall, CallError> {
    let start = text.find(START_FUNCTION_CALL).ok_or(CallError::NoCall)?;
    Parser { text, pos: start }.call()
}

/// Parses every function call in `text` (FunctionGemma may answer with parallel calls).
pub fn parse_calls(text: &str) -> Result<Vec<FunctionCall>, CallError> {
    let mut calls = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find(START_FUNCTION_CALL) {
        let mut p = Parser {
            text,
            pos: from + i,
        };
        calls.push(p.call()?);
        from = p.pos;
    }
    if calls.is_empty() {
        return Err(CallError::NoCall);
    }
    Ok(calls)
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.text[self.pos..]
    }

    /// Up to 24 characters from the current position, for error messages.
    fn found(&self) -> String {
        self.rest().chars().take(24).collect()
    }

    fn expect(&mut self, token: &'static str) -> Result<(), CallError> {
        if self.rest().starts_with(token) {
            self.pos += token.len();
            Ok(())
        } else if token.starts_with(self.rest()) {
            Err(CallError::Truncated {
                at: self.pos,
                expected: token,
            })
        } else {
            Err(CallError::Expected {
                at: self.pos,
                expected: token,
                found: self.found(),
            })
        }
    }

    fn call(&mut self) -> Result<FunctionCall, CallError> {
        self.expect(START_FUNCTION_CALL)?;
        self.expect("call:")?;
        let name = self.name("function", "{")?;
        self.expect("{")?;
        let mut args: Vec<(String, Value)> = Vec::new();
        if !self.rest().starts_with('}') {
            loop {
                let at = self.pos;
                let key = self.name("argument", ":")?;
                self.expect(":")?;
                let value = self.value()?;
                if args.iter().any(|(k, _)| *k == key) {
                    return Err(CallError::DuplicateArgument { at, name: key });
                }
                args.push((key, value));
                if self.rest().starts_with(',') {
                    self.pos += 1;
                } else {
                    break;
                }
            }
        }
        self.expect("}")?;
        self.expect(END_FUNCTION_CALL)?;
        Ok(FunctionCall { name, args })
    }

    /// A name up to `end`: the same alphabet the catalog allows.
    fn name(&mut self, what: &'static str, end: &'static str) -> Result<String, CallError> {
        let text = self.text;
        let rest = &text[self.pos..];
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .unwrap_or(rest.len());
        if len == rest.len() {
            return Err(CallError::Truncated {
                at: self.pos + len,
                expected: end,
            });
        }
        if len == 0 {
            let bad: String = rest.chars().take_while(|c| !"{:,}".contains(*c)).collect();
            if bad.is_empty() {
                return Err(CallError::Expected {
                    at: self.pos,
                    expected: if what == "function" {
                        "a function name"
                    } else {
                        "an argument name"
                    },
                    found: self.found(),
                });
            }
            return Err(CallError::BadName {
                at: self.pos,
                what,
                name: bad,
            });
        }
        let name = rest[..len].to_string();
        self.pos += len;
        Ok(name)
    }

    fn value(&mut self) -> Result<Value, CallError> {
        let text = self.text;
        let rest = &text[self.pos..];
        if let Some(body) = rest.strip_prefix(ESCAPE) {
            let Some(len) = body.find(ESCAPE) else {
                return Err(CallError::Truncated {
                    at: self.text.len(),
                    expected: "<escape> closing the string",
                });
            };
            self.pos += ESCAPE.len() + len + ESCAPE.len();
            return Ok(Value::Str(body[..len].to_string()));
        }
        // A bare value runs to the next `,` or `}`.
        let Some(len) = rest.find([',', '}']) else {
            return Err(CallError::Truncated {
                at: self.text.len(),
                expected: "`,` or `}` after a value",
            });
        };
        let word = &rest[..len];
        let value = match word {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ if is_number(word) => {
                Value::Number(word.parse().map_err(|_| CallError::BadValue {
                    at: self.pos,
                    found: word.to_string(),
                })?)
            }
            _ => {
                return Err(CallError::BadValue {
                    at: self.pos,
                    found: word.to_string(),
                })
            }
        };
        self.pos += len;
        Ok(value)
    }
}

/// JSON number grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn is_number(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    let int_start = i;
    let n = digits(&mut i);
    if n == 0 || (n > 1 && b[int_start] == b'0') {
        return false;
    }
    if i < b.len() && b[i] == b'.' {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}
