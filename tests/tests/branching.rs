//! Templates and lineage within one daemon, against the real binary over REST: a branch of a
//! bundled example inherits its derivations, tests and library, overrides one library function,
//! adds its own derivation and test, and passes every test; `GET /models/{id}/lineage` shows
//! the pinned chain; a template that is missing, the model itself, or a chain that would loop
//! is refused with 422.

use serde_json::{json, Value};
use valem_tests::{repo_root, Daemon, Http};

fn example(name: &str) -> Value {
    let text = std::fs::read_to_string(repo_root().join("examples").join(format!("{name}.json")))
        .expect("the bundled example");
    serde_json::from_str(&text).expect("JSON")
}

fn items() -> Value {
    json!([
        {"sku": "CBL-USB-C", "description": "USB-C cable, 2 m", "qty": 3, "unitPrice": 19.99, "discountPercent": 0, "taxable": true},
        {"sku": "DOCK-4K", "description": "4K docking station", "qty": 1, "unitPrice": 250, "discountPercent": 10, "discountReason": "launch promotion", "taxable": false}
    ])
}

#[test]
fn a_branch_of_a_bundled_example_inherits_overrides_and_passes_its_tests() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    let base = example("order-invoice");
    let base_tests = base["tests"].as_array().unwrap().len();
    let base_derivations = base["derivations"].as_array().unwrap().len();
    assert_eq!(http.post_json("/models", &base).status, 201);

    // The branch: money never goes negative (a credit-note guard), plus a refund preview that
    // shows the override at work.
    let branch = json!({
        "id": "order-invoice-credit",
        "template": {"ref": "order-invoice"},
        "schema": {"properties": {"refundPreview": {"type": "number"}}},
        "library": "( $money := function($n) { $n < 0 ? 0 : $round($n, 2) }; [\"money\"] )",
        "derivations": [{"path": "$.refundPreview", "expr": "$money(0 - total)"}],
        "tests": [{"description": "the overridden money() floors a refund at zero",
                   "given": {"$.items": items()},
                   "expect": {"$.total": 302.27, "$.refundPreview": 0}}]
    });
    let r = http.post_json("/models", &branch);
    assert_eq!(r.status, 201, "{r:?}");

    let spec = http.get("/models/order-invoice-credit/spec").json();
    assert_eq!(
        spec["derivations"].as_array().unwrap().len(),
        base_derivations + 1,
        "inherited derivations plus the branch's own: {spec}"
    );
    let layers = spec["library"]["layers"]
        .as_array()
        .expect("library layers");
    assert_eq!(layers.len(), 2, "{spec}");
    assert_eq!(layers[0]["origin"], "order-invoice");
    assert_eq!(spec["tests"].as_array().unwrap().len(), base_tests + 1);
    assert_eq!(
        spec["schema"]["properties"]["refundPreview"]["type"],
        "number"
    );
    assert!(
        spec["schema"]["properties"]["items"].is_object(),
        "the template's schema is kept"
    );

    let lineage = http.get("/models/order-invoice-credit/lineage").json();
    assert_eq!(lineage[0]["ref"], "order-invoice", "{lineage}");
    assert!(lineage[0]["digest"]
        .as_str()
        .unwrap()
        .starts_with("blake3:"));
    assert_eq!(http.get("/models/order-invoice/lineage").json(), json!([]));

    // Every test passes: the template's (under the override) and the branch's own.
    let v = http.get("/models/order-invoice-credit/verification").json();
    assert_eq!(v["state"], "green", "{v}");
    assert_eq!(v["passedCount"], base_tests + 1, "{v}");
    assert_eq!(v["checkedCount"], base_tests + 1, "{v}");

    // The live model computes with the override; the template is unchanged by it.
    let m = http.post_json(
        "/models/order-invoice-credit/mutations",
        &json!({"$.items": items()}),
    );
    assert_eq!(m.status, 200, "{m:?}");
    let s = http.get("/models/order-invoice-credit/state").json();
    assert_eq!(
        (s["total"].clone(), s["refundPreview"].clone()),
        (json!(302.27), json!(0))
    );
    let base_spec = http.get("/models/order-invoice/spec").json();
    assert!(base_spec.get("lineage").is_none() || base_spec["lineage"] == json!([]));
}

/// Create an empty model `id`, branched from `template` when given.
fn post_model(http: &Http, id: &str, template: Option<&str>) -> valem_tests::Reply {
    let mut spec = json!({"id": id, "schema": {}});
    if let Some(t) = template {
        spec["template"] = json!({"ref": t});
    }
    http.post_json("/models", &spec)
}

#[test]
fn missing_self_and_cyclic_templates_are_refused() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    let missing = post_model(&http, "x", Some("nowhere"));
    assert_eq!(missing.status, 422, "{missing:?}");
    assert!(
        missing.text().contains("not a model of this daemon"),
        "{missing:?}"
    );
    let own = post_model(&http, "x", Some("x"));
    assert_eq!(own.status, 422, "{own:?}");
    assert!(own.text().contains("cyclic"), "{own:?}");

    // a ← b, then a recreated from b: its chain would be [b, a] — a cycle.
    assert_eq!(post_model(&http, "a", None).status, 201);
    assert_eq!(post_model(&http, "b", Some("a")).status, 201);
    assert_eq!(http.delete("/models/a").status, 200);
    let cyc = post_model(&http, "a", Some("b"));
    assert_eq!(cyc.status, 422, "{cyc:?}");
    assert!(cyc.text().contains("cyclic"), "{cyc:?}");
    // A three-level chain pins every ancestor, nearest first.
    assert_eq!(post_model(&http, "c", Some("b")).status, 201);
    let lineage = http.get("/models/c/lineage").json();
    let refs: Vec<&str> = lineage
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["ref"].as_str())
        .collect();
    assert_eq!(refs, vec!["b", "a"]);
}
