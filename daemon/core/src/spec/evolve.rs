//! Applying a SpecEvolution to a ModelSpec: keyed upserts/removes, wholesale replacements and the
//! targeted schema/view/constants diffs; and the strand check of a base document against a new
//! schema. Pure: no runtime state, no compile (the service validates and compiles the result).
//! `backfill` and `expectedVersion` belong to the service and are not read here.

use indexmap::IndexMap;
use serde_json::{Map, Value as Json};

use super::{
    ComponentRemove, ComponentUpsert, LibrarySpec, MetaProp, ModelSpec, SchemaNodeUpsert,
    SpecEvolution,
};
use crate::expr::path::{render, Address, PathSeg};
use crate::value::{intern, Seg};

/// Why an evolution cannot be applied (the reference's IllegalArgumentException: a 400).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct EvolveError(pub String);

/// A base-document value the evolved schema no longer accepts.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Incompatibility {
    pub path: String,
    pub message: String,
}

/// Most incompatibilities one strand check reports (the rest are summarised in a last entry).
pub const MAX_INCOMPATIBILITIES: usize = 1000;

fn err<T>(message: impl Into<String>) -> Result<T, EvolveError> {
    Err(EvolveError(message.into()))
}

/// Build the evolved spec (carrying template/lineage). Does not validate or compile it.
pub fn apply(spec: &ModelSpec, evo: &SpecEvolution) -> Result<ModelSpec, EvolveError> {
    check_exclusive(evo)?;
    let mut out = spec.clone();
    if let Some(v) = &evo.new_version {
        out.version = Some(v.clone());
    }
    out.schema = evolve_schema(&spec.schema, evo)?;
    out.view_definition = evolve_view(spec.view_definition.as_ref(), evo)?;

    out.derivations = keyed(
        &spec.derivations,
        &evo.upsert_derivations,
        &evo.remove_derivations,
        |d| canonical_address(&d.path),
        |k| Ok(canonical_address(k)),
    )?;
    out.meta_derivations = keyed(
        &spec.meta_derivations,
        &evo.upsert_meta_derivations,
        &evo.remove_meta_derivations,
        |m| meta_key(&m.path, &m.property),
        parse_meta_key,
    )?;
    out.constraints = keyed(
        &spec.constraints,
        &evo.upsert_constraints,
        &evo.remove_constraints,
        |c| c.id.clone(),
        |k| Ok(k.to_string()),
    )?;
    out.effects = keyed(
        &spec.effects,
        &evo.upsert_effects,
        &evo.remove_effects,
        |e| e.id.clone(),
        |k| Ok(k.to_string()),
    )?;
    out.default_values = keyed(
        &spec.default_values,
        &evo.upsert_default_values,
        &evo.remove_default_values,
        |d| canonical_address(&d.path),
        |k| Ok(canonical_address(k)),
    )?;

    if let Some(new) = &evo.new_library {
        out.library = replace_own_layer(spec.library.as_ref(), new.as_ref());
    }
    if let Some(tests) = &evo.new_tests {
        out.tests = tests.clone();
    }
    // Last: the reference scan for removed constants runs over the evolved expressions, so an
    // evolution may drop a constant together with the rules that read it.
    out.constants = evolve_constants(&out, evo)?;
    Ok(out)
}

// ── Mutual exclusion ─────────────────────────────────────────────────────────────────────────

fn check_exclusive(evo: &SpecEvolution) -> Result<(), EvolveError> {
    let schema_diffs = [
        (
            "upsertSchemaDefs",
            evo.upsert_schema_defs
                .as_ref()
                .is_some_and(|m| !m.is_empty()),
        ),
        ("removeSchemaDefs", !evo.remove_schema_defs.is_empty()),
        ("upsertSchemaNodes", !evo.upsert_schema_nodes.is_empty()),
        ("removeSchemaNodes", !evo.remove_schema_nodes.is_empty()),
    ];
    let view_diffs = [
        ("newDefaultView", evo.new_default_view.is_some()),
        ("upsertViews", !evo.upsert_views.is_empty()),
        ("removeViews", !evo.remove_views.is_empty()),
        ("upsertComponents", !evo.upsert_components.is_empty()),
        ("removeComponents", !evo.remove_components.is_empty()),
    ];
    let constant_diffs = [
        (
            "upsertConstants",
            evo.upsert_constants.as_ref().is_some_and(|m| !m.is_empty()),
        ),
        ("removeConstants", !evo.remove_constants.is_empty()),
    ];
    for (whole, present, diffs, what) in [
        (
            "newSchema",
            evo.new_schema.is_some(),
            &schema_diffs[..],
            "the whole schema",
        ),
        (
            "newViewDefinition",
            evo.new_view_definition.is_some(),
            &view_diffs[..],
            "the whole view definition",
        ),
        (
            "newConstants",
            evo.new_constants.is_some(),
            &constant_diffs[..],
            "every constant",
        ),
    ] {
        if !present {
            continue;
        }
        let used: Vec<&str> = diffs.iter().filter(|d| d.1).map(|d| d.0).collect();
        if !used.is_empty() {
            return err(format!(
                "{whole} cannot be combined with {} in one evolution: {whole} replaces {what}, the others edit parts of it; send either {whole} or the targeted fields",
                used.join(", ")
            ));
        }
    }
    Ok(())
}

// ── Keyed lists ──────────────────────────────────────────────────────────────────────────────

/// An address in canonical form, so legacy spellings of the same address match (`$.items.0.x`
/// and `$.items[0].x`); text that is no address at all is compared as written.
pub fn canonical_address(text: &str) -> String {
    match Address::parse(text) {
        Ok(a) => a.to_string(),
        Err(e) => e.rewrite.unwrap_or_else(|| text.trim().to_string()),
    }
}

/// The reference's meta-derivation key: `<canonical path>#<enum name lowercased>`
/// (`$.score#read_only`). An unknown property is kept as written.
pub fn meta_key(path: &str, property: &str) -> String {
    let prop = MetaProp::parse_any(property.trim())
        .map(|p| p.key_name().to_string())
        .unwrap_or_else(|| property.trim().to_string());
    format!("{}#{prop}", canonical_address(path))
}

/// A `removeMetaDerivations` entry in either spelling (`$.f#read_only` or `$.f#readOnly`).
fn parse_meta_key(key: &str) -> Result<String, EvolveError> {
    match key.rsplit_once('#') {
        Some((path, prop)) if !path.trim().is_empty() && !prop.trim().is_empty() => {
            Ok(meta_key(path, prop))
        }
        _ => err(format!(
            "removeMetaDerivations entry `{key}` is not a meta key: write `<path>#<property>`, e.g. `$.email#relevant` or `$.score#read_only`"
        )),
    }
}

/// Removes, then in-place replacement, then new keys appended in first-mention order; a key
/// mentioned twice in `upserts` takes the last entry. Removing an absent key does nothing.
fn keyed<T: Clone>(
    existing: &[T],
    upserts: &[T],
    removes: &[String],
    key: impl Fn(&T) -> String,
    remove_key: impl Fn(&str) -> Result<String, EvolveError>,
) -> Result<Vec<T>, EvolveError> {
    let removed = removes
        .iter()
        .map(|r| remove_key(r))
        .collect::<Result<std::collections::HashSet<String>, _>>()?;
    let mut pending: IndexMap<String, &T> = IndexMap::new();
    for u in upserts {
        pending.insert(key(u), u);
    }
    let mut out = Vec::with_capacity(existing.len() + pending.len());
    for item in existing {
        let k = key(item);
        if removed.contains(&k) {
            continue;
        }
        match pending.shift_remove(&k) {
            Some(replacement) => out.push(replacement.clone()),
            None => out.push(item.clone()),
        }
    }
    out.extend(pending.into_values().cloned());
    Ok(out)
}

// ── Library ──────────────────────────────────────────────────────────────────────────────────

/// Replace (or with `None` drop) the model's own layer, keeping layers inherited from a parent
/// (those carrying an `origin`).
fn replace_own_layer(
    current: Option<&LibrarySpec>,
    new: Option<&LibrarySpec>,
) -> Option<LibrarySpec> {
    let (inherited, description) = match current {
        Some(LibrarySpec::Layered {
            layers,
            description,
        }) => (
            layers
                .iter()
                .filter(|l| l.origin.is_some())
                .cloned()
                .collect::<Vec<_>>(),
            description.clone(),
        ),
        _ => (Vec::new(), None),
    };
    if inherited.is_empty() {
        return new.cloned();
    }
    let mut layers = inherited;
    if let Some(n) = new {
        layers.extend(n.layers());
    }
    Some(LibrarySpec::Layered {
        layers,
        description,
    })
}

// ── Constants ────────────────────────────────────────────────────────────────────────────────

fn evolve_constants(
    evolved: &ModelSpec,
    evo: &SpecEvolution,
) -> Result<Map<String, Json>, EvolveError> {
    if let Some(c) = &evo.new_constants {
        return Ok(c.clone());
    }
    let mut out = evolved.constants.clone();
    for name in &evo.remove_constants {
        let places = constant_references(evolved, name);
        if !places.is_empty() {
            return err(format!(
                "removeConstants cannot drop `{name}`: $const.{name} is still referenced at {} (textual scan; dynamic $const[...] access is not detected) — remove or rewrite those expressions in the same evolution",
                places.join(", ")
            ));
        }
        out.shift_remove(name);
    }
    if let Some(up) = &evo.upsert_constants {
        for (k, v) in up {
            out.insert(k.clone(), v.clone());
        }
    }
    Ok(out)
}

/// Whether `text` mentions `$const.<name>` (at an identifier boundary), `$const."<name>"` or
/// `` $const.`<name>` ``.
pub fn mentions_constant(text: &str, name: &str) -> bool {
    if text.contains(&format!("$const.\"{name}\"")) || text.contains(&format!("$const.`{name}`")) {
        return true;
    }
    let needle = format!("$const.{name}");
    let mut from = 0;
    while let Some(i) = text[from..].find(&needle) {
        let after = from + i + needle.len();
        match text[after..].chars().next() {
            Some(c) if c.is_alphanumeric() || c == '_' => from = after,
            _ => return true,
        }
    }
    false
}

/// Every place of the spec whose expression text mentions `$const.<name>`.
pub fn constant_references(spec: &ModelSpec, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |loc: String, text: &str| {
        if mentions_constant(text, name) {
            out.push(loc);
        }
    };
    for (i, d) in spec.derivations.iter().enumerate() {
        check(format!("derivations[{i}] ({})", d.path), &d.expr);
    }
    for (i, m) in spec.meta_derivations.iter().enumerate() {
        check(
            format!("metaDerivations[{i}] ({})", meta_key(&m.path, &m.property)),
            &m.expr,
        );
    }
    for (i, c) in spec.constraints.iter().enumerate() {
        check(format!("constraints[{i}] ({})", c.id), &c.expr);
    }
    for (i, d) in spec.default_values.iter().enumerate() {
        check(format!("defaultValues[{i}] ({})", d.path), &d.expr);
    }
    for (i, e) in spec.effects.iter().enumerate() {
        if let Ok(j) = serde_json::to_value(e) {
            each_string(&j, &format!("effects[{i}] ({})", e.id), &mut check);
        }
    }
    let layers = spec.library_layers();
    for (i, l) in layers.iter().enumerate() {
        let loc = if layers.len() == 1 {
            "library.define".to_string()
        } else {
            format!("library.layers[{i}].define")
        };
        check(loc, &l.define);
    }
    if let Some(v) = &spec.view_definition {
        each_string(v, "viewDefinition", &mut check);
    }
    out
}

/// Call `f` with every string inside `j` and its location.
fn each_string(j: &Json, loc: &str, f: &mut impl FnMut(String, &str)) {
    match j {
        Json::String(s) => f(loc.to_string(), s),
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                each_string(x, &format!("{loc}[{i}]"), f);
            }
        }
        Json::Object(m) => {
            for (k, x) in m {
                each_string(x, &format!("{loc}.{k}"), f);
            }
        }
        _ => {}
    }
}

// ── Schema ───────────────────────────────────────────────────────────────────────────────────

fn evolve_schema(base: &Json, evo: &SpecEvolution) -> Result<Json, EvolveError> {
    if let Some(s) = &evo.new_schema {
        return Ok(s.clone());
    }
    let upsert_defs = evo.upsert_schema_defs.as_ref().filter(|m| !m.is_empty());
    if upsert_defs.is_none()
        && evo.remove_schema_defs.is_empty()
        && evo.upsert_schema_nodes.is_empty()
        && evo.remove_schema_nodes.is_empty()
    {
        return Ok(base.clone());
    }
    let mut schema = match base {
        Json::Object(_) => base.clone(),
        _ => Json::Object(Map::new()),
    };
    // 1. Definition upserts.
    if let Some(defs) = upsert_defs {
        for (name, def) in defs {
            if !def.is_object() && !def.is_boolean() {
                return err(format!(
                    "upsertSchemaDefs[`{name}`] must be a schema object"
                ));
            }
        }
        let root = object_mut(&mut schema);
        let slot = root
            .entry("$defs")
            .or_insert_with(|| Json::Object(Map::new()));
        if !slot.is_object() {
            *slot = Json::Object(Map::new());
        }
        let map = object_mut(slot);
        for (name, def) in defs {
            map.insert(name.clone(), def.clone());
        }
    }
    // 2. Node removals.
    for path in &evo.remove_schema_nodes {
        remove_node(&mut schema, path)?;
    }
    // 3. Node upserts.
    for up in &evo.upsert_schema_nodes {
        upsert_node(&mut schema, up)?;
    }
    // 4. Definition removals, refused while the result still references them.
    if !evo.remove_schema_defs.is_empty() {
        if let Some(Json::Object(defs)) = object_mut(&mut schema).get_mut("$defs") {
            for name in &evo.remove_schema_defs {
                defs.shift_remove(name);
            }
        }
        let refs = ref_locations(&schema);
        for name in &evo.remove_schema_defs {
            if let Some(places) = refs.get(name.as_str()) {
                return err(format!(
                    "removeSchemaDefs cannot drop `{name}`: it is still referenced at {} — replace those $refs (upsertSchemaNodes) in the same evolution first",
                    places.join(", ")
                ));
            }
        }
    }
    Ok(schema)
}

fn object_mut(j: &mut Json) -> &mut Map<String, Json> {
    if !j.is_object() {
        *j = Json::Object(Map::new());
    }
    match j {
        Json::Object(m) => m,
        _ => unreachable!("made an object just above"),
    }
}

/// A schema-node data path: canonical, not the root, `[*]` for array elements.
fn node_path(text: &str, field: &str) -> Result<crate::expr::path::Segs, EvolveError> {
    let a = Address::parse(text).map_err(|e| EvolveError(format!("{field}: {}", e.message)))?;
    if a.is_root() {
        return err(format!(
            "{field} cannot target the root `$`; use newSchema to replace the whole schema"
        ));
    }
    if a.segs.iter().any(|s| matches!(s, PathSeg::Index(_))) {
        return err(format!(
            "{field} path `{text}` addresses one array element; schema nodes describe every element, write `[*]` (`{}`)",
            Address {
                segs: a
                    .segs
                    .iter()
                    .map(|s| match s {
                        PathSeg::Index(_) => PathSeg::Wild,
                        o => o.clone(),
                    })
                    .collect()
            }
        ));
    }
    Ok(a.segs)
}

fn escape_pointer(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

/// The schema pointer of the node describing `segs` (`/properties/a/items`).
fn schema_pointer(segs: &[PathSeg]) -> String {
    let mut p = String::new();
    for s in segs {
        match s {
            PathSeg::Field(k) => {
                p.push_str("/properties/");
                p.push_str(&escape_pointer(k));
            }
            PathSeg::Wild | PathSeg::Index(_) => p.push_str("/items"),
        }
    }
    p
}

fn data_path(segs: &[PathSeg]) -> String {
    Address { segs: segs.into() }.to_string()
}

/// Walk to the schema node owning the last segment of `segs` (creating missing intermediates
/// when `create`), refusing to cross a `$ref`. Returns that parent's pointer, or `None` when an
/// intermediate is absent and `create` is false.
fn parent_pointer(
    schema: &mut Json,
    segs: &[PathSeg],
    field: &str,
    create: bool,
) -> Result<Option<String>, EvolveError> {
    let full = data_path(segs);
    for i in 0..segs.len() {
        let here = schema_pointer(&segs[..i]);
        let node = schema
            .pointer(&here)
            .expect("each step's node exists: checked or created by the previous step");
        if let Some(r) = node.get("$ref") {
            let at = data_path(&segs[..i]);
            return err(format!(
                "{field} path `{full}` traverses a $ref ({}) at `{at}`: editing through it would change every usage of the definition — edit the definition with upsertSchemaDefs, or replace `{at}` with an inline schema first",
                r.as_str().unwrap_or("?")
            ));
        }
        if !node.is_object() {
            return err(format!(
                "{field} path `{full}`: the schema at `{}` is not a schema object",
                data_path(&segs[..i])
            ));
        }
        let seg = &segs[i];
        if create {
            // Adding below a node declared as another type would describe values it can't hold.
            let want = match seg {
                PathSeg::Field(_) => "object",
                _ => "array",
            };
            if let Some(types) = declared_types(node) {
                if !types.contains(&want) {
                    return err(format!(
                        "{field} path `{full}`: `{}` is declared as {}, so it cannot hold {}",
                        data_path(&segs[..i]),
                        types.join(" or "),
                        match seg {
                            PathSeg::Field(k) => format!("the property `{k}`"),
                            _ => "array elements".to_string(),
                        }
                    ));
                }
            }
        }
        if i + 1 == segs.len() {
            return Ok(Some(here));
        }
        if schema.pointer(&schema_pointer(&segs[..=i])).is_some() {
            continue;
        }
        if !create {
            return Ok(None);
        }
        let fresh = intermediate(&segs[i + 1]);
        let node = object_mut(
            schema
                .pointer_mut(&here)
                .expect("the node was read just above"),
        );
        match seg {
            PathSeg::Field(k) => {
                let props = node
                    .entry("properties")
                    .or_insert_with(|| Json::Object(Map::new()));
                if !props.is_object() {
                    return err(format!(
                        "{field} path `{full}`: `properties` of `{}` is not an object",
                        data_path(&segs[..i])
                    ));
                }
                object_mut(props).insert(k.to_string(), fresh);
            }
            _ => {
                if node.get("items").is_some_and(|x| !x.is_object()) {
                    return err(format!(
                        "{field} path `{full}`: `items` of `{}` is not a schema object",
                        data_path(&segs[..i])
                    ));
                }
                node.insert("items".into(), fresh);
            }
        }
    }
    Ok(None)
}

fn declared_types(node: &Json) -> Option<Vec<&str>> {
    match node.get("type")? {
        Json::String(s) => Some(vec![s.as_str()]),
        Json::Array(a) => Some(a.iter().filter_map(Json::as_str).collect()),
        _ => None,
    }
}

/// A created intermediate node: an array when the next step is `[*]`, else an object.
fn intermediate(next: &PathSeg) -> Json {
    match next {
        PathSeg::Field(_) => serde_json::json!({"type": "object", "properties": {}}),
        _ => serde_json::json!({"type": "array"}),
    }
}

fn upsert_node(schema: &mut Json, up: &SchemaNodeUpsert) -> Result<(), EvolveError> {
    const FIELD: &str = "upsertSchemaNodes";
    let segs = node_path(&up.path, FIELD)?;
    if !up.schema.is_object() {
        return err(format!(
            "{FIELD}[`{}`].schema must be a schema object",
            up.path
        ));
    }
    let parent = parent_pointer(schema, &segs, FIELD, true)?
        .expect("intermediates are created when missing");
    let node = object_mut(
        schema
            .pointer_mut(&parent)
            .expect("parent_pointer returns an existing node"),
    );
    match segs.last().expect("node_path refuses the root") {
        PathSeg::Field(k) => {
            let props = node
                .entry("properties")
                .or_insert_with(|| Json::Object(Map::new()));
            if !props.is_object() {
                return err(format!(
                    "{FIELD} path `{}`: the parent's `properties` is not an object",
                    up.path
                ));
            }
            object_mut(props).insert(k.to_string(), up.schema.clone());
            if let Some(req) = up.required {
                set_required(node, k, req);
            }
        }
        // `required` means nothing for array elements (as in the reference).
        _ => {
            node.insert("items".into(), up.schema.clone());
        }
    }
    Ok(())
}

fn set_required(parent: &mut Map<String, Json>, key: &str, required: bool) {
    let listed = |x: &Json| x.as_str() == Some(key);
    match parent.get_mut("required") {
        Some(Json::Array(list)) => {
            if required {
                if !list.iter().any(listed) {
                    list.push(Json::String(key.to_string()));
                }
            } else {
                list.retain(|x| !listed(x));
            }
        }
        _ if required => {
            parent.insert("required".into(), Json::Array(vec![key.into()]));
        }
        _ => {}
    }
}

fn remove_node(schema: &mut Json, path: &str) -> Result<(), EvolveError> {
    const FIELD: &str = "removeSchemaNodes";
    let segs = node_path(path, FIELD)?;
    let absent = || err(format!("{FIELD} path `{path}` is absent from the schema"));
    let Some(parent) = parent_pointer(schema, &segs, FIELD, false)? else {
        return absent();
    };
    let node = object_mut(
        schema
            .pointer_mut(&parent)
            .expect("parent_pointer returns an existing node"),
    );
    match segs.last().expect("node_path refuses the root") {
        PathSeg::Field(k) => {
            let removed = match node.get_mut("properties") {
                Some(Json::Object(props)) => props.shift_remove(&**k).is_some(),
                _ => false,
            };
            if !removed {
                return absent();
            }
            set_required(node, k, false);
        }
        _ => {
            if node.shift_remove("items").is_none() {
                return absent();
            }
        }
    }
    Ok(())
}

/// Every local `$ref` of `schema`: definition name → JSON pointers of the referencing nodes.
pub fn ref_locations(schema: &Json) -> IndexMap<String, Vec<String>> {
    fn walk(j: &Json, ptr: &str, out: &mut IndexMap<String, Vec<String>>, depth: usize) {
        if depth > 256 {
            return;
        }
        match j {
            Json::Object(m) => {
                if let Some(name) = m
                    .get("$ref")
                    .and_then(Json::as_str)
                    .and_then(|r| r.strip_prefix("#/$defs/"))
                {
                    let name = name.split('/').next().unwrap_or(name);
                    let name = name.replace("~1", "/").replace("~0", "~");
                    out.entry(name).or_default().push(format!("#{ptr}"));
                }
                for (k, x) in m {
                    walk(x, &format!("{ptr}/{}", escape_pointer(k)), out, depth + 1);
                }
            }
            Json::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, &format!("{ptr}/{i}"), out, depth + 1);
                }
            }
            _ => {}
        }
    }
    let mut out = IndexMap::new();
    walk(schema, "", &mut out, 0);
    out
}

// ── View ─────────────────────────────────────────────────────────────────────────────────────

fn evolve_view(base: Option<&Json>, evo: &SpecEvolution) -> Result<Option<Json>, EvolveError> {
    if let Some(v) = &evo.new_view_definition {
        return Ok(Some(v.clone()));
    }
    if evo.new_default_view.is_none()
        && evo.upsert_views.is_empty()
        && evo.remove_views.is_empty()
        && evo.upsert_components.is_empty()
        && evo.remove_components.is_empty()
    {
        return Ok(base.cloned());
    }
    let mut root = match base {
        Some(v @ Json::Object(_)) => v.clone(),
        _ => Json::Object(Map::new()),
    };
    {
        let root_map = object_mut(&mut root);
        let views = root_map
            .entry("views")
            .or_insert_with(|| Json::Array(Vec::new()));
        if !views.is_array() {
            *views = Json::Array(Vec::new());
        }
        let Json::Array(views) = views else {
            unreachable!("made an array just above")
        };
        // 1. View removals (absent ids are ignored).
        for id in &evo.remove_views {
            views.retain(|v| id_of(v).as_deref() != Some(id.as_str()));
        }
        // 2. View upserts: replace by id, else append.
        for v in &evo.upsert_views {
            let Some(id) = v.is_object().then(|| id_of(v)).flatten() else {
                return err("upsertViews entries must be view objects carrying an `id`");
            };
            match views
                .iter_mut()
                .find(|x| id_of(x).as_deref() == Some(id.as_str()))
            {
                Some(slot) => *slot = v.clone(),
                None => views.push(v.clone()),
            }
        }
        // 3. Component removals.
        for rm in &evo.remove_components {
            remove_component(views, rm)?;
        }
        // 4. Component upserts.
        for up in &evo.upsert_components {
            upsert_component(views, up)?;
        }
        // 5. Default view.
        if let Some(d) = &evo.new_default_view {
            root_map.insert("defaultView".into(), Json::String(d.clone()));
        }
    }
    Ok(Some(root))
}

fn id_of(j: &Json) -> Option<String> {
    match j.get("id")? {
        Json::String(s) => Some(s.clone()),
        Json::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn view_mut<'a>(views: &'a mut [Json], id: &str, field: &str) -> Result<&'a mut Json, EvolveError> {
    let known: Vec<String> = views.iter().filter_map(id_of).collect();
    match views.iter_mut().find(|v| id_of(v).as_deref() == Some(id)) {
        Some(v) => Ok(v),
        None => err(format!(
            "{field} targets view `{id}`, which does not exist (views: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        )),
    }
}

/// The `components` array of a view or component, created when `create`.
fn children_mut(holder: &mut Json, create: bool) -> Option<&mut Vec<Json>> {
    let m = holder.as_object_mut()?;
    if create && !m.get("components").is_some_and(Json::is_array) {
        m.insert("components".into(), Json::Array(Vec::new()));
    }
    m.get_mut("components")?.as_array_mut()
}

fn children(holder: &Json) -> &[Json] {
    holder
        .get("components")
        .and_then(Json::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Indices from a holder's `components` down to the component `id` (depth first).
fn locate(holder: &Json, id: &str) -> Option<Vec<usize>> {
    for (i, c) in children(holder).iter().enumerate() {
        if id_of(c).as_deref() == Some(id) {
            return Some(vec![i]);
        }
        if let Some(mut rest) = locate(c, id) {
            rest.insert(0, i);
            return Some(rest);
        }
    }
    None
}

/// The holder reached by following `steps` (each an index into the current `components`).
fn holder_at<'a>(mut holder: &'a mut Json, steps: &[usize]) -> Option<&'a mut Json> {
    for &i in steps {
        holder = children_mut(holder, false)?.get_mut(i)?;
    }
    Some(holder)
}

fn remove_component(views: &mut [Json], rm: &ComponentRemove) -> Result<(), EvolveError> {
    let view = view_mut(views, &rm.view_id, "removeComponents")?;
    let Some(steps) = locate(view, &rm.component_id) else {
        return err(format!(
            "removeComponents: component `{}` is absent from view `{}`",
            rm.component_id, rm.view_id
        ));
    };
    let (last, above) = steps.split_last().expect("locate returns a non-empty path");
    let holder = holder_at(view, above).expect("located just above");
    children_mut(holder, false)
        .expect("located just above")
        .remove(*last);
    Ok(())
}

fn upsert_component(views: &mut [Json], up: &ComponentUpsert) -> Result<(), EvolveError> {
    let Some(id) = up
        .component
        .is_object()
        .then(|| id_of(&up.component))
        .flatten()
    else {
        return err("upsertComponents: component must be an object carrying an `id`");
    };
    let view = view_mut(views, &up.view_id, "upsertComponents")?;
    let existing = locate(view, &id);
    if let Some(steps) = &existing {
        let (last, above) = steps.split_last().expect("locate returns a non-empty path");
        if up.parent_id.is_none() && up.before_id.is_none() {
            // Replace in place, keeping the position.
            let holder = holder_at(view, above).expect("located just above");
            children_mut(holder, false).expect("located just above")[*last] = up.component.clone();
            return Ok(());
        }
        if let Some(p) = &up.parent_id {
            let live = holder_at(view, steps).expect("located just above");
            if *p == id || locate(live, p).is_some() {
                return err(format!(
                    "upsertComponents cannot move `{id}` under `{p}`: the target is inside its own subtree"
                ));
            }
        }
        let holder = holder_at(view, above).expect("located just above");
        children_mut(holder, false)
            .expect("located just above")
            .remove(*last);
    }
    let target = match &up.parent_id {
        None => children_mut(view, true).expect("a view is an object"),
        Some(p) => {
            let Some(steps) = locate(view, p) else {
                return err(format!(
                    "upsertComponents: parentId `{p}` does not exist in view `{}`",
                    up.view_id
                ));
            };
            let parent = holder_at(view, &steps).expect("located just above");
            match children_mut(parent, true) {
                Some(c) => c,
                None => {
                    return err(format!(
                        "upsertComponents: parentId `{p}` is not a component object"
                    ))
                }
            }
        }
    };
    match &up.before_id {
        None => target.push(up.component.clone()),
        Some(b) => match target.iter().position(|c| id_of(c).as_deref() == Some(b)) {
            Some(i) => target.insert(i, up.component.clone()),
            None => {
                return err(format!(
                    "upsertComponents: beforeId `{b}` is not a child of {} in view `{}`",
                    up.parent_id
                        .as_ref()
                        .map_or("the view root".to_string(), |p| format!("`{p}`")),
                    up.view_id
                ))
            }
        },
    }
    Ok(())
}

// ── Strand check ─────────────────────────────────────────────────────────────────────────────

/// Values of `base` that `schema` rejects, with their canonical addresses. Like the reference's
/// SchemaStateChecker it judges existing values only: `required` (a missing field strands
/// nothing; `backfill` seeds it) and `readOnly` (a write gate) are not reported.
pub fn strand_check(schema: &Json, base: &Json) -> Vec<Incompatibility> {
    let validator = match jsonschema::validator_for(schema) {
        Ok(v) => v,
        Err(e) => {
            return vec![Incompatibility {
                path: "$".into(),
                message: format!("the new schema is not a valid JSON Schema: {e}"),
            }]
        }
    };
    let mut out = Vec::new();
    let mut more = 0usize;
    for e in validator.iter_errors(base) {
        let keyword = e.kind().keyword();
        if keyword == "required" || keyword == "readOnly" {
            continue;
        }
        if out.len() >= MAX_INCOMPATIBILITIES {
            more += 1;
            continue;
        }
        out.push(Incompatibility {
            path: pointer_address(base, &e.instance_path().to_string()),
            message: e.to_string(),
        });
    }
    if more > 0 {
        out.push(Incompatibility {
            path: "$".into(),
            message: format!("{more} more incompatibilities are not listed"),
        });
    }
    out
}

/// A JSON Pointer into `doc` as a canonical address; the document decides whether a numeric
/// token is an index or a member name.
fn pointer_address(doc: &Json, pointer: &str) -> String {
    let mut segs = Vec::new();
    let mut node = Some(doc);
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        let seg = match (node, token.parse::<usize>()) {
            (Some(Json::Array(_)), Ok(i)) => Seg::Index(i),
            _ => Seg::Field(intern(&token)),
        };
        node = match (&seg, node) {
            (Seg::Index(i), Some(Json::Array(a))) => a.get(*i),
            (Seg::Field(k), Some(Json::Object(m))) => m.get(&**k),
            _ => None,
        };
        segs.push(seg);
    }
    render(&segs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn constant_mentions_respect_name_boundaries_and_quoted_forms() {
        assert!(mentions_constant("$const.rate * 2", "rate"));
        assert!(mentions_constant("x + $const.rate", "rate"));
        assert!(!mentions_constant("$const.rateLimit", "rate"));
        assert!(!mentions_constant("$const.rate_2", "rate"));
        assert!(mentions_constant("$const.rateLimit + $const.rate", "rate"));
        assert!(mentions_constant("$const.\"odd-name\"", "odd-name"));
        assert!(mentions_constant("$const.`odd-name`", "odd-name"));
        assert!(!mentions_constant("$const[\"rate\"]", "rate"));
    }

    #[test]
    fn pointers_become_canonical_addresses_using_the_document() {
        let doc = json!({"items": [{"qty": 1}], "m": {"0": {"a b": 1}}});
        assert_eq!(pointer_address(&doc, ""), "$");
        assert_eq!(pointer_address(&doc, "/items/0/qty"), "$.items[0].qty");
        assert_eq!(pointer_address(&doc, "/m/0/a b"), "$.m['0']['a b']");
    }

    #[test]
    fn meta_keys_are_canonical() {
        assert_eq!(
            meta_key("$.items.*.x", "readOnly"),
            "$.items[*].x#read_only"
        );
        assert_eq!(meta_key("$.x", "multiple_of"), "$.x#multiple_of");
        assert_eq!(parse_meta_key("$.x#minLength").unwrap(), "$.x#min_length");
        assert_eq!(meta_key("$.x", "bogus"), "$.x#bogus");
    }
}
