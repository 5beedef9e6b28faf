//! The function catalog: what the model may call, as a JSON file describes it.
//!
//! ```json
//! {"functions": [{"name": "set_volume",
//!                 "description": "Set the audio volume.",
//!                 "parameters": {"level": {"type": "integer", "description": "0 to 100."}},
//!                 "required": ["level"]}]}
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use serde::Deserialize;

use crate::call::{FunctionCall, Value};
use crate::error::{Error, Result};

/// Markers that would change the structure of the rendered prompt if they appeared inside a
/// name, a description or an enum value.
pub(crate) const CONTROL_MARKERS: [&str; 9] = [
    "<escape>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_function_declaration>",
    "<end_function_declaration>",
    "<start_function_call>",
    "<end_function_call>",
    "<start_function_response>",
    "<end_function_response>",
];

/// A set of functions the model may call, in declaration order.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalog {
    /// The functions, rendered in this order.
    pub functions: Vec<Function>,
}

/// One callable function.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Function {
    /// Name the model calls it by: ASCII letters, digits, `_`, `-` and `.`.
    pub name: String,
    /// What it does; the model picks functions by it.
    #[serde(default)]
    pub description: Option<String>,
    /// Parameters by name; rendered sorted by name whatever the file's order.
    #[serde(default)]
    pub parameters: BTreeMap<String, Parameter>,
    /// Names of the parameters a call must give, in this order.
    #[serde(default)]
    pub required: Vec<String>,
}

/// One parameter of a function.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parameter {
    /// Its JSON-schema type.
    #[serde(rename = "type")]
    pub ty: ParamType,
    /// What it means.
    #[serde(default)]
    pub description: Option<String>,
    /// The values a string parameter may take.
    #[serde(rename = "enum", default)]
    pub choices: Option<Vec<String>>,
}

/// The parameter types a flat catalog supports (JSON-schema names, any case in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum ParamType {
    String,
    Integer,
    Number,
    Boolean,
}

impl ParamType {
    /// The upper-case name FunctionGemma's declarations use.
    pub fn declared(self) -> &'static str {
        match self {
            ParamType::String => "STRING",
            ParamType::Integer => "INTEGER",
            ParamType::Number => "NUMBER",
            ParamType::Boolean => "BOOLEAN",
        }
    }

    /// Whether `value` is of this type (an integer must be a whole number).
    pub fn accepts(self, value: &Value) -> bool {
        match (self, value) {
            (ParamType::String, Value::Str(_)) => true,
            (ParamType::Number, Value::Number(_)) => true,
            (ParamType::Integer, Value::Number(x)) => x.fract() == 0.0,
            (ParamType::Boolean, Value::Bool(_)) => true,
            _ => false,
        }
    }
}

impl TryFrom<String> for ParamType {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "string" => Ok(ParamType::String),
            "integer" => Ok(ParamType::Integer),
            "number" => Ok(ParamType::Number),
            "boolean" => Ok(ParamType::Boolean),
            _ => Err(format!(
                "parameter type `{s}` is not supported (string, integer, number, boolean)"
            )),
        }
    }
}

impl fmt::Display for ParamType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.declared().to_ascii_lowercase())
    }
}

/// Why a parsed call does not fit the catalog.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CatalogProblem {
    /// The called function is not declared.
    #[error("`{name}` is not a function of the catalog")]
    UnknownFunction { name: String },
    /// An argument names no parameter of the function.
    #[error("`{function}` has no parameter `{arg}`")]
    UnknownArgument { function: String, arg: String },
    /// A required parameter is missing.
    #[error("`{function}` requires `{param}`")]
    MissingRequired { function: String, param: String },
    /// An argument has the wrong type.
    #[error("`{function}`: `{arg}` should be {expected}, got {got}")]
    WrongType {
        function: String,
        arg: String,
        expected: ParamType,
        got: Value,
    },
    /// A string argument is not one of the parameter's enum values.
    #[error("`{function}`: `{arg}` is {got}, not one of {choices:?}")]
    NotAChoice {
        function: String,
        arg: String,
        got: Value,
        choices: Vec<String>,
    },
}

impl Catalog {
    /// Reads and validates a catalog file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|cause| Error::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Parses and validates catalog JSON; `origin` names it in error messages.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let catalog: Catalog = serde_json::from_str(text).map_err(|e| Error::Catalog {
            origin: origin.to_string(),
            problem: e.to_string(),
        })?;
        catalog.validate().map_err(|problem| Error::Catalog {
            origin: origin.to_string(),
            problem,
        })?;
        Ok(catalog)
    }

    /// Checks the rules the declaration syntax needs: names that parse back out of a call,
    /// no control markers inside strings, required names that exist, enums on strings only.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.functions.is_empty() {
            return Err("no functions".into());
        }
        let mut seen = BTreeSet::new();
        for f in &self.functions {
            check_name("function name", &f.name)?;
            if !seen.insert(f.name.as_str()) {
                return Err(format!("function `{}` is declared twice", f.name));
            }
            if let Some(d) = &f.description {
                check_text(&format!("`{}` description", f.name), d)?;
            }
            for (name, p) in &f.parameters {
                check_name(&format!("`{}` parameter name", f.name), name)?;
                if let Some(d) = &p.description {
                    check_text(&format!("`{}.{name}` description", f.name), d)?;
                }
                if let Some(choices) = &p.choices {
                    if p.ty != ParamType::String {
                        return Err(format!(
                            "`{}.{name}`: enum is only rendered for string parameters, this one is {}",
                            f.name, p.ty
                        ));
                    }
                    if choices.is_empty() {
                        return Err(format!("`{}.{name}`: enum is empty", f.name));
                    }
                    for c in choices {
                        check_text(&format!("`{}.{name}` enum value", f.name), c)?;
                    }
                }
            }
            let mut required = BTreeSet::new();
            for r in &f.required {
                if !f.parameters.contains_key(r) {
                    return Err(format!(
                        "`{}` requires `{r}`, which is not one of its parameters",
                        f.name
                    ));
                }
                if !required.insert(r) {
                    return Err(format!("`{}` lists `{r}` twice in required", f.name));
                }
            }
        }
        Ok(())
    }

    /// The function called `name`.
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// Checks a parsed call against the declarations: known function and arguments, required
    /// arguments present, types and enum values respected. Returns every problem found.
    pub fn check_call(&self, call: &FunctionCall) -> Vec<CatalogProblem> {
        let Some(f) = self.function(&call.name) else {
            return vec![CatalogProblem::UnknownFunction {
                name: call.name.clone(),
            }];
        };
        let mut problems = Vec::new();
        for (arg, value) in &call.args {
            let Some(p) = f.parameters.get(arg) else {
                problems.push(CatalogProblem::UnknownArgument {
                    function: f.name.clone(),
                    arg: arg.clone(),
                });
                continue;
            };
            if !p.ty.accepts(value) {
                problems.push(CatalogProblem::WrongType {
                    function: f.name.clone(),
                    arg: arg.clone(),
                    expected: p.ty,
                    got: value.clone(),
                });
            } else if let (Some(choices), Value::Str(s)) = (&p.choices, value) {
                if !choices.contains(s) {
                    problems.push(CatalogProblem::NotAChoice {
                        function: f.name.clone(),
                        arg: arg.clone(),
                        got: value.clone(),
                        choices: choices.clone(),
                    });
                }
            }
        }
        for r in &f.required {
            if call.arg(r).is_none() {
                problems.push(CatalogProblem::MissingRequired {
                    function: f.name.clone(),
                    param: r.clone(),
                });
            }
        }
        problems
    }
}

/// Names end at `{`, `:` or `,` in the syntax, so they are kept to a plain identifier alphabet.
fn check_name(what: &str, name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!(
            "{what} `{name}` holds {c:?} (allowed: ASCII letters, digits, `_`, `-`, `.`)"
        ));
    }
    Ok(())
}

fn check_text(what: &str, text: &str) -> std::result::Result<(), String> {
    match CONTROL_MARKERS.iter().find(|m| text.contains(*m)) {
        Some(m) => Err(format!("{what} holds the control marker `{m}`")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        Catalog::from_json(json, "test").unwrap_err().to_string()
    }

    #[test]
    fn invalid_catalogs_name_the_problem() {
        assert!(err("{}").contains("missing field `functions`"));
        assert!(err(r#"{"functions": []}"#).contains("no functions"));
        assert!(err(r#"{"functions": [{"name": "a b"}]}"#).contains("holds ' '"));
        assert!(
            err(r#"{"functions": [{"name": "f", "parameters": {"x": {"type": "array"}}}]}"#)
                .contains("`array` is not supported")
        );
        assert!(err(r#"{"functions": [{"name": "f", "required": ["x"]}]}"#)
            .contains("requires `x`, which is not one of its parameters"));
        assert!(err(r#"{"functions": [{"name": "f"}, {"name": "f"}]}"#).contains("twice"));
        assert!(err(
            r#"{"functions": [{"name": "f", "parameters": {"x": {"type": "integer", "enum": ["1"]}}}]}"#
        )
        .contains("enum is only rendered for string parameters"));
        assert!(
            err(r#"{"functions": [{"name": "f", "description": "a<escape>b"}]}"#)
                .contains("control marker `<escape>`")
        );
        assert!(err(r#"{"functions": [{"name": "f", "extra": 1}]}"#).contains("unknown field"));
    }

    #[test]
    fn calls_are_checked_against_declarations() {
        let c = Catalog::from_json(
            r#"{"functions": [{"name": "f", "parameters": {
                "n": {"type": "integer"}, "mode": {"type": "string", "enum": ["a", "b"]}},
                "required": ["n"]}]}"#,
            "test",
        )
        .unwrap();
        let call = |name: &str, args: Vec<(&str, Value)>| FunctionCall {
            name: name.into(),
            args: args.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        };
        assert!(c
            .check_call(&call("f", vec![("n", Value::Number(3.0))]))
            .is_empty());
        assert_eq!(
            c.check_call(&call("g", vec![])),
            [CatalogProblem::UnknownFunction { name: "g".into() }]
        );
        let problems = c.check_call(&call(
            "f",
            vec![
                ("n", Value::Number(2.5)),
                ("mode", Value::Str("c".into())),
                ("z", Value::Bool(true)),
            ],
        ));
        let text: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(
            text,
            [
                "`f`: `n` should be integer, got 2.5",
                "`f`: `mode` is \"c\", not one of [\"a\", \"b\"]",
                "`f` has no parameter `z`",
            ]
        );
        assert_eq!(
            c.check_call(&call("f", vec![])),
            [CatalogProblem::MissingRequired {
                function: "f".into(),
                param: "n".into()
            }]
        );
    }
}
