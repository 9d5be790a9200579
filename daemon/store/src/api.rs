//! The `Store` trait: what the model service needs of a durable store, whatever keeps the
//! data. [`SqliteStore`] is its first implementation; every method keeps the guarantees the
//! crate documentation states for it (a write is acknowledged only once committed, records
//! chain, checkpoints are checked before they are used).

use std::ops::ControlFlow;
use std::path::Path;

use serde_json::Value as Json;

use crate::chain::{AuditKey, BrokenCheckpoint, ChainHasher, ChainReport, Seq};
use crate::checkpoints::CheckpointChoice;
use crate::keys::KeyAdoption;
use crate::pg::{NodeInfo, Ownership};
use crate::Timestamp;
use crate::{
    AuditEntry, AuditFilter, BlobMeta, SqliteStore, StoreError, StoredKey, StoredModel,
    StoredSnapshot, Writer, WriterStats,
};

/// A durable store shared by the service's threads (`Send + Sync`, behind an `Arc`).
pub trait Store: Send + Sync + std::fmt::Debug {
    /// The directory the store keeps files in, for plugins that keep theirs beside it (blob
    /// bytes); `None` for a store without one.
    fn dir(&self) -> Option<&Path>;
    /// The key record and checkpoint hashes are keyed with (`None`: plain blake3).
    fn audit_key(&self) -> Option<&AuditKey>;
    /// What opening the store did to adopt the audit key, when it had none before.
    fn key_adoption(&self) -> Option<&KeyAdoption>;
    /// How model `model_id`'s records are hashed.
    fn record_hasher(&self, model_id: &str) -> Result<ChainHasher, StoreError>;
    /// A handle for submitting writes (cheap to clone, `Send + Sync`).
    fn writer(&self) -> Writer;
    /// Make everything acknowledged so far durable against power loss too.
    fn flush(&self) -> Result<(), StoreError>;
    /// The writer's counters (batches, ops, fsyncs).
    fn stats(&self) -> WriterStats;
    /// Every stored model.
    fn load_models(&self) -> Result<Vec<StoredModel>, StoreError>;
    /// One stored model (`None`: not stored).
    fn load_model(&self, id: &str) -> Result<Option<StoredModel>, StoreError>;
    /// The stored models' ids, in order; with `needle`, only those whose stored spec text
    /// contains it (a prefilter that parses no spec).
    fn model_ids(&self, needle: Option<&str>) -> Result<Vec<String>, StoreError>;
    /// Stream a model's records with sequence > `after` (all when `None`) oldest first,
    /// stopping before the first committed after `up_to`, or when `f` breaks; returns
    /// how many `f` saw.
    fn audit_after(
        &self,
        model_id: &str,
        after: Option<Seq>,
        up_to: Option<Timestamp>,
        f: &mut dyn FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError>;
    /// A model's records matching `filter`, newest first.
    fn query_audit(&self, model_id: &str, filter: &AuditFilter) -> Result<Vec<Json>, StoreError>;
    /// A model's named snapshots.
    fn snapshots(&self, model_id: &str) -> Result<Vec<StoredSnapshot>, StoreError>;
    /// A model's idempotency keys, newest first (at most [`crate::KEYS_KEPT`]).
    fn idempotency_keys(&self, model_id: &str) -> Result<Vec<StoredKey>, StoreError>;
    /// The answer a write made under `key` was given (`None`: no such key kept).
    fn idempotency_answer(&self, model_id: &str, key: &str) -> Result<Option<String>, StoreError>;
    /// The records of the tasks kept (MCP's tasks extension); written with `Op::PutTask`.
    fn tasks(&self) -> Result<Vec<String>, StoreError>;
    /// A blob's metadata.
    fn blob(&self, id: &str) -> Result<Option<BlobMeta>, StoreError>;
    /// Keep blob bytes (content-addressed); returns their blake3 hex.
    fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError>;
    /// The bytes of the blob with this blake3 hex.
    fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError>;
    /// Verify a model's stored chain and checkpoints.
    fn verify_chain(&self, model_id: &str) -> Result<ChainReport, StoreError>;
    /// The store's own integrity check.
    fn quick_check(&self) -> Result<(), StoreError>;
    /// The checkpoint model `model_id` is recovered from (at or before an instant, for `?at=`).
    fn usable_checkpoint(
        &self,
        model_id: &str,
        at_or_before: Option<Timestamp>,
    ) -> Result<CheckpointChoice, StoreError>;
    /// How many of a model's checkpoints verify, and the first that does not.
    fn verify_model_checkpoints(
        &self,
        model_id: &str,
    ) -> Result<(u64, Option<BrokenCheckpoint>), StoreError>;

    // A fleet's ownership (see `pg::owners`); a store with one writer owns every model.

    /// Take `model_id` for this node before loading or creating it: `None` when the store has
    /// a single writer; owned by another node: [`StoreError::OwnedElsewhere`].
    fn claim(&self, _model_id: &str) -> Result<Option<Ownership>, StoreError> {
        Ok(None)
    }
    /// Whether this node still holds `model_id` (a single-writer store holds every model);
    /// a node that lost it must drop it from memory and claim it again.
    fn holds(&self, _model_id: &str) -> bool {
        true
    }
    /// This node's id in a fleet (`None`: not a fleet's node).
    fn node_id(&self) -> Option<String> {
        None
    }
    /// Whether this store is shared by a fleet (models are claimed before use).
    fn is_fleet(&self) -> bool {
        false
    }
    /// Give `model_id` up (evicted, deleted) so another node can claim it at once.
    fn release(&self, _model_id: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// The models this node lost since the last call (another node claimed them after its
    /// lease ran out): drop them from memory.
    fn take_lost(&self) -> Vec<String> {
        Vec::new()
    }
    /// Who owns `model_id` (`None`: nobody, or a single-writer store).
    fn owner(&self, _model_id: &str) -> Result<Option<Ownership>, StoreError> {
        Ok(None)
    }
    /// The fleet's nodes (empty for a single-writer store).
    fn nodes(&self) -> Result<Vec<NodeInfo>, StoreError> {
        Ok(Vec::new())
    }
    /// What this node's claims did since it started (`None`: not a fleet's node).
    fn claim_stats(&self) -> Option<crate::pg::ClaimStats> {
        None
    }
}

impl Store for SqliteStore {
    fn dir(&self) -> Option<&Path> {
        Some(SqliteStore::dir(self))
    }
    fn audit_key(&self) -> Option<&AuditKey> {
        SqliteStore::audit_key(self)
    }
    fn key_adoption(&self) -> Option<&KeyAdoption> {
        SqliteStore::key_adoption(self)
    }
    fn record_hasher(&self, model_id: &str) -> Result<ChainHasher, StoreError> {
        SqliteStore::record_hasher(self, model_id)
    }
    fn writer(&self) -> Writer {
        SqliteStore::writer(self)
    }
    fn flush(&self) -> Result<(), StoreError> {
        SqliteStore::flush(self)
    }
    fn stats(&self) -> WriterStats {
        SqliteStore::stats(self)
    }
    fn load_models(&self) -> Result<Vec<StoredModel>, StoreError> {
        SqliteStore::load_models(self)
    }
    fn load_model(&self, id: &str) -> Result<Option<StoredModel>, StoreError> {
        SqliteStore::load_model(self, id)
    }
    fn model_ids(&self, needle: Option<&str>) -> Result<Vec<String>, StoreError> {
        SqliteStore::model_ids(self, needle)
    }
    fn audit_after(
        &self,
        model_id: &str,
        after: Option<Seq>,
        up_to: Option<Timestamp>,
        f: &mut dyn FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        SqliteStore::audit_after(self, model_id, after, up_to, f)
    }
    fn query_audit(&self, model_id: &str, filter: &AuditFilter) -> Result<Vec<Json>, StoreError> {
        SqliteStore::query_audit(self, model_id, filter)
    }
    fn tasks(&self) -> Result<Vec<String>, StoreError> {
        SqliteStore::tasks(self)
    }
    fn snapshots(&self, model_id: &str) -> Result<Vec<StoredSnapshot>, StoreError> {
        SqliteStore::snapshots(self, model_id)
    }
    fn idempotency_keys(&self, model_id: &str) -> Result<Vec<StoredKey>, StoreError> {
        SqliteStore::idempotency_keys(self, model_id)
    }
    fn idempotency_answer(&self, model_id: &str, key: &str) -> Result<Option<String>, StoreError> {
        SqliteStore::idempotency_answer(self, model_id, key)
    }
    fn blob(&self, id: &str) -> Result<Option<BlobMeta>, StoreError> {
        SqliteStore::blob(self, id)
    }
    fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError> {
        SqliteStore::put_blob_bytes(self, bytes)
    }
    fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError> {
        SqliteStore::blob_bytes(self, hash)
    }
    fn verify_chain(&self, model_id: &str) -> Result<ChainReport, StoreError> {
        SqliteStore::verify_chain(self, model_id)
    }
    fn quick_check(&self) -> Result<(), StoreError> {
        SqliteStore::quick_check(self)
    }
    fn usable_checkpoint(
        &self,
        model_id: &str,
        at_or_before: Option<Timestamp>,
    ) -> Result<CheckpointChoice, StoreError> {
        SqliteStore::usable_checkpoint(self, model_id, at_or_before)
    }
    fn verify_model_checkpoints(
        &self,
        model_id: &str,
    ) -> Result<(u64, Option<BrokenCheckpoint>), StoreError> {
        SqliteStore::verify_model_checkpoints(self, model_id)
    }
}
