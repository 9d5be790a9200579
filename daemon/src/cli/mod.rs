//! The command line: argument parsing and human/JSON output over the library. No logic of its
//! own beyond reading files and choosing exit codes (0 ok, 1 failure, 2 usage).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use serde_json::{json, Value as Json};

use valem_core::expr::{eval_once, Limits};
use valem_core::spec::{parse_spec, ModelSpec};
use valem_engine::testrun::{dry_run, parse_batches, run_tests, DryRunError};
use valem_engine::validate::{validate_json, Report};
use valem_engine::EngineLimits;

#[derive(Parser, Debug)]
#[command(
    name = "valem",
    version,
    propagate_version = true,
    about = "Reactive JSON models for AI agents",
    long_about = "valem runs reactive JSON models: a JSON document plus a ModelSpec (schema, JSONata \
derivations, meta-derivations, constraints, effects, tests, view). Every mutation runs one \
reactive cycle and commits atomically.\n\nFILE arguments accept `-` for standard input. A bundled \
example can be named as `example:<name>` (see `valem examples`)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Author and check ModelSpecs without running a daemon.
    Spec {
        #[command(subcommand)]
        action: SpecAction,
    },
    /// Evaluate one JSONata expression (with Valem's engine and limits).
    Eval {
        /// The JSONata expression.
        expr: String,
        /// JSON input document: a file, or `-` for standard input (default: no input).
        #[arg(long)]
        input: Option<String>,
        /// JSON object of variable bindings, e.g. '{"rate": 0.2}' binds $rate.
        #[arg(long)]
        bindings: Option<String>,
        /// Print exactly one JSON line: {"result": v}, {} when undefined, or {"error": {...}}.
        #[arg(long)]
        json: bool,
    },
    /// Serve MCP on stdio (one JSON-RPC message per line): an embedded in-memory engine, or
    /// with --url a proxy to a running daemon (`valem serve`).
    ///
    /// Register it with an MCP client as the command `valem` with the argument `mcp` (and
    /// `--url http://127.0.0.1:8080` to share a daemon's models). Only protocol messages go to
    /// stdout; diagnostics go to stderr. The process exits when stdin closes. With --url, model
    /// tools and resources run on the daemon and authoring tools here; a daemon that is down
    /// gives a tool error and the next call reconnects. Extra domain-guidance topics: set
    /// VALEM_DOMAIN_GUIDANCE_TOPICS_FILE to a JSON file of [{"id", "description",
    /// "instructions", "title"?}].
    Mcp {
        /// Proxy to the daemon at this base URL (e.g. http://127.0.0.1:8080) instead of
        /// running an embedded engine.
        #[arg(long, env = "VALEM_URL")]
        url: Option<String>,
        /// API key of the daemon (sent as `Authorization: Bearer`).
        #[arg(long, env = "VALEM_API_KEY", hide_env_values = true, requires = "url")]
        api_key: Option<String>,
        /// With --url: offer `pair_browser`, which pairs the agent with the developer's browser
        /// sandbox (the daemon's /sandbox/) so both drive one live session.
        #[arg(long, requires = "url")]
        browser: bool,
        /// Largest accepted message in bytes; longer lines are refused with -32600 and skipped.
        #[arg(long, env = "VALEM_MCP_MAX_MESSAGE_BYTES", default_value_t = valem_mcp::stdio::DEFAULT_MAX_MESSAGE_BYTES)]
        max_message_bytes: usize,
        /// Shard threads running the models (0: one per core).
        #[arg(long, env = "VALEM_SHARDS", default_value_t = 0)]
        shards: usize,
        /// Most live models.
        #[arg(long, env = "VALEM_MAX_MODELS", default_value_t = 1000)]
        max_models: usize,
        #[command(flatten)]
        cycle: CycleArgs,
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        plugins: PluginArgs,
        #[command(flatten)]
        effects: EffectsArgs,
    },
    /// Run commands given as JSON lines on stdin, one answer line each on stdout.
    ///
    /// Protocol: each line of stdin is one object {"cmd": "<command>", …arguments}, e.g.
    /// {"cmd":"mutate","id":"demo","mutations":{"$.price":10}}. Each gets exactly one line on
    /// stdout: {"ok":true,"result":<value>} or {"ok":false,"error":"<message>"}. Results have
    /// the shapes of the MCP tools' results; a bad line, an unknown command or a missing or
    /// mistyped argument is answered with an error naming it, and the console keeps reading.
    /// Blank lines are skipped. {"cmd":"help"} lists the commands and their arguments;
    /// {"cmd":"exit"} or the end of stdin ends the console. Binary data is base64.
    ///
    /// Modes: embedded (default) runs an in-memory engine in this process; models are gone when
    /// it exits. Remote (--url, or VALEM_URL) sends every command to the REST API of a running
    /// `valem serve` (plain http://; shared, server-wide models), with `Authorization: Bearer`
    /// when --api-key (or VALEM_API_KEY) is given; a server error is answered with the server's
    /// message, and an unreachable daemon with an error naming the URL.
    Console {
        /// Remote mode: the daemon's base URL, e.g. http://127.0.0.1:8080.
        #[arg(long, env = "VALEM_URL")]
        url: Option<String>,
        /// Remote mode: the daemon's API key, sent as `Authorization: Bearer <key>`.
        #[arg(long, env = "VALEM_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Largest accepted line in bytes; longer lines are refused with an error and skipped.
        #[arg(long, env = "VALEM_CONSOLE_MAX_LINE_BYTES", default_value_t = crate::console::DEFAULT_MAX_LINE_BYTES)]
        max_line_bytes: usize,
        /// Embedded mode: shard threads running the models (0: one per core).
        #[arg(long, env = "VALEM_SHARDS", default_value_t = 0)]
        shards: usize,
        /// Embedded mode: most live models.
        #[arg(long, env = "VALEM_MAX_MODELS", default_value_t = 1000)]
        max_models: usize,
        #[command(flatten)]
        cycle: CycleArgs,
    },
    /// Run the daemon: REST, Streamable HTTP MCP at /mcp, WebSocket, the browser sandbox at
    /// /sandbox/ (with device-flow pairing for `valem mcp --url … --browser`), /healthz,
    /// /metrics; effects requested by committed cycles run here (see --effects-*).
    ///
    /// Listens on loopback by default. Requests must name a loopback Host (or one of
    /// --allowed-hosts) and, from a browser, a loopback Origin (or one of --allowed-origins).
    /// With --api-key every request but /healthz must carry `Authorization: Bearer <key>`
    /// (only the WebSocket handshake may pass `?token=<key>`); the sandbox page and the
    /// browser's half of pairing need no key, and a paired session's `X-Session-Token` stands
    /// in for it on its own models (`/models…`, `/mcp`). Stops on SIGINT/SIGTERM after
    /// finishing in-flight requests. Logs go to stderr; RUST_LOG sets the level (default info).
    Serve {
        /// Address to listen on (port 0 picks a free port; the chosen address is printed).
        #[arg(long, env = "VALEM_LISTEN", default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Require this API key on every request but /healthz.
        #[arg(long, env = "VALEM_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Comma-separated browser origins allowed besides loopback ones (`*`: any).
        #[arg(long, env = "VALEM_ALLOWED_ORIGINS", value_delimiter = ',')]
        allowed_origins: Vec<String>,
        /// Comma-separated Host names allowed besides loopback ones (needed when listening
        /// on a non-loopback address; `*`: any).
        #[arg(long, env = "VALEM_ALLOWED_HOSTS", value_delimiter = ',')]
        allowed_hosts: Vec<String>,
        /// Largest accepted request body in bytes.
        #[arg(long, env = "VALEM_MAX_BODY_BYTES", default_value_t = 16 << 20)]
        max_body_bytes: usize,
        /// Largest blob in bytes (`POST /blobs`, `upload_blob`).
        #[arg(long, env = "VALEM_MAX_BLOB_BYTES", default_value_t = 50 << 20)]
        max_blob_bytes: usize,
        /// Seconds a client has to send a request's headers, counted from the connection's
        /// opening or its previous response; slow or idle connections are closed after it.
        #[arg(long, env = "VALEM_HEADER_TIMEOUT", default_value_t = 10.0, value_parser = seconds)]
        header_timeout: f64,
        /// Seconds a request may take, body and handling included (408 past it); SSE and
        /// WebSocket streams are not limited.
        #[arg(long, env = "VALEM_REQUEST_TIMEOUT", default_value_t = 60.0, value_parser = seconds)]
        request_timeout: f64,
        /// Shard threads running the models (0: one per core).
        #[arg(long, env = "VALEM_SHARDS", default_value_t = 0)]
        shards: usize,
        /// Most live models.
        #[arg(long, env = "VALEM_MAX_MODELS", default_value_t = 1000)]
        max_models: usize,
        #[command(flatten)]
        cycle: CycleArgs,
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        plugins: PluginArgs,
        #[command(flatten)]
        effects: EffectsArgs,
        /// Serve the MCP conformance suite's fixture tools, resources and prompts. For the
        /// conformance tests only; never enable it on a real daemon.
        #[arg(long, hide = true)]
        conformance_fixtures: bool,
        /// Seconds a sandbox pairing (POST /sandbox/pair) waits for the developer's approval
        /// before it expires.
        #[arg(long, env = "VALEM_PAIRING_TTL", default_value_t = 600.0, value_parser = seconds)]
        pairing_ttl: f64,
        /// Seconds the pairing agent is told to wait between token polls (`intervalSec`).
        #[arg(long, env = "VALEM_PAIRING_INTERVAL", default_value_t = 3.0, value_parser = seconds)]
        pairing_interval: f64,
    },
    /// Load the plugins as `valem serve` would (same flags) and list them: name, kind, version,
    /// SDK and rustc versions, path, and each one's tools or topics; libraries that did not load
    /// are listed with the reason (exit 1 if any).
    Plugins {
        #[command(subcommand)]
        action: PluginsAction,
    },
    /// Measure a model in-process (the engine alone; with --service the model service in
    /// memory, with --durable over a durable store; no transport): compile time, the first
    /// cycle, per-mutation latency percentiles, mutations/s, evaluations per mutation and
    /// resident memory.
    ///
    /// A synthetic shape (`--shape fanout|chain|items|mixed --n N`), or your own spec (`--spec
    /// FILE`, seeded with its first test's `given`) with random writes to its writable number,
    /// integer, boolean and string fields within their schema bounds, or the mutations of
    /// `--mutations FILE`. Prints a table, or with `--json` one JSON object (see docs/bench.md).
    /// Before the timed mutations, untimed ones run for `--warmup` seconds (default 1), so that
    /// what is timed is the model as a running daemon holds it (caches, JIT tiers and the
    /// allocator warm), not the first mutations after a build; `--warmup 0` times those.
    /// Mutations stop at `--count` or after `--max-seconds`, whichever comes first.
    Bench {
        /// The synthetic shape (ignored with --spec).
        #[arg(long, value_enum, default_value = "fanout")]
        shape: crate::bench::Shape,
        /// The shape's size: derivations (fanout, chain) or items (items, mixed).
        #[arg(long, default_value_t = 10_000)]
        n: usize,
        /// Benchmark this spec instead (a file, `-`, or `example:<name>`).
        #[arg(long, value_name = "FILE")]
        spec: Option<String>,
        /// With --spec: a JSON array of mutation objects `{"$.path": value, ...}`, applied one
        /// per cycle in order (cycled), instead of generated writes.
        #[arg(long, value_name = "FILE", requires = "spec")]
        mutations: Option<String>,
        /// Most mutations to time.
        #[arg(long, default_value_t = 1_000)]
        count: usize,
        /// Stop timing mutations after this many seconds (at least one runs).
        #[arg(long, default_value_t = 10.0)]
        max_seconds: f64,
        /// Seconds of untimed mutations before the timed ones (0: time from the first).
        #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
        warmup: f64,
        /// The arithmetic fast path for the run: on or off.
        #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set, value_name = "on|off")]
        jit: bool,
        /// Seed of the mutation generator.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Go through the model service in memory (one shard: its history ring, traces and
        /// audit trail; no transport), as the daemon commits.
        #[arg(long)]
        service: bool,
        /// Go through the model service and a durable store (strict: each mutation counts
        /// once fsynced) in a temporary directory, removed after the run.
        #[arg(long)]
        durable: bool,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// List the bundled example specs, or print one.
    Examples {
        /// Print this example's spec.
        name: Option<String>,
    },
}

/// `on`/`off` (also `1`/`0`, `true`/`false`).
fn on_off(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(format!("expected on or off; got {s:?}")),
    }
}

/// A positive, finite number of seconds (at most a day).
fn seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "expected seconds between 0 and 86400, e.g. 10 or 0.5; got {s:?}"
        )),
    }
}

#[derive(Subcommand, Debug)]
pub enum PluginsAction {
    /// List the plugins and what they provide.
    List {
        #[command(flatten)]
        plugins: PluginArgs,
        /// The daemon's data directory (plugins get `<dir>/plugins/<name>/`).
        #[arg(long, env = "VALEM_DATA_DIR")]
        data_dir: Option<PathBuf>,
        /// Print `{loaded: [...], failed: [...]}` as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum SpecAction {
    /// Validate a spec: errors and warnings with their location (exit 1 when invalid).
    Validate {
        file: String,
        /// Print the {valid, errors, warnings} report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run a spec's embedded tests in throwaway models (exit 1 when a test fails).
    Test {
        file: String,
        /// Print the {total, passed, failed, results} report as JSON.
        #[arg(long)]
        json: bool,
        /// The cycle's instant in epoch milliseconds (default: now), pinning $now()/$millis().
        #[arg(long)]
        now: Option<i64>,
    },
    /// Create a throwaway model, apply mutations and print the merged state as JSON.
    DryRun {
        file: String,
        /// A `{"$.path": value}` object, or an array of them applied in order; `@FILE` reads a
        /// file.
        #[arg(long)]
        mutations: Option<String>,
        /// The cycle's instant in epoch milliseconds (default: now).
        #[arg(long)]
        now: Option<i64>,
    },
}

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

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
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
    parse_batches(&v)
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
    // `valem spec …` and `valem eval`: the daemon's default cycle budget.
    let limits = EngineLimits {
        cycle_budget: valem_service::time::cycle_budget(valem_service::DEFAULT_CYCLE_BUDGET_MS),
        ..EngineLimits::default()
    };
    match cli.command {
        Command::Bench {
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
        } => {
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
        Command::Spec { action } => match action {
            SpecAction::Validate { file, json } => {
                let text = read_arg(&file)?;
                let report = match parse_json(&text, &file) {
                    Ok(j) => validate_json(&j, &limits),
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
                let report = validate_json(&raw, &limits);
                if !report.valid {
                    if json {
                        print_json(&json!({"error": "Invalid spec", "errors": report.errors}));
                    } else {
                        print_report(&report);
                    }
                    return Ok(1);
                }
                let r = run_tests(&spec, None, now.unwrap_or_else(now_ms), &limits)
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
                        parse_batches(&parse_json(&text, "--mutations")?)?
                    }
                };
                match dry_run(&spec, &batches, now.unwrap_or_else(now_ms), &limits) {
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
        },
        Command::Eval {
            expr,
            input,
            bindings,
            json,
        } => {
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
        Command::Mcp {
            url,
            api_key,
            browser,
            max_message_bytes,
            shards,
            max_models,
            cycle,
            store,
            plugins,
            effects,
        } => {
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
            let (plugins, guidance) = match load_plugins("mcp", &plugins, store.data_dir.as_deref())
            {
                Ok(g) => g,
                Err(code) => return Ok(code),
            };
            let limits = valem_service::ServiceLimits {
                engine: cycle.engine(),
                max_models,
                checkpoint_every: usize::try_from(store.checkpoint_every).unwrap_or(usize::MAX),
                ..Default::default()
            };
            let service = match open_service("mcp", shards, limits, &store) {
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
                match &store.data_dir {
                    Some(d) => format!("durable in {}", d.display()),
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
        Command::Console {
            url,
            api_key,
            max_line_bytes,
            shards,
            max_models,
            cycle,
        } => {
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
                    let limits = valem_service::ServiceLimits {
                        engine: cycle.engine(),
                        max_models,
                        ..Default::default()
                    };
                    let service = valem_service::ModelService::new(shards, limits);
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
        Command::Serve {
            listen,
            api_key,
            allowed_origins,
            allowed_hosts,
            max_body_bytes,
            max_blob_bytes,
            header_timeout,
            request_timeout,
            shards,
            max_models,
            cycle,
            store,
            plugins,
            effects,
            conformance_fixtures,
            pairing_ttl,
            pairing_interval,
        } => {
            init_logging("info");
            let (plugins, guidance) =
                match load_plugins("serve", &plugins, store.data_dir.as_deref()) {
                    Ok(g) => g,
                    Err(code) => return Ok(code),
                };
            let limits = valem_service::ServiceLimits {
                engine: cycle.engine(),
                max_models,
                checkpoint_every: usize::try_from(store.checkpoint_every).unwrap_or(usize::MAX),
                blob_max_bytes: max_blob_bytes,
                ..Default::default()
            };
            let service = match open_service("serve", shards, limits, &store) {
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
            let storage = match &store.data_dir {
                Some(d) => format!(
                    "{} models durable in {} ({})",
                    service.model_count(),
                    d.display(),
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

/// Where and how models are kept (`valem serve` and `valem mcp`).
#[derive(clap::Args, Debug)]
pub struct StoreArgs {
    /// Keep models in this directory (durable mode): a SQLite database holding every model's
    /// spec, audit log, checkpoints and blobs; models are recovered from it on start, and a
    /// write is acknowledged only once it is committed. Without it, models live in memory and
    /// end with the process.
    #[arg(long, env = "VALEM_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// With --data-dir: `strict` acknowledges a write after its batch is fsynced; `relaxed`
    /// after COMMIT without fsync (an OS crash or power loss may lose the last moments).
    #[arg(long, env = "VALEM_DURABILITY", default_value = "strict", value_parser = ["strict", "relaxed"])]
    pub durability: String,
    /// With --data-dir: checkpoint a model's state every N audit records (and at shutdown), so
    /// a restart replays at most N records per model.
    #[arg(long, env = "VALEM_CHECKPOINT_EVERY", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: u64,
    /// With --data-dir: the largest the database may grow, in bytes (default: the disk's
    /// space). Past it writes fail as on a full disk, and work again once there is room.
    #[arg(long, env = "VALEM_MAX_DB_BYTES")]
    pub max_db_bytes: Option<u64>,
    /// With --data-dir: a file holding a 32-byte audit key, as 64 hex characters (`openssl rand
    /// -hex 32 > FILE`) or 32 raw bytes. Audit record and checkpoint hashes become keyed blake3,
    /// so verify_audit catches a rewrite of the log by anyone without the key. The store
    /// remembers its key: later starts need the same key. An unkeyed store given a key keys
    /// each model's chain from its next record on.
    #[arg(long, env = "VALEM_AUDIT_KEY_FILE", value_name = "PATH")]
    pub audit_key_file: Option<PathBuf>,
}

/// What one mutation may cost (`valem serve`, `valem mcp`, `valem console`).
#[derive(clap::Args, Debug, Clone)]
pub struct CycleArgs {
    /// Milliseconds one mutation's cycle may take, its evaluations together; past it the
    /// cycle stops, rolls back and fails, and the shard goes on (0: no budget). Each
    /// evaluation is also bounded by 2 s, so a cycle ends within about 2 s of its budget.
    /// Replays of stored records at start-up are not bounded.
    #[arg(
        long,
        env = "VALEM_CYCLE_BUDGET_MS",
        default_value_t = 10_000,
        value_name = "MS"
    )]
    pub cycle_budget_ms: u64,
    /// Most instances one `[*]` derivation, meta-derivation or constraint may have in one
    /// cycle (the elements of the arrays its pattern spans); a write that would exceed it is
    /// refused.
    #[arg(
        long,
        env = "VALEM_MAX_INSTANCES",
        default_value_t = 200_000,
        value_name = "N"
    )]
    pub max_instances: usize,
    /// Memory one expression evaluation may hold, in MiB: past it the evaluation stops with an
    /// error (a derivation then stores null with the error in its trace). Single calls that
    /// would make a huge string or array (`$pad`, `$join`, `$split`, `$replace`, `$string`) are
    /// refused before they allocate.
    #[arg(long, env = "VALEM_EVAL_MEMORY_MB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1 << 20), value_name = "MIB")]
    pub eval_memory_mb: u64,
    /// The arithmetic fast path: `on` compiles hot arithmetic derivations to native code
    /// (cranelift), `off` leaves every derivation to the interpreter. Answers are the same.
    #[arg(long, env = "VALEM_JIT", default_value = "on", value_parser = on_off, action = clap::ArgAction::Set, value_name = "on|off")]
    pub jit: bool,
    /// Runs of an arithmetic derivation before its native code is requested (0: at once);
    /// the IR interpreter answers until then.
    #[arg(
        long,
        env = "VALEM_JIT_AFTER",
        default_value_t = 2,
        value_name = "RUNS"
    )]
    pub jit_after: u32,
}

impl CycleArgs {
    /// The engine's limits with these.
    fn engine(&self) -> EngineLimits {
        let mut limits = EngineLimits {
            cycle_budget: valem_service::time::cycle_budget(self.cycle_budget_ms),
            max_instances: self.max_instances,
            jit: valem_engine::JitConfig {
                enabled: self.jit,
                tier_after: self.jit_after,
            },
            ..EngineLimits::default()
        };
        limits.expr.memory_bytes = usize::try_from(self.eval_memory_mb << 20).unwrap_or(usize::MAX);
        limits
    }
}

/// What effect executors may do (`valem serve` and the embedded `valem mcp`).
#[derive(clap::Args, Debug, Clone)]
pub struct EffectsArgs {
    /// Comma-separated hosts `server` effects may call (`*`: any host). Empty (the default)
    /// refuses every call: effects reach nothing until the operator lists a destination.
    #[arg(
        long,
        env = "VALEM_EFFECTS_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "HOSTS"
    )]
    pub effects_allowed_hosts: Vec<String>,
    /// Let `server` effects reach loopback, private (RFC 1918), link-local and other non-public
    /// addresses (IPv6 forms that embed such an IPv4 address included). Off by default: a
    /// listed host that resolves to one is refused.
    #[arg(long, env = "VALEM_EFFECTS_ALLOW_PRIVATE_IPS", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_missing_value = "true", default_value = "false", value_name = "BOOL")]
    pub effects_allow_private_ips: bool,
    /// Largest response body a `server` effect folds back, in bytes.
    #[arg(long, env = "VALEM_EFFECTS_MAX_RESPONSE_BYTES", default_value_t = 1 << 20)]
    pub effects_max_response_bytes: usize,
    /// Seconds a `server` effect call may take when its policy names no `timeoutMs`.
    #[arg(long, env = "VALEM_EFFECTS_TIMEOUT", default_value_t = 5.0, value_parser = seconds)]
    pub effects_timeout: f64,
    /// A PEM file of CA certificates: https effects trust these instead of Mozilla's roots
    /// (an internal CA).
    #[arg(long, env = "VALEM_EFFECTS_CA_FILE", value_name = "PEM")]
    pub effects_ca_file: Option<PathBuf>,
}

impl EffectsArgs {
    /// Start the effect executors of `service` (they resume what the last run left, then run
    /// new dispatches); a CA file that cannot be read is reported, exit code 2.
    fn start(
        &self,
        cmd: &str,
        service: &std::sync::Arc<valem_service::ModelService>,
    ) -> Result<std::sync::Arc<valem_service::effects::Runner>, i32> {
        match self.config() {
            Ok(c) => Ok(valem_service::effects::Runner::start(service, c)),
            Err(e) => {
                eprintln!("valem {cmd}: --effects-ca-file: {e}");
                Err(2)
            }
        }
    }

    /// The executors' configuration; a CA file that cannot be read is an error.
    pub fn config(&self) -> Result<valem_service::effects::EffectsConfig, String> {
        let ca_certs = match &self.effects_ca_file {
            Some(p) => Some(valem_service::effects::load_ca_file(p)?),
            None => None,
        };
        Ok(valem_service::effects::EffectsConfig {
            ca_certs,
            allowed_hosts: self
                .effects_allowed_hosts
                .iter()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
                .collect(),
            allow_private_ips: self.effects_allow_private_ips,
            max_response_bytes: self.effects_max_response_bytes,
            default_timeout: std::time::Duration::from_secs_f64(self.effects_timeout),
            ..Default::default()
        })
    }
}

/// Which plugins to load (`valem serve`, `valem mcp`, `valem plugins list`).
#[derive(clap::Args, Debug, Clone)]
pub struct PluginArgs {
    /// Load a plugin library (a `cdylib` built with valem-sdk); repeatable, loaded in order.
    /// A library that does not load is reported and skipped: the daemon runs without it.
    #[arg(long = "plugin", value_name = "PATH")]
    pub plugin: Vec<PathBuf>,
    /// Also load every library (`*.so`, `*.dylib`, `*.dll`) in this directory, by name, after
    /// the --plugin ones.
    #[arg(long, env = "VALEM_PLUGIN_DIR", value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Configuration for the plugin named NAME, as JSON (repeatable).
    #[arg(long, value_name = "NAME=JSON", value_parser = plugin_config)]
    pub plugin_config: Vec<(String, serde_json::Value)>,
    /// Seconds a plugin call may take before it is answered with a timeout error.
    #[arg(long, env = "VALEM_PLUGIN_TIMEOUT", default_value_t = 10.0, value_parser = seconds)]
    pub plugin_timeout: f64,
    /// Do not load the built-in guidance plugin (`valem-guidance`): `get_domain_guidance`
    /// then offers only the topics of loaded guidance plugins (and the topics file).
    #[arg(long, env = "VALEM_NO_BUILTIN_GUIDANCE")]
    pub no_builtin_guidance: bool,
}

fn plugin_config(s: &str) -> Result<(String, serde_json::Value), String> {
    let (name, json) = s.split_once('=').ok_or_else(|| {
        format!("expected NAME=JSON, e.g. my-store={{\"bucket\":\"b\"}}; got {s:?}")
    })?;
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("the JSON for `{name}` is invalid: {e}"))?;
    Ok((name.to_string(), v))
}

impl PluginArgs {
    fn options(&self, data_dir: Option<&std::path::Path>) -> valem_service::plugins::Options {
        valem_service::plugins::Options {
            paths: self.plugin.clone(),
            dir: self
                .plugin_dir
                .clone()
                .filter(|d| !d.as_os_str().is_empty()),
            builtin_guidance: !self.no_builtin_guidance,
            timeout: std::time::Duration::from_secs_f64(self.plugin_timeout),
            data_dir: data_dir.map(|d| d.to_path_buf()),
            config: self.plugin_config.iter().cloned().collect(),
        }
    }
}

/// Load the plugins and build the guidance catalog from them (plus the topics file). Libraries
/// that fail are reported on stderr and skipped; a bad topics file is a usage error (exit 2).
fn load_plugins(
    cmd: &str,
    args: &PluginArgs,
    data_dir: Option<&std::path::Path>,
) -> Result<
    (
        std::sync::Arc<valem_service::plugins::Plugins>,
        valem_mcp::guidance::Catalog,
    ),
    i32,
> {
    let plugins = valem_service::plugins::Plugins::load(&args.options(data_dir));
    for f in plugins.failures() {
        eprintln!(
            "valem {cmd}: plugin {} not loaded: {}",
            f.path.display(),
            f.error
        );
    }
    let guidance = valem_mcp::guidance::Catalog::from_plugins(&plugins).map_err(|e| {
        eprintln!("valem {cmd}: {e}");
        2
    })?;
    Ok((std::sync::Arc::new(plugins), guidance))
}

/// Hand the service its storage plugins: the first `audit_store` plugin receives every committed
/// audit record and answers audit queries; the first `blob_store` plugin keeps blob bytes (a
/// second one of either kind is reported and not used).
fn attach_plugins(
    cmd: &str,
    service: &valem_service::ModelService,
    plugins: &valem_service::plugins::Plugins,
) {
    let mut audit = plugins.of_kind(valem_service::plugins::Kind::AuditStore);
    if let Some(first) = audit.next() {
        service.set_audit_plugin(first.clone());
        for p in audit {
            eprintln!(
                "valem {cmd}: audit store plugin `{}` not used: `{}` was loaded first",
                p.name, first.name
            );
        }
    }
    for (i, p) in plugins
        .of_kind(valem_service::plugins::Kind::BlobStore)
        .enumerate()
    {
        if i == 0 {
            service.set_blob_plugin(p.clone());
        } else {
            eprintln!(
                "valem {cmd}: blob store plugin `{}` not used: `{}` was loaded first and keeps the blobs",
                p.name,
                plugins
                    .of_kind(valem_service::plugins::Kind::BlobStore)
                    .next()
                    .map(|f| f.name.as_str())
                    .unwrap_or("")
            );
        }
    }
}

/// `valem plugins list`.
fn plugins_list(args: &PluginArgs, data_dir: Option<&std::path::Path>, as_json: bool) -> i32 {
    use valem_service::plugins::Kind;
    let plugins = valem_service::plugins::Plugins::load(&args.options(data_dir));
    let mut info = plugins.info();
    for (i, p) in plugins.loaded().iter().enumerate() {
        // What the daemon would make of it, with the daemon's own checks.
        let provides = match p.kind {
            Kind::Tool => valem_mcp::tools::plugin_tools(p)
                .map(|t| serde_json::json!(t.iter().map(|t| t.name).collect::<Vec<_>>())),
            Kind::Guidance => {
                let mut c = valem_mcp::guidance::Catalog::default();
                c.extend_from_plugin(p).map(|_| serde_json::json!(c.ids()))
            }
            Kind::BlobStore | Kind::AuditStore => Ok(serde_json::Value::Null),
        };
        let slot = &mut info["loaded"][i];
        match provides {
            Ok(v) => slot["provides"] = v,
            Err(e) => slot["error"] = serde_json::json!(e),
        }
    }
    if as_json {
        println!("{info:#}");
    } else {
        for p in info["loaded"].as_array().into_iter().flatten() {
            println!(
                "{} {} ({}) sdk {} · {} · {}",
                p["name"].as_str().unwrap_or(""),
                p["version"].as_str().unwrap_or(""),
                p["kind"].as_str().unwrap_or(""),
                p["sdkVersion"].as_str().unwrap_or(""),
                p["rustcVersion"].as_str().unwrap_or(""),
                p["path"].as_str().unwrap_or("built in"),
            );
            if let Some(list) = p["provides"].as_array() {
                let names: Vec<&str> = list.iter().filter_map(|v| v.as_str()).collect();
                println!("    {}", names.join(", "));
            }
            if let Some(e) = p["error"].as_str() {
                println!("    error: {e}");
            }
        }
        for f in info["failed"].as_array().into_iter().flatten() {
            println!(
                "NOT LOADED {}: {}",
                f["path"].as_str().unwrap_or(""),
                f["error"].as_str().unwrap_or("")
            );
        }
    }
    let broken = !plugins.failures().is_empty()
        || info["loaded"]
            .as_array()
            .is_some_and(|l| l.iter().any(|p| p.get("error").is_some()));
    i32::from(broken)
}

/// The service, in memory or over the store in `data_dir` (recovering its models); a store
/// that cannot be opened or recovered is reported and exits 1.
fn open_service(
    cmd: &str,
    shards: usize,
    limits: valem_service::ServiceLimits,
    args: &StoreArgs,
) -> Result<std::sync::Arc<valem_service::ModelService>, i32> {
    let Some(dir) = args.data_dir.as_deref() else {
        if let Some(f) = &args.audit_key_file {
            eprintln!(
                "valem {cmd}: --audit-key-file {} needs --data-dir: the key protects the durable audit log",
                f.display()
            );
            return Err(2);
        }
        return Ok(valem_service::ModelService::new(shards, limits));
    };
    let audit_key = match &args.audit_key_file {
        None => None,
        Some(f) => Some(read_audit_key(f).map_err(|e| {
            eprintln!("valem {cmd}: {e}");
            2
        })?),
    };
    let opts = valem_store::StoreOptions {
        durability: if args.durability == "relaxed" {
            valem_store::Durability::Relaxed
        } else {
            valem_store::Durability::Strict
        },
        max_db_bytes: args.max_db_bytes,
        audit_key,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let store = valem_store::SqliteStore::open(dir, opts).map_err(|e| {
        eprintln!(
            "valem {cmd}: cannot open the data directory {}: {e}",
            dir.display()
        );
        1
    })?;
    if let Some(a) = store.key_adoption() {
        if a.models.is_empty() {
            eprintln!(
                "valem {cmd}: the store in {} is keyed with this audit key; later starts need it",
                dir.display()
            );
        } else {
            let mut firsts: Vec<String> = a
                .models
                .iter()
                .take(10)
                .map(|(m, from)| format!("`{m}` from record {from}"))
                .collect();
            if a.models.len() > 10 {
                firsts.push(format!("and {} more", a.models.len() - 10));
            }
            eprintln!(
                "valem {cmd}: the store in {} had no audit key and adopts this one: audit records are keyed from now on ({}); {} checkpoint(s) rehashed. Later starts need this key.",
                dir.display(),
                firsts.join(", "),
                a.checkpoints_rehashed
            );
        }
    }
    let service = valem_service::ModelService::open(shards, limits, std::sync::Arc::new(store))
        .map_err(|e| {
            eprintln!(
                "valem {cmd}: cannot recover the models in {}: {e}",
                dir.display()
            );
            1
        })?;
    tracing::info!(
        models = service.model_count(),
        took_ms = started.elapsed().as_millis() as u64,
        dir = %dir.display(),
        "recovered the stored models"
    );
    Ok(service)
}

/// The audit key in `path` (see `--audit-key-file`); the error names the file and what is wrong.
fn read_audit_key(path: &Path) -> Result<valem_store::AuditKey, String> {
    const MAX: u64 = 4096;
    let len = std::fs::metadata(path)
        .map_err(|e| format!("cannot read the audit key file {}: {e}", path.display()))?
        .len();
    if len > MAX {
        return Err(format!(
            "the audit key file {} is {len} bytes; a key is 64 hex characters or 32 raw bytes",
            path.display()
        ));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read the audit key file {}: {e}", path.display()))?;
    valem_store::AuditKey::parse(&bytes)
        .map_err(|e| format!("the audit key file {} holds no key: {e}", path.display()))
}

fn mcp_proxy(
    url: &str,
    api_key: Option<String>,
    browser: bool,
    max_message_bytes: usize,
    plugin_args: &PluginArgs,
) -> i32 {
    if !url.starts_with("http://") && !url.starts_with("https://") {
        eprintln!(
            "valem mcp: --url must be an http:// or https:// URL of a valem daemon (got `{url}`)"
        );
        return 2;
    }
    let (plugins, guidance) = match load_plugins("mcp", plugin_args, None) {
        Ok(g) => g,
        Err(code) => return code,
    };
    // The proxy runs authoring tools only; tools, blobs and audit live on the daemon.
    if let Some(p) = plugins
        .loaded()
        .iter()
        .find(|p| p.kind != valem_service::plugins::Kind::Guidance)
    {
        eprintln!(
            "valem mcp --url: plugin `{}` is a {} plugin; those load in the daemon (`valem serve --plugin`), the proxy loads guidance plugins only",
            p.name,
            p.kind.as_str()
        );
        return 2;
    }
    // Authoring tools only: they never touch this service's registry.
    let service = valem_service::ModelService::new(1, Default::default());
    let mode = if browser {
        valem_mcp::Mode::ProxyWithBrowser
    } else {
        valem_mcp::Mode::Proxy
    };
    let server = valem_mcp::Server::new(service, guidance, mode);
    eprintln!(
        "valem mcp {}: proxy to {url}; reading JSON-RPC on stdin",
        env!("CARGO_PKG_VERSION")
    );
    let key = api_key.filter(|k| !k.is_empty());
    let url = url.to_string();
    let stdin = std::io::stdin().lock();
    match valem_mcp::stdio::serve_with(
        move |out| -> std::sync::Arc<dyn valem_mcp::Handler> {
            valem_mcp::proxy::Proxy::new(server, &url, key, out, browser)
        },
        stdin,
        std::io::stdout(),
        max_message_bytes,
    ) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("valem mcp: {e}");
            1
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
