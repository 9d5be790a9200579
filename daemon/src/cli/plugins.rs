//! Loading plugins for a command, attaching them to the service, and `valem plugins list`.

use super::*;

/// Load the plugins and build the guidance catalog from them (plus the topics file). Libraries
/// that fail are reported on stderr and skipped; a bad topics file is a usage error (exit 2).
pub(super) fn load_plugins(
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
pub(super) fn attach_plugins(
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
pub(super) fn plugins_list(
    args: &PluginArgs,
    data_dir: Option<&std::path::Path>,
    as_json: bool,
) -> i32 {
    use valem_service::plugins::Kind;
    let plugins = valem_service::plugins::Plugins::load(&args.options(data_dir));
    let mut info = plugins.info();
    for (i, p) in plugins.loaded().iter().enumerate() {
        // What the daemon would make of it, with the daemon's own checks.
        let provides = match p.kind {
            Kind::Tool => valem_mcp::tools::plugin_tools(p)
                .map(|t| serde_json::json!(t.iter().map(|t| t.name).collect::<Vec<_>>()))
                .map_err(|e| e.to_string()),
            Kind::Guidance => {
                let mut c = valem_mcp::guidance::Catalog::default();
                c.extend_from_plugin(p)
                    .map(|_| serde_json::json!(c.ids()))
                    .map_err(|e| e.to_string())
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
