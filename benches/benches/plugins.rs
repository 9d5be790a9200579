//! Plugin call overhead through the C ABI and blob-store throughput. Issue 7 target: ≤ 2 µs for
//! a small JSON round trip through the ABI.
//!
//! - `abi_direct/*`: one call through the table on this thread. The host serialises the request,
//!   the plugin's shim parses it, runs the trait method and serialises the answer, and the host
//!   copies it, frees it and parses it.
//! - `pooled/*`: the same call as the daemon makes it: on the plugin's own thread, with the
//!   timeout.
//! - `blob_fs/*`: 1 MiB blobs through `call_bytes` (raw bytes, no base64) into the blob-fs plugin
//!   on a temporary directory. A put is fsynced.
//!
//! Needs the release plugin libraries (`cargo build --release --workspace`); skipped without them.
//! A workspace build unifies serde_json's `preserve_order` (which the daemon needs) into every
//! plugin; a team's plugin, built on its own against `valem-sdk`, does not have it. To measure
//! that build, run `cargo build --release -p valem-test-plugin-faulty` last.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::json;
use valem_service::plugins::{Kind, Options, Plugins};

// The daemon's allocator, so the host side costs what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn release_lib(name: &str) -> Option<PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(format!("lib{name}.so"));
    if p.is_file() {
        return Some(p);
    }
    eprintln!(
        "plugins bench: {} not found (cargo build --release --workspace); skipped",
        p.display()
    );
    None
}

fn plugins(c: &mut Criterion) {
    valem::allocator::configure();
    let (Some(faulty), Some(blob_fs)) = (
        release_lib("valem_test_plugin_faulty"),
        release_lib("valem_blob_fs"),
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let p = Plugins::load(&Options {
        paths: vec![faulty, blob_fs],
        data_dir: Some(dir.path().to_path_buf()),
        ..Options::default()
    });
    assert!(p.failures().is_empty(), "{:?}", p.failures());
    let guidance = p
        .of_kind(Kind::Guidance)
        .next()
        .expect("built-in guidance")
        .clone();
    let tools = p
        .of_kind(Kind::Tool)
        .next()
        .expect("the faulty plugin")
        .clone();
    let blobs = p.of_kind(Kind::BlobStore).next().expect("blob-fs").clone();

    let echo = json!({"name": "echo", "arguments": {"id": "demo", "path": "$.qty", "by": 1}});
    let r = tools.call_direct("tools.call", &echo).expect("echo");
    assert_eq!(r["echo"]["by"], 1);
    let first = guidance
        .call_direct("topics.list", json!({}))
        .expect("topics")[0]["id"]
        .as_str()
        .expect("an id")
        .to_string();
    let topic = json!({"id": first});
    let text = guidance.call_direct("topics.get", &topic).expect("topic");
    println!(
        "plugins: the echo answer is {} bytes of JSON; topic `{first}` is {} bytes",
        serde_json::to_vec(&r).map(|v| v.len()).unwrap_or(0),
        serde_json::to_vec(&text).map(|v| v.len()).unwrap_or(0)
    );

    let mut g = c.benchmark_group("plugins");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("abi_direct/tool_echo_small_json", |b| {
        b.iter(|| black_box(tools.call_direct("tools.call", &echo).unwrap()))
    });
    g.bench_function("abi_direct/guidance_topics_get", |b| {
        b.iter(|| black_box(guidance.call_direct("topics.get", &topic).unwrap()))
    });
    g.bench_function("pooled/tool_echo_small_json", |b| {
        b.iter(|| black_box(tools.call("tools.call", &echo).unwrap()))
    });
    g.bench_function("pooled/guidance_topics_get", |b| {
        b.iter(|| black_box(guidance.call("topics.get", &topic).unwrap()))
    });
    g.finish();

    let mut g = c.benchmark_group("blob_fs");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Bytes(1 << 20));
    let mut seq = 0u64;
    g.bench_function("put_1MiB_fsynced", |b| {
        b.iter(|| {
            // A new blob each time (a known id is a no-op): its last 8 bytes are a counter.
            seq += 1;
            let mut data = vec![7u8; 1 << 20];
            data[(1 << 20) - 8..].copy_from_slice(&seq.to_le_bytes());
            let id = blake3_hex(&data);
            blobs
                .call_bytes("blob.put", json!({"id": id}), Arc::from(data))
                .unwrap()
        })
    });
    let data = vec![9u8; 1 << 20];
    let id = blake3_hex(&data);
    blobs
        .call_bytes("blob.put", json!({"id": id}), Arc::from(data))
        .expect("put");
    g.bench_function("get_1MiB", |b| {
        b.iter(|| {
            let got = blobs
                .call_bytes("blob.get", json!({"id": id}), Arc::from([]))
                .unwrap();
            assert_eq!(got.len(), 1 << 20);
            got
        })
    });
    g.finish();
}

fn blake3_hex(b: &[u8]) -> String {
    blake3::hash(b).to_hex().to_string()
}

criterion_group!(benches, plugins);
criterion_main!(benches);
