//! Member names made to collide under the unkeyed hash the daemon once used for wide objects and
//! its name table — FxHash of rustc-hash 2.1 over a `str` — for the hash-flooding tests (issue
//! 30), and random names of the same shape to compare them with. Every name is 64 printable
//! ASCII bytes without `"` or `\`, so it goes into JSON as it is.
//!
//! FxHash of a `str` is `rotl(((h·K) + 0xff)·K, 26)` where `h` is rustc-hash's `hash_bytes`. For
//! 64 bytes that is, with `m(a, b)` the xor of the halves of the 128-bit product `a·b`, chunks
//! `c1..c3` of 16 bytes, then `x4`, `y4` of 8:
//!
//! ```text
//! t1 = m(SEED1 ^ c1.x, G ^ c1.y)    t2 = m(SEED2 ^ c2.x, G ^ c2.y)    t3 = m(t1 ^ c3.x, G ^ c3.y)
//! h  = m(t2 ^ x4, t3 ^ y4) ^ 64
//! ```
//!
//! - Whole 64-bit collisions: a `c2` whose `t2` is printable, and `x4 = t2`, make the first factor
//!   of the last product 0, so `h = 64` whatever `c1`, `c3` and `y4` are.
//! - Collisions of the low 32 bits only: with `c3.x = t1 ^ 1` and `x4 = t2 ^ 1` both products
//!   multiply by 1, so `h = G ^ 64 ^ c3.y ^ y4`. The hash's low 32 bits are bits 38..64 and 0..6
//!   of `h·K² + 0xff·K` (the rotation); walking `h` by steps of `2⁶·K⁻²` moves only bits 6..38
//!   of that, and one step in 256 or so gives an `h` whose xor with `G ^ 64` splits into two
//!   printable words.

/// rustc-hash 2.1's multiplier (64-bit targets).
const K: u64 = 0xf1357aea2e62a9c5;
const SEED1: u64 = 0x243f6a8885a308d3;
const SEED2: u64 = 0x13198a2e03707344;
/// rustc-hash's `PREVENT_TRIVIAL_ZERO_COLLAPSE`.
const G: u64 = 0xa4093822299f31d0;

/// The length of every name made here.
pub const KEY_LEN: usize = 64;

fn mix(x: u64, y: u64) -> u64 {
    let full = u128::from(x) * u128::from(y);
    (full as u64) ^ ((full >> 64) as u64)
}

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// rustc-hash 2.1's `hash_bytes`.
fn hash_bytes(bytes: &[u8]) -> u64 {
    let len = bytes.len();
    let (mut s0, mut s1) = (SEED1, SEED2);
    if len <= 16 {
        if len >= 8 {
            s0 ^= word(&bytes[..8]);
            s1 ^= word(&bytes[len - 8..]);
        } else if len >= 4 {
            let half = |b: &[u8]| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            s0 ^= half(&bytes[..4]);
            s1 ^= half(&bytes[len - 4..]);
        } else if len > 0 {
            s0 ^= u64::from(bytes[0]);
            s1 ^= (u64::from(bytes[len - 1]) << 8) | u64::from(bytes[len / 2]);
        }
    } else {
        let mut bulk = &bytes[..len - 1];
        while bulk.len() >= 16 {
            let t = mix(s0 ^ word(&bulk[..8]), G ^ word(&bulk[8..16]));
            s0 = s1;
            s1 = t;
            bulk = &bulk[16..];
        }
        s0 ^= word(&bytes[len - 16..]);
        s1 ^= word(&bytes[len - 8..]);
    }
    mix(s0, s1) ^ len as u64
}

/// FxHash (rustc-hash 2.1, 64-bit) of a `str`, as `FxBuildHasher.hash_one(s)` computes it.
pub fn fx_str(s: &str) -> u64 {
    let h = hash_bytes(s.as_bytes());
    h.wrapping_mul(K)
        .wrapping_add(0xff)
        .wrapping_mul(K)
        .rotate_left(26)
}

/// A byte a name may hold: printable ASCII but `"` and `\`.
pub fn allowed(b: u8) -> bool {
    (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\'
}

fn printable(w: u64) -> bool {
    w.to_le_bytes().into_iter().all(allowed)
}

/// `n` as 16 allowed bytes, its lowest digit first (distinct for distinct `n`, and names
/// numbered in a row differ from their first byte on, as random ones do).
fn digits(mut n: u64) -> [u8; 16] {
    let alphabet: Vec<u8> = (0x20..0x7f).filter(|&b| allowed(b)).collect();
    let base = alphabet.len() as u64;
    let mut out = [alphabet[0]; 16];
    for d in out.iter_mut() {
        *d = alphabet[(n % base) as usize];
        n /= base;
    }
    out
}

/// The first chunk, from numbered candidates tagged `tag`, that `keep` accepts.
fn find_chunk(tag: u8, keep: impl Fn(&[u8; 16]) -> bool) -> [u8; 16] {
    (0u64..)
        .map(|i| {
            let mut c = digits(i);
            c[15] = tag;
            c
        })
        .find(|c| keep(c))
        .unwrap_or([tag; 16])
}

/// What the 16-byte chunk `c` makes of the state word `s0` (a `t` above).
fn chunk_mix(s0: u64, c: &[u8; 16]) -> u64 {
    mix(s0 ^ word(&c[..8]), G ^ word(&c[8..]))
}

fn name(parts: &[&[u8]]) -> String {
    let bytes: Vec<u8> = parts.concat();
    debug_assert_eq!(bytes.len(), KEY_LEN);
    String::from_utf8(bytes).unwrap_or_default()
}

/// `n` distinct names with one and the same FxHash, in no particular order (in order, they
/// would be cheaper to sort than random names).
pub fn whole_collisions(n: usize) -> Vec<String> {
    let c2 = find_chunk(b'W', |c| printable(chunk_mix(SEED2, c)));
    let x4 = chunk_mix(SEED2, &c2).to_le_bytes();
    let c3 = *b"whole-64-bit-fx!";
    let y4 = *b"#collide";
    let mut out: Vec<String> = (0..n as u64)
        .map(|i| name(&[&digits(i), &c2, &c3, &x4, &y4]))
        .collect();
    let mut random = Random::new(0x64);
    for i in (1..out.len()).rev() {
        out.swap(i, random.below(i + 1));
    }
    out
}

/// The fixed parts of the low-half names: `c1`, `c2`, `c3.x` and `x4`.
struct LowHalf {
    c1: [u8; 16],
    c2: [u8; 16],
    x3: [u8; 8],
    x4: [u8; 8],
}

impl LowHalf {
    fn new() -> LowHalf {
        let c1 = find_chunk(b'L', |c| printable(chunk_mix(SEED1, c) ^ 1));
        let c2 = find_chunk(b'l', |c| printable(chunk_mix(SEED2, c) ^ 1));
        LowHalf {
            c1,
            c2,
            x3: (chunk_mix(SEED1, &c1) ^ 1).to_le_bytes(),
            x4: (chunk_mix(SEED2, &c2) ^ 1).to_le_bytes(),
        }
    }

    fn name(&self, y3: &[u8; 8], y4: &[u8; 8]) -> String {
        name(&[&self.c1, &self.c2, &self.x3, y3, &self.x4, y4])
    }
}

/// `n` distinct names whose FxHashes agree in their low 32 bits and differ in their high ones.
/// They share their first 40 bytes, which costs something of its own wherever names are
/// compared or sorted: [`low_half_like`] makes names of the same shape that do not collide.
pub fn low_half_collisions(n: usize) -> Vec<String> {
    let t = LowHalf::new();
    // Each value below 0x80 as the xor of two allowed bytes, every way it is one (a name
    // picks one at random, so that the names do not share more than their first 40 bytes).
    let split: Vec<Vec<(u8, u8)>> = (0u8..0x80)
        .map(|v| {
            (0x20u8..0x7f)
                .filter(|&a| allowed(a) && allowed(a ^ v))
                .map(|a| (a, a ^ v))
                .collect()
        })
        .collect();
    let mut pick = Random::new(0x1032);
    let k_inv = {
        let mut inv = K;
        for _ in 0..6 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(K.wrapping_mul(inv)));
        }
        inv
    };
    let k2_inv = k_inv.wrapping_mul(k_inv);
    let offset = 0xffu64.wrapping_mul(K);
    // h·K² + 0xff·K has bits 6..38 zero at the start, so a walk of up to 2³² steps of 2⁶
    // never carries past them.
    let start: u64 = (0x2A5 << 38) | 0x15;
    let h0 = start.wrapping_sub(offset).wrapping_mul(k2_inv);
    let step = (1u64 << 6).wrapping_mul(k2_inv);
    let mut out = Vec::with_capacity(n);
    for m in 0u64..1 << 32 {
        if out.len() == n {
            break;
        }
        let h = h0.wrapping_add(m.wrapping_mul(step));
        let z = (h ^ G ^ KEY_LEN as u64).to_le_bytes();
        let (mut y3, mut y4) = ([0u8; 8], [0u8; 8]);
        let split_all = z.iter().enumerate().all(|(i, &v)| {
            let ways = split.get(usize::from(v)).map_or(&[][..], Vec::as_slice);
            let Some(&(a, b)) = ways.get(pick.below(ways.len())) else {
                return false;
            };
            (y3[i], y4[i]) = (a, b);
            true
        });
        if split_all {
            out.push(t.name(&y3, &y4));
        }
    }
    out
}

/// `n` distinct names shaped like [`low_half_collisions`]' (the same first 40 bytes and
/// `x4`), their two free words random: their FxHashes are as random as any.
pub fn low_half_like(n: usize, seed: u64) -> Vec<String> {
    let t = LowHalf::new();
    let mut random = Random::new(seed);
    distinct(n, || {
        let (y3, y4) = (random.word(), random.word());
        t.name(&y3, &y4)
    })
}

/// `n` distinct names of random allowed bytes (from `seed`).
pub fn random_names(n: usize, seed: u64) -> Vec<String> {
    let mut random = Random::new(seed);
    distinct(n, || {
        let bytes: Vec<u8> = (0..KEY_LEN / 8).flat_map(|_| random.word()).collect();
        String::from_utf8(bytes).unwrap_or_default()
    })
}

/// The first `n` distinct names `make` makes.
fn distinct(n: usize, mut make: impl FnMut() -> String) -> Vec<String> {
    let mut seen = std::collections::HashSet::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let name = make();
        if seen.insert(name.clone()) {
            out.push(name);
        }
    }
    out
}

/// Words of random allowed bytes (xorshift).
struct Random {
    x: u64,
    alphabet: Vec<u8>,
}

impl Random {
    fn new(seed: u64) -> Random {
        Random {
            x: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            alphabet: (0x20..0x7f).filter(|&b| allowed(b)).collect(),
        }
    }

    fn next(&mut self) -> u64 {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        self.x
    }

    /// A number below `n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn word(&mut self) -> [u8; 8] {
        let mut w = [0u8; 8];
        for b in &mut w {
            let i = self.below(self.alphabet.len());
            *b = self.alphabet[i];
        }
        w
    }
}
