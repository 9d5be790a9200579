//! Keyed hashing for the tables whose keys come from clients (member names of documents, names in
//! a spec, model ids): foldhash, seeded once per process from the OS's randomness. Never decides
//! anything persisted or printed: a hash lives only in this process's memory.
//!
//! Why keyed: an unkeyed hash (FxHash) is invertible, so anyone can send keys that all hash alike,
//! and a table of them turns every insert into a scan (60k such keys in one write took 14 s).
//! foldhash with a secret seed is as fast as FxHash on short names, and its documented claim is
//! that no list of inputs collides for every seed; it makes no claim against an attacker who
//! learns the seed by timing the daemon, which is why the wide-object map also keeps keys of equal
//! hash in an ordered map (`value.rs`), and stays O(log n) even then.
//!
//! One seed for the whole process, not one per table or thread: a compiled model keeps member
//! hashes ([`crate::value::member_hash`]) that every shard thread looks members up by.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use foldhash::fast::FoldHasher;
use foldhash::SharedSeed;

/// The process's secret: foldhash's per-hasher seed and its shared seeds.
struct Seed {
    per_hasher: u64,
    shared: SharedSeed,
}

static SEED: OnceLock<Seed> = OnceLock::new();

#[inline]
fn seed() -> &'static Seed {
    SEED.get_or_init(|| {
        let [a, b] = random_words();
        Seed {
            per_hasher: a,
            shared: SharedSeed::from_u64(b),
        }
    })
}

/// 128 random bits from the OS; should `getrandom` fail, from std's own hash keys (which the OS
/// also supplies, by another path), never a constant.
fn random_words() -> [u64; 2] {
    if let (Ok(a), Ok(b)) = (getrandom::u64(), getrandom::u64()) {
        return [a, b];
    }
    let keys = std::hash::RandomState::new();
    [keys.hash_one(1u8), keys.hash_one(2u8)]
}

/// The [`BuildHasher`] of client-keyed tables (a `HashMap`/`HashSet` hasher, or the hash of a
/// `hashbrown::HashTable` entry through [`str_hash`] / [`pair_hash`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Keyed;

impl BuildHasher for Keyed {
    type Hasher = FoldHasher<'static>;

    #[inline]
    fn build_hasher(&self) -> FoldHasher<'static> {
        let s = seed();
        FoldHasher::with_seed(s.per_hasher, &s.shared)
    }
}

/// A set keyed by client-chosen values.
pub type KeyedSet<T> = std::collections::HashSet<T, Keyed>;

/// The hash of a name (`Keyed.hash_one(s)`, spelt out so that it is inlined where names are
/// interned and looked up: a call per name cost the 100k fan-out's compile ~5 ms, 3%).
#[inline(always)]
pub fn str_hash(s: &str) -> u64 {
    let mut h = Keyed.build_hasher();
    h.write(s.as_bytes());
    h.write_u8(0xff);
    h.finish()
}

/// The hash of a name below a numbered parent (a trie edge): `Keyed.hash_one((parent, s))`.
#[inline(always)]
pub fn pair_hash(parent: u32, s: &str) -> u64 {
    let mut h = Keyed.build_hasher();
    h.write_u32(parent);
    h.write(s.as_bytes());
    h.write_u8(0xff);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every thread of the process hashes alike (a compiled model's member hashes are used by
    /// other threads), and different names differ.
    #[test]
    fn hashes_agree_across_threads() {
        let here: Vec<u64> = (0..100).map(|i| str_hash(&format!("m{i}"))).collect();
        let there = std::thread::spawn(|| {
            (0..100)
                .map(|i| str_hash(&format!("m{i}")))
                .collect::<Vec<u64>>()
        })
        .join()
        .unwrap();
        assert_eq!(here, there);
        let mut distinct = here.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), here.len());
        assert_ne!(pair_hash(1, "m0"), pair_hash(2, "m0"));
        // Spelt out as `hash_one` does it.
        assert_eq!(str_hash("m0"), Keyed.hash_one("m0"));
        assert_eq!(pair_hash(7, "m0"), Keyed.hash_one((7u32, "m0")));
    }
}
