//! [`ToolCaller`]: utterances in, parsed function calls out, for one model and tokenizer.

use kvsnap_contract::KvModel;

use crate::cache::{Lookup, PrefillProgress, PrefixCache};
use crate::call::{parse_call, CallError, FunctionCall};
use crate::catalog::{Catalog, CatalogProblem, Function};
use crate::error::Result;
use crate::render;
use crate::stop::StopRules;
use crate::tokenizer::Tokenizer;
use crate::turn::{run_turn, Turn};

/// What one utterance produced.
#[derive(Clone, Debug, PartialEq)]
pub struct CallOutcome {
    /// The generation and its timings.
    pub turn: Turn,
    /// The parsed call, or why the output is not one.
    pub call: std::result::Result<FunctionCall, CallError>,
    /// Where a parsed call disagrees with the catalog (empty when it fits or did not parse).
    pub problems: Vec<CatalogProblem>,
}

/// Serves utterances against catalogs, each catalog's prefix prefilled once and cached.
///
/// The cache key of a catalog is its prefix's tokens, less the few at its end that tokenize
/// differently once another declaration follows (the base Gemma 3 tokenizer merges the `>` that
/// ends `<end_function_declaration>` with the `<` that starts the next declaration; a FunctionGemma
/// tokenizer has both markers as single tokens and holds nothing back). Those tokens are sent with
/// the turn instead, so a catalog that appends functions to a cached one extends its snapshot, and
/// the whole prompt still tokenizes exactly as one text.
pub struct ToolCaller<'m, M: KvModel> {
    cache: PrefixCache<'m, M>,
    tokenizer: Tokenizer,
    rules: StopRules,
    held_back: usize,
}

impl<'m, M: KvModel> ToolCaller<'m, M> {
    /// A caller over `model` with a prefix cache of `budget` bytes, generating at most
    /// `max_new_tokens` per utterance.
    pub fn new(
        model: &'m M,
        tokenizer: Tokenizer,
        budget: u64,
        max_new_tokens: usize,
    ) -> Result<Self> {
        let rules = StopRules::new(model.config(), tokenizer.end_of_turn(), max_new_tokens);
        let held_back = unstable_tail(&tokenizer)?;
        Ok(ToolCaller {
            cache: PrefixCache::new(model, budget),
            tokenizer,
            rules,
            held_back,
        })
    }

    /// Computes uncached prefixes `chunk` tokens per model call (progress is reported per chunk).
    pub fn with_prefill_chunk(mut self, chunk: usize) -> Self {
        self.cache = self.cache.with_chunk(chunk);
        self
    }

    /// The prefix cache.
    pub fn cache(&self) -> &PrefixCache<'m, M> {
        &self.cache
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The stopping rules.
    pub fn rules(&self) -> &StopRules {
        &self.rules
    }

    /// Tokens at the end of a catalog prefix that are sent with each turn instead of cached.
    pub fn held_back(&self) -> usize {
        self.held_back
    }

    /// The cache key of `catalog` (`<bos>` first) and the tokens held back from it.
    pub fn prefix_ids(&self, catalog: &Catalog) -> Result<(Vec<u32>, Vec<u32>)> {
        let mut key = self.tokenizer.encode_with_bos(&render::prefix(catalog))?;
        let tail = key.split_off(key.len() - self.held_back.min(key.len() - 1));
        Ok((key, tail))
    }

    /// Makes sure `catalog`'s prefix is cached (prefilling it if needed) without serving a turn;
    /// says how it was found. The time it took is in the cache's stats.
    pub fn warm(
        &mut self,
        catalog: &Catalog,
        progress: &mut dyn FnMut(PrefillProgress),
    ) -> Result<Lookup> {
        let (key, _) = self.prefix_ids(catalog)?;
        let checkout = self.cache.checkout_with_progress(&key, progress)?;
        self.cache.model().release(checkout.kv)?;
        Ok(checkout.lookup)
    }

    /// Serves `utterance` against `catalog`.
    pub fn call(
        &mut self,
        catalog: &Catalog,
        utterance: &str,
        progress: &mut dyn FnMut(PrefillProgress),
    ) -> Result<CallOutcome> {
        let (key, mut turn_ids) = self.prefix_ids(catalog)?;
        turn_ids.extend(self.tokenizer.encode(&render::turn(utterance)?)?);
        let tokenizer = &self.tokenizer;
        let turn = run_turn(
            &mut self.cache,
            &key,
            &turn_ids,
            &self.rules,
            &|ids| tokenizer.decode(ids),
            progress,
        )?;
        let call = parse_call(&turn.text);
        let problems = match &call {
            Ok(c) => catalog.check_call(c),
            Err(_) => Vec::new(),
        };
        Ok(CallOutcome {
            turn,
            call,
            problems,
        })
    }
}

/// How many tokens at the end of a catalog prefix change when another declaration follows,
/// measured on a two-function catalog against its first function alone.
fn unstable_tail(tokenizer: &Tokenizer) -> Result<usize> {
    let f = |name: &str| Function {
        name: name.into(),
        description: Some("x".into()),
        parameters: Default::default(),
        required: vec![],
    };
    let one = tokenizer.encode(&render::prefix(&Catalog {
        functions: vec![f("a")],
    }))?;
    let two = tokenizer.encode(&render::prefix(&Catalog {
        functions: vec![f("a"), f("b")],
    }))?;
    let common = one.iter().zip(&two).take_while(|(a, b)| a == b).count();
    Ok(one.len() - common)
}
