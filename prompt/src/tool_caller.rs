//! [`ToolCaller`]: utterances in, parsed function calls out, for one model and tokenizer.

use kvsnap_contract::KvModel;

use crate::cache::{Lookup, PrefillProgress, PrefixCache};
use crate::call::{parse_call, CallError, FunctionCall};
use crate::catalog::{Catalog, CatalogProblem};
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
pub struct ToolCaller<'m, M: KvModel> {
    cache: PrefixCache<'m, M>,
    tokenizer: Tokenizer,
    rules: StopRules,
}

impl<'m, M: KvModel> ToolCaller<'m, M> {
    /// A caller over `model` with a prefix cache of `budget` bytes, generating at most
    /// `max_new_tokens` per utterance.
    pub fn new(model: &'m M, tokenizer: Tokenizer, budget: u64, max_new_tokens: usize) -> Self {
        let rules = StopRules::new(model.config(), tokenizer.end_of_turn(), max_new_tokens);
        ToolCaller {
            cache: PrefixCache::new(model, budget),
            tokenizer,
            rules,
        }
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

    /// Token ids of `catalog`'s prefix, `<bos>` first: the cache key.
    pub fn prefix_ids(&self, catalog: &Catalog) -> Result<Vec<u32>> {
        self.tokenizer.encode_with_bos(&render::prefix(catalog))
    }

    /// Makes sure `catalog`'s prefix is cached (prefilling it if needed) without serving a turn;
    /// says how it was found. The time it took is in the cache's stats.
    pub fn warm(
        &mut self,
        catalog: &Catalog,
        progress: &mut dyn FnMut(PrefillProgress),
    ) -> Result<Lookup> {
        let prefix = self.prefix_ids(catalog)?;
        let checkout = self.cache.checkout_with_progress(&prefix, progress)?;
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
        let prefix = self.prefix_ids(catalog)?;
        let turn_ids = self.tokenizer.encode(&render::turn(utterance)?)?;
        let tokenizer = &self.tokenizer;
        let turn = run_turn(
            &mut self.cache,
            &prefix,
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
