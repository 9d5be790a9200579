//! A shard's writes: mutations and JSON Patch, snapshot and restore, evolution, each a cycle
//! committed with its audit record.

use super::*;
use crate::{Change, IdempotencyKey, ModelInfo, Viewed};

/// Replace local `{"$ref": "#/…"}` nodes by their targets. At most 16 references are followed
/// along any one branch, so a recursive schema keeps its `$ref` below that.
pub(super) fn inline_refs(node: &Json, root: &Json, followed: usize) -> Json {
    const MAX_FOLLOWED: usize = 16;
    match node {
        Json::Object(m) => {
            if let Some(Json::String(r)) = m.get("$ref") {
                if followed < MAX_FOLLOWED {
                    if let Some(target) = r.strip_prefix('#').and_then(|p| root.pointer(p)) {
                        let mut out = match inline_refs(target, root, followed + 1) {
                            Json::Object(t) => t,
                            other => return other,
                        };
                        for (k, v) in m {
                            if k != "$ref" {
                                out.insert(k.clone(), inline_refs(v, root, followed));
                            }
                        }
                        return Json::Object(out);
                    }
                }
            }
            Json::Object(
                m.iter()
                    .map(|(k, v)| (k.clone(), inline_refs(v, root, followed)))
                    .collect(),
            )
        }
        Json::Array(a) => Json::Array(a.iter().map(|v| inline_refs(v, root, followed)).collect()),
        other => other.clone(),
    }
}

/// Keep the newest `max` of `traces` in the explain ring (only those are expanded).
pub(super) fn push_traces(
    ring: &mut VecDeque<Trace>,
    traces: impl DoubleEndedIterator<Item = Trace>,
    max: usize,
) {
    let newest: Vec<Trace> = traces.rev().take(max).collect();
    for t in newest.into_iter().rev() {
        if ring.len() >= max {
            ring.pop_front();
        }
        ring.push_back(t);
    }
}

/// Apply `patch` to `doc` one operation at a time, refusing any operation that would place a
/// value deeper in the document than [`valem_core::value::MAX_DEPTH`] (a few `copy`s of a value under
/// a long path would double the document's depth each time). On error `doc` is left part-way:
/// the caller drops it.
pub(super) fn apply_patch(doc: &mut Json, patch: &json_patch::Patch) -> Result<(), String> {
    use json_patch::PatchOperation as P;
    for (i, op) in patch.0.iter().enumerate() {
        let placed = match op {
            P::Add(a) => Some(&a.value),
            P::Replace(r) => Some(&r.value),
            P::Copy(c) => doc.pointer(c.from.as_str()),
            P::Move(m) => doc.pointer(m.from.as_str()),
            P::Remove(_) | P::Test(_) => None,
        };
        if let Some(v) = placed {
            let at = op.path().tokens().count();
            if valem_core::value::json_deeper_than(v, valem_core::value::room_below(at)) {
                return Err(format!(
                    "operation '/{i}' at path '{}': the value there {}",
                    op.path(),
                    valem_core::value::TooDeep
                ));
            }
        }
        json_patch::patch_unsafe(doc, std::slice::from_ref(op))
            .map_err(|e| format!("operation '/{i}' failed at path '{}': {}", e.path, e.kind))?;
    }
    Ok(())
}

pub(super) fn collect_leaves(v: &Json, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    match v {
        Json::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                at.push(Seg::Field(valem_core::value::intern(k)));
                collect_leaves(x, at, out);
                at.pop();
            }
        }
        Json::Array(a) if !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                at.push(Seg::Index(i));
                collect_leaves(x, at, out);
                at.pop();
            }
        }
        _ => out.push(at.clone()),
    }
}

/// The writes that turn `old` into `new`: objects are compared member by member (a removed
/// member rewrites its parent), arrays element by element when their length is unchanged
/// (otherwise the array is rewritten whole).
pub(super) fn diff(old: &Json, new: &Json, at: &mut Vec<Seg>, out: &mut Vec<(Vec<Seg>, Json)>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Json::Object(o), Json::Object(n)) if o.keys().all(|k| n.contains_key(k)) => {
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) => {
                        at.push(Seg::Field(valem_core::value::intern(k)));
                        diff(ov, nv, at, out);
                        at.pop();
                    }
                    None => {
                        let mut p = at.clone();
                        p.push(Seg::Field(valem_core::value::intern(k)));
                        out.push((p, nv.clone()));
                    }
                }
            }
        }
        (Json::Array(o), Json::Array(n)) if o.len() == n.len() => {
            for (i, (ov, nv)) in o.iter().zip(n).enumerate() {
                at.push(Seg::Index(i));
                diff(ov, nv, at, out);
                at.pop();
            }
        }
        _ => out.push((at.clone(), new.clone())),
    }
}

impl Shard {
    // --- writes -----------------------------------------------------------------------------

    pub(crate) fn mutate(
        &mut self,
        id: &str,
        mutations: Vec<(String, Json)>,
        source: Source,
        reply: Reply<Arc<MutationResult>>,
    ) {
        match self.parse_mutations(mutations) {
            Ok(parsed) => self.commit(id, parsed, source, reply),
            Err(e) => reply.send(Err(e)),
        }
    }

    pub(super) fn parse_mutations(
        &self,
        mutations: Vec<(String, Json)>,
    ) -> Result<Writes, ServiceError> {
        // The values are moved, not copied: an initial load can be one large array.
        valem_engine::parse_writes(mutations.into_iter(), self.limits.engine.max_mutations)
            .map_err(ServiceError::Mutation)
    }

    /// Run one cycle and answer it: at once in memory, or once its audit record is durable.
    pub(super) fn commit(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
        reply: Reply<Arc<MutationResult>>,
    ) {
        self.commit_then(id, parsed, source, reply, |_, result| result);
    }

    /// A write answered with `view` of the state it committed, evaluated in the same shard job
    /// (no other write comes between); an unknown view is refused before anything is written.
    pub(crate) fn write_viewed(
        &mut self,
        id: &str,
        change: Change,
        view: Option<String>,
        key: Option<IdempotencyKey>,
        reply: Reply<Viewed>,
    ) {
        let keyed = match key {
            None => None,
            Some(k) => {
                let request = keys::request_hash(&change, view.as_deref());
                match self.replay(id, &k, &request) {
                    Ok(None) => Some(keys::Keyed::new(k, request)),
                    Ok(Some(result)) => {
                        self.metrics
                            .replayed
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let view = view.map(|v| self.view(id, Some(&v)));
                        return reply.send(Ok(Viewed {
                            result,
                            view,
                            replayed: true,
                        }));
                    }
                    Err(e) => return reply.send(Err(e)),
                }
            }
        };
        if let Some(v) = &view {
            match self.entry(id) {
                Ok(e) if e.info().views.iter().any(|x| x == v) => {}
                Ok(_) => {
                    return reply.send(Err(ServiceError::ViewNotFound(format!(
                        "model `{id}` has no view `{v}`"
                    ))))
                }
                Err(e) => return reply.send(Err(e)),
            }
        }
        let (writes, source) = match change {
            Change::Mutations(m) => match self.parse_mutations(m) {
                Ok(w) => (Some(w), Source::Client),
                Err(e) => return reply.send(Err(e)),
            },
            Change::Patch(p) => match self.patch_writes(id, p) {
                Ok(w) => (w, Source::Patch),
                Err(e) => return reply.send(Err(e)),
            },
        };
        let answer = |s: &mut Shard, result: Arc<MutationResult>| Viewed {
            view: view.map(|v| s.view(id, Some(&v))),
            result,
            replayed: false,
        };
        match writes {
            Some(w) => self.commit_keyed(id, w, source, keyed, reply, answer),
            // A patch that changes nothing: no cycle.
            None => {
                let unchanged = Arc::new(MutationResult {
                    success: true,
                    ..Default::default()
                });
                let out = answer(self, unchanged);
                reply.send(Ok(out));
            }
        }
    }

    /// [`commit`](Self::commit), answering what `answer` makes of the result, right after the
    /// cycle on the state it committed.
    pub(super) fn commit_then<R: Send + 'static>(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
        reply: Reply<R>,
        answer: impl FnOnce(&mut Shard, Arc<MutationResult>) -> R,
    ) {
        self.commit_keyed(id, parsed, source, None, reply, answer)
    }

    /// [`commit_then`](Self::commit_then) of a write that may come with an idempotency key:
    /// the key is kept with it.
    pub(super) fn commit_keyed<R: Send + 'static>(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
        keyed: Option<keys::Keyed>,
        reply: Reply<R>,
        answer: impl FnOnce(&mut Shard, Arc<MutationResult>) -> R,
    ) {
        match self.cycle(id, parsed, source) {
            Ok((result, op)) => {
                let op = match keyed {
                    Some(k) => self.keep_key(id, k, &result, op),
                    None => op,
                };
                let event = Event::Mutation {
                    model_id: id.to_string(),
                    result: result.clone(),
                };
                // The audit store hears of the record once it is committed, like subscribers.
                let fed = self.audit_sink.get().cloned().and_then(|sink| {
                    let r = self.models.get(id)?.audit.last()?;
                    let entry = valem_sdk::AuditEntry {
                        model_id: id.to_string(),
                        sequence: r.sequence.get(),
                        at_us: r.at.us(),
                        paths: r.paths.clone(),
                        record: r.json.clone(),
                    };
                    Some(Box::new(move || sink.append(entry)) as Box<dyn FnOnce() + Send>)
                });
                let ok = answer(self, result);
                self.durably_then(id, op, ok, reply, Some(event), fed);
                let every = self.limits.checkpoint_every.max(1) as u64;
                let due = self
                    .models
                    .get(id)
                    .and_then(|e| e.audit.head())
                    .is_some_and(|seq| (seq.get() + 1).is_multiple_of(every));
                if due {
                    self.checkpoint(id);
                }
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The cycle itself; with a store, also the audit record to append.
    pub(super) fn cycle(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
    ) -> Result<(Arc<MutationResult>, Option<Op>), ServiceError> {
        let durable = self.store.is_some();
        let (history_max, explain_max) = (self.limits.history_entries, self.limits.explain_entries);
        let metrics = self.metrics.clone();
        let e = self.entry(id)?;
        let t = e.tick();
        let started = std::time::Instant::now();
        let outcome = e.model.mutate_parsed(&parsed, t);
        let took = started.elapsed();
        let result = match outcome {
            Ok(r) => r,
            Err(err) => {
                let counter = match &err {
                    MutationError::Schema(_) => &metrics.rejected_schema,
                    MutationError::Constraint { .. } => &metrics.rejected_constraint,
                    _ => &metrics.rejected_other,
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Rejected cycles leave no history or audit; their constraint traces explain the
                // refusal (the derivation traces describe values that were never committed).
                if let MutationError::Constraint { traces, .. } = &err {
                    let refusal = traces
                        .iter()
                        .filter(|t| t.target_path.starts_with("$constraint:"));
                    push_traces(&mut e.traces, refusal, explain_max);
                }
                return Err(ServiceError::Mutation(err));
            }
        };
        push_traces(&mut e.traces, result.traces.iter(), explain_max);
        e.remember(t, history_max);
        let mutations: Map<String, Json> = parsed
            .into_iter()
            .map(|(segs, v)| (render(&segs), v))
            .collect();
        let version = e.spec.version_or_default().to_string();
        let op = e
            .audit
            .append(
                AuditEntry {
                    model_id: id,
                    model_version: &version,
                    source: source.as_str(),
                    at: t,
                    mutations,
                    result: &result,
                },
                durable,
            )
            .map_err(|x| ServiceError::Storage(x.to_string()))?
            .map(Op::AppendAudit);
        let result = Arc::new(result);
        metrics.committed(took);
        Ok((result, op))
    }

    /// The writes a patch amounts to (`None`: it changes nothing).
    pub(super) fn patch_writes(
        &mut self,
        id: &str,
        patch: json_patch::Patch,
    ) -> Result<Option<Writes>, ServiceError> {
        let e = self.entry(id)?;
        let old = e.model.state().base.to_json();
        let mut new = old.clone();
        apply_patch(&mut new, &patch).map_err(|m| {
            ServiceError::Mutation(MutationError::Invalid(format!("invalid patch: {m}")))
        })?;
        if !new.is_object() {
            return Err(ServiceError::Mutation(MutationError::Invalid(
                "the patched document must stay a JSON object".into(),
            )));
        }
        let mut writes = Vec::new();
        diff(&old, &new, &mut Vec::new(), &mut writes);
        Ok((!writes.is_empty()).then_some(writes))
    }

    pub(crate) fn snapshot(&mut self, id: &str) -> Result<Json, ServiceError> {
        let e = self.entry(id)?;
        let now = now();
        let derived = e.model.derived_cache(now);
        let st = e.model.state();
        Ok(json!({
            "modelId": id,
            "modelVersion": e.spec.version_or_default(),
            "takenAt": iso(now),
            "baseDoc": st.base.to_json(),
            "derivedCache": derived,
            "metaCache": st.meta_json(),
        }))
    }

    /// Replace the base document with a snapshot's; with a store, answered once a checkpoint of
    /// the restored state is durable (recovery starts from it).
    pub(crate) fn restore_durably(&mut self, id: &str, snapshot: Json, reply: Reply<Json>) {
        match self.restore(id, snapshot) {
            Ok(v) => {
                let op = match (&self.store, self.models.get_mut(id)) {
                    (Some(_), Some(e)) => {
                        e.checkpointed = e.audit.head();
                        Some(checkpoint_op(id, e, CheckpointKind::Base))
                    }
                    _ => None,
                };
                let event = Event::Restored {
                    model_id: id.to_string(),
                };
                self.durably(id, op, v, reply, Some(event))
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    pub(super) fn restore(&mut self, id: &str, snapshot: Json) -> Result<Json, ServiceError> {
        let bad = |m: String| ServiceError::BadRequest(m);
        let e = self.entry(id)?;
        let Json::Object(snap) = snapshot else {
            return Err(bad(
                "a snapshot is an object as `snapshot` returns it: {modelId, modelVersion, baseDoc, …}"
                    .into(),
            ));
        };
        if let Some(m) = snap.get("modelId").and_then(|m| m.as_str()) {
            if m != id {
                return Err(bad(format!("this snapshot is of model `{m}`, not `{id}`")));
            }
        }
        let Some(base @ Json::Object(_)) = snap.get("baseDoc") else {
            return Err(bad("the snapshot has no `baseDoc` object".into()));
        };
        if valem_core::value::json_deeper_than(base, valem_core::value::MAX_DEPTH) {
            return Err(bad(format!(
                "the snapshot's baseDoc {}",
                valem_core::value::TooDeep
            )));
        }
        // A base document may not hold derived values, and must satisfy the schema.
        let mut leaves = Vec::new();
        collect_leaves(base, &mut Vec::new(), &mut leaves);
        let mut violations = Vec::new();
        for segs in &leaves {
            if e.model.compiled.producers.above(segs).is_some() {
                violations.push(SchemaViolation {
                    path: render(segs),
                    keyword: "readOnly".into(),
                    message: "a derived field cannot be part of baseDoc".into(),
                });
            }
        }
        for i in evolve::strand_check(&e.model.compiled.schema, base) {
            violations.push(SchemaViolation {
                path: i.path,
                keyword: "schema".into(),
                message: i.message,
            });
        }
        if !violations.is_empty() {
            return Err(ServiceError::Mutation(MutationError::Schema(violations)));
        }
        let t = e.tick();
        e.model.reset_base(Val::from_json(base), t);
        e.traces.clear();
        e.restart_history(t);
        let version = e.spec.version_or_default().to_string();
        Ok(json!({"restored": true, "id": id, "version": version, "restoredAt": iso(t)}))
    }

    /// Evolve the spec; with a store, answered once the new spec and a checkpoint of the
    /// evolved state are durable, together (recovery and `?at=` start from it: the history of
    /// the old runtime is not carried, as in the reference).
    pub(crate) fn evolve_durably(&mut self, id: &str, evo: SpecEvolution, reply: Reply<ModelInfo>) {
        match self.evolve(id, evo) {
            // Nothing changed: nothing to store or announce.
            Ok(None) => match self.entry(id) {
                Ok(e) => reply.send(Ok(e.info())),
                Err(x) => reply.send(Err(x)),
            },
            Ok(Some(info)) => {
                let op = match (&self.store, self.models.get_mut(id)) {
                    (Some(_), Some(e)) => {
                        e.checkpointed = e.audit.head();
                        e.evolved = e.last;
                        match put_model_op(&e.named_spec(), e.last) {
                            Ok(put) => Some(Op::Atomic(vec![
                                put,
                                checkpoint_op(id, e, CheckpointKind::Base),
                            ])),
                            Err(x) => {
                                e.stale.store(true, std::sync::atomic::Ordering::Release);
                                return reply.send(Err(x));
                            }
                        }
                    }
                    _ => None,
                };
                let event = Event::SpecEvolved {
                    model_id: id.to_string(),
                    version: info.version.clone(),
                };
                self.durably(id, op, info, reply, Some(event))
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Apply `evo`; `None` when the evolved spec is the live one and no backfill is written (the
    /// model, its history and traces are left as they are).
    pub(super) fn evolve(
        &mut self,
        id: &str,
        evo: SpecEvolution,
    ) -> Result<Option<ModelInfo>, ServiceError> {
        let limits = self.limits.engine.clone();
        let e = self.entry(id)?;
        let actual = e.spec.version_or_default().to_string();
        if let Some(expected) = &evo.expected_version {
            if *expected != actual {
                return Err(ServiceError::VersionConflict {
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        // Applied to the shared content (whose id may be another model's), compared with it,
        // then named for this model.
        let mut spec = evolve::apply(&e.spec, &evo).map_err(|x| ServiceError::BadRequest(x.0))?;
        let backfills = evo.backfill.as_ref().is_some_and(|b| {
            b.keys().any(|k| {
                concrete(k)
                    .ok()
                    .is_none_or(|segs| e.model.state().base.get_path(&segs).is_none())
            })
        });
        if spec == *e.spec && !backfills {
            return Ok(None);
        }
        spec.id = id.to_string();
        let report = valem_engine::validate::validate(&spec, &limits);
        if !report.valid {
            return Err(ServiceError::EvolutionInvalid(report.errors));
        }
        // The new spec's names are the live document's (not copies of them), as they are
        // when a model is compiled before its document is loaded.
        valem_core::value::share_names_of(&e.model.state().base);
        let compiled = compile_cached(&spec, &limits)
            .map_err(|errs| ServiceError::EvolutionInvalid(compile_findings(errs)))?;
        let t = e.tick();
        let st = e.model.state();
        let base = st.base.clone();
        let mut model = Model::from_base(compiled, base.clone(), st.effect_keys.clone(), t, limits);
        if let Some(backfill) = &evo.backfill {
            let mut writes = Vec::new();
            for (k, v) in backfill {
                let segs = concrete(k)?;
                if base.get_path(&segs).is_none() {
                    writes.push((segs, v.clone()));
                }
            }
            if !writes.is_empty() {
                model
                    .mutate_parsed(&writes, t)
                    .map_err(ServiceError::Mutation)?;
            }
        }
        let schema_touched = evo.new_schema.is_some()
            || evo.upsert_schema_defs.is_some()
            || !evo.remove_schema_defs.is_empty()
            || !evo.upsert_schema_nodes.is_empty()
            || !evo.remove_schema_nodes.is_empty();
        if schema_touched {
            let stranded = evolve::strand_check(&spec.schema, &model.state().base.to_json());
            if !stranded.is_empty() {
                return Err(ServiceError::Stranded(stranded));
            }
        }
        let info = ModelInfo::of(&spec);
        e.spec = model.compiled.spec.clone();
        e.verification = None;
        e.model = model;
        e.traces.clear();
        e.restart_history(t);
        Ok(Some(info))
    }
}
