//! The driver: runs a script on a backend, keeps the expected state of every slot, and checks
//! every result against its ground truths.
//!
//! The KV states live in the contract's [`HandleTable`], as they do behind JNI: ops name slots
//! (the handles issued so far, in order), a released slot keeps its handle, and an op on it must
//! get [`Error::StaleHandle`] ("released") from the table without reaching the backend; an op
//! before the first handle uses the zero handle. After every op the table must hold exactly the
//! live slots.
//!
//! Each slot's model is its token history and the chunks (prefill, extend, step) that built it,
//! inherited through snapshots. After every op that produced a result, the result is checked:
//! 1. well formed: logits of vocab length, token their argmax, `len` equal to the history;
//! 2. bit-exact against a replay of the slot's chunks on a fresh state (same backend): a
//!    snapshot restored and continued must equal the run that never forked, bit for bit, and
//!    its last chunk run again with [`Logits::Skip`] must give the same token (the greedy token
//!    alone may be found another way: the int8-screened heads), on other backends than the
//!    reference unless the two tokens' logits are a near-tie within [`Tolerance`];
//! 3. within [`Tolerance`] of a one-shot prefill of the whole history (same backend), tokens
//!    equal unless the truth's margin is a near-tie: chunking invariance;
//! 4. within tolerance of the reference backend's one-shot prefill (other backends only);
//! 5. within tolerance of the oracle's goldens when the history is a prefix of a golden case.
//!
//! With [`Checks::Lean`] (slow backends) truth 2 is computed only for slots with a snapshot in
//! their lineage (for the others a replay repeats the very calls that made the slot, so it only
//! checks determinism), and on other backends truth 3 is left to truth 4: the same tolerance
//! against the reference's one-shot prefill, which costs microseconds instead of a device call.
//!
//! Ops whose inputs are invalid must return the error the contract names (checked by kind and
//! fields), and must change no slot: every op is followed by a length check of every live slot,
//! and the script ends with a probe step on every live slot, checked like any other op.

use kvsnap_contract::handles::reason;
use kvsnap_contract::{Error, HandleTable, KvModel, Logits, Next, Tolerance};
use kvsnap_reference::ReferenceModel;

use super::compare::{against_golden, bit_exact, well_formed, within_tolerance, Divergence};
use super::op::Op;
use crate::golden::Case;

/// The outcome of a check: the first divergence, boxed (it is large and rare).
type Checked = Result<(), Box<Divergence>>;

/// Which truths the driver computes for every result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Checks {
    /// Every truth: the bit-exact replay of every slot, the backend's own one-shot prefill of
    /// every history, and on other backends the reference's one-shot prefill.
    #[default]
    Full,
    /// For a slow backend: the bit-exact replay only of slots with a snapshot in their lineage,
    /// and on other backends the reference's one-shot prefill instead of the backend's own
    /// (both within the same tolerance). On the reference itself the own one-shot stays. What
    /// this gives up: the determinism of unforked slots (a replay of the same calls), and
    /// chunking invariance tighter than twice the tolerance on the backend itself.
    Lean,
}

/// What the driver checks against: the backend, the reference, the oracle.
pub struct Truths<'a, M: KvModel> {
    /// The backend under test.
    pub model: &'a M,
    /// The reference backend: the source of host-gathered embedding rows, and the cross-backend
    /// truth when `cross` is set.
    pub reference: &'a ReferenceModel,
    /// Whether to compare with `reference` (off when `model` is the reference itself).
    pub cross: bool,
    /// Golden cases of the oracle for this model (may be empty).
    pub goldens: &'a [Case],
    /// Tolerance of every non-bit-exact comparison.
    pub tolerance: Tolerance,
    /// Which truths are computed.
    pub checks: Checks,
}

/// What one or more script runs exercised, so a property can show it covered what it claims.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Scripts run.
    pub scripts: usize,
    /// Ops that succeeded and were checked (final probes included).
    pub valid_ops: usize,
    /// Ops that returned the expected error, by [`Error::kind`].
    pub errors: Vec<(&'static str, usize)>,
    /// Snapshots taken.
    pub snapshots: usize,
    /// Results checked on a slot that was created by a snapshot (or descends from one).
    pub after_snapshot: usize,
    /// Results compared bit for bit with a replay of their slot's chunks.
    pub replayed: usize,
    /// Results compared with the same backend's one-shot prefill.
    pub one_shot: usize,
    /// Results compared with the reference's one-shot prefill.
    pub reference: usize,
    /// Results checked at a position at or past the sliding window.
    pub past_window: usize,
    /// Results checked at the last position the context capacity allows.
    pub at_capacity: usize,
    /// Results checked against the oracle's goldens.
    pub golden: usize,
    /// Largest logit difference to the same backend's one-shot prefill.
    pub max_d_one_shot: f64,
    /// Largest logit difference to the reference's one-shot prefill.
    pub max_d_reference: f64,
    /// Largest top-k logit difference to the oracle.
    pub max_d_golden: f64,
}

impl Stats {
    /// How many ops returned the error of kind `kind`.
    pub fn errors_of(&self, kind: &str) -> usize {
        self.errors
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |e| e.1)
    }

    fn count_error(&mut self, kind: &'static str) {
        match self.errors.iter_mut().find(|(k, _)| *k == kind) {
            Some(e) => e.1 += 1,
            None => self.errors.push((kind, 1)),
        }
    }

    /// Adds the counts of `other`.
    pub fn merge(&mut self, other: &Stats) {
        self.scripts += other.scripts;
        self.valid_ops += other.valid_ops;
        for &(kind, n) in &other.errors {
            for _ in 0..n {
                self.count_error(kind);
            }
        }
        self.snapshots += other.snapshots;
        self.replayed += other.replayed;
        self.one_shot += other.one_shot;
        self.reference += other.reference;
        self.after_snapshot += other.after_snapshot;
        self.past_window += other.past_window;
        self.at_capacity += other.at_capacity;
        self.golden += other.golden;
        self.max_d_one_shot = self.max_d_one_shot.max(other.max_d_one_shot);
        self.max_d_reference = self.max_d_reference.max(other.max_d_reference);
        self.max_d_golden = self.max_d_golden.max(other.max_d_golden);
    }
}

/// One piece of a slot's history, as the backend received it.
#[derive(Clone, Debug, PartialEq)]
enum Chunk {
    Prefill(Vec<u32>),
    PrefillEmbeddings(Vec<u32>),
    Extend(Vec<u32>),
    Step(u32),
}

/// What the driver expects of a live KV state.
#[derive(Clone)]
struct Expected {
    /// Every token the state has seen.
    history: Vec<u32>,
    /// How the history reached the backend, fork ancestors included.
    chunks: Vec<Chunk>,
    /// Whether a snapshot is in this slot's lineage.
    forked: bool,
}

/// A handle the table issued, and the driver's model of its state (`None` once released).
struct Slot {
    handle: u64,
    state: Option<Expected>,
}

/// Runs scripts on one backend; see the module docs for what it checks.
pub struct Driver<'a, M: KvModel> {
    truths: &'a Truths<'a, M>,
    /// The KV states, behind the contract's handles.
    table: HandleTable<M::Kv>,
    /// Every handle issued, in order: what `Op` slot numbers name.
    slots: Vec<Slot>,
    stats: Stats,
}

/// Where the op under check is, for messages.
struct At<'o> {
    index: Option<usize>,
    op: &'o Op,
    label: Option<&'static str>,
}

/// A slot an op names: its index (none before the first handle), its handle, and the
/// stale-handle reason the table must give when it is not live.
struct Target {
    slot: Option<usize>,
    handle: u64,
    stale: Option<&'static str>,
}

impl<'a, M: KvModel> Driver<'a, M> {
    /// A driver with an empty handle table.
    pub fn new(truths: &'a Truths<'a, M>) -> Self {
        Driver {
            truths,
            table: HandleTable::new(),
            slots: Vec::new(),
            stats: Stats::default(),
        }
    }

    /// Runs `ops` from an empty table, then probes and releases every live slot. Returns what
    /// the run exercised, or the first divergence.
    pub fn run(mut self, ops: &[Op]) -> Result<Stats, Box<Divergence>> {
        self.stats.scripts = 1;
        for (i, op) in ops.iter().enumerate() {
            let at = At {
                index: Some(i),
                op,
                label: None,
            };
            self.apply(&at)?;
            self.check_lengths(&at)?;
        }
        self.close()?;
        Ok(self.stats)
    }

    fn cfg(&self) -> &kvsnap_contract::ModelConfig {
        self.truths.model.config()
    }

    fn diverged(&self, at: &At<'_>, slot: Option<usize>, pos: Option<usize>) -> DivergenceAt {
        DivergenceAt {
            base: Divergence {
                backend: self.truths.model.backend(),
                op_index: at.index,
                op: match at.label {
                    Some(label) => format!("{label} `{:?}`", at.op),
                    None => format!("{:?}", at.op),
                },
                slot,
                position: pos,
                truth: String::new(),
                detail: String::new(),
            },
        }
    }

    /// The slot `h` names: `h` modulo the handles issued so far; before the first one, the
    /// zero handle.
    fn target(&self, h: usize) -> Target {
        if self.slots.is_empty() {
            return Target {
                slot: None,
                handle: 0,
                stale: Some(reason::ZERO),
            };
        }
        let s = h % self.slots.len();
        Target {
            slot: Some(s),
            handle: self.slots[s].handle,
            stale: self.slots[s].state.is_none().then_some(reason::RELEASED),
        }
    }

    fn expected(&self, s: usize) -> &Expected {
        self.slots[s].state.as_ref().expect("a live slot")
    }

    fn apply(&mut self, at: &At<'_>) -> Checked {
        let model = self.truths.model;
        match at.op {
            Op::Prefill { ids } => {
                let want = self.input_errors(0, ids);
                let got = model.prefill(ids, Logits::Return);
                self.new_slot(at, want, got, Chunk::Prefill(ids.clone()))
            }
            Op::PrefillEmbeddings { ids, rows_delta } => {
                let rows = self.embedding_rows(ids, *rows_delta);
                let mut want = self.input_errors(0, ids);
                let hidden = self.cfg().hidden_size;
                if rows.len() != ids.len() * hidden {
                    want.push(Error::ShapeMismatch {
                        op: "prefill_embeddings",
                        what: "embeddings",
                        expected: vec![ids.len(), hidden],
                        got: vec![],
                    });
                }
                let got = model.prefill_embeddings(ids, &rows, Logits::Return);
                self.new_slot(at, want, got, Chunk::PrefillEmbeddings(ids.clone()))
            }
            Op::Extend { h, ids } => self.append(at, *h, ids, Chunk::Extend(ids.clone())),
            Op::Step { h, id } => self.append(at, *h, &[*id], Chunk::Step(*id)),
            Op::Snapshot { h } => {
                let t = self.target(*h);
                let got = self
                    .table
                    .with_ref("snapshot", t.handle, |kv| model.snapshot(kv));
                if let Some(reason) = t.stale {
                    let want = [stale(t.handle, reason)];
                    return self.check_error(at, t.slot, &want, got.map(|_| None));
                }
                let s = t.slot.expect("a live slot");
                let inserted = got.and_then(|kv| self.table.insert("snapshot", kv));
                match inserted {
                    Ok(handle) => {
                        let copy = Expected {
                            forked: true,
                            ..self.expected(s).clone()
                        };
                        self.slots.push(Slot {
                            handle,
                            state: Some(copy),
                        });
                        self.stats.snapshots += 1;
                        Ok(())
                    }
                    Err(e) => Err(self
                        .diverged(at, Some(s), None)
                        .truth("the contract (snapshot of a live state succeeds)")
                        .detail(format!("snapshot failed: {e}"))),
                }
            }
            Op::Release { h } => {
                let t = self.target(*h);
                let got = self.table.remove("release", t.handle);
                if let Some(reason) = t.stale {
                    let want = [stale(t.handle, reason)];
                    return self.check_error(at, t.slot, &want, got.map(|_| None));
                }
                let s = t.slot.expect("a live slot");
                self.slots[s].state = None;
                got.and_then(|kv| model.release(kv)).map_err(|e| {
                    self.diverged(at, Some(s), None)
                        .truth("the contract (release of a live state succeeds)")
                        .detail(format!("release failed: {e}"))
                })
            }
        }
    }

    /// Raw embedding rows of `ids` (zeros for out-of-range ids) with `delta` floats added or
    /// removed.
    fn embedding_rows(&self, ids: &[u32], delta: i32) -> Vec<f32> {
        let hidden = self.cfg().hidden_size;
        let vocab = self.cfg().vocab_size as u32;
        let mut rows = Vec::with_capacity(ids.len() * hidden);
        for &id in ids {
            match self.truths.reference.embedding_rows(&[id.min(vocab - 1)]) {
                Ok(row) if id < vocab => rows.extend(row),
                _ => rows.extend(std::iter::repeat_n(0.0, hidden)),
            }
        }
        let len = (rows.len() as i64 + delta as i64).max(0) as usize;
        rows.resize(len, 0.5);
        rows
    }

    /// Every error the contract allows for appending `ids` to `have` cached tokens (empty when
    /// the input is valid).
    fn input_errors(&self, have: usize, ids: &[u32]) -> Vec<Error> {
        let cfg = self.cfg();
        let mut errors = Vec::new();
        if ids.is_empty() {
            errors.push(Error::EmptyInput { op: "" });
        }
        if let Some(index) = ids.iter().position(|&t| t as usize >= cfg.vocab_size) {
            errors.push(Error::TokenOutOfRange {
                op: "",
                token: ids[index] as i64,
                index,
                vocab: cfg.vocab_size,
            });
        }
        if have + ids.len() > cfg.context_capacity {
            errors.push(Error::ContextOverflow {
                op: "",
                have,
                adding: ids.len(),
                capacity: cfg.context_capacity,
            });
        }
        errors
    }

    /// Checks an error against the allowed ones (kind and structured fields); `got` is `Ok`
    /// with the token, if the op returns one, when the backend accepted the op.
    fn check_error(
        &mut self,
        at: &At<'_>,
        slot: Option<usize>,
        want: &[Error],
        got: Result<Option<u32>, Error>,
    ) -> Checked {
        let kinds: Vec<&str> = want.iter().map(Error::kind).collect();
        match got {
            Ok(token) => Err(self
                .diverged(at, slot, None)
                .truth("the contract's input and handle checks")
                .detail(format!(
                    "expected an error of kind {kinds:?}, got Ok (token {token:?})"
                ))),
            Err(e) if want.iter().any(|w| same_error(&e, w)) => {
                self.stats.count_error(e.kind());
                Ok(())
            }
            Err(e) => Err(self
                .diverged(at, slot, None)
                .truth("the contract's input and handle checks")
                .detail(format!(
                    "expected an error of kind {kinds:?} ({want:?}), got {} ({e})",
                    e.kind()
                ))),
        }
    }

    fn new_slot(
        &mut self,
        at: &At<'_>,
        want: Vec<Error>,
        got: kvsnap_contract::Result<(M::Kv, Next)>,
        chunk: Chunk,
    ) -> Checked {
        if !want.is_empty() {
            return self.check_error(at, None, &want, got.map(|(_, next)| Some(next.token)));
        }
        let op = at.op.name();
        match got.and_then(|(kv, next)| Ok((self.table.insert(op, kv)?, next))) {
            Ok((handle, next)) => {
                let ids = match &chunk {
                    Chunk::Prefill(ids) | Chunk::PrefillEmbeddings(ids) => ids.clone(),
                    _ => unreachable!("a new slot starts with a prefill"),
                };
                self.slots.push(Slot {
                    handle,
                    state: Some(Expected {
                        history: ids,
                        chunks: vec![chunk],
                        forked: false,
                    }),
                });
                self.check_result(at, self.slots.len() - 1, &next)
            }
            Err(e) => Err(self
                .diverged(at, None, None)
                .truth("the contract (valid input)")
                .detail(format!("unexpected error {}: {e}", e.kind()))),
        }
    }

    fn append(&mut self, at: &At<'_>, h: usize, ids: &[u32], chunk: Chunk) -> Checked {
        let op = at.op.name();
        let model = self.truths.model;
        let t = self.target(h);
        let got = self.table.with_mut(op, t.handle, |kv| match chunk {
            Chunk::Step(id) => model.step(kv, id, Logits::Return),
            _ => model.extend(kv, ids, Logits::Return),
        });
        if let Some(reason) = t.stale {
            let want = [stale(t.handle, reason)];
            return self.check_error(at, t.slot, &want, got.map(|next| Some(next.token)));
        }
        let s = t.slot.expect("a live slot");
        let have = self.expected(s).history.len();
        let want = self.input_errors(have, ids);
        if !want.is_empty() {
            return self.check_error(at, Some(s), &want, got.map(|next| Some(next.token)));
        }
        match got {
            Ok(next) => {
                let state = self.slots[s].state.as_mut().expect("a live slot");
                state.history.extend_from_slice(ids);
                state.chunks.push(chunk);
                self.check_result(at, s, &next)
            }
            Err(e) => Err(self
                .diverged(at, Some(s), Some(have + ids.len() - 1))
                .truth("the contract (valid input)")
                .detail(format!("unexpected error {}: {e}", e.kind()))),
        }
    }

    /// Checks the result `next` of an op that left slot `s` with its current history.
    fn check_result(&mut self, at: &At<'_>, s: usize, next: &Next) -> Checked {
        let t = self.truths;
        let cfg = t.model.config();
        let slot = self.expected(s);
        let n = slot.history.len();
        let pos = Some(n - 1);
        let fail = |truth: &str, detail: String| {
            self.diverged(at, Some(s), pos).truth(truth).detail(detail)
        };

        well_formed(next, cfg.vocab_size).map_err(|d| fail("the contract", d))?;
        let len = self.len_of(s);
        if len != Ok(n) {
            return Err(fail(
                "the contract",
                format!("len() is {len:?}, the history has {n} tokens"),
            ));
        }
        let lean = t.checks == Checks::Lean;
        // Lean: an unforked slot's replay repeats the calls that made it (determinism only).
        let replay = !lean || slot.forked;
        if replay {
            let replayed = self.replay(&slot.chunks).map_err(|e| {
                fail(
                    "a replay of the slot's chunks on a fresh state",
                    format!("failed: {e}"),
                )
            })?;
            let (replayed, skip_token) = replayed;
            // The reference's screened head promises the very token; another backend's (IREE
            // recomputes its candidates in its own summation order) a token whose logit is
            // within the tolerance of the best: a near-tie may go either way.
            let near_tie = t.cross
                && replayed.logits.as_deref().is_some_and(|l| {
                    l.get(skip_token as usize).is_some_and(|&v| {
                        t.tolerance
                            .accepts(f64::from(v), f64::from(l[replayed.token as usize]))
                    })
                });
            if skip_token != next.token && !near_tie {
                return Err(fail(
                    "the replay's last chunk run again with Logits::Skip (the greedy token alone)",
                    format!("token {} with logits, {skip_token} without", next.token),
                ));
            }
            bit_exact(next, &replayed).map_err(|d| {
                fail(
                    &format!(
                        "a replay of the slot's {} chunks on a fresh state without forks (same \
                         backend, bit-exact): {:?}",
                        slot.chunks.len(),
                        slot.chunks
                    ),
                    d,
                )
            })?;
        }

        // A history made by one plain prefill is its own one-shot (a replay, when computed,
        // covered it). Lean, on another backend: the reference's one-shot below is the truth.
        let one_shot_is_replay = matches!(slot.chunks.as_slice(), [Chunk::Prefill(_)]);
        let own_one_shot = !one_shot_is_replay && (!lean || !t.cross);
        let mut max_d_one_shot = 0.0f64;
        if own_one_shot {
            let (_, one_shot) = t
                .model
                .prefill(&slot.history, Logits::Return)
                .map_err(|e| fail("a one-shot prefill of the history", format!("failed: {e}")))?;
            max_d_one_shot = within_tolerance(next, &one_shot, t.tolerance).map_err(|d| {
                fail(
                    &format!(
                        "a one-shot prefill of the slot's {n}-token history (same backend, \
                         tolerance {:?})",
                        t.tolerance
                    ),
                    d,
                )
            })?;
        }

        let mut max_d_reference = 0.0f64;
        if t.cross {
            let (_, truth) = t
                .reference
                .prefill(&slot.history, Logits::Return)
                .map_err(|e| fail("the reference's one-shot prefill", format!("failed: {e}")))?;
            max_d_reference = within_tolerance(next, &truth, t.tolerance).map_err(|d| {
                fail(
                    &format!(
                        "the reference backend's one-shot prefill of the {n}-token history \
                         (tolerance {:?})",
                        t.tolerance
                    ),
                    d,
                )
            })?;
        }

        let mut golden = None;
        for case in t.goldens {
            if case.positions.len() >= n && (0..n).all(|p| case.token(p) == slot.history[p]) {
                let d = against_golden(next, case.position(n - 1), t.tolerance).map_err(|d| {
                    fail(
                        &format!(
                            "the oracle's golden case `{}` position {} (tolerance {:?})",
                            case.name,
                            n - 1,
                            t.tolerance
                        ),
                        d,
                    )
                })?;
                golden = Some(d);
                break;
            }
        }

        let forked = slot.forked;
        let st = &mut self.stats;
        st.valid_ops += 1;
        st.replayed += replay as usize;
        st.one_shot += own_one_shot as usize;
        st.reference += t.cross as usize;
        st.after_snapshot += forked as usize;
        st.past_window += (n > cfg.sliding_window) as usize;
        st.at_capacity += (n == cfg.context_capacity) as usize;
        st.max_d_one_shot = st.max_d_one_shot.max(max_d_one_shot);
        st.max_d_reference = st.max_d_reference.max(max_d_reference);
        if let Some(d) = golden {
            st.golden += 1;
            st.max_d_golden = st.max_d_golden.max(d);
        }
        Ok(())
    }

    /// Runs `chunks` on a fresh state of the backend; returns the last result, and the token of
    /// the last chunk run again with [`Logits::Skip`] (on a snapshot of the state before it, or
    /// as a second prefill): the greedy token alone, which a backend may find another way
    /// (the reference's int8-screened head), must be the same.
    fn replay(&self, chunks: &[Chunk]) -> kvsnap_contract::Result<(Next, u32)> {
        let model = self.truths.model;
        let (first, rest) = chunks.split_first().expect("a slot has a first chunk");
        let start = |logits| match first {
            Chunk::Prefill(ids) => model.prefill(ids, logits),
            Chunk::PrefillEmbeddings(ids) => {
                model.prefill_embeddings(ids, &self.embedding_rows(ids, 0), logits)
            }
            other => unreachable!("a slot starts with a prefill, not {other:?}"),
        };
        let run = |kv: &mut M::Kv, chunk: &Chunk, logits| match chunk {
            Chunk::Extend(ids) => model.extend(kv, ids, logits),
            Chunk::Step(id) => model.step(kv, *id, logits),
            other => unreachable!("a prefill only starts a slot, not {other:?}"),
        };
        let (mut kv, next) = start(Logits::Return)?;
        let Some((last, middle)) = rest.split_last() else {
            let (again, skip) = start(Logits::Skip)?;
            model.release(again)?;
            model.release(kv)?;
            return Ok((next, skip.token));
        };
        for chunk in middle {
            run(&mut kv, chunk, Logits::Return)?;
        }
        let mut fork = model.snapshot(&kv)?;
        let next = run(&mut kv, last, Logits::Return)?;
        let skip = run(&mut fork, last, Logits::Skip)?;
        model.release(fork)?;
        model.release(kv)?;
        Ok((next, skip.token))
    }

    /// `len()` of the state in live slot `s`, through the table.
    fn len_of(&self, s: usize) -> Result<usize, String> {
        let model = self.truths.model;
        self.table
            .with_ref("len", self.slots[s].handle, |kv| Ok(model.len(kv)))
            .map_err(|e| e.to_string())
    }

    /// After every op: the table holds exactly the live slots, each with its history's length.
    fn check_lengths(&self, at: &At<'_>) -> Checked {
        let live = self.slots.iter().filter(|s| s.state.is_some()).count();
        if self.table.live() != live {
            return Err(self
                .diverged(at, None, None)
                .truth("the driver's model of the handle table")
                .detail(format!(
                    "{} live handles after this op, the driver expects {live}",
                    self.table.live()
                )));
        }
        for (s, slot) in self.slots.iter().enumerate() {
            let Some(state) = &slot.state else { continue };
            let len = self.len_of(s);
            if len != Ok(state.history.len()) {
                return Err(self
                    .diverged(at, Some(s), None)
                    .truth("the driver's model of every live slot")
                    .detail(format!(
                        "len() of slot {s} is {len:?} after this op, its history has {}",
                        state.history.len()
                    )));
            }
        }
        Ok(())
    }

    /// Probes every live slot with one more step (so a slot an earlier op damaged shows it even
    /// if the script never used it again), then closes the table and releases every state.
    fn close(&mut self) -> Checked {
        let vocab = self.cfg().vocab_size as u64;
        for s in 0..self.slots.len() {
            let Some(state) = &self.slots[s].state else {
                continue;
            };
            let id = ((state.history.len() as u64 * 7919 + 3) % vocab) as u32;
            let probe = Op::Step { h: s, id };
            let at = At {
                index: None,
                op: &probe,
                label: Some("closing probe"),
            };
            self.apply(&at)?;
        }
        let close = Op::Release { h: 0 };
        let at = At {
            index: None,
            op: &close,
            label: Some("closing the table, then releasing every state"),
        };
        let states = self.table.close();
        let live = self.slots.iter().filter(|s| s.state.is_some()).count();
        if states.len() != live {
            return Err(self
                .diverged(&at, None, None)
                .truth("the driver's model of the handle table")
                .detail(format!(
                    "closing returned {} states, the driver expects {live}",
                    states.len()
                )));
        }
        for kv in states {
            if let Err(e) = self.truths.model.release(kv) {
                return Err(self
                    .diverged(&at, None, None)
                    .truth("the contract (release of a live state succeeds)")
                    .detail(format!("release failed: {e}")));
            }
        }
        Ok(())
    }
}

/// The error the handle table gives for `handle`.
fn stale(handle: u64, reason: &'static str) -> Error {
    Error::StaleHandle {
        op: "",
        handle,
        reason,
    }
}

/// A [`Divergence`] under construction.
struct DivergenceAt {
    base: Divergence,
}

impl DivergenceAt {
    fn truth(mut self, truth: &str) -> Self {
        self.base.truth = truth.to_string();
        self
    }

    fn detail(mut self, detail: String) -> Box<Divergence> {
        self.base.detail = detail;
        Box::new(self.base)
    }
}

/// Whether `got` is the error `want` describes: same kind and the same structured fields
/// (the `op` name and the `got` shape are not compared).
fn same_error(got: &Error, want: &Error) -> bool {
    use Error::*;
    match (got, want) {
        (EmptyInput { .. }, EmptyInput { .. }) => true,
        (
            TokenOutOfRange {
                token,
                index,
                vocab,
                ..
            },
            TokenOutOfRange {
                token: t,
                index: i,
                vocab: v,
                ..
            },
        ) => (token, index, vocab) == (t, i, v),
        (
            ContextOverflow {
                have,
                adding,
                capacity,
                ..
            },
            ContextOverflow {
                have: h,
                adding: a,
                capacity: c,
                ..
            },
        ) => (have, adding, capacity) == (h, a, c),
        (
            ShapeMismatch { what, expected, .. },
            ShapeMismatch {
                what: w,
                expected: e,
                ..
            },
        ) => (what, expected) == (w, e),
        (
            StaleHandle { handle, reason, .. },
            StaleHandle {
                handle: h,
                reason: r,
                ..
            },
        ) => (handle, reason) == (h, r),
        _ => false,
    }
}
