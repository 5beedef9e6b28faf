//! Script generators: one per property, all built from the same ops.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

use super::op::{Op, Script};

/// Sizes the generators work with, taken from the model under test.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Vocabulary size: valid ids are `0..vocab`.
    pub vocab: u32,
    /// Context capacity of every KV state.
    pub capacity: usize,
    /// Hidden size (one embedding row).
    pub hidden: usize,
    /// Longest chunk of valid ids one op appends.
    pub max_chunk: usize,
    /// Most ops a script has after its opening prefill.
    pub max_ops: usize,
}

/// Slot names the generators use: more than a script usually has, so `h % slots` spreads.
const SLOT_NAMES: usize = 6;

fn ids(shape: &Shape, len: std::ops::RangeInclusive<usize>) -> BoxedStrategy<Vec<u32>> {
    vec(0..shape.vocab, len).boxed()
}

fn chunk(shape: &Shape) -> BoxedStrategy<Vec<u32>> {
    ids(shape, 1..=shape.max_chunk)
}

fn slot() -> BoxedStrategy<usize> {
    (0..SLOT_NAMES).boxed()
}

/// Valid-looking ids with one id out of range, at any index.
fn bad_ids(shape: &Shape) -> BoxedStrategy<Vec<u32>> {
    let bad = prop_oneof![shape.vocab..shape.vocab + 16, Just(u32::MAX)];
    (chunk(shape), any::<Index>(), bad)
        .prop_map(|(mut ids, at, bad)| {
            let i = at.index(ids.len());
            ids[i] = bad;
            ids
        })
        .boxed()
}

/// One op with valid inputs on a random slot (which may be released).
fn valid_op(shape: &Shape, weights: [u32; 6]) -> BoxedStrategy<Op> {
    let [prefill, embeddings, extend, step, snapshot, release] = weights;
    let vocab = shape.vocab;
    prop_oneof![
        prefill => chunk(shape).prop_map(|ids| Op::Prefill { ids }),
        embeddings => chunk(shape).prop_map(|ids| Op::PrefillEmbeddings { ids, rows_delta: 0 }),
        extend => (slot(), chunk(shape)).prop_map(|(h, ids)| Op::Extend { h, ids }),
        step => (slot(), 0..vocab).prop_map(|(h, id)| Op::Step { h, id }),
        snapshot => slot().prop_map(|h| Op::Snapshot { h }),
        release => slot().prop_map(|h| Op::Release { h }),
    ]
    .boxed()
}

/// One op whose input the contract must refuse (stale handles come from `Release` ops).
fn invalid_op(shape: &Shape) -> BoxedStrategy<Op> {
    let (vocab, capacity, hidden) = (shape.vocab, shape.capacity, shape.hidden as i32);
    let shape = shape.clone();
    prop_oneof![
        Just(Op::Prefill { ids: vec![] }),
        slot().prop_map(|h| Op::Extend { h, ids: vec![] }),
        (slot(), prop_oneof![vocab..vocab + 16, Just(u32::MAX)])
            .prop_map(|(h, id)| Op::Step { h, id }),
        bad_ids(&shape).prop_map(|ids| Op::Prefill { ids }),
        (slot(), bad_ids(&shape)).prop_map(|(h, ids)| Op::Extend { h, ids }),
        // Overflows whenever the slot holds more than `capacity - len` tokens.
        (slot(), ids(&shape, capacity / 2..=capacity)).prop_map(|(h, ids)| Op::Extend { h, ids }),
        ids(&shape, capacity + 1..=capacity + 2).prop_map(|ids| Op::Prefill { ids }),
        (chunk(&shape), prop_oneof![-hidden - 1..=-1, 1..=hidden + 1])
            .prop_map(|(ids, rows_delta)| Op::PrefillEmbeddings { ids, rows_delta }),
    ]
    .boxed()
}

/// A prefill of a random chunk, so that the ops after it have a slot to work on.
fn opening(shape: &Shape) -> BoxedStrategy<Op> {
    chunk(shape).prop_map(|ids| Op::Prefill { ids }).boxed()
}

/// `opening` ops, then up to `shape.max_ops` ops from `op`.
fn script(
    opening: Vec<BoxedStrategy<Op>>,
    op: BoxedStrategy<Op>,
    max_ops: usize,
) -> BoxedStrategy<Script> {
    (opening, vec(op, 0..=max_ops))
        .prop_map(|(mut ops, rest)| {
            ops.extend(rest);
            Script(ops)
        })
        .boxed()
}

/// Everything mixed: prefills of both kinds, appends, snapshots, releases, a few invalid ops.
pub fn mixed(shape: &Shape) -> BoxedStrategy<Script> {
    let op = prop_oneof![
        15 => valid_op(shape, [2, 1, 4, 4, 2, 1]),
        1 => invalid_op(shape),
    ];
    script(vec![opening(shape)], op.boxed(), shape.max_ops)
}

/// One prompt (up to the capacity) split into a prefill (ids or embeddings) and extend and step
/// chunks, all on slot 0.
pub fn chunked_prompt(shape: &Shape) -> BoxedStrategy<Script> {
    let capacity = shape.capacity;
    (vec((chunk(shape), any::<bool>()), 1..=shape.max_ops + 1))
        .prop_map(move |chunks| {
            let mut ops = Vec::new();
            let mut len = 0;
            for (i, (mut ids, flavour)) in chunks.into_iter().enumerate() {
                ids.truncate(capacity - len);
                if ids.is_empty() {
                    break;
                }
                len += ids.len();
                ops.push(match (i, ids.len(), flavour) {
                    (0, _, false) => Op::Prefill { ids },
                    (0, _, true) => Op::PrefillEmbeddings { ids, rows_delta: 0 },
                    (_, 1, true) => Op::Step { h: 0, id: ids[0] },
                    _ => Op::Extend { h: 0, ids },
                });
            }
            Script(ops)
        })
        .boxed()
}

/// A prefill and a snapshot of it, then appends on the original and the copies, more
/// snapshots and releases.
pub fn forks(shape: &Shape) -> BoxedStrategy<Script> {
    script(
        vec![opening(shape), Just(Op::Snapshot { h: 0 }).boxed()],
        valid_op(shape, [1, 0, 4, 4, 3, 2]),
        shape.max_ops,
    )
}

/// Mostly invalid ops, between enough valid ones (and releases) to give them live and stale
/// slots of every length.
pub fn invalid_heavy(shape: &Shape) -> BoxedStrategy<Script> {
    let op = prop_oneof![
        3 => invalid_op(shape),
        2 => valid_op(shape, [1, 0, 2, 2, 1, 2]),
    ];
    script(
        vec![opening(shape), Just(Op::Snapshot { h: 0 }).boxed()],
        op.boxed(),
        shape.max_ops,
    )
}

/// One golden sequence (`ids + greedy` of a case) fed in random chunks: at random chunk
/// boundaries the current slot is snapshotted, the original diverges with random tokens (or is
/// released) and the sequence goes on in the copy. When the sequence is longer than the
/// capacity, the chunk that would cross it must be refused, the rest up to exactly the capacity
/// accepted, and one more step refused.
pub fn golden_walk(shape: &Shape, sequences: Vec<Vec<u32>>) -> BoxedStrategy<Script> {
    assert!(
        !sequences.is_empty(),
        "golden_walk needs at least one sequence"
    );
    let capacity = shape.capacity;
    let fork = (any::<bool>(), any::<bool>(), chunk(shape));
    let piece = (1..=shape.max_chunk, prop::option::weighted(0.3, fork));
    (
        any::<Index>(),
        any::<bool>(),
        vec(piece, 1..=shape.max_ops + 1),
    )
        .prop_map(move |(case, embeddings, pieces)| {
            let seq = &sequences[case.index(sequences.len())];
            let mut ops = Vec::new();
            let (mut cur, mut slots, mut pos) = (0, 0, 0);
            for (i, (len, fork)) in pieces.into_iter().enumerate() {
                if pos >= seq.len() {
                    break;
                }
                let end = (pos + len).min(seq.len());
                if i == 0 {
                    let ids = seq[..end.min(capacity)].to_vec();
                    ops.push(if embeddings {
                        Op::PrefillEmbeddings { ids, rows_delta: 0 }
                    } else {
                        Op::Prefill { ids }
                    });
                    slots = 1;
                    pos = end.min(capacity);
                    continue;
                }
                let ids = seq[pos..end].to_vec();
                if let Some((release, step, tokens)) = fork {
                    ops.push(Op::Snapshot { h: cur });
                    let original = cur;
                    cur = slots;
                    slots += 1;
                    ops.push(match (release, step) {
                        (true, _) => Op::Release { h: original },
                        (false, true) => Op::Step {
                            h: original,
                            id: tokens[0],
                        },
                        (false, false) => Op::Extend {
                            h: original,
                            ids: tokens,
                        },
                    });
                }
                if end > capacity {
                    ops.push(Op::Extend { h: cur, ids });
                    if pos < capacity {
                        ops.push(Op::Extend {
                            h: cur,
                            ids: seq[pos..capacity].to_vec(),
                        });
                        pos = capacity;
                    }
                    ops.push(Op::Step {
                        h: cur,
                        id: seq[pos],
                    });
                    break;
                }
                ops.push(match ids.as_slice() {
                    [id] => Op::Step { h: cur, id: *id },
                    _ => Op::Extend { h: cur, ids },
                });
                pos = end;
            }
            Script(ops)
        })
        .boxed()
}
