//! A shard's reads: state (live or `?at=`), fields, schemas, explain, history, audit, view,
//! graph, verification, blob references.

use super::*;

impl Shard {
    pub(crate) fn library(&mut self, id: &str) -> Result<Option<Json>, ServiceError> {
        let e = self.entry(id)?;
        let Some(lib) = &e.spec.library else {
            return Ok(None);
        };
        let layers: Vec<Json> = lib
            .layers()
            .into_iter()
            .map(|l| {
                json!({
                    "define": l.define,
                    "description": l.description,
                    "extends": l.extends,
                    "origin": l.origin,
                })
            })
            .collect();
        let exports: Vec<Json> = e
            .model
            .compiled
            .exports
            .iter()
            .map(|x| {
                json!({
                    "name": x.name,
                    "kind": if x.is_function { "function" } else { "value" },
                    "signature": x.signature,
                    "arity": x.arity,
                    "layer": x.layer,
                })
            })
            .collect();
        let description = layers
            .iter()
            .rev()
            .find_map(|l| l.get("description").filter(|d| !d.is_null()).cloned())
            .unwrap_or(Json::Null);
        Ok(Some(
            json!({"description": description, "layers": layers, "exports": exports}),
        ))
    }

    pub(crate) fn state(&mut self, id: &str, at: Option<Timestamp>) -> Result<Json, ServiceError> {
        let e = self.entry(id)?;
        match at {
            None => Ok(e.model.merged_json(now())),
            Some(at) => {
                // The ring holds the newest commits without a gap: a hit in it is the answer.
                if let Some(doc) = e.state_at(at) {
                    return Ok(doc);
                }
                let (spec, created, evolved) = (e.spec.clone(), e.created, e.evolved);
                if at < evolved {
                    // Before the current spec: that runtime's history is not carried.
                    return Err(ServiceError::HistoryNotFound(iso(at)));
                }
                match self.store.clone() {
                    Some(store) => self.state_from_store(&*store, &spec, created, id, at),
                    None => Err(ServiceError::HistoryNotFound(iso(at))),
                }
            }
        }
    }

    /// The state of model `id` at `at` rebuilt from the store: the newest checkpoint taken
    /// at or before it, plus the records committed up to it.
    pub(super) fn state_from_store(
        &self,
        store: &dyn Store,
        spec: &ModelSpec,
        created: Timestamp,
        id: &str,
        at: Timestamp,
    ) -> Result<Json, ServiceError> {
        if at < created {
            return Err(ServiceError::HistoryNotFound(iso(at)));
        }
        let storage = |x: valem_store::StoreError| ServiceError::Storage(x.to_string());
        let limits = &self.limits.engine;
        let choice = store.usable_checkpoint(id, Some(at)).map_err(storage)?;
        self.report_refused(id, &choice, "the `?at=` read");
        let checkpoint = choice.checkpoint;
        let mut model = match &checkpoint {
            Some(cp) => model_at(spec, &cp.state, cp.at, limits)?,
            None => {
                Model::create(spec, created, limits.clone())
                    .map_err(create_error)?
                    .0
            }
        };
        replay_stored(
            store,
            id,
            checkpoint.and_then(|c| c.sequence),
            Some(at),
            |rec| apply_record(&mut model, &rec).map(|_| ()),
        )?;
        let st = model.state();
        Ok(st.merged_json())
    }

    pub(crate) fn field(&mut self, id: &str, path: &str) -> Result<Option<Json>, ServiceError> {
        let segs = concrete(path)?;
        let e = self.entry(id)?;
        Ok(e.model.get(&segs, now()))
    }

    pub(crate) fn effective_schema(&mut self, id: &str, path: &str) -> Result<Json, ServiceError> {
        let segs = concrete(path)?;
        let e = self.entry(id)?;
        e.model.materialize(now());
        let node =
            effective_schema(&e.model.compiled, &e.model.state().meta, &segs).ok_or_else(|| {
                ServiceError::BadRequest(format!(
                    "`{path}` has no schema: it is not a field the model's schema admits"
                ))
            })?;
        // Served on its own, a node's local `$ref`s would dangle: inline them.
        Ok(inline_refs(&node, &e.model.compiled.schema, 0))
    }

    pub(crate) fn explain(
        &mut self,
        id: &str,
        path: &str,
        limit: Option<usize>,
    ) -> Result<Vec<Trace>, ServiceError> {
        let e = self.entry(id)?;
        let prefix = if path.is_empty() { "$" } else { path };
        let all = prefix == "$";
        let hits: Vec<&Trace> = e
            .traces
            .iter()
            .filter(|t| all || t.target_path.starts_with(prefix))
            .collect();
        let skip = limit.map_or(0, |l| hits.len().saturating_sub(l));
        Ok(hits.into_iter().skip(skip).cloned().collect())
    }

    pub(crate) fn history(&mut self, id: &str) -> Result<Vec<String>, ServiceError> {
        let max = self.limits.history_entries.max(1);
        let store = self.store.clone();
        let e = self.entry(id)?;
        let Some(store) = store else {
            return Ok(e.history.iter().map(|c| iso(c.at)).collect());
        };
        // The commit times the store holds (the ring restarts with the process): the creation
        // or last evolve, then one per record since, the newest `max` of them.
        let filter = valem_store::AuditFilter {
            limit: Some(max),
            from: Some(e.evolved),
            ..Default::default()
        };
        let newest = store
            .query_audit(id, &filter)
            .map_err(|x| ServiceError::Storage(x.to_string()))?;
        let mut times: Vec<String> = newest
            .iter()
            .rev()
            .filter_map(|r| {
                r.get("timestamp")
                    .and_then(Json::as_str)
                    .map(str::to_string)
            })
            .collect();
        if times.len() < max {
            times.insert(0, iso(e.evolved));
        }
        Ok(times)
    }

    pub(crate) fn audit(&mut self, id: &str, q: &AuditQuery) -> Result<Vec<Json>, ServiceError> {
        let store = self.store.clone();
        let e = self.entry(id)?;
        match store {
            // The store holds every record, indexed; memory only the newest.
            Some(store) => store
                .query_audit(
                    id,
                    &valem_store::AuditFilter {
                        path_prefix: q.path_prefix.clone(),
                        from: q.from,
                        to: q.to,
                        limit: q.limit,
                    },
                )
                .map_err(|x| ServiceError::Storage(x.to_string())),
            None => Ok(e.audit.query(q)),
        }
    }

    /// The newest audit sequence of model `id`.
    pub(crate) fn audit_head(&mut self, id: &str) -> Result<Option<Seq>, ServiceError> {
        Ok(self.entry(id)?.audit.head())
    }

    pub(crate) fn verify_audit(&mut self, id: &str) -> Result<Json, ServiceError> {
        let store = self.store.clone();
        let e = self.entry(id)?;
        match store {
            // The whole stored chain, from genesis to the head.
            Some(store) => store
                .verify_chain(id)
                .map(|r| serde_json::to_value(r).unwrap_or(Json::Null))
                .map_err(|x| ServiceError::Storage(x.to_string())),
            None => Ok(e.audit.verify()),
        }
    }

    pub(crate) fn view(&mut self, id: &str, view_id: Option<&str>) -> Result<Json, ServiceError> {
        let limits = self.limits.engine.expr.clone();
        let e = self.entry(id)?;
        let now = now();
        let merged = e.model.merged_json(now);
        let meta = e.model.state().meta_json();
        // The shared spec may carry another model's id: the view is this one's.
        match valem_engine::view::evaluate_view(&e.spec, &merged, &meta, view_id, now, &limits) {
            Ok(mut view) => {
                if let Some(o) = view.as_object_mut() {
                    o.insert("modelId".into(), Json::String(id.to_string()));
                }
                Ok(view)
            }
            Err(ViewError::NoView(_)) => Err(ServiceError::ViewNotFound(
                ViewError::NoView(id.to_string()).to_string(),
            )),
            Err(v @ ViewError::UnknownView(_)) => Err(ServiceError::ViewNotFound(v.to_string())),
            Err(v @ ViewError::Invalid(_)) => Err(ServiceError::BadRequest(v.to_string())),
        }
    }

    pub(crate) fn graph(&mut self, id: &str) -> Result<Json, ServiceError> {
        let mut graph = valem_engine::graph::project(&self.entry(id)?.model.compiled);
        // The compiled model is shared by content: its spec may carry another model's id.
        if let Some(o) = graph.as_object_mut() {
            o.insert("modelId".into(), Json::String(id.to_string()));
        }
        Ok(graph)
    }

    pub(crate) fn verification(&mut self, id: &str) -> Result<Arc<Json>, ServiceError> {
        let limits = self.limits.engine.clone();
        let e = self.entry(id)?;
        if let Some(v) = &e.verification {
            return Ok(v.clone());
        }
        let report =
            valem_engine::testrun::verify(&e.spec, now(), &limits).map_err(create_error)?;
        let v = Arc::new(serde_json::to_value(report).unwrap_or(Json::Null));
        e.verification = Some(v.clone());
        Ok(v)
    }

    pub(crate) fn references(&mut self, id: &str, blob_id: &str) -> Result<bool, ServiceError> {
        fn walk(v: &Json, id: &str) -> bool {
            match v {
                Json::String(s) => s == id || s.ends_with(&format!("/{id}")),
                Json::Array(a) => a.iter().any(|x| walk(x, id)),
                Json::Object(m) => m.values().any(|x| walk(x, id)),
                _ => false,
            }
        }
        let e = self.entry(id)?;
        Ok(walk(&e.model.merged_json(now()), blob_id))
    }
}
