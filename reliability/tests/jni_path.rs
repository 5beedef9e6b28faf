//! The bad-id row of the JNI path: Java passes `int[]` ids, so negative ids exist there and must
//! be rejected (before any backend runs) with the same typed error as ids past the vocab.

use kvsnap_jni::exports::token_ids;

#[test]
fn negative_and_oversized_java_ids_are_token_out_of_range() {
    for (raw, index, token) in [
        (vec![1, -1, 3], 1, -1i64),
        (vec![i32::MIN], 0, i32::MIN as i64),
        (vec![0, 1, 512], 2, 512),
        (vec![i32::MAX], 0, i32::MAX as i64),
    ] {
        let e = token_ids("prefill", &raw, 512).unwrap_err();
        assert_eq!(e.kind(), "token_out_of_range");
        let msg = e.to_string();
        let want = format!("token id {token} at input index {index} is out of range");
        assert!(
            msg.contains(&want) && msg.contains("vocab size 512"),
            "{msg}"
        );
    }
    assert_eq!(token_ids("step", &[0, 511], 512).unwrap(), vec![0, 511]);
}
