//! Propagation: a written path dirties the nodes that read it, an ancestor or a descendant
//! (through the reader index), with the `[*]` indices the match binds.

use super::*;

impl<'a> Cycle<'a> {
    pub(super) fn mark(&mut self, id: NodeId, binding: Vec<usize>) {
        if self.evaluating == Some(id) {
            // A derivation's own write never re-dirties it (see the compile-time rule).
            return;
        }
        let node = &self.cm.nodes[id as usize];
        if self.cm.has_delta_aggregates
            && self.agg_noted.take() != Some(id)
            && self.cm.delta_aggregate(node).is_some()
        {
            // Reached by something other than a noted leaf write: rescan.
            self.agg_delta.insert(id, None);
        }
        // An empty binding, or a node without `[*]`, means every instance.
        let every = binding.is_empty() || node.wildcards() == 0;
        match node.kind {
            NodeKind::Derivation { .. } => {
                if !self.sc.has(id, QUEUED) {
                    self.sc.set(id, QUEUED);
                    self.pending.push(Reverse((node.level, id)));
                }
                self.sc.add(id, binding, every);
            }
            NodeKind::Meta(_) => {
                self.meta_dirty.insert(id);
                self.sc.add(id, binding, every);
            }
            NodeKind::Constraint { .. } => {
                // A constraint's bindings come from its scope paths, not from `targets[0]`.
                let every = binding.is_empty();
                self.constraint_dirty.insert(id);
                self.sc.add(id, binding, every);
            }
            NodeKind::Effect { .. } => {
                self.effect_dirty.insert(id);
            }
        }
    }

    pub(super) fn mark_all(&mut self, id: NodeId) {
        self.mark(id, Vec::new());
    }

    /// Dirty every reader of a written path (and whole-document readers).
    pub(super) fn propagate(&mut self, w: &[Seg]) {
        let readers = &self.cm.readers;
        self.propagate_hits(w, |visit| readers.visit_hits(w, visit));
    }

    /// `propagate` for a write of the top-level member `w`, given its node in the reader index.
    pub(super) fn propagate_member(&mut self, w: &[Seg], member: Option<crate::trie::Member>) {
        let readers = &self.cm.readers;
        self.propagate_hits(w, |visit| readers.visit_member_hits(member, visit));
    }

    /// Mark the readers `find` gives (in the order it finds them) for the write at `w`.
    pub(super) fn propagate_hits(
        &mut self,
        w: &[Seg],
        find: impl FnOnce(&mut dyn FnMut(u32, &[usize])),
    ) {
        find(&mut |id, b| {
            if self.cm.has_delta_aggregates {
                self.note_aggregate(id, w);
            }
            self.mark(id, b.to_vec());
        });
        self.mark_whole_doc();
    }

    /// `propagate` for a write of a concrete derivation's own target, from its readers listed
    /// at compile time.
    pub(super) fn propagate_target(&mut self, node: &Node, target: &[Seg]) {
        let cm = self.cm;
        let Some(readers) = cm.target_readers(node.id) else {
            return self.propagate(target);
        };
        for &id in readers {
            if cm.has_delta_aggregates {
                self.note_aggregate(id, target);
            }
            self.mark(id, Vec::new());
        }
        self.mark_whole_doc();
    }

    /// A write at `w` reaches node `id`: when `id` is a delta aggregate and `w` is one of its
    /// leaves (`array[k].field`) with number-or-absent old and new values, note the change;
    /// anything else makes it rescan.
    pub(super) fn note_aggregate(&mut self, id: NodeId, w: &[Seg]) {
        let cm = self.cm;
        let Some(agg) = cm.delta_aggregate(&cm.nodes[id as usize]) else {
            return;
        };
        let leaf = match w {
            [Seg::Field(a), Seg::Index(k), Seg::Field(f)]
                if **a == *agg.path[0] && **f == *agg.path[1] =>
            {
                Some(*k)
            }
            _ => None,
        };
        let num = |v: Option<&Val>| match v {
            None => Some(None),
            Some(Val::Num(x)) => Some(Some(*x)),
            Some(_) => None,
        };
        let change = match (&self.agg_change, leaf) {
            (Some((old, new)), Some(k)) => num(old.as_ref())
                .zip(num(Some(new)))
                .map(|(o, n)| (k, o, n)),
            _ => None,
        };
        let e = self.agg_delta.entry(id).or_insert_with(|| Some(Vec::new()));
        match (e.as_mut(), change) {
            // Past a few dozen changes a rescan is as cheap and bounds the log.
            (Some(log), Some(c)) if log.len() < 64 => log.push(c),
            _ => *e = None,
        }
        self.agg_noted = Some(id);
    }

    pub(super) fn mark_whole_doc(&mut self) {
        if !self.whole_doc_marked && !self.cm.whole_doc_nodes.is_empty() {
            self.whole_doc_marked = true;
            for i in 0..self.cm.whole_doc_nodes.len() {
                let id = self.cm.whole_doc_nodes[i];
                self.mark_all(id);
            }
        }
    }

    /// A base write replaces everything below `w`, and may create containers: every per-address
    /// value below it (derived values wiped from the merged document, meta of new elements)
    /// must be recomputed. Scoped constraints are not marked here: a constraint runs when
    /// something it reads is written (`propagate` reaches one scoped at or below a replaced
    /// value), not because a write created the container of a field still absent — the
    /// reference's rule, so `{"$.q.other": 1}` does not check a constraint on `$.q.c`.
    pub(super) fn shadow(&mut self, w: &[Seg]) {
        let mut below = Vec::new();
        self.cm.produced_below(w, &mut below);
        self.cm.instances.below(w, &mut below);
        for (id, b) in below {
            if !matches!(self.cm.nodes[id as usize].kind, NodeKind::Constraint { .. }) {
                self.mark(id, b);
            }
        }
    }
}
