//! A shard's store side: the ops it writes, replies released once durable, checkpoints,
//! and recovering or reloading a model from its checkpoint and the records after it.

use super::*;

/// The model `spec` defines, with the base document and effect dedupe keys of a checkpoint
/// (`{base, effectKeys}`), evaluated at `at`.
pub(super) fn model_at(
    spec: &ModelSpec,
    state: &Json,
    at: Timestamp,
    limits: &valem_engine::EngineLimits,
) -> Result<Model, ServiceError> {
    let compiled = compile_cached(spec, limits).map_err(|errs| {
        ServiceError::Storage(format!(
            "the stored spec of model `{}` no longer compiles: {}",
            spec.id,
            errs.iter()
                .map(|e| e.message.clone())
                .collect::<Vec<_>>()
                .join("; ")
        ))
    })?;
    let base = Val::from_json(state.get("base").unwrap_or(&Json::Null));
    let keys = state
        .get("effectKeys")
        .and_then(Json::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (Arc::<str>::from(k.as_str()), Val::from_json(v)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Model::from_base(compiled, base, keys, at, limits.clone()))
}

/// The store write of `spec` as the model's current spec, at `at`.
pub(super) fn put_model_op(spec: &ModelSpec, at: Timestamp) -> Result<Op, ServiceError> {
    let text = serde_json::to_string(spec).map_err(|e| ServiceError::Storage(e.to_string()))?;
    Ok(Op::PutModel {
        id: spec.id.clone(),
        spec_text: text,
        version: spec.version_or_default().to_string(),
        at,
    })
}

/// A checkpoint of `e` as it is now: after its newest record (before any, when it has none).
/// `Base` when the state was set outside the records (a restore, an evolve).
pub(super) fn checkpoint_op(id: &str, e: &Entry, kind: CheckpointKind) -> Op {
    let st = e.model.state();
    let keys: Map<String, Json> = st
        .effect_keys
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_json()))
        .collect();
    Op::Checkpoint {
        model_id: id.to_string(),
        sequence: e.audit.head(),
        at: e.last,
        state: json!({"base": st.base.to_json(), "effectKeys": keys}),
        kind,
    }
}

/// The writes of one cycle: concrete paths and their new values.
pub(super) type Writes = Vec<(Vec<Seg>, Json)>;

/// The writes a stored audit record committed.
pub(super) fn record_writes(rec: &valem_store::AuditEntry) -> Result<Writes, String> {
    let Some(Json::Object(muts)) = rec.record.get("mutations") else {
        return Err(format!("record {} has no mutations object", rec.sequence));
    };
    muts.iter()
        .map(|(k, v)| {
            concrete(k)
                .map(|segs| (segs, v.clone()))
                .map_err(|x| format!("record {}: {x}", rec.sequence))
        })
        .collect()
}

/// Apply one stored audit record to `e` (recovery): its mutations at its time, then its record
/// back into the in-memory trail and rings.
pub(super) fn replay(
    e: &mut Entry,
    rec: valem_store::AuditEntry,
    history_max: usize,
    explain_max: usize,
) -> Result<(), String> {
    let result = apply_record(&mut e.model, &rec)?;
    push_traces(&mut e.traces, result.traces.iter(), explain_max);
    e.remember(rec.at, history_max);
    e.last = e.last.max(rec.at);
    e.audit.push_stored(rec.sequence, rec.at, rec.record);
    Ok(())
}

/// Run the cycle a stored audit record committed, at its recorded time.
pub(super) fn apply_record(
    model: &mut Model,
    rec: &valem_store::AuditEntry,
) -> Result<MutationResult, String> {
    let writes = record_writes(rec)?;
    model
        .unbounded(|m| m.mutate_parsed(&writes, rec.at))
        .map_err(|x| format!("record {} no longer commits: {x}", rec.sequence))
}

/// Feed model `id`'s stored records after `after` (up to `up_to`) to `f`, oldest first,
/// stopping at its first failure.
pub(super) fn replay_stored(
    store: &dyn Store,
    id: &str,
    after: Option<Seq>,
    up_to: Option<Timestamp>,
    mut f: impl FnMut(valem_store::AuditEntry) -> Result<(), String>,
) -> Result<(), ServiceError> {
    let mut failure = None;
    store
        .audit_after(id, after, up_to, &mut |rec| match f(rec) {
            Ok(()) => std::ops::ControlFlow::Continue(()),
            Err(m) => {
                failure = Some(m);
                std::ops::ControlFlow::Break(())
            }
        })
        .map_err(|x| ServiceError::Storage(x.to_string()))?;
    match failure {
        None => Ok(()),
        Some(m) => Err(ServiceError::Storage(format!(
            "replaying model `{id}`: {m}"
        ))),
    }
}

pub(super) fn compile_findings(errs: Vec<valem_engine::CompileError>) -> Vec<Finding> {
    errs.into_iter()
        .map(|e| Finding {
            location: e.location,
            message: e.message,
        })
        .collect()
}

pub(super) fn create_error(e: CreateError) -> ServiceError {
    match e {
        CreateError::Compile(errs) => ServiceError::InvalidSpec(compile_findings(errs)),
        CreateError::Initial(m) => ServiceError::Mutation(m),
    }
}

pub(super) fn concrete(path: &str) -> Result<Vec<Seg>, ServiceError> {
    let addr = Address::parse(path).map_err(|e| ServiceError::BadRequest(e.message))?;
    addr.concrete().ok_or_else(|| {
        ServiceError::BadRequest(format!(
            "`{path}` contains `[*]`; name one element (e.g. `[0]`)"
        ))
    })
}

impl Shard {
    /// Answer `ok` now (no store, or nothing to write) or once `op` is durable, and only then tell
    /// the subscribers (`event`): nobody hears of a write a crash could still take back. A failed
    /// write marks model `id` stale and is announced to no one.
    pub(super) fn durably<R: Send + 'static>(
        &self,
        id: &str,
        op: Option<Op>,
        ok: R,
        reply: Reply<R>,
        event: Option<Event>,
    ) {
        self.durably_then(id, op, ok, reply, event, None)
    }

    /// [`durably`](Self::durably), running `committed` too once the write is durable.
    pub(super) fn durably_then<R: Send + 'static>(
        &self,
        id: &str,
        op: Option<Op>,
        ok: R,
        reply: Reply<R>,
        event: Option<Event>,
        then: Option<Box<dyn FnOnce() + Send>>,
    ) {
        let subscribers = self.subscribers.clone();
        match (&self.store, op) {
            (Some(store), Some(op)) => {
                let (stale, inflight) = match self.models.get(id) {
                    Some(e) => (Some(e.stale.clone()), Some(e.inflight.clone())),
                    None => (None, None),
                };
                if let Some(n) = &inflight {
                    n.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                }
                reply.after(&store.writer(), op, ok, move |committed| {
                    if let Some(n) = inflight {
                        n.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    }
                    if !committed {
                        if let Some(s) = stale {
                            s.store(true, std::sync::atomic::Ordering::Release);
                        }
                        return;
                    }
                    if let Some(ev) = event {
                        subscribers.publish(ev);
                    }
                    if let Some(f) = then {
                        f();
                    }
                })
            }
            _ => {
                if let Some(ev) = event {
                    subscribers.publish(ev);
                }
                if let Some(f) = then {
                    f();
                }
                reply.send(Ok(ok));
            }
        }
    }

    /// Write a checkpoint of model `id` at its chain head (when it has records and the head is
    /// not checkpointed yet). Nobody waits for it: a lost checkpoint only means a longer replay.
    pub(super) fn checkpoint(&mut self, id: &str) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let Ok(e) = self.entry_raw(id) else { return };
        let Some(seq) = e.audit.head() else { return };
        if e.checkpointed == Some(seq) {
            return;
        }
        e.checkpointed = Some(seq);
        let op = checkpoint_op(id, e, CheckpointKind::Periodic);
        let id = id.to_string();
        store.writer().submit(
            op,
            Box::new(move |r| {
                if let Err(err) = r {
                    tracing::warn!(model = %id, error = %err, "checkpoint not written");
                }
            }),
        );
    }

    /// Checkpoint every model at its head (shutdown: the next start replays nothing).
    pub(crate) fn checkpoint_all(&mut self) {
        for id in self.ids() {
            self.checkpoint(&id);
        }
    }

    /// Rebuild a model from the store: its spec, then every stored record replayed in order
    /// (each cycle at its recorded time, so the state is the one that was acknowledged). A model
    /// the store does not hold is dropped.
    /// Recover a stored model (see [`Shard::recover_model`]); one that cannot be is kept
    /// aside as unrecovered, so that the shard serves the others and answers for it.
    pub(crate) fn recover(&mut self, stored: StoredModel) -> Result<(), ServiceError> {
        let id = stored.id.clone();
        let result = self.recover_model(stored);
        let was = match &result {
            Ok(()) => self.unrecovered.remove(&id).is_some(),
            Err(e) => {
                self.unload(&id);
                self.unrecovered.insert(id, e.to_string()).is_some()
            }
        };
        if was != result.is_err() {
            self.checkpoint_metrics.unrecovered(result.is_err());
        }
        result
    }

    pub(super) fn recover_model(&mut self, stored: StoredModel) -> Result<(), ServiceError> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        let id = stored.id.clone();
        self.unload(&id);
        let spec = valem_core::spec::parse_spec_text(&stored.spec_text).map_err(|e| {
            ServiceError::Storage(format!(
                "the stored spec of model `{id}` does not parse: {e}"
            ))
        })?;
        let (history_max, explain_max) = (self.limits.history_entries, self.limits.explain_entries);
        let storage = |x: valem_store::StoreError| ServiceError::Storage(x.to_string());
        let choice = store.usable_checkpoint(&id, None).map_err(storage)?;
        self.report_refused(&id, &choice, "recovery");
        let checkpoint = choice.checkpoint;
        let after = checkpoint.as_ref().and_then(|c| c.sequence);
        let e = match checkpoint {
            None => self.insert(spec, stored.created)?,
            Some(cp) => {
                let model = model_at(&spec, &cp.state, cp.at, &self.limits.engine)?;
                let e = self.register(spec.id, model, cp.at)?;
                e.checkpointed = cp.sequence;
                e
            }
        };
        e.created = stored.created;
        e.evolved = stored.updated.max(stored.created);
        if let Some(head) = stored.head_seq {
            e.audit.resume(head, &stored.head_hash);
        }
        replay_stored(&*store, &id, after, None, |rec| {
            replay(e, rec, history_max, explain_max)
        })
    }

    /// Log and count the checkpoints `choice` refused on its way (`purpose`: what reads it).
    pub(super) fn report_refused(&self, id: &str, choice: &CheckpointChoice, purpose: &str) {
        let fallback = match &choice.checkpoint {
            Some(cp) => valem_store::checkpoints::describe(cp.sequence),
            None => "the spec's initial state".to_string(),
        };
        for r in &choice.refused {
            self.checkpoint_metrics.refused(&r.fault);
            tracing::warn!(
                model = %id,
                checkpoint = r.sequence.map_or(-1, |s| s.get() as i64),
                reason = r.fault.label(),
                "model `{id}`: {} refused: {}; {purpose} starts from {fallback} instead and replays the records after it",
                valem_store::checkpoints::describe(r.sequence),
                r.fault,
            );
        }
    }

    /// Memory is ahead of the store (a write failed): wait for the writes in flight, then load
    /// the model as the store has it.
    pub(super) fn reload(&mut self, id: &str) -> Result<(), ServiceError> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        store
            .flush()
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        let stored = store
            .load_model(id)
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        match stored {
            Some(m) => self.recover(m),
            None => {
                self.unload(id);
                Err(ServiceError::NotFound(id.to_string()))
            }
        }
    }
}
