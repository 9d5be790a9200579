//! Hash flooding (issue 30), end to end: one REST write of a wide object whose member names were
//! crafted to collide under the daemon's old unkeyed hash (whole 64-bit collisions, and
//! collisions of the low 32 bits) costs about what the same number of names that do not collide
//! costs. With the old hash the crafted write was quadratic: 60k names took 14.3 s against 0.19 s.
//! The low-half names share their first 40 bytes, which makes sorting them (the audit record's
//! canonical JSON) slower whatever the hash, so they are compared with names of that shape.
//!
//! `VALEM_FLOOD_KEYS` sets the names per write (default 16,000); with `VALEM_BIN` pointing at a
//! release binary this is the acceptance measurement (`--nocapture` prints the times).

use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use serde_json::json;
use valem_tests::flood::{
    allowed, fx_str, low_half_collisions, low_half_like, random_names, whole_collisions, KEY_LEN,
};
use valem_tests::Daemon;

/// A crafted write may take at most this many times a write of as many names that do not
/// collide.
const MAX_RATIO: f64 = 3.0;

fn names_per_write() -> usize {
    std::env::var("VALEM_FLOOD_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16_000)
}

/// The generator's names are what it says they are, by the real FxHash.
fn check_names(whole: &[String], low: &[String], like: &[String], random: &[String], n: usize) {
    let fx = |s: &String| rustc_hash::FxBuildHasher.hash_one(s.as_str());
    for set in [whole, low, like, random] {
        assert_eq!(set.len(), n);
        assert!(set
            .iter()
            .all(|k| k.len() == KEY_LEN && k.bytes().all(allowed)));
        let mut distinct: Vec<&String> = set.iter().collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "distinct names");
    }
    let h = fx(&whole[0]);
    assert!(whole.iter().all(|k| fx(k) == h && fx_str(k) == h));
    let low32 = fx(&low[0]) as u32;
    assert!(low
        .iter()
        .all(|k| fx(k) as u32 == low32 && fx_str(k) == fx(k)));
    let mut highs: Vec<u64> = low.iter().map(fx).collect();
    highs.sort_unstable();
    highs.dedup();
    assert_eq!(highs.len(), n, "low-half names differ in their whole hash");
    assert!(random.iter().take(100).all(|k| fx_str(k) == fx(k)));
    assert_eq!(like[0][..40], low[0][..40], "the same shape");
    let mut lows: Vec<u32> = like.iter().map(|k| fx(k) as u32).collect();
    lows.sort_unstable();
    lows.dedup();
    assert!(
        lows.len() > n * 9 / 10,
        "names shaped alike collide no more than random ones"
    );
}

/// One model per write, each written once: `{"$.obj": {name: i, …}}`; the time of the write.
struct Writer {
    agent: ureq::Agent,
    base: String,
}

impl Writer {
    fn post(&self, path: &str, body: String) -> (u16, String) {
        let r = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body)
            .expect("the daemon answered");
        let status = r.status().as_u16();
        let text = r
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .unwrap_or_default();
        (status, text)
    }

    fn model(&self, id: &str) {
        let spec = json!({"id": id, "schema": {"type": "object"}});
        let (status, text) = self.post("/models", spec.to_string());
        assert_eq!(status, 201, "{text}");
        let (status, text) = self.post(
            &format!("/models/{id}/mutations"),
            json!({"$.warm": 1}).to_string(),
        );
        assert_eq!(status, 200, "{text}");
    }

    fn write(&self, id: &str, names: &[String]) -> Duration {
        let mut body = String::with_capacity(names.len() * (KEY_LEN + 12) + 16);
        body.push_str("{\"$.obj\":{");
        for (i, k) in names.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            // The names need no escaping (`allowed`).
            body.push('"');
            body.push_str(k);
            body.push_str("\":");
            body.push_str(&i.to_string());
        }
        body.push_str("}}");
        let started = Instant::now();
        let (status, text) = self.post(&format!("/models/{id}/mutations"), body);
        let took = started.elapsed();
        assert_eq!(status, 200, "{}", &text[..text.len().min(500)]);
        took
    }
}

#[test]
fn crafted_member_names_cost_what_random_ones_do() {
    let n = names_per_write();
    let whole = whole_collisions(n);
    let low = low_half_collisions(n);
    let like = low_half_like(n, 3);
    let random = random_names(n, 1);
    let random_again = random_names(n, 2);
    check_names(&whole, &low, &like, &random, n);

    let d = Daemon::start(&[
        "--max-body-bytes",
        &(64usize << 20).to_string(),
        "--request-timeout",
        "3600",
    ]);
    let w = Writer {
        agent: ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(Duration::from_secs(3600)))
            .build()
            .into(),
        base: d.url(""),
    };
    let sets: [(&str, &[String]); 5] = [
        ("random", &random),
        ("whole-64", &whole),
        ("low-32", &low),
        ("low-32-shaped", &like),
        ("random-2", &random_again),
    ];
    for (id, _) in sets {
        w.model(id);
    }
    let times: Vec<(&str, Duration)> = sets
        .iter()
        .map(|&(id, names)| (id, w.write(id, names)))
        .collect();
    for (id, t) in &times {
        eprintln!("{n} names, {id}: {:.3} s", t.as_secs_f64());
    }
    let secs = |id: &str| {
        times
            .iter()
            .find(|(i, _)| *i == id)
            .map_or(0.0, |(_, t)| t.as_secs_f64())
    };
    let random_secs = (secs("random") + secs("random-2")) / 2.0;
    eprintln!(
        "low-32 / random: {:.2}",
        secs("low-32") / random_secs.max(1e-6)
    );
    for (crafted, baseline, base_secs) in [
        ("whole-64", "random", random_secs),
        ("low-32", "low-32-shaped", secs("low-32-shaped")),
    ] {
        let ratio = secs(crafted) / base_secs.max(1e-6);
        eprintln!("{crafted} / {baseline}: {ratio:.2}");
        assert!(
            ratio < MAX_RATIO,
            "{n} {crafted} names took {:.3} s, {ratio:.1} times the {base_secs:.3} s of {baseline} ones",
            secs(crafted)
        );
    }
    // The written object holds every name.
    let r = valem_tests::Http::new(&d).get("/models/whole-64/state");
    assert_eq!(r.status, 200, "{r:?}");
    let state = r.json();
    let obj = state
        .get("state")
        .or(Some(&state))
        .and_then(|s| s.get("obj"))
        .and_then(|o| o.as_object())
        .unwrap_or_else(|| panic!("no $.obj in the state"));
    assert_eq!(obj.len(), n);
    assert_eq!(obj.get(&whole[n / 2]), Some(&json!(n / 2)));
}
