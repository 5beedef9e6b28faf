//! The call parser on valid calls and on the ways a model's output goes wrong.

use kvsnap_prompt::{parse_call, parse_calls, CallError, FunctionCall, Value};

fn call(name: &str, args: &[(&str, Value)]) -> FunctionCall {
    FunctionCall {
        name: name.into(),
        args: args
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

fn s(text: &str) -> Value {
    Value::Str(text.into())
}

#[test]
fn valid_calls_parse_into_typed_arguments_in_order() {
    assert_eq!(
        parse_call("<start_function_call>call:set_volume{level:20}<end_function_call>"),
        Ok(call("set_volume", &[("level", Value::Number(20.0))]))
    );
    // Strings keep every character between the markers, syntax characters included.
    assert_eq!(
        parse_call(
            "<start_function_call>call:record_program{weekly:true,channel:<escape>Arte, {HD}: 7<escape>,start:<escape>2026-11-29T20:15<escape>}<end_function_call>"
        ),
        Ok(call(
            "record_program",
            &[
                ("weekly", Value::Bool(true)),
                ("channel", s("Arte, {HD}: 7")),
                ("start", s("2026-11-29T20:15")),
            ]
        ))
    );
    assert_eq!(
        parse_call("<start_function_call>call:f{a:-0.5,b:1e3,c:false,d:<escape><escape>}<end_function_call>"),
        Ok(call(
            "f",
            &[
                ("a", Value::Number(-0.5)),
                ("b", Value::Number(1000.0)),
                ("c", Value::Bool(false)),
                ("d", s("")),
            ]
        ))
    );
    assert_eq!(
        parse_call("<start_function_call>call:lights_off{}<end_function_call>"),
        Ok(call("lights_off", &[]))
    );
}

#[test]
fn text_around_the_call_is_ignored_and_parallel_calls_are_all_found() {
    let out = "Sure.<start_function_call>call:a{x:1}<end_function_call><start_function_call>call:b{y:<escape>z<escape>}<end_function_call><end_of_turn>";
    assert_eq!(parse_call(out), Ok(call("a", &[("x", Value::Number(1.0))])));
    assert_eq!(
        parse_calls(out),
        Ok(vec![
            call("a", &[("x", Value::Number(1.0))]),
            call("b", &[("y", s("z"))])
        ])
    );
}

#[test]
fn display_reads_like_a_call() {
    let c = call(
        "f",
        &[
            ("n", Value::Number(20.0)),
            ("x", Value::Number(0.25)),
            ("s", s("a \"b\"")),
            ("on", Value::Bool(true)),
        ],
    );
    assert_eq!(
        c.to_string(),
        r#"f(n: 20, x: 0.25, s: "a \"b\"", on: true)"#
    );
}

#[test]
fn malformed_calls_get_typed_errors_that_say_where() {
    let cases: Vec<(&str, CallError)> = vec![
        ("I can't help with that.<end_of_turn>", CallError::NoCall),
        (
            "<start_function_call>set_volume{level:20}<end_function_call>",
            CallError::Expected {
                at: 21,
                expected: "call:",
                found: "set_volume{level:20}<end".into(),
            },
        ),
        (
            "<start_function_call>call:{level:20}<end_function_call>",
            CallError::Expected {
                at: 26,
                expected: "a function name",
                found: "{level:20}<end_function_".into(),
            },
        ),
        (
            "<start_function_call>call:$vol{level:20}<end_function_call>",
            CallError::BadName {
                at: 26,
                what: "function",
                name: "$vol".into(),
            },
        ),
        (
            "<start_function_call>call:set volume{level:20}<end_function_call>",
            CallError::Expected {
                at: 29,
                expected: "{",
                found: " volume{level:20}<end_fu".into(),
            },
        ),
        (
            "<start_function_call>call:f{level=20}<end_function_call>",
            CallError::Expected {
                at: 33,
                expected: ":",
                found: "=20}<end_function_call>".into(),
            },
        ),
        (
            "<start_function_call>call:f{level:twenty}<end_function_call>",
            CallError::BadValue {
                at: 34,
                found: "twenty".into(),
            },
        ),
        (
            "<start_function_call>call:f{level:\"20\"}<end_function_call>",
            CallError::BadValue {
                at: 34,
                found: "\"20\"".into(),
            },
        ),
        (
            "<start_function_call>call:f{level:007}<end_function_call>",
            CallError::BadValue {
                at: 34,
                found: "007".into(),
            },
        ),
        (
            "<start_function_call>call:f{a:1,a:2}<end_function_call>",
            CallError::DuplicateArgument {
                at: 32,
                name: "a".into(),
            },
        ),
        (
            "<start_function_call>call:f{a:1}}<end_function_call>",
            CallError::Expected {
                at: 32,
                expected: "<end_function_call>",
                found: "}<end_function_call>".into(),
            },
        ),
        (
            "<start_function_call>call:f{a:1,}<end_function_call>",
            CallError::Expected {
                at: 32,
                expected: "an argument name",
                found: "}<end_function_call>".into(),
            },
        ),
    ];
    for (text, want) in cases {
        assert_eq!(parse_call(text), Err(want), "{text}");
    }
}

#[test]
fn outputs_cut_off_by_the_token_limit_are_truncated_not_malformed() {
    for (text, expected) in [
        ("<start_function_call>call:set_vol", "{"),
        (
            "<start_function_call>call:f{level:2",
            "`,` or `}` after a value",
        ),
        (
            "<start_function_call>call:f{q:<escape>living ro",
            "<escape> closing the string",
        ),
        (
            "<start_function_call>call:f{q:1}<end_func",
            "<end_function_call>",
        ),
        ("<start_function_call>call:f{q:1}", "<end_function_call>"),
        ("<start_function_call>ca", "call:"),
    ] {
        match parse_call(text) {
            Err(CallError::Truncated { expected: e, .. }) => assert_eq!(e, expected, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
    }
    let e = parse_call("<start_function_call>call:f{q:1}").unwrap_err();
    assert_eq!(
        e.to_string(),
        "the output ends inside the call at byte 32 (expected <end_function_call>); generation stopped before <end_function_call>"
    );
}
