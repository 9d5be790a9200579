//! Interning of member names: a per-thread table of shared keys, each kept with its keyed
//! hash, swept of names only it still holds when full.

use super::*;

/// Longest key text worth interning.
pub(super) const INTERN_MAX_LEN: usize = 64;
/// A thread's table starts this large and sweeps (drops the keys only it still holds) when
/// full; it doubles when a sweep leaves it more than half full, up to `INTERN_MAX_KEYS`.
pub(super) const INTERN_FIRST_CAP: usize = 1 << 16;
pub(super) const INTERN_MAX_KEYS: usize = 1 << 22;
/// An object of this many members or more is a bulk load (a large model's document): once its
/// names are interned, the thread's table starts over (see [`intern_all`]).
pub(super) const WIDE_LOAD: usize = 1 << 16;

/// A thread's table of shared keys: each with its hash, so that growing the table and
/// looking a name up compare and move hashes, not the names' text (a cache miss each). The
/// names come from clients, so the hash is keyed ([`crate::hash`]): crafted names cannot all
/// land in one bucket.
#[derive(Default)]
pub(super) struct Interner {
    pub(super) set: NameTable,
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
    intern_with(s, || Key::from(s))
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

/// [`intern`] for many names at once (the members of a wide object), the table taken once,
/// given each name's hash ([`crate::hash::str_hash`]): computed once by the caller, for the
/// table's prefetches and lookups and its own use (a wide map's slots), where each of them
/// hashed the name again (a 2M-member document: 8M hashes, not 2M). The slot of the name
/// `AHEAD` places on and the text of the one half as far are loaded while each is looked up
/// (a wide object's names are cache misses in a large table).
///
/// After a bulk load ([`WIDE_LOAD`] names or more) the table starts over, unless a
/// [`HoldingNames`] guard is open. The load's names are held by its document from then on,
/// and by the compiled model whose names it found here (a model is compiled before its
/// document is loaded). Kept, they would pin 12–16 bytes a name for the thread's life (48 MB
/// after a 1M-derivation model's 3M names) only to share them with specs and documents not
/// seen yet. What is compiled later against this document shares its names through
/// [`share_names_of`].
pub(super) fn intern_all<'a>(
    names: impl ExactSizeIterator<Item = &'a str>,
    hashes: &[u64],
) -> Vec<Key> {
    const AHEAD: usize = 16;
    INTERNED.with(|t| {
        let mut t = t.borrow_mut();
        let mut keys = Vec::with_capacity(names.len());
        for (i, s) in names.enumerate() {
            if let Some(&h) = hashes.get(i + AHEAD) {
                t.set.prefetch(h);
            }
            if let Some(&h) = hashes.get(i + AHEAD / 2) {
                t.set.prefetch_text(h);
            }
            let h = hashes.get(i).copied().unwrap_or_else(|| name_hash(s));
            keys.push(t.key_hashed(s, h, || Key::from(s)));
        }
        if keys.len() >= WIDE_LOAD && t.holding == 0 {
            t.set = NameTable::default();
            t.cap = 0;
        }
        keys
    })
}

/// Put the names of `doc`'s top-level members in this thread's table (those it has not got),
/// so that a spec compiled next against `doc` (an evolution) shares them rather than making
/// its own copies: after a bulk load the table holds none of them ([`intern_all`]).
pub fn share_names_of(doc: &Val) {
    let Val::Obj(m) = doc else { return };
    reserve_names(INTERNED.with(|t| t.borrow().set.len()) + m.len());
    INTERNED.with(|t| {
        let mut t = t.borrow_mut();
        for (k, _) in m.iter() {
            t.key(k, || k.clone());
        }
    });
}

/// Start loading the slot of name `s` in this thread's table: a caller about to intern a run
/// of names calls this for one some places ahead of the one it interns.
pub fn prefetch_name(s: &str) {
    if s.len() <= INTERN_MAX_LEN {
        INTERNED.with(|t| t.borrow().set.prefetch(name_hash(s)));
    }
}

impl Interner {
    /// The shared key for `s`, made by `make` (and kept, while the table has room) when the
    /// name is new; a name too long to be worth sharing is only made.
    pub(super) fn key(&mut self, s: &str, make: impl FnOnce() -> Key) -> Key {
        if s.len() > INTERN_MAX_LEN {
            return make();
        }
        self.key_hashed(s, name_hash(s), make)
    }

    /// [`Interner::key`] for a name whose hash is `h` ([`name_hash`]).
    pub(super) fn key_hashed(&mut self, s: &str, h: u64, make: impl FnOnce() -> Key) -> Key {
        if s.len() > INTERN_MAX_LEN {
            return make();
        }
        if let Some(k) = self.set.find(h, |k| **k == *s) {
            return k.clone();
        }
        let k: Key = make();
        if self.cap == 0 {
            self.cap = INTERN_FIRST_CAP;
        }
        if self.set.len() >= self.cap {
            if self.holding == 0 {
                self.set
                    .retain(|(_, k)| Key::strong_count(k).is_some_and(|n| n > 1));
            }
            if self.set.len() >= self.cap / 2 {
                self.cap = (self.cap * 2).min(INTERN_MAX_KEYS);
            }
            if self.set.len() < self.set.capacity() / 4 {
                let keep = self.set.len() * 2;
                self.set.shrink_to(keep);
            }
        }
        if self.set.len() < self.cap {
            self.set.insert_unique(h, k.clone());
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
        t.set.reserve(more);
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

/// The interning table: open addressing with linear probing over two arrays, each slot's tag
/// (the high half of its name's hash, never `0`: `0` marks an empty slot, and the slot a name
/// probes first is its tag's low bits) and its key, at most seven eighths full — 12 bytes a
/// slot, where a SIMD-grouped table of (hash, key) takes 17. Unlike such a table its slot for
/// a hash is known before the probe, so a run of names can start loading theirs ahead
/// ([`prefetch_name`]): a large compile or load interns millions of names, each a cache miss
/// or two in a table of that size.
#[derive(Default)]
pub(super) struct NameTable {
    tags: Vec<u32>,
    keys: Vec<Option<Key>>,
    len: usize,
}

/// A name's tag: the high half of its hash, never `0` (which marks an empty slot).
#[inline]
fn tag(h: u64) -> u32 {
    ((h >> 32) as u32).max(1)
}

/// Slots for `n` names at most seven eighths full.
fn slots_for(n: usize) -> usize {
    (n.saturating_mul(8) / 7 + 1).next_power_of_two()
}

impl NameTable {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Names it holds before it must grow.
    pub(super) fn capacity(&self) -> usize {
        self.tags.len() / 8 * 7
    }

    #[inline]
    fn mask(&self) -> usize {
        self.tags.len().wrapping_sub(1)
    }

    /// Start loading the slot `h` probes first.
    #[inline]
    pub(super) fn prefetch(&self, h: u64) {
        if self.tags.is_empty() {
            return;
        }
        let i = (tag(h) as usize) & self.mask();
        crate::prefetch(&self.tags[i]);
        crate::prefetch(&self.keys[i]);
    }

    /// Start loading the text of the key in the slot `h` probes first, when that slot holds
    /// its tag (loaded already by [`NameTable::prefetch`], some names before).
    #[inline]
    pub(super) fn prefetch_text(&self, h: u64) {
        if self.tags.is_empty() {
            return;
        }
        let t = tag(h);
        let i = (t as usize) & self.mask();
        if self.tags[i] == t {
            if let Some(k) = &self.keys[i] {
                crate::prefetch(k.as_ptr());
            }
        }
    }

    /// The key of hash `h` for which `eq` holds.
    #[inline]
    pub(super) fn find(&self, h: u64, mut eq: impl FnMut(&Key) -> bool) -> Option<&Key> {
        if self.tags.is_empty() {
            return None;
        }
        let (t, mask) = (tag(h), self.mask());
        let mut i = (t as usize) & mask;
        loop {
            match self.tags[i] {
                0 => return None,
                et if et == t => {
                    if let Some(k) = self.keys[i].as_ref().filter(|k| eq(k)) {
                        return Some(k);
                    }
                }
                _ => {}
            }
            i = (i + 1) & mask;
        }
    }

    /// Add an entry known not to be there, growing when full.
    pub(super) fn insert_unique(&mut self, h: u64, k: Key) {
        if self.len + 1 > self.capacity() {
            self.rebuild((self.len + 1).max(16));
        }
        self.put(tag(h), k);
        self.len += 1;
    }

    fn put(&mut self, t: u32, k: Key) {
        let mask = self.mask();
        let mut i = (t as usize) & mask;
        while self.tags[i] != 0 {
            i = (i + 1) & mask;
        }
        self.tags[i] = t;
        self.keys[i] = Some(k);
    }

    /// Move every entry to a table of room for `n` names.
    fn rebuild(&mut self, n: usize) {
        let slots = slots_for(n.max(self.len));
        let tags = std::mem::replace(&mut self.tags, vec![0; slots]);
        let keys = std::mem::replace(&mut self.keys, vec![None; slots]);
        for (t, k) in tags.into_iter().zip(keys) {
            if let Some(k) = k {
                self.put(t, k);
            }
        }
    }

    /// Room for `additional` more names without growing.
    pub(super) fn reserve(&mut self, additional: usize) {
        let want = self.len.saturating_add(additional);
        if want > self.capacity() {
            self.rebuild(want);
        }
    }

    /// Fewer slots, down to room for `n` names (or as many as it holds).
    pub(super) fn shrink_to(&mut self, n: usize) {
        if slots_for(n.max(self.len)) < self.tags.len() {
            self.rebuild(n);
        }
    }

    /// Keep only the entries for which `f` holds.
    pub(super) fn retain(&mut self, mut f: impl FnMut(&(u32, Key)) -> bool) {
        let slots = self.tags.len();
        let tags = std::mem::replace(&mut self.tags, vec![0; slots]);
        let keys = std::mem::replace(&mut self.keys, vec![None; slots]);
        self.len = 0;
        for (h, k) in tags.into_iter().zip(keys) {
            if let Some(k) = k {
                let pair = (h, k);
                if f(&pair) {
                    self.put(pair.0, pair.1);
                    self.len += 1;
                }
            }
        }
    }

    /// The entries, in no particular order.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &Key)> + '_ {
        self.tags
            .iter()
            .zip(&self.keys)
            .filter_map(|(&h, k)| Some((h, k.as_ref()?)))
    }
}
