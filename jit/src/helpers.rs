//! The numeric helpers the interpreter and the JIT share: one definition each, so compiled
//! code cannot drift from the interpreter. The `extern "C"` wrappers are what generated code
//! calls.

/// The name the daemon gives `$round` calls in the ASTs it evaluates, bound to [`round`]
/// (lowering treats it as `$round`).
pub const ROUND_FN: &str = "__valem_round";

/// JSONata's `$round(x, precision)`: round half to even on the number's *decimal*
/// representation, as jsonata-js does it. The decimal point is shifted by rewriting the
/// exponent of the shortest round-trip string (so `2.675` shifted by 2 is exactly `267.5`, not
/// `267.49999999999997`), the shifted value is rounded with `Math.round` and moved to the even
/// neighbour on an exact tie, and shifted back the same way. `-0` becomes `0` (JSON has no -0).
///
/// `$round(2.675, 2)` is `2.68`, `$round(0.125, 2)` is `0.12`, `$round(-0.5)` is `0`.
/// A non-finite input gives a non-finite (or NaN) result, which callers treat as an error.
pub fn round(x: f64, precision: i32) -> f64 {
    if let Some(r) = round_far_from_tie(x, precision) {
        return r;
    }
    round_decimal(x, precision)
}

/// `10^k` for the `k` where it is exact in an f64 (0 to 22).
fn pow10(k: usize) -> Option<f64> {
    const POW10: [f64; 23] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
        1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
    ];
    POW10.get(k).copied()
}

/// [`round`] without decimal strings, when that cannot change the answer: for a precision of
/// 1 to 22 (`10^p` exact), `y = x × 10^p` is within a few units in the last place of the
/// decimal shift `round_decimal` makes; when `y`'s fraction is clearly not ½ both lie on the
/// same side of the rounding boundary, and there is no tie to settle. Shifting the integer
/// back is one exact-operand division, which is the correctly rounded conversion of
/// `r + 'e-' + p` that `round_decimal` makes. `None`: near a tie, or too large or not finite.
#[inline]
fn round_far_from_tie(x: f64, precision: i32) -> Option<f64> {
    let scale = pow10(usize::try_from(precision).ok().filter(|&p| p >= 1)?)?;
    let y = x * scale;
    // |y| < 2^52: its floor and fraction are exact, the integer below stays exact.
    if y.is_nan() || y.abs() >= 4_503_599_627_370_496.0 {
        return None;
    }
    let floor = y.floor();
    let frac = y - floor;
    // Far more than the few ulps between y and the decimal shift.
    if (frac - 0.5).abs() <= y.abs() * 1e-13 + 1e-300 {
        return None;
    }
    let r = if frac < 0.5 { floor } else { floor + 1.0 };
    let r = r / scale;
    Some(if r == 0.0 { 0.0 } else { r })
}

/// [`round`] as jsonata-js computes it, through the decimal representation.
fn round_decimal(x: f64, precision: i32) -> f64 {
    let shifted = if precision != 0 {
        shift(x, precision)
    } else {
        x
    };
    let mut r = math_round(shifted);
    let diff = r - shifted;
    if diff.abs() == 0.5 && (r % 2.0).abs() == 1.0 {
        r -= 1.0;
    }
    if precision != 0 {
        r = shift(r, -precision);
    }
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// `+(m + 'e' + (e + by))` where `m`/`e` are the mantissa and exponent of `x.toString()`.
/// This runs twice per `$round`: the shortest digits come from ryu in a stack buffer, and the
/// shifted decimal `digits × 10^k` is converted with one exact multiplication or division when
/// the digits fit in 53 bits and |k| ≤ 22 (both factors exact, so the one rounding is the
/// correctly rounded conversion `parse` would make); otherwise through `parse`.
fn shift(x: f64, by: i32) -> f64 {
    let mut buf = ryu_js::Buffer::new();
    let s = buf.format(x);
    let (m, e) = match s.split_once('e') {
        Some((m, e)) => match e.parse::<i64>() {
            Ok(e) => (m, e),
            Err(_) => return f64::NAN,
        },
        None => (s, 0),
    };
    let exp = e + i64::from(by);
    if let Some(v) = fast_decimal(m, exp) {
        return v;
    }
    slow_shift(m, exp)
}

/// `m × 10^exp` for a plain decimal `m` (`-12.345`), when it converts exactly-rounded in one
/// floating-point operation.
fn fast_decimal(m: &str, exp: i64) -> Option<f64> {
    let (neg, digits) = match m.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, m),
    };
    let mut d: u64 = 0;
    let mut frac = 0i64;
    let mut seen_point = false;
    let mut any = false;
    for c in digits.bytes() {
        match c {
            b'0'..=b'9' => {
                d = d.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
                frac += i64::from(seen_point);
                any = true;
            }
            b'.' if !seen_point => seen_point = true,
            _ => return None,
        }
    }
    if !any || d > (1u64 << 53) {
        return None;
    }
    let k = exp - frac;
    let v = d as f64;
    let v = if k >= 0 {
        v * pow10(usize::try_from(k).ok()?)?
    } else {
        v / pow10(usize::try_from(-k).ok()?)?
    };
    Some(if neg { -v } else { v })
}

/// The general case of [`shift`]: the text `m e exp` parsed.
fn slow_shift(m: &str, exp: i64) -> f64 {
    use std::io::Write as _;
    let mut text = [0u8; 64];
    let mut w = &mut text[..];
    if write!(w, "{m}e{exp}").is_err() {
        return f64::NAN;
    }
    let len = 64 - w.len();
    // JavaScript's `+"NaNe2"` and `+"Infinitye2"` are NaN; Rust's parse refuses them.
    std::str::from_utf8(&text[..len])
        .ok()
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

/// JavaScript's `Math.round`: the nearest integer, ties towards +∞. `x - floor(x)` is
/// compared with 0.5, which is exact enough: rounding is monotonic and 0.5 representable, so
/// the comparison decides as the exact difference would. (The sign of a zero result may differ
/// from JavaScript's; `round` normalises zeros.)
fn math_round(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    let f = x.floor();
    if x - f >= 0.5 {
        f + 1.0
    } else {
        f
    }
}

/// `a % b`: JavaScript's remainder (the sign of the dividend), which is C's `fmod`.
pub fn rem(a: f64, b: f64) -> f64 {
    a % b
}

/// `$power(base, exponent)`; a non-finite result is D3061 for the caller.
pub fn power(base: f64, exponent: f64) -> f64 {
    base.powf(exponent)
}

pub extern "C" fn round_c(x: f64, precision: i32) -> f64 {
    round(x, precision)
}

pub extern "C" fn rem_c(a: f64, b: f64) -> f64 {
    rem(a, b)
}

pub extern "C" fn power_c(base: f64, exponent: f64) -> f64 {
    power(base, exponent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traps_of_the_issue() {
        assert_eq!(round(2.675, 2), 2.68);
        assert_eq!(round(0.125, 2), 0.12);
        assert_eq!(round(0.375, 2), 0.38);
        assert_eq!(round(2.5, 0), 2.0);
        assert_eq!(round(3.5, 0), 4.0);
        assert_eq!(round(-2.5, 0), -2.0);
        assert_eq!(round(-3.5, 0), -4.0);
        assert_eq!(round(1250.0, -2), 1200.0);
        assert_eq!(round(1350.0, -2), 1400.0);
        // -0 never comes out.
        for (x, p) in [
            (-0.0, 0),
            (-0.4, 0),
            (-0.5, 0),
            (-0.004, 2),
            (-0.005, 2),
            (-0.0, 3),
        ] {
            let r = round(x, p);
            assert!(r == 0.0 && r.is_sign_positive(), "{x} -> {r:?}");
        }
        // Exponent forms of toString on both sides of the shift.
        assert_eq!(round(1e21, 2), 1e21);
        assert_eq!(round(1.5e-7, 7), 2e-7);
        assert_eq!(round(2.5e-7, 7), 2e-7);
        assert!(round(f64::INFINITY, 2).is_nan());
        assert!(round(f64::NAN, 0).is_nan());
    }

    #[test]
    fn the_fast_decimal_conversion_equals_parsing() {
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for i in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly everyday magnitudes and precisions, now and then anything at all.
            let v = if i % 10 == 0 {
                f64::from_bits(x)
            } else {
                (x >> 11) as f64 / (1u64 << (x % 50)) as f64 * if x & 1 == 0 { 1.0 } else { -1.0 }
            };
            if !v.is_finite() {
                continue;
            }
            let by = (x % 31) as i32 - 15;
            let mut buf = ryu_js::Buffer::new();
            let s = buf.format(v);
            let (m, e) = match s.split_once('e') {
                Some((m, e)) => (m, e.parse::<i64>().unwrap()),
                None => (s, 0),
            };
            let exp = e + i64::from(by);
            if let Some(fast) = fast_decimal(m, exp) {
                let slow = slow_shift(m, exp);
                assert_eq!(fast.to_bits(), slow.to_bits(), "{s} e{exp}");
            }
        }
    }

    /// The float fast path of `round` gives the decimal algorithm's answer bit for bit:
    /// everyday values, values a hair either side of a tie at the rounding digit, and anything.
    #[test]
    fn rounding_without_strings_equals_the_decimal_algorithm() {
        let mut x: u64 = 0x2545f4914f6cdd1d;
        let mut fast = 0;
        for i in 0..300_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let p = (x % 8) as i32 + 1;
            let scale = 10f64.powi(p);
            let sign = if x & 1 == 0 { 1.0 } else { -1.0 };
            let v = match i % 4 {
                0 => (x >> 11) as f64 / (1u64 << (x % 40)) as f64 * sign,
                // k.5 / 10^p, then nudged by a few ulps.
                1 => {
                    let t = (((x >> 20) % 1_000_000) as f64 + 0.5) / scale * sign;
                    f64::from_bits(t.to_bits().wrapping_add((x >> 60) % 5).wrapping_sub(2))
                }
                2 => ((x >> 30) % 100_000) as f64 / 1000.0 * sign,
                _ => f64::from_bits(x),
            };
            let want = round_decimal(v, p);
            let got = round(v, p);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "round({v:e}, {p}): {got:e} vs {want:e}"
            );
            fast += usize::from(round_far_from_tie(v, p).is_some());
        }
        // The fast path runs for most everyday values (half the cases are near ties or huge).
        assert!(fast > 100_000, "fast path taken {fast} times");
    }

    #[test]
    fn math_round_matches_javascript() {
        assert_eq!(math_round(0.49999999999999994), 0.0);
        assert_eq!(math_round(-0.5), 0.0);
        assert_eq!(math_round(-1.5), -1.0);
        assert_eq!(math_round(4503599627370495.5), 4503599627370496.0);
        assert_eq!(math_round(-4503599627370495.5), -4503599627370495.0);
        assert_eq!(math_round(9007199254740993.0), 9007199254740992.0);
    }

    #[test]
    fn remainder_has_the_sign_of_the_dividend() {
        assert_eq!(rem(-7.0, 3.0), -1.0);
        assert_eq!(rem(7.0, -3.0), 1.0);
        assert!(rem(1.0, 0.0).is_nan());
        assert_eq!(rem(5.5, 2.0), 1.5);
    }
}
