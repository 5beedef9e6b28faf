//! The native methods of `dev.kvsnap.Native`. Each one is a single [`bridge`] call: argument
//! conversion, the model call and the result conversion all happen inside it.
//!
//! Handles cross as Java `long`s, bit for bit (`u64 as i64`).

use std::path::Path;

use jni::objects::{JClass, JFloatArray, JIntArray, JString};
use jni::sys::{jfloatArray, jint, jlong, jlongArray, jstring};
use jni::JNIEnv;
use kvsnap_contract::{Error, Logits};

use crate::bridge::{bridge, BridgeError, BridgeResult};
use crate::models::{self, OpenOptions};

/// Java `int[]` token ids to `u32`s: a negative id, or one past the vocab, is
/// [`Error::TokenOutOfRange`] naming the first bad index and its value.
pub fn token_ids(op: &'static str, raw: &[i32], vocab: usize) -> Result<Vec<u32>, Error> {
    match raw
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as usize >= vocab)
    {
        Some((index, &token)) => Err(Error::TokenOutOfRange {
            op,
            token: token.into(),
            index,
            vocab,
        }),
        None => Ok(raw.iter().map(|&t| t as u32).collect()),
    }
}

fn read_ids(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    ids: &JIntArray<'_>,
    vocab: usize,
) -> BridgeResult<Vec<u32>> {
    if ids.is_null() {
        return Err(BridgeError::Null { op, what: "ids" });
    }
    let n = env.get_array_length(ids).map_err(BridgeError::jni(op))?;
    let mut raw = vec![0; n as usize];
    env.get_int_array_region(ids, 0, &mut raw)
        .map_err(BridgeError::jni(op))?;
    Ok(token_ids(op, &raw, vocab)?)
}

/// A new Java `int[]` holding `values`.
fn int_array(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    values: &[jint],
) -> BridgeResult<jni::sys::jintArray> {
    let out = env
        .new_int_array(values.len() as jint)
        .map_err(BridgeError::jni(op))?;
    env.set_int_array_region(&out, 0, values)
        .map_err(BridgeError::jni(op))?;
    Ok(out.into_raw())
}

fn read_floats(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    what: &'static str,
    values: &JFloatArray<'_>,
) -> BridgeResult<Vec<f32>> {
    if values.is_null() {
        return Err(BridgeError::Null { op, what });
    }
    let n = env.get_array_length(values).map_err(BridgeError::jni(op))?;
    let mut out = vec![0.0; n as usize];
    env.get_float_array_region(values, 0, &mut out)
        .map_err(BridgeError::jni(op))?;
    Ok(out)
}

/// A required string argument.
fn read_string(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    what: &'static str,
    s: &JString<'_>,
) -> BridgeResult<String> {
    if s.is_null() {
        return Err(BridgeError::Null { op, what });
    }
    Ok(env.get_string(s).map_err(BridgeError::jni(op))?.into())
}

/// An optional string argument: null and empty both mean "not given".
fn read_optional(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    what: &'static str,
    s: &JString<'_>,
) -> BridgeResult<Option<String>> {
    if s.is_null() {
        return Ok(None);
    }
    let s = read_string(env, op, what, s)?;
    Ok((!s.is_empty()).then_some(s))
}

/// `{handle, next token}` as a Java `long[2]`.
fn handle_and_token(
    env: &mut JNIEnv<'_>,
    op: &'static str,
    handle: u64,
    token: u32,
) -> BridgeResult<jlongArray> {
    let out = env.new_long_array(2).map_err(BridgeError::jni(op))?;
    env.set_long_array_region(&out, 0, &[handle as jlong, token.into()])
        .map_err(BridgeError::jni(op))?;
    Ok(out.into_raw())
}

fn to_jint(op: &'static str, what: &str, n: usize) -> BridgeResult<jint> {
    jint::try_from(n).map_err(|_| BridgeError::BadArgument {
        op,
        problem: format!("{what} {n} does not fit a Java int"),
    })
}

/// `long open(String backend, String modelDir, String moduleDir, String device)`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_open<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    backend: JString<'l>,
    model_dir: JString<'l>,
    module_dir: JString<'l>,
    device: JString<'l>,
) -> jlong {
    bridge(&mut env, "open", |env| {
        let op = "open";
        let backend = read_string(env, op, "backend", &backend)?;
        let model_dir = read_string(env, op, "modelDir", &model_dir)?;
        let module_dir = read_optional(env, op, "moduleDir", &module_dir)?;
        let device = read_optional(env, op, "device", &device)?;
        let model = models::open(OpenOptions {
            backend: &backend,
            model_dir: Path::new(&model_dir),
            module_dir: module_dir.as_deref().map(Path::new),
            device: device.as_deref(),
        })?;
        Ok(models::insert(model)? as jlong)
    })
}

/// `void close(long model)`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_close<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
) {
    bridge(&mut env, "close", |_| models::close(model as u64))
}

/// `String backend(long model)`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_backend<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
) -> jstring {
    bridge(&mut env, "backend", |env| {
        let m = models::get("backend", model as u64)?;
        let s = env
            .new_string(m.session.backend())
            .map_err(BridgeError::jni("backend"))?;
        Ok(s.into_raw())
    })
}

/// `int[] config(long model)`: `{vocab size, hidden size, context capacity}`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_config<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
) -> jni::sys::jintArray {
    bridge(&mut env, "config", |env| {
        let op = "config";
        let m = models::get(op, model as u64)?;
        let cfg = m.session.config();
        let values = [
            to_jint(op, "vocab size", cfg.vocab_size)?,
            to_jint(op, "hidden size", cfg.hidden_size)?,
            to_jint(op, "context capacity", cfg.context_capacity)?,
        ];
        int_array(env, op, &values)
    })
}

/// `long[] prefill(long model, int[] ids)`: `{kv handle, next token}`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_prefill<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    ids: JIntArray<'l>,
) -> jlongArray {
    bridge(&mut env, "prefill", |env| {
        let op = "prefill";
        let m = models::get(op, model as u64)?;
        let ids = read_ids(env, op, &ids, m.session.config().vocab_size)?;
        let (kv, next) = m.session.prefill(&ids, Logits::Skip)?;
        handle_and_token(env, op, kv, next.token)
    })
}

/// `long[] prefillEmbeddings(long model, int[] ids, float[] embeddings)`:
/// `{kv handle, next token}`; `embeddings` are the raw rows `[ids.length, hidden]`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_prefillEmbeddings<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    ids: JIntArray<'l>,
    embeddings: JFloatArray<'l>,
) -> jlongArray {
    bridge(&mut env, "prefill_embeddings", |env| {
        let op = "prefill_embeddings";
        let m = models::get(op, model as u64)?;
        let ids = read_ids(env, op, &ids, m.session.config().vocab_size)?;
        let rows = read_floats(env, op, "embeddings", &embeddings)?;
        let (kv, next) = m.session.prefill_embeddings(&ids, &rows, Logits::Skip)?;
        handle_and_token(env, op, kv, next.token)
    })
}

/// `float[] embeddingRows(long model, int[] ids)`: the raw rows `[ids.length, hidden]`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_embeddingRows<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    ids: JIntArray<'l>,
) -> jfloatArray {
    bridge(&mut env, "embedding_rows", |env| {
        let op = "embedding_rows";
        let m = models::get(op, model as u64)?;
        let ids = read_ids(env, op, &ids, m.session.config().vocab_size)?;
        let rows = m.embedding_rows(&ids)?;
        let n = to_jint(op, "embedding length", rows.len())?;
        let out = env.new_float_array(n).map_err(BridgeError::jni(op))?;
        env.set_float_array_region(&out, 0, &rows)
            .map_err(BridgeError::jni(op))?;
        Ok(out.into_raw())
    })
}

/// `int extend(long model, long kv, int[] ids)`: the next token.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_extend<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
    ids: JIntArray<'l>,
) -> jint {
    bridge(&mut env, "extend", |env| {
        let op = "extend";
        let m = models::get(op, model as u64)?;
        let ids = read_ids(env, op, &ids, m.session.config().vocab_size)?;
        let next = m.session.extend(kv as u64, &ids, Logits::Skip)?;
        Ok(next.token as jint)
    })
}

/// `int step(long model, long kv, int id)`: the next token.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_step<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
    id: jint,
) -> jint {
    bridge(&mut env, "step", |_| {
        let op = "step";
        let m = models::get(op, model as u64)?;
        let id = token_ids(op, &[id], m.session.config().vocab_size)?[0];
        let next = m.session.step(kv as u64, id, Logits::Skip)?;
        Ok(next.token as jint)
    })
}

/// `int[] decode(long model, long kv, int id, int steps)`: the `steps` greedy tokens after `id`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_decode<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
    id: jint,
    steps: jint,
) -> jni::sys::jintArray {
    bridge(&mut env, "decode", |env| {
        let op = "decode";
        let m = models::get(op, model as u64)?;
        let id = token_ids(op, &[id], m.session.config().vocab_size)?[0];
        let steps = usize::try_from(steps).map_err(|_| BridgeError::BadArgument {
            op,
            problem: format!("steps must be at least 0, got {steps}"),
        })?;
        let tokens = m.session.decode(kv as u64, id, steps)?;
        let values: Vec<jint> = tokens.iter().map(|&t| t as jint).collect();
        int_array(env, op, &values)
    })
}

/// `long snapshot(long model, long kv)`: the copy's handle.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_snapshot<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
) -> jlong {
    bridge(&mut env, "snapshot", |_| {
        let m = models::get("snapshot", model as u64)?;
        Ok(m.session.snapshot(kv as u64)? as jlong)
    })
}

/// `void release(long model, long kv)`.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_release<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
) {
    bridge(&mut env, "release", |_| {
        let m = models::get("release", model as u64)?;
        Ok(m.session.release(kv as u64)?)
    })
}

/// `int len(long model, long kv)`: tokens cached in the state.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_len<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
) -> jint {
    bridge(&mut env, "len", |_| {
        let m = models::get("len", model as u64)?;
        to_jint("len", "length", m.session.len(kv as u64)?)
    })
}

/// `long kvBytes(long model, long kv)`: bytes of memory the state holds.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_kvBytes<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
    kv: jlong,
) -> jlong {
    bridge(&mut env, "kv_bytes", |_| {
        let m = models::get("kv_bytes", model as u64)?;
        Ok(m.session.kv_bytes(kv as u64)? as jlong)
    })
}

/// `int liveStates(long model)`: number of KV states not yet released.
#[no_mangle]
pub extern "system" fn Java_dev_kvsnap_Native_liveStates<'l>(
    mut env: JNIEnv<'l>,
    _class: JClass<'l>,
    model: jlong,
) -> jint {
    bridge(&mut env, "live_states", |_| {
        let m = models::get("live_states", model as u64)?;
        to_jint("live_states", "live states", m.session.live())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_and_too_large_ids_name_the_first_bad_index() {
        assert_eq!(token_ids("prefill", &[0, 5, 7], 8).unwrap(), vec![0, 5, 7]);
        let msg = token_ids("prefill", &[1, -5, 9], 8)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "prefill: token id -5 at input index 1 is out of range (vocab size 8)"
        );
        assert!(matches!(
            token_ids("step", &[8], 8),
            Err(Error::TokenOutOfRange {
                token: 8,
                index: 0,
                ..
            })
        ));
        assert!(matches!(
            token_ids("step", &[i32::MIN], 8),
            Err(Error::TokenOutOfRange {
                token: -2147483648,
                ..
            })
        ));
    }
}
