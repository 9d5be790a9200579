//! Default values: `defaultValues` rules and schema `default`s fill new containers leaf by
//! leaf (only what they fill is written and propagated).

use super::*;

/// JSON Schema `default` keywords fill absent properties at creation (after `$` rules), as the
/// reference's `SchemaDefaultApplier` does: every `properties` entry with a non-null `default`
/// is filled (the objects on the way created) and not descended into; one without is descended
/// into when it declares `properties`. Local `$ref`s are followed (the reference reads the
/// schema as written).
pub(super) fn apply_schema_defaults(
    c: &mut Cycle<'_>,
    root: &serde_json::Value,
    node: &serde_json::Value,
    at: &mut Vec<Seg>,
    depth: usize,
) -> Result<(), MutationError> {
    if depth > 32 {
        return Ok(());
    }
    let node = crate::schema::resolve(root, node);
    let Some(props) = node.get("properties").and_then(|p| p.as_object()) else {
        return Ok(());
    };
    for (k, sub) in props {
        at.push(Seg::Field(valem_core::value::intern(k)));
        let sub_r = crate::schema::resolve(root, sub);
        match sub_r.get("default") {
            Some(d) if !d.is_null() => {
                let d = Val::from_json_within(d, room_below(at.len())).map_err(|e| {
                    MutationError::Invalid(format!("the schema default of {}: {e}", render(at)))
                })?;
                c.fill_leaf(at, d)?
            }
            _ => apply_schema_defaults(c, root, sub_r, at, depth + 1)?,
        }
        at.pop();
    }
    Ok(())
}

impl<'a> Cycle<'a> {
    // --- defaults ---------------------------------------------------------------------------

    /// Containers a mutation will create: absent proper prefixes of its paths (not the array
    /// itself when the next segment is an index).
    pub(super) fn new_containers<J>(&self, mutations: &[(Vec<Seg>, J)]) -> Vec<Vec<Seg>> {
        let mut out: Vec<Vec<Seg>> = Vec::new();
        for (segs, _) in mutations {
            for k in 1..segs.len() {
                if matches!(segs[k], Seg::Index(_)) {
                    continue;
                }
                let prefix = &segs[..k];
                if self.st.base.get_path(prefix).is_none() && !out.iter().any(|p| p == prefix) {
                    out.push(prefix.to_vec());
                }
            }
        }
        out.sort_by_key(Vec::len);
        out
    }

    pub(super) fn apply_defaults(&mut self, containers: &[Vec<Seg>]) -> Result<(), MutationError> {
        let cm = self.cm;
        for c in containers {
            for rule in &cm.defaults {
                if !matches_pattern(&rule.path, c) {
                    continue;
                }
                let input = self.whole_doc();
                let parent = if c.is_empty() {
                    JValue::Null
                } else {
                    self.st.merged().jvalue_at(&c[..c.len() - 1])
                };
                let me = self.st.base.get_path(c).map_or(JValue::Null, to_jvalue);
                let env = self.env().with("parent", parent).with("self", me);
                let Ok(Some(v)) = rule.expr.eval(&input, &env, &self.limits.expr) else {
                    continue;
                };
                let v = from_jvalue(&v, room_below(c.len()), &self.limits.expr).map_err(|e| {
                    MutationError::Invalid(format!(
                        "the defaultValues rule for {}: {}",
                        rule.path, e.message
                    ))
                })?;
                if v.as_obj().is_some() {
                    self.fill_absent(&mut c.clone(), &v)?;
                }
            }
        }
        Ok(())
    }

    /// Deep-merge `v` into the container at `at`, only where the caller left a field absent.
    /// As the reference's applier does, the object is written leaf by leaf (a non-empty object
    /// is descended into, a null is no default), so only the addresses actually filled are
    /// written and marked: a reader of a field the default leaves absent is not reached.
    pub(super) fn fill_absent(&mut self, at: &mut Vec<Seg>, v: &Val) -> Result<(), MutationError> {
        let Some(obj) = v.as_obj() else { return Ok(()) };
        for (k, x) in obj.iter() {
            at.push(Seg::Field(k.clone()));
            match x {
                Val::Null => {}
                Val::Obj(o) if !o.is_empty() => self.fill_absent(at, x)?,
                _ => self.fill_leaf(at, x.clone())?,
            }
            at.pop();
        }
        Ok(())
    }

    /// Write a default at `p` when it may fill it: nothing (or null) is there, no derivation
    /// writes it, and nothing on the way is a value of another kind (fill-absent never
    /// replaces a value to make room).
    pub(super) fn fill_leaf(&mut self, p: &[Seg], v: Val) -> Result<(), MutationError> {
        if self.cm.produced_above(p).is_some() {
            return Ok(());
        }
        let mut cur = Some(&self.st.base);
        for s in p {
            cur = match (cur, s) {
                (None | Some(Val::Null), _) => break,
                (Some(Val::Obj(m)), Seg::Field(k)) => m.get(k),
                (Some(Val::Arr(a)), Seg::Index(i)) => a.get(*i),
                _ => return Ok(()),
            };
        }
        if matches!(cur, None | Some(Val::Null)) {
            self.write_base(p, v)?;
        }
        Ok(())
    }
}
