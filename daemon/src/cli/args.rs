//! The command line's arguments: the subcommands and the argument groups several of them share
//! (`StoreArgs`, `CycleArgs`, `EffectsArgs`, `PluginArgs`).

use super::*;

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
    Eval(EvalArgs),
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
    ///
    /// Protocol revisions: both eras of MCP, chosen by the client per message. The modern era
    /// (2026-07-28): a request names its revision in its _meta
    /// ("io.modelcontextprotocol/protocolVersion") and needs no handshake; server/discover lists
    /// what is spoken;
    /// subscriptions/listen streams state changes; long tools (test_spec, dry_run,
    /// evolve_spec) run as tasks for a client that declares the tasks extension; pair_browser
    /// is a multi round-trip request. The legacy era: an `initialize` handshake at 2024-11-05,
    /// 2025-03-26, 2025-06-18 or 2025-11-25. A client that probes with server/discover (the
    /// official SDKs' "auto" mode) settles on 2026-07-28; the proxy speaks the client's era to
    /// the daemon too.
    Mcp(McpArgs),
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
    Console(ConsoleArgs),
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
    Serve(ServeArgs),
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
    Bench(BenchArgs),
    /// List the bundled example specs, or print one.
    Examples {
        /// Print this example's spec.
        name: Option<String>,
    },
}

/// `on`/`off` (also `1`/`0`, `true`/`false`).
pub(super) fn on_off(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(format!("expected on or off; got {s:?}")),
    }
}

/// A positive, finite number of seconds (at most a day).
pub(super) fn seconds(s: &str) -> Result<f64, String> {
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

/// Where and how models are kept (`valem serve` and `valem mcp`).
#[derive(clap::Args, Debug)]
pub struct StoreArgs {
    /// Keep models in this directory (durable mode): a SQLite database holding every model's
    /// spec, audit log, checkpoints and blobs; models are recovered from it on start, and a
    /// write is acknowledged only once it is committed. Without it, models live in memory and
    /// end with the process.
    #[arg(long, env = "VALEM_DATA_DIR", conflicts_with = "store")]
    pub data_dir: Option<PathBuf>,
    /// Keep models in a PostgreSQL database instead of a data directory (durable mode, as with
    /// --data-dir): `postgres://USER:PASSWORD@HOST:PORT/DATABASE` (or a `key=value` connection
    /// string). Everything durable lives in the schema `valem` of that database, created and
    /// migrated at start (a schema from a newer valem is refused); blob bytes too. Several
    /// daemons share one database as a fleet with --node-id. TLS is not supported yet: use a
    /// trusted network or a local proxy.
    #[arg(long, env = "VALEM_STORE", value_name = "URL")]
    pub store: Option<String>,
    /// With --store: this node's id in a fleet of daemons sharing the database (unique in the
    /// fleet, the same across restarts of this node). Each model then has one owner node at
    /// a time, with a lease this node renews; a model is claimed by the first node a request
    /// for it reaches once its owner's lease ran out, and every commit checks the claim
    /// (an owner paused past its lease commits nothing more). A request for a model another
    /// live node owns is forwarded to that node (REST and MCP's modern era; a WebSocket or a
    /// legacy MCP session gets 421 or a tool error naming it). Nothing is loaded at start: each
    /// model wakes at its first request here. See GET /cluster and docs/fleet.md.
    #[arg(
        long,
        env = "VALEM_NODE_ID",
        value_name = "ID",
        requires = "store",
        requires = "advertise"
    )]
    pub node_id: Option<String>,
    /// With --node-id: the URL the other nodes and clients reach this node at
    /// (`http://host:port`).
    #[arg(
        long,
        env = "VALEM_ADVERTISE",
        value_name = "URL",
        requires = "node_id"
    )]
    pub advertise: Option<String>,
    /// With --node-id: how long a claim holds a model without renewal, in milliseconds; this
    /// node renews every third of it. A dead node's models move after at most this long.
    #[arg(long, env = "VALEM_LEASE_MS", default_value_t = 5000, value_name = "MS", value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub lease_ms: u64,
    /// With --store: how long to keep trying at start while the database cannot be reached
    /// (down, restarting), in seconds; then the daemon gives up with the last error.
    #[arg(
        long,
        env = "VALEM_STORE_CONNECT_TIMEOUT",
        default_value_t = 30.0,
        value_name = "SECS"
    )]
    pub store_connect_timeout: f64,
    /// With a store: `strict` acknowledges a write after its batch is fsynced (PostgreSQL:
    /// `synchronous_commit = on`); `relaxed` after COMMIT without fsync (an OS crash or power
    /// loss may lose the last moments).
    #[arg(long, env = "VALEM_DURABILITY", default_value = "strict", value_parser = ["strict", "relaxed"])]
    pub durability: String,
    /// With a store: checkpoint a model's state every N audit records (and at shutdown), so
    /// a restart replays at most N records per model.
    #[arg(long, env = "VALEM_CHECKPOINT_EVERY", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: u64,
    /// With --data-dir: the largest the SQLite database may grow, in bytes (default: the disk's
    /// space). Past it writes fail as on a full disk, and work again once there is room.
    #[arg(long, env = "VALEM_MAX_DB_BYTES")]
    pub max_db_bytes: Option<u64>,
    /// With a store: a file holding a 32-byte audit key, as 64 hex characters (`openssl rand
    /// -hex 32 > FILE`) or 32 raw bytes. Audit record and checkpoint hashes become keyed blake3,
    /// so verify_audit catches a rewrite of the log by anyone without the key. The store
    /// remembers its key: later starts need the same key. An unkeyed store given a key keys
    /// each model's chain from its next record on.
    #[arg(long, env = "VALEM_AUDIT_KEY_FILE", value_name = "PATH")]
    pub audit_key_file: Option<PathBuf>,
    /// With a store: keep at most N models in memory. Past it the least recently used are
    /// evicted (their state is already durable; a checkpoint at their head is written) and
    /// woken from the store by their next request, on every surface; timers and subscribers
    /// keep working meanwhile. At start no model is loaded: each wakes when first asked for.
    /// Explain traces and the in-memory history ring start again at a wake, as at a restart.
    /// --max-models still bounds all models, hibernated ones included.
    #[arg(long, env = "VALEM_MAX_RESIDENT_MODELS", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_resident_models: Option<u64>,
}

/// Where models run and how many may live, with the engine's limits (`valem mcp`, `console`
/// and `serve` share these).
#[derive(clap::Args, Debug)]
pub struct ModelsArgs {
    /// Shard threads running the models (0: one per core).
    #[arg(long, env = "VALEM_SHARDS", default_value_t = 0)]
    pub shards: usize,
    /// Most live models.
    #[arg(long, env = "VALEM_MAX_MODELS", default_value_t = 1000)]
    pub max_models: usize,
    #[command(flatten)]
    pub cycle: CycleArgs,
}

impl ModelsArgs {
    /// The service's limits with these (the rest at their defaults).
    pub(super) fn limits(&self) -> valem_service::ServiceLimits {
        valem_service::ServiceLimits {
            engine: self.cycle.engine(),
            max_models: self.max_models,
            ..Default::default()
        }
    }
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
    pub(super) fn engine(&self) -> EngineLimits {
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
    pub(super) fn start(
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

pub(super) fn plugin_config(s: &str) -> Result<(String, serde_json::Value), String> {
    let (name, json) = s.split_once('=').ok_or_else(|| {
        format!("expected NAME=JSON, e.g. my-store={{\"bucket\":\"b\"}}; got {s:?}")
    })?;
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("the JSON for `{name}` is invalid: {e}"))?;
    Ok((name.to_string(), v))
}

impl PluginArgs {
    pub(super) fn options(
        &self,
        data_dir: Option<&std::path::Path>,
    ) -> valem_service::plugins::Options {
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

/// The arguments of `valem eval`.
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// The JSONata expression.
    pub expr: String,
    /// JSON input document: a file, or `-` for standard input (default: no input).
    #[arg(long)]
    pub input: Option<String>,
    /// JSON object of variable bindings, e.g. '{"rate": 0.2}' binds $rate.
    #[arg(long)]
    pub bindings: Option<String>,
    /// Print exactly one JSON line: {"result": v}, {} when undefined, or {"error": {...}}.
    #[arg(long)]
    pub json: bool,
}

/// The arguments of `valem mcp`.
#[derive(clap::Args, Debug)]
pub struct McpArgs {
    /// Proxy to the daemon at this base URL (e.g. http://127.0.0.1:8080) instead of
    /// running an embedded engine.
    #[arg(long, env = "VALEM_URL")]
    pub url: Option<String>,
    /// API key of the daemon (sent as `Authorization: Bearer`).
    #[arg(long, env = "VALEM_API_KEY", hide_env_values = true, requires = "url")]
    pub api_key: Option<String>,
    /// With --url: offer `pair_browser`, which pairs the agent with the developer's browser
    /// sandbox (the daemon's /sandbox/) so both drive one live session.
    #[arg(long, requires = "url")]
    pub browser: bool,
    /// Largest accepted message in bytes; longer lines are refused with -32600 and skipped.
    #[arg(long, env = "VALEM_MCP_MAX_MESSAGE_BYTES", default_value_t = valem_mcp::stdio::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    #[command(flatten)]
    pub models: ModelsArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(flatten)]
    pub effects: EffectsArgs,
}

/// The arguments of `valem console`.
#[derive(clap::Args, Debug)]
pub struct ConsoleArgs {
    /// Remote mode: the daemon's base URL, e.g. http://127.0.0.1:8080.
    #[arg(long, env = "VALEM_URL")]
    pub url: Option<String>,
    /// Remote mode: the daemon's API key, sent as `Authorization: Bearer <key>`.
    #[arg(long, env = "VALEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest accepted line in bytes; longer lines are refused with an error and skipped.
    #[arg(long, env = "VALEM_CONSOLE_MAX_LINE_BYTES", default_value_t = crate::console::DEFAULT_MAX_LINE_BYTES)]
    pub max_line_bytes: usize,
    #[command(flatten)]
    pub models: ModelsArgs,
}

/// The arguments of `valem serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, env = "VALEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// Require this API key on every request but /healthz.
    #[arg(long, env = "VALEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Comma-separated browser origins allowed besides loopback ones (`*`: any).
    #[arg(long, env = "VALEM_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Comma-separated Host names allowed besides loopback ones (needed when listening
    /// on a non-loopback address; `*`: any).
    #[arg(long, env = "VALEM_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Largest accepted request body in bytes.
    #[arg(long, env = "VALEM_MAX_BODY_BYTES", default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Largest blob in bytes (`POST /blobs`, `upload_blob`).
    #[arg(long, env = "VALEM_MAX_BLOB_BYTES", default_value_t = 50 << 20)]
    pub max_blob_bytes: usize,
    /// Seconds a client has to send a request's headers, counted from the connection's
    /// opening or its previous response; slow or idle connections are closed after it.
    #[arg(long, env = "VALEM_HEADER_TIMEOUT", default_value_t = 10.0, value_parser = seconds)]
    pub header_timeout: f64,
    /// Seconds a request may take, body and handling included (408 past it); SSE and
    /// WebSocket streams are not limited.
    #[arg(long, env = "VALEM_REQUEST_TIMEOUT", default_value_t = 60.0, value_parser = seconds)]
    pub request_timeout: f64,
    #[command(flatten)]
    pub models: ModelsArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(flatten)]
    pub effects: EffectsArgs,
    /// Serve the MCP conformance suite's fixture tools, resources and prompts. For the
    /// conformance tests only; never enable it on a real daemon.
    #[arg(long, hide = true)]
    pub conformance_fixtures: bool,
    /// Seconds a sandbox pairing (POST /sandbox/pair) waits for the developer's approval
    /// before it expires.
    #[arg(long, env = "VALEM_PAIRING_TTL", default_value_t = 600.0, value_parser = seconds)]
    pub pairing_ttl: f64,
    /// Seconds the pairing agent is told to wait between token polls (`intervalSec`).
    #[arg(long, env = "VALEM_PAIRING_INTERVAL", default_value_t = 3.0, value_parser = seconds)]
    pub pairing_interval: f64,
}

/// The arguments of `valem bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// The synthetic shape (ignored with --spec).
    #[arg(long, value_enum, default_value = "fanout")]
    pub shape: crate::bench::Shape,
    /// The shape's size: derivations (fanout, chain) or items (items, mixed).
    #[arg(long, default_value_t = 10_000)]
    pub n: usize,
    /// Benchmark this spec instead (a file, `-`, or `example:<name>`).
    #[arg(long, value_name = "FILE")]
    pub spec: Option<String>,
    /// With --spec: a JSON array of mutation objects `{"$.path": value, ...}`, applied one
    /// per cycle in order (cycled), instead of generated writes.
    #[arg(long, value_name = "FILE", requires = "spec")]
    pub mutations: Option<String>,
    /// Most mutations to time.
    #[arg(long, default_value_t = 1_000)]
    pub count: usize,
    /// Stop timing mutations after this many seconds (at least one runs).
    #[arg(long, default_value_t = 10.0)]
    pub max_seconds: f64,
    /// Seconds of untimed mutations before the timed ones (0: time from the first).
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    pub warmup: f64,
    /// The arithmetic fast path for the run: on or off.
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set, value_name = "on|off")]
    pub jit: bool,
    /// Seed of the mutation generator.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Go through the model service in memory (one shard: its history ring, traces and
    /// audit trail; no transport), as the daemon commits.
    #[arg(long)]
    pub service: bool,
    /// Go through the model service and a durable store (strict: each mutation counts
    /// once fsynced) in a temporary directory, removed after the run.
    #[arg(long)]
    pub durable: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Instead of one model: create N small models (copies of --spec, by default the bundled
    /// car-loan-calculator) through the service over a strict durable store in a temporary
    /// directory, from one caller, then time --count reads of one model in memory and of
    /// models picked at random (woken from the store under --max-resident-models). Reports
    /// creates/s, resident KB per model and read latencies.
    #[arg(long, value_name = "N")]
    pub models: Option<usize>,
    /// With --models: keep at most this many models in memory (as `valem serve
    /// --max-resident-models`).
    #[arg(long, value_name = "N", requires = "models")]
    pub max_resident_models: Option<usize>,
    /// With --models: shard threads (0: one per core, as `valem serve`).
    #[arg(long, default_value_t = 0, requires = "models")]
    pub shards: usize,
    /// With --models: drive the daemon at this URL over REST (one keep-alive client) instead
    /// of a service in this process; memory is the daemon's, read from its /metrics. Start it
    /// with the flags to measure (`--data-dir`, `--max-resident-models`, `--max-models`).
    #[arg(long, value_name = "URL", requires = "models", conflicts_with_all = ["max_resident_models", "shards"])]
    pub url: Option<String>,
    /// With --url: the daemon's API key.
    #[arg(long, env = "VALEM_API_KEY", requires = "url")]
    pub api_key: Option<String>,
    /// With --models in-process: `strict` acknowledges a creation after its fsync, `relaxed`
    /// after COMMIT (as `valem serve --durability`).
    #[arg(long, default_value = "strict", value_parser = ["strict", "relaxed"], requires = "models", conflicts_with = "url")]
    pub durability: String,
    /// With --models: creations in flight at once from the one caller, each thread on its own
    /// keep-alive connection over REST (1: one call after the other). A strict store commits
    /// what arrives together in one fsynced batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256), requires = "models")]
    pub concurrency: u16,
    /// The most instances one `[*]` derivation may span, as `valem serve --max-instances`
    /// (`items` at 1M needs `--max-instances 1000000`).
    #[arg(long, value_name = "N", default_value_t = valem_service::ServiceLimits::default().engine.max_instances)]
    pub max_instances: usize,
}
