//! The command line: argument parsing and human/JSON output over the library. No logic of its
//! own beyond reading files and choosing exit codes (0 ok, 1 failure, 2 usage).

mod args;
mod open;
mod plugins;

pub use args::*;
use open::*;
use plugins::*;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use serde_json::{json, Value as Json};

use valem_core::expr::{eval_once, Limits};
use valem_core::spec::{parse_spec, ModelSpec};
use valem_engine::testrun::{dry_run, parse_batches, run_tests, DryRunError};
use valem_engine::validate::{validate_json, Report};
use valem_engine::{EngineLimits, Timestamp};

/// Run the CLI; returns the process exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("valem: {message}");
            1
        }
    }
}

/// Read a file argument (`-` = stdin, `example:<name>` = a bundled example).
fn read_arg(arg: &str) -> Result<String, String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| format!("cannot read standard input: {e}"))?;
        return Ok(s);
    }
    if let Some(name) = arg.strip_prefix("example:") {
        return valem_core::examples::get(name)
            .map(str::to_string)
            .ok_or_else(|| format!("no bundled example `{name}`; `valem examples` lists them"));
    }
    std::fs::read_to_string(Path::new(arg)).map_err(|e| format!("cannot read {arg}: {e}"))
}

fn parse_json(text: &str, what: &str) -> Result<Json, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    serde_json::from_str(text).map_err(|e| {
        format!(
            "{what} is not valid JSON (line {}, column {}): {e}",
            e.line(),
            e.column()
        )
    })
}

fn load_spec(arg: &str) -> Result<(Json, ModelSpec), String> {
    let text = read_arg(arg)?;
    let json = parse_json(&text, arg)?;
    let spec = parse_spec(&json).map_err(|e| {
        format!(
            "{arg} is not a valid spec: {}: {}",
            e.location(),
            e.message()
        )
    })?;
    Ok((json, spec))
}

/// `--mutations FILE` of `valem bench`: a JSON array of non-empty `{"$.path": value}` objects
/// (stricter than `parse_batches`, which it then uses: one bare object or an empty one would
/// benchmark nothing useful).
fn parse_mutation_list(arg: &str) -> Result<Vec<Vec<(String, Json)>>, String> {
    let v = parse_json(&read_arg(arg)?, arg)?;
    let Some(items) = v.as_array() else {
        return Err(format!("{arg}: expected a JSON array of mutation objects"));
    };
    if let Some(i) = items
        .iter()
        .position(|m| m.as_object().is_none_or(serde_json::Map::is_empty))
    {
        return Err(format!(
            "{arg}: [{i}] is not a non-empty object of {{\"$.path\": value}}"
        ));
    }
    parse_batches(&v).map_err(|e| e.to_string())
}

fn print_json(v: &Json) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_default()
    );
}

fn print_report(r: &Report) {
    for e in &r.errors {
        println!("error   {}: {}", e.location, e.message);
    }
    for w in &r.warnings {
        println!("warning {}: {}", w.location, w.message);
    }
    println!(
        "{} ({} error{}, {} warning{})",
        if r.valid { "valid" } else { "invalid" },
        r.errors.len(),
        if r.errors.len() == 1 { "" } else { "s" },
        r.warnings.len(),
        if r.warnings.len() == 1 { "" } else { "s" }
    );
}

/// `valem bench`'s progress bar: 30 columns, then what it counts (padded, so that the timed
/// phase's line covers the warm-up's).
fn progress_line(p: crate::bench::Progress) -> String {
    let (done, of, what) = match p {
        crate::bench::Progress::Building { nodes, first_cycle } => (
            0,
            1,
            if first_cycle {
                format!("first cycle, {nodes} nodes")
            } else {
                format!("compiling {nodes} nodes")
            },
        ),
        crate::bench::Progress::WarmUp { elapsed, of } => (
            elapsed.as_millis() as usize,
            of.as_millis() as usize,
            format!(
                "warming up, {:.1}/{:.1} s",
                elapsed.as_secs_f64(),
                of.as_secs_f64()
            ),
        ),
        crate::bench::Progress::Timed { done, of } => (done, of, format!("{done}/{of} mutations")),
    };
    let w = 30;
    let filled = (done * w).checked_div(of.max(1)).unwrap_or(0).min(w);
    format!(
        "[{}{}] {what:<28}",
        "#".repeat(filled),
        ".".repeat(w - filled)
    )
}

fn run(cli: Cli) -> Result<i32, String> {
    // `valem spec …`: the daemon's default engine limits (its cycle budget included).
    let limits = valem_service::ServiceLimits::default().engine;
    match cli.command {
        Command::Bench(args) => bench(args),
        Command::Spec { action } => spec(action, &limits),
        Command::Eval(args) => eval(args),
        Command::Mcp(args) => mcp(args),
        Command::Console(args) => console(args),
        Command::Serve(args) => serve(args),
        Command::Plugins {
            action:
                PluginsAction::List {
                    plugins,
                    data_dir,
                    json,
                },
        } => Ok(plugins_list(&plugins, data_dir.as_deref(), json)),
        Command::Examples { name } => {
            match name {
                None => {
                    for (n, _) in valem_core::examples::ALL {
                        println!("{n}");
                    }
                }
                Some(n) => match valem_core::examples::get(&n) {
                    Some(text) => print!("{text}"),
                    None => {
                        return Err(format!(
                            "no bundled example `{n}`; `valem examples` lists them"
                        ))
                    }
                },
            }
            Ok(0)
        }
    }
}

/// `valem spec …`.
fn spec(action: SpecAction, limits: &EngineLimits) -> Result<i32, String> {
    match action {
        SpecAction::Validate { file, json } => {
            let text = read_arg(&file)?;
            let report = match parse_json(&text, &file) {
                Ok(j) => validate_json(&j, limits),
                Err(m) => Report {
                    valid: false,
                    errors: vec![valem_engine::validate::Finding {
                        location: file.clone(),
                        message: m,
                    }],
                    warnings: Vec::new(),
                },
            };
            if json {
                print_json(&serde_json::to_value(&report).unwrap_or(Json::Null));
            } else {
                print_report(&report);
            }
            Ok(if report.valid { 0 } else { 1 })
        }
        SpecAction::Test { file, json, now } => {
            let (raw, spec) = load_spec(&file)?;
            let report = validate_json(&raw, limits);
            if !report.valid {
                if json {
                    print_json(&json!({"error": "Invalid spec", "errors": report.errors}));
                } else {
                    print_report(&report);
                }
                return Ok(1);
            }
            let r = run_tests(
                &spec,
                None,
                now.map_or_else(valem_service::time::now, Timestamp::from_ms),
                limits,
            )
            .map_err(|e| e.to_string())?;
            if json {
                print_json(&serde_json::to_value(&r).unwrap_or(Json::Null));
            } else {
                for c in &r.results {
                    println!(
                        "{} {}",
                        if c.passed { "PASS" } else { "FAIL" },
                        c.description
                    );
                    for f in &c.failures {
                        println!("     {}", f.message);
                    }
                }
                println!("{} passed, {} failed", r.passed, r.failed);
            }
            Ok(if r.failed == 0 { 0 } else { 1 })
        }
        SpecAction::DryRun {
            file,
            mutations,
            now,
        } => {
            let (_, spec) = load_spec(&file)?;
            let batches = match mutations {
                None => Vec::new(),
                Some(m) => {
                    let text = match m.strip_prefix('@') {
                        Some(f) => read_arg(f)?,
                        None => m,
                    };
                    parse_batches(&parse_json(&text, "--mutations")?).map_err(|e| e.to_string())?
                }
            };
            match dry_run(
                &spec,
                &batches,
                now.map_or_else(valem_service::time::now, Timestamp::from_ms),
                limits,
            ) {
                Ok(state) => {
                    print_json(&state);
                    Ok(0)
                }
                Err(DryRunError::Mutation { index, error }) => {
                    eprintln!("valem: mutation #{index} was refused: {error}");
                    print_json(&error.to_json());
                    Ok(1)
                }
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// `valem bench`.
fn bench(args: BenchArgs) -> Result<i32, String> {
    let BenchArgs {
        shape,
        n,
        spec,
        mutations,
        count,
        max_seconds,
        warmup,
        jit,
        seed,
        service,
        durable,
        json,
        models,
        max_resident_models,
        shards,
        url,
        api_key,
        durability,
        concurrency,
        max_instances,
    } = args;
    if let Some(n) = models {
        let (name, spec) = match spec {
            Some(file) => (file.clone(), load_spec(&file)?.1),
            None => {
                let name = "example:car-loan-calculator".to_string();
                (name.clone(), load_spec(&name)?.1)
            }
        };
        let opts = crate::bench_models::Options {
            models: n,
            spec,
            spec_name: name,
            max_resident: max_resident_models,
            shards,
            reads: count,
            seed,
            url,
            api_key,
            relaxed: durability == "relaxed",
            concurrency: usize::from(concurrency),
        };
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let mut progress = |phase: &str, done: usize, of: usize| {
            if tty {
                eprint!("\r{phase} {done}/{of}        ");
            }
        };
        let report = crate::bench_models::run(&opts, &mut progress)?;
        if tty {
            eprintln!();
        }
        if json {
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
        } else {
            print!("{}", crate::bench_models::table(&report));
        }
        return Ok(0);
    }
    if !(max_seconds > 0.0 && max_seconds.is_finite()) {
        return Err(format!(
            "--max-seconds must be a positive number; got {max_seconds}"
        ));
    }
    if !(warmup >= 0.0 && warmup.is_finite()) {
        return Err(format!(
            "--warmup must be zero or a positive number of seconds; got {warmup}"
        ));
    }
    let workload = match spec {
        Some(file) => {
            let (_, parsed) = load_spec(&file)?;
            let mutations = match mutations {
                Some(m) => Some(parse_mutation_list(&m)?),
                None => None,
            };
            crate::bench::Workload::Spec {
                name: file,
                spec: Box::new(parsed),
                mutations,
            }
        }
        None => crate::bench::Workload::Shape(shape, n),
    };
    let opts = crate::bench::Options {
        workload,
        mutations: count,
        max_time: std::time::Duration::from_secs_f64(max_seconds),
        warmup: std::time::Duration::from_secs_f64(warmup),
        jit,
        seed,
        service,
        durable,
        max_instances,
    };
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut progress = |p: crate::bench::Progress| {
        if tty {
            eprint!("\r{}", progress_line(p));
            if matches!(p, crate::bench::Progress::Timed { done, of } if done >= of) {
                eprintln!();
            }
        }
    };
    let report = crate::bench::run(&opts, &mut progress)?;
    if json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        print!("{}", crate::bench::table(&report));
    }
    Ok(0)
}

/// `valem eval`.
fn eval(args: EvalArgs) -> Result<i32, String> {
    let EvalArgs {
        expr,
        input,
        bindings,
        json,
    } = args;
    let input = match input {
        Some(i) => Some(parse_json(&read_arg(&i)?, "the input")?),
        None => None,
    };
    let bindings = match bindings {
        None => serde_json::Map::new(),
        Some(b) => match parse_json(&b, "--bindings")? {
            Json::Object(m) => m,
            _ => return Err("--bindings must be a JSON object of name → value".into()),
        },
    };
    let out = eval_once(&expr, input.as_ref(), &bindings, &Limits::default());
    if json {
        let line = match &out {
            Ok(Some(v)) => json!({ "result": v }),
            Ok(None) => json!({}),
            Err(e) => json!({ "error": e.to_json() }),
        };
        println!("{line}");
    } else {
        match &out {
            Ok(Some(v)) => print_json(v),
            Ok(None) => eprintln!("(undefined)"),
            Err(e) => {
                let at = e.at();
                eprintln!(
                    "valem: {}{at}: {}",
                    e.code.as_deref().unwrap_or("error"),
                    e.message
                );
            }
        }
    }
    Ok(if out.is_err() { 1 } else { 0 })
}

/// `valem mcp`.
fn mcp(args: McpArgs) -> Result<i32, String> {
    let McpArgs {
        url,
        api_key,
        browser,
        max_message_bytes,
        models,
        store,
        plugins,
        effects,
    } = args;
    if let Some(url) = url {
        return Ok(mcp_proxy(
            &url,
            api_key,
            browser,
            max_message_bytes,
            &plugins,
        ));
    }
    // Warnings only (stdout is the protocol): a checkpoint refused on recovery, a
    // checkpoint not written, a plugin that failed.
    init_logging("warn");
    let (plugins, guidance) = match load_plugins("mcp", &plugins, store.data_dir.as_deref()) {
        Ok(g) => g,
        Err(code) => return Ok(code),
    };
    let limits = valem_service::ServiceLimits {
        checkpoint_every: usize::try_from(store.checkpoint_every).unwrap_or(usize::MAX),
        ..models.limits()
    };
    let service = match open_service("mcp", models.shards, limits, &store) {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    attach_plugins("mcp", &service, &plugins);
    let _effects = match effects.start("mcp", &service) {
        Ok(r) => r,
        Err(code) => return Ok(code),
    };
    let server = valem_mcp::Server::with_plugins(
        service.clone(),
        guidance,
        plugins,
        valem_mcp::Mode::Embedded,
    );
    eprintln!(
        "valem mcp {}: embedded engine ({}); reading JSON-RPC on stdin",
        env!("CARGO_PKG_VERSION"),
        match open::store_label(&store) {
            Some(d) => format!("durable in {d}"),
            None => "in memory".to_string(),
        }
    );
    let stdin = std::io::stdin().lock();
    match valem_mcp::stdio::serve(server, stdin, std::io::stdout(), max_message_bytes) {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("valem mcp: {e}");
            Ok(1)
        }
    }
}

/// `valem console`.
fn console(args: ConsoleArgs) -> Result<i32, String> {
    let ConsoleArgs {
        url,
        api_key,
        max_line_bytes,
        models,
    } = args;
    let url = url.filter(|u| !u.trim().is_empty());
    let mut backend: Box<dyn crate::console::Backend> = match url {
        Some(u) => match crate::console::remote::Remote::new(&u, api_key) {
            Ok(r) => Box::new(r),
            Err(e) => {
                eprintln!("valem console: {e}");
                return Ok(2);
            }
        },
        None => {
            let service = valem_service::ModelService::new(models.shards, models.limits());
            Box::new(crate::console::embedded::Embedded::new(service))
        }
    };
    eprintln!(
        "valem console {} ({}): one JSON command per line on stdin; {{\"cmd\":\"help\"}} lists them",
        env!("CARGO_PKG_VERSION"),
        backend.mode()
    );
    let stdin = std::io::stdin().lock();
    match crate::console::serve(
        &mut *backend,
        stdin,
        std::io::stdout().lock(),
        max_line_bytes,
    ) {
        Ok(()) => Ok(0),
        // A closed stdout means the reader is gone: nothing left to answer.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => {
            eprintln!("valem console: {e}");
            Ok(1)
        }
    }
}

/// `valem serve`.
fn serve(args: ServeArgs) -> Result<i32, String> {
    let ServeArgs {
        listen,
        api_key,
        allowed_origins,
        allowed_hosts,
        max_body_bytes,
        max_blob_bytes,
        header_timeout,
        request_timeout,
        models,
        store,
        plugins,
        effects,
        conformance_fixtures,
        pairing_ttl,
        pairing_interval,
    } = args;
    init_logging("info");
    let (plugins, guidance) = match load_plugins("serve", &plugins, store.data_dir.as_deref()) {
        Ok(g) => g,
        Err(code) => return Ok(code),
    };
    let limits = valem_service::ServiceLimits {
        checkpoint_every: usize::try_from(store.checkpoint_every).unwrap_or(usize::MAX),
        blob_max_bytes: max_blob_bytes,
        ..models.limits()
    };
    let service = match open_service("serve", models.shards, limits, &store) {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    let mode = if conformance_fixtures {
        valem_mcp::Mode::DaemonWithFixtures
    } else {
        valem_mcp::Mode::Daemon
    };
    attach_plugins("serve", &service, &plugins);
    let _effects = match effects.start("serve", &service) {
        Ok(r) => r,
        Err(code) => return Ok(code),
    };
    let server = valem_mcp::Server::with_plugins(service.clone(), guidance, plugins, mode);
    let config = valem_http::Config {
        listen,
        api_key: api_key.filter(|k| !k.is_empty()),
        allowed_origins: allowed_origins
            .into_iter()
            .filter(|o| !o.is_empty())
            .collect(),
        allowed_hosts: allowed_hosts
            .into_iter()
            .filter(|o| !o.is_empty())
            .collect(),
        max_body_bytes,
        header_timeout: std::time::Duration::from_secs_f64(header_timeout),
        request_timeout: std::time::Duration::from_secs_f64(request_timeout),
        conformance_fixtures,
        pairing_ttl: std::time::Duration::from_secs_f64(pairing_ttl),
        pairing_interval: std::time::Duration::from_secs_f64(pairing_interval),
        ..Default::default()
    };
    let keyed = config.api_key.is_some();
    let storage = match open::store_label(&store) {
        Some(d) => format!(
            "{} models durable in {d} ({})",
            service.model_count(),
            store.durability
        ),
        None => "in-memory models".to_string(),
    };
    let result = valem_http::serve(config, service, server, |addr| {
        // The one line on stdout: scripts and tests read the bound address from it.
        println!("valem serve: listening on http://{addr}");
        let _ = std::io::stdout().flush();
        eprintln!(
            "valem serve {}: {storage}; REST at http://{addr}/models, MCP at http://{addr}/mcp{}",
            env!("CARGO_PKG_VERSION"),
            if keyed { " (API key required)" } else { "" }
        );
    });
    match result {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("valem serve: {e}");
            Ok(1)
        }
    }
}

/// Structured logs to stderr; `RUST_LOG` sets the filter (default `default`).
fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Where the bundled example files live in a source checkout (for tests and docs).
pub fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("examples")
}

#[cfg(test)]
mod tests {
    use super::progress_line;
    use crate::bench::Progress;
    use std::time::Duration;

    /// The bar fills in proportion in both phases, says which phase it is, and the timed
    /// phase's line is as long as the warm-up's (it is written over it with a carriage return).
    #[test]
    fn bench_progress_shows_the_warm_up_then_the_timed_mutations() {
        let warm = progress_line(Progress::WarmUp {
            elapsed: Duration::from_millis(500),
            of: Duration::from_secs(1),
        });
        let timed = progress_line(Progress::Timed {
            done: 250,
            of: 1000,
        });
        assert!(
            warm.starts_with(&format!("[{}{}]", "#".repeat(15), ".".repeat(15))),
            "{warm}"
        );
        assert!(warm.contains("warming up, 0.5/1.0 s"), "{warm}");
        assert!(
            timed.starts_with(&format!("[{}{}]", "#".repeat(7), ".".repeat(23))),
            "{timed}"
        );
        assert!(timed.contains("250/1000 mutations"), "{timed}");
        assert_eq!(warm.len(), timed.len(), "{warm:?} / {timed:?}");
        let done = progress_line(Progress::Timed {
            done: 1000,
            of: 1000,
        });
        assert!(done.starts_with(&format!("[{}]", "#".repeat(30))), "{done}");
        // Building: an empty bar and the phase, as long as the rest.
        for (first_cycle, what) in [
            (false, "compiling 100000 nodes"),
            (true, "first cycle, 100000 nodes"),
        ] {
            let b = progress_line(Progress::Building {
                nodes: 100_000,
                first_cycle,
            });
            assert!(
                b.starts_with(&format!("[{}] {what}", ".".repeat(30))),
                "{b}"
            );
            assert_eq!(b.len(), timed.len(), "{b:?}");
        }
        // No warm-up at all: nothing to divide by, an empty bar.
        let none = progress_line(Progress::WarmUp {
            elapsed: Duration::ZERO,
            of: Duration::ZERO,
        });
        assert!(none.starts_with(&format!("[{}]", ".".repeat(30))), "{none}");
    }
}
