//! Evaluating one node: the arithmetic tier when it answers, else an aggregate or the JSONata
//! interpreter over the node's projected input.

use super::*;

/// The projected input of a document expression: only the paths it reads.
pub(super) fn project_root(m: Merged<'_>, p: &Projection) -> JValue {
    if p.whole {
        return m.to_jvalue();
    }
    if !m.root_is_obj() {
        return project(m.doc, p);
    }
    let mut o = IndexMap::with_capacity(p.children.len());
    for (k, sub) in &p.children {
        if let Some(x) = m.root_get(k) {
            o.insert(k.to_string(), project(x, sub));
        }
    }
    JValue::object(o)
}

/// The projected input: only the paths the expression reads.
pub(super) fn project(v: &Val, p: &Projection) -> JValue {
    if p.whole {
        return to_jvalue(v);
    }
    match v {
        Val::Obj(m) => {
            let mut o = IndexMap::with_capacity(p.children.len());
            for (k, sub) in &p.children {
                if let Some(x) = m.get(k) {
                    o.insert(k.to_string(), project(x, sub));
                }
            }
            JValue::object(o)
        }
        Val::Arr(a) => valem_core::expr::jarray(a.iter(), |x| project(x, p)),
        other => to_jvalue(other),
    }
}

impl<'a> Cycle<'a> {
    // --- evaluation -------------------------------------------------------------------------

    pub(super) fn whole_doc(&mut self) -> JValue {
        if let Some((v, j)) = &self.whole_cache {
            if *v == self.version {
                return j.clone();
            }
        }
        let j = self.st.merged().to_jvalue();
        self.whole_cache = Some((self.version, j.clone()));
        j
    }

    pub(super) fn input(&mut self, node: &Node, inst: &[Seg]) -> JValue {
        match node.input {
            Input::Doc if node.whole_doc => self.whole_doc(),
            Input::Doc if node.projection_deferred => {
                let p = self.cm.fallback_projection(node);
                project_root(self.st.merged(), &p)
            }
            Input::Doc => project_root(self.st.merged(), node.projection()),
            Input::Element => {
                let el = element_prefix(&node.targets[0], inst);
                self.st.merged().jvalue_at(el)
            }
            Input::Field => self.st.merged().jvalue_at(inst),
        }
    }

    /// The arithmetic tier's answer (`Some(Ok(None))`: undefined): compiled code once it is
    /// ready, the IR's interpreter until then or when an input is undefined, JSONata's type
    /// error for one operation over a null, boolean or string input; `None` when the node is
    /// not arithmetic, an input is something else or a value is not finite (the JSONata
    /// interpreter answers).
    pub(super) fn evaluate_lowered(&mut self, node: &Node, inst: &[Seg]) -> Option<jit::Answer> {
        let (nj, code) = node.jit(self.limits.jit)?;
        if let Some((answer, hit)) = self.early.take() {
            // Answered ahead, on another thread (see `Cycle::answer_ahead`); the run is counted.
            self.jit_hit = hit;
            return Some(answer);
        }
        // Only derivations are lowered: their input is the document. `$parent` as `evaluate`
        // binds it: the target's JSON parent.
        let parent = (node.uses_parent && !inst.is_empty()).then(|| &inst[..inst.len() - 1]);
        let read = jit::read_slots(&nj.inputs, self.st.merged(), parent, &mut self.jit_slots);
        let (answer, hit) = jit::answer(nj, code, read, &self.jit_slots)?;
        self.jit_hit = hit;
        Some(answer)
    }

    /// A meta-derivation's, constraint's or effect trigger's value. These are never lowered
    /// (only derivations are, and they go through `derive_instance`).
    #[inline]
    pub(super) fn evaluate(
        &mut self,
        node: &Node,
        inst: &[Seg],
    ) -> Result<Option<JValue>, ExprError> {
        debug_assert!(!node.jit.lowered(), "only derivations are lowered");
        self.jit_hit = false;
        let out = self.evaluate_slow(node, inst);
        self.spend(WORK_PER_CHECK);
        out
    }

    /// [`Cycle::evaluate`] past the compiled code: an aggregate, or the interpreter.
    pub(super) fn evaluate_slow(
        &mut self,
        node: &Node,
        inst: &[Seg],
    ) -> Result<Option<JValue>, ExprError> {
        if let (Some(agg), Input::Doc) = (self.cm.aggregate(node), node.input) {
            if node.keeps_by_delta(agg) {
                if let Some(v) = self.delta_aggregate(agg) {
                    return Ok(v);
                }
            }
            if let Some(v) = aggregate(self.st.merged(), agg) {
                return Ok(v);
            }
        }
        let expr = self.cm.interpreted(node)?;
        let input = self.input(node, inst);
        if node.uses_parent && !inst.is_empty() {
            // Derivations: the target's JSON parent. Meta and constraints: the `[*]` element.
            let at = match node.kind {
                NodeKind::Derivation { .. } => &inst[..inst.len() - 1],
                _ => element_prefix(&node.targets[0], inst),
            };
            let parent = self.st.merged().jvalue_at(at);
            let env = self.env().with("parent", parent);
            expr.eval(&input, &env, &self.limits.expr)
        } else {
            expr.eval(&input, self.env(), &self.limits.expr)
        }
    }
}
