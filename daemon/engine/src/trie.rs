//! Path tries over address segments: the reader index (written path → nodes that read it, its
//! ancestors or its descendants, with the `[*]` indices the match binds) and the producer index
//! (where derivations write). Arrays are mapped implicitly, as JSONata navigation does: a read of
//! `$.items.total` matches a write of `$.items[3].total`.

use std::collections::HashMap;

use valem_core::hash::{pair_hash, str_hash, Keyed};
use valem_core::value::{Key, Seg};

/// A field edge of the trie: from `parent` through member `key` to `child` (16 bytes; the
/// table hashes `(parent, key)` itself, so a lookup borrows the name and clones nothing). The
/// names are a spec's, so the hash is keyed ([`valem_core::hash`]).
#[derive(Debug)]
struct FieldEdge {
    key: Key,
    parent: u32,
    child: u32,
}

fn edge_hash(parent: u32, key: &str) -> u64 {
    pair_hash(parent, key)
}

/// A field edge from the root: to `child` through top-level member `key` (16 bytes). When
/// `child` is a plain leaf (one entry, nothing below) the edge holds that entry too, so a
/// write of the member finds its reader without visiting the node. Large flat models are
/// almost all root edges.
#[derive(Debug)]
struct RootEdge {
    key: Key,
    /// The child node; the top bit is the edge's mark ([`Trie::mark_member`], [`Trie::mark_all_members`]).
    child: u32,
    /// The child's only entry when it is a plain leaf (set by [`Trie::shrink`]), or `NONE`.
    leaf: u32,
}

#[cfg(target_pointer_width = "64")]
const _: () =
    assert!(std::mem::size_of::<FieldEdge>() == 16 && std::mem::size_of::<RootEdge>() == 16);

impl RootEdge {
    /// What [`Trie::member`] tells of this member.
    fn member(&self) -> Member {
        Member {
            child: self.child,
            leaf: self.leaf,
        }
    }
}

fn root_hash(key: &str) -> u64 {
    str_hash(key)
}

/// The root edges, split by hash among up to [`ROOT_SHARDS`] tables of one size. A table of
/// `n` entries has a power of two of buckets, from 8/7 `n` to 16/7 `n` (17 bytes each): fan-out
/// 1M reads 2M members, just past 1.8M, and its one table had 4M buckets (68 MB). Split five
/// ways, the same members take 5 × 512k (44 MB). The number of tables is chosen once, when
/// room is first reserved for many members ([`RootTable::reserve`]).
#[derive(Debug)]
struct RootTable {
    /// Never empty.
    shards: Vec<hashbrown::HashTable<RootEdge>>,
}

/// Most tables a [`RootTable`] is split into.
const ROOT_SHARDS: usize = 8;
/// Fewer members than this stay in one table.
const SHARD_FROM: usize = 4096;

/// Buckets of a `hashbrown` table made with room for `cap` entries.
fn buckets_for(cap: usize) -> usize {
    if cap < 8 {
        if cap < 4 {
            4
        } else {
            8
        }
    } else {
        (cap.saturating_mul(8) / 7).next_power_of_two()
    }
}

impl Default for RootTable {
    fn default() -> Self {
        RootTable {
            shards: vec![hashbrown::HashTable::new()],
        }
    }
}

impl RootTable {
    /// The table of hash `h`: from bits 25–56, which a table of up to 2^25 buckets does not
    /// place by and whose tag (the top 7 bits) they leave alone.
    #[inline]
    fn shard(&self, h: u64) -> usize {
        let mid = (h >> 25) as u32 as u64;
        ((mid * self.shards.len() as u64) >> 32) as usize
    }

    fn len(&self) -> usize {
        self.shards.iter().map(hashbrown::HashTable::len).sum()
    }

    /// Room for `n` more edges. Into an empty table of many, the split with the fewest
    /// buckets; each table with a tenth more room than its share.
    fn reserve(&mut self, n: usize) {
        let room = |k: usize| (n / k).saturating_add(n / k / 10);
        if self.len() == 0 && n >= SHARD_FROM {
            let k = (1..=ROOT_SHARDS)
                .min_by_key(|&k| k * buckets_for(room(k)))
                .unwrap_or(1);
            self.shards = (0..k)
                .map(|_| hashbrown::HashTable::with_capacity(room(k)))
                .collect();
            return;
        }
        let room = room(self.shards.len());
        for t in &mut self.shards {
            t.reserve(room, |e| root_hash(&e.key));
        }
    }

    #[inline]
    fn find(&self, h: u64, k: &str) -> Option<&RootEdge> {
        self.shards[self.shard(h)].find(h, |e| valem_core::value::key_eq(&e.key, k))
    }

    fn find_mut(&mut self, h: u64, k: &str) -> Option<&mut RootEdge> {
        let s = self.shard(h);
        self.shards[s].find_mut(h, |e| valem_core::value::key_eq(&e.key, k))
    }

    /// The child of `k`'s edge, and whether `make` made it: one probe of the table, where a
    /// lookup then an insert take two (a large compile inserts millions).
    fn find_or_insert(&mut self, h: u64, k: &str, make: impl FnOnce() -> RootEdge) -> (u32, bool) {
        let s = self.shard(h);
        let entry = self.shards[s].entry(
            h,
            |e| valem_core::value::key_eq(&e.key, k),
            |e| root_hash(&e.key),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => (e.get().child, false),
            hashbrown::hash_table::Entry::Vacant(v) => (v.insert(make()).get().child, true),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &RootEdge> + '_ {
        self.shards.iter().flat_map(hashbrown::HashTable::iter)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut RootEdge> + '_ {
        self.shards
            .iter_mut()
            .flat_map(hashbrown::HashTable::iter_mut)
    }

    fn shrink_to_fit(&mut self) {
        for t in &mut self.shards {
            t.shrink_to_fit(|e| root_hash(&e.key));
        }
    }

    /// Buckets in all.
    #[cfg(test)]
    fn buckets(&self) -> usize {
        self.shards.iter().map(|t| buckets_for(t.capacity())).sum()
    }
}

/// The bit of `RootEdge::child` that marks the edge.
const MARKED: u32 = 1 << 31;

/// The node a root edge's `child` (mark and all) leads to.
fn unmarked(child: u32) -> usize {
    (child & !MARKED) as usize
}

/// A top-level member's place in the index (see [`Trie::member`]).
#[derive(Clone, Copy, Debug)]
pub struct Member {
    child: u32,
    leaf: u32,
}

impl Member {
    /// Whether the member is marked ([`Trie::mark_member`]).
    pub fn marked(&self) -> bool {
        self.child & MARKED != 0
    }

    /// The only entry of a member that is a plain leaf (one reader, nothing below).
    pub fn leaf(&self) -> Option<u32> {
        (self.leaf != NONE).then_some(self.leaf)
    }
}

/// One segment of an indexed pattern.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TSeg {
    Field(Key),
    Index(usize),
    /// `[*]`: in a reader path it binds the node's wildcard of the same ordinal.
    Wild,
}

impl TSeg {
    pub fn as_ref(&self) -> TSegRef<'_> {
        match self {
            TSeg::Field(k) => TSegRef::Field(k),
            TSeg::Index(i) => TSegRef::Index(*i),
            TSeg::Wild => TSegRef::Wild,
        }
    }
}

/// A [`TSeg`] borrowed: what [`Trie::insert_refs`] indexes a pattern by (its names are cloned
/// only for the edges it adds).
#[derive(Clone, Copy, Debug)]
pub enum TSegRef<'a> {
    Field(&'a Key),
    Index(usize),
    Wild,
}

impl TSegRef<'_> {
    pub fn owned(self) -> TSeg {
        match self {
            TSegRef::Field(k) => TSeg::Field(k.clone()),
            TSegRef::Index(i) => TSeg::Index(i),
            TSegRef::Wild => TSeg::Wild,
        }
    }
}

const NONE: u32 = u32::MAX;

/// A trie node: its first entries. Child lookup goes through the trie-wide maps, and a node's
/// later entries and its child list (for subtree walks) sit in a side table that most nodes
/// never use (a leaf holds one entry), so a node costs 16 bytes.
#[derive(Debug)]
struct TNode {
    first: u32,
    wild: u32,
    /// Its [`More`] in `Trie::more`, or `NONE`.
    more: u32,
    /// Reached through an index segment (rather than a field).
    index_child: bool,
    /// Has children reached through index segments (rare: concrete indices in patterns).
    has_index_children: bool,
}

impl Default for TNode {
    fn default() -> Self {
        TNode {
            first: NONE,
            wild: NONE,
            more: NONE,
            index_child: false,
            has_index_children: false,
        }
    }
}

/// A node's second and later entries, and its field and index children.
#[derive(Debug, Default)]
struct More {
    rest: Vec<u32>,
    children: Vec<u32>,
}

/// A trie whose entries are node ids.
#[derive(Debug)]
pub struct Trie {
    nodes: Vec<TNode>,
    more: Vec<More>,
    fields: hashbrown::HashTable<FieldEdge>,
    roots: RootTable,
    /// Index edges: (parent, concrete index in a pattern) → child.
    indices: HashMap<(u32, usize), u32, Keyed>,
    /// Trie nodes from this number on are folded leaves ([`Trie::fold_leaves`]): node
    /// `folded + e` is a plain leaf whose only entry is `e`, kept in no `TNode`. `NONE`
    /// until folded.
    folded: u32,
}

impl Default for Trie {
    fn default() -> Self {
        Trie {
            nodes: vec![TNode::default()],
            more: Vec::new(),
            fields: hashbrown::HashTable::new(),
            roots: RootTable::default(),
            indices: HashMap::default(),
            folded: NONE,
        }
    }
}

/// A node reached by a write, with the array indices bound to its first wildcards (fewer than
/// its wildcard count means "every instance below this prefix").
pub type Hit = (u32, Vec<usize>);

impl Trie {
    /// The entry of `t` when it is a folded leaf ([`Trie::fold_leaves`]).
    #[inline]
    fn folded_entry(&self, t: usize) -> Option<u32> {
        (t >= self.folded as usize).then(|| (t - self.folded as usize) as u32)
    }

    fn more(&self, t: usize) -> Option<&More> {
        self.more.get(self.nodes.get(t)?.more as usize)
    }

    fn more_mut(&mut self, t: usize) -> &mut More {
        if self.nodes[t].more == NONE {
            self.nodes[t].more = self.more.len() as u32;
            self.more.push(More::default());
        }
        let i = self.nodes[t].more as usize;
        &mut self.more[i]
    }

    fn entries(&self, t: usize) -> impl Iterator<Item = u32> + '_ {
        let first = match self.folded_entry(t) {
            Some(e) => e,
            None => self.nodes[t].first,
        };
        (first != NONE)
            .then_some(first)
            .into_iter()
            .chain(self.more(t).map_or(&[][..], |m| &m.rest).iter().copied())
    }

    fn children(&self, t: usize) -> &[u32] {
        self.more(t).map_or(&[], |m| &m.children)
    }

    fn add(&mut self, t: usize, e: u32) {
        let first = self.nodes[t].first;
        if first == NONE {
            self.nodes[t].first = e;
        } else if first != e && !self.more(t).is_some_and(|m| m.rest.contains(&e)) {
            self.more_mut(t).rest.push(e);
        }
    }

    fn root(&self, k: &str) -> Option<&RootEdge> {
        self.roots.find(root_hash(k), k)
    }

    fn field(&self, t: usize, k: &Key) -> Option<usize> {
        if t == 0 {
            return self.root(k).map(|e| unmarked(e.child));
        }
        if t >= self.nodes.len() {
            return None;
        }
        let t = t as u32;
        self.fields
            .find(edge_hash(t, k), |e| {
                e.parent == t && valem_core::value::key_eq(&e.key, k)
            })
            .map(|e| e.child as usize)
    }

    fn index(&self, t: usize, i: usize) -> Option<usize> {
        if t >= self.nodes.len() {
            return None;
        }
        self.indices.get(&(t as u32, i)).map(|&c| c as usize)
    }

    fn wild(&self, t: usize) -> Option<usize> {
        let w = self.nodes.get(t)?.wild;
        (w != NONE).then_some(w as usize)
    }

    /// Whether `t` was reached through an index segment.
    fn is_index_child(&self, t: usize) -> bool {
        self.nodes.get(t).is_some_and(|n| n.index_child)
    }

    /// Room for `n` more top-level members: a large flat model's index is then built without
    /// growing its table step by step (each step hashes every member's name again, reading
    /// its text).
    pub fn reserve_members(&mut self, n: usize) {
        self.roots.reserve(n);
        if n > 0 {
            self.nodes.reserve(n);
            self.more_mut(0).children.reserve(n);
        }
    }

    pub fn insert(&mut self, path: &[TSeg], entry: u32) {
        self.insert_refs(path.iter().map(TSeg::as_ref), entry);
    }

    /// Index `entry` at `path`; returns the trie node it is at (see [`Trie::sole_entry`]).
    pub fn insert_refs<'a>(&mut self, path: impl Iterator<Item = TSegRef<'a>>, entry: u32) -> u32 {
        debug_assert!(self.folded == NONE, "nothing is inserted in a folded trie");
        let mut t = 0usize;
        for seg in path {
            if let (TSegRef::Field(k), 0) = (seg, t) {
                let n = self.nodes.len() as u32;
                let (child, made) = self.roots.find_or_insert(root_hash(k), k, || RootEdge {
                    key: k.clone(),
                    child: n,
                    leaf: NONE,
                });
                if made {
                    self.nodes.push(TNode::default());
                    self.more_mut(0).children.push(n);
                }
                t = unmarked(child);
                continue;
            }
            let next = match seg {
                TSegRef::Field(k) => self.field(t, k),
                TSegRef::Index(i) => self.index(t, i),
                TSegRef::Wild => self.wild(t),
            };
            t = match next {
                Some(n) => n,
                None => {
                    let n = self.nodes.len() as u32;
                    self.nodes.push(TNode::default());
                    match seg {
                        TSegRef::Field(k) => {
                            let edge = FieldEdge {
                                key: k.clone(),
                                parent: t as u32,
                                child: n,
                            };
                            self.fields
                                .insert_unique(edge_hash(t as u32, k), edge, |e| {
                                    edge_hash(e.parent, &e.key)
                                });
                            self.more_mut(t).children.push(n);
                        }
                        TSegRef::Index(i) => {
                            self.indices.insert((t as u32, i), n);
                            self.more_mut(t).children.push(n);
                            self.nodes[n as usize].index_child = true;
                            self.nodes[t].has_index_children = true;
                        }
                        TSegRef::Wild => self.nodes[t].wild = n,
                    }
                    n as usize
                }
            };
        }
        self.add(t, entry);
        t as u32
    }

    /// The only entry at or below trie node `t` (as [`Trie::insert_refs`] returned it), if it
    /// has exactly one: what `at` and `below` of its path would find, without walking to it.
    pub fn sole_entry(&self, t: u32) -> Option<u32> {
        if let Some(e) = self.folded_entry(t as usize) {
            return Some(e);
        }
        let n = self.nodes.get(t as usize)?;
        let alone = n.first != NONE
            && n.wild == NONE
            && self
                .more(t as usize)
                .is_none_or(|m| m.rest.is_empty() && m.children.is_empty());
        alone.then_some(n.first)
    }

    /// Release spare capacity once the trie is complete (nothing is inserted after), and note
    /// the plain leaves below root edges in the edges.
    pub fn shrink(&mut self) {
        if self.folded != NONE {
            return; // shrunk before it was folded
        }
        for e in self.roots.iter_mut() {
            let n = &self.nodes[unmarked(e.child)];
            e.leaf = if n.wild == NONE && n.more == NONE {
                n.first
            } else {
                NONE
            };
        }
        self.roots.shrink_to_fit();
        self.nodes.shrink_to_fit();
        self.more.shrink_to_fit();
        for m in &mut self.more {
            m.children.shrink_to_fit();
            m.rest.shrink_to_fit();
        }
        self.fields.shrink_to_fit(|e| edge_hash(e.parent, &e.key));
        self.indices.shrink_to_fit();
    }

    /// Fold away the trie nodes of the top-level members that are plain leaves (one entry,
    /// nothing below: [`Trie::shrink`] has put that entry in their edges already). A large
    /// flat model's index is almost all such members, and their nodes were 16 bytes each
    /// (fan-out 1M: 2M of them) that no lookup needs. A folded leaf keeps a number, past the
    /// nodes that are left, from which its entry follows; every walk takes such a number for a
    /// node with that one entry and nothing below. Call it once, after `shrink`, on a trie
    /// nothing is inserted in afterwards and whose node numbers nobody kept (the reader
    /// index; not the producer index, whose numbers `sole_entry` is asked about).
    pub fn fold_leaves(&mut self) {
        if self.folded != NONE {
            return;
        }
        let n = self.nodes.len();
        let mut gone = vec![false; n];
        let mut count = 0usize;
        let mut top = 0u32;
        for e in self.roots.iter() {
            let c = unmarked(e.child);
            if e.leaf != NONE && c != 0 && !gone[c] {
                gone[c] = true;
                count += 1;
                top = top.max(e.leaf);
            }
        }
        let kept = n - count;
        // Folded numbers stay below the edges' mark bit (node ids are far fewer).
        if count == 0 || kept as u64 + top as u64 >= MARKED as u64 {
            return;
        }
        let mut next = 0u32;
        let remap: Vec<u32> = (0..n)
            .map(|i| {
                if gone[i] {
                    kept as u32 + self.nodes[i].first
                } else {
                    next += 1;
                    next - 1
                }
            })
            .collect();
        let mut i = 0;
        self.nodes.retain(|_| {
            i += 1;
            !gone[i - 1]
        });
        self.nodes.shrink_to_fit();
        let map = |c: u32| if c == NONE { NONE } else { remap[c as usize] };
        for node in &mut self.nodes {
            node.wild = map(node.wild);
        }
        for m in &mut self.more {
            for c in &mut m.children {
                *c = map(*c);
            }
        }
        for e in self.roots.iter_mut() {
            e.child = (e.child & MARKED) | map(unmarked(e.child) as u32);
        }
        let fields = std::mem::take(&mut self.fields);
        self.fields
            .reserve(fields.len(), |e| edge_hash(e.parent, &e.key));
        for mut e in fields {
            e.parent = map(e.parent);
            e.child = map(e.child);
            self.fields
                .insert_unique(edge_hash(e.parent, &e.key), e, |e| {
                    edge_hash(e.parent, &e.key)
                });
        }
        let indices = std::mem::take(&mut self.indices);
        self.indices = indices
            .into_iter()
            .map(|((p, i), c)| ((map(p), i), map(c)))
            .collect();
        self.folded = kept as u32;
    }

    /// The key and trie node of top-level member `k`, when an entry is at or below it: the
    /// key is the one the index shares (a write can store it without interning `k`).
    pub fn member(&self, k: &str) -> Option<(&Key, Member)> {
        self.root(k).map(|e| (&e.key, e.member()))
    }

    /// Mark every top-level member (what a [`Member`] then tells).
    pub fn mark_all_members(&mut self) {
        for e in self.roots.iter_mut() {
            e.child |= MARKED;
        }
    }

    /// Mark top-level member `k`, when it is one, and give what [`Trie::member`] gives for it
    /// (marked).
    pub fn mark_member_found(&mut self, k: &str) -> Option<Member> {
        let e = self.roots.find_mut(root_hash(k), k)?;
        e.child |= MARKED;
        Some(e.member())
    }

    /// Mark top-level member `k`, when it is one.
    pub fn mark_member(&mut self, k: &str) {
        self.mark_member_found(k);
    }

    /// The names of the top-level members (in no particular order).
    pub fn members(&self) -> impl Iterator<Item = &Key> + '_ {
        self.roots.iter().map(|e| &e.key)
    }

    /// Whether an entry is at the root (a pattern of the whole document).
    pub fn has_root_entries(&self) -> bool {
        self.entries(0).next().is_some()
    }

    /// [`Trie::hits`] for a write of a top-level member, given what [`Trie::member`] found
    /// for it (`None`: nothing at or below it, only readers of the whole document).
    pub fn member_hits(&self, member: Option<Member>, out: &mut Vec<Hit>) {
        self.visit_member_hits(member, &mut |e, b| out.push((e, b.to_vec())));
    }

    /// [`Trie::member_hits`], each given to `visit` as it is found (entry, binding).
    pub fn visit_member_hits<F: FnMut(u32, &[usize]) + ?Sized>(
        &self,
        member: Option<Member>,
        visit: &mut F,
    ) {
        for e in self.entries(0) {
            visit(e, &[]);
        }
        match member {
            Some(Member { leaf, .. }) if leaf != NONE => visit(leaf, &[]),
            Some(Member { child, .. }) => {
                self.walk(unmarked(child), &[], &mut Vec::new(), false, visit)
            }
            None => {}
        }
    }

    /// Readers affected by a write at the concrete path `w`: those reading `w`, an ancestor of
    /// it, or something below it.
    pub fn hits(&self, w: &[Seg], out: &mut Vec<Hit>) {
        self.visit_hits(w, &mut |e, b| out.push((e, b.to_vec())));
    }

    /// [`Trie::hits`], each given to `visit` as it is found (entry, binding), in the same
    /// order: a write of the root reaches every reader, and a list of them all is as large as
    /// the index (fan-out 1M: 2M hits, 64 MB).
    pub fn visit_hits<F: FnMut(u32, &[usize]) + ?Sized>(&self, w: &[Seg], visit: &mut F) {
        let mut bind = Vec::new();
        self.walk(0, w, &mut bind, false, visit);
    }

    fn walk<F: FnMut(u32, &[usize]) + ?Sized>(
        &self,
        t: usize,
        w: &[Seg],
        bind: &mut Vec<usize>,
        skipped: bool,
        out: &mut F,
    ) {
        if !skipped {
            for e in self.entries(t) {
                out(e, bind);
            }
        }
        match w.split_first() {
            None => self.subtree(t, bind, skipped, out),
            Some((Seg::Field(k), rest)) => {
                if let Some(c) = self.field(t, k) {
                    self.walk(c, rest, bind, false, out);
                }
            }
            Some((Seg::Index(i), rest)) => {
                if let Some(c) = self.wild(t) {
                    bind.push(*i);
                    self.walk(c, rest, bind, false, out);
                    bind.pop();
                }
                if let Some(c) = self.index(t, *i) {
                    self.walk(c, rest, bind, false, out);
                }
                // Implicit mapping: field reads below this node see through the index.
                self.walk(t, rest, bind, true, out);
            }
        }
    }

    /// Everything indexed strictly below `t`. After an implicitly skipped index, array children
    /// were already visited with their binding and are left out.
    fn subtree<F: FnMut(u32, &[usize]) + ?Sized>(
        &self,
        t: usize,
        bind: &[usize],
        skip_arrays: bool,
        out: &mut F,
    ) {
        let Some(node) = self.nodes.get(t) else {
            return; // a folded leaf: nothing below it
        };
        for &c in self.children(t) {
            if skip_arrays && node.has_index_children && self.is_index_child(c as usize) {
                continue;
            }
            self.all(c as usize, bind, out);
        }
        if !skip_arrays {
            if let Some(c) = self.wild(t) {
                self.all(c, bind, out);
            }
        }
    }

    fn all<F: FnMut(u32, &[usize]) + ?Sized>(&self, t: usize, bind: &[usize], out: &mut F) {
        for e in self.entries(t) {
            out(e, bind);
        }
        self.subtree(t, bind, false, out);
    }

    /// Entries whose pattern overlaps the pattern `r` (compile-time edges): at or above `r`,
    /// or below it; a field segment of `r` also passes through array levels of the index.
    pub fn overlapping(&self, r: &[TSeg], out: &mut Vec<u32>) {
        self.overlap(0, r, out, 0);
    }

    fn index_children(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        let scan: &[u32] = if self.nodes.get(t).is_some_and(|n| n.has_index_children) {
            self.children(t)
        } else {
            &[]
        };
        scan.iter()
            .map(|&c| c as usize)
            .filter(|&c| self.is_index_child(c))
    }

    fn overlap(&self, t: usize, r: &[TSeg], out: &mut Vec<u32>, depth: usize) {
        if depth > 512 {
            return;
        }
        out.extend(self.entries(t));
        match r.split_first() {
            None => {
                self.subtree(t, &[], false, &mut |e, _| out.push(e));
            }
            Some((TSeg::Field(k), rest)) => {
                if let Some(c) = self.field(t, k) {
                    self.overlap(c, rest, out, depth + 1);
                }
                if let Some(c) = self.wild(t) {
                    self.overlap(c, r, out, depth + 1);
                }
                for c in self.index_children(t) {
                    self.overlap(c, r, out, depth + 1);
                }
            }
            Some((TSeg::Wild, rest)) => {
                if let Some(c) = self.wild(t) {
                    self.overlap(c, rest, out, depth + 1);
                }
                for c in self.index_children(t) {
                    self.overlap(c, rest, out, depth + 1);
                }
            }
            Some((TSeg::Index(i), rest)) => {
                if let Some(c) = self.wild(t) {
                    self.overlap(c, rest, out, depth + 1);
                }
                if let Some(c) = self.index(t, *i) {
                    self.overlap(c, rest, out, depth + 1);
                }
            }
        }
    }

    /// The first entry whose pattern is at or above the concrete path `w` (is `w` inside a
    /// value an entry owns?).
    pub fn above(&self, w: &[Seg]) -> Option<u32> {
        self.above_walk(0, w)
    }

    fn above_walk(&self, t: usize, w: &[Seg]) -> Option<u32> {
        if let Some(e) = self.entries(t).next() {
            return Some(e);
        }
        match w.split_first()? {
            (Seg::Field(k), rest) => self.above_walk(self.field(t, k)?, rest),
            (Seg::Index(i), rest) => self
                .wild(t)
                .and_then(|c| self.above_walk(c, rest))
                .or_else(|| self.above_walk(self.index(t, *i)?, rest)),
        }
    }

    /// The entries indexed exactly at the concrete path `w` (through field and index
    /// segments, not wildcards).
    pub fn at(&self, w: &[Seg]) -> Option<impl Iterator<Item = u32> + '_> {
        let mut t = 0usize;
        for seg in w {
            t = match seg {
                Seg::Field(k) => self.field(t, k)?,
                Seg::Index(i) => self.index(t, *i)?,
            };
        }
        Some(self.entries(t))
    }

    /// Entries strictly below the concrete path `w`, with the indices `w` binds.
    pub fn below(&self, w: &[Seg], out: &mut Vec<Hit>) {
        let mut bind = Vec::new();
        self.below_walk(0, w, &mut bind, out);
    }

    fn below_walk(&self, t: usize, w: &[Seg], bind: &mut Vec<usize>, out: &mut Vec<Hit>) {
        match w.split_first() {
            None => self.subtree(t, bind, false, &mut |e, b| out.push((e, b.to_vec()))),
            Some((Seg::Field(k), rest)) => {
                if let Some(c) = self.field(t, k) {
                    self.below_walk(c, rest, bind, out);
                }
            }
            Some((Seg::Index(i), rest)) => {
                if let Some(c) = self.wild(t) {
                    bind.push(*i);
                    self.below_walk(c, rest, bind, out);
                    bind.pop();
                }
                if let Some(c) = self.index(t, *i) {
                    self.below_walk(c, rest, bind, out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(k: &str) -> TSeg {
        TSeg::Field(Key::from(k))
    }
    fn sf(k: &str) -> Seg {
        Seg::Field(Key::from(k))
    }

    #[test]
    fn implicit_mapping_and_bindings() {
        let mut t = Trie::default();
        t.insert(&[f("items"), f("total")], 1); // $sum(items.total)
        t.insert(&[f("items"), TSeg::Wild, f("price")], 2); // $parent.price
        t.insert(&[f("other")], 3);
        let mut out = Vec::new();
        t.hits(&[sf("items"), Seg::Index(3), sf("price")], &mut out);
        assert_eq!(out, vec![(2, vec![3])]);
        out.clear();
        t.hits(&[sf("items"), Seg::Index(3), sf("total")], &mut out);
        assert_eq!(out, vec![(1, vec![])]);
        out.clear();
        t.hits(&[sf("items"), Seg::Index(3)], &mut out);
        out.sort();
        assert_eq!(out, vec![(1, vec![]), (2, vec![3])]);
        out.clear();
        t.hits(&[sf("items")], &mut out);
        out.sort();
        assert_eq!(out, vec![(1, vec![]), (2, vec![])]);
    }

    /// A write of a top-level member finds the same readers through its root edge (a plain
    /// leaf's entry kept in the edge, or the node below) as through the walk.
    #[test]
    fn member_hits_are_the_walk_hits() {
        let mut t = Trie::default();
        t.insert(&[f("a")], 1); // a plain leaf
        t.insert(&[f("b")], 2); // two entries
        t.insert(&[f("b")], 3);
        t.insert(&[f("c"), f("x")], 4); // below
        t.insert(&[f("d")], 5); // at and below
        t.insert(&[f("d"), TSeg::Wild, f("y")], 6);
        t.insert(&[], 7); // the whole document
        for shrunk in [false, true] {
            if shrunk {
                t.shrink();
            }
            for k in ["a", "b", "c", "d", "e"] {
                let mut walk = Vec::new();
                t.hits(&[sf(k)], &mut walk);
                let mut member = Vec::new();
                t.member_hits(t.member(k).map(|(_, m)| m), &mut member);
                walk.sort();
                member.sort();
                assert_eq!(member, walk, "{k}");
                assert!(walk.contains(&(7, vec![])), "{k}");
            }
        }
        assert_eq!(t.member("a").map(|(k, _)| &**k), Some("a"));
        assert!(t.member("e").is_none());
    }

    /// A folded trie answers every lookup as before: the members that were plain leaves (and
    /// only those) lose their nodes, and the numbers of the nodes that are left move.
    #[test]
    fn folded_leaves_answer_as_their_nodes_did() {
        let mut t = Trie::default();
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            t.insert(&[f(k)], 10 + i as u32); // plain leaves
        }
        t.insert(&[f("two")], 1); // two entries
        t.insert(&[f("two")], 2);
        t.insert(&[f("deep"), f("x")], 3); // below, with a plain leaf of its own
        t.insert(&[f("both")], 4); // at and below
        t.insert(&[f("both"), TSeg::Wild, f("y")], 5);
        t.insert(&[f("list"), TSeg::Index(2), f("z")], 6); // an index child
        t.insert(&[TSeg::Index(1)], 7); // an index below the root
        t.insert(&[f("z")], 8); // a plain leaf after the others
        t.shrink();
        let writes: Vec<Vec<Seg>> = vec![
            vec![],
            vec![sf("a")],
            vec![sf("a"), sf("q")],
            vec![sf("a"), Seg::Index(0)],
            vec![sf("c")],
            vec![sf("two")],
            vec![sf("deep")],
            vec![sf("deep"), sf("x")],
            vec![sf("both")],
            vec![sf("both"), Seg::Index(4), sf("y")],
            vec![sf("list"), Seg::Index(2)],
            vec![sf("list"), Seg::Index(2), sf("z")],
            vec![Seg::Index(1)],
            vec![sf("z")],
            vec![sf("none")],
        ];
        let reads: Vec<Vec<TSeg>> = vec![
            vec![],
            vec![f("a")],
            vec![f("b"), f("q")],
            vec![f("deep")],
            vec![f("both"), TSeg::Wild],
            vec![f("list"), f("z")],
            vec![f("none")],
        ];
        let answers = |t: &Trie| {
            let mut out = Vec::new();
            for w in &writes {
                let (mut hits, mut below, mut member) = (Vec::new(), Vec::new(), Vec::new());
                t.hits(w, &mut hits);
                t.below(w, &mut below);
                if let [Seg::Field(k)] = &w[..] {
                    t.member_hits(t.member(k).map(|(_, m)| m), &mut member);
                    member.sort();
                }
                let at: Option<Vec<u32>> = t.at(w).map(Iterator::collect);
                out.push(format!(
                    "{hits:?} {below:?} {member:?} {at:?} {:?}",
                    t.above(w)
                ));
            }
            for r in &reads {
                let mut o = Vec::new();
                t.overlapping(r, &mut o);
                out.push(format!("{o:?}"));
            }
            out
        };
        let before = answers(&t);
        let nodes = t.nodes.len();
        t.fold_leaves();
        // a, b, c and z are folded; two (two entries), both, deep and list are not, nor x.
        assert_eq!(t.nodes.len(), nodes - 4);
        assert_eq!(t.member("a").and_then(|(_, m)| m.leaf()), Some(10));
        assert_eq!(answers(&t), before);
        // Folding again, or shrinking after, changes nothing.
        t.fold_leaves();
        t.shrink();
        assert_eq!(answers(&t), before);
        assert_eq!(t.nodes.len(), nodes - 4);
    }

    /// Room reserved for many members splits the root table: every member, marked or not,
    /// is found in its part, none twice, and the parts take fewer buckets than one table.
    #[test]
    fn a_split_root_table_finds_every_member() {
        let n = 60_000;
        let mut t = Trie::default();
        t.reserve_members(n);
        assert!(t.roots.shards.len() > 1, "split");
        for i in 0..n {
            t.insert(&[f(&format!("m{i}"))], i as u32);
        }
        t.shrink();
        t.fold_leaves();
        // One table of 60k members: 131,072 buckets (60k × 8/7 is past 65,536).
        assert!(t.roots.buckets() < 131_072, "{} buckets", t.roots.buckets());
        assert_eq!(t.roots.len(), n);
        let mut names: Vec<&str> = t.members().map(|k| &**k).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        t.mark_member("m7");
        for i in 0..n {
            let (_, m) = t.member(&format!("m{i}")).unwrap();
            assert_eq!(m.leaf(), Some(i as u32));
            assert_eq!(m.marked(), i == 7, "m{i}");
            let mut hits = Vec::new();
            t.hits(&[sf(&format!("m{i}"))], &mut hits);
            assert_eq!(hits.iter().map(|h| h.0).collect::<Vec<_>>(), vec![i as u32]);
        }
        assert!(t.member("m60000").is_none() && t.member("").is_none());
        t.mark_all_members();
        assert!(t
            .members()
            .all(|k| t.member(k).is_some_and(|(_, m)| m.marked())));
    }

    #[test]
    fn overlap_passes_through_arrays() {
        let mut p = Trie::default();
        p.insert(&[f("items"), TSeg::Wild, f("total")], 7);
        p.insert(&[f("sum")], 8);
        let mut out = Vec::new();
        p.overlapping(&[f("items"), f("total")], &mut out);
        assert_eq!(out, vec![7]);
        out.clear();
        p.overlapping(&[f("items")], &mut out);
        assert_eq!(out, vec![7]);
        out.clear();
        p.overlapping(&[f("sum"), f("x")], &mut out);
        assert_eq!(out, vec![8]);
    }
}
