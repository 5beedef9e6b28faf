//! Golden sets and parity checks.
