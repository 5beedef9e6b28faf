//! kvsnap's JNI bridge: the `KvModel` contract for Kotlin and Java.
//!
//! The Java API (`jni/java/dev/kvsnap/`) calls the native methods of `dev.kvsnap.Native`,
//! exported by [`exports`]. Models and KV states cross as `long` handles resolved through
//! generation-checked handle tables ([`kvsnap_contract::HandleTable`]): a zero, stale,
//! released or foreign handle throws, it never crashes. Every export goes through one
//! panic-catching wrapper, [`bridge::bridge`], which throws a specific Java exception for each
//! kind of failure ([`bridge::java_exception`]); no export signals an error by null or 0.
//!
//! # Locking
//! Calls on distinct KV handles run in parallel, from any Java thread; calls on one handle are
//! serialised; closing a model waits for its calls in progress. See jni/README.md.

pub mod bridge;
pub mod exports;
pub mod models;

pub use bridge::{java_exception, BridgeError, BridgeResult, JavaException};
pub use models::{open, OpenModel, OpenOptions, BACKENDS};
