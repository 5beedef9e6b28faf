//! The Hugging Face `tokenizer.json` of a model directory, through the `tokenizers` crate.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::stop::END_OF_TURN;

/// A Gemma 3 tokenizer. Prompts are encoded without the post-processor (which would add a
/// `<bos>` to every piece); the caller puts [`Tokenizer::bos`] in front of the first piece.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    bos: u32,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn load(model_dir: &Path) -> Result<Self> {
        Self::from_file(&model_dir.join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::TokenizerLoad {
                path: path.to_path_buf(),
                problem: "no such file (`kvsnap fetch-model` installs the Gemma 3 one)".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::TokenizerLoad {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        let bos = inner.token_to_id("<bos>").ok_or(Error::MissingToken {
            path: path.to_path_buf(),
            token: "<bos>",
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
            bos,
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Id of `<bos>`.
    pub fn bos(&self) -> u32 {
        self.bos
    }

    /// Id of `<end_of_turn>`, if the vocabulary has it as one token.
    pub fn end_of_turn(&self) -> Option<u32> {
        self.token_id(END_OF_TURN)
    }

    /// Id of `token` if the vocabulary has it as one token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Ids of `text`, special-token markers in it mapped to their ids, no `<bos>` added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenize {
                op: "encode",
                problem: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// `<bos>` followed by the ids of `text`: a whole prompt as the goldens tokenize it.
    pub fn encode_with_bos(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = vec![self.bos];
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// Text of `ids`, special tokens included (so `<end_of_turn>` shows where the model put it).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenize {
            op: "decode",
            problem: e.to_string(),
        })
    }
}
