//! Opening what a command runs on: the service (in memory or over a store, with its audit key)
//! and the stdio proxy to a daemon.

use super::*;

/// Where the models are kept, for messages: `in /data/dir` or `in postgres://user@host:5432/db`.
pub(super) fn store_label(args: &StoreArgs) -> Option<String> {
    match (&args.data_dir, &args.store) {
        (Some(d), _) => Some(d.display().to_string()),
        (None, Some(url)) => Some(
            valem_store::PgStore::label_of(url).unwrap_or_else(|| "the --store database".into()),
        ),
        (None, None) => None,
    }
}

/// The service, in memory or over the store (`--data-dir` or `--store`), recovering its
/// models; a store that cannot be opened or recovered is reported and exits 1.
pub(super) fn open_service(
    cmd: &str,
    shards: usize,
    mut limits: valem_service::ServiceLimits,
    args: &StoreArgs,
) -> Result<std::sync::Arc<valem_service::ModelService>, i32> {
    limits.max_resident_models = args
        .max_resident_models
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    // A fleet's node loads nothing at start: each model wakes (claimed) at its first request.
    if args.node_id.is_some() && limits.max_resident_models.is_none() {
        limits.max_resident_models = Some(limits.max_models);
    }
    let Some(label) = store_label(args) else {
        if let Some(n) = args.max_resident_models {
            eprintln!(
                "valem {cmd}: --max-resident-models {n} needs a store (--data-dir or --store): an evicted model is woken from the store, and without one it would be lost"
            );
            return Err(2);
        }
        if let Some(f) = &args.audit_key_file {
            eprintln!(
                "valem {cmd}: --audit-key-file {} needs a store (--data-dir or --store): the key protects the durable audit log",
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
        node: args.node_id.clone().map(|id| valem_store::pg::NodeConfig {
            id,
            url: args.advertise.clone().unwrap_or_default(),
            lease: std::time::Duration::from_millis(args.lease_ms),
            renew: true,
        }),
        ..Default::default()
    };
    if let Some(id) = &args.node_id {
        if args.store.is_none() {
            eprintln!(
                "valem {cmd}: --node-id needs --store postgres://…: a fleet's nodes share one PostgreSQL database"
            );
            return Err(2);
        }
        let ok = !id.is_empty()
            && id.len() <= 128
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            eprintln!(
                "valem {cmd}: --node-id must be 1 to 128 characters of letters, digits, `-`, `_` and `.` (got `{id}`)"
            );
            return Err(2);
        }
    }
    if let Some(url) = &args.advertise {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            eprintln!(
                "valem {cmd}: --advertise must be the http:// or https:// URL other nodes and clients reach this node at (got `{url}`)"
            );
            return Err(2);
        }
    }
    let started = std::time::Instant::now();
    let store: std::sync::Arc<dyn valem_store::Store> = match (&args.data_dir, &args.store) {
        (Some(dir), _) => {
            let store = valem_store::SqliteStore::open(dir, opts).map_err(|e| {
                eprintln!(
                    "valem {cmd}: cannot open the data directory {}: {e}",
                    dir.display()
                );
                1
            })?;
            std::sync::Arc::new(store)
        }
        (None, Some(url)) => std::sync::Arc::new(open_pg(cmd, url, opts, args)?),
        (None, None) => return Err(2),
    };
    if let Some(a) = store.key_adoption() {
        if a.models.is_empty() {
            eprintln!(
                "valem {cmd}: the store in {label} is keyed with this audit key; later starts need it"
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
                "valem {cmd}: the store in {label} had no audit key and adopts this one: audit records are keyed from now on ({}); {} checkpoint(s) rehashed. Later starts need this key.",
                firsts.join(", "),
                a.checkpoints_rehashed
            );
        }
    }
    let service = valem_service::ModelService::open(shards, limits, store).map_err(|e| {
        eprintln!("valem {cmd}: cannot recover the models in {label}: {e}");
        1
    })?;
    match args.max_resident_models {
        None => tracing::info!(
            models = service.model_count(),
            took_ms = started.elapsed().as_millis() as u64,
            store = %label,
            "recovered the stored models"
        ),
        Some(n) => tracing::info!(
            models = service.model_count(),
            max_resident = n,
            took_ms = started.elapsed().as_millis() as u64,
            store = %label,
            "registered the stored models; each is loaded at its first request"
        ),
    }
    Ok(service)
}

/// Open the PostgreSQL store at `url`, trying again while the database cannot be reached,
/// for up to `--store-connect-timeout`.
fn open_pg(
    cmd: &str,
    url: &str,
    opts: valem_store::StoreOptions,
    args: &StoreArgs,
) -> Result<valem_store::PgStore, i32> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://") || url.contains('=')) {
        eprintln!(
            "valem {cmd}: --store takes a PostgreSQL URL (postgres://USER:PASSWORD@HOST:PORT/DATABASE); for the embedded store use --data-dir DIR"
        );
        return Err(2);
    }
    if args.max_db_bytes.is_some() {
        eprintln!(
            "valem {cmd}: --max-db-bytes bounds the SQLite database of --data-dir; PostgreSQL's size is the server's to bound"
        );
        return Err(2);
    }
    let wait = std::time::Duration::from_secs_f64(args.store_connect_timeout.clamp(0.0, 86_400.0));
    let deadline = std::time::Instant::now() + wait;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        match valem_store::PgStore::open(url, opts.clone()) {
            Ok(s) => {
                if attempt > 1 {
                    eprintln!(
                        "valem {cmd}: reached the database {} (attempt {attempt})",
                        s.label()
                    );
                }
                return Ok(s);
            }
            Err(e @ valem_store::StoreError::Unavailable { .. })
                if std::time::Instant::now() < deadline =>
            {
                if attempt == 1 {
                    eprintln!(
                        "valem {cmd}: {e}; trying again for up to {:.0} s (--store-connect-timeout)",
                        wait.as_secs_f64()
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(
                    (100u64 << attempt.min(4)).min(1000),
                ));
            }
            Err(e) => {
                eprintln!("valem {cmd}: cannot open the store: {e}");
                return Err(1);
            }
        }
    }
}

/// The audit key in `path` (see `--audit-key-file`); the error names the file and what is wrong.
pub(super) fn read_audit_key(path: &Path) -> Result<valem_store::AuditKey, String> {
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

pub(super) fn mcp_proxy(
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
