//! Many small models (issue 34's figures in `docs/performance.md`): N copies of the bundled
//! `car-loan-calculator` (`VALEM_BENCH_MODELS`, default 20,000) created from one caller, with
//! `valem bench --models`, in the eight runs of the table: in-process over a strict store, with
//! 2,000 resident, over a relaxed store; then over REST against `valem serve --data-dir`
//! (strict, with `--max-resident-models 2000`, relaxed; then strict and with 2,000 resident
//! again, 8 creations in flight: `--concurrency 8`). Each prints creates/s, resident KB per
//! model and warm and cold read latency. Needs the release binary (`cargo build --release -p
//! valem`, or `VALEM_BIN`).

use std::ffi::OsStr;
use std::process::Command;

use valem_benches::{release_valem, Serve};

fn main() {
    let Some(bin) = release_valem("models runs") else {
        return;
    };
    let n = std::env::var("VALEM_BENCH_MODELS").unwrap_or_else(|_| "20000".into());
    let bench = |label: &str, extra: &[&str]| {
        let out = Command::new(&bin)
            .args(["bench", "--models", &n])
            .args(extra)
            .output();
        match out {
            Ok(o) if o.status.success() => {
                println!("== {label}\n{}", String::from_utf8_lossy(&o.stdout));
            }
            Ok(o) => eprintln!("{label}: {}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("{label}: {e}"),
        }
    };
    bench("in-process, strict store", &[]);
    bench(
        "in-process, strict, 2,000 resident",
        &["--max-resident-models", "2000"],
    );
    bench("in-process, relaxed store", &["--durability", "relaxed"]);
    let eight: &[&str] = &["--concurrency", "8"];
    for (label, flags, caller) in [
        ("REST, serve --data-dir (strict)", &[][..], &[][..]),
        (
            "REST, strict, --max-resident-models 2000",
            &["--max-resident-models", "2000"][..],
            &[][..],
        ),
        (
            "REST, --durability relaxed",
            &["--durability", "relaxed"][..],
            &[][..],
        ),
        ("REST, strict, 8 creations in flight", &[][..], eight),
        (
            "REST, strict, 2,000 resident, 8 in flight",
            &["--max-resident-models", "2000"][..],
            eight,
        ),
    ] {
        let dir = tempfile::tempdir().expect("a temporary data directory");
        let mut extra: Vec<&OsStr> = vec![
            OsStr::new("--data-dir"),
            dir.path().as_os_str(),
            OsStr::new("--max-models"),
            OsStr::new(&n),
        ];
        extra.extend(flags.iter().map(OsStr::new));
        let Some(d) = Serve::start(&bin, &extra) else {
            eprintln!("{label}: valem serve did not start");
            continue;
        };
        let url = format!("http://{}", d.addr);
        let mut args = vec!["--url", &url];
        args.extend_from_slice(caller);
        bench(label, &args);
    }
}
