//! Golden sets: the oracle's logits and greedy tokens for a list of prompts, in the
//! `kvsnap-goldens` version 1 format (`shared/goldens/FORMAT.md`).
//!
//! Loading validates everything the checker relies on (format name and version, BOS first,
//! one position per token of `ids + greedy`, `top_k` pairs per position), so a bad file is
//! rejected up front with its path and the exact problem instead of failing halfway through a
//! parity run.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The `format` value every golden file carries.
pub const FORMAT_NAME: &str = "kvsnap-goldens";
/// The format version this crate reads.
pub const FORMAT_VERSION: u64 = 1;
/// The id every prompt starts with (Gemma's BOS).
pub const BOS_ID: u32 = 2;

/// Why a golden file could not be loaded.
///
/// Messages are complete on their own (they include the underlying I/O or JSON error), so the
/// underlying error is kept as a field rather than chained as a `source`, which would print it
/// twice through `anyhow`'s `{:#}`.
#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    /// The file could not be read.
    #[error("goldens {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    /// Not JSON, or JSON without the fields (or types) the format requires.
    #[error("goldens {path}: not a valid {FORMAT_NAME} file: {error}")]
    Json {
        path: PathBuf,
        error: serde_json::Error,
    },

    /// The `format` field names another format (or is missing).
    #[error(
        "goldens {path}: format is {found}, expected \"{FORMAT_NAME}\" \
         (hint: this is not a kvsnap golden set; see shared/goldens/FORMAT.md)"
    )]
    FormatMismatch { path: PathBuf, found: String },

    /// The `version` field is not one this crate reads.
    #[error(
        "goldens {path}: {FORMAT_NAME} version {found}, expected version {FORMAT_VERSION} \
         (hint: regenerate the goldens with a matching script or update kvsnap-parity)"
    )]
    VersionMismatch { path: PathBuf, found: String },

    /// A file-level field holds an impossible value.
    #[error("goldens {path}: `{field}` {problem}")]
    BadField {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },

    /// One case breaks the format's rules.
    #[error("goldens {path}: case {index} `{case}`: {problem}")]
    BadCase {
        path: PathBuf,
        index: usize,
        case: String,
        problem: String,
    },

    /// `--cases` named a case the file does not have.
    #[error("no case named `{name}` in the golden set (cases: {known})")]
    UnknownCase { name: String, known: String },
}

/// One golden set: what produced it and its cases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GoldenSet {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub version: u64,
    /// Which weights (source package and how they were dequantized).
    #[serde(default)]
    pub model: serde_json::Value,
    /// sha256 (hex) of the `model.safetensors` the goldens were computed from, when the set
    /// records it (an extension of the format used by generated models such as the tiny one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_sha256: Option<String>,
    /// The implementation that produced the numbers.
    #[serde(default)]
    pub oracle: serde_json::Value,
    /// How many `(id, logit)` pairs each position lists.
    pub top_k: usize,
    /// Prose statement of what positions mean.
    #[serde(default)]
    pub semantics: String,
    /// How far float32 drifts from the oracle on these cases.
    #[serde(default)]
    pub calibration: serde_json::Value,
    /// The prompts.
    pub cases: Vec<Case>,
}

/// One prompt with the oracle's greedy continuation and per-position logits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Case {
    /// Short unique name.
    pub name: String,
    /// The prompt text (informational; `ids` are what runs).
    #[serde(default)]
    pub text: String,
    /// Prompt token ids, BOS first.
    pub ids: Vec<u32>,
    /// The oracle's greedy continuation (no EOS stop).
    pub greedy: Vec<u32>,
    /// Whether a no-cache forward reproduces the cached greedy decode.
    #[serde(default)]
    pub greedy_matches_nocache_argmax: Option<bool>,
    /// One entry per position of `ids + greedy`.
    pub positions: Vec<Position>,
}

/// The oracle's view of the logits at one position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// Index into `ids + greedy`; these logits predict token `pos + 1`.
    pub pos: usize,
    /// The `top_k` best `(id, logit)` pairs, best first.
    pub top: Vec<(u32, f64)>,
    /// Log-sum-exp of the logits over the whole vocabulary.
    pub lse: f64,
    /// `top[0]` logit minus `top[1]` logit.
    pub margin: f64,
}

/// Only the fields that identify the format, read before the rest so that a file of another
/// format or version gets a hint instead of a confusing "missing field".
#[derive(Deserialize)]
struct Header {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
}

impl GoldenSet {
    /// Reads and validates a golden file.
    pub fn load(path: &Path) -> Result<Self, GoldenError> {
        let text = std::fs::read_to_string(path).map_err(|error| GoldenError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses and validates a golden set; `path` only names the source in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, GoldenError> {
        let json = |error| GoldenError::Json {
            path: path.to_path_buf(),
            error,
        };
        let header: Header = serde_json::from_str(text).map_err(json)?;
        let found = |v: &Option<serde_json::Value>| match v {
            Some(v) => v.to_string(),
            None => "missing".to_string(),
        };
        if header.format.as_ref().and_then(|v| v.as_str()) != Some(FORMAT_NAME) {
            return Err(GoldenError::FormatMismatch {
                path: path.to_path_buf(),
                found: found(&header.format),
            });
        }
        if header.version.as_ref().and_then(|v| v.as_u64()) != Some(FORMAT_VERSION) {
            return Err(GoldenError::VersionMismatch {
                path: path.to_path_buf(),
                found: found(&header.version),
            });
        }
        let set: GoldenSet = serde_json::from_str(text).map_err(json)?;
        set.validate(path)?;
        Ok(set)
    }

    /// Checks the rules the format states and the checker relies on.
    pub fn validate(&self, path: &Path) -> Result<(), GoldenError> {
        if self.top_k == 0 {
            return Err(GoldenError::BadField {
                path: path.to_path_buf(),
                field: "top_k",
                problem: "must be at least 1".into(),
            });
        }
        if self.cases.is_empty() {
            return Err(GoldenError::BadField {
                path: path.to_path_buf(),
                field: "cases",
                problem: "is empty".into(),
            });
        }
        for (index, case) in self.cases.iter().enumerate() {
            let bad = |problem: String| GoldenError::BadCase {
                path: path.to_path_buf(),
                index,
                case: case.name.clone(),
                problem,
            };
            if let Some(first) = self.cases[..index].iter().position(|c| c.name == case.name) {
                return Err(bad(format!("name repeats case {first}")));
            }
            case.validate(self.top_k).map_err(bad)?;
        }
        Ok(())
    }

    /// The named cases in the order given, or every case when `names` is empty.
    pub fn select<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<&Case>, GoldenError> {
        if names.is_empty() {
            return Ok(self.cases.iter().collect());
        }
        names
            .iter()
            .map(|name| {
                let name = name.as_ref();
                self.cases
                    .iter()
                    .find(|c| c.name == name)
                    .ok_or_else(|| GoldenError::UnknownCase {
                        name: name.to_string(),
                        known: self
                            .cases
                            .iter()
                            .map(|c| c.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    })
            })
            .collect()
    }
}

impl Case {
    /// The golden for position `pos` of `ids + greedy`.
    pub fn position(&self, pos: usize) -> &Position {
        &self.positions[pos]
    }

    /// The token at position `pos` of `ids + greedy`.
    pub fn token(&self, pos: usize) -> u32 {
        if pos < self.ids.len() {
            self.ids[pos]
        } else {
            self.greedy[pos - self.ids.len()]
        }
    }

    /// Largest token id the case mentions (prompt, greedy or top-k), to check against a vocab.
    pub fn max_id(&self) -> u32 {
        let top = self
            .positions
            .iter()
            .flat_map(|p| p.top.iter().map(|t| t.0));
        self.ids
            .iter()
            .chain(&self.greedy)
            .copied()
            .chain(top)
            .max()
            .unwrap_or(0)
    }

    fn validate(&self, top_k: usize) -> Result<(), String> {
        match self.ids.first() {
            None => return Err("ids is empty".into()),
            Some(&first) if first != BOS_ID => {
                return Err(format!("ids[0] is {first}, expected the BOS {BOS_ID}"))
            }
            Some(_) => {}
        }
        let want = self.ids.len() + self.greedy.len();
        if self.positions.len() != want {
            return Err(format!(
                "{} positions, expected one per token of ids + greedy ({} + {} = {want})",
                self.positions.len(),
                self.ids.len(),
                self.greedy.len()
            ));
        }
        for (p, position) in self.positions.iter().enumerate() {
            if position.pos != p {
                return Err(format!("positions[{p}].pos is {}", position.pos));
            }
            if position.top.len() != top_k {
                return Err(format!(
                    "positions[{p}] lists {} top pairs, expected top_k = {top_k}",
                    position.top.len()
                ));
            }
            let finite = position.lse.is_finite()
                && position.margin.is_finite()
                && position.top.iter().all(|t| t.1.is_finite());
            if !finite {
                return Err(format!("positions[{p}] holds a non-finite number"));
            }
            if position.top.windows(2).any(|w| w[0].1 < w[1].1) {
                return Err(format!("positions[{p}].top is not sorted best first"));
            }
            if position.margin < 0.0 {
                return Err(format!(
                    "positions[{p}].margin {} is negative",
                    position.margin
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> serde_json::Value {
        serde_json::json!({
            "format": "kvsnap-goldens",
            "version": 1,
            "model": "m",
            "oracle": {"library": "x"},
            "top_k": 2,
            "semantics": "s",
            "calibration": {},
            "cases": [{
                "name": "a",
                "text": "t",
                "ids": [2, 5],
                "greedy": [7],
                "greedy_matches_nocache_argmax": true,
                "positions": [
                    {"pos": 0, "top": [[5, 1.5], [3, 1.0]], "lse": 2.0, "margin": 0.5},
                    {"pos": 1, "top": [[7, 2.5], [3, 1.0]], "lse": 3.0, "margin": 1.5},
                    {"pos": 2, "top": [[1, 0.5], [3, 0.25]], "lse": 1.0, "margin": 0.25}
                ]
            }]
        })
    }

    fn load(v: &serde_json::Value) -> Result<GoldenSet, GoldenError> {
        GoldenSet::from_json(&v.to_string(), Path::new("g.json"))
    }

    #[test]
    fn reads_the_format() {
        let set = load(&minimal()).unwrap();
        assert_eq!(set.top_k, 2);
        let case = &set.cases[0];
        assert_eq!(case.positions[1].top[0], (7, 2.5));
        assert_eq!((case.token(1), case.token(2)), (5, 7));
        assert_eq!(case.max_id(), 7);
        assert_eq!(set.select::<&str>(&[]).unwrap().len(), 1);
        let e = set.select(&["a", "zz"]).unwrap_err().to_string();
        assert!(
            e.contains("no case named `zz`") && e.contains("cases: a"),
            "{e}"
        );
    }

    #[test]
    fn format_and_version_mismatches_give_hints() {
        let mut v = minimal();
        v["format"] = "llm.c-state".into();
        let e = load(&v).unwrap_err();
        assert!(matches!(e, GoldenError::FormatMismatch { .. }));
        let e = e.to_string();
        assert!(e.contains("g.json") && e.contains("\"llm.c-state\""), "{e}");
        assert!(
            e.contains("expected \"kvsnap-goldens\"") && e.contains("hint"),
            "{e}"
        );

        let mut v = minimal();
        v.as_object_mut().unwrap().remove("format");
        assert!(load(&v)
            .unwrap_err()
            .to_string()
            .contains("format is missing"));

        let mut v = minimal();
        v["version"] = 2.into();
        let e = load(&v).unwrap_err();
        assert!(matches!(e, GoldenError::VersionMismatch { .. }));
        let e = e.to_string();
        assert!(
            e.contains("version 2, expected version 1") && e.contains("hint"),
            "{e}"
        );
    }

    #[test]
    fn structural_errors_name_path_and_problem() {
        let e = GoldenSet::from_json("{not json", Path::new("g.json")).unwrap_err();
        assert!(matches!(e, GoldenError::Json { .. }));
        assert!(
            e.to_string().starts_with("goldens g.json: not a valid"),
            "{e}"
        );

        let mut v = minimal();
        v["cases"][0].as_object_mut().unwrap().remove("ids");
        let e = load(&v).unwrap_err().to_string();
        assert!(e.contains("missing field `ids`"), "{e}");

        let mut v = minimal();
        v["cases"][0]["ids"][0] = 1.into();
        let e = load(&v).unwrap_err().to_string();
        assert!(
            e.contains("case 0 `a`: ids[0] is 1, expected the BOS 2"),
            "{e}"
        );

        let mut v = minimal();
        v["cases"][0]["positions"].as_array_mut().unwrap().pop();
        let e = load(&v).unwrap_err().to_string();
        assert!(e.contains("2 positions, expected one per token"), "{e}");

        let mut v = minimal();
        v["top_k"] = 3.into();
        let e = load(&v).unwrap_err().to_string();
        assert!(e.contains("lists 2 top pairs, expected top_k = 3"), "{e}");

        let mut v = minimal();
        v["cases"][0]["positions"][1]["pos"] = 5.into();
        assert!(load(&v)
            .unwrap_err()
            .to_string()
            .contains("positions[1].pos is 5"));

        let mut v = minimal();
        v["cases"][0]["positions"][0]["top"] = serde_json::json!([[5, 1.0], [3, 1.5]]);
        assert!(load(&v).unwrap_err().to_string().contains("not sorted"));

        let mut v = minimal();
        let case = v["cases"][0].clone();
        v["cases"].as_array_mut().unwrap().push(case);
        assert!(load(&v)
            .unwrap_err()
            .to_string()
            .contains("name repeats case 0"));
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = GoldenSet::load(Path::new("no/such/goldens.json")).unwrap_err();
        assert!(matches!(e, GoldenError::Io { .. }));
        assert!(e.to_string().contains("no/such/goldens.json"), "{e}");
    }
}
