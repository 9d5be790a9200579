//! Wide objects: a persistent hash array mapped trie of up to 32 slots per branch, keyed by
//! the keyed hash of `crate::hash`.

use super::*;

// ---------------------------------------------------------------------------------------------
// Wide objects: a persistent hash array mapped trie, up to 32 slots per branch, keyed by a 64-bit
// keyed hash of the key ([`crate::hash`]: secret per process). Keys whose whole hashes are equal
// share one slot, an ordered map by key text, so even keys made to collide cost O(log n) each. A
// branch stores only its occupied slots (a bitmap says which), so the sparse bottom branches of a
// wide object cost tens of bytes, not 32 slots. 32 rather than 16: a 200k-member object is a level
// shallower (3–4 levels, not 4–5), one cache miss less on every read and write of it (fan-out 100k
// one mutation ~5% faster). A member is kept in its slot, not behind a pointer of its own:
// reaching it is one cache miss less, and a 200k-member object is 6 MB smaller. A write copies
// only the branches on one hash path (a few levels deep), so snapshots stay cheap at any width.
// Insertion order is kept by a sequence number per entry.

pub(super) const FANOUT_BITS: u32 = 5;
pub(super) const FANOUT: usize = 1 << FANOUT_BITS;

/// A member: 40 bytes, kept in its branch's slot (a 300k-member object has 300k of them). It
/// keeps the low half of its key's hash, which is what the first six levels index by and
/// rejects almost every other key without reading its text; the whole hash is computed again
/// from the key when a collision needs it.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) hash: u32,
    /// Its insertion rank in the map (see [`WideMap::insert`] for when ranks run out).
    pub(super) seq: u32,
    pub(super) key: Key,
    pub(super) val: Val,
}

impl Clone for Entry {
    #[inline]
    fn clone(&self) -> Self {
        // Tests count copies of members (a write to a shared map copies what it changes).
        #[cfg(test)]
        tests::ENTRY_COPIES.with(|c| c.set(c.get() + 1));
        Entry {
            hash: self.hash,
            seq: self.seq,
            key: self.key.clone(),
            val: self.val.clone(),
        }
    }
}

/// The part of a key's hash an entry keeps.
#[inline]
pub(super) fn low(hash: u64) -> u32 {
    hash as u32
}

/// What [`ObjMap::get_hashed`] takes for a member name.
pub fn member_hash(key: &str) -> u32 {
    low(hash_key(key))
}

/// A branch with fewer slots than this is taken for a bottom one by [`WideMap::prefetch`]:
/// its slot is prefetched, not read (the full branches above it are few and stay in cache).
pub(super) const PREFETCH_BELOW: usize = FANOUT / 2;

/// Levels of a wide map that the low half of a hash indexes.
pub(super) const LOW_LEVELS: u32 = u32::BITS / FANOUT_BITS;

/// Whether `e`'s key has the whole hash `hash`.
pub(super) fn same_hash(e: &Entry, hash: u64) -> bool {
    e.hash == low(hash) && hash_key(&e.key) == hash
}

/// The members of one slot whose keys' whole 64-bit hashes are equal (two or more), by key
/// text: finding, adding or removing one is O(log n) string comparisons, and a write to a
/// shared one copies one path of it, not all of it. Crafting such keys takes the process's
/// secret seed; this keeps the map O(log n) per write even for someone who has it. Its
/// methods are out of line: no ordinary map has such a slot, and the lookups and writes every
/// map makes stay small enough to inline.
#[derive(Clone, Debug)]
pub(super) struct Collisions(OrdMap<Key, Entry>);

impl Collisions {
    #[cold]
    #[inline(never)]
    pub(super) fn of(entries: impl Iterator<Item = Entry>) -> Collisions {
        Collisions(entries.map(|e| (e.key.clone(), e)).collect())
    }

    #[cold]
    #[inline(never)]
    pub(super) fn get(&self, key: &str) -> Option<&Entry> {
        self.0.get(key)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn get_mut(&mut self, key: &str) -> Option<&mut Entry> {
        self.0.get_mut(key)
    }

    /// A member (they all have the group's hash).
    #[cold]
    #[inline(never)]
    pub(super) fn any(&self) -> Option<&Entry> {
        self.0.get_min().map(|(_, e)| e)
    }

    /// Add a member whose key is not in the group yet.
    #[cold]
    #[inline(never)]
    pub(super) fn add(&mut self, e: Entry) {
        self.0.insert(e.key.clone(), e);
    }

    #[cold]
    #[inline(never)]
    pub(super) fn remove(&mut self, key: &str) -> Option<Entry> {
        self.0.remove(key)
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.0.values()
    }
}

#[derive(Clone, Debug)]
pub(super) enum Slot {
    One(Entry),
    /// Keys whose full 64-bit hashes collide.
    Many(Collisions),
    /// A branch: which of its `FANOUT` slots are occupied (bit `i` for slot `i`), and those
    /// slots in order. The bitmap sits here, in the parent, and the slots in one shared
    /// allocation, so a step down the trie is one cache miss (not a branch record and then
    /// its array). A slot is the 40 bytes of its member.
    Branch {
        bitmap: Bitmap,
        slots: Arc<[Slot]>,
    },
    /// Only while a branch's slots are moved into a new array: never in a finished map.
    Vacant,
}

impl Slot {
    /// A branch's bitmap and slots.
    #[inline]
    pub(super) fn branch(&self) -> Option<(Bitmap, &[Slot])> {
        match self {
            Slot::Branch { bitmap, slots } => Some((*bitmap, slots)),
            _ => None,
        }
    }
}

/// One bit per slot of a branch.
pub(super) type Bitmap = u32;

const _: () = assert!(FANOUT <= Bitmap::BITS as usize);
const _: () = assert!(std::mem::size_of::<Slot>() == 40);

/// Where slot `i` of a branch is (or would be) stored, and whether it is occupied.
#[inline]
pub(super) fn pos(bitmap: Bitmap, i: usize) -> (usize, bool) {
    let bit: Bitmap = 1 << i;
    (
        (bitmap & (bit - 1)).count_ones() as usize,
        bitmap & bit != 0,
    )
}

#[inline]
pub(super) fn slot_get(bitmap: Bitmap, slots: &[Slot], i: usize) -> Option<&Slot> {
    match pos(bitmap, i) {
        (p, true) => slots.get(p),
        _ => None,
    }
}

/// A branch being changed: its bitmap and its slots, wherever they are kept (the map's root,
/// or a parent's slot).
pub(super) struct BranchMut<'a> {
    pub(super) bitmap: &'a mut Bitmap,
    pub(super) slots: &'a mut Arc<[Slot]>,
}

impl<'a> BranchMut<'a> {
    /// The branch in `slot`, if it is one.
    pub(super) fn of(slot: &'a mut Slot) -> Option<Self> {
        match slot {
            Slot::Branch { bitmap, slots } => Some(BranchMut { bitmap, slots }),
            _ => None,
        }
    }

    pub(super) fn reborrow(&mut self) -> BranchMut<'_> {
        BranchMut {
            bitmap: self.bitmap,
            slots: self.slots,
        }
    }

    /// Copy-on-write access to occupied slot `i` (the array is copied when shared).
    #[inline]
    pub(super) fn into_slot(self, i: usize) -> Option<&'a mut Slot> {
        match pos(*self.bitmap, i) {
            (p, true) => Arc::make_mut(self.slots).get_mut(p),
            _ => None,
        }
    }

    /// The slots, moved out when this branch holds the only reference, cloned otherwise.
    pub(super) fn drain(&mut self) -> Vec<Slot> {
        match Arc::get_mut(self.slots) {
            Some(slots) => slots
                .iter_mut()
                .map(|s| std::mem::replace(s, Slot::Vacant))
                .collect(),
            None => self.slots.to_vec(),
        }
    }

    /// Occupy the empty slot `i`.
    pub(super) fn put(&mut self, i: usize, slot: Slot) {
        let (p, _) = pos(*self.bitmap, i);
        let mut v = self.drain();
        v.insert(p, slot);
        *self.slots = Arc::from(v);
        *self.bitmap |= 1 << i;
    }

    /// Empty the occupied slot `i`.
    pub(super) fn take(&mut self, i: usize) -> Option<Slot> {
        let (p, true) = pos(*self.bitmap, i) else {
            return None;
        };
        let mut v = self.drain();
        let out = v.remove(p);
        *self.slots = Arc::from(v);
        *self.bitmap &= !(1 << i);
        Some(out)
    }
}

pub(super) fn no_slots() -> Arc<[Slot]> {
    Arc::from(Vec::new())
}

/// The wide-object map (see above).
#[derive(Clone, Debug)]
pub struct WideMap {
    pub(super) bitmap: Bitmap,
    pub(super) slots: Arc<[Slot]>,
    pub(super) len: usize,
    pub(super) next: u32,
}

impl Default for WideMap {
    fn default() -> Self {
        WideMap {
            bitmap: 0,
            slots: no_slots(),
            len: 0,
            next: 0,
        }
    }
}

#[cfg(not(test))]
#[inline]
pub(super) fn hash_key(key: &str) -> u64 {
    crate::hash::str_hash(key)
}

/// Tests choose the hashes of some keys, to build deep branches and collisions on purpose.
#[cfg(test)]
pub(super) fn hash_key(key: &str) -> u64 {
    tests::CHOSEN
        .with(|c| c.borrow().get(key).copied())
        .unwrap_or_else(|| crate::hash::str_hash(key))
}

pub(super) fn slot_index(hash: u64, shift: u32) -> usize {
    ((hash >> shift) & (FANOUT as u64 - 1)) as usize
}

/// Levels the whole hash indexes (the last one with the hash's top bits).
pub(super) const ALL_LEVELS: u32 = u64::BITS.div_ceil(FANOUT_BITS);

/// The entry for `key` (of hash `hash`) below a branch, searched in at most `levels` levels:
/// `None` when it lies deeper than that.
pub(super) fn find_entry<'a>(
    mut bitmap: Bitmap,
    mut slots: &'a [Slot],
    hash: u64,
    key: &str,
    levels: u32,
) -> Option<Option<&'a Entry>> {
    for level in 0..levels {
        let Some(slot) = slot_get(bitmap, slots, slot_index(hash, level * FANOUT_BITS)) else {
            return Some(None);
        };
        match slot {
            Slot::One(e) => return Some((e.hash == low(hash) && key_eq(&e.key, key)).then_some(e)),
            Slot::Many(es) => return Some(es.get(key)),
            Slot::Branch { .. } => (bitmap, slots) = slot.branch()?,
            Slot::Vacant => return Some(None),
        }
    }
    None
}

impl WideMap {
    pub(super) fn root(&mut self) -> BranchMut<'_> {
        BranchMut {
            bitmap: &mut self.bitmap,
            slots: &mut self.slots,
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&Entry> {
        find_entry(self.bitmap, &self.slots, hash_key(key), key, ALL_LEVELS).flatten()
    }

    /// Walk the branches on `hash`'s path down to the one whose slots are not yet read, and
    /// prefetch the slot there (see [`ObjMap::prefetch_hashed`]).
    pub(super) fn prefetch(&self, hash: u64) {
        let (mut bitmap, mut slots): (Bitmap, &[Slot]) = (self.bitmap, &self.slots);
        for level in 0..LOW_LEVELS {
            let (p, true) = pos(bitmap, slot_index(hash, level * FANOUT_BITS)) else {
                return;
            };
            let Some(slot) = slots.get(p) else { return };
            if slots.len() < PREFETCH_BELOW {
                return crate::prefetch(slot);
            }
            let Some(below) = slot.branch() else { return };
            (bitmap, slots) = below;
        }
    }

    /// The first stage of a prefetch two stages long: load the slot one level above where
    /// [`WideMap::prefetch`] will (the levels above it are full and few enough to stay in
    /// cache), so that its walk, started some lookups later, does not wait on that level.
    pub(super) fn prefetch_far(&self, hash: u64) {
        // Levels of full branches: a map of 32^k members or more has k of them.
        let full = (self.len.max(1).ilog2() / FANOUT_BITS).min(LOW_LEVELS);
        let (mut bitmap, mut slots): (Bitmap, &[Slot]) = (self.bitmap, &self.slots);
        for level in 0..full {
            let (p, true) = pos(bitmap, slot_index(hash, level * FANOUT_BITS)) else {
                return;
            };
            let Some(slot) = slots.get(p) else { return };
            if level + 1 == full {
                return crate::prefetch(slot);
            }
            let Some(below) = slot.branch() else { return };
            (bitmap, slots) = below;
        }
    }

    /// [`WideMap::get`] given the low half of `key`'s hash: past the levels it indexes (a
    /// chain of collisions 30 bits long) the whole hash is computed.
    pub(super) fn get_hashed(&self, hash: u32, key: &str) -> Option<&Entry> {
        find_entry(self.bitmap, &self.slots, u64::from(hash), key, LOW_LEVELS)
            .unwrap_or_else(|| self.get(key))
    }

    pub(super) fn get_mut(&mut self, key: &str) -> Option<&mut Val> {
        let hash = hash_key(key);
        let mut branch = self.root();
        let mut shift = 0;
        loop {
            let slot = branch.into_slot(slot_index(hash, shift))?;
            match slot {
                Slot::One(e) => {
                    if e.hash != low(hash) || &*e.key != key {
                        return None;
                    }
                    return Some(&mut e.val);
                }
                Slot::Many(es) => return es.get_mut(key).map(|e| &mut e.val),
                Slot::Branch { .. } => {
                    branch = BranchMut::of(slot)?;
                    shift += FANOUT_BITS;
                }
                Slot::Vacant => return None,
            }
        }
    }

    /// The map of `entries` (distinct keys, in insertion order, each already the key to
    /// keep), built at once: sorted by the hash's digits from the root down, every branch is
    /// made with its final slots (inserting them one by one copies the bottom branch at each
    /// step). The same map as those insertions make. `hashes` are the keys' hashes
    /// ([`crate::hash::str_hash`], in the entries' order) and `order`, when it was made
    /// already, their [`hashed_order`].
    pub(super) fn from_entries(
        entries: Vec<(Key, Val)>,
        hashes: Vec<u64>,
        order: Option<Vec<(u64, u32)>>,
    ) -> WideMap {
        // Tests choose some keys' hashes (`hash_key`): the map is built with those.
        #[cfg(test)]
        let (hashes, order): (Vec<u64>, Option<Vec<(u64, u32)>>) =
            if tests::CHOSEN.with(|c| c.borrow().is_empty()) {
                (hashes, order)
            } else {
                (Vec::new(), None)
            };
        let len = entries.len();
        let Ok(next) = u32::try_from(len) else {
            let mut m = WideMap::default();
            for (k, v) in entries {
                m.insert(k, v, |k| k);
            }
            return m;
        };
        let hashes = if hashes.len() == len {
            hashes
        } else {
            entries.iter().map(|(k, _)| hash_key(k)).collect()
        };
        let order = match order {
            Some(order) if order.len() == len => order,
            _ => hashed_order(&hashes),
        };
        let mut entries: Vec<Option<(Key, Val)>> = entries.into_iter().map(Some).collect();
        // The branches take their members in sorted order, each from anywhere in `entries`:
        // the one `TAKE_AHEAD` places on starts loading as each is taken.
        let mut taken = 0;
        let mut take = |i: u32| {
            if let Some(&(_, ahead)) = order.get(taken + TAKE_AHEAD) {
                crate::prefetch(entries.as_ptr().wrapping_add(ahead as usize));
                crate::prefetch(hashes.as_ptr().wrapping_add(ahead as usize));
            }
            taken += 1;
            let (key, val) = entries.get_mut(i as usize)?.take()?;
            Some(Entry {
                hash: low(hashes[i as usize]),
                seq: i,
                key,
                val,
            })
        };
        let (bitmap, slots) = build_branch(&order, 0, &mut take, &mut Vec::new());
        WideMap {
            bitmap,
            slots,
            len,
            next,
        }
    }

    pub(super) fn insert(&mut self, key: Key, val: Val, store: fn(Key) -> Key) -> Option<Val> {
        if self.next == u32::MAX {
            self.renumber();
        }
        let hash = hash_key(&key);
        let seq = self.next;
        let old = insert_at(self.root(), hash, 0, key, val, seq, store);
        if old.is_none() {
            self.len += 1;
            self.next += 1;
        }
        old
    }

    pub(super) fn remove(&mut self, key: &str) -> Option<Val> {
        let hash = hash_key(key);
        let out = remove_at(self.root(), hash, 0, key);
        if out.is_some() {
            self.len -= 1;
        }
        out
    }

    /// Number the entries again from 0 in their order, when 2^32 insertions of new keys
    /// (removed ones included) have used up the ranks.
    pub(super) fn renumber(&mut self) {
        let entries: Vec<(Key, Val)> = self
            .ordered()
            .into_iter()
            .map(|e| (e.key.clone(), e.val.clone()))
            .collect();
        *self = WideMap::default();
        for (k, v) in entries {
            self.insert(k, v, |k| k);
        }
    }

    /// Entries in insertion order.
    pub(super) fn ordered(&self) -> Vec<&Entry> {
        let mut out = Vec::with_capacity(self.len);
        collect_entries(&self.slots, &mut out);
        out.sort_unstable_by_key(|e| e.seq);
        out
    }
}

/// The order [`WideMap::from_entries`] takes the members of hashes `hashes` in: by
/// [`root_first`], with each one's position.
pub(super) fn hashed_order(hashes: &[u64]) -> Vec<(u64, u32)> {
    hashed_order_into(hashes, Vec::with_capacity(hashes.len()))
}

/// [`hashed_order`] into `order` (emptied first): a helper thread given room made by the
/// loading thread allocates nothing.
pub(super) fn hashed_order_into(hashes: &[u64], mut order: Vec<(u64, u32)>) -> Vec<(u64, u32)> {
    order.clear();
    order.extend((0u32..).zip(hashes).map(|(i, &h)| (root_first(h), i)));
    order.sort_unstable();
    order
}

/// From this many members, a wide object loaded from JSON has its members' order sorted on
/// another thread while its names are interned and its values converted ([`Val::from_json`]).
pub(super) const SORT_APART: usize = 65_536;

/// How far ahead in its sorted order [`WideMap::from_entries`] starts loading a member.
pub(super) const TAKE_AHEAD: usize = 16;

/// A hash with its levels' digits reordered so that the root's comes first: sorting by it
/// puts the members of every branch next to one another, in slot order. The last level has
/// the hash's top 4 bits.
pub(super) fn root_first(hash: u64) -> u64 {
    let mut out = 0u64;
    for level in 0..ALL_LEVELS - 1 {
        out = (out << FANOUT_BITS) | slot_index(hash, level * FANOUT_BITS) as u64;
    }
    let last = (ALL_LEVELS - 1) * FANOUT_BITS;
    (out << (u64::BITS - last)) | (hash >> last)
}

/// The branch at `shift` holding `run` (positions sorted by [`root_first`] of their hashes,
/// all on this branch's path), its entries taken by `take`. `bufs` holds a buffer per level,
/// reused from branch to branch: a branch's slots are gathered there and moved into their
/// `Arc` in one allocation of the exact size (a 2M-member map has ~1M small bottom branches;
/// growing a fresh `Vec` for each and copying it into its `Arc` was most of its build).
pub(super) fn build_branch(
    run: &[(u64, u32)],
    shift: u32,
    take: &mut impl FnMut(u32) -> Option<Entry>,
    bufs: &mut Vec<Vec<Slot>>,
) -> (Bitmap, Arc<[Slot]>) {
    // This level's digit in a `root_first` key: 5 bits, or the last level's 4 at the end.
    let digit = |k: u64| match u64::BITS.checked_sub(shift + FANOUT_BITS) {
        Some(at) => ((k >> at) & (FANOUT as u64 - 1)) as usize,
        None => (k & ((1 << (u64::BITS - shift)) - 1)) as usize,
    };
    let depth = (shift / FANOUT_BITS) as usize;
    if bufs.len() <= depth {
        bufs.resize_with(depth + 1, Vec::new);
    }
    let mut slots = std::mem::take(&mut bufs[depth]);
    slots.clear();
    let mut bitmap: Bitmap = 0;
    let mut rest = run;
    while let Some(&(first, _)) = rest.first() {
        let d = digit(first);
        let n = rest.iter().take_while(|&&(k, _)| digit(k) == d).count();
        let (group, after) = rest.split_at(n);
        rest = after;
        bitmap |= 1 << d;
        let last = group.last().map_or(first, |&(k, _)| k);
        let slot = if let [(_, i)] = group {
            take(*i).map(Slot::One)
        } else if first == last {
            // One whole hash: the keys that share it.
            Some(Slot::Many(Collisions::of(
                group.iter().filter_map(|&(_, i)| take(i)),
            )))
        } else {
            let (bitmap, slots) = build_branch(group, shift + FANOUT_BITS, take, bufs);
            Some(Slot::Branch { bitmap, slots })
        };
        slots.extend(slot);
    }
    // A draining iterator has an exact length: the `Arc` is allocated once, at its size.
    let made: Arc<[Slot]> = slots.drain(..).collect();
    bufs[depth] = slots;
    (bitmap, made)
}

/// The hash a slot's entries share (a branch has none), as far as the level at `shift` needs
/// it: the low half an entry keeps while that indexes the level (no read of the key's text,
/// which is a cache miss of its own), the whole hash computed again below.
pub(super) fn slot_hash(slot: &Slot, shift: u32) -> Option<u64> {
    let e = match slot {
        Slot::One(e) => e,
        Slot::Many(es) => es.any()?,
        Slot::Branch { .. } | Slot::Vacant => return None,
    };
    Some(if shift + FANOUT_BITS <= u32::BITS {
        u64::from(e.hash)
    } else {
        hash_key(&e.key)
    })
}

/// Insert below `branch`; the replaced value, or `None` when the key is new.
pub(super) fn insert_at(
    mut branch: BranchMut<'_>,
    hash: u64,
    shift: u32,
    key: Key,
    val: Val,
    seq: u32,
    store: fn(Key) -> Key,
) -> Option<Val> {
    let i = slot_index(hash, shift);
    let new = |key: Key, val: Val| Entry {
        hash: low(hash),
        seq,
        key: store(key),
        val,
    };
    let Some(slot) = branch.reborrow().into_slot(i) else {
        branch.put(i, Slot::One(new(key, val)));
        return None;
    };
    match slot {
        Slot::One(e) if e.hash == low(hash) && (e.key == key || same_hash(e, hash)) => {
            if e.key == key {
                return Some(std::mem::replace(&mut e.val, val));
            }
            let (old, added) = (e.clone(), new(key, val));
            *slot = Slot::Many(Collisions::of([old, added].into_iter()));
            None
        }
        Slot::Many(es) if es.any().is_some_and(|e| same_hash(e, hash)) => {
            if let Some(e) = es.get_mut(&key) {
                return Some(std::mem::replace(&mut e.val, val));
            }
            es.add(new(key, val));
            None
        }
        Slot::Branch { bitmap, slots } => {
            let branch = BranchMut { bitmap, slots };
            insert_at(branch, hash, shift + FANOUT_BITS, key, val, seq, store)
        }
        Slot::Vacant => {
            *slot = Slot::One(new(key, val));
            None
        }
        Slot::One(_) | Slot::Many(_) => {
            // Two different hashes share this slot: push the old one level down.
            let old_hash = slot_hash(slot, shift + FANOUT_BITS).unwrap_or(0);
            let at = slot_index(old_hash, shift + FANOUT_BITS);
            let old = std::mem::replace(slot, Slot::Vacant);
            let mut bitmap: Bitmap = 1 << at;
            let mut slots: Arc<[Slot]> = Arc::from(vec![old]);
            let child = BranchMut {
                bitmap: &mut bitmap,
                slots: &mut slots,
            };
            insert_at(child, hash, shift + FANOUT_BITS, key, val, seq, store);
            *slot = Slot::Branch { bitmap, slots };
            None
        }
    }
}

pub(super) fn remove_at(
    mut branch: BranchMut<'_>,
    hash: u64,
    shift: u32,
    key: &str,
) -> Option<Val> {
    let i = slot_index(hash, shift);
    let slot = branch.reborrow().into_slot(i)?;
    match slot {
        Slot::One(e) => {
            if e.hash != low(hash) || &*e.key != key {
                return None;
            }
            let Some(Slot::One(e)) = branch.take(i) else {
                unreachable!("matched above")
            };
            Some(e.val)
        }
        Slot::Many(es) => {
            let removed = es.remove(key)?;
            if es.len() == 1 {
                if let Some(last) = es.any() {
                    *slot = Slot::One(last.clone());
                }
            }
            Some(removed.val)
        }
        Slot::Vacant => None,
        Slot::Branch { bitmap, slots } => {
            let out = remove_at(BranchMut { bitmap, slots }, hash, shift + FANOUT_BITS, key);
            // Collapse a branch left with a single entry so lookups stay short.
            match &**slots {
                [] => {
                    branch.take(i);
                }
                [only @ (Slot::One(_) | Slot::Many(_))] => *slot = only.clone(),
                _ => {}
            }
            out
        }
    }
}

pub(super) fn collect_entries<'a>(slots: &'a [Slot], out: &mut Vec<&'a Entry>) {
    for s in slots {
        match s {
            Slot::One(e) => out.push(e),
            Slot::Many(es) => out.extend(es.entries()),
            Slot::Branch { slots, .. } => collect_entries(slots, out),
            Slot::Vacant => {}
        }
    }
}
