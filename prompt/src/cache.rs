//! The prefix cache: KV snapshots of prompt prefixes, keyed by their token ids.
//!
//! Each cached prefix is prefilled once; a request gets an independent snapshot of it to extend
//! and step. A prefix that starts with a cached one is computed by extending a snapshot of the
//! longest such entry (a catalog that adds functions to another's pays only for the new ones)
//! and is cached in turn. Entries live under a byte budget measured with
//! [`KvModel::kv_bytes`]; the least recently used go first when a new one needs room.
//!
//! The contract has no truncation, so a cached prefix that merely shares its first tokens with a
//! request (without being a prefix of it) cannot serve it.

use std::time::Instant;

use kvsnap_contract::{Error as ModelError, KvModel, Logits};

use crate::error::{Error, Result};

/// Tokens per prefill call when a prefix is computed, so progress can be reported.
pub const DEFAULT_CHUNK: usize = 256;

/// How a prefix was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The whole prefix was cached.
    Hit,
    /// A cached prefix of `reused` tokens was extended by the rest.
    Extended { reused: usize },
    /// Nothing reusable was cached: prefilled from the first token.
    Miss,
}

/// Progress of computing one prefix: `done` of `total` tokens are in its KV state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillProgress {
    pub done: usize,
    pub total: usize,
}

/// A snapshot of a cached prefix, handed out to serve one request.
pub struct Checkout<K> {
    /// The caller's own KV state holding the prefix; extending it never changes the cache.
    pub kv: K,
    /// How the prefix was found.
    pub lookup: Lookup,
    /// Tokens in the prefix.
    pub prefix_len: usize,
    /// Tokens computed for this request (0 on a hit).
    pub prefilled: usize,
    /// Seconds spent computing them.
    pub prefill_s: f64,
    /// Seconds spent copying the cached state into `kv`.
    pub restore_s: f64,
}

/// Counters of a [`PrefixCache`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Requests whose whole prefix was cached.
    pub hits: u64,
    /// Requests served by extending a shorter cached prefix.
    pub extended: u64,
    /// Requests prefilled from the first token.
    pub misses: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
    /// Entries cached now.
    pub entries: usize,
    /// Bytes of KV state cached now.
    pub bytes: u64,
    /// The byte budget.
    pub budget: u64,
    /// Prefix tokens computed by the model, over all requests.
    pub prefilled_tokens: u64,
    /// Seconds spent computing them.
    pub prefill_s: f64,
    /// Prefix tokens served from the cache instead of computed.
    pub reused_tokens: u64,
}

impl CacheStats {
    /// Measured prefill rate in tokens per second, once anything was prefilled.
    pub fn prefill_rate(&self) -> Option<f64> {
        (self.prefilled_tokens > 0 && self.prefill_s > 0.0)
            .then(|| self.prefilled_tokens as f64 / self.prefill_s)
    }
}

struct Entry<K> {
    key: Vec<u32>,
    kv: K,
    bytes: u64,
    last_used: u64,
}

/// KV snapshots of prompt prefixes for one model, under a byte budget with LRU eviction.
pub struct PrefixCache<'m, M: KvModel> {
    model: &'m M,
    budget: u64,
    chunk: usize,
    entries: Vec<Entry<M::Kv>>,
    clock: u64,
    stats: CacheStats,
}

impl<'m, M: KvModel> PrefixCache<'m, M> {
    /// An empty cache for `model` holding at most `budget` bytes of KV state.
    pub fn new(model: &'m M, budget: u64) -> Self {
        PrefixCache {
            model,
            budget,
            chunk: DEFAULT_CHUNK,
            entries: Vec::new(),
            clock: 0,
            stats: CacheStats {
                budget,
                ..CacheStats::default()
            },
        }
    }

    /// Computes prefixes `chunk` tokens per model call (at least 1).
    pub fn with_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    /// The model whose states are cached.
    pub fn model(&self) -> &'m M {
        self.model
    }

    /// The counters, with the current entry count and bytes.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.entries.len(),
            bytes: self.bytes(),
            ..self.stats.clone()
        }
    }

    /// Whether exactly `prefix` is cached.
    pub fn contains(&self, prefix: &[u32]) -> bool {
        self.entries.iter().any(|e| e.key == prefix)
    }

    /// Token lengths of the cached prefixes, most recently used first.
    pub fn cached_lengths(&self) -> Vec<usize> {
        let mut entries: Vec<&Entry<M::Kv>> = self.entries.iter().collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.last_used));
        entries.iter().map(|e| e.key.len()).collect()
    }

    /// A snapshot of `prefix`'s KV state, computing and caching it first if needed.
    pub fn checkout(&mut self, prefix: &[u32]) -> Result<Checkout<M::Kv>> {
        self.checkout_with_progress(prefix, &mut |_| {})
    }

    /// [`PrefixCache::checkout`], reporting progress after each chunk it computes.
    ///
    /// Errors: [`Error::EmptyPrefix`]; the model's errors; `KvBudget` when the prefix alone
    /// needs more bytes than the budget (nothing is evicted then).
    pub fn checkout_with_progress(
        &mut self,
        prefix: &[u32],
        progress: &mut dyn FnMut(PrefillProgress),
    ) -> Result<Checkout<M::Kv>> {
        if prefix.is_empty() {
            return Err(Error::EmptyPrefix);
        }
        self.clock += 1;
        let base = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| prefix.starts_with(&e.key))
            .max_by_key(|(_, e)| e.key.len())
            .map(|(i, _)| i);

        if let Some(i) = base.filter(|&i| self.entries[i].key.len() == prefix.len()) {
            let entry = &mut self.entries[i];
            entry.last_used = self.clock;
            let t = Instant::now();
            let kv = self.model.snapshot(&entry.kv)?;
            self.stats.hits += 1;
            self.stats.reused_tokens += prefix.len() as u64;
            return Ok(Checkout {
                kv,
                lookup: Lookup::Hit,
                prefix_len: prefix.len(),
                prefilled: 0,
                prefill_s: 0.0,
                restore_s: t.elapsed().as_secs_f64(),
            });
        }

        let t = Instant::now();
        let (kv, lookup) = match base {
            Some(i) => {
                let entry = &mut self.entries[i];
                entry.last_used = self.clock;
                let reused = entry.key.len();
                let kv = self.model.snapshot(&entry.kv)?;
                let kv = self.run(Some(kv), prefix, reused, progress)?;
                (kv, Lookup::Extended { reused })
            }
            None => (self.run(None, prefix, 0, progress)?, Lookup::Miss),
        };
        let prefill_s = t.elapsed().as_secs_f64();
        let reused = match lookup {
            Lookup::Extended { reused } => reused,
            _ => 0,
        };
        match lookup {
            Lookup::Extended { .. } => self.stats.extended += 1,
            _ => self.stats.misses += 1,
        }
        self.stats.prefilled_tokens += (prefix.len() - reused) as u64;
        self.stats.prefill_s += prefill_s;
        self.stats.reused_tokens += reused as u64;

        let bytes = self.model.kv_bytes(&kv);
        if bytes > self.budget {
            self.model.release(kv)?;
            return Err(ModelError::KvBudget {
                op: "prefix cache",
                live: 0,
                adding: bytes,
                cap: self.budget,
            }
            .into());
        }
        self.make_room(bytes)?;
        let t = Instant::now();
        let copy = self.model.snapshot(&kv)?;
        let restore_s = t.elapsed().as_secs_f64();
        self.entries.push(Entry {
            key: prefix.to_vec(),
            kv,
            bytes,
            last_used: self.clock,
        });
        Ok(Checkout {
            kv: copy,
            lookup,
            prefix_len: prefix.len(),
            prefilled: prefix.len() - reused,
            prefill_s,
            restore_s,
        })
    }

    /// Drops every entry.
    pub fn clear(&mut self) -> Result<()> {
        for e in self.entries.drain(..) {
            self.model.release(e.kv)?;
        }
        Ok(())
    }

    fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Evicts least recently used entries until `adding` more bytes fit.
    fn make_room(&mut self, adding: u64) -> Result<()> {
        while self.bytes() + adding > self.budget {
            let Some((i, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
            else {
                break;
            };
            let e = self.entries.swap_remove(i);
            self.stats.evictions += 1;
            self.model.release(e.kv)?;
        }
        Ok(())
    }

    /// Runs `prefix[from..]` chunk by chunk on `kv` (a fresh sequence when `None`).
    fn run(
        &self,
        mut kv: Option<M::Kv>,
        prefix: &[u32],
        from: usize,
        progress: &mut dyn FnMut(PrefillProgress),
    ) -> Result<M::Kv> {
        let total = prefix.len();
        let mut done = from;
        for chunk in prefix[from..].chunks(self.chunk) {
            kv = Some(match kv {
                None => self.model.prefill(chunk, Logits::Skip)?.0,
                Some(mut kv) => {
                    self.model.extend(&mut kv, chunk, Logits::Skip)?;
                    kv
                }
            });
            done += chunk.len();
            progress(PrefillProgress { done, total });
        }
        // `from < total` on every path that gets here, so at least one chunk ran.
        kv.ok_or(Error::EmptyPrefix)
    }
}
