//! `libvalem_blob_fs.so`: the blob-fs blob store as a library (see `plugins/blob-fs`).

valem_sdk::export_entry!(valem_plugin_blob_fs::plugin_v1);
