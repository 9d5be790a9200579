//! A node's reads (packed into its draft and the trace table), and the library layers bound
//! into the interpreter's environment.

use super::*;

pub(super) fn merge_reads(into: &mut Reads, r: &Reads) {
    into.whole_doc |= r.whole_doc;
    into.dynamic |= r.dynamic;
    into.paths.extend(r.paths.iter().cloned());
}

#[allow(clippy::too_many_arguments)]
pub(super) fn draft_empty(
    drafts: &mut Drafts,
    kind: NodeKind,
    key: arcstr::ArcStr,
    targets: impl Into<smallvec::SmallVec<[Address; 1]>>,
    expr: ExprDraft,
    input: Input,
    location: Location,
    aggregate: Option<Aggregate>,
) -> NodeDraft {
    drafts.begin();
    // A derivation's one target is kept in place (a list of it was an allocation a node).
    let targets: smallvec::SmallVec<[Address; 1]> = targets.into();
    let concrete = match kind {
        NodeKind::Derivation { .. } => targets.first().map_or(Concrete::None, Concrete::of),
        _ => Concrete::None,
    };
    let wild = targets.first().map_or(0, Address::wildcard_count) as u32;
    // A derivation's pattern is kept beside the nodes while the model compiles (see
    // `Drafts::targets`): most are concrete, and keep no pattern once compiled.
    let (targets, target) = match kind {
        NodeKind::Derivation { .. } => (Box::default(), targets.into_iter().next()),
        _ => (targets.into_vec().into_boxed_slice(), None),
    };
    NodeDraft {
        node: Node {
            id: 0,
            kind,
            wild,
            concrete,
            cell: NO_CELL,
            targets,
            expr: NodeExpr::new(expr.compiled),
            input,
            projection: None,
            projection_deferred: false,
            whole_doc: false,
            uses_parent: false,
            level: 0,
            location,
            jit: crate::jit::JitCell::default(),
            runs: std::cell::Cell::new(0),
        },
        extra: DraftExtra {
            program: None,
            aggregate,
            key,
            text: expr.text,
            target,
        },
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn draft(
    drafts: &mut Drafts,
    kind: NodeKind,
    key: arcstr::ArcStr,
    targets: Vec<Address>,
    expr: Rc<Compiled>,
    input: Input,
    parent: Option<&Address>,
    location: Location,
) -> NodeDraft {
    let reads = deps::reads(expr.ast());
    let aggregate = aggregate_of(expr.ast());
    let mut d = draft_empty(
        drafts,
        kind,
        key,
        targets,
        ExprDraft::new(expr),
        input,
        location,
        aggregate,
    );
    add_reads(&mut d, drafts, &reads, parent, None);
    d
}

/// Add an expression's reads to a node. Document reads go to the projection and the reader
/// index — under `doc_base` when the input is an element rather than the root; `$parent` reads
/// are indexed under the parent pattern with bound wildcards.
pub(super) fn add_reads(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    reads: &Reads,
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    let paths = reads.paths.iter().map(|r| (&r.root, &r.fields[..]));
    add_read_paths(d, drafts, reads.whole_doc, paths, parent, doc_base);
}

/// [`add_reads`] for reads given one by one (in the order a [`Reads`] set iterates them).
pub(super) fn add_read_paths<'r>(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    whole_doc: bool,
    reads: impl Iterator<Item = (&'r Root, &'r [Key])>,
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    add_whole_doc(d, drafts, whole_doc, doc_base);
    for (root, fields) in reads {
        add_read(d, drafts, root, fields, parent, doc_base);
    }
    end_reads(d);
}

/// The first of a node's reads: its whole input, when it reads that.
pub(super) fn add_whole_doc(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    whole_doc: bool,
    doc_base: Option<&Address>,
) {
    if !whole_doc {
        return;
    }
    match doc_base {
        None => {
            d.node.whole_doc = true;
            d.node.projection = Some(Projection::whole());
            drafts.trace_table.push_path_with(|t| t.push('$'));
        }
        Some(b) => drafts.add_read(tseg_iter(b)),
    }
}

/// One read of a node (see [`add_reads`]).
pub(super) fn add_read(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    root: &Root,
    fields: &[Key],
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    match (root, doc_base) {
        (Root::Doc, None) => {
            if !d.node.projection_deferred {
                d.node.projection.get_or_insert_default().add(fields);
            }
            drafts.add_read(field_tsegs(fields));
        }
        (Root::Doc, Some(b)) => drafts.add_read(tseg_iter(b).chain(field_tsegs(fields))),
        (Root::Parent, _) => {
            d.node.uses_parent = true;
            // `$parent` where nothing binds it reads nothing.
            if let Some(p) = parent {
                drafts.add_read(tseg_iter(p).chain(field_tsegs(fields)));
            }
        }
    }
}

/// After a node's last read.
pub(super) fn end_reads(d: &mut NodeDraft) {
    if let Some(p) = &mut d.node.projection {
        p.shrink();
    }
}

/// Evaluate the library layers in order and bind their exports into `env`.
pub fn bind_library(
    spec: &ModelSpec,
    env: &mut Env,
    limits: &Limits,
) -> Result<Vec<LibraryExport>, Vec<CompileError>> {
    let mut exports: Vec<LibraryExport> = Vec::new();
    let mut errors = Vec::new();
    for (li, layer) in spec.library_layers().iter().enumerate() {
        let loc = if spec.library_layers().len() == 1 {
            "library.define".to_string()
        } else {
            format!("library.layers[{li}].define")
        };
        match eval_library_layer(&layer.define, env, limits) {
            Ok(bound) => {
                for (name, value) in bound {
                    let is_function = value.is_function();
                    let arity = match &value {
                        JValue::Lambda(l) => Some(l.params.len()),
                        _ => None,
                    };
                    let signature = layer
                        .signatures
                        .get(&name)
                        .and_then(|s| s.as_str())
                        .map(str::to_string);
                    exports.retain(|e| e.name != name);
                    exports.push(LibraryExport {
                        name: name.clone(),
                        is_function,
                        layer: li,
                        signature,
                        arity,
                    });
                    env.vars.push((Rc::from(name.as_str()), value));
                }
            }
            Err(message) => errors.push(CompileError {
                location: loc,
                message,
            }),
        }
    }
    if errors.is_empty() {
        Ok(exports)
    } else {
        Err(errors)
    }
}

/// Evaluate one library definition: a block whose last expression is the array of exported
/// names. Returns each export with its value (a function, or a value computed once).
pub fn eval_library_layer(
    define: &str,
    env: &Env,
    limits: &Limits,
) -> Result<Vec<(String, JValue)>, String> {
    let compiled = Compiled::compile(define, limits).map_err(|e| {
        let at = e.at();
        format!("library definition does not compile{at}: {}", e.message)
    })?;
    let names_val = compiled
        .eval(&JValue::Null, env, limits)
        .map_err(|e| format!("library definition failed to evaluate: {}", e.message))?;
    let names: Vec<String> = match names_val {
        Some(JValue::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or("library definition must return an array of export names (strings)")?,
        Some(JValue::String(s)) => vec![s.to_string()],
        _ => return Err("library definition must return the array of export names, e.g. `( $f := function($x) { $x }; [\"f\"] )`".into()),
    };
    if names.is_empty() {
        return Err("library definition exports no names".into());
    }
    // Re-evaluate with the export list replaced by an object of the exported bindings, so the
    // closures keep their shared scope (mutual recursion between exports works).
    let AstNode::Block(items) = compiled.evaluated_ast() else {
        return Err("library definition must be a block `( $name := ...; [\"name\"] )`".into());
    };
    let mut items = items.clone();
    items.pop();
    items.push(AstNode::Object(
        names
            .iter()
            .map(|n| (AstNode::String(n.clone()), AstNode::Variable(n.clone())))
            .collect(),
    ));
    let block = AstNode::Block(items);
    let obj = valem_core::expr::eval_tree(&block, &JValue::Null, env, limits)
        .map_err(|e| format!("library definition failed to evaluate: {}", e.message))?;
    let mut out = Vec::new();
    for n in names {
        let v = obj.get(&n).cloned().unwrap_or(JValue::Undefined);
        if v.is_undefined() {
            return Err(format!("library exports `{n}` but never binds `${n}`"));
        }
        out.push((n, v));
    }
    Ok(out)
}
