//! The cost of `subscriptions/listen` fan-out (MCP 2026-07-28) on the release `valem serve`
//! over loopback: one model (the demo, `$.total = price * qty`, in memory), `LISTENERS` open
//! listen streams, and one writer committing `POST /models/demo/mutations`, one commit at a
//! time (REST, the cheapest surface: which surface commits does not change what the listeners
//! get, and `--bench http` compares the surfaces). Per commit:
//! - commit: the writer's round trip (the shard publishes to the listeners before it replies);
//! - first / all: from sending the commit until the first / the last listener has read its
//!   `notifications/resources/updated` off its SSE stream.
//!
//! Three cases, alternating in rounds (a noisy neighbour hits them alike): no listener;
//! `LISTENERS` streams on another model's URI (their connections are open and each commit runs
//! their filters, but nothing is sent: this separates what open connections cost the writer —
//! the daemon stops polling for a shard's answer once it has more connections than reactor
//! threads — from the fan-out itself); `LISTENERS` streams on the written model. After each
//! case the streams are closed and the bench checks that the daemon let go of them
//! (`valem_mcp_listens`, `valem_event_subscribers`).
//!
//! The listeners are read by one thread (a current-thread tokio runtime, one task per stream)
//! that stamps each notification as it reads it; the writer is a keep-alive client
//! (`valem_tests::load::Conn`). Fixed rounds print p50/p99 first; the criterion group then
//! tracks the commit with 0 and `LISTENERS` listeners and the time until all have it. Needs
//! `target/release/valem` (or `VALEM_BIN`).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use valem_benches::modern;
use valem_tests::load::Conn;

/// Listen streams per case.
const LISTENERS: usize = 100;

const DEMO: &str = r#"{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;
const OTHER: &str = r#"{"id":"other","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;

/// How long any one wait may take before the bench gives up (loudly).
const PATIENCE: Duration = Duration::from_secs(10);

/// A group of open listen streams, read on their own thread; dropping it closes them.
struct Listeners {
    /// When each `notifications/resources/updated` was read, in arrival order.
    arrivals: mpsc::Receiver<Instant>,
    /// Notifications each commit of the written model brings (0 when listening elsewhere).
    per_commit: usize,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Listeners {
    /// `n` streams listening to `uri`; returns once every one has been acknowledged.
    fn open(addr: &str, uri: &str, n: usize, written: bool) -> Listeners {
        let (tx, arrivals) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let body = modern::listen(1, &[uri]).to_string();
        let mut head = format!("POST /mcp HTTP/1.1\r\nHost: {addr}\r\n");
        for (k, v) in modern::headers("subscriptions/listen", None) {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        let request = format!("{head}Content-Length: {}\r\n\r\n{body}", body.len());
        let addr = addr.to_string();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let mut streams = Vec::with_capacity(n);
                for i in 0..n {
                    match tokio::time::timeout(PATIENCE, subscribe(&addr, &request)).await {
                        Ok(Ok(s)) => streams.push(s),
                        Ok(Err(e)) => {
                            let _ = ready_tx.send(Err(format!("listener {i}: {e}")));
                            return;
                        }
                        Err(_) => {
                            let _ = ready_tx.send(Err(format!("listener {i}: no acknowledgement")));
                            return;
                        }
                    }
                }
                for s in streams {
                    tokio::spawn(read_notices(s, tx.clone()));
                }
                let _ = ready_tx.send(Ok(()));
                let _ = stopped.await;
            });
            // Dropping the runtime drops the tasks and so closes every stream.
        });
        match ready_rx.recv_timeout(PATIENCE * 3) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("opening the listen streams: {e}"),
            Err(e) => panic!("opening the listen streams: {e}"),
        }
        Listeners {
            arrivals,
            per_commit: if written { n } else { 0 },
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Open one listen stream and read up to its acknowledgement.
async fn subscribe(addr: &str, request: &str) -> std::io::Result<BufReader<TcpStream>> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(request.as_bytes()).await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    if !line.starts_with("HTTP/1.1 200") {
        return Err(std::io::Error::other(format!("listen answered {line:?}")));
    }
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::other(
                "the stream ended before its acknowledgement",
            ));
        }
        if line.starts_with("data:") {
            if line.contains("notifications/subscriptions/acknowledged") {
                return Ok(r);
            }
            return Err(std::io::Error::other(format!(
                "not an acknowledgement: {line}"
            )));
        }
    }
}

/// Stamp every `notifications/resources/updated` the stream brings (SSE `data:` lines inside
/// the chunked body) until it ends.
async fn read_notices(mut r: BufReader<TcpStream>, tx: mpsc::Sender<Instant>) {
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.starts_with("data:") && line.contains("notifications/resources/updated") {
            let _ = tx.send(Instant::now());
        }
    }
}

/// The writer: REST mutations of the demo model over one keep-alive connection.
struct Writer {
    conn: Conn,
    i: usize,
}

/// One commit's times, µs: the writer's round trip; until the first and the last listener has
/// read its notification (0 without listeners on the written model).
#[derive(Clone, Copy)]
struct Sample {
    commit: f64,
    first: f64,
    all: f64,
}

impl Writer {
    fn open(addr: &str) -> Writer {
        Writer {
            conn: Conn::open(addr).expect("the writer connects"),
            i: 0,
        }
    }

    /// One commit, and the wait for what it brings the listeners.
    fn commit(&mut self, listeners: Option<&Listeners>) -> Sample {
        if let Some(l) = listeners {
            let stray = l.arrivals.try_iter().count();
            assert_eq!(stray, 0, "a notification arrived that no commit explains");
        }
        self.i += 1;
        let body = json!({"$.price": self.i, "$.qty": 3}).to_string();
        let t0 = Instant::now();
        let r = self
            .conn
            .request(
                "POST",
                "/models/demo/mutations",
                &[("Content-Type", "application/json")],
                body.as_bytes(),
            )
            .expect("the commit's round trip");
        let commit = t0.elapsed();
        assert_eq!(
            r.status,
            200,
            "commit {}: {}",
            self.i,
            String::from_utf8_lossy(&r.body)
        );
        let (mut first, mut last) = (None::<Instant>, None::<Instant>);
        for _ in 0..listeners.map_or(0, |l| l.per_commit) {
            let l = listeners.expect("listeners");
            let t = l
                .arrivals
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|e| panic!("commit {}: a listener got nothing: {e}", self.i));
            first = Some(first.map_or(t, |f| f.min(t)));
            last = Some(last.map_or(t, |f| f.max(t)));
        }
        let us = |t: Option<Instant>| t.map_or(0.0, |t| (t - t0).as_secs_f64() * 1e6);
        Sample {
            commit: commit.as_secs_f64() * 1e6,
            first: us(first),
            all: us(last),
        }
    }
}

/// The release daemon with the demo model and another one.
fn daemon() -> Option<valem_benches::Serve> {
    let bin = valem_benches::release_valem("the listen bench")?;
    let d = valem_benches::Serve::start(&bin, &[])?;
    let mut c = Conn::open(&d.addr).ok()?;
    for spec in [DEMO, OTHER] {
        let r = c
            .request(
                "POST",
                "/models",
                &[("Content-Type", "application/json")],
                spec.as_bytes(),
            )
            .ok()?;
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    }
    Some(d)
}

/// A gauge of the daemon's `/metrics`.
fn gauge(addr: &str, name: &str) -> usize {
    let mut c = Conn::open(addr).expect("connect");
    let r = c.request("GET", "/metrics", &[], b"").expect("/metrics");
    let prefix = format!("{name} ");
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_string))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} gauge"))
}

/// Close `l`, wait until the daemon has let go of its streams, and write the demo model once:
/// a closed stream's service subscriber leaves at the next commit of any model. Then the
/// service has `subscribers` (its count before `l` opened) again, so the next case starts
/// without them.
fn close(addr: &str, l: Listeners, subscribers: usize) {
    drop(l);
    let start = Instant::now();
    while gauge(addr, "valem_mcp_listens") != 0 {
        assert!(
            start.elapsed() < PATIENCE,
            "the daemon still holds closed listen streams"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut c = Conn::open(addr).expect("connect");
    let r = c
        .request(
            "POST",
            "/models/demo/mutations",
            &[("Content-Type", "application/json")],
            br#"{"$.qty": 1}"#,
        )
        .expect("a write");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        gauge(addr, "valem_event_subscribers"),
        subscribers,
        "closed listen streams left service subscribers behind"
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Case {
    None,
    Elsewhere,
    Written,
}

impl Case {
    const ALL: [Case; 3] = [Case::None, Case::Elsewhere, Case::Written];

    fn label(self) -> String {
        match self {
            Case::None => "0 listeners".into(),
            Case::Elsewhere => format!("{LISTENERS} listeners on another model"),
            Case::Written => format!("{LISTENERS} listeners on the written model"),
        }
    }

    /// The model the case's listeners listen to.
    fn model(self) -> &'static str {
        match self {
            Case::Elsewhere => "other",
            Case::None | Case::Written => "demo",
        }
    }

    fn open(self, addr: &str) -> Option<Listeners> {
        let uri = format!("valem://state/{}", self.model());
        match self {
            Case::None => None,
            Case::Elsewhere => Some(Listeners::open(addr, &uri, LISTENERS, false)),
            Case::Written => Some(Listeners::open(addr, &uri, LISTENERS, true)),
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn line(what: &str, mut us: Vec<f64>, round_p50: &[f64]) -> String {
    us.sort_by(f64::total_cmp);
    let (lo, hi) = round_p50
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    format!(
        "{what} p50 {:.0} µs (by round {lo:.0}–{hi:.0}), p99 {:.0} µs, max {:.0} µs",
        quantile(&us, 0.5),
        quantile(&us, 0.99),
        quantile(&us, 1.0)
    )
}

/// Fixed rounds: every case in turn, `per_round` commits each (after 100 unmeasured ones).
fn rounds(addr: &str) {
    let (rounds, per_round) = (4, 1_000);
    let subscribers = gauge(addr, "valem_event_subscribers");
    let mut w = Writer::open(addr);
    let mut all: Vec<Vec<Sample>> = vec![Vec::new(); 3];
    let mut p50s: Vec<[Vec<f64>; 3]> = vec![Default::default(); 3];
    for _ in 0..rounds {
        for (k, case) in Case::ALL.into_iter().enumerate() {
            let l = case.open(addr);
            for _ in 0..100 {
                w.commit(l.as_ref());
            }
            let s: Vec<Sample> = (0..per_round).map(|_| w.commit(l.as_ref())).collect();
            if let Some(l) = l {
                close(addr, l, subscribers);
            }
            let fields: [fn(&Sample) -> f64; 3] = [|s| s.commit, |s| s.first, |s| s.all];
            for (j, f) in fields.into_iter().enumerate() {
                let mut v: Vec<f64> = s.iter().map(f).collect();
                v.sort_by(f64::total_cmp);
                p50s[k][j].push(quantile(&v, 0.5));
            }
            all[k].extend(s);
        }
    }
    for (k, case) in Case::ALL.into_iter().enumerate() {
        let s = &all[k];
        println!(
            "listen/{} ({} commits): {}",
            case.label(),
            s.len(),
            line("commit", s.iter().map(|s| s.commit).collect(), &p50s[k][0])
        );
        if case == Case::Written {
            println!(
                "listen/{}: first listener {}; all {LISTENERS} {}",
                case.label(),
                line("", s.iter().map(|s| s.first).collect(), &p50s[k][1]),
                line("", s.iter().map(|s| s.all).collect(), &p50s[k][2])
            );
        }
    }
}

fn listen(c: &mut Criterion) {
    let Some(d) = daemon() else { return };
    rounds(&d.addr);

    let mut g = c.benchmark_group("listen");
    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let subscribers = gauge(&d.addr, "valem_event_subscribers");
    let mut w = Writer::open(&d.addr);
    g.bench_function("commit_0_listeners", |b| {
        b.iter_custom(|n| {
            (0..n)
                .map(|_| Duration::from_secs_f64(w.commit(None).commit / 1e6))
                .sum()
        })
    });
    let l = Case::Written.open(&d.addr);
    g.bench_function(format!("commit_{LISTENERS}_listeners"), |b| {
        b.iter_custom(|n| {
            (0..n)
                .map(|_| Duration::from_secs_f64(w.commit(l.as_ref()).commit / 1e6))
                .sum()
        })
    });
    g.bench_function(format!("all_{LISTENERS}_listeners_notified"), |b| {
        b.iter_custom(|n| {
            (0..n)
                .map(|_| Duration::from_secs_f64(w.commit(l.as_ref()).all / 1e6))
                .sum()
        })
    });
    g.finish();
    if let Some(l) = l {
        close(&d.addr, l, subscribers);
    }
}

criterion_group!(benches, listen);
criterion_main!(benches);
