//! SpecEvolution application (section D of the reference facts): keyed upserts/removes,
//! wholesale fields, the targeted schema/view/constants tiers, and the strand check.

use serde_json::{json, Value};
use valem_core::expr::path::Address;
use valem_core::spec::evolve::{apply, strand_check, EvolveError, Incompatibility};
use valem_core::spec::{parse_evolution, parse_spec, ModelSpec};
use valem_engine::testrun::run_tests;
use valem_engine::validate::validate;
use valem_engine::Timestamp;
use valem_engine::{EngineLimits, Model};

const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

fn spec(j: Value) -> ModelSpec {
    parse_spec(&j).unwrap()
}

fn evolve(s: &ModelSpec, e: Value) -> Result<ModelSpec, EvolveError> {
    apply(s, &parse_evolution(&e).unwrap())
}

fn ok(s: &ModelSpec, e: Value) -> ModelSpec {
    evolve(s, e).unwrap()
}

fn fails(s: &ModelSpec, e: Value) -> String {
    evolve(s, e).unwrap_err().0
}

fn base() -> ModelSpec {
    spec(json!({
        "id": "shop",
        "version": "1.0.0",
        "template": {"ref": "acme/base"},
        "lineage": [{"ref": "acme/base", "version": "1.0.0"}],
        "schema": {
            "type": "object",
            "$defs": {
                "Money": {"type": "number", "minimum": 0},
                "Unused": {"type": "string"}
            },
            "properties": {
                "price": {"$ref": "#/$defs/Money"},
                "qty": {"type": "integer"},
                "name": {"type": "string"},
                "total": {"type": "number", "readOnly": true},
                "items": {"type": "array", "items": {"type": "object", "properties": {
                    "sku": {"type": "string"}
                }}}
            },
            "required": ["name"]
        },
        "constants": {"rate": 0.2, "cap": 100, "rateLimit": 5},
        "library": "( $money := function($n) { $round($n, 2) }; [\"money\"] )",
        "defaultValues": [{"path": "$", "expr": "{ \"qty\": 1 }"}],
        "derivations": [
            {"path": "$.a", "expr": "1"},
            {"path": "$.b", "expr": "2"},
            {"path": "$.c", "expr": "3"}
        ],
        "metaDerivations": [
            {"path": "$.qty", "property": "readOnly", "expr": "false"},
            {"path": "$.name", "property": "relevant", "expr": "true"}
        ],
        "constraints": [
            {"id": "c1", "expr": "qty > 0", "message": "m1", "policy": "flag"},
            {"id": "c2", "expr": "qty < $const.cap", "message": "m2", "policy": "rollback"}
        ],
        "effects": [
            {"id": "e1", "executor": "caller", "trigger": "qty > 1", "emit": "big",
             "payload": {"r": "$const.rate * 2"}}
        ],
        "tests": [{"given": {"$.qty": 2}, "expect": {"$.a": 1}}],
        "viewDefinition": {
            "defaultView": "main",
            "views": [
                {"id": "main", "components": [
                    {"id": "g", "type": "group", "components": [
                        {"id": "x", "type": "textField", "bind": "$.name"},
                        {"id": "y", "type": "numericField", "bind": "$.qty"}
                    ]},
                    {"id": "z", "type": "label", "text": "Total"}
                ]},
                {"id": "other", "components": []}
            ]
        }
    }))
}

fn paths(s: &ModelSpec) -> Vec<(&str, &str)> {
    s.derivations.iter().map(|d| (&*d.path, &*d.expr)).collect()
}

fn ids(components: &Value) -> Vec<String> {
    components
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

// ── Keyed lists ──────────────────────────────────────────────────────────────────────────────

#[test]
fn upsert_replaces_in_place_and_appends_new_keys_in_order() {
    let s = ok(
        &base(),
        json!({"upsertDerivations": [
            {"path": "$.z", "expr": "26"},
            {"path": "$.b", "expr": "20"},
            {"path": "$.y", "expr": "25"}
        ]}),
    );
    assert_eq!(
        paths(&s),
        [
            ("$.a", "1"),
            ("$.b", "20"),
            ("$.c", "3"),
            ("$.z", "26"),
            ("$.y", "25")
        ]
    );
}

#[test]
fn duplicate_upsert_keys_last_wins() {
    let s = ok(
        &base(),
        json!({"upsertDerivations": [
            {"path": "$.n", "expr": "first"},
            {"path": "$.a", "expr": "10"},
            {"path": "$.n", "expr": "last"},
            {"path": "$.a", "expr": "11"}
        ]}),
    );
    assert_eq!(
        paths(&s),
        [("$.a", "11"), ("$.b", "2"), ("$.c", "3"), ("$.n", "last")]
    );
}

#[test]
fn removing_absent_keys_is_ignored_and_present_ones_go() {
    let s = ok(
        &base(),
        json!({
            "removeDerivations": ["$.b", "$.nothing"],
            "removeConstraints": ["c1", "ghost"],
            "removeEffects": ["e1", "ghost"],
            "removeDefaultValues": ["$", "$.ghost"],
            "removeMetaDerivations": ["$.ghost#relevant"]
        }),
    );
    assert_eq!(paths(&s), [("$.a", "1"), ("$.c", "3")]);
    assert_eq!(s.constraints.len(), 1);
    assert_eq!(s.constraints[0].id, "c2");
    assert!(s.effects.is_empty());
    assert!(s.default_values.is_empty());
    assert_eq!(s.meta_derivations.len(), 2);
}

#[test]
fn remove_and_upsert_of_one_key_re_adds_it_at_the_end() {
    let s = ok(
        &base(),
        json!({"removeDerivations": ["$.a"], "upsertDerivations": [{"path": "$.a", "expr": "9"}]}),
    );
    assert_eq!(paths(&s), [("$.b", "2"), ("$.c", "3"), ("$.a", "9")]);
}

#[test]
fn paths_match_in_canonical_form() {
    let s = spec(json!({"id": "m", "schema": {},
        "derivations": [{"path": "$.items[*].x", "expr": "1"}, {"path": "$['b']", "expr": "2"}],
        "defaultValues": [{"path": "$.items[*]", "expr": "{}"}]}));
    let s = ok(
        &s,
        json!({
            "upsertDerivations": [{"path": "$.items.*.x", "expr": "10"}, {"path": "$.b", "expr": "20"}],
            "removeDefaultValues": ["$.items.*"]
        }),
    );
    assert_eq!(paths(&s), [("$.items.*.x", "10"), ("$.b", "20")]);
    assert!(s.default_values.is_empty());
}

#[test]
fn constraints_and_effects_are_keyed_by_id() {
    let s = ok(
        &base(),
        json!({
            "upsertConstraints": [
                {"id": "c3", "expr": "true", "message": "m3", "policy": "flag"},
                {"id": "c1", "expr": "qty >= 0", "message": "m1'", "policy": "rollback"}
            ],
            "upsertEffects": [{"id": "e1", "executor": "caller", "trigger": "qty > 5", "emit": "bigger"}]
        }),
    );
    let c: Vec<(&str, &str)> = s
        .constraints
        .iter()
        .map(|c| (c.id.as_str(), c.expr.as_str()))
        .collect();
    assert_eq!(
        c,
        [
            ("c1", "qty >= 0"),
            ("c2", "qty < $const.cap"),
            ("c3", "true")
        ]
    );
    assert_eq!(s.effects.len(), 1);
    assert_eq!(s.effects[0].trigger, "qty > 5");
    assert_eq!(s.effects[0].emit.as_deref(), Some("bigger"));
}

#[test]
fn meta_keys_use_the_lowercased_enum_name_and_accept_either_spelling() {
    // Upsert keyed by path#read_only replaces the camelCase `readOnly` entry in place.
    let s = ok(
        &base(),
        json!({"upsertMetaDerivations": [
            {"path": "$.qty", "property": "readOnly", "expr": "true"},
            {"path": "$.qty", "property": "minimum", "expr": "1"}
        ]}),
    );
    let m: Vec<(&str, &str, &str)> = s
        .meta_derivations
        .iter()
        .map(|m| (m.path.as_str(), m.property.as_str(), m.expr.as_str()))
        .collect();
    assert_eq!(
        m,
        [
            ("$.qty", "readOnly", "true"),
            ("$.name", "relevant", "true"),
            ("$.qty", "minimum", "1")
        ]
    );
    for key in ["$.qty#read_only", "$.qty#readOnly"] {
        let s = ok(&base(), json!({"removeMetaDerivations": [key]}));
        assert_eq!(s.meta_derivations.len(), 1, "{key}");
        assert_eq!(s.meta_derivations[0].property, "relevant");
    }
    // Two meta properties on one path are distinct keys.
    let s = spec(json!({"id": "m", "schema": {}, "metaDerivations": [
        {"path": "$.s", "property": "minLength", "expr": "1"},
        {"path": "$.s", "property": "maxLength", "expr": "9"}
    ]}));
    let s = ok(&s, json!({"removeMetaDerivations": ["$.s#min_length"]}));
    assert_eq!(s.meta_derivations.len(), 1);
    assert_eq!(s.meta_derivations[0].property, "maxLength");
    assert!(
        fails(&base(), json!({"removeMetaDerivations": ["$.qty"]})).contains("<path>#<property>")
    );
}

// ── Wholesale fields ─────────────────────────────────────────────────────────────────────────

#[test]
fn wholesale_fields_replace_and_absent_fields_keep() {
    let b = base();
    let s = ok(&b, json!({}));
    assert_eq!(s, b);
    let s = ok(
        &b,
        json!({
            "newVersion": "2.0.0",
            "newSchema": {"type": "object"},
            "newViewDefinition": {"views": [{"id": "v", "components": []}]},
            "newConstants": {"k": 1},
            "newTests": [{"given": {}, "expect": {"$.a": 1}}, {"given": {}, "expect": {"$.b": 2}}]
        }),
    );
    assert_eq!(s.version.as_deref(), Some("2.0.0"));
    assert_eq!(s.schema, json!({"type": "object"}));
    assert_eq!(s.view_definition.as_ref().unwrap()["views"][0]["id"], "v");
    assert_eq!(Value::Object(s.constants.clone()), json!({"k": 1}));
    assert_eq!(s.tests.len(), 2);
    // Template and lineage are carried over; everything not mentioned is kept.
    assert_eq!(s.template, b.template);
    assert_eq!(s.lineage, b.lineage);
    assert_eq!(s.derivations, b.derivations);
    assert_eq!(s.library, b.library);
}

#[test]
fn version_is_not_bumped_automatically() {
    let s = ok(
        &base(),
        json!({"upsertDerivations": [{"path": "$.d", "expr": "4"}]}),
    );
    assert_eq!(s.version.as_deref(), Some("1.0.0"));
}

#[test]
fn new_tests_empty_clears() {
    let s = ok(&base(), json!({"newTests": []}));
    assert!(s.tests.is_empty());
    let s = ok(&base(), json!({"newConstants": {}}));
    assert!(s.constants.is_empty());
}

#[test]
fn new_library_null_drops_absent_keeps_value_replaces() {
    let b = base();
    assert!(ok(&b, json!({"newLibrary": null})).library.is_none());
    assert_eq!(ok(&b, json!({})).library, b.library);
    let s = ok(
        &b,
        json!({"newLibrary": {"define": "( $twice := function($n) { $n * 2 }; [\"twice\"] )"}}),
    );
    let layers = s.library_layers();
    assert_eq!(layers.len(), 1);
    assert!(layers[0].define.contains("$twice"));
}

#[test]
fn new_library_replaces_only_the_own_layer() {
    let s = spec(json!({"id": "m", "schema": {}, "library": {"layers": [
        {"define": "inherited", "origin": "acme/base"},
        {"define": "own"}
    ]}}));
    let evolved = ok(&s, json!({"newLibrary": "mine"}));
    let defines: Vec<String> = evolved
        .library_layers()
        .into_iter()
        .map(|l| l.define)
        .collect();
    assert_eq!(defines, ["inherited", "mine"]);
    let dropped = ok(&s, json!({"newLibrary": null}));
    let defines: Vec<String> = dropped
        .library_layers()
        .into_iter()
        .map(|l| l.define)
        .collect();
    assert_eq!(defines, ["inherited"]);
}

// ── Mutual exclusion ─────────────────────────────────────────────────────────────────────────

#[test]
fn wholesale_and_targeted_fields_are_mutually_exclusive() {
    let cases = [
        (
            json!({"newSchema": {}, "upsertSchemaDefs": {"A": {}}}),
            "newSchema",
            "upsertSchemaDefs",
        ),
        (
            json!({"newSchema": {}, "removeSchemaDefs": ["A"]}),
            "newSchema",
            "removeSchemaDefs",
        ),
        (
            json!({"newSchema": {}, "upsertSchemaNodes": [{"path": "$.a", "schema": {}}]}),
            "newSchema",
            "upsertSchemaNodes",
        ),
        (
            json!({"newSchema": {}, "removeSchemaNodes": ["$.a"]}),
            "newSchema",
            "removeSchemaNodes",
        ),
        (
            json!({"newViewDefinition": {}, "newDefaultView": "v"}),
            "newViewDefinition",
            "newDefaultView",
        ),
        (
            json!({"newViewDefinition": {}, "upsertViews": [{"id": "v"}]}),
            "newViewDefinition",
            "upsertViews",
        ),
        (
            json!({"newViewDefinition": {}, "removeViews": ["v"]}),
            "newViewDefinition",
            "removeViews",
        ),
        (
            json!({"newViewDefinition": {}, "upsertComponents": [{"viewId": "v", "component": {"id": "c"}}]}),
            "newViewDefinition",
            "upsertComponents",
        ),
        (
            json!({"newViewDefinition": {}, "removeComponents": [{"viewId": "v", "componentId": "c"}]}),
            "newViewDefinition",
            "removeComponents",
        ),
        (
            json!({"newConstants": {}, "upsertConstants": {"k": 1}}),
            "newConstants",
            "upsertConstants",
        ),
        (
            json!({"newConstants": {}, "removeConstants": ["k"]}),
            "newConstants",
            "removeConstants",
        ),
    ];
    for (evo, whole, part) in cases {
        let m = fails(&base(), evo.clone());
        assert!(m.contains(whole) && m.contains(part), "{evo}: {m}");
    }
    // Different sections combine freely; an explicit null wholesale field counts as absent.
    ok(
        &base(),
        json!({"newSchema": {"type": "object"}, "upsertConstants": {"k": 1}, "newDefaultView": "other"}),
    );
    ok(
        &base(),
        json!({"newSchema": null, "upsertSchemaNodes": [{"path": "$.n", "schema": {"type": "number"}}]}),
    );
}

// ── Schema tiers ─────────────────────────────────────────────────────────────────────────────

#[test]
fn schema_defs_upsert_and_remove() {
    let s = ok(
        &base(),
        json!({"upsertSchemaDefs": {"Money": {"type": "number", "minimum": 1}, "Code": {"type": "string"}},
               "removeSchemaDefs": ["Unused", "NeverThere"]}),
    );
    assert_eq!(
        s.schema["$defs"],
        json!({"Money": {"type": "number", "minimum": 1}, "Code": {"type": "string"}})
    );
}

#[test]
fn remove_schema_defs_is_blocked_while_referenced_then_allowed() {
    let m = fails(&base(), json!({"removeSchemaDefs": ["Money"]}));
    assert!(m.contains("Money"), "{m}");
    assert!(m.contains("#/properties/price"), "{m}");
    // A ref from inside another definition counts too.
    let m = fails(
        &base(),
        json!({"upsertSchemaDefs": {"Line": {"type": "object", "properties": {"amt": {"$ref": "#/$defs/Money"}}}},
               "upsertSchemaNodes": [{"path": "$.price", "schema": {"type": "number"}}],
               "removeSchemaDefs": ["Money"]}),
    );
    assert!(m.contains("#/$defs/Line/properties/amt"), "{m}");
    // Once the node is inlined (node upserts run before def removals) the removal succeeds.
    let s = ok(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.price", "schema": {"type": "number", "minimum": 0}}],
               "removeSchemaDefs": ["Money"]}),
    );
    assert!(s.schema["$defs"].get("Money").is_none());
    assert_eq!(
        s.schema["properties"]["price"],
        json!({"type": "number", "minimum": 0})
    );
    // Likewise when the referencing node is removed in the same evolution.
    let s = ok(
        &base(),
        json!({"removeSchemaNodes": ["$.price"], "removeSchemaDefs": ["Money"]}),
    );
    assert!(s.schema["properties"].get("price").is_none());
}

#[test]
fn schema_node_upsert_creates_intermediates_and_edits_required() {
    let s = ok(
        &base(),
        json!({"upsertSchemaNodes": [
            {"path": "$.order.customer.email", "schema": {"type": "string"}, "required": true},
            {"path": "$.lines[*].qty", "schema": {"type": "integer"}, "required": true},
            {"path": "$.qty", "schema": {"type": "integer", "minimum": 1}, "required": true},
            {"path": "$.name", "schema": {"type": "string", "minLength": 1}, "required": false}
        ]}),
    );
    let p = &s.schema["properties"];
    assert_eq!(
        p["order"],
        json!({"type": "object", "properties": {"customer": {"type": "object", "properties": {
            "email": {"type": "string"}}, "required": ["email"]}}})
    );
    assert_eq!(
        p["lines"],
        json!({"type": "array", "items": {"type": "object", "properties": {
            "qty": {"type": "integer"}}, "required": ["qty"]}})
    );
    assert_eq!(p["qty"], json!({"type": "integer", "minimum": 1}));
    assert_eq!(s.schema["required"], json!(["qty"]));
    // Existing intermediates are kept; `required` absent leaves the list alone.
    let s = ok(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.items[*].price", "schema": {"type": "number"}}]}),
    );
    assert_eq!(
        s.schema["properties"]["items"],
        json!({"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "price": {"type": "number"}}}})
    );
    assert_eq!(s.schema["required"], json!(["name"]));
    // Array element node replaced via [*].
    let s = ok(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.items[*]", "schema": {"type": "string"}}]}),
    );
    assert_eq!(
        s.schema["properties"]["items"]["items"],
        json!({"type": "string"})
    );
}

#[test]
fn schema_node_paths_are_checked() {
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.price.cents", "schema": {"type": "integer"}}]}),
    );
    assert!(
        m.contains("$ref") && m.contains("#/$defs/Money") && m.contains("`$.price`"),
        "{m}"
    );
    let m = fails(&base(), json!({"removeSchemaNodes": ["$.price.cents"]}));
    assert!(m.contains("$ref"), "{m}");
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$", "schema": {}}]}),
    );
    assert!(m.contains("root") && m.contains("newSchema"), "{m}");
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.items.*.sku", "schema": {}}]}),
    );
    assert!(m.contains("$.items[*].sku"), "{m}");
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.items[0].sku", "schema": {}}]}),
    );
    assert!(m.contains("[*]"), "{m}");
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.name.first", "schema": {}}]}),
    );
    assert!(m.contains("string"), "{m}");
    let m = fails(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.x", "schema": 3}]}),
    );
    assert!(m.contains("schema object"), "{m}");
    // Replacing the $ref node itself (not traversing it) is allowed.
    let s = ok(
        &base(),
        json!({"upsertSchemaNodes": [{"path": "$.price", "schema": {"type": "integer"}}]}),
    );
    assert_eq!(s.schema["properties"]["price"], json!({"type": "integer"}));
}

#[test]
fn schema_node_remove_drops_required_and_absent_is_an_error() {
    let s = ok(
        &base(),
        json!({"removeSchemaNodes": ["$.name", "$.items[*].sku"]}),
    );
    assert!(s.schema["properties"].get("name").is_none());
    assert_eq!(s.schema["required"], json!([]));
    assert_eq!(
        s.schema["properties"]["items"]["items"]["properties"],
        json!({})
    );
    let s = ok(&base(), json!({"removeSchemaNodes": ["$.items[*]"]}));
    assert!(s.schema["properties"]["items"].get("items").is_none());
    for absent in ["$.ghost", "$.ghost.deeper", "$.items[*].ghost"] {
        let m = fails(&base(), json!({"removeSchemaNodes": [absent]}));
        assert!(m.contains(absent) && m.contains("absent"), "{m}");
    }
}

#[test]
fn schema_tiers_apply_in_order_defs_upsert_node_removes_node_upserts_defs_removes() {
    // The node remove runs before the node upsert, so a remove+upsert of one path re-creates it.
    let s = ok(
        &base(),
        json!({"removeSchemaNodes": ["$.qty"],
               "upsertSchemaNodes": [{"path": "$.qty", "schema": {"$ref": "#/$defs/Count"}}],
               "upsertSchemaDefs": {"Count": {"type": "integer"}}}),
    );
    assert_eq!(
        s.schema["properties"]["qty"],
        json!({"$ref": "#/$defs/Count"})
    );
    let report = validate(&s, &EngineLimits::default());
    assert!(report.valid, "{:?}", report.errors);
}

// ── View tiers ───────────────────────────────────────────────────────────────────────────────

fn main_view(s: &ModelSpec) -> &Value {
    &s.view_definition.as_ref().unwrap()["views"][0]
}

#[test]
fn view_upsert_remove_and_default() {
    let s = ok(
        &base(),
        json!({"upsertViews": [{"id": "other", "label": "Other", "components": []}, {"id": "third", "components": []}],
               "removeViews": ["ghost"],
               "newDefaultView": "third"}),
    );
    let vd = s.view_definition.as_ref().unwrap();
    assert_eq!(ids(&vd["views"]), ["main", "other", "third"]);
    assert_eq!(vd["views"][1]["label"], "Other");
    assert_eq!(vd["defaultView"], "third");
    let s = ok(&base(), json!({"removeViews": ["other"]}));
    assert_eq!(ids(&s.view_definition.unwrap()["views"]), ["main"]);
    assert!(fails(&base(), json!({"upsertViews": [{"label": "no id"}]})).contains("id"));
    // A model without a view gets one.
    let bare = spec(json!({"id": "m", "schema": {}}));
    let s = ok(
        &bare,
        json!({"upsertViews": [{"id": "v", "components": []}]}),
    );
    assert_eq!(ids(&s.view_definition.unwrap()["views"]), ["v"]);
}

#[test]
fn component_splices() {
    let b = base();
    // Under a parent, before a sibling.
    let s = ok(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "g", "beforeId": "y",
                                     "component": {"id": "n", "type": "label"}}]}),
    );
    assert_eq!(
        ids(&main_view(&s)["components"][0]["components"]),
        ["x", "n", "y"]
    );
    // Under a parent, appended.
    let s = ok(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "g", "component": {"id": "n"}}]}),
    );
    assert_eq!(
        ids(&main_view(&s)["components"][0]["components"]),
        ["x", "y", "n"]
    );
    // At the root, before a sibling; and appended.
    let s = ok(
        &b,
        json!({"upsertComponents": [
            {"viewId": "main", "beforeId": "g", "component": {"id": "first"}},
            {"viewId": "main", "component": {"id": "last"}}
        ]}),
    );
    assert_eq!(
        ids(&main_view(&s)["components"]),
        ["first", "g", "z", "last"]
    );
    // Replace in place (a nested one), keeping the position.
    let s = ok(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "component": {"id": "x", "type": "textArea", "bind": "$.name"}}]}),
    );
    let g = &main_view(&s)["components"][0]["components"];
    assert_eq!(ids(g), ["x", "y"]);
    assert_eq!(g[0]["type"], "textArea");
    // Move: an existing id with a parentId leaves its old place.
    let s = ok(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "g", "beforeId": "x", "component": {"id": "z", "type": "label"}}]}),
    );
    assert_eq!(ids(&main_view(&s)["components"]), ["g"]);
    assert_eq!(
        ids(&main_view(&s)["components"][0]["components"]),
        ["z", "x", "y"]
    );
    // A parent that has no children yet gets a components list.
    let s = ok(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "z", "component": {"id": "k"}}]}),
    );
    assert_eq!(ids(&main_view(&s)["components"][1]["components"]), ["k"]);
}

#[test]
fn component_removal_is_tree_wide() {
    let s = ok(
        &base(),
        json!({"removeComponents": [{"viewId": "main", "componentId": "y"}, {"viewId": "main", "componentId": "z"}]}),
    );
    assert_eq!(ids(&main_view(&s)["components"]), ["g"]);
    assert_eq!(ids(&main_view(&s)["components"][0]["components"]), ["x"]);
    let s = ok(
        &base(),
        json!({"removeComponents": [{"viewId": "main", "componentId": "g"}]}),
    );
    assert_eq!(ids(&main_view(&s)["components"]), ["z"]);
}

#[test]
fn component_errors_name_what_is_missing() {
    let b = base();
    let m = fails(
        &b,
        json!({"upsertComponents": [{"viewId": "ghost", "component": {"id": "n"}}]}),
    );
    assert!(m.contains("ghost") && m.contains("main"), "{m}");
    let m = fails(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "nope", "component": {"id": "n"}}]}),
    );
    assert!(m.contains("parentId `nope`"), "{m}");
    let m = fails(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "beforeId": "x", "component": {"id": "n"}}]}),
    );
    assert!(m.contains("beforeId `x`") && m.contains("view root"), "{m}");
    let m = fails(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "parentId": "x", "component": {"id": "g"}}]}),
    );
    assert!(m.contains("own subtree"), "{m}");
    let m = fails(
        &b,
        json!({"upsertComponents": [{"viewId": "main", "component": {"type": "label"}}]}),
    );
    assert!(m.contains("id"), "{m}");
    let m = fails(
        &b,
        json!({"removeComponents": [{"viewId": "ghost", "componentId": "x"}]}),
    );
    assert!(m.contains("ghost"), "{m}");
    let m = fails(
        &b,
        json!({"removeComponents": [{"viewId": "main", "componentId": "nope"}]}),
    );
    assert!(m.contains("nope") && m.contains("absent"), "{m}");
}

// ── Constants tiers ──────────────────────────────────────────────────────────────────────────

#[test]
fn constants_upsert_keeps_order_and_remove_unreferenced() {
    let s = ok(
        &base(),
        json!({"upsertConstants": {"cap": 200, "fresh": "x"}, "removeConstants": ["rateLimit", "ghost"]}),
    );
    assert_eq!(
        Value::Object(s.constants),
        json!({"rate": 0.2, "cap": 200, "fresh": "x"})
    );
}

#[test]
fn remove_constants_is_blocked_by_a_reference_naming_the_places() {
    let m = fails(&base(), json!({"removeConstants": ["cap"]}));
    assert!(m.contains("constraints[1] (c2)"), "{m}");
    let m = fails(&base(), json!({"removeConstants": ["rate"]}));
    assert!(m.contains("effects[0] (e1).payload.r"), "{m}");
    // `$const.rateLimit` is not a reference to `rate`: only whole names count.
    let s = spec(
        json!({"id": "m", "schema": {}, "constants": {"rate": 1, "rateLimit": 2},
        "derivations": [{"path": "$.x", "expr": "$const.rateLimit"}],
        "viewDefinition": {"views": [{"id": "v", "components": [{"id": "t", "type": "label", "text": "$string($const.\"odd\")"}]}]},
        "library": "( $f := function() { $const.lib }; [\"f\"] )"}),
    );
    let s2 = ok(&s, json!({"removeConstants": ["rate"]}));
    assert!(!s2.constants.contains_key("rate"));
    let m = fails(&s, json!({"removeConstants": ["odd"]}));
    assert!(
        m.contains("viewDefinition.views[0].components[0].text"),
        "{m}"
    );
    let m = fails(&s, json!({"removeConstants": ["lib"]}));
    assert!(m.contains("library.define"), "{m}");
    let m = fails(&s, json!({"removeConstants": ["rateLimit"]}));
    assert!(m.contains("derivations[0] ($.x)"), "{m}");
    // Dropping the reader in the same evolution unblocks the removal.
    let s3 = ok(
        &s,
        json!({"removeDerivations": ["$.x"], "removeConstants": ["rateLimit"]}),
    );
    assert!(!s3.constants.contains_key("rateLimit"));
}

// ── Strand check ─────────────────────────────────────────────────────────────────────────────

#[test]
fn strand_check_reports_each_stranded_value_by_address() {
    let schema = json!({"type": "object", "$defs": {"Qty": {"type": "integer", "minimum": 1}},
        "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"qty": {"$ref": "#/$defs/Qty"}}}},
            "code": {"type": "string"},
            "m": {"type": "object", "properties": {"0": {"type": "string"}}},
            "total": {"type": "number", "readOnly": true}
        },
        "required": ["mustHave"]});
    let doc = json!({"items": [{"qty": 1}, {"qty": 2}, {"qty": "three"}, {"qty": 0}],
        "code": 12, "m": {"0": false}, "total": 3});
    let found = strand_check(&schema, &doc);
    let paths: Vec<&str> = found.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(paths.len(), 4, "{found:?}");
    for p in ["$.items[2].qty", "$.items[3].qty", "$.code", "$.m['0']"] {
        assert!(paths.contains(&p), "{p} in {found:?}");
    }
    let three = found.iter().find(|i| i.path == "$.items[2].qty").unwrap();
    assert!(three.message.contains("integer"), "{}", three.message);
    // Every address is canonical.
    for i in &found {
        assert_eq!(Address::parse(&i.path).unwrap().to_string(), i.path);
    }
    // A document the schema accepts has no incompatibilities (missing required fields and
    // read-only values strand nothing).
    assert_eq!(
        strand_check(&schema, &json!({"items": [{"qty": 4}], "total": 1})),
        Vec::<Incompatibility>::new()
    );
}

#[test]
fn strand_check_after_a_retyping_evolution() {
    let b = base();
    let s = ok(
        &b,
        json!({"upsertSchemaNodes": [{"path": "$.qty", "schema": {"type": "string"}}]}),
    );
    let found = strand_check(&s.schema, &json!({"qty": 3, "name": "n"}));
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].path, "$.qty");
    assert!(strand_check(&b.schema, &json!({"qty": 3, "name": "n"})).is_empty());
}

// ── A realistic evolution of a bundled example ───────────────────────────────────────────────

#[test]
fn evolving_the_order_invoice_example_validates_and_runs() {
    let text = valem_core::examples::get("order-invoice").unwrap();
    let b = valem_core::spec::parse_spec_text(text).unwrap();
    let limits = EngineLimits::default();
    assert!(validate(&b, &limits).valid);
    let evo = json!({
        "newVersion": "1.1.0",
        "upsertSchemaDefs": {"LineItem": {
            "type": "object",
            "properties": {
                "sku": {"type": "string"}, "description": {"type": "string"},
                "qty": {"type": "integer", "minimum": 1}, "unitPrice": {"type": "number", "minimum": 0},
                "discountPercent": {"type": "number", "minimum": 0, "maximum": 100},
                "discountReason": {"type": "string"}, "taxable": {"type": "boolean"},
                "weightKg": {"type": "number", "minimum": 0},
                "lineNet": {"type": "number", "readOnly": true}, "lineTax": {"type": "number", "readOnly": true}
            },
            "required": ["sku"]
        }},
        "upsertSchemaNodes": [
            {"path": "$.totalWeight", "schema": {"type": "number", "readOnly": true}},
            {"path": "$.customerRef", "schema": {"type": "string"}, "required": false}
        ],
        "upsertConstants": {"heavyParcelKg": 30},
        "upsertDerivations": [
            {"path": "$.totalWeight", "expr": "$sum(items.(qty * (weightKg ? weightKg : 0)))"}
        ],
        "upsertConstraints": [
            {"id": "line-discount-cap", "path": "$.items[*]", "expr": "discountPercent <= 50",
             "message": "A line discount above 50% needs a credit note instead", "policy": "rollback"},
            {"id": "parcel-weight", "expr": "totalWeight <= $const.heavyParcelKg",
             "message": "Heavy parcels ship as freight", "policy": "flag"}
        ],
        "removeConstraints": ["priced-lines"],
        "removeConstants": ["maxLineDiscountPercent"],
        "upsertComponents": [
            {"viewId": "invoice", "beforeId": "totals",
             "component": {"id": "weightLabel", "type": "label", "label": "Weight (kg)", "bind": "$.totalWeight"}}
        ]
    });
    let s = evolve(&b, evo).unwrap();
    let report = validate(&s, &limits);
    assert!(report.valid, "{:?}", report.errors);
    assert_eq!(s.version.as_deref(), Some("1.1.0"));
    assert!(!s.constants.contains_key("maxLineDiscountPercent"));
    assert_eq!(s.constraints.len(), b.constraints.len());
    assert_eq!(s.constraints.last().unwrap().id, "parcel-weight");
    let comps = &s.view_definition.as_ref().unwrap()["views"][0]["components"];
    let order = ids(comps);
    let w = order.iter().position(|c| c == "weightLabel").unwrap();
    assert_eq!(order[w + 1], "totals");

    let (mut model, _) = Model::create(&s, NOW, limits.clone()).unwrap();
    let r = model
        .mutate(
            &[(
                "$.items".to_string(),
                json!([{"sku": "A", "qty": 2, "unitPrice": 10, "discountPercent": 0, "taxable": true, "weightKg": 20}]),
            )],
            NOW,
        )
        .unwrap();
    let segs = Address::parse("$.totalWeight").unwrap().concrete().unwrap();
    assert_eq!(model.get(&segs, NOW), Some(json!(40)));
    let flagged = serde_json::to_value(&r).unwrap().to_string();
    assert!(flagged.contains("parcel-weight"), "{flagged}");
    // The example's embedded tests still pass on the evolved spec.
    let tests = run_tests(&s, None, NOW, &limits).unwrap();
    assert_eq!(tests.failed, 0, "{:?}", tests.results);
    // The old instance state is compatible with the new schema, a retyped one is not.
    let doc = json!({"items": [{"sku": "A", "qty": 2, "weightKg": 1.5}]});
    assert!(strand_check(&s.schema, &doc).is_empty());
    let retyped = ok(
        &s,
        json!({"upsertSchemaDefs": {"LineItem": {"type": "object", "properties": {"qty": {"type": "string"}}}}}),
    );
    let found = strand_check(&retyped.schema, &doc);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].path, "$.items[0].qty");
}

#[test]
fn every_bundled_example_survives_an_empty_and_a_version_evolution() {
    let limits = EngineLimits::default();
    for (name, text) in valem_core::examples::ALL {
        let b = valem_core::spec::parse_spec_text(text).unwrap();
        assert_eq!(ok(&b, json!({})), b, "{name}");
        let s = ok(&b, json!({"newVersion": "9.9.9"}));
        assert!(validate(&s, &limits).valid, "{name}");
        Model::create(&s, NOW, limits.clone()).unwrap();
    }
}
