//! `libvalem_guidance.so`: the daemon's built-in guidance plugin as a library. A separate crate
//! because two statically linked plugins cannot both export `valem_plugin_v1`.

valem_sdk::export_entry!(valem_plugin_guidance::plugin_v1);
