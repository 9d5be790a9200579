//! The service's blob operations: bytes kept by a `blob_store` plugin, the store or memory,
//! metadata rows, and downloads checked against the model that names the blob.

use super::*;

/// The metadata row of a blob whose bytes are already stored.
pub(super) fn put_blob_meta(
    store: &dyn valem_store::Store,
    r: &BlobRef,
) -> Result<(), ServiceError> {
    store
        .writer()
        .apply(valem_store::Op::PutBlob(valem_store::BlobMeta {
            id: r.blob_id.clone(),
            hash: r.blob_id.clone(),
            size: r.bytes as u64,
            media_type: r.media_type.clone(),
            filename: None,
            created: time::now(),
        }))
        .map_err(|e| ServiceError::Storage(e.to_string()))
}

impl ModelService {
    // --- blobs ------------------------------------------------------------------------------

    /// Keep blob bytes in a `blob_store` plugin from now on (set once, before serving).
    pub fn set_blob_plugin(&self, p: Arc<crate::plugins::Plugin>) -> bool {
        self.blob_plugin.set(p).is_ok()
    }

    /// Bytes into the blob plugin, metadata into the store (or memory).
    pub(super) fn upload_to_plugin(
        &self,
        p: &crate::plugins::Plugin,
        data: Vec<u8>,
        media_type: Option<String>,
    ) -> Result<BlobRef, ServiceError> {
        blobs::check_size(data.len(), self.limits.blob_max_bytes)?;
        let hash = blake3::hash(&data).to_hex().to_string();
        let size = data.len();
        p.call_bytes("blob.put", serde_json::json!({"id": hash}), Arc::from(data))
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        let r = BlobRef {
            blob_id: hash.clone(),
            bytes: size,
            media_type: media_type.unwrap_or_else(|| "application/octet-stream".into()),
        };
        match &self.store {
            Some(store) => put_blob_meta(&**store, &r)?,
            None => {
                self.plugin_blobs
                    .lock()
                    .map_err(|_| ServiceError::Unavailable)?
                    .insert(hash, r.clone());
            }
        }
        Ok(r)
    }

    /// A blob's bytes from the blob plugin, checked against their content id.
    pub(super) fn download_from_plugin(
        &self,
        p: &crate::plugins::Plugin,
        blob_id: &str,
    ) -> Result<(BlobRef, Arc<[u8]>), ServiceError> {
        let not_found = || ServiceError::BlobNotFound(blob_id.to_string());
        let meta = match &self.store {
            Some(store) => store
                .blob(blob_id)
                .map_err(|e| ServiceError::Storage(e.to_string()))?
                .map(|m| BlobRef {
                    blob_id: m.id,
                    bytes: m.size as usize,
                    media_type: m.media_type,
                }),
            None => self
                .plugin_blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .get(blob_id)
                .cloned(),
        }
        .ok_or_else(not_found)?;
        let bytes = p
            .call_bytes(
                "blob.get",
                serde_json::json!({"id": blob_id}),
                Arc::from([]),
            )
            .map_err(|e| match e.code() {
                Some("not_found") => not_found(),
                _ => ServiceError::Storage(e.to_string()),
            })?;
        if blake3::hash(&bytes).to_hex().as_str() != blob_id {
            return Err(ServiceError::Storage(format!(
                "blob store plugin `{}` returned bytes that do not match blob {blob_id}",
                p.name
            )));
        }
        Ok((meta, Arc::from(bytes)))
    }

    pub fn upload_blob(
        &self,
        data: Vec<u8>,
        media_type: Option<String>,
    ) -> Result<BlobRef, ServiceError> {
        if let Some(p) = self.blob_plugin.get() {
            return self.upload_to_plugin(p, data, media_type);
        }
        let Some(store) = &self.store else {
            return self
                .blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .put(data, media_type);
        };
        blobs::check_size(data.len(), self.limits.blob_max_bytes)?;
        // Bytes first (temp file, fsync, rename), then the metadata row: a crash between them
        // leaves an unreferenced file, never a row without bytes.
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        let hash = store.put_blob_bytes(&data).map_err(storage)?;
        let r = BlobRef {
            blob_id: hash,
            bytes: data.len(),
            media_type: media_type.unwrap_or_else(|| "application/octet-stream".into()),
        };
        put_blob_meta(&**store, &r)?;
        Ok(r)
    }

    /// A blob's bytes; with `model`, only when that model's state references it.
    pub fn download_blob(
        &self,
        blob_id: &str,
        model: Option<&str>,
    ) -> Result<(BlobRef, Arc<[u8]>), ServiceError> {
        if let Some(m) = model {
            let (owned, b) = (m.to_string(), blob_id.to_string());
            if !self.on_model(m, move |s| s.references(&owned, &b))? {
                return Err(ServiceError::BlobNotFound(blob_id.to_string()));
            }
        }
        if let Some(p) = self.blob_plugin.get() {
            return self.download_from_plugin(p, blob_id);
        }
        let Some(store) = &self.store else {
            return self
                .blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .get(blob_id)
                .ok_or_else(|| ServiceError::BlobNotFound(blob_id.to_string()));
        };
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        let meta = store
            .blob(blob_id)
            .map_err(storage)?
            .ok_or_else(|| ServiceError::BlobNotFound(blob_id.to_string()))?;
        let bytes = store.blob_bytes(&meta.hash).map_err(storage)?;
        Ok((
            BlobRef {
                blob_id: meta.id,
                bytes: bytes.len(),
                media_type: meta.media_type,
            },
            Arc::from(bytes),
        ))
    }
}
