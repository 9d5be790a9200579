//! The structural dependency graph of a compiled model, as `GET /models/{id}/graph` serves it:
//! a pure function of the compiled spec (no state, no clock).
//!
//! - nodes: `BASE` (every path an expression reads that no derivation writes), `DERIVED`,
//!   `META` (`$.path#prop`), `CONSTRAINT` (`$constraint:id`), `EFFECT` (`$effect:id`), each
//!   computed node with its expression, the paths it reads and where in the spec it comes from;
//! - edges `{from, to}`: a read of a base path, or a compile-time dependency on a derivation;
//! - levels: the reference's depth (a node without inputs is 0, otherwise one more than its
//!   deepest input), so a derivation of base fields is at level 1.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde_json::{json, Value as Json};

use super::compile::{CompiledModel, NodeKind};

/// The graph of `cm` as JSON `{modelId, version, nodes, edges, levels}`.
pub fn project(cm: &CompiledModel) -> Json {
    let derived: HashSet<&str> = cm
        .nodes
        .iter()
        .filter(|n| matches!(n.kind, NodeKind::Derivation { .. }))
        .map(|n| &**cm.key(n.id))
        .collect();
    // Predecessors of each computed node: derivations it depends on, then base paths it reads.
    let mut preds: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); cm.nodes.len()];
    for (p, ds) in cm.dependents.iter().enumerate() {
        for &d in ds {
            if let Some(set) = preds.get_mut(d as usize) {
                set.insert(p);
            }
        }
    }
    let mut base: Vec<&str> = Vec::new();
    let mut base_seen: HashSet<&str> = HashSet::new();
    let mut edges: Vec<Json> = Vec::new();
    for n in &cm.nodes {
        for ip in cm.trace_table.input_paths(n.id) {
            if derived.contains(ip) {
                continue;
            }
            if base_seen.insert(ip) {
                base.push(ip);
            }
            edges.push(json!({"from": ip, "to": &**cm.key(n.id)}));
        }
    }
    for (d, ps) in preds.iter().enumerate() {
        for &p in ps {
            edges.push(json!({"from": &**cm.key(p as u32), "to": &**cm.key(d as u32)}));
        }
    }

    // Depth in compile-level order: a dependency always has a lower compile level.
    let mut order: Vec<usize> = (0..cm.nodes.len()).collect();
    order.sort_by_key(|&i| cm.nodes[i].level);
    let mut depth: HashMap<usize, usize> = HashMap::new();
    for &i in &order {
        let from_nodes = preds[i].iter().filter_map(|p| depth.get(p)).max().copied();
        let reads_base = cm
            .trace_table
            .input_paths(i as u32)
            .any(|ip| !derived.contains(ip));
        let d = match (from_nodes, reads_base) {
            (Some(m), _) => m + 1,
            (None, true) => 1,
            (None, false) => 0,
        };
        depth.insert(i, d);
    }

    let mut nodes: Vec<Json> = base
        .iter()
        .map(|b| json!({"id": b, "kind": "BASE", "level": 0}))
        .collect();
    let mut levels: Vec<Vec<&str>> = vec![base.clone()];
    for (i, n) in cm.nodes.iter().enumerate() {
        let level = depth.get(&i).copied().unwrap_or(0);
        let mut node = json!({
            "id": &**cm.key(n.id),
            "kind": kind_name(&n.kind),
            "expression": &**cm.expression(n.id),
            "inputPaths": cm.trace_table.input_paths(n.id).collect::<Vec<_>>(),
            "level": level,
            "location": n.location.to_string(),
        });
        match &n.kind {
            NodeKind::Derivation { lazy } => node["lazy"] = json!(lazy),
            NodeKind::Constraint { policy, .. } => node["policy"] = json!(policy.as_str()),
            NodeKind::Meta(_) | NodeKind::Effect { .. } => {}
        }
        nodes.push(node);
        if levels.len() <= level {
            levels.resize(level + 1, Vec::new());
        }
        levels[level].push(cm.key(n.id));
    }
    levels.retain(|l| !l.is_empty());
    json!({
        "modelId": cm.spec.id,
        "version": cm.spec.version_or_default(),
        "nodes": nodes,
        "edges": edges,
        "levels": levels,
    })
}

fn kind_name(k: &NodeKind) -> &'static str {
    match k {
        NodeKind::Derivation { .. } => "DERIVED",
        NodeKind::Meta(_) => "META",
        NodeKind::Constraint { .. } => "CONSTRAINT",
        NodeKind::Effect { .. } => "EFFECT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use valem_core::spec::parse_spec;

    #[test]
    fn nodes_edges_and_levels() {
        let spec = parse_spec(&json!({
            "id": "g",
            "schema": {"type": "object", "properties": {"price": {"type": "number"}, "qty": {"type": "number"}}},
            "derivations": [
                {"path": "$.total", "expr": "price * qty"},
                {"path": "$.withTax", "expr": "total * 1.2"}
            ],
            "constraints": [{"id": "cap", "expr": "withTax < 1000", "message": "too much", "policy": "flag"}]
        }))
        .unwrap();
        let cm = crate::compile::compile(Arc::new(spec), &crate::EngineLimits::default()).unwrap();
        let g = project(&cm);
        let kind_of = |id: &str| {
            g["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["id"] == id)
                .map(|n| (n["kind"].clone(), n["level"].clone()))
        };
        assert_eq!(kind_of("$.price"), Some((json!("BASE"), json!(0))));
        assert_eq!(kind_of("$.total"), Some((json!("DERIVED"), json!(1))));
        assert_eq!(kind_of("$.withTax"), Some((json!("DERIVED"), json!(2))));
        assert_eq!(
            kind_of("$constraint:cap"),
            Some((json!("CONSTRAINT"), json!(3)))
        );
        let edges = g["edges"].as_array().unwrap();
        assert!(edges.contains(&json!({"from": "$.price", "to": "$.total"})));
        assert!(edges.contains(&json!({"from": "$.total", "to": "$.withTax"})));
        assert!(edges.contains(&json!({"from": "$.withTax", "to": "$constraint:cap"})));
        assert!(!edges
            .iter()
            .any(|e| e["from"] == "$.total" && e["to"] == "$.total"));
        assert_eq!(
            g["levels"],
            json!([
                ["$.price", "$.qty"],
                ["$.total"],
                ["$.withTax"],
                ["$constraint:cap"]
            ])
        );
    }
}
