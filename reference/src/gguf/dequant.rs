//! Dequantization of ggml blocks to f32, bit-exact with gguf-py 0.19.0 (`gguf/quants.py`).
//!
//! Bit-exactness means the same float32 operations in the same order: every scale is an f16
//! widened to f32, products such as `d * sc` are rounded to f32 before they are used, and
//! `a * b - c` is two roundings, never a fused multiply-add (Rust does not contract float
//! expressions, so writing them out is enough). Each `*_block` function is the plain transcription
//! of one gguf-py `dequantize_blocks`; [`dequantize`] only spreads blocks over threads.

use kvsnap_contract::{Error, Result};
use rayon::prelude::*;

use super::types::{GgmlType, QK_K};

/// Bytes of one Q8_0 block: f16 scale, 32 int8 values.
pub const Q8_0_BYTES: usize = 34;
/// Bytes of one Q5_0 block: f16 scale, 32 high bits, 16 bytes of low nibbles.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of one Q4_K super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one Q6_K super-block: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.
pub const Q6_K_BYTES: usize = 210;

/// Blocks handed to one rayon task: large enough to amortise scheduling, small enough to balance.
const BLOCKS_PER_TASK: usize = 1024;

/// Dequantizes `data`, whole blocks of `ty`, into `out` (one f32 per value, in storage order).
///
/// Errors: [`Error::Unsupported`] for a type without a dequantizer, [`Error::ShapeMismatch`] when
/// `data` is not exactly the blocks that fill `out`.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let (block, block_bytes) = ty.block_geometry();
    let n_blocks = out.len() / block;
    if !out.len().is_multiple_of(block) || data.len() != n_blocks * block_bytes {
        return Err(Error::ShapeMismatch {
            op: "gguf dequantize",
            what: "quantized data bytes",
            expected: vec![out.len().div_ceil(block) * block_bytes],
            got: vec![data.len()],
        });
    }
    match ty {
        GgmlType::F32 => par_blocks(out, data, |o: &mut [f32; 1], b: &[u8; 4]| {
            o[0] = f32::from_le_bytes(*b)
        }),
        GgmlType::F16 => par_blocks(out, data, |o: &mut [f32; 1], b: &[u8; 2]| {
            o[0] = f16_to_f32(*b)
        }),
        GgmlType::BF16 => par_blocks(out, data, |o: &mut [f32; 1], b: &[u8; 2]| {
            o[0] = bf16_to_f32(*b)
        }),
        GgmlType::Q8_0 => par_blocks(out, data, q8_0_block),
        GgmlType::Q5_0 => par_blocks(out, data, q5_0_block),
        GgmlType::Q4_K => par_blocks(out, data, q4_k_block),
        GgmlType::Q6_K => par_blocks(out, data, q6_k_block),
        other => {
            return Err(Error::Unsupported {
                backend: "gguf dequantization",
                op: other.name(),
            })
        }
    }
    Ok(())
}

/// Runs `f` on every (output block, input block) pair, `BLOCKS_PER_TASK` blocks per rayon task.
/// The caller has checked that `out` and `data` hold the same number of whole blocks.
fn par_blocks<const N: usize, const B: usize>(
    out: &mut [f32],
    data: &[u8],
    f: impl Fn(&mut [f32; N], &[u8; B]) + Sync,
) {
    // Tiny per-value types get proportionally more values per task.
    let per_task = BLOCKS_PER_TASK * if N == 1 { 64 } else { 1 };
    out.par_chunks_mut(per_task * N)
        .zip(data.par_chunks(per_task * B))
        .for_each(|(o, d)| {
            for (ob, db) in o.chunks_exact_mut(N).zip(d.chunks_exact(B)) {
                // chunks_exact yields exactly N and B elements.
                f(ob.try_into().unwrap(), db.try_into().unwrap());
            }
        });
}

/// IEEE half to single. Exact for every non-NaN value (as numpy's `astype(np.float32)`).
fn f16_to_f32(b: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(b).to_f32()
}

/// bfloat16 to f32: the 16 bits become the high half (gguf-py: `int16 -> int32 << 16`).
fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

/// Q8_0: `x * d` (gguf-py `Q8_0.dequantize_blocks`).
pub fn q8_0_block(out: &mut [f32; 32], b: &[u8; Q8_0_BYTES]) {
    let d = f16_to_f32([b[0], b[1]]);
    for (o, &q) in out.iter_mut().zip(&b[2..]) {
        *o = f32::from(q as i8) * d;
    }
}

/// Q5_0: value `j` is `d * (q - 16)` with `q = low nibble | bit j of qh << 4`; the low nibbles
/// of values 0..16 are the low halves of `qs`, those of 16..32 the high halves.
pub fn q5_0_block(out: &mut [f32; 32], b: &[u8; Q5_0_BYTES]) {
    let d = f16_to_f32([b[0], b[1]]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        let high = ((qh >> j) & 1) as u8;
        let q = (low | (high << 4)) as i8 - 16;
        *o = d * f32::from(q);
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block
/// (gguf-py `Q4_K.get_scale_min`).
fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3F, s[j + 4] & 0x3F)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30),
            (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30),
        )
    }
}

/// Q4_K: 8 sub-blocks of 32; sub-block `j` is `(d * sc_j) * q - (dmin * m_j)`, the two products
/// rounded to f32 first. Sub-blocks `2i` and `2i + 1` share the 32 bytes `qs[32i..]` as low and
/// high nibbles.
pub fn q4_k_block(out: &mut [f32; QK_K], b: &[u8; Q4_K_BYTES]) {
    let d = f16_to_f32([b[0], b[1]]);
    let dmin = f16_to_f32([b[2], b[3]]);
    let scales = &b[4..16];
    let qs = &b[16..];
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, j);
        let dl = d * f32::from(sc);
        let ml = dmin * f32::from(m);
        let bytes = &qs[(j / 2) * 32..][..32];
        let shift = 4 * (j % 2);
        for (o, &q) in sub.iter_mut().zip(bytes) {
            *o = dl * f32::from((q >> shift) & 0x0F) - ml;
        }
    }
}

/// Q6_K: 16 groups of 16 values; value `e` is `(d * scales[e / 16]) * (q - 32)`, the product
/// rounded to f32 first. The two halves of 128 values each take 64 bytes of `ql` (low nibbles for
/// values 0..64 of the half, high nibbles for 64..128) and 32 bytes of `qh` (2 bits per value).
pub fn q6_k_block(out: &mut [f32; QK_K], b: &[u8; Q6_K_BYTES]) {
    let ql = &b[..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_to_f32([b[208], b[209]]);
    for (e, o) in out.iter_mut().enumerate() {
        let (half, r) = (e / 128, e % 128);
        let low = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        let high = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        let dl = d * f32::from(scales[e / 16] as i8);
        *o = dl * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    //! Hand-made blocks. Unless said otherwise, expected values were produced by gguf-py 0.19.0
    //! (`gguf.quants.dequantize` on the same bytes) and are compared bit for bit; the sha256 is of
    //! the whole dequantized output as little-endian f32.

    use super::*;
    use sha2::{Digest, Sha256};

    /// `len` bytes `(i * mul + add) % 256`: a deterministic pattern that sets every bit somewhere.
    fn pattern(len: usize, mul: usize, add: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * mul + add) % 256) as u8).collect()
    }

    fn put_f16(b: &mut [u8], at: usize, bits: u16) {
        b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }

    fn run(ty: GgmlType, data: &[u8]) -> Vec<f32> {
        let (block, bytes) = ty.block_geometry();
        let mut out = vec![f32::NAN; data.len() / bytes * block];
        dequantize(ty, data, &mut out).unwrap();
        out
    }

    fn sha256(values: &[f32]) -> String {
        let mut h = Sha256::new();
        for v in values {
            h.update(v.to_le_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn check(out: &[f32], spots: &[(usize, u32)], sha: &str) {
        for &(i, bits) in spots {
            assert_eq!(
                out[i].to_bits(),
                bits,
                "value {i}: got {} ({:#x}), gguf-py gives {} ({bits:#x})",
                out[i],
                out[i].to_bits(),
                f32::from_bits(bits)
            );
        }
        assert_eq!(sha256(out), sha, "sha256 of all values");
    }

    #[test]
    fn q8_0_by_hand() {
        // d = 0.5 (f16 0x3800): every value is q / 2, exactly.
        let mut b = [0u8; Q8_0_BYTES];
        put_f16(&mut b, 0, 0x3800);
        let qs: [i8; 4] = [-128, -1, 0, 127];
        for (i, q) in qs.iter().enumerate() {
            b[2 + i] = *q as u8;
        }
        let out = run(GgmlType::Q8_0, &b);
        assert_eq!(&out[..4], &[-64.0, -0.5, 0.0, 63.5]);
        assert!(out[4..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn q8_0_matches_gguf_py() {
        // Two blocks, d = f16 0x2E66 and 0x8400 (the smallest negative normal).
        let mut b = pattern(2 * Q8_0_BYTES, 73, 41);
        put_f16(&mut b, 0, 0x2E66);
        put_f16(&mut b, 34, 0x8400);
        let spots = [
            (0, 0xc0dcbf00),
            (1, 0x3eccc000),
            (15, 0x3e4cc000),
            (16, 0x40eff100),
            (17, 0xc12cc200),
            (31, 0xc12ff500),
            (32, 0xbbda0000),
            (33, 0x3b940000),
            (63, 0xbb880000),
        ];
        check(
            &run(GgmlType::Q8_0, &b),
            &spots,
            "ad8843edeccc4ac536a8e177a6a8800d77390e58278fe7b6116ee9f91d2d6ab6",
        );
    }

    #[test]
    fn q5_0_matches_gguf_py() {
        let mut b = pattern(2 * Q5_0_BYTES, 37, 11);
        put_f16(&mut b, 0, 0x2E66);
        put_f16(&mut b, 22, 0xB123);
        let spots = [
            (0, 0x3f665800),
            (1, 0xbe4cc000),
            (15, 0xbf999000),
            (16, 0x3fb32800),
            (17, 0x0),
            (31, 0x3dccc000),
            (32, 0xbf8fd400),
            (33, 0xbff69000),
            (63, 0xbf246000),
        ];
        check(
            &run(GgmlType::Q5_0, &b),
            &spots,
            "1c78a95ff314d25eb5e1109423d4c81535bfef4aee1d2a5bd71990befc89fd2b",
        );
    }

    #[test]
    fn q5_0_by_hand() {
        // d = 1: value j is (low nibble | qh bit j << 4) - 16.
        let mut b = [0u8; Q5_0_BYTES];
        put_f16(&mut b, 0, 0x3C00);
        b[2..6].copy_from_slice(&(1u32 << 0 | 1 << 17).to_le_bytes());
        b[6] = 0x3F; // value 0: low 0xF, value 16: low 0x3
        b[7] = 0x01; // value 1: low 0x1, value 17: low 0x0
        let out = run(GgmlType::Q5_0, &b);
        assert_eq!(out[0], (0x1F - 16) as f32);
        assert_eq!(out[16], (0x03 - 16) as f32);
        assert_eq!(out[1], (0x01 - 16) as f32);
        assert_eq!(out[17], (0x10 - 16) as f32);
        assert_eq!(out[2], -16.0);
    }

    #[test]
    fn q4_k_matches_gguf_py() {
        let mut b = pattern(Q4_K_BYTES, 97, 5);
        put_f16(&mut b, 0, 0x2E66);
        put_f16(&mut b, 2, 0x1C3F);
        let spots = [
            (0, 0x408e3d68),
            (1, 0x40ab0868),
            (15, 0x4062e4d0),
            (16, 0x408e3d68),
            (31, 0x4062e4d0),
            (32, 0x40804370),
            (33, 0x41e99ddc),
            (63, 0x4259956e),
            (64, 0x40adf778),
            (100, 0x4240c1b0),
            (127, 0x428391d8),
            (128, 0x4183ab52),
            (129, 0x419e1012),
            (191, 0x409bd8f8),
            (200, 0x41c3cb2a),
            (255, 0x412c072c),
        ];
        check(
            &run(GgmlType::Q4_K, &b),
            &spots,
            "0b43437f538a3084980777f09325dd570eb35262efd6530c9653fc4cb2716dbd",
        );
    }

    #[test]
    fn q4_k_scale_packing_by_hand() {
        // Sub-block 5 takes its scale from byte 9's low nibble and byte 1's top two bits, its min
        // from byte 9's high nibble and byte 5's top two bits.
        let mut s = [0u8; 12];
        s[1] = 0b1100_0000;
        s[5] = 0b0100_0000;
        s[9] = 0xA7;
        assert_eq!(k_scale_min(&s, 5), (0x30 | 0x7, 0x10 | 0xA));
        assert_eq!(k_scale_min(&s, 1), (0, 0));
    }

    #[test]
    fn q6_k_matches_gguf_py() {
        let mut b = pattern(Q6_K_BYTES, 59, 200);
        put_f16(&mut b, 208, 0x211F);
        let spots = [
            (0, 0xbff5d000),
            (1, 0x3fc29a00),
            (15, 0xbe75d000),
            (16, 0xc180aae0),
            (17, 0x414bb938),
            (31, 0xc000aae0),
            (32, 0x41215080),
            (33, 0xc21230f4),
            (63, 0xc1a4c154),
            (64, 0x4019a200),
            (100, 0xc20377d4),
            (127, 0x412ec1e0),
            (128, 0x40f5d000),
            (129, 0xc0c29a00),
            (191, 0xc200c99a),
            (200, 0x41585dc0),
            (255, 0x41a008c0),
        ];
        check(
            &run(GgmlType::Q6_K, &b),
            &spots,
            "15e862ece2fa85648005fc2b6a7ebac7546ce45f6df83e87ce4d5c59d9461b1c",
        );
    }

    #[test]
    fn f16_and_bf16_match_gguf_py() {
        let f16_bits: [u16; 11] = [
            0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xC000, 0x7BFF, 0x7C00, 0xFC00, 0x3555,
        ];
        let f16_want: [u32; 11] = [
            0x0, 0x80000000, 0x33800000, 0x387fc000, 0x38800000, 0x3f800000, 0xc0000000,
            0x477fe000, 0x7f800000, 0xff800000, 0x3eaaa000,
        ];
        let data: Vec<u8> = f16_bits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let got: Vec<u32> = run(GgmlType::F16, &data)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, f16_want);

        let bf16_bits: [u16; 7] = [0x0000, 0x8000, 0x3F80, 0xC0A0, 0x7F80, 0x0001, 0x4049];
        let bf16_want: [u32; 7] = [
            0x0, 0x80000000, 0x3f800000, 0xc0a00000, 0x7f800000, 0x10000, 0x40490000,
        ];
        let data: Vec<u8> = bf16_bits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let got: Vec<u32> = run(GgmlType::BF16, &data)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, bf16_want);
    }

    #[test]
    fn f32_is_copied_bit_for_bit() {
        let vals = [1.5f32, -0.0, f32::MIN_POSITIVE, f32::from_bits(0x7fc0_1234)];
        let data: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let got: Vec<u32> = run(GgmlType::F32, &data)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, vals.map(f32::to_bits));
    }

    #[test]
    fn many_blocks_match_block_by_block() {
        // Enough blocks to cross several rayon tasks, with distinct scales per block.
        let n = 3 * BLOCKS_PER_TASK + 7;
        let mut data = pattern(n * Q4_K_BYTES, 31, 3);
        for i in 0..n {
            put_f16(&mut data, i * Q4_K_BYTES, 0x2000 + i as u16);
        }
        let out = run(GgmlType::Q4_K, &data);
        for (i, chunk) in data.chunks_exact(Q4_K_BYTES).enumerate() {
            let mut want = [0f32; QK_K];
            q4_k_block(&mut want, chunk.try_into().unwrap());
            assert_eq!(&out[i * QK_K..][..QK_K], &want[..], "block {i}");
        }
    }

    #[test]
    fn wrong_lengths_and_types_are_typed_errors() {
        let mut out = vec![0f32; 32];
        let e = dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        let mut out = vec![0f32; 31];
        let e = dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        let mut out = vec![0f32; 256];
        let e = dequantize(GgmlType::Q2_K, &[0u8; 84], &mut out).unwrap_err();
        assert!(matches!(e, Error::Unsupported { op: "Q2_K", .. }), "{e}");
    }
}
