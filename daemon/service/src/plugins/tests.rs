use std::time::{Duration, Instant};

use super::pool::{PluginError, Pool, MAX_THREADS};
use super::*;

#[test]
fn a_call_that_never_returns_times_out_and_the_pool_stays_usable() {
    let pool = Pool::new(Duration::from_millis(100));
    let t = Instant::now();
    let r: Result<(), _> = pool.run(
        || {
            std::thread::sleep(Duration::from_secs(3600));
            Ok(())
        },
        "p",
        "hang",
    );
    assert!(matches!(r, Err(PluginError::Timeout { .. })), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // The stuck thread does not hold up the next call.
    assert_eq!(pool.run(|| Ok(7), "p", "echo"), Ok(7));
}

#[test]
fn once_max_threads_calls_are_stuck_further_calls_are_refused_at_once() {
    let pool = Pool::new(Duration::from_millis(20));
    for _ in 0..MAX_THREADS {
        let r: Result<(), _> = pool.run(
            || {
                std::thread::sleep(Duration::from_secs(3600));
                Ok(())
            },
            "p",
            "hang",
        );
        assert!(matches!(r, Err(PluginError::Timeout { .. })));
    }
    let r = pool.run(|| Ok(1), "p", "echo");
    assert!(
        matches!(r, Err(PluginError::Stuck { running, .. }) if running == MAX_THREADS),
        "{r:?}"
    );
}

#[test]
fn the_builtin_guidance_plugin_loads_through_the_abi_and_lists_its_topics() {
    let p = Plugins::load(&Options::default());
    assert!(p.failures().is_empty(), "{:?}", p.failures());
    let g = p
        .of_kind(Kind::Guidance)
        .next()
        .expect("the built-in guidance plugin");
    assert_eq!(g.name, valem_plugin_guidance::NAME);
    assert_eq!(g.origin, Origin::BuiltIn);
    let list = g.call("topics.list", json!({})).expect("topics.list");
    let ids: Vec<&str> = list
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    let direct = valem_plugin_guidance::topics().expect("topics");
    assert_eq!(
        ids,
        direct.iter().map(|t| t.id.as_str()).collect::<Vec<_>>()
    );
    let one = g
        .call("topics.get", json!({"id": direct[0].id}))
        .expect("topics.get");
    assert_eq!(one["instructions"], json!(direct[0].instructions));
    let missing = g.call("topics.get", json!({"id": "no-such-topic"}));
    assert!(
        matches!(&missing, Err(PluginError::Failed { code, .. }) if code == "not_found"),
        "{missing:?}"
    );
    let unknown = g.call("nope", json!({}));
    assert!(
        matches!(&unknown, Err(PluginError::Failed { code, .. }) if code == "unknown_method"),
        "{unknown:?}"
    );
}

#[test]
fn load_failures_name_the_path_and_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("libnot_a_library.so");
    std::fs::write(&text, "this is text, not ELF").expect("write");
    let opts = Options {
        paths: vec![dir.path().join("missing.so"), text.clone()],
        builtin_guidance: false,
        ..Options::default()
    };
    let p = Plugins::load(&opts);
    assert!(p.loaded().is_empty());
    let f = p.failures();
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(
        f[0].error.contains("cannot read") && f[0].error.contains("missing.so"),
        "{}",
        f[0].error
    );
    assert_eq!(f[1].path, text);
    assert!(
        f[1].error.contains("not a loadable library"),
        "{}",
        f[1].error
    );
}
