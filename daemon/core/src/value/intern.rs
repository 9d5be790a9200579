//! Interning of member names: a per-thread table of shared keys, each kept with its keyed
//! hash, swept of names only it still holds when full.

use super::*;

/// Longest key text worth interning.
pub(super) const INTERN_MAX_LEN: usize = 64;
/// A thread's table starts this large and sweeps (drops the keys only it still holds) when
/// full; it doubles when a sweep leaves it more than half full, up to `INTERN_MAX_KEYS`.
pub(super) const INTERN_FIRST_CAP: usize = 1 << 16;
pub(super) const INTERN_MAX_KEYS: usize = 1 << 22;

/// A thread's table of shared keys: each with its hash, so that growing the table and
/// looking a name up compare and move hashes, not the names' text (a cache miss each). The
/// names come from clients, so the hash is keyed ([`crate::hash`]): crafted names cannot all
/// land in one bucket.
#[derive(Default)]
pub(super) struct Interner {
    pub(super) set: hashbrown::HashTable<(u64, Key)>,
    pub(super) cap: usize,
    /// Open [`HoldingNames`] guards: while any is, a full table grows instead of sweeping.
    pub(super) holding: usize,
}

pub(super) fn name_hash(s: &str) -> u64 {
    crate::hash::str_hash(s)
}

thread_local! {
    pub(super) static INTERNED: std::cell::RefCell<Interner> = std::cell::RefCell::new(Interner::default());
}

/// The shared `Key` for a member name. Documents repeat the same few names (every element of
/// an array has the same fields), so sharing one allocation per name saves memory and makes
/// lookups compare pointers before bytes. The table holds the keys in use (a model of 300k
/// distinct members shares each name among its state, index and nodes); names nothing uses
/// any more are swept out when it fills, and past `INTERN_MAX_KEYS` live names keys are simply
/// allocated.
pub fn intern(s: &str) -> Key {
    intern_with(s, || Arc::from(s))
}

/// The shared key for `key`'s text: `key` itself when the name is not interned yet. For keys
/// made without the table (a mutation's address, [`crate::expr::path::Address::parse_transient`])
/// at the point they are stored in a document.
pub fn share(key: Key) -> Key {
    intern_with(&key.clone(), || key)
}

pub(super) fn intern_with(s: &str, make: impl FnOnce() -> Key) -> Key {
    INTERNED.with(|t| t.borrow_mut().key(s, make))
}

/// [`intern`] for many names at once (the members of a wide object), the table taken once.
pub fn intern_all<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> Vec<Key> {
    INTERNED.with(|t| {
        let mut t = t.borrow_mut();
        let mut keys = Vec::with_capacity(names.len());
        for s in names {
            keys.push(t.key(s, || Arc::from(s)));
        }
        keys
    })
}

impl Interner {
    /// The shared key for `s`, made by `make` (and kept, while the table has room) when the
    /// name is new; a name too long to be worth sharing is only made.
    pub(super) fn key(&mut self, s: &str, make: impl FnOnce() -> Key) -> Key {
        if s.len() > INTERN_MAX_LEN {
            return make();
        }
        let h = name_hash(s);
        if let Some((_, k)) = self.set.find(h, |(eh, k)| *eh == h && **k == *s) {
            return k.clone();
        }
        let k: Key = make();
        if self.cap == 0 {
            self.cap = INTERN_FIRST_CAP;
        }
        if self.set.len() >= self.cap {
            if self.holding == 0 {
                self.set.retain(|(_, k)| Arc::strong_count(k) > 1);
            }
            if self.set.len() >= self.cap / 2 {
                self.cap = (self.cap * 2).min(INTERN_MAX_KEYS);
            }
            if self.set.len() < self.set.capacity() / 4 {
                let keep = self.set.len() * 2;
                self.set.shrink_to(keep, |(h, _)| *h);
            }
        }
        if self.set.len() < self.cap {
            self.set.insert_unique(h, (h, k.clone()), |(h, _)| *h);
        }
        k
    }
}

/// While this guard lives, this thread's intern table grows when full rather than sweeping
/// out the names only it holds: for a compile, whose new names are all held by the model it
/// makes, so that a sweep would read every key in the table to drop none of them.
pub struct HoldingNames(std::marker::PhantomData<*const ()>);

/// Room in this thread's intern table for `total` names in all (a compile's, counted before it
/// interns them): a table that small is made that large once rather than doubled step by step;
/// one that holds as many already (a spec compiled again) is left as it is.
pub fn reserve_names(total: usize) {
    INTERNED.with(|t| {
        let mut t = t.borrow_mut();
        let want = total.min(INTERN_MAX_KEYS);
        t.cap = t.cap.max(INTERN_FIRST_CAP).max(want);
        let more = want.saturating_sub(t.set.len());
        t.set.reserve(more, |(h, _)| *h);
    });
}

/// See [`HoldingNames`].
pub fn holding_names() -> HoldingNames {
    INTERNED.with(|t| t.borrow_mut().holding += 1);
    HoldingNames(std::marker::PhantomData)
}

impl Drop for HoldingNames {
    fn drop(&mut self) {
        let _ = INTERNED.try_with(|t| {
            let mut t = t.borrow_mut();
            t.holding = t.holding.saturating_sub(1);
        });
    }
}

/// The same key text by pointer (interned keys): a `false` proves nothing.
#[inline]
pub(super) fn same_key(a: &str, b: &str) -> bool {
    a.as_ptr() == b.as_ptr() && a.len() == b.len()
}

/// Key equality with a pointer fast path for interned keys.
#[inline]
pub fn key_eq(a: &str, b: &str) -> bool {
    same_key(a, b) || a == b
}
