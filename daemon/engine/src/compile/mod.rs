//! The ModelSpec compiler: expressions compiled once (identical text interned), dependencies
//! extracted into the reader and producer tries, the derivation DAG levelled topologically (a
//! cycle is an error naming it), the library bound, projections and native aggregates planned.
//! Pure: no I/O, no clock.

mod model;
mod prepare;
mod reads;

pub use model::*;
use prepare::*;
use reads::*;
pub use reads::{bind_library, eval_library_layer};

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

use jsonata_core::ast::AstNode;
use serde_json::Value as Json;

use super::shapes::{skeleton, Shape, Shapes};
use super::trie::{TSeg, TSegRef, Trie};
use std::collections::HashSet;
use valem_core::expr::deps::{self, ReadPath, Reads, Root};
use valem_core::expr::path::{Address, PathSeg};
use valem_core::expr::{json_to_jvalue, Compiled, Env, ExprError, Limits, Parsed, Value as JValue};
use valem_core::spec::{MetaProp, ModelSpec, Policy};
use valem_core::value::{Key, Seg, MAX_DEPTH};
use valem_jit::ir::{self, Program};

/// Compile a spec. All findings are collected, not just the first.
pub fn compile(
    spec: Arc<ModelSpec>,
    engine: &crate::EngineLimits,
) -> Result<CompiledModel, Vec<CompileError>> {
    let limits = &engine.expr;
    // The names interned from here on are held by the compiled model.
    let _names = valem_core::value::holding_names();
    let mut errors = Vec::new();
    let mut interner = Interner {
        exprs: HashMap::new(),
        limits: limits.clone(),
    };
    let mut drafts = Drafts::with_capacity(
        spec.derivations.len()
            + spec.meta_derivations.len()
            + spec.constraints.len()
            + spec.effects.len(),
        &spec,
    );

    // Constants and library first: every expression may bind them.
    let constants = json_to_jvalue(&Json::Object(spec.constants.clone()));
    let mut env = Env::default();
    env.vars.push((Rc::from("const"), constants));
    let exports = match bind_library(&spec, &mut env, limits) {
        Ok(x) => x,
        Err(mut e) => {
            errors.append(&mut e);
            Vec::new()
        }
    };

    let bound: HashSet<String> = env.vars.iter().map(|(n, _)| n.to_string()).collect();
    // With the JIT tier off, arithmetic derivations keep their interpreted form too.
    let keep_parsed = !engine.jit.enabled;
    draft_derivations(
        &spec,
        limits,
        (&bound, keep_parsed),
        &mut interner,
        &mut drafts,
        &mut errors,
    );

    draft_meta(&spec, &mut interner, &mut drafts, &mut errors);
    draft_constraints(&spec, &mut interner, &mut drafts, &mut errors);
    let effect_plans = draft_effects(&spec, &mut interner, &mut drafts, &mut errors);
    let defaults = default_rules(&spec, &mut interner, &mut errors);

    if !errors.is_empty() {
        return Err(errors);
    }

    let mut nodes = std::mem::take(&mut drafts.nodes);
    let mut patterns = std::mem::take(&mut drafts.targets);
    let nodes_len = nodes.len();
    let (segs, read_ends, node_reads) = (
        &drafts.segs[..],
        &drafts.read_ends[..],
        &drafts.node_reads[..],
    );
    let reads = move |id| packed_reads(segs, read_ends, node_reads, id);
    // The derivations' concrete targets, taken out of the nodes while the graph is built (and
    // put back after): the readers of each are looked up beside the reader index.
    let taken: Vec<Concrete> = nodes
        .iter_mut()
        .map(|n| match n.kind {
            NodeKind::Derivation { .. } => std::mem::take(&mut n.concrete),
            _ => Concrete::None,
        })
        .collect();
    let concretes = &taken[..];
    // The reader index and the readers of each derivation's target are needed only at the
    // end: a large spec's are made on a thread of its own while the graph is (at most one
    // top-level member per read).
    let index_readers = move || {
        let mut readers = Trie::default();
        readers.reserve_members(read_ends.len());
        for id in 0..nodes_len {
            for r in reads(id) {
                readers.insert(r, id as u32);
            }
        }
        readers.shrink();
        readers.fold_leaves();
        let targets = target_readers(concretes, &mut readers);
        (readers, targets)
    };
    let mut model = std::thread::scope(|s| {
        let helper = (nodes_len >= PARALLEL_FROM).then(|| s.spawn(index_readers));
        let derivation_ids: Vec<NodeId> = (0..nodes_len as u32)
            .filter(|&i| matches!(nodes[i as usize].kind, NodeKind::Derivation { .. }))
            .collect();
        // A flat model (each derivation writes its own top-level member) needs no producer
        // index: its targets are found by name.
        let flat = flat_targets(concretes, &derivation_ids);
        let (producers, produced_at, instances) =
            index_targets(&nodes, &patterns, derivation_ids.len(), flat.is_none());
        let whole_doc_nodes: Vec<NodeId> = (0..nodes_len as u32)
            .filter(|&i| nodes[i as usize].whole_doc)
            .collect();
        let whole: Vec<bool> = nodes.iter().map(|n| n.whole_doc).collect();
        let firsts: Vec<Option<&Address>> = nodes
            .iter()
            .zip(&patterns)
            .map(|(n, p)| p.as_ref().or(n.targets.first()))
            .collect();
        let overlapping = |r: &[TSeg], out: &mut Vec<u32>| match &flat {
            Some(f) => f.overlapping(r, concretes, out),
            None => producers.overlapping(r, out),
        };
        let deps_of = edges(&whole, &firsts, &derivation_ids, &overlapping, reads);
        drop(firsts);
        let dependents = deps_of.reverse();

        let level =
            levels_of(&nodes, &deps_of, &dependents, &drafts.trace_table).map_err(|e| vec![e])?;

        debug_assert!(
            (0..nodes_len).all(|i| deps_of
                .of(i as NodeId)
                .iter()
                .all(|&d| level[d as usize] < level[i])),
            "every node is on a level below each of its dependents"
        );
        drop(deps_of);
        let (aggregates, mut trace_table) = (drafts.aggregates, drafts.trace_table);
        for (n, &l) in nodes.iter_mut().zip(&level) {
            n.level = l;
        }
        let by_level = level_order(&level, &derivation_ids);
        let by_kind = |f: fn(&NodeKind) -> bool| -> Vec<NodeId> {
            (0..nodes.len() as u32)
                .filter(|&i| f(&nodes[i as usize].kind))
                .collect()
        };
        let meta_nodes = by_kind(|k| matches!(k, NodeKind::Meta(_)));
        let constraint_nodes = by_kind(|k| matches!(k, NodeKind::Constraint { .. }));
        let effect_nodes = by_kind(|k| matches!(k, NodeKind::Effect { .. }));

        let alone = |id: NodeId| {
            flat.is_some() || producers.sole_entry(produced_at[id as usize]) == Some(id)
        };
        let cells = assign_cells(&mut nodes, &by_level, concretes, alone);
        for n in &mut nodes {
            // A derivation on level 0 depends on none: none of its slots reads another's
            // target, so none reads a cell (and its own target is no read: that would be a
            // cycle). Its lookups are not made (fan-out 1M: 2M probes of the layout, ~0.1 s).
            if n.level > 0 {
                n.jit.resolve_cells(&cells);
            } else {
                debug_assert!(!n.jit.reads_cells(&cells), "{:?} reads a cell", n.location);
            }
        }
        trace_table.shrink();
        let (mut readers, (target_readers, target_reader_ids)) = match helper {
            Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => index_readers(),
        };
        let merged_is_base = derivation_ids
            .iter()
            .all(|&i| nodes[i as usize].cell().is_some());
        // A flat model's derivations each have a cell: the cells say who writes what. Their
        // members were marked as written with their readers (`target_readers`).
        let cell_producers = flat.as_ref().map(|_| {
            let mut by_cell = vec![0; cells.len()];
            for &i in &derivation_ids {
                if let Some(c) = nodes[i as usize].cell() {
                    by_cell[c as usize] = i;
                }
            }
            by_cell.into_boxed_slice()
        });
        if flat.is_none() {
            mark_written(&mut readers, &producers);
        }
        Ok::<_, Vec<CompileError>>(CompiledModel {
            cell_producers,
            target_readers,
            target_reader_ids,
            trace_table: Arc::new(trace_table),
            cells: Arc::new(cells),
            merged_is_base,
            schema: spec.schema.clone(),
            spec,
            has_delta_aggregates: false,
            aggregates,
            nodes,
            by_level,
            dependents,
            readers,
            producers,
            instances,
            whole_doc_nodes,
            meta_nodes,
            constraint_nodes,
            effect_nodes,
            effect_plans,
            defaults,
            env,
            exports,
            limits: limits.clone(),
            validators: RefCell::new(HashMap::new()),
            scratch: RefCell::default(),
            fallback_forms: RefCell::default(),
            fallback_projections: RefCell::default(),
        })
    })?;
    // The concrete targets go back where they are kept; a `[*]` derivation keeps its
    // pattern.
    for ((n, c), p) in model.nodes.iter_mut().zip(taken).zip(&mut patterns) {
        if c.is_some() {
            n.concrete = c;
        } else if let Some(p) = p.take() {
            n.targets = Box::new([p]);
        }
    }
    drop(patterns);
    model.has_delta_aggregates = model
        .aggregates
        .iter()
        .any(|(&id, a)| model.nodes[id as usize].keeps_by_delta(a));
    Ok(model)
}

/// Draft the derivations (prepared in parallel parts by [`prepare_all`]): one node each, with
/// its target, reads, native aggregate and lowered program.
fn draft_derivations(
    spec: &ModelSpec,
    limits: &Limits,
    (bound, keep_parsed): (&HashSet<String>, bool),
    interner: &mut Interner,
    drafts: &mut Drafts,
    errors: &mut Vec<CompileError>,
) {
    let mut key_buf = String::new();
    let mut done = 0;
    prepare_all(spec, limits, bound, keep_parsed, |mut part| {
        if done == 0 {
            // Room for the names of all the shaped derivations, reckoned from the first part.
            let names: usize = part
                .iter()
                .flatten()
                .filter_map(|p| p.shaped.as_ref())
                .map(|s| s.1.len())
                .sum();
            let total = spec.derivations.len();
            valem_core::value::reserve_names(names.saturating_mul(total) / part.len().max(1));
        }
        let first = done;
        done += part.len();
        let before = first == 0 && part.len() < spec.derivations.len();
        // The names a shaped text's settling interns are cache misses in a large table: those
        // of the derivation `NAMES_AHEAD` places on start loading as each is drafted.
        // Each is drafted where it lies in the part, its fields taken out one by one: a
        // `Prepared` is hundreds of bytes, and moving each out whole (and again) was ~0.1 s of
        // the compiling thread's time at 1M derivations.
        for k in 0..part.len() {
            if let Some(Ok(Prepared {
                shaped: Some((_, names)),
                ..
            })) = part.get(k + NAMES_AHEAD)
            {
                names
                    .iter()
                    .for_each(|n| valem_core::value::prefetch_name(n));
            }
            let i = first + k;
            let Some(d) = spec.derivations.get(i) else {
                break;
            };
            let p = match &mut part[k] {
                Ok(p) => p,
                Err(e) => {
                    errors.push(e.clone());
                    continue;
                }
            };
            p.settle();
            let expr = match p.parsed.take() {
                Some(parsed) => ExprDraft::new(interner.share(&d.expr, parsed)),
                None => ExprDraft::text(d.expr.clone()),
            };
            let parent = p.target.parent();
            // The key is the canonical address: the spec's own text when written that way.
            key_buf.clear();
            p.target.render_into(&mut key_buf);
            let key = if *key_buf == *d.path {
                d.path.clone()
            } else {
                arcstr::ArcStr::from(key_buf.as_str())
            };
            let mut dr = draft_empty(
                drafts,
                NodeKind::Derivation { lazy: d.is_lazy() },
                key,
                [std::mem::replace(&mut p.target, Address::root())],
                expr,
                Input::Doc,
                Location::new(Section::Derivations, i),
                p.aggregate.take(),
            );
            // An arithmetic derivation's projection waits for a fallback that may never come.
            dr.node.projection_deferred = p.program.is_some() && !p.whole_doc;
            add_whole_doc(&mut dr, drafts, p.whole_doc, None);
            for_each_read(&p.program, &p.reads, |root, fields| {
                add_read(&mut dr, drafts, root, fields, Some(&parent), None);
            });
            end_reads(&mut dr);
            dr.extra.program = p.program.take();
            drafts.push(dr);
        }
        if before {
            // Room for the reads of all the derivations, reckoned from the first part.
            drafts.reserve_like(done, spec.derivations.len());
        }
    });
}

/// How far ahead of the derivation drafted the names of one to draft are prefetched.
const NAMES_AHEAD: usize = 8;

/// The producer index (each derivation's target, its pattern in `patterns`; left empty unless
/// `producing`) and the instance index (the targets of every other node), as path tries; and
/// per node, the producer index's node of its target (`u32::MAX` for nodes other than
/// derivations).
fn index_targets(
    nodes: &[Node],
    patterns: &[Option<Address>],
    derivations: usize,
    producing: bool,
) -> (Trie, Vec<u32>, Trie) {
    let mut producers = Trie::default();
    let mut instances = Trie::default();
    let mut at = vec![u32::MAX; if producing { nodes.len() } else { 0 }];
    // At most one top-level member per derivation.
    if producing {
        producers.reserve_members(derivations);
    }
    for (id, n) in nodes.iter().enumerate() {
        if matches!(n.kind, NodeKind::Derivation { .. }) {
            if let (true, Some(p)) = (producing, &patterns[id]) {
                at[id] = producers.insert_refs(tseg_refs(p), id as u32);
            }
        } else {
            for t in &n.targets {
                instances.insert_refs(tseg_refs(t), id as u32);
            }
        }
    }

    producers.shrink();
    instances.shrink();
    (producers, at, instances)
}

/// The targets of a flat model's derivations, each one top-level member written by no other
/// derivation: by name, each entry a derivation (what the producer index would hold, in 8
/// bytes a target rather than ~70).
struct FlatTargets(hashbrown::HashTable<NodeId>);

/// The member a derivation's concrete target is, when it is one top-level member.
fn flat_member(concretes: &[Concrete], id: NodeId) -> Option<&Key> {
    match concretes.get(id as usize)?.as_deref() {
        Some([Seg::Field(k)]) => Some(k),
        _ => None,
    }
}

/// [`FlatTargets`] of the derivations, when every one writes its own top-level member.
fn flat_targets(concretes: &[Concrete], derivation_ids: &[NodeId]) -> Option<FlatTargets> {
    let hash =
        |id: &NodeId| flat_member(concretes, *id).map_or(0, |k| valem_core::hash::str_hash(k));
    let mut table = hashbrown::HashTable::with_capacity(derivation_ids.len());
    for &id in derivation_ids {
        let k = flat_member(concretes, id)?;
        match table.entry(
            valem_core::hash::str_hash(k),
            |&o: &NodeId| {
                flat_member(concretes, o).is_some_and(|m| valem_core::value::key_eq(m, k))
            },
            hash,
        ) {
            hashbrown::hash_table::Entry::Occupied(_) => return None,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(id);
            }
        }
    }
    Some(FlatTargets(table))
}

impl FlatTargets {
    /// [`Trie::overlapping`] of the index these targets would make: every target for a read
    /// of the whole document, the member's own for a read at or in it, none for a read
    /// that starts with an array step.
    fn overlapping(&self, r: &[TSeg], concretes: &[Concrete], out: &mut Vec<u32>) {
        match r.first() {
            None => out.extend(self.0.iter().copied()),
            Some(TSeg::Field(k)) => out.extend(
                self.0
                    .find(valem_core::hash::str_hash(k), |&o| {
                        flat_member(concretes, o).is_some_and(|m| valem_core::value::key_eq(m, k))
                    })
                    .copied(),
            ),
            Some(TSeg::Wild | TSeg::Index(_)) => {}
        }
    }
}

/// Edges producer → reader: each node's dependencies, the derivations whose targets overlap
/// what it reads (a whole-document reader depends on every derivation but the other such), in
/// increasing order. `whole` and `firsts` are each node's `whole_doc` and first target. A
/// large graph's are found in two halves, one on a thread of its own.
fn edges<'r, I: Iterator<Item = &'r [TSeg]>>(
    whole: &[bool],
    firsts: &[Option<&Address>],
    derivation_ids: &[NodeId],
    overlapping: &(impl Fn(&[TSeg], &mut Vec<u32>) + Sync),
    reads: impl Fn(usize) -> I + Sync,
) -> Dependents {
    let nodes_len = whole.len();
    let some = |lo: usize, hi: usize| {
        let mut deps_of = Dependents::with_capacity(hi - lo);
        let (mut buf, mut list) = (Vec::new(), Vec::new());
        for id in lo..hi {
            list.clear();
            if whole[id] {
                list.extend(
                    derivation_ids
                        .iter()
                        .copied()
                        .filter(|&p| !whole[p as usize] && p as usize != id),
                );
                deps_of.push_list(&list);
                continue;
            }
            for r in reads(id) {
                buf.clear();
                overlapping(r, &mut buf);
                for &p in &buf {
                    // A `[*]` derivation reading its whole element (`$fn($parent)`) also reads
                    // its own previous output; that is not a dependency (the reference has no
                    // such edge). A read at or below its own target still is: a real cycle.
                    if p as usize == id && firsts[id].is_some_and(|t| reads_strict_ancestor(r, t)) {
                        continue;
                    }
                    list.push(p);
                }
            }
            list.sort_unstable();
            list.dedup();
            deps_of.push_list(&list);
        }
        deps_of
    };
    if nodes_len < PARALLEL_FROM {
        return some(0, nodes_len);
    }
    let mid = nodes_len / 2;
    std::thread::scope(|s| {
        let upper = s.spawn(|| some(mid, nodes_len));
        let mut deps_of = some(0, mid);
        let upper = upper
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        deps_of.append(&upper);
        deps_of
    })
}

/// The derivations in evaluation order: by level, then by id (a counting sort: a chain of 1M
/// derivations has 1M levels, and a list per level was an allocation per derivation).
fn level_order(level: &[u32], derivation_ids: &[NodeId]) -> Vec<NodeId> {
    let Some(max_level) = derivation_ids.iter().map(|&i| level[i as usize]).max() else {
        return Vec::new();
    };
    let mut starts = vec![0u32; max_level as usize + 2];
    for &i in derivation_ids {
        starts[level[i as usize] as usize + 1] += 1;
    }
    for l in 1..starts.len() {
        starts[l] += starts[l - 1];
    }
    let mut order = vec![0; derivation_ids.len()];
    for &i in derivation_ids {
        let at = &mut starts[level[i as usize] as usize];
        order[*at as usize] = i;
        *at += 1;
    }
    order
}

/// Mark the read members a derivation may write (the member, something in it, or the whole
/// document).
fn mark_written(readers: &mut Trie, producers: &Trie) {
    // A read member is marked when a derivation writes the whole document, the member or
    // something in it: an unmarked one is writable without asking the producer index.
    if producers.has_root_entries() {
        readers.mark_all_members();
    } else {
        for k in producers.members() {
            readers.mark_member(k);
        }
    }
}

/// Each node's level: the longest path to it from a node with no dependency (Kahn's
/// algorithm); a cycle is an error naming it.
fn levels_of(
    nodes: &[Node],
    deps_of: &Dependents,
    dependents: &Dependents,
    trace_table: &crate::TraceTable,
) -> Result<Vec<u32>, CompileError> {
    let nodes_len = nodes.len();
    // Kahn's algorithm; levels = longest path from a source.
    let mut indeg: Vec<usize> = deps_of.iter().map(<[NodeId]>::len).collect();
    let mut level = vec![0u32; nodes_len];
    let mut queue: VecDeque<usize> = (0..nodes_len).filter(|&i| indeg[i] == 0).collect();
    let mut done = 0;
    while let Some(n) = queue.pop_front() {
        done += 1;
        for &m in dependents.of(n as NodeId) {
            let m = m as usize;
            level[m] = level[m].max(level[n] + 1);
            indeg[m] -= 1;
            if indeg[m] == 0 {
                queue.push_back(m);
            }
        }
    }
    if done < nodes_len {
        let stuck: Vec<usize> = (0..nodes_len).filter(|&i| indeg[i] > 0).collect();
        let cycle = find_cycle(&stuck, deps_of, &indeg);
        let names: Vec<&str> = cycle
            .iter()
            .map(|&i| &**trace_table.key(i as u32))
            .collect();
        let location = nodes[cycle[0]].location.to_string();
        return Err(CompileError {
            location,
            message: format!("cyclic dependency: {}", names.join(" → ")),
        });
    }
    Ok(level)
}

/// Draft the meta-derivations (`metaDerivations[i]`): `[*]` meta sees the element as `$`.
fn draft_meta(
    spec: &ModelSpec,
    interner: &mut Interner,
    drafts: &mut Drafts,
    errors: &mut Vec<CompileError>,
) {
    for (i, m) in spec.meta_derivations.iter().enumerate() {
        let loc = format!("metaDerivations[{i}]");
        let Some(prop) = MetaProp::parse(&m.property) else {
            errors.push(CompileError {
                location: format!("{loc}.property"),
                message: format!(
                    "unknown meta property `{}`; expected one of: {}",
                    m.property,
                    MetaProp::ALL.map(|p| p.name()).join(", ")
                ),
            });
            continue;
        };
        let target = match parse_address(|| format!("{loc}.path"), &m.path) {
            Ok(a) => a,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let expr = match interner.get(&m.expr) {
            Ok(c) => c,
            Err(e) => {
                errors.push(expr_error(&format!("{loc}.expr"), &m.expr, &e));
                continue;
            }
        };
        let key = format!("{}#{}", target, prop.key_name());
        // `[*]` meta sees the element as `$` (the reference's rule) and as `$parent`.
        let element = target.element_pattern();
        let input = if element.is_some() {
            Input::Element
        } else {
            Input::Doc
        };
        let reads = deps::reads(expr.ast());
        let aggregate = aggregate_of(expr.ast());
        let mut d = draft_empty(
            drafts,
            NodeKind::Meta(prop),
            key.into(),
            vec![target],
            ExprDraft::new(expr),
            input,
            Location::new(Section::MetaDerivations, i),
            aggregate,
        );
        add_reads(&mut d, drafts, &reads, element.as_ref(), element.as_ref());
        if element.is_some() {
            d.node.projection = Some(Projection::whole());
        }
        drafts.push(d);
    }
}

/// Draft the constraints (`constraints[i]`), scoped ones per element.
fn draft_constraints(
    spec: &ModelSpec,
    interner: &mut Interner,
    drafts: &mut Drafts,
    errors: &mut Vec<CompileError>,
) {
    for (i, c) in spec.constraints.iter().enumerate() {
        let loc = format!("constraints[{i}]");
        let Some(policy) = Policy::parse(&c.policy) else {
            errors.push(CompileError {
                location: format!("{loc}.policy"),
                message: format!("policy is required (rollback | flag), found `{}`", c.policy),
            });
            continue;
        };
        let expr = match interner.get(&c.expr) {
            Ok(e) => e,
            Err(e) => {
                errors.push(expr_error(&format!("{loc}.expr"), &c.expr, &e));
                continue;
            }
        };
        let mut targets = Vec::new();
        let mut bad = false;
        if let Some(p) = &c.path {
            for (j, t) in p.paths().into_iter().enumerate() {
                match parse_address(|| format!("{loc}.path[{j}]"), t) {
                    Ok(a) => targets.push(a),
                    Err(e) => {
                        errors.push(e);
                        bad = true;
                    }
                }
            }
        }
        if bad {
            continue;
        }
        let kind = NodeKind::Constraint {
            index: i as u32,
            policy,
        };
        let key = format!("$constraint:{}", c.id);
        if targets.is_empty() {
            let at = Location::new(Section::Constraints, i);
            let d = draft(
                drafts,
                kind,
                key.into(),
                targets,
                expr,
                Input::Doc,
                None,
                at,
            );
            drafts.push(d);
        } else {
            // Scoped: `$` is the field value (the element for `[*]`) and the node reads the
            // scope paths whole, which covers every reference relative to it; `$parent` is the
            // `[*]` element.
            let element = targets.iter().find_map(Address::element_pattern);
            let reads = deps::reads(expr.ast());
            let at = Location::new(Section::Constraints, i);
            let expr = ExprDraft::new(expr);
            let (field, key) = (Input::Field, key.into());
            let mut d = draft_empty(drafts, kind, key, targets, expr, field, at, None);
            for t in &d.node.targets {
                drafts.add_read(tseg_iter(t));
            }
            let parent_only = Reads {
                paths: reads
                    .paths
                    .iter()
                    .filter(|p| p.root == Root::Parent)
                    .cloned()
                    .collect(),
                ..Reads::default()
            };
            add_reads(&mut d, drafts, &parent_only, element.as_ref(), None);
            d.node.projection = Some(Projection::whole());
            d.extra.aggregate = None;
            drafts.push(d);
        }
    }
}

/// Draft the effects' triggers and plan what each evaluates when it fires.
fn draft_effects(
    spec: &ModelSpec,
    interner: &mut Interner,
    drafts: &mut Drafts,
    errors: &mut Vec<CompileError>,
) -> Vec<EffectPlan> {
    let mut effect_plans = Vec::new();
    for (i, e) in spec.effects.iter().enumerate() {
        let loc = format!("effects[{i}]");
        let trigger = match interner.get(&e.trigger) {
            Ok(c) => c,
            Err(err) => {
                errors.push(expr_error(&format!("{loc}.trigger"), &e.trigger, &err));
                effect_plans.push(EffectPlan::default());
                continue;
            }
        };
        let mut plan = EffectPlan::default();
        let mut extra_reads = Reads::default();
        let mut opt = |field: &str,
                       text: &Option<String>,
                       errors: &mut Vec<CompileError>|
         -> Option<Rc<Compiled>> {
            let t = text.as_ref()?;
            match interner.get(t) {
                Ok(c) => Some(c),
                Err(err) => {
                    errors.push(expr_error(&format!("{loc}.{field}"), t, &err));
                    None
                }
            }
        };
        plan.dedupe = opt("dedupeKey", &e.dedupe_key, errors);
        plan.at = opt("at", &e.at, errors);
        plan.after_ms = opt("afterMs", &e.after_ms, errors);
        let requests = opt("requests", &e.requests, errors);
        let prompt = opt("prompt", &e.prompt, errors);
        for c in [&plan.dedupe, &plan.at, &plan.after_ms, &requests, &prompt]
            .into_iter()
            .flatten()
        {
            merge_reads(&mut extra_reads, &deps::reads(c.ast()));
        }
        if let Some(payload) = &e.payload {
            for (k, v) in payload {
                let text = match v {
                    Json::String(s) => s.clone(),
                    other => other.to_string(),
                };
                match interner.get(&text) {
                    Ok(c) => plan.payload.push((k.clone(), c)),
                    Err(err) => errors.push(expr_error(&format!("{loc}.payload.{k}"), &text, &err)),
                }
            }
        }
        let mut d = draft(
            drafts,
            NodeKind::Effect { index: i as u32 },
            format!("$effect:{}", e.id).into(),
            Vec::new(),
            trigger,
            Input::Doc,
            None,
            Location::new(Section::Effects, i),
        );
        add_reads(&mut d, drafts, &extra_reads, None, None);
        drafts.push(d);
        effect_plans.push(plan);
    }
    effect_plans
}

/// The `defaultValues` rules, compiled.
fn default_rules(
    spec: &ModelSpec,
    interner: &mut Interner,
    errors: &mut Vec<CompileError>,
) -> Vec<DefaultRule> {
    let mut defaults = Vec::new();
    for (i, dv) in spec.default_values.iter().enumerate() {
        let loc = format!("defaultValues[{i}]");
        let path = match parse_address(|| format!("{loc}.path"), &dv.path) {
            Ok(a) => a,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        match interner.get(&dv.expr) {
            Ok(expr) => defaults.push(DefaultRule { path, expr }),
            Err(e) => errors.push(expr_error(&format!("{loc}.expr"), &dv.expr, &e)),
        }
    }
    defaults
}

/// The readers of each concrete derivation target without array indices (a write there binds
/// no `[*]`, so each reader is dirtied whole), looked up in the index once.
/// As `CompiledModel::target_readers` keeps them: each node's end in the ids (with [`KNOWN`]
/// when it has a list), after a leading 0.
fn target_readers(concretes: &[Concrete], readers: &mut Trie) -> (Vec<u32>, Vec<NodeId>) {
    let mut ends = Vec::with_capacity(concretes.len() + 1);
    ends.push(0);
    let mut ids = Vec::new();
    let mut hits = Vec::new();
    for c in concretes {
        let known = match c.as_deref() {
            Some(t) if t.iter().all(|s| matches!(s, Seg::Field(_))) => {
                hits.clear();
                // Its member is marked as written here too (what `mark_written` does for every
                // producer's): one lookup of a top-level target, where marking it on the
                // compiling thread afterwards was another (fan-out 1M: 1M probes, ~60 ms).
                match t {
                    [Seg::Field(k)] => {
                        let member = readers.mark_member_found(k);
                        readers.member_hits(member, &mut hits);
                    }
                    _ => {
                        readers.hits(t, &mut hits);
                        if let Some(Seg::Field(k)) = t.first() {
                            readers.mark_member(k);
                        }
                    }
                }
                ids.extend(hits.iter().map(|(id, _)| *id));
                KNOWN
            }
            _ => 0,
        };
        // Fewer than 2^31 ids (each is a read the spec makes: bounded far below).
        ends.push((ids.len() as u32 & !KNOWN) | known);
    }
    ids.shrink_to_fit();
    (ends, ids)
}

/// Give a cell to every derivation whose target is one top-level member that no other
/// derivation writes at or below; cells are numbered in evaluation order (level, then id).
/// `concretes` are the derivations' concrete targets; `alone(id)`: the only entry at its
/// member in the producer index, and nothing below it.
fn assign_cells(
    nodes: &mut [Node],
    by_level: &[NodeId],
    concretes: &[Concrete],
    alone: impl Fn(NodeId) -> bool,
) -> super::merged::CellLayout {
    let mut keys = Vec::new();
    for &id in by_level {
        let Some(k) = flat_member(concretes, id) else {
            continue;
        };
        // Alone: the only entry at its member, and nothing below it.
        if alone(id) {
            nodes[id as usize].cell = keys.len() as u32;
            keys.push(k.clone());
        }
    }
    super::merged::CellLayout::new(keys)
}

/// Whether the read pattern `r` is a strict ancestor of `target` (wildcards match indices).
fn reads_strict_ancestor(r: &[TSeg], target: &Address) -> bool {
    let t = tsegs(target);
    r.len() < t.len()
        && r.iter().zip(&t).all(|(a, b)| match (a, b) {
            (TSeg::Wild, TSeg::Index(_)) | (TSeg::Index(_), TSeg::Wild) => true,
            _ => a == b,
        })
}

/// Name one cycle among the stuck nodes (each has an unprocessed dependency).
fn find_cycle(stuck: &[usize], deps_of: &Dependents, indeg: &[usize]) -> Vec<usize> {
    let start = stuck[0];
    let mut path = vec![start];
    let mut seen: HashMap<usize, usize> = HashMap::from([(start, 0)]);
    let mut cur = start;
    loop {
        let next = deps_of
            .of(cur as NodeId)
            .iter()
            .map(|&d| d as usize)
            .find(|&d| indeg[d] > 0)
            .unwrap_or(cur);
        if let Some(&pos) = seen.get(&next) {
            let mut cycle: Vec<usize> = path[pos..].to_vec();
            cycle.reverse();
            cycle.push(cycle[0]);
            return cycle;
        }
        seen.insert(next, path.len());
        path.push(next);
        cur = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use valem_core::spec::parse_spec;

    fn c(j: Json) -> Result<CompiledModel, Vec<CompileError>> {
        compile(
            Arc::new(parse_spec(&j).unwrap()),
            &crate::EngineLimits::default(),
        )
    }

    /// A derivation's value nests as deep as its path before it holds anything: a path of
    /// more segments than `MAX_DEPTH` does not compile (it did, and its null made the merged
    /// document that deep), one of `MAX_DEPTH` does.
    #[test]
    fn a_derivation_path_deeper_than_a_document_may_be_does_not_compile() {
        let spec = |segments: usize| {
            json!({"id": "deep", "schema": {}, "derivations": [
                {"path": "$.ok", "expr": "1"},
                {"path": format!("${}", ".a".repeat(segments)), "expr": "x + 1"}
            ]})
        };
        let errs = c(spec(MAX_DEPTH + 1)).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].location, "derivations[1].path");
        assert!(
            errs[0].message.contains("101 levels deep"),
            "{}",
            errs[0].message
        );
        assert!(c(spec(MAX_DEPTH)).is_ok());
        let shaped = json!({"id": "deep", "schema": {}, "derivations": [
            {"path": "$.a", "expr": "x_1 + y_1"},
            {"path": format!("$.b{}", "[*]".repeat(MAX_DEPTH)), "expr": "x_2 + y_2"}
        ]});
        assert_eq!(c(shaped).unwrap_err()[0].location, "derivations[1].path");
    }

    /// A large spec is prepared in parts by other threads while this one drafts: every node
    /// comes out in spec order and every finding is reported, in order, as for a small spec.
    #[test]
    fn a_large_spec_prepared_in_parts_keeps_its_order_and_findings() {
        let n = PARALLEL_FROM + PART + 17;
        let bad = [10, PART, 2 * PART + 5, PARALLEL_FROM, n - 1];
        let derivations: Vec<Json> = (0..n)
            .map(|i| {
                let expr = if bad.contains(&i) {
                    format!("a_{i} *")
                } else if i % 3 == 0 {
                    format!("$sum(items.v_{i})")
                } else {
                    format!("a_{i} * b_{i}")
                };
                json!({"path": format!("$.t_{i}"), "expr": expr})
            })
            .collect();
        let errs = c(json!({"id": "big", "schema": {}, "derivations": derivations})).unwrap_err();
        let at: Vec<String> = errs.iter().map(|e| e.location.clone()).collect();
        let want: Vec<String> = bad
            .iter()
            .map(|i| format!("derivations[{i}].expr"))
            .collect();
        assert_eq!(at, want);
        let good: Vec<Json> = (0..n)
            .map(|i| json!({"path": format!("$.t_{i}"), "expr": format!("a_{i} * b_{i}")}))
            .collect();
        let m = c(json!({"id": "big", "schema": {}, "derivations": good})).unwrap();
        assert_eq!(m.nodes.len(), n);
        for (i, node) in m.nodes.iter().enumerate() {
            assert_eq!(&**m.key(node.id), format!("$.t_{i}"));
            assert_eq!(&**m.expression(node.id), format!("a_{i} * b_{i}"));
            assert_eq!(node.location.to_string(), format!("derivations[{i}]"));
            let reads: Vec<String> = m
                .trace_table
                .input_paths(i as u32)
                .map(String::from)
                .collect();
            assert_eq!(reads, [format!("$.a_{i}"), format!("$.b_{i}")]);
        }
    }

    /// A text analysed from the shape of one seen before gives what its own full analysis
    /// gives: the same lowering (code key and inputs), reads and aggregate, for formulas in
    /// and out of the arithmetic subset and names that collide with keywords, constants and
    /// each other.
    #[test]
    fn shaped_analysis_equals_full_analysis() {
        let families = [
            "A * B",
            "A * B + A - (A / 4)",
            "(A - B) / (A + 1) % 3",
            "$round(A * B * (1 + $const.rate), 2)",
            "A > B ? A : (B <= 1 ? -A : 2.5e-3)",
            "A.x * B.y + A.B",
            "$abs(A) + $sqrt(B) * $const.rate",
            "$power(A, 2) + $floor(B) - $ceil(C)",
            "A = 1 and B != 2 ? C : 0",
            "$parent.price * A",
            "$sum(A.B)",
            "$count(A)",
            "A & B",
            "A[0] * 2",
            "$max([A, B])",
            "A in [1, 2] ? B : C",
            "true ? A : B",
            "A * * B",
            "$undefinedfn(A)",
        ];
        let names = [
            ["price_1", "qty_1", "z"],
            ["price_2", "qty_2", "w"],
            ["rate", "x", "y"],
            ["and_x", "or_y", "in_z"],
            ["x", "x", "y"],
            ["price", "qty", "c"],
            ["a", "b", "c"],
        ];
        let limits = Limits::default();
        let mut constants = serde_json::Map::new();
        constants.insert("rate".into(), json!(0.5));
        let bound = HashSet::new();
        let mut shaped = 0;
        for f in families {
            let mut shapes = Shapes::default();
            for ns in names {
                let text = f
                    .replace('A', ns[0])
                    .replace('B', ns[1])
                    .replace('C', ns[2]);
                let d = valem_core::spec::DerivationSpec::new("$.t", text.as_str());
                let seen =
                    skeleton(&text).is_some_and(|sk| matches!(shapes.get(&sk), Some(Some(_))));
                let fast = prepare(0, &d, &limits, &constants, &bound, false, &mut shapes, None);
                let full = prepare(
                    0,
                    &d,
                    &limits,
                    &constants,
                    &bound,
                    false,
                    &mut Shapes::default(),
                    Some(&mut PartNames::default()),
                );
                match (fast, full) {
                    (Ok(mut a), Ok(mut b)) => {
                        a.settle();
                        b.settle();
                        let reads = |p: &Prepared| {
                            let mut out = Vec::new();
                            p.for_each_read(|root, fields| {
                                out.push((root.clone(), fields.to_vec()))
                            });
                            out
                        };
                        let (reads_a, reads_b) = (reads(&a), reads(&b));
                        shaped += usize::from(seen);
                        let program = |p: &Prepared| p.program.as_ref().map(Lowering::program);
                        assert_eq!(program(&a), program(&b), "{text}");
                        // The slots an instance reads are those its program's slots read.
                        let inputs = |p: &Prepared| {
                            let mut slots = crate::jit::Slots::new();
                            p.program
                                .clone()
                                .map(|l| format!("{:?}", l.into_jit(false, &mut slots).inputs))
                        };
                        assert_eq!(inputs(&a), inputs(&b), "{text}");
                        assert_eq!(reads_a, reads_b, "{text}");
                        assert_eq!(a.whole_doc, b.whole_doc, "{text}");
                        assert_eq!(a.aggregate, b.aggregate, "{text}");
                        assert_eq!(a.target, b.target, "{text}");
                        assert_eq!(a.parsed.is_some(), b.parsed.is_some(), "{text}");
                    }
                    (Err(a), Err(b)) => assert_eq!(a.message, b.message, "{text}"),
                    (a, b) => panic!("{text}: {:?} vs {:?}", a.is_ok(), b.is_ok()),
                }
            }
        }
        // The arithmetic families were analysed from their shapes after their first text.
        assert!(shaped >= 30, "only {shaped} texts were shaped");
    }

    #[test]
    fn levels_follow_dependencies() {
        let m = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.c","expr":"b + 1"},
            {"path":"$.b","expr":"a + 1"},
            {"path":"$.items[*].t","expr":"$parent.p * 2"},
            {"path":"$.sum","expr":"$sum(items.t)"}
        ]}))
        .unwrap();
        let find = |k: &str| m.nodes.iter().find(|n| &**m.key(n.id) == k).unwrap();
        let lvl = |k: &str| find(k).level;
        assert_eq!(lvl("$.b"), 0);
        assert_eq!(lvl("$.c"), 1);
        assert_eq!(lvl("$.items[*].t"), 0);
        assert_eq!(lvl("$.sum"), 1);
        // Every derivation once, in evaluation order: by level, then by id.
        let order: Vec<(u32, NodeId)> = m
            .by_level
            .iter()
            .map(|&id| (m.nodes[id as usize].level, id))
            .collect();
        assert_eq!(order, [(0, 1), (0, 2), (1, 0), (1, 3)]);
        let sum = find("$.sum");
        assert!(m.delta_aggregate(sum).is_some());
        let b = find("$.b");
        assert!(m.aggregate(b).is_none());
    }

    /// The producer questions answered from the reader index's marks give what the producer
    /// index gives, for members read and not, written at, in and around derived targets.
    #[test]
    fn marked_members_answer_as_the_producer_index() {
        let m = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.a.b","expr":"x + a.c"},
            {"path":"$.t","expr":"x * 2"},
            {"path":"$.items[*].v","expr":"$parent.p + y"}
        ]}))
        .unwrap();
        let f = |s: &str| valem_core::value::Seg::Field(valem_core::value::Key::from(s));
        let paths: Vec<Vec<valem_core::value::Seg>> = vec![
            vec![f("x")],
            vec![f("y")],
            vec![f("a")],
            vec![f("a"), f("b")],
            vec![f("a"), f("c")],
            vec![f("a"), f("b"), f("z")],
            vec![f("t")],
            vec![f("items")],
            vec![f("items"), valem_core::value::Seg::Index(2), f("v")],
            vec![f("items"), valem_core::value::Seg::Index(2), f("p")],
            vec![f("unread")],
            vec![],
        ];
        // `$.items[*].v` has no concrete target: its writes look the index up.
        assert_eq!(m.target_readers(2), None);
        assert_eq!(m.target_readers(0), Some(&[][..]));
        answers_as(&m, &m.producers, &paths);
        // `x` and `y` are read and nothing writes them: answered from the mark.
        let unproduced = paths.iter().filter(|w| m.unproduced(w)).count();
        assert_eq!(unproduced, 2);
    }

    /// `m` answers which derivation is above and which are below each write in `paths` as
    /// the producer index `index` does (those below in any order).
    fn answers_as(m: &CompiledModel, index: &Trie, paths: &[Vec<valem_core::value::Seg>]) {
        for w in paths {
            assert_eq!(m.produced_above(w), index.above(w), "{w:?}");
            let (mut a, mut b) = (Vec::new(), Vec::new());
            m.produced_below(w, &mut a);
            index.below(w, &mut b);
            a.sort();
            b.sort();
            assert_eq!(a, b, "{w:?}");
        }
    }

    /// A model whose derivations all write cells drops its producer index and answers from
    /// the cells what the index would: the same derivation above a write, the same set below.
    #[test]
    fn cells_answer_as_the_producer_index_of_a_flat_model() {
        let m = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.t","expr":"x * 2"},
            {"path":"$.u","expr":"t + y.z"},
            {"path":"$.v","expr":"$count(items)"}
        ]}))
        .unwrap();
        assert!(m.cell_producers.is_some());
        assert!(!m.producers.has_root_entries() && m.producers.members().next().is_none());
        // Its derivations' patterns (once compiled a concrete one keeps none), from the spec.
        let patterns: Vec<Option<Address>> = m
            .spec
            .derivations
            .iter()
            .map(|d| Address::parse(&d.path).ok())
            .collect();
        let (index, _, _) = index_targets(&m.nodes, &patterns, patterns.len(), true);
        let f = |s: &str| valem_core::value::Seg::Field(valem_core::value::Key::from(s));
        let i = valem_core::value::Seg::Index;
        let paths: Vec<Vec<valem_core::value::Seg>> = vec![
            vec![],
            vec![f("x")],
            vec![f("t")],
            vec![f("t"), f("deep")],
            vec![f("u")],
            vec![f("v"), i(0)],
            vec![f("y"), f("z")],
            vec![f("items"), i(3)],
            vec![f("unread")],
            vec![i(0)],
        ];
        answers_as(&m, &index, &paths);
        // The root write reaches every derivation.
        let mut all = Vec::new();
        m.produced_below(&[], &mut all);
        assert_eq!(all.len(), 3);
        // Edges found by name: `u` reads `t` (and `y.z`, which nothing writes).
        assert_eq!(m.dependents.of(0), &[1]);
        // A write of `t` dirties `u`, of `u` or `v` nothing: known at compile time.
        assert_eq!(m.target_readers(0), Some(&[1][..]));
        assert_eq!(m.target_readers(1), Some(&[][..]));
        assert_eq!(m.target_readers(2), Some(&[][..]));
        assert_eq!(m.target_readers(3), None);
        assert!(m.dependents.of(1).is_empty() && m.dependents.of(2).is_empty());
        let deep = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.b","expr":"a.w + 1"},
            {"path":"$.a","expr":"{\"w\": x}"},
            {"path":"$.k","expr":"$count($keys($))"}
        ]}))
        .unwrap();
        assert!(deep.cell_producers.is_some());
        // A read inside a derived member depends on it; a whole-document reader on the others.
        assert_eq!(deep.dependents.of(1), &[0, 2]);
        assert_eq!(deep.dependents.of(0), &[2]);
        assert!(deep.nodes[1].level < deep.nodes[0].level);
    }

    /// Traces (and the model: the nodes keep neither) name each node by its key and
    /// expression: the spec's own texts for derivations written canonically up to the first
    /// that is not, the table's own after it (and for meta, constraints and effects).
    #[test]
    fn the_trace_table_names_every_node() {
        let m = c(json!({"id":"m","schema":{},
            "derivations":[
                {"path":"$.t0","expr":"x + 1"},
                {"path":"$.t1","expr":"t0 * 2"},
                {"path":"$['t2']","expr":"t1 - 3"},
                {"path":"$.t3","expr":"t2 / 4"}
            ],
            "metaDerivations":[{"path":"$.x","property":"readOnly","expr":"t3 > 10"}],
            "constraints":[{"id":"c","expr":"t0 < 100","message":"m","policy":"flag"}]
        }))
        .unwrap();
        let table = &m.trace_table;
        let keys: Vec<&str> = m.nodes.iter().map(|n| &**m.key(n.id)).collect();
        assert_eq!(
            keys,
            [
                "$.t0",
                "$.t1",
                "$.t2",
                "$.t3",
                "$.x#read_only",
                "$constraint:c"
            ],
            "the canonical keys"
        );
        let texts = ["x + 1", "t0 * 2", "t1 - 3", "t2 / 4", "t3 > 10", "t0 < 100"];
        for (n, text) in m.nodes.iter().zip(texts) {
            assert_eq!(&**m.expression(n.id), text);
            let source = crate::TraceTable::source(table, n.id);
            assert_eq!(&*source.expression, text, "{}", m.key(n.id));
        }
        // The first two are the spec's texts, not copies; the other four the table's own.
        assert_eq!(table.own_texts(), 4);
        assert!(arcstr::ArcStr::ptr_eq(
            table.key(1),
            &m.spec.derivations[1].path
        ));
        assert!(!arcstr::ArcStr::ptr_eq(
            table.key(2),
            &m.spec.derivations[2].path
        ));
    }

    #[test]
    fn cycles_are_named() {
        let e = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.a","expr":"b + 1"},
            {"path":"$.b","expr":"c + 1"},
            {"path":"$.c","expr":"a + 1"}
        ]}))
        .unwrap_err();
        assert!(e[0].message.contains("cyclic dependency"), "{:?}", e);
        for k in ["$.a", "$.b", "$.c"] {
            assert!(e[0].message.contains(k), "{}", e[0].message);
        }
    }

    #[test]
    fn library_exports_functions_and_values() {
        let m = c(json!({"id":"m","schema":{},"constants":{"r":2},
            "library":"( $money := function($n) { $round($n, 2) }; $twice := function($x) { $x * $const.r }; $k := 5; [\"money\", \"twice\", \"k\"] )",
            "derivations":[{"path":"$.t","expr":"$money($twice(a)) + $k"}]}))
        .unwrap();
        assert_eq!(m.exports.len(), 3);
        assert!(m.exports[0].is_function);
        assert!(!m.exports[2].is_function);
    }

    #[test]
    fn compile_errors_are_located() {
        let e = c(json!({"id":"m","schema":{},"derivations":[{"path":"$.a","expr":"1 +"}]}))
            .unwrap_err();
        assert_eq!(e[0].location, "derivations[0].expr");
        assert!(e[0].message.contains("position 3"), "{}", e[0].message);
    }
}
