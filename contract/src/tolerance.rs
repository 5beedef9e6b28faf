//! `Tolerance`: how close two logits must be to count as equal.

/// An absolute-plus-relative tolerance.
///
/// Two values `got` and `want` agree iff `|got - want| <= abs + rel * |want|`.
///
/// The default, [`Tolerance::LOGITS`], is 2e-3 absolute on logits and log-sum-exp: a float32
/// forward pass of Gemma 3 270M drifts from the float64 oracle by at most about 1.2e-4 on top-k
/// logits (see the `calibration` of the golden sets), so 2e-3 leaves room for a different but
/// sound float32 summation order while still catching any real bug (a wrong mask, norm or RoPE
/// shifts logits by tenths).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f64,
    pub rel: f64,
}

impl Tolerance {
    /// 2e-3 absolute: the acceptance tolerance for logits against the oracle goldens.
    pub const LOGITS: Tolerance = Tolerance {
        abs: 2e-3,
        rel: 0.0,
    };

    /// An absolute-only tolerance.
    pub const fn abs(abs: f64) -> Self {
        Tolerance { abs, rel: 0.0 }
    }

    /// The largest allowed difference from `want`.
    pub fn bound(&self, want: f64) -> f64 {
        self.abs + self.rel * want.abs()
    }

    /// Whether `got` agrees with `want`. NaN never agrees.
    pub fn accepts(&self, got: f64, want: f64) -> bool {
        (got - want).abs() <= self.bound(want)
    }
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance::LOGITS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formula() {
        let t = Tolerance {
            abs: 1e-3,
            rel: 1e-2,
        };
        assert!(t.accepts(10.1, 10.0));
        assert!(!t.accepts(10.2, 10.0));
        assert!(Tolerance::LOGITS.accepts(1.0019, 1.0));
        assert!(!Tolerance::LOGITS.accepts(1.0021, 1.0));
        assert!(!Tolerance::LOGITS.accepts(f64::NAN, 1.0));
    }
}
