//! Operations of a property script, and how a failing script prints as a replayable test.

use std::fmt;

/// One operation of a script, applied by the [`crate::props::Driver`].
///
/// `h` names a slot of the driver's handle table: slots are numbered in the order prefills and
/// snapshots created them and `h` is taken modulo their number, so every script means something
/// even after shrinking removed the op that created a slot. A released slot stays in the table,
/// so ops on it exercise the stale-handle path.
///
/// Ops are not labelled valid or invalid: the driver decides from its model of the state
/// (released slot, empty input, token out of range, capacity, embeddings shape) which error, if
/// any, the backend must return.
#[derive(Clone, PartialEq, Eq)]
pub enum Op {
    /// `prefill(ids)` into a new slot.
    Prefill { ids: Vec<u32> },
    /// `prefill_embeddings(ids, rows)` into a new slot; the rows are the model's raw embedding
    /// rows of `ids` with `rows_delta` floats added (filled with 0.5) or removed, so any
    /// `rows_delta != 0` is a wrong shape.
    PrefillEmbeddings { ids: Vec<u32>, rows_delta: i32 },
    /// `extend(h, ids)`.
    Extend { h: usize, ids: Vec<u32> },
    /// `step(h, id)`.
    Step { h: usize, id: u32 },
    /// `snapshot(h)` into a new slot.
    Snapshot { h: usize },
    /// `release(h)`; the slot stays in the table, released.
    Release { h: usize },
}

impl Op {
    /// The contract operation's name, as backends put it in their errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Prefill { .. } => "prefill",
            Op::PrefillEmbeddings { .. } => "prefill_embeddings",
            Op::Extend { .. } => "extend",
            Op::Step { .. } => "step",
            Op::Snapshot { .. } => "snapshot",
            Op::Release { .. } => "release",
        }
    }

    /// The slot the op acts on, if it acts on one.
    pub fn slot(&self) -> Option<usize> {
        match *self {
            Op::Extend { h, .. } | Op::Step { h, .. } | Op::Snapshot { h } | Op::Release { h } => {
                Some(h)
            }
            Op::Prefill { .. } | Op::PrefillEmbeddings { .. } => None,
        }
    }
}

/// Rust source of a `Vec<u32>` literal.
struct IdsLiteral<'a>(&'a [u32]);

impl fmt::Display for IdsLiteral<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("vec![")?;
        for (i, id) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{id}")?;
        }
        f.write_str("]")
    }
}

impl fmt::Debug for Op {
    /// Prints the op as the Rust expression that builds it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Prefill { ids } => write!(f, "Op::Prefill {{ ids: {} }}", IdsLiteral(ids)),
            Op::PrefillEmbeddings { ids, rows_delta } => write!(
                f,
                "Op::PrefillEmbeddings {{ ids: {}, rows_delta: {rows_delta} }}",
                IdsLiteral(ids)
            ),
            Op::Extend { h, ids } => {
                write!(f, "Op::Extend {{ h: {h}, ids: {} }}", IdsLiteral(ids))
            }
            Op::Step { h, id } => write!(f, "Op::Step {{ h: {h}, id: {id} }}"),
            Op::Snapshot { h } => write!(f, "Op::Snapshot {{ h: {h} }}"),
            Op::Release { h } => write!(f, "Op::Release {{ h: {h} }}"),
        }
    }
}

/// A sequence of ops: what a property generates, shrinks and replays.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Script(pub Vec<Op>);

impl fmt::Debug for Script {
    /// Prints the ops as a Rust slice literal, one op a line, so a shrunk failure can be pasted
    /// into a `replay(&[...])` call.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("&[\n")?;
        for op in &self.0 {
            writeln!(f, "    {op:?},")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_print_as_rust() {
        let script = Script(vec![
            Op::Prefill { ids: vec![2, 7] },
            Op::PrefillEmbeddings {
                ids: vec![3],
                rows_delta: -1,
            },
            Op::Extend { h: 1, ids: vec![] },
            Op::Step { h: 0, id: 9 },
            Op::Snapshot { h: 0 },
            Op::Release { h: 2 },
        ]);
        assert_eq!(
            format!("{script:?}"),
            "&[\n    Op::Prefill { ids: vec![2, 7] },\n    \
             Op::PrefillEmbeddings { ids: vec![3], rows_delta: -1 },\n    \
             Op::Extend { h: 1, ids: vec![] },\n    Op::Step { h: 0, id: 9 },\n    \
             Op::Snapshot { h: 0 },\n    Op::Release { h: 2 },\n]"
        );
    }
}
