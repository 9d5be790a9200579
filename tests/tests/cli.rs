//! The spec tooling CLI as a user runs it: real binary, real files, real exit codes.

use serde_json::{json, Value};
use valem_tests::{repo_root, run, stderr, stdout, valem_bin};

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
fn spec_test_creates_a_spec_whose_seed_leaves_a_checked_field_absent() {
    // A reference spec: the `$` rule seeds part of `q`, a rollback constraint reads the absent
    // `q.c`. Creation checks only what the seed filled, so every case runs.
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"id": "seed", "schema": {"type": "object"},
    "defaultValues": [{"path": "$", "expr": "{\"q\": {\"other\": 1}}"}],
    "derivations": [{"path": "$.d", "expr": "q.other + 1"}],
    "constraints": [{"id": "c-pos", "expr": "q.c = null or q.c > 0",
                     "message": "c must be positive", "policy": "rollback"}],
    "tests": [
        {"description": "seeded", "given": {}, "expect": {"$.q.other": 1, "$.d": 2}},
        {"description": "c written", "given": {"$.q.c": 3}, "expect": {"$.q.c": 3}},
        {"description": "c refused", "given": {"$.q.c": -3}, "expect": {"$.q.c": -3}}
    ]});
    let f = write(&dir, "seed.json", &spec.to_string());
    let o = run(&["spec", "test", "--json", &f], None);
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (r["passed"].clone(), r["failed"].clone()),
        (json!(2), json!(1)),
        "{r}"
    );
    let refused = r["results"][2]["failures"][0]["message"]
        .as_str()
        .unwrap_or("");
    assert!(refused.contains("c must be positive"), "{r}");
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

/// `valem bench --json`'s object, after checking the fields every report has (with a short
/// warm-up unless `args` give one).
fn bench_json(args: &[&str]) -> Value {
    let mut full = vec!["bench", "--json"];
    if !args.contains(&"--warmup") {
        full.extend_from_slice(&["--warmup", "0.05"]);
    }
    full.extend_from_slice(args);
    let o = run(&full, None);
    assert!(o.status.success(), "valem {full:?}: {}", stderr(&o));
    let r: Value = serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("valem {full:?}: not one JSON object ({e}): {}", stdout(&o)));
    for k in [
        "shape",
        "n",
        "nodes",
        "jit",
        "compile_ms",
        "first_cycle_ms",
        "warmup_mutations",
        "warmup_ms",
        "mutations",
        "rejected",
        "p50_us",
        "p90_us",
        "p99_us",
        "max_us",
        "mean_us",
        "mutations_per_s",
        "recomputed_per_mutation",
        "derived_updated_per_mutation",
        "rss_mb",
        "peak_rss_mb",
        "huge_pages",
    ] {
        assert!(r.get(k).is_some(), "{full:?}: no `{k}` in {r}");
    }
    let (p50, p90, p99, max) = (
        r["p50_us"].as_f64().unwrap(),
        r["p90_us"].as_f64().unwrap(),
        r["p99_us"].as_f64().unwrap(),
        r["max_us"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p90 && p90 <= p99 && p99 <= max, "{r}");
    assert!(r["rss_mb"].as_f64().unwrap() > 1.0, "{r}");
    r
}

#[test]
fn bench_shapes_report_what_each_mutation_recomputes() {
    let r = bench_json(&["--shape", "fanout", "--n", "500", "--count", "50"]);
    assert_eq!(
        (r["shape"].as_str(), r["n"].as_u64()),
        (Some("fanout"), Some(500))
    );
    assert_eq!(r["mutations"], 50);
    assert_eq!(r["nodes"], 500);
    // One price written: its one total, nothing else.
    assert_eq!(r["recomputed_per_mutation"], 1.0);
    assert_eq!(r["derived_updated_per_mutation"], 1.0);

    let r = bench_json(&[
        "--shape", "chain", "--n", "300", "--count", "20", "--jit", "off",
    ]);
    assert_eq!(r["jit"], false);
    assert_eq!(
        r["recomputed_per_mutation"], 300.0,
        "a seed write recomputes the chain"
    );

    let r = bench_json(&["--shape", "items", "--n", "200", "--count", "30"]);
    // One qty written: that item's total and the sum.
    assert_eq!(r["derived_updated_per_mutation"], 2.0, "{r}");

    let r = bench_json(&["--shape", "mixed", "--n", "100", "--count", "60"]);
    assert!(
        r["rejected"].as_u64().unwrap() > 0,
        "the discount cap rolls some back: {r}"
    );
    assert!(r["rejected"].as_u64().unwrap() < 60, "{r}");

    // The table: one line per measurement.
    let o = run(
        &["bench", "--shape", "chain", "--n", "50", "--count", "5"],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let t = stdout(&o);
    for label in [
        "compile",
        "first cycle",
        "warm-up",
        "latency",
        "recomputed",
        "memory",
    ] {
        assert!(
            t.lines().any(|l| l.starts_with(label)),
            "no `{label}` line in\n{t}"
        );
    }
    // Not a terminal: no progress bar on stderr.
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
}

#[test]
fn bench_runs_every_bundled_example_and_a_mutations_file() {
    let listed = stdout(&run(&["examples"], None));
    for name in listed.lines().filter(|l| !l.trim().is_empty()) {
        let spec = format!("example:{name}");
        let r = bench_json(&["--spec", &spec, "--count", "40"]);
        assert_eq!(r["shape"], "spec");
        assert_eq!(r["spec"], spec.as_str());
        assert_eq!(r["mutations"], 40, "{name}: {r}");
        assert!(
            r["rejected"].as_u64().unwrap() < 40,
            "{name}: every generated write was refused: {r}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let m = write(
        &dir,
        "m.json",
        r#"[{"$.price": 3, "$.qty": 4}, {"$.qty": 5}]"#,
    );
    let r = bench_json(&["--spec", "example:demo", "--mutations", &m, "--count", "4"]);
    assert_eq!(r["mutations"], 4);
    assert_eq!(r["rejected"], 0);
    // 3*4, then 3*5, then 3*4 again...: every cycle changes the total.
    assert_eq!(r["derived_updated_per_mutation"], 1.0, "{r}");
}

#[test]
fn bench_bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--n".into(), "0".into()], "--n must be at least 1"),
        (
            vec!["--spec".into(), "example:nope".into()],
            "no bundled example `nope`",
        ),
        (
            vec![
                "--spec".into(),
                "example:demo".into(),
                "--mutations".into(),
                write(&dir, "bad.json", r#"{"$.price": 1}"#),
            ],
            "expected a JSON array",
        ),
        (
            vec![
                "--spec".into(),
                "example:demo".into(),
                "--mutations".into(),
                write(&dir, "bad2.json", "[{\"$.price\": 1}, 7]"),
            ],
            "[1] is not a non-empty object",
        ),
        (
            vec!["--max-seconds=0".into()],
            "--max-seconds must be a positive",
        ),
        (
            vec!["--warmup=-1".into()],
            "--warmup must be zero or a positive number of seconds; got -1",
        ),
        (vec!["--warmup=nan".into()], "--warmup must be zero"),
    ];
    for (args, want) in cases {
        let mut full = vec!["bench"];
        full.extend(args.iter().map(String::as_str));
        let o = run(&full, None);
        assert_eq!(o.status.code(), Some(1), "{full:?}");
        assert!(stderr(&o).contains(want), "{full:?}: {}", stderr(&o));
    }
    // --mutations without --spec is a usage error.
    let o = run(&["bench", "--mutations", "x.json"], None);
    assert_eq!(o.status.code(), Some(2));
}

/// Untimed mutations run for `--warmup` seconds (1 by default) before the timed ones, which
/// keep their count; `--warmup 0` runs none.
#[test]
fn bench_warms_up_for_the_time_given_before_timing() {
    let args = ["--shape", "fanout", "--n", "100", "--count", "25"];
    let by_default = {
        let mut full = vec!["bench", "--json"];
        full.extend_from_slice(&args);
        let o = run(&full, None);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<Value>(stdout(&o).trim()).unwrap()
    };
    let given = bench_json(&[&args[..], &["--warmup", "0.3"]].concat());
    let none = bench_json(&[&args[..], &["--warmup", "0"]].concat());
    for (r, least_ms) in [(&by_default, 1000.0), (&given, 300.0)] {
        assert!(r["warmup_ms"].as_f64().unwrap() >= least_ms, "{r}");
        // Far more than were timed: a 100-derivation model mutates in microseconds.
        assert!(r["warmup_mutations"].as_u64().unwrap() > 1000, "{r}");
        assert_eq!(r["mutations"], 25, "{r}");
    }
    assert_eq!(none["warmup_mutations"], 0, "{none}");
    assert_eq!(none["mutations"], 25, "{none}");
}

/// `valem bench ARGS`, successful, with its temporary files under `tmp`.
fn bench_in(tmp: &std::path::Path, args: &[&str]) -> std::process::Output {
    let o = std::process::Command::new(valem_bin())
        .arg("bench")
        .args(args)
        .env("TMPDIR", tmp)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

#[test]
fn bench_durable_goes_through_a_store_and_removes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bench_in(
        tmp.path(),
        &[
            "--json",
            "--durable",
            "--shape",
            "items",
            "--n",
            "50",
            "--count",
            "20",
        ],
    );
    let r: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((&r["service"], &r["durable"]), (&json!(true), &json!(true)));
    assert_eq!(
        (r["mutations"].as_u64(), r["rejected"].as_u64()),
        (Some(20), Some(0))
    );
    assert_eq!(r["derived_updated_per_mutation"], 2.0, "{r}");
    // The store lived in a temporary directory under TMPDIR, and is gone.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let r = bench_json(&["--shape", "chain", "--n", "20", "--count", "3"]);
    assert_eq!(
        (&r["service"], &r["durable"]),
        (&json!(false), &json!(false))
    );
}

/// `--service` commits through the model service in memory, as the daemon does: same
/// recomputation as the engine alone, and nothing written to disk.
#[test]
fn bench_service_goes_through_the_service_in_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bench_in(
        tmp.path(),
        &[
            "--service",
            "--shape",
            "fanout",
            "--n",
            "200",
            "--count",
            "50",
        ],
    );
    assert!(
        stdout(&o).contains("through the service, in memory"),
        "{}",
        stdout(&o)
    );
    let r = bench_json(&[
        "--service",
        "--shape",
        "fanout",
        "--n",
        "200",
        "--count",
        "50",
    ]);
    assert_eq!(
        (&r["service"], &r["durable"]),
        (&json!(true), &json!(false))
    );
    assert_eq!(
        (r["mutations"].as_u64(), r["rejected"].as_u64()),
        (Some(50), Some(0))
    );
    assert_eq!(r["recomputed_per_mutation"], 1.0, "{r}");
    assert_eq!(r["derived_updated_per_mutation"], 1.0, "{r}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "written to disk: {left:?}");
}

/// The allocator asks for transparent huge pages only when the environment says so
/// (`MIMALLOC_ALLOW_THP=1`); `valem bench` reports which it ran with.
#[test]
fn bench_reports_huge_pages_off_unless_the_environment_asks() {
    for (env, want) in [(None, false), (Some("1"), true), (Some("0"), false)] {
        let mut cmd = std::process::Command::new(valem_bin());
        cmd.args([
            "bench", "--json", "--shape", "fanout", "--n", "10", "--count", "5",
        ]);
        cmd.current_dir(repo_root())
            .env_remove("MIMALLOC_ALLOW_THP");
        if let Some(v) = env {
            cmd.env("MIMALLOC_ALLOW_THP", v);
        }
        let o = cmd.output().expect("run valem bench");
        assert!(o.status.success(), "{env:?}: {}", stderr(&o));
        let r: Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
        assert_eq!(
            r["huge_pages"],
            json!(want),
            "MIMALLOC_ALLOW_THP={env:?}: {r}"
        );
    }
}
