//! The in-memory content-addressed blob store: a blob's id is the blake3 hash of its bytes, so
//! uploading the same bytes twice stores them once. Bounded per blob and in total.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use super::ServiceError;

/// What an upload returns.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlobRef {
    pub blob_id: String,
    pub bytes: usize,
    pub media_type: String,
}

/// A blob of `len` bytes fits under `max`, or the TooLarge error naming both.
pub(crate) fn check_size(len: usize, max: usize) -> Result<(), ServiceError> {
    if len > max {
        return Err(ServiceError::TooLarge(format!(
            "blob of {len} bytes exceeds the limit of {max} bytes"
        )));
    }
    Ok(())
}

pub struct BlobStore {
    blobs: HashMap<String, (BlobRef, Arc<[u8]>)>,
    total: usize,
    max_bytes: usize,
    max_total: usize,
}

impl BlobStore {
    pub fn new(max_bytes: usize, max_total: usize) -> BlobStore {
        BlobStore {
            blobs: HashMap::new(),
            total: 0,
            max_bytes,
            max_total,
        }
    }

    pub fn put(
        &mut self,
        data: Vec<u8>,
        media_type: Option<String>,
    ) -> Result<BlobRef, ServiceError> {
        check_size(data.len(), self.max_bytes)?;
        let blob_id = blake3::hash(&data).to_hex().to_string();
        if let Some((r, _)) = self.blobs.get(&blob_id) {
            return Ok(r.clone());
        }
        if self.total + data.len() > self.max_total {
            return Err(ServiceError::TooLarge(format!(
                "the blob store is full ({} of {} bytes used)",
                self.total, self.max_total
            )));
        }
        let r = BlobRef {
            blob_id: blob_id.clone(),
            bytes: data.len(),
            media_type: media_type.unwrap_or_else(|| "application/octet-stream".into()),
        };
        self.total += data.len();
        self.blobs.insert(blob_id, (r.clone(), Arc::from(data)));
        Ok(r)
    }

    pub fn get(&self, blob_id: &str) -> Option<(BlobRef, Arc<[u8]>)> {
        self.blobs.get(blob_id).cloned()
    }
}
