//! The one wrapper every JNI export goes through: it catches panics and turns every failure
//! into a specific Java exception, so no export ever signals an error by a null or 0 alone.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use jni::objects::{JObject, JThrowable, JValue};
use jni::sys::{jint, jlong, jobject};
use jni::JNIEnv;
use kvsnap_contract::Error;

/// The Java class of kvsnap's own exception (device, backend, I/O and weights failures).
pub const KVSNAP_EXCEPTION: &str = "dev/kvsnap/KvsnapException";

/// Everything an export can fail with: a contract error, or a problem of the bridge itself.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// A failure reported by the model or its handle tables.
    #[error(transparent)]
    Kv(#[from] Error),

    /// A Java argument that must not be null was null.
    #[error("{op}: {what} is null")]
    Null {
        op: &'static str,
        what: &'static str,
    },

    /// A Java argument the bridge itself rejects (unknown backend, option the backend takes no
    /// value for, ...).
    #[error("{op}: {problem}")]
    BadArgument { op: &'static str, problem: String },

    /// A JNI call failed (the JVM is out of memory, a class is missing, ...).
    #[error("{op}: JNI call failed: {source}")]
    Jni {
        op: &'static str,
        #[source]
        source: jni::errors::Error,
    },

    /// Rust code panicked; the panic was caught at the boundary.
    #[error("{op}: internal error (panic): {message}")]
    Panic { op: &'static str, message: String },
}

impl BridgeError {
    /// Wraps a JNI failure of `op`.
    pub fn jni(op: &'static str) -> impl FnOnce(jni::errors::Error) -> Self {
        move |source| BridgeError::Jni { op, source }
    }
}

/// Result alias of the bridge.
pub type BridgeResult<T> = std::result::Result<T, BridgeError>;

/// The Java exception a failure is thrown as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JavaException {
    /// JNI class name, e.g. `java/lang/IllegalArgumentException`.
    pub class: &'static str,
    /// The stable error kind ([`Error::kind`], or `null`, `bad_argument`, `jni`, `panic`).
    pub kind: &'static str,
    /// The full message: the error's `Display` text.
    pub message: String,
    /// The backend that reported a backend failure.
    pub backend: Option<String>,
    /// The backend's own status text of a backend failure.
    pub status: Option<String>,
}

/// Maps each failure to its Java exception:
/// - bad ids, shapes, empty input, context overflow, bad bridge arguments:
///   `IllegalArgumentException`;
/// - null arguments: `NullPointerException`;
/// - stale, released or foreign handles, closed models, poisoned states:
///   `IllegalStateException`;
/// - capabilities a backend lacks: `UnsupportedOperationException`;
/// - device, backend, I/O, weights, config and format failures, the KV budget, JNI failures
///   and panics: `dev.kvsnap.KvsnapException` with the kind and the backend status text.
pub fn java_exception(e: &BridgeError) -> JavaException {
    let (class, kind) = match e {
        BridgeError::Kv(kv) => (class_of(kv), kv.kind()),
        BridgeError::Null { .. } => ("java/lang/NullPointerException", "null"),
        BridgeError::BadArgument { .. } => ("java/lang/IllegalArgumentException", "bad_argument"),
        BridgeError::Jni { .. } => (KVSNAP_EXCEPTION, "jni"),
        BridgeError::Panic { .. } => (KVSNAP_EXCEPTION, "panic"),
    };
    let (backend, status) = match e {
        BridgeError::Kv(Error::Backend {
            backend, status, ..
        }) => (Some(backend.to_string()), Some(status.clone())),
        BridgeError::Kv(Error::Unsupported { backend, .. }) => (Some(backend.to_string()), None),
        _ => (None, None),
    };
    JavaException {
        class,
        kind,
        message: e.to_string(),
        backend,
        status,
    }
}

fn class_of(e: &Error) -> &'static str {
    match e {
        Error::TokenOutOfRange { .. }
        | Error::EmptyInput { .. }
        | Error::ContextOverflow { .. }
        | Error::ShapeMismatch { .. }
        | Error::NonFinite { .. } => "java/lang/IllegalArgumentException",
        Error::StaleHandle { .. } | Error::Closed { .. } | Error::Poisoned { .. } => {
            "java/lang/IllegalStateException"
        }
        Error::Unsupported { .. } => "java/lang/UnsupportedOperationException",
        Error::WeightsMismatch { .. }
        | Error::Config { .. }
        | Error::Format { .. }
        | Error::Io { .. }
        | Error::KvBudget { .. }
        | Error::Backend { .. } => KVSNAP_EXCEPTION,
    }
}

/// Runs `f`, turning a panic into [`BridgeError::Panic`].
pub fn guarded<R>(op: &'static str, f: impl FnOnce() -> BridgeResult<R>) -> BridgeResult<R> {
    // Unwind safety: the only state shared across calls is the handle tables, which poison the
    // value a panic interrupted (see kvsnap_contract::handles).
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(BridgeError::Panic {
            op,
            message: panic_text(payload.as_ref()),
        })
    })
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// The placeholder an export returns after throwing. The JVM discards it: the pending
/// exception is the signal.
pub trait JniReturn {
    /// The placeholder.
    fn thrown() -> Self;
}

impl JniReturn for () {
    fn thrown() -> Self {}
}

impl JniReturn for jint {
    fn thrown() -> Self {
        0
    }
}

impl JniReturn for jlong {
    fn thrown() -> Self {
        0
    }
}

impl JniReturn for jobject {
    fn thrown() -> Self {
        std::ptr::null_mut()
    }
}

/// The wrapper of every export: runs `f` with panics caught and throws the Java exception of
/// any failure.
pub fn bridge<'l, R: JniReturn>(
    env: &mut JNIEnv<'l>,
    op: &'static str,
    f: impl FnOnce(&mut JNIEnv<'l>) -> BridgeResult<R>,
) -> R {
    match guarded(op, || f(env)) {
        Ok(r) => r,
        Err(e) => {
            throw(env, &e);
            R::thrown()
        }
    }
}

/// Throws the Java exception of `e`. An exception the JVM already has pending (a JNI call
/// that threw) is left as it is: it names the problem first-hand.
fn throw(env: &mut JNIEnv<'_>, e: &BridgeError) {
    if env.exception_check().unwrap_or(false) {
        return;
    }
    let ex = java_exception(e);
    let thrown = if ex.class == KVSNAP_EXCEPTION {
        throw_kvsnap(env, &ex)
    } else {
        env.throw_new(ex.class, &ex.message)
    };
    if thrown.is_err() && !env.exception_check().unwrap_or(false) {
        // The exception class could not be built (e.g. the Java API is not on the class
        // path): still fail loudly, with the message.
        let _ = env.throw_new("java/lang/RuntimeException", &ex.message);
    }
}

fn throw_kvsnap(env: &mut JNIEnv<'_>, ex: &JavaException) -> jni::errors::Result<()> {
    let kind = env.new_string(ex.kind)?;
    let backend = optional_string(env, ex.backend.as_deref())?;
    let status = optional_string(env, ex.status.as_deref())?;
    let message = env.new_string(&ex.message)?;
    let obj = env.new_object(
        KVSNAP_EXCEPTION,
        "(Ljava/lang/String;Ljava/lang/String;Ljava/lang/String;Ljava/lang/String;)V",
        &[
            JValue::Object(&kind),
            JValue::Object(&backend),
            JValue::Object(&status),
            JValue::Object(&message),
        ],
    )?;
    env.throw(JThrowable::from(obj))
}

fn optional_string<'l>(env: &mut JNIEnv<'l>, s: Option<&str>) -> jni::errors::Result<JObject<'l>> {
    match s {
        Some(s) => Ok(env.new_string(s)?.into()),
        None => Ok(JObject::null()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(e: impl Into<BridgeError>) -> &'static str {
        java_exception(&e.into()).class
    }

    #[test]
    fn each_error_kind_has_its_exception() {
        let iae = "java/lang/IllegalArgumentException";
        let ise = "java/lang/IllegalStateException";
        assert_eq!(
            class(Error::TokenOutOfRange {
                op: "step",
                token: -1,
                index: 0,
                vocab: 8
            }),
            iae
        );
        assert_eq!(class(Error::EmptyInput { op: "extend" }), iae);
        assert_eq!(
            class(Error::ContextOverflow {
                op: "extend",
                have: 1,
                adding: 9,
                capacity: 8
            }),
            iae
        );
        assert_eq!(
            class(Error::StaleHandle {
                op: "step",
                handle: 0,
                reason: "zero handle"
            }),
            ise
        );
        assert_eq!(class(Error::Closed { op: "step" }), ise);
        assert_eq!(
            class(Error::Unsupported {
                backend: "iree-cpu",
                op: "open"
            }),
            "java/lang/UnsupportedOperationException"
        );
        assert_eq!(
            class(BridgeError::Null {
                op: "prefill",
                what: "ids"
            }),
            "java/lang/NullPointerException"
        );
    }

    #[test]
    fn backend_failures_carry_backend_and_status_text() {
        let ex = java_exception(&BridgeError::Kv(Error::Backend {
            backend: "iree-vulkan",
            op: "step".into(),
            status: "RESOURCE_EXHAUSTED; out of device memory".into(),
        }));
        assert_eq!(ex.class, KVSNAP_EXCEPTION);
        assert_eq!(ex.kind, "backend");
        assert_eq!(ex.backend.as_deref(), Some("iree-vulkan"));
        assert_eq!(
            ex.status.as_deref(),
            Some("RESOURCE_EXHAUSTED; out of device memory")
        );
        assert!(
            ex.message.contains("out of device memory"),
            "{}",
            ex.message
        );
    }

    #[test]
    fn panics_become_errors_with_their_message() {
        let r: BridgeResult<()> = guarded("step", || panic!("index {} out of bounds", 7));
        let e = r.unwrap_err();
        let ex = java_exception(&e);
        assert_eq!((ex.class, ex.kind), (KVSNAP_EXCEPTION, "panic"));
        assert!(
            ex.message.contains("step") && ex.message.contains("index 7 out of bounds"),
            "{}",
            ex.message
        );
    }
}
