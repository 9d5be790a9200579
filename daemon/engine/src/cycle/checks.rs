//! After the derivations: meta-derivations, constraints and the effects a cycle requests.

use super::*;

/// The reference's constraint truthiness: missing/null fail, booleans as is, numbers ≠ 0 and
/// non-empty strings pass, objects and arrays fail.
pub(super) fn truthy(v: Option<&JValue>) -> bool {
    match v {
        None | Some(JValue::Null) | Some(JValue::Undefined) => false,
        Some(JValue::Bool(b)) => *b,
        Some(JValue::Number(n)) => *n != 0.0,
        Some(JValue::String(s)) => !s.is_empty(),
        Some(_) => false,
    }
}

impl<'a> Cycle<'a> {
    pub(super) fn meta(&mut self) {
        if self.abort.is_some() {
            return;
        }
        let cm = self.cm;
        let ids: Vec<NodeId> = std::mem::take(&mut self.meta_dirty).into_iter().collect();
        for id in ids {
            let node = &cm.nodes[id as usize];
            let NodeKind::Meta(prop) = node.kind else {
                continue;
            };
            let pattern = &node.targets[0];
            let full = self.sc.bound(id).is_none();
            let insts = self.instances(id, pattern);
            self.sc.clean(id);
            let mut keys = KeyedSet::default();
            for inst in insts.iter() {
                if self.abort.is_some() {
                    break;
                }
                let value = match self.evaluate(node, inst) {
                    Ok(Some(v)) => {
                        from_jvalue(&v, MAX_DEPTH, &self.limits.expr).unwrap_or(Val::Null)
                    }
                    _ => Val::Null,
                };
                let key: Arc<str> = Arc::from(format!("{}#{}", render(inst), prop.key_name()));
                keys.insert(key.clone());
                let entry = MetaEntry { node: id, value };
                if self.st.meta.get(&key) != Some(&entry) {
                    self.result.meta_updated.push(key.to_string());
                    let old = self.st.meta.insert(key.clone(), entry);
                    self.journal.meta.push((key, old));
                }
            }
            if full && pattern.has_wildcard() {
                let stale: Vec<Arc<str>> = self
                    .st
                    .meta
                    .iter()
                    .filter(|(k, e)| e.node == id && !keys.contains(*k))
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in stale {
                    let old = self.st.meta.remove(&k);
                    self.journal.meta.push((k, old));
                }
            }
        }
    }

    pub(super) fn allowed(&self, id: NodeId) -> bool {
        self.allowed.as_ref().is_none_or(|a| a.contains(&id))
    }

    pub(super) fn constraints(&mut self) -> Vec<ConstraintViolation> {
        let cm = self.cm;
        let mut rollback = Vec::new();
        if self.abort.is_some() {
            return rollback;
        }
        let ids: Vec<NodeId> = std::mem::take(&mut self.constraint_dirty)
            .into_iter()
            .collect();
        for id in ids {
            if !self.allowed(id) {
                continue;
            }
            let node = &cm.nodes[id as usize];
            let NodeKind::Constraint { index, policy } = node.kind else {
                continue;
            };
            let spec = &cm.spec.constraints[index as usize];
            let mut insts = Insts::default();
            if node.targets.is_empty() {
                insts.push(&[]);
            } else {
                for t in &node.targets {
                    insts.extend(&self.instances(id, t));
                }
            }
            self.sc.clean(id);
            let mut failed = false;
            for inst in insts.iter() {
                if self.abort.is_some() {
                    break;
                }
                let (passed, error) = match self.evaluate(node, inst) {
                    Ok(v) => (truthy(v.as_ref()), None),
                    Err(e) => (false, Some(e.message)),
                };
                self.trace(node, None, Val::Null, Some(passed), error);
                failed |= !passed;
            }
            if failed {
                let v = ConstraintViolation {
                    constraint_id: spec.id.clone(),
                    message: spec.message.clone(),
                    policy: policy.as_str(),
                };
                match policy {
                    Policy::Rollback => rollback.push(v),
                    Policy::Flag => self.result.flagged_constraints.push(v),
                }
            }
        }
        rollback
    }

    pub(super) fn effects(&mut self) {
        let cm = self.cm;
        let ids: Vec<NodeId> = std::mem::take(&mut self.effect_dirty).into_iter().collect();
        for id in ids {
            if !self.allowed(id) {
                continue;
            }
            let node = &cm.nodes[id as usize];
            let NodeKind::Effect { index } = node.kind else {
                continue;
            };
            let spec = &cm.spec.effects[index as usize];
            let plan = &cm.effect_plans[index as usize];
            let fire = matches!(self.evaluate(node, &[]), Ok(v) if truthy(v.as_ref()));
            if !fire {
                continue;
            }
            // The trigger's projection covers the dedupe key and timer expressions (they are
            // the node's reads); the payload is not tracked (reference rule), so it sees the
            // whole document, converted once per firing.
            let input = self.input(node, &[]);
            let full = if plan.payload.is_empty() {
                JValue::Null
            } else {
                self.whole_doc()
            };
            let env = cycle_env(&self.env, self.cm, self.now_ms);
            let limits = &self.limits.expr;
            let eval_on =
                |c: &valem_core::expr::Compiled, input: &JValue| -> Option<serde_json::Value> {
                    match c.eval(input, env, limits) {
                        Ok(Some(v)) => jvalue_to_json(&v, limits).ok(),
                        _ => None,
                    }
                };
            let eval = |c: &valem_core::expr::Compiled| eval_on(c, &input);
            let dedupe_key = plan
                .dedupe
                .as_ref()
                .map(|c| eval(c).unwrap_or(serde_json::Value::Null));
            if let Some(k) = &dedupe_key {
                let key = Val::from_json(k);
                let id_key: Arc<str> = Arc::from(spec.id.as_str());
                if self.st.effect_keys.get(&id_key) == Some(&key) {
                    continue;
                }
                let old = self.st.effect_keys.insert(id_key.clone(), key);
                self.journal.effect_keys.push((id_key, old));
            }
            let payload = if plan.payload.is_empty() {
                None
            } else {
                Some(
                    plan.payload
                        .iter()
                        .map(|(k, c)| {
                            (
                                k.clone(),
                                eval_on(c, &full).unwrap_or(serde_json::Value::Null),
                            )
                        })
                        .collect(),
                )
            };
            self.result.dispatched_effects.push(EffectRequest {
                effect_id: spec.id.clone(),
                executor: spec.executor().to_string(),
                emit: spec.emit.clone(),
                payload,
                dedupe_key,
                status_path: spec.status_path.clone(),
                at: plan.at.as_ref().and_then(|c| eval(c)),
                after_ms: plan.after_ms.as_ref().and_then(|c| eval(c)),
            });
        }
    }
}
