//! The spec tooling CLI as a user runs it: real binary, real files, real exit codes.

use serde_json::{json, Value};
use valem_tests::{repo_root, run, stderr, stdout};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn worked_example_reproduces_via_dry_run() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}],"constraints":[],"metaDerivations":[],"tests":[]});
    let f = write(&dir, "demo.json", &spec.to_string());
    let o = run(
        &[
            "spec",
            "dry-run",
            &f,
            "--mutations",
            r#"{"$.price":10,"$.qty":3}"#,
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let state: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(state, json!({"price": 10, "qty": 3, "total": 30}));
    // Key order as the contract prints it: base fields first, then derived.
    assert_eq!(
        serde_json::to_string(&state).unwrap(),
        r#"{"price":10,"qty":3,"total":30}"#
    );
}

#[test]
fn dry_run_applies_batches_and_reports_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"id":"d","schema":{"type":"object","properties":{"n":{"type":"number","maximum":10}}},
        "derivations":[{"path":"$.double","expr":"n * 2"}]});
    let f = write(&dir, "d.json", &spec.to_string());
    let o = run(
        &[
            "spec",
            "dry-run",
            &f,
            "--mutations",
            r#"[{"$.n":1},{"$.n":4}]"#,
        ],
        None,
    );
    assert_eq!(
        serde_json::from_str::<Value>(&stdout(&o)).unwrap(),
        json!({"n": 4, "double": 8})
    );
    let o = run(
        &["spec", "dry-run", &f, "--mutations", r#"{"$.n":11}"#],
        None,
    );
    assert_eq!(o.status.code(), Some(1));
    let body: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(body["error"], "Schema violation");
    assert_eq!(
        body["violations"][0],
        json!({"path": "$.n", "keyword": "maximum", "message": body["violations"][0]["message"]})
    );
    let mfile = write(&dir, "m.json", r#"{"$.n": 2}"#);
    let o = run(
        &["spec", "dry-run", &f, "--mutations", &format!("@{mfile}")],
        None,
    );
    assert_eq!(
        serde_json::from_str::<Value>(&stdout(&o)).unwrap(),
        json!({"n": 2, "double": 4})
    );
}

#[test]
fn validate_exit_codes_and_locations() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(
        &dir,
        "good.json",
        r#"{"id":"g","schema":{},"derivations":[{"path":"$.t","expr":"a+1"}]}"#,
    );
    let o = run(&["spec", "validate", &good], None);
    assert!(o.status.success(), "{}", stdout(&o));
    assert!(stdout(&o).contains("valid"));

    let bad = write(
        &dir,
        "bad.json",
        r#"{"id":"g","schema":{},"derivations":[{"path":"$.items.0.t","expr":"a +"}]}"#,
    );
    let o = run(&["spec", "validate", "--json", &bad], None);
    assert_eq!(o.status.code(), Some(1));
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(r["valid"], false);
    let errors = r["errors"].as_array().unwrap();
    assert!(
        errors.iter().any(|e| e["location"] == "derivations[0].path"
            && e["message"].as_str().unwrap().contains("$.items[0].t")),
        "{errors:?}"
    );

    let broken = write(
        &dir,
        "broken.json",
        "{\n  \"id\": \"x\",\n  \"schema\": {,\n}",
    );
    let o = run(&["spec", "validate", &broken], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("line 3"), "{}", stdout(&o));

    let o = run(&["spec", "validate", "/nonexistent/spec.json"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot read /nonexistent/spec.json"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn spec_test_human_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"id":"t","schema":{},"derivations":[{"path":"$.t","expr":"a * 2"}],
    "metaDerivations":[{"path":"$.b","property":"relevant","expr":"a > 1"}],
    "tests":[
        {"description":"doubles","given":{"$.a":2},"expect":{"$.t":4,"$.b":{"$meta":{"relevant":true}}}},
        {"description":"wrong on purpose","given":{"$.a":2},"expect":{"$.t":5}}
    ]});
    let f = write(&dir, "t.json", &spec.to_string());
    let o = run(&["spec", "test", &f], None);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(
        out.contains("PASS doubles") && out.contains("FAIL wrong on purpose"),
        "{out}"
    );
    assert!(out.contains("1 passed, 1 failed"));
    let o = run(&["spec", "test", "--json", &f], None);
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (r["total"].clone(), r["passed"].clone(), r["failed"].clone()),
        (json!(2), json!(1), json!(1))
    );
    assert_eq!(r["results"][1]["failures"][0]["path"], "$.t");
    assert_eq!(r["results"][1]["failures"][0]["expected"], 5);
    assert_eq!(r["results"][1]["failures"][0]["actual"], 4);
}

#[test]
fn eval_json_shapes() {
    let line = |args: &[&str], stdin: Option<&str>| {
        let o = run(args, stdin);
        let out = stdout(&o);
        assert_eq!(out.lines().count(), 1, "exactly one line: {out}");
        (
            o.status.code(),
            serde_json::from_str::<Value>(&out).unwrap(),
        )
    };
    assert_eq!(
        line(&["eval", "--json", "1 + 2"], None),
        (Some(0), json!({"result": 3}))
    );
    assert_eq!(
        line(&["eval", "--json", "nothing"], None),
        (Some(0), json!({}))
    );
    let (code, v) = line(&["eval", "--json", "1 + + 2"], None);
    assert_eq!(code, Some(1));
    assert_eq!(v["error"]["position"], 4);
    assert!(v["error"]["code"].as_str().unwrap().starts_with('S'));
    let (_, v) = line(
        &["eval", "--json", "price * qty", "--input", "-"],
        Some(r#"{"price": 2.5, "qty": 4}"#),
    );
    assert_eq!(v, json!({"result": 10}));
    let (_, v) = line(
        &[
            "eval",
            "--json",
            "$rate * 2",
            "--bindings",
            r#"{"rate": 0.25}"#,
        ],
        None,
    );
    assert_eq!(v, json!({"result": 0.5}));
    let (code, v) = line(&["eval", "--json", "'a' - 1"], None);
    assert_eq!(code, Some(1));
    assert_eq!(v["error"]["code"], "T2001");
}

#[test]
fn usage_errors_exit_2_and_help_explains() {
    let o = run(&["spec", "frobnicate"], None);
    assert_eq!(o.status.code(), Some(2));
    let o = run(&["spec", "dry-run", "--help"], None);
    assert!(o.status.success());
    assert!(stdout(&o).contains("--mutations"));
}

#[test]
fn every_bundled_example_validates_and_passes_its_tests() {
    let dir = repo_root().join("examples");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    let listed = stdout(&run(&["examples"], None));
    for n in &names {
        let stem = n.trim_end_matches(".json");
        assert!(
            listed.lines().any(|l| l == stem),
            "{stem} is not embedded in the binary"
        );
        let path = dir.join(n).to_string_lossy().into_owned();
        let o = run(&["spec", "validate", &path], None);
        assert!(o.status.success(), "{n}: {}", stdout(&o));
        let o = run(&["spec", "test", "--json", &path], None);
        let r: Value = serde_json::from_str(&stdout(&o)).unwrap_or(Value::Null);
        assert!(o.status.success(), "{n}: {r}");
        assert!(
            r["total"].as_u64().unwrap() >= 2,
            "{n} needs embedded tests"
        );
    }
    for required in ["insurance-quote", "car-loan-calculator"] {
        assert!(
            names.iter().any(|n| n == &format!("{required}.json")),
            "missing example {required}"
        );
    }
    assert!(
        names.len() >= 10,
        "at least 10 bundled examples, found {}",
        names.len()
    );
}
