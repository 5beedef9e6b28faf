//! FunctionGemma's prompt syntax.
//!
//! A prompt is a developer turn that declares the functions, a user turn and the opening of the
//! model's turn:
//!
//! ```text
//! <start_of_turn>developer
//! You are a model that can do function calling with the following functions<start_function_declaration>declaration:NAME{description:<escape>...<escape>,parameters:{properties:{P:{description:<escape>...<escape>,type:<escape>STRING<escape>}},required:[<escape>P<escape>],type:<escape>OBJECT<escape>}}<end_function_declaration>...<end_of_turn>
//! <start_of_turn>user
//! UTTERANCE<end_of_turn>
//! <start_of_turn>model
//! ```
//!
//! (the first line break after `developer` is the only one inside the developer turn).
//! Properties are sorted by name, every string sits between `<escape>` markers, types are upper
//! case. A string parameter's `enum` is rendered between its description and its type as
//! `enum:[<escape>a<escape>,<escape>b<escape>]`, as FunctionGemma's chat template and its
//! documentation's `get_current_weather` example do. A function without parameters gets
//! `parameters:{type:<escape>OBJECT<escape>}` (the template leaves out empty `properties` and
//! `required`); a function without a description gets no `description:` field.
//!
//! The prompt is split for the prefix cache at the end of the last declaration:
//! [`prefix`] is the same for every utterance against a catalog, [`turn`] starts with the
//! `<end_of_turn>` that closes the developer turn. Both halves meet at a special token, so
//! tokenizing them apart gives the same ids as tokenizing the whole prompt; a catalog that adds
//! functions after another's reuses the other's cached prefix.

use std::fmt::Write;

use crate::catalog::{Catalog, Function, CONTROL_MARKERS};
use crate::error::{Error, Result};

/// The developer instruction that switches FunctionGemma to function calling.
pub const DEVELOPER_PROMPT: &str =
    "You are a model that can do function calling with the following functions";

/// Everything before the utterance that does not depend on it: the developer turn up to the
/// end of the last declaration.
pub fn prefix(catalog: &Catalog) -> String {
    let mut out = String::from("<start_of_turn>developer\n");
    out.push_str(DEVELOPER_PROMPT);
    for f in &catalog.functions {
        declaration(&mut out, f);
    }
    out
}

/// The per-utterance rest of the prompt: closes the developer turn, then the user turn and
/// the opening of the model's turn. Errors if the utterance holds a control marker.
pub fn turn(utterance: &str) -> Result<String> {
    if let Some(marker) = CONTROL_MARKERS.iter().find(|m| utterance.contains(*m)) {
        return Err(Error::Utterance { marker });
    }
    Ok(format!(
        "<end_of_turn>\n<start_of_turn>user\n{utterance}<end_of_turn>\n<start_of_turn>model\n"
    ))
}

/// The whole prompt text for one utterance (without the BOS token).
pub fn prompt(catalog: &Catalog, utterance: &str) -> Result<String> {
    Ok(prefix(catalog) + &turn(utterance)?)
}

/// Appends `<start_function_declaration>declaration:NAME{...}<end_function_declaration>`.
fn declaration(out: &mut String, f: &Function) {
    out.push_str("<start_function_declaration>declaration:");
    out.push_str(&f.name);
    out.push('{');
    if let Some(d) = &f.description {
        write!(out, "description:{},", escaped(d)).unwrap();
    }
    out.push_str("parameters:{");
    if !f.parameters.is_empty() {
        out.push_str("properties:{");
        // BTreeMap: sorted by name, as the template's `dictsort`.
        for (i, (name, p)) in f.parameters.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write!(out, "{name}:{{").unwrap();
            if let Some(d) = &p.description {
                write!(out, "description:{},", escaped(d)).unwrap();
            }
            if let Some(choices) = &p.choices {
                let items: Vec<String> = choices.iter().map(|c| escaped(c)).collect();
                write!(out, "enum:[{}],", items.join(",")).unwrap();
            }
            write!(out, "type:{}}}", escaped(p.ty.declared())).unwrap();
        }
        out.push_str("},");
    }
    if !f.required.is_empty() {
        let items: Vec<String> = f.required.iter().map(|r| escaped(r)).collect();
        write!(out, "required:[{}],", items.join(",")).unwrap();
    }
    out.push_str("type:<escape>OBJECT<escape>}}<end_function_declaration>");
}

fn escaped(s: &str) -> String {
    format!("<escape>{s}<escape>")
}
