//! Plugins from the operator's and the plugin author's side: `valem plugins list` and
//! `GET /plugins` name every plugin and every failure; the example-guidance README, followed
//! from `cargo new --lib`, gives a library the daemon loads. (MCP behaviour through the official
//! SDK clients is in tests/clients/python/test_plugins.py.)

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use valem_tests::{repo_root, run, stderr, stdout, valem_bin, Daemon};

fn lib(name: &str) -> String {
    let p = valem_bin()
        .parent()
        .expect("target/<profile>")
        .join(format!("lib{name}.so"));
    assert!(
        p.is_file(),
        "{} is missing: cargo build --workspace",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

#[test]
fn plugins_list_names_each_plugin_what_it_provides_and_each_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("libtext.so");
    std::fs::write(&text, "text").expect("write");
    let (guidance, tool, text) = (
        lib("example_guidance"),
        lib("example_tool"),
        text.to_string_lossy().into_owned(),
    );
    let o = run(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin",
            &guidance,
            "--plugin",
            &tool,
            "--plugin",
            &text,
            "--plugin",
            "/no/such/libplugin.so",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(1), "failures exit 1: {}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    let loaded = v["loaded"].as_array().expect("loaded");
    let names: Vec<&str> = loaded.iter().filter_map(|p| p["name"].as_str()).collect();
    assert_eq!(
        names,
        ["valem-guidance", "example-guidance", "example-tool"]
    );
    assert_eq!(loaded[0]["builtIn"], true);
    assert_eq!(loaded[1]["kind"], "guidance");
    assert_eq!(loaded[1]["path"].as_str(), Some(guidance.as_str()));
    assert_eq!(
        loaded[1]["provides"],
        serde_json::json!(["loan_amortization", "credit_limits"])
    );
    assert_eq!(
        loaded[2]["provides"],
        serde_json::json!(["example_tool__increment"])
    );
    assert!(loaded[2]["rustcVersion"]
        .as_str()
        .is_some_and(|r| r.starts_with("rustc ")));
    let failed = v["failed"].as_array().expect("failed");
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(failed[0]["error"]
        .as_str()
        .is_some_and(|e| e.contains("not a loadable library") && e.contains("libtext.so")));
    assert!(failed[1]["error"]
        .as_str()
        .is_some_and(|e| e.contains("No such file")));
    // Only the built-ins: exit 0; with a data directory the blob store is one too.
    let o = run(&["plugins", "list"], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("valem-guidance"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("valem-blobs"), "{}", stdout(&o));
    let data = dir.path().join("data");
    let data = data.to_string_lossy();
    let o = run(&["plugins", "list", "--json", "--data-dir", &data], None);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(v["loaded"][1]["name"], "valem-blobs");
    assert_eq!(v["loaded"][1]["kind"], "blob_store");
    assert_eq!(v["loaded"][1]["builtIn"], true);
}

#[test]
fn wrong_abi_version_a_small_table_and_no_table_are_refused_with_the_reason() {
    let raw = lib("valem_test_plugin_raw");
    for (mode, want) in [
        (
            "abi99",
            "plugin ABI version 99; this daemon loads version 1",
        ),
        ("small", "its table is 8 bytes"),
        ("null", "returned no table"),
    ] {
        let o = Command::new(valem_bin())
            .args(["plugins", "list", "--json", "--plugin", &raw])
            .env("VALEM_TEST_RAW_MODE", mode)
            .output()
            .expect("valem runs");
        assert_eq!(o.status.code(), Some(1), "{mode}");
        let v: Value = serde_json::from_slice(&o.stdout).expect("JSON");
        let e = v["failed"][0]["error"].as_str().unwrap_or_default();
        assert!(e.contains(want), "{mode}: {e}");
    }
}

#[test]
fn the_daemon_lists_its_plugins_and_load_failures_at_get_plugins() {
    let tool = lib("example_tool");
    let d = Daemon::start(&["--plugin", &tool, "--plugin", "/no/such/lib.so"]);
    let r = valem_tests::Http::new(&d).get("/plugins");
    assert_eq!(r.status, 200);
    let v = r.json();
    let names: Vec<&str> = v["loaded"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(names, ["valem-guidance", "example-tool"]);
    assert_eq!(v["failed"][0]["path"], "/no/such/lib.so");
    let needle = "plugin /no/such/lib.so not loaded";
    let stderr = d.stderr_with(needle);
    assert!(stderr.contains(needle), "{stderr}");
}

/// The Rust code block after `src/lib.rs` in plugins/example-guidance/README.md.
fn readme_lib_rs() -> String {
    let readme = std::fs::read_to_string(repo_root().join("plugins/example-guidance/README.md"))
        .expect("the README");
    let after = readme
        .split("`src/lib.rs`:")
        .nth(1)
        .expect("a `src/lib.rs`: section");
    let code = after.split("```rust\n").nth(1).expect("a rust block");
    code.split("\n```").next().expect("its end").to_string()
}

#[test]
fn the_readme_takes_a_team_from_cargo_new_to_a_loaded_plugin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(&cargo)
        .args(["new", "--lib", "--vcs", "none", "lending-guidance"])
        .current_dir(dir.path())
        .output()
        .expect("cargo new");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let krate = dir.path().join("lending-guidance");
    let manifest = krate.join("Cargo.toml");
    let mut toml = std::fs::read_to_string(&manifest).expect("Cargo.toml");
    let sdk = repo_root().join("sdk");
    // What the README says to add, with this checkout's sdk/ as the path.
    toml = toml.replace(
        "[dependencies]",
        &format!(
            "[lib]\ncrate-type = [\"cdylib\"]\n\n[dependencies]\nvalem-sdk = {{ path = {:?} }}",
            sdk.display().to_string()
        ),
    );
    std::fs::write(&manifest, toml).expect("write Cargo.toml");
    std::fs::write(krate.join("src/lib.rs"), readme_lib_rs()).expect("write lib.rs");
    // This workspace's lock file: the same dependency versions, nothing new to fetch.
    std::fs::copy(repo_root().join("Cargo.lock"), krate.join("Cargo.lock")).expect("lock");
    // Its own target directory (kept between runs): no wait on the workspace's build lock.
    let target: PathBuf = repo_root().join("target").join("readme-plugin");
    let o = Command::new(&cargo)
        .args(["build", "--quiet"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&krate)
        .output()
        .expect("cargo build");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let so = target.join("debug/liblending_guidance.so");
    let so = so.to_string_lossy();
    let o = run(&["plugins", "list", "--json", "--plugin", &so], None);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(v["loaded"][1]["name"], "lending-guidance");
    assert_eq!(
        v["loaded"][1]["provides"],
        serde_json::json!(["loan_amortization"])
    );
}
