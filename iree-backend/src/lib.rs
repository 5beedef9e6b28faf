//! IREE backend of kvsnap. Not implemented yet: see the IREE backend issue.

pub mod compile;
pub mod emit;
pub mod graphs;
pub mod runtime;
