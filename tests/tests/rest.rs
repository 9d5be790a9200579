//! End-to-end tests of the REST API of `valem serve`: the real binary on a loopback port, driven
//! over HTTP — every endpoint on success and on each of its failures, the JSON error bodies,
//! the limits, and the guard (API key, Origin, Host).

use serde_json::{json, Value};
use valem_tests::{raw_http, seg, Daemon, Http, Reply};

const JSON: (&str, &str) = ("Content-Type", "application/json");

fn demo_spec() -> Value {
    json!({
        "id": "demo",
        "schema": {"type": "object", "properties": {
            "price": {"type": "number", "minimum": 0},
            "qty": {"type": "number"},
            "note": {"type": "string"}
        }},
        "derivations": [{"path": "$.total", "expr": "price * qty"}],
        "constraints": [
            {"id": "cap", "expr": "total = null or total <= 1000", "message": "Total over 1000", "policy": "rollback"},
            {"id": "big", "expr": "total = null or total <= 100", "message": "Large order", "policy": "flag"}
        ],
        "tests": [
            {"description": "ten at three", "given": {"$.price": 10, "$.qty": 3}, "expect": {"$.total": 30}},
            {"description": "just runs", "given": {"$.price": 1}, "expect": {}}
        ],
        "viewDefinition": {"defaultView": "main", "views": [{"id": "main", "title": "Order", "components": [
            {"id": "priceField", "type": "numericField", "label": "Price", "bind": "$.price"},
            {"id": "totals", "type": "card", "components": [
                {"id": "totalLabel", "type": "label", "label": "Total", "bind": "$.total"}
            ]}
        ]}]}
    })
}

fn start(extra: &[&str]) -> (Daemon, Http) {
    let d = Daemon::start(extra);
    let h = Http::new(&d);
    (d, h)
}

fn create(h: &Http, spec: &Value) -> Reply {
    h.post_json("/models", spec)
}

fn mutate(h: &Http, id: &str, m: Value) -> Reply {
    h.post_json(&format!("/models/{id}/mutations"), &m)
}

fn assert_error(r: &Reply, status: u16, error: &str) -> Value {
    assert_eq!(r.status, status, "{r:?}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{r:?}"
    );
    let b = r.json();
    assert_eq!(b["error"], error, "{b}");
    b
}

#[test]
fn models_registry_create_list_info_delete() {
    let (_d, h) = start(&[]);
    assert_eq!(h.get("/models").json(), json!([]));

    let r = create(&h, &demo_spec());
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(r.header("location"), Some("/models/demo"));
    assert_eq!(r.json(), json!({"id": "demo", "status": "created"}));
    let mut other = demo_spec();
    other["id"] = json!("acme/order");
    let r = create(&h, &other);
    assert_eq!(r.header("location"), Some("/models/acme%2Forder"));
    assert_eq!(h.get("/models").json(), json!(["acme/order", "demo"]));
    assert_eq!(h.get("/models/acme%2Forder").json()["id"], "acme/order");

    let info = h.get("/models/demo").json();
    assert_eq!(info["id"], "demo");
    assert_eq!(info["version"], "1.0.0");
    assert_eq!(info["derivationCount"], 1);
    assert_eq!(info["constraintCount"], 2);
    assert_eq!(info["effectCount"], 0);

    let spec = h.get("/models/demo/spec").json();
    assert_eq!(spec["derivations"][0]["expr"], "price * qty");
    assert_eq!(h.get("/models/demo/lineage").json(), json!([]));
    assert_error(&h.get("/models/demo/library"), 404, "Not found");

    // Duplicate, invalid spec, wrong shape, malformed JSON, wrong content type.
    let b = assert_error(&create(&h, &demo_spec()), 409, "Duplicate model");
    assert_eq!(b["id"], "demo");
    let mut bad = demo_spec();
    bad["id"] = json!("bad");
    bad["derivations"][0]["expr"] = json!("price * (");
    let b = assert_error(&create(&h, &bad), 422, "Invalid spec");
    assert_eq!(b["errors"][0]["location"], "derivations[0].expr", "{b}");
    assert_eq!(b["errors"][0]["severity"], "error");
    assert!(b["message"].as_str().unwrap().contains("derivations[0]"));
    let b = assert_error(
        &create(&h, &json!({"id": "shape", "schema": {}, "derivations": 5})),
        422,
        "Invalid spec",
    );
    assert_eq!(b["errors"][0]["location"], "derivations", "{b}");
    let b = assert_error(
        &h.post("/models", &[JSON], b"{\"id\": \"x\",\n \"schema\": }"),
        400,
        "Malformed or unreadable request body",
    );
    assert_eq!(
        (b["line"].clone(), b["column"].clone()),
        (json!(2), json!(12))
    );
    assert_error(
        &h.post("/models", &[("Content-Type", "text/plain")], b"{}"),
        415,
        "Unsupported media type",
    );
    assert_error(
        &h.post("/models", &[], demo_spec().to_string().as_bytes()),
        415,
        "Unsupported media type",
    );

    // Unknown model on every read.
    for path in [
        "/models/nope",
        "/models/nope/spec",
        "/models/nope/library",
        "/models/nope/lineage",
        "/models/nope/state",
        "/models/nope/state/$.a",
        "/models/nope/history",
        "/models/nope/schema/$.a",
        "/models/nope/explain/$",
        "/models/nope/graph",
        "/models/nope/verification",
        "/models/nope/audit",
        "/models/nope/audit/verify",
        "/models/nope/view",
        "/models/nope/view/main",
    ] {
        let b = assert_error(&h.get(path), 404, "Not found");
        assert!(
            b["message"].as_str().unwrap().contains("nope"),
            "{path}: {b}"
        );
    }
    assert_error(&mutate(&h, "nope", json!({"$.a": 1})), 404, "Not found");
    assert_error(&h.post("/models/nope/snapshot", &[], b""), 404, "Not found");

    let r = h.delete("/models/demo");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json(), json!({"deleted": true, "id": "demo"}));
    assert_error(&h.get("/models/demo"), 404, "Not found");
    assert_error(&h.delete("/models/demo"), 404, "Not found");
    assert_eq!(h.get("/models").json(), json!(["acme/order"]));
}

#[test]
fn registry_limit_is_429() {
    let (_d, h) = start(&["--max-models", "1"]);
    assert_eq!(create(&h, &demo_spec()).status, 201);
    let mut second = demo_spec();
    second["id"] = json!("second");
    let b = assert_error(&create(&h, &second), 429, "Too many models");
    assert_eq!(b["limit"], 1);
}

/// A body that differs from an earlier one only in its leading `id` is created from the
/// spec remembered for it (no second parse): the copy is exactly what a fresh parse would
/// create, its id is checked as any, and a body that only looks like a copy is parsed.
#[test]
fn copies_of_a_spec_are_the_spec_under_their_own_id() {
    let (_d, h) = start(&["--max-models", "4"]);
    let body = demo_spec().to_string();
    let rest = body
        .strip_prefix(r#"{"id":"demo","#)
        .expect("the id serialises first");
    let post = |text: String| h.post("/models", &[JSON], text.as_bytes());
    assert_eq!(post(body.clone()).status, 201);
    // Spaces around the id member, and an escape inside it.
    let copy = post(format!(r#"{{ "id" : "cop\u0079" ,{rest}"#));
    assert_eq!(copy.status, 201, "{copy:?}");
    assert_eq!(copy.json()["id"], "copy");
    assert_eq!(copy.header("location"), Some("/models/copy"));
    let mut want = demo_spec();
    want["id"] = json!("copy");
    let got = h.get("/models/copy/spec").json();
    assert_eq!(got["id"], "copy");
    for key in [
        "schema",
        "derivations",
        "constraints",
        "tests",
        "viewDefinition",
    ] {
        assert_eq!(got[key], want[key], "{key}");
    }
    let r = mutate(&h, "copy", json!({"$.price": 4, "$.qty": 5}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(h.get("/models/copy/state").json()["total"], 20);
    assert_eq!(h.get("/models/demo/state").json()["total"], Value::Null);

    // The id is checked as in any creation: the same error as a fresh parse of that body.
    let bad = post(format!(r#"{{"id":"9lives",{rest}"#));
    let fresh = post(format!(r#"{{"id":"9lives",{rest}"#).replacen(
        r#""schema""#,
        r#""version":"1.0.0","schema""#,
        1,
    ));
    let b = assert_error(&bad, 422, "Invalid spec");
    assert_eq!(b, assert_error(&fresh, 422, "Invalid spec"));
    assert!(b.to_string().contains("9lives"), "{b}");
    // A copy under a taken id is a duplicate.
    let dup = assert_error(
        &post(format!(r#"{{"id":"copy",{rest}"#)),
        409,
        "Duplicate model",
    );
    assert_eq!(dup["id"], "copy");
    // A body naming `id` twice is not a copy of anything: parsed whole, as before.
    let twice = format!(
        r#"{{"id":"first",{}"#,
        rest.strip_suffix('}')
            .map(|r| format!(r#"{r},"id":"again"}}"#))
            .expect("an object")
    );
    let r1 = post(twice.clone());
    assert_eq!(
        (r1.status, r1.json()["id"].clone()),
        (201, json!("again")),
        "{r1:?}"
    );
    let r2 = post(twice.replacen("first", "other", 1));
    assert_eq!(assert_error(&r2, 409, "Duplicate model")["id"], "again");
    assert_eq!(h.delete("/models/again").status, 200);
    // The registry's bound holds for copies, and a refused copy takes no place.
    assert_eq!(post(format!(r#"{{"id":"third",{rest}"#)).status, 201);
    assert_eq!(post(format!(r#"{{"id":"fourth",{rest}"#)).status, 201);
    assert_error(
        &post(format!(r#"{{"id":"fifth",{rest}"#)),
        429,
        "Too many models",
    );
    assert_eq!(h.delete("/models/third").status, 200);
    assert_eq!(post(format!(r#"{{"id":"fifth",{rest}"#)).status, 201);
    let listed = h.get("/models").json();
    assert_eq!(listed.as_array().map(Vec::len), Some(4), "{listed}");
    // Every body after the first was a copy but the one with a version and the two naming
    // `id` twice.
    assert_eq!(
        valem_tests::metric(&h, "valem_model_copies_total"),
        Some(7.0)
    );
}

#[test]
fn mutations_state_and_reads() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());

    let r = mutate(&h, "demo", json!({"$.price": 10, "$.qty": 3}));
    assert_eq!(r.status, 200, "{r:?}");
    let b = r.json();
    assert_eq!(b["success"], true);
    assert_eq!(b["mutatedPaths"], json!(["$.price", "$.qty"]));
    assert_eq!(b["derivedUpdated"], json!(["$.total"]));
    assert_eq!(b["flaggedConstraints"], json!([]));
    assert!(b.get("viewDelta").is_none());
    let trace = b["traces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["targetPath"] == "$.total")
        .expect("a trace of $.total");
    assert_eq!(trace["result"], 30);

    assert_eq!(
        h.get("/models/demo/state").json(),
        json!({"price": 10, "qty": 3, "total": 30})
    );
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(30));
    assert_eq!(
        h.get(&format!("/models/demo/state/{}", seg("$.price")))
            .json(),
        json!(10)
    );
    assert_error(&h.get("/models/demo/state/$.note"), 404, "Not found");
    assert_error(&h.get("/models/demo/state/$.a..b"), 400, "Bad request");

    // A flag constraint reports and commits.
    let b = mutate(&h, "demo", json!({"$.qty": 20})).json();
    assert_eq!(b["flaggedConstraints"][0]["constraintId"], "big", "{b}");
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(200));

    // Schema violation: 422 with violations; nothing written.
    let b = assert_error(
        &mutate(&h, "demo", json!({"$.price": "ten", "$.qty": 1})),
        422,
        "Schema violation",
    );
    assert_eq!(b["violations"][0]["path"], "$.price", "{b}");
    assert_eq!(b["violations"][0]["keyword"], "type");
    // Rollback constraint: 409 with violations; nothing written.
    let b = assert_error(
        &mutate(&h, "demo", json!({"$.qty": 1000})),
        409,
        "Constraint violation",
    );
    assert_eq!(b["violations"][0]["constraintId"], "cap", "{b}");
    assert_eq!(b["violations"][0]["message"], "Total over 1000");
    assert_eq!(b["violations"][0]["policy"], "rollback");
    assert_eq!(
        h.get("/models/demo/state").json(),
        json!({"price": 10, "qty": 20, "total": 200})
    );
    // Writing a derived field, a bad address, a body that is not an object.
    assert_error(
        &mutate(&h, "demo", json!({"$.total": 1})),
        422,
        "Schema violation",
    );
    assert_error(
        &mutate(&h, "demo", json!({"price": 1})),
        422,
        "Invalid mutation",
    );
    assert_error(
        &mutate(&h, "demo", json!([1, 2])),
        400,
        "Malformed or unreadable request body",
    );
    assert_error(
        &h.post("/models/demo/mutations", &[JSON], b"{\"$.qty\": }"),
        400,
        "Malformed or unreadable request body",
    );
    assert_error(
        &h.post(
            "/models/demo/mutations",
            &[("Content-Type", "application/xml")],
            b"<qty/>",
        ),
        415,
        "Unsupported media type",
    );

    // History and time travel.
    let history = h.get("/models/demo/history").json();
    let times = history.as_array().unwrap();
    assert_eq!(times.len(), 3, "creation and two commits: {history}");
    let at = times[1].as_str().unwrap();
    assert!(at.ends_with('Z'), "{at}");
    assert_eq!(
        h.get(&format!("/models/demo/state?at={}", seg(at))).json(),
        json!({"price": 10, "qty": 3, "total": 30})
    );
    assert_error(
        &h.get("/models/demo/state?at=1990-01-01T00:00:00Z"),
        404,
        "Not found",
    );
    let b = assert_error(
        &h.get("/models/demo/state?at=yesterday"),
        400,
        "Bad request",
    );
    assert!(b["message"].as_str().unwrap().contains("yesterday"));

    // Effective schema and explain.
    let s = h.get("/models/demo/schema/$.price").json();
    assert_eq!(s["type"], "number");
    assert_eq!(s["minimum"], 0);
    assert_error(&h.get("/models/demo/schema/$.a..b"), 400, "Bad request");
    // An address the schema does not declare accepts anything, and says so (a typo shows).
    let s = h.get("/models/demo/schema/$.pirce").json();
    let c = s["$comment"].as_str().unwrap_or_default();
    assert!(
        c.contains("$.pirce is not declared") && c.contains("$ declares price, qty, note"),
        "{s}"
    );
    assert_eq!(s.as_object().map(|o| o.len()), Some(1), "{s}");
    let s = h.get("/models/demo/schema/$.total").json();
    assert!(
        s["$comment"]
            .as_str()
            .unwrap_or_default()
            .contains("derivation of $.total"),
        "{s}"
    );
    let traces = h.get("/models/demo/explain/$.total").json();
    let all = traces.as_array().unwrap();
    assert!(all.len() >= 2, "{traces}");
    assert!(all.iter().all(|t| t["targetPath"] == "$.total"));
    assert_eq!(all.last().unwrap()["result"], 200);
    let one = h.get("/models/demo/explain/$.total?limit=1").json();
    assert_eq!(one.as_array().unwrap().len(), 1);
    assert_eq!(one[0]["result"], 200);
    let cap = h
        .get(&format!("/models/demo/explain/{}", seg("$constraint:cap")))
        .json();
    assert!(
        cap.as_array()
            .unwrap()
            .iter()
            .any(|t| t["targetPath"] == "$constraint:cap" && t["constraintPassed"] == false),
        "the refused cycle's constraint trace: {cap}"
    );
    assert_error(&h.get("/models/demo/explain/$?limit=0"), 400, "Bad request");
    assert_error(&h.get("/models/demo/explain/$?limit=x"), 400, "Bad request");
}

/// `?at=` answers each commit's state from the ring, which keeps what later commits and reads
/// changed rather than the states: a lazy value read between commits is at each commit as that
/// commit left it (stale until read), and the live state moves on.
#[test]
fn time_travel_gives_each_commit_its_state_across_reads_of_lazy_values() {
    let (_d, h) = start(&[]);
    let spec = json!({
        "id": "lz",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.total", "expr": "price * qty"},
            {"path": "$.lz", "expr": "total * 10", "evaluation": "lazy"}
        ]
    });
    assert_eq!(create(&h, &spec).status, 201);
    let commit = |m: Value| assert_eq!(mutate(&h, "lz", m).status, 200);
    commit(json!({"$.price": 1, "$.qty": 2}));
    assert_eq!(
        h.get("/models/lz/state").json(),
        json!({"price": 1, "qty": 2, "total": 2, "lz": 20})
    );
    commit(json!({"$.qty": 3}));
    assert_eq!(
        h.get("/models/lz/state").json(),
        json!({"price": 1, "qty": 3, "total": 3, "lz": 30})
    );
    commit(json!({"$.price": 5}));
    let history = h.get("/models/lz/history").json();
    let times: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(times.len(), 4, "creation and three commits: {history}");
    let at = |t: &str| h.get(&format!("/models/lz/state?at={}", seg(t))).json();
    assert_eq!(at(times[0]), json!({"total": null}));
    assert_eq!(at(times[1]), json!({"price": 1, "qty": 2, "total": 2}));
    assert_eq!(
        at(times[2]),
        json!({"price": 1, "qty": 3, "total": 3, "lz": 20})
    );
    assert_eq!(
        at(times[3]),
        json!({"price": 5, "qty": 3, "total": 15, "lz": 30})
    );
    // Asked twice, and after the live state was read again: the same answers.
    assert_eq!(
        h.get("/models/lz/state").json(),
        json!({"price": 5, "qty": 3, "total": 15, "lz": 150})
    );
    assert_eq!(at(times[1]), json!({"price": 1, "qty": 2, "total": 2}));
    assert_eq!(
        at(times[3]),
        json!({"price": 5, "qty": 3, "total": 15, "lz": 30})
    );
}

#[test]
fn json_patch_mutations() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    let patch = |ct: &str, body: &str| {
        h.post(
            "/models/demo/mutations/patch",
            &[("Content-Type", ct)],
            body.as_bytes(),
        )
    };
    let r = patch(
        "application/json-patch+json",
        r#"[{"op":"add","path":"/price","value":4},{"op":"add","path":"/qty","value":5}]"#,
    );
    assert_eq!(r.status, 200, "{r:?}");
    let b = r.json();
    assert_eq!(b["derivedUpdated"], json!(["$.total"]));
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(20));

    assert_error(
        &patch(
            "application/json",
            r#"[{"op":"replace","path":"/qty","value":1}]"#,
        ),
        415,
        "Unsupported media type",
    );
    let b = assert_error(
        &patch(
            "application/json-patch+json",
            r#"[{"op":"bogus","path":"/qty"}]"#,
        ),
        422,
        "Invalid mutation",
    );
    assert!(b["message"].as_str().unwrap().contains("JSON Patch"), "{b}");
    assert_error(
        &patch(
            "application/json-patch+json",
            r#"[{"op":"test","path":"/qty","value":99}]"#,
        ),
        422,
        "Invalid mutation",
    );
    assert_error(
        &patch(
            "application/json-patch+json",
            r#"[{"op":"replace","path":"/price","value":"x"}]"#,
        ),
        422,
        "Schema violation",
    );
    assert_error(
        &patch("application/json-patch+json", "[{"),
        400,
        "Malformed or unreadable request body",
    );
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(20));
}

#[test]
fn views_and_view_delta() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 2, "$.qty": 2}));

    let v = h.get("/models/demo/view").json();
    assert_eq!(v["viewId"], "main");
    assert_eq!(v["title"], "Order");
    assert_eq!(v["components"][0]["value"], 2);
    assert_eq!(h.get("/models/demo/view/main").json(), v);
    assert_error(&h.get("/models/demo/view/other"), 404, "Not found");

    let r = h.post(
        "/models/demo/mutations",
        &[JSON, ("X-View", "main")],
        br#"{"$.qty": 5}"#,
    );
    assert_eq!(r.status, 200, "{r:?}");
    let delta = &r.json()["viewDelta"];
    assert_eq!(delta["priceField"]["value"], 2, "{delta}");
    assert_eq!(
        delta["totalLabel"]["value"], 10,
        "nested components too: {delta}"
    );
    assert_eq!(delta["totals"]["type"], "card");

    // An unknown X-View is refused before anything is written.
    assert_error(
        &h.post(
            "/models/demo/mutations",
            &[JSON, ("X-View", "nope")],
            br#"{"$.qty": 7}"#,
        ),
        404,
        "Not found",
    );
    assert_eq!(h.get("/models/demo/state/$.qty").json(), json!(5));

    let mut plain = demo_spec();
    plain["id"] = json!("plain");
    plain.as_object_mut().unwrap().remove("viewDefinition");
    create(&h, &plain);
    assert_error(&h.get("/models/plain/view"), 404, "Not found");
}

#[test]
fn a_view_delta_shows_the_state_its_own_write_committed() {
    // Two clients write the same field with X-View at once; each answer's view must show the
    // value its own write committed: the view check, the cycle and the view are one shard job,
    // so no other write comes between them.
    let (d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 1, "$.qty": 1}));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let h = Http::new(&d);
            std::thread::spawn(move || {
                let mut seen = 0;
                for i in 0..150 {
                    let price = 2 * i + w;
                    let r = h.post(
                        "/models/demo/mutations",
                        &[JSON, ("X-View", "main")],
                        format!(r#"{{"$.price": {price}}}"#).as_bytes(),
                    );
                    assert_eq!(r.status, 200, "{r:?}");
                    let delta = &r.json()["viewDelta"];
                    assert_eq!(delta["priceField"]["value"], json!(price), "{delta}");
                    assert_eq!(delta["totalLabel"]["value"], json!(price), "{delta}");
                    seen += 1;
                }
                seen
            })
        })
        .collect();
    for w in writers {
        assert_eq!(w.join().expect("a writer"), 150);
    }
    // A patch with X-View answers the view of its own commit too.
    let r = h.post(
        "/models/demo/mutations/patch",
        &[
            ("Content-Type", "application/json-patch+json"),
            ("X-View", "main"),
        ],
        br#"[{"op":"replace","path":"/price","value":7}]"#,
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["viewDelta"]["priceField"]["value"], json!(7));
}

#[test]
fn graph_and_verification() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    let g = h.get("/models/demo/graph").json();
    let node = |id: &str| {
        g["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no node {id} in {g}"))
    };
    assert_eq!(node("$.price")["kind"], "BASE");
    assert_eq!(node("$.price")["level"], 0);
    assert_eq!(node("$.total")["kind"], "DERIVED");
    assert_eq!(node("$.total")["expression"], "price * qty");
    assert_eq!(node("$.total")["level"], 1);
    assert_eq!(node("$constraint:cap")["kind"], "CONSTRAINT");
    assert_eq!(node("$constraint:cap")["level"], 2);
    let edges = g["edges"].as_array().unwrap();
    assert!(
        edges.contains(&json!({"from": "$.qty", "to": "$.total"})),
        "{g}"
    );
    assert!(edges.contains(&json!({"from": "$.total", "to": "$constraint:cap"})));
    assert_eq!(g["levels"][1], json!(["$.total"]));

    let v = h.get("/models/demo/verification").json();
    assert_eq!(v["state"], "green", "{v}");
    assert_eq!(v["checkedCount"], 1);
    assert_eq!(v["passedCount"], 1);
    assert_eq!(v["unverifiableCount"], 1);
    assert_eq!(v["cases"][0]["status"], "passed");
    assert_eq!(v["cases"][1]["status"], "unverifiable");

    let mut wrong = demo_spec();
    wrong["id"] = json!("wrong");
    wrong["tests"][0]["expect"]["$.total"] = json!(31);
    create(&h, &wrong);
    let v = h.get("/models/wrong/verification").json();
    assert_eq!(v["state"], "amber", "{v}");
    assert_eq!(
        (v["checkedCount"].clone(), v["passedCount"].clone()),
        (json!(1), json!(0))
    );
    assert_eq!(v["cases"][0]["status"], "failed");
    assert_eq!(v["cases"][0]["failures"][0]["actual"], 30);

    let mut none = demo_spec();
    none["id"] = json!("untested");
    none.as_object_mut().unwrap().remove("tests");
    create(&h, &none);
    let v = h.get("/models/untested/verification").json();
    assert_eq!(v["state"], "neutral", "{v}");
    assert_eq!(v["checkedCount"], 0);
}

#[test]
fn audit_trail_and_verify() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 1}));
    mutate(&h, "demo", json!({"$.qty": 2}));

    let all = h.get("/models/demo/audit").json();
    let recs = all.as_array().unwrap();
    assert_eq!(recs.len(), 2, "{all}");
    assert_eq!(recs[0]["sequence"], 1, "newest first");
    assert_eq!(recs[0]["mutations"], json!({"$.qty": 2}));
    assert_eq!(recs[0]["source"], "client");
    assert_eq!(recs[1]["sequence"], 0);
    assert_eq!(recs[0]["prevHash"], recs[1]["hash"]);

    let price = h.get("/models/demo/audit?path=$.price").json();
    assert_eq!(price.as_array().unwrap().len(), 1, "{price}");
    assert_eq!(price[0]["sequence"], 0);
    let qty = h.get("/models/demo/audit?path=$.qty").json();
    assert_eq!(qty.as_array().unwrap().len(), 1, "{qty}");
    assert_eq!(qty[0]["sequence"], 1);
    // Trace targets match too: both cycles evaluated $.total.
    let total = h.get("/models/demo/audit?path=$.total").json();
    assert_eq!(total.as_array().unwrap().len(), 2, "{total}");
    assert_eq!(
        h.get("/models/demo/audit?limit=1")
            .json()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let t0 = recs[0]["timestamp"].as_str().unwrap();
    let from = h
        .get(&format!("/models/demo/audit?from={}", seg(t0)))
        .json();
    assert_eq!(from.as_array().unwrap().len(), 1, "{from}");
    assert_eq!(
        h.get("/models/demo/audit?to=2000-01-01T00:00:00Z").json(),
        json!([])
    );
    assert_error(&h.get("/models/demo/audit?from=soon"), 400, "Bad request");
    assert_error(
        &h.get("/models/demo/audit?to=2026-13-45"),
        400,
        "Bad request",
    );
    assert_error(&h.get("/models/demo/audit?limit=-1"), 400, "Bad request");

    let v = h.get("/models/demo/audit/verify").json();
    assert_eq!(v["valid"], true, "{v}");
    assert_eq!(v["recordsChecked"], 2);
    assert_eq!(v["firstBrokenSequence"], Value::Null);
}

#[test]
fn snapshot_and_restore() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 10, "$.qty": 3}));
    let r = h.post("/models/demo/snapshot", &[], b"");
    assert_eq!(r.status, 200, "{r:?}");
    let snap = r.json();
    assert_eq!(snap["modelId"], "demo");
    assert_eq!(snap["baseDoc"], json!({"price": 10, "qty": 3}));
    assert_eq!(snap["derivedCache"]["$.total"], 30);

    mutate(&h, "demo", json!({"$.qty": 50}));
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(500));
    let r = h.post_json("/models/demo/restore", &snap);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["restored"], true);
    assert_eq!(
        h.get("/models/demo/state").json(),
        json!({"price": 10, "qty": 3, "total": 30})
    );

    assert_error(
        &h.post_json("/models/demo/restore", &json!([snap])),
        400,
        "Malformed or unreadable request body",
    );
    assert_error(
        &h.post_json("/models/demo/restore", &json!({"modelId": "demo"})),
        400,
        "Bad request",
    );
    let b = assert_error(
        &h.post_json(
            "/models/demo/restore",
            &json!({"modelId": "demo", "baseDoc": {"price": "x"}}),
        ),
        422,
        "Schema violation",
    );
    assert_eq!(b["violations"][0]["path"], "$.price", "{b}");
    assert_error(
        &h.post(
            "/models/demo/restore",
            &[("Content-Type", "text/plain")],
            b"{}",
        ),
        415,
        "Unsupported media type",
    );
    assert_error(
        &h.post("/models/demo/restore", &[JSON], b"{"),
        400,
        "Malformed or unreadable request body",
    );
}

#[test]
fn spec_evolution() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 10, "$.qty": 3}));
    let evolve = |v: Value| h.post_json("/models/demo/spec/evolve", &v);

    let r = evolve(json!({
        "expectedVersion": "1.0.0",
        "newVersion": "1.1.0",
        "upsertDerivations": [{"path": "$.withTax", "expr": "total * 1.5"}]
    }));
    assert_eq!(r.status, 200, "{r:?}");
    let info = r.json();
    assert_eq!(info["version"], "1.1.0");
    assert_eq!(info["derivationCount"], 2);
    assert_eq!(h.get("/models/demo/state/$.withTax").json(), json!(45));
    assert_eq!(h.get("/models/demo/spec").json()["version"], "1.1.0");

    let b = assert_error(
        &evolve(json!({"expectedVersion": "1.0.0", "newVersion": "2.0.0"})),
        409,
        "Version conflict",
    );
    assert_eq!(
        (b["expected"].clone(), b["actual"].clone()),
        (json!("1.0.0"), json!("1.1.0"))
    );
    let b = assert_error(
        &evolve(json!({"upsertDerivations": [{"path": "$.bad", "expr": "price +"}]})),
        422,
        "Invalid evolution",
    );
    assert!(!b["errors"].as_array().unwrap().is_empty(), "{b}");
    assert_error(
        &evolve(json!({"upsertDerivations": 3})),
        422,
        "Invalid evolution",
    );
    let b = assert_error(
        &evolve(json!({"newSchema": {"type": "object", "properties": {
            "price": {"type": "string"}, "qty": {"type": "number"}
        }}})),
        422,
        "Stranded state",
    );
    assert_eq!(b["incompatibilities"][0]["path"], "$.price", "{b}");
    assert_error(
        &h.post("/models/demo/spec/evolve", &[JSON], b"{\"newVersion\""),
        400,
        "Malformed or unreadable request body",
    );
    assert_error(
        &h.post_json("/models/nope/spec/evolve", &json!({})),
        404,
        "Not found",
    );
    assert_eq!(h.get("/models/demo/spec").json()["version"], "1.1.0");
}

#[test]
fn evolutions_that_name_no_change_are_refused_or_leave_the_model_alone() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    mutate(&h, "demo", json!({"$.price": 10, "$.qty": 3}));
    let evolve = |v: Value| h.post_json("/models/demo/spec/evolve", &v);
    let history = || h.get("/models/demo/history").json();
    let before = history();
    assert_eq!(before.as_array().map(Vec::len), Some(2), "{before}");
    let constraints = h.get("/models/demo").json()["constraintCount"].clone();

    // A misspelt key and nothing else: refused, naming it and the key meant.
    let b = assert_error(
        &evolve(json!({"addDerivations": [{"path": "$.withTax", "expr": "total * 1.5"}]})),
        422,
        "Invalid evolution",
    );
    assert_eq!(b["errors"][0]["location"], "addDerivations", "{b}");
    let m = b["message"].as_str().unwrap();
    assert!(
        m.contains("names no change") && m.contains("did you mean `upsertDerivations`"),
        "{m}"
    );
    let b = assert_error(
        &evolve(json!({"expectedVersion": "1.0.0", "upsert_constraints": []})),
        422,
        "Invalid evolution",
    );
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("did you mean `upsertConstraints`"),
        "{b}"
    );
    // Nothing was applied and the history is untouched.
    assert_eq!(
        h.get("/models/demo/spec").json()["derivations"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(history(), before);

    // An evolution that changes nothing: answered, with a warning, and nothing touched.
    let r = evolve(json!({}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.json()["warnings"][0]["location"],
        "evolution",
        "{}",
        r.json()
    );
    let r = evolve(json!({"expectedVersion": "1.0.0",
        "upsertDerivations": [{"path": "$.total", "expr": "price * qty"}]}));
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.json().get("warnings").is_none(), "{}", r.json());
    assert_eq!(history(), before);

    // Unknown keys beside a change: the change applies, they come back as warnings.
    let r = evolve(json!({
        "upsertDerivations": [{"path": "$.withTax", "expr": "total * 1.5"}],
        "addConstraints": [{"id": "x", "expr": "true", "message": "m", "policy": "flag"}]
    }));
    assert_eq!(r.status, 200, "{r:?}");
    let info = r.json();
    assert_eq!(info["derivationCount"], 2);
    assert_eq!(info["constraintCount"], constraints);
    assert_eq!(info["warnings"][0]["location"], "addConstraints", "{info}");
    assert!(info["warnings"][0]["message"]
        .as_str()
        .unwrap()
        .contains("`upsertConstraints` or `removeConstraints`"));
    assert_eq!(h.get("/models/demo/state/$.withTax").json(), json!(45));
    assert_ne!(history(), before, "a real evolution restarts the history");
}

fn multipart(fields: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "valemTestBoundary7MA4YWxk";
    let mut body = Vec::new();
    for (name, content_type, data) in fields {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match content_type {
            Some(ct) => body.extend_from_slice(
                format!(
                    "Content-Disposition: form-data; name=\"{name}\"; filename=\"f.bin\"\r\nContent-Type: {ct}\r\n\r\n"
                )
                .as_bytes(),
            ),
            None => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

#[test]
fn blobs_upload_download_and_model_scope() {
    let (d, h) = start(&["--max-blob-bytes", "1000"]);
    let png: &[u8] = b"\x89PNG\r\n\x1a\n not really a picture";
    let (ct, body) = multipart(&[
        ("file", Some("application/octet-stream"), png),
        ("mediaType", None, b"image/png"),
    ]);
    let r = h.post("/blobs", &[("Content-Type", &ct)], &body);
    assert_eq!(r.status, 201, "{r:?}");
    let blob = r.json();
    let id = blob["blobId"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 64, "a blake3 hex id: {blob}");
    assert_eq!(blob["bytes"], png.len());
    assert_eq!(blob["mediaType"], "image/png");
    assert_eq!(r.header("location"), Some(format!("/blobs/{id}").as_str()));

    let got = h.get(&format!("/blobs/{id}"));
    assert_eq!(got.status, 200);
    assert_eq!(got.body, png);
    assert_eq!(got.header("content-type"), Some("image/png"));
    assert_eq!(got.header("x-content-type-options"), Some("nosniff"));
    assert_error(
        &h.get(&format!("/blobs/{}", "0".repeat(64))),
        404,
        "Not found",
    );

    // Without mediaType the part's own type is kept.
    let (ct2, body2) = multipart(&[("file", Some("text/plain"), b"hello")]);
    let r = h.post("/blobs", &[("Content-Type", &ct2)], &body2);
    assert_eq!(r.json()["mediaType"], "text/plain", "{r:?}");

    // Model-scoped reads: only blobs the current state references.
    create(&h, &demo_spec());
    let scoped = format!("/models/demo/blobs/{id}");
    assert_error(&h.get(&scoped), 404, "Not found");
    mutate(&h, "demo", json!({"$.note": id}));
    let got = h.get(&scoped);
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(got.body, png);
    assert_error(
        &h.get(&format!("/models/nope/blobs/{id}")),
        404,
        "Not found",
    );

    // Failures: too big, no `file`, not multipart, a bad media type.
    let big = vec![7u8; 1001];
    let (ct3, body3) = multipart(&[("file", Some("application/octet-stream"), &big)]);
    assert_error(
        &h.post("/blobs", &[("Content-Type", &ct3)], &body3),
        413,
        "Payload too large",
    );
    // A declared length over the limit is refused before the body is sent.
    let (status, text) = raw_http(
        &d.addr,
        &format!(
            "POST /blobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ct3}\r\nContent-Length: 200000\r\nConnection: close\r\n\r\n"
        ),
    );
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("\"error\":\"Payload too large\""), "{text}");
    let (ct5, body5) = multipart(&[("mediaType", None, b"image/png")]);
    assert_error(
        &h.post("/blobs", &[("Content-Type", &ct5)], &body5),
        400,
        "Bad request",
    );
    assert_error(
        &h.post("/blobs", &[JSON], b"{}"),
        415,
        "Unsupported media type",
    );
    let (ct6, body6) = multipart(&[("file", None, b"x"), ("mediaType", None, b"nonsense")]);
    assert_error(
        &h.post("/blobs", &[("Content-Type", &ct6)], &body6),
        400,
        "Bad request",
    );
}

#[test]
fn oversize_bodies_are_413() {
    let (d, h) = start(&["--max-body-bytes", "1000"]);
    create(&h, &demo_spec());
    let long = "x".repeat(2000);
    let b = assert_error(
        &mutate(&h, "demo", json!({"$.note": long})),
        413,
        "Payload too large",
    );
    assert!(b["message"].as_str().unwrap().contains("max-body-bytes"));
    let mut spec = demo_spec();
    spec["id"] = json!("big");
    spec["description"] = json!(long);
    assert_error(&create(&h, &spec), 413, "Payload too large");
    assert_eq!(mutate(&h, "demo", json!({"$.note": "short"})).status, 200);
    let (status, text) = raw_http(
        &d.addr,
        "POST /models/demo/mutations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 413, "{text}");
}

#[test]
fn every_error_is_json() {
    let (_d, h) = start(&[]);
    create(&h, &demo_spec());
    assert_error(&h.get("/no/such/route"), 404, "Not found");
    let r = h.delete("/models/demo/state");
    assert_error(&r, 405, "Method not allowed");
    assert_error(&h.get("/models/demo/mutations"), 405, "Method not allowed");
    assert_error(
        &h.get("/models/demo/subscribe"),
        400,
        "WebSocket upgrade required",
    );
    let m = h.get("/metrics").text();
    assert!(
        m.contains("valem_errors_total{kind=\"method_not_allowed\"} 2"),
        "{m}"
    );
}

#[test]
fn api_key_is_required_but_healthz_stays_open() {
    let d = Daemon::start(&["--api-key", "s3cret"]);
    let anon = Http::new(&d);
    let health = anon.get("/healthz");
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.json()["status"], "ok");
    let r = anon.get("/models");
    let b = assert_error(&r, 401, "Unauthorized");
    assert!(b["message"].as_str().unwrap().contains("Bearer"));
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    assert_error(
        &anon.post_json("/models", &demo_spec()),
        401,
        "Unauthorized",
    );
    let wrong = Http::new(&d).with_key("guess");
    assert_error(&wrong.get("/models"), 401, "Unauthorized");
    let good = Http::new(&d).with_key("s3cret");
    assert_eq!(create(&good, &demo_spec()).status, 201);
    assert_eq!(good.get("/models").json(), json!(["demo"]));
    assert_eq!(
        mutate(&good, "demo", json!({"$.price": 2, "$.qty": 4})).status,
        200
    );
    assert_eq!(good.get("/models/demo/state/$.total").json(), json!(8));
}

#[test]
fn origin_and_host_are_checked() {
    let (d, h) = start(&[]);
    create(&h, &demo_spec());
    let b = assert_error(
        &h.get_with("/models", &[("Origin", "https://evil.example")]),
        403,
        "Forbidden",
    );
    assert!(b["message"].as_str().unwrap().contains("evil.example"));
    assert_error(
        &h.post(
            "/models/demo/mutations",
            &[JSON, ("Origin", "https://evil.example")],
            br#"{"$.qty": 1}"#,
        ),
        403,
        "Forbidden",
    );
    assert_eq!(h.get("/models/demo/state").json(), json!({"total": null}));
    let ok = h.get_with("/models", &[("Origin", "http://localhost:3000")]);
    assert_eq!(ok.status, 200, "{ok:?}");

    let (status, text) = raw_http(
        &d.addr,
        "GET /models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("\"error\":\"Forbidden\""), "{text}");
    let (status, text) = raw_http(
        &d.addr,
        "GET /models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 200, "{text}");

    let listed = Daemon::start(&["--allowed-origins", "https://app.example"]);
    let hl = Http::new(&listed);
    assert_eq!(
        hl.get_with("/models", &[("Origin", "https://app.example")])
            .status,
        200
    );
}

#[test]
fn bundled_examples_run_over_rest() {
    let (_d, h) = start(&[]);
    let dir = valem_tests::repo_root().join("examples");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    assert!(names.len() >= 10);
    for p in names {
        let spec: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let id = spec["id"].as_str().unwrap().to_string();
        let r = create(&h, &spec);
        assert_eq!(r.status, 201, "{}: {r:?}", p.display());
        let v = h.get(&format!("/models/{}/verification", seg(&id))).json();
        assert_eq!(v["state"], "green", "{id}: {v}");
        assert_eq!(v["checkedCount"], v["passedCount"], "{id}");
        let g = h.get(&format!("/models/{}/graph", seg(&id))).json();
        assert!(
            g["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n["kind"] == "DERIVED"),
            "{id}: {g}"
        );
        if spec.get("viewDefinition").is_some() {
            let view = h.get(&format!("/models/{}/view", seg(&id)));
            assert_eq!(view.status, 200, "{id}: {view:?}");
        }
        let lib = h.get(&format!("/models/{}/library", seg(&id)));
        if spec.get("library").is_some() {
            assert_eq!(lib.status, 200, "{id}: {lib:?}");
            assert!(
                !lib.json()["exports"].as_array().unwrap().is_empty(),
                "{id}"
            );
        } else {
            assert_eq!(lib.status, 404, "{id}");
        }
    }

    // The car-loan example's first test, replayed over REST.
    let r = mutate(
        &h,
        "car-loan-calculator",
        json!({"$.loan.downPayment": 3000}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        h.get("/models/car-loan-calculator/state/$.monthlyPayment")
            .json(),
        json!(548.13)
    );
    let lib = h.get("/models/car-loan-calculator/library").json();
    assert!(
        lib["exports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "levelPayment" && e["kind"] == "function"),
        "{lib}"
    );
    // The live `maximum` meta (the vehicle price) refuses a down payment above it.
    let b = assert_error(
        &mutate(
            &h,
            "car-loan-calculator",
            json!({"$.loan.downPayment": 1_000_000}),
        ),
        422,
        "Schema violation",
    );
    assert_eq!(b["violations"][0]["keyword"], "maximum", "{b}");
}
