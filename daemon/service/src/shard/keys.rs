//! Idempotency keys: a write sent again under the key it was first sent with is answered as
//! it was, not applied twice. With a store, a key is committed with its write's audit record
//! (one transaction), so a retry after a crash, an eviction or a fleet's failover finds it; the
//! shard keeps each model's keys (not their answers) once a keyed write asked for them.

use super::*;
use crate::{Change, IdempotencyKey};
use valem_store::{KeyedWrite, KEYS_KEPT};

/// A model's newest idempotency keys, loaded at its first keyed write.
#[derive(Default)]
pub(super) struct KeyMemory {
    /// Oldest first.
    order: VecDeque<Arc<str>>,
    kept: HashMap<Arc<str>, Kept>,
}

struct Kept {
    /// The blake3 hex of the request the key came with.
    request: String,
    /// The answer, kept here only without a store (the store keeps it otherwise).
    answer: Option<Arc<MutationResult>>,
}

impl KeyMemory {
    fn remember(&mut self, key: &str, request: String, answer: Option<Arc<MutationResult>>) {
        let key: Arc<str> = Arc::from(key);
        if self
            .kept
            .insert(key.clone(), Kept { request, answer })
            .is_none()
        {
            self.order.push_back(key);
        }
        while self.order.len() > KEYS_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.kept.remove(&old);
            }
        }
    }
}

/// A keyed write on its way: the key and the hash of its request.
pub(super) struct Keyed {
    key: IdempotencyKey,
    request: String,
}

/// The blake3 hex of a request: its change and the view it asked for.
pub(super) fn request_hash(change: &Change, view: Option<&str>) -> String {
    let change = match change {
        Change::Mutations(m) => json!({"mutations": m}),
        Change::Patch(p) => json!({"patch": p}),
    };
    let text = json!({"change": change, "view": view}).to_string();
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

impl Shard {
    /// The answer of an earlier write of model `id` under `key` (`None`: the key is new), or
    /// [`ServiceError::KeyReused`] when it came with another request.
    pub(super) fn replay(
        &mut self,
        id: &str,
        key: &IdempotencyKey,
        request: &str,
    ) -> Result<Option<Arc<MutationResult>>, ServiceError> {
        // A write under this key may still be on its way to the store: once it is there (or
        // failed, and the model was reloaded without it), the keys say what happened.
        for settled in [false, true] {
            let store = self.store.clone();
            let e = self.entry(id)?;
            if e.keys.is_none() {
                let mut m = KeyMemory::default();
                if let Some(s) = &store {
                    let stored = s
                        .idempotency_keys(id)
                        .map_err(|x| ServiceError::Storage(x.to_string()))?;
                    for k in stored.into_iter().rev() {
                        m.remember(&k.key, k.request, None);
                    }
                }
                e.keys = Some(Box::new(m));
            }
            let Some(kept) = e.keys.as_ref().and_then(|m| m.kept.get(key.as_str())) else {
                return Ok(None);
            };
            if kept.request != request {
                return Err(ServiceError::KeyReused {
                    id: id.to_string(),
                    key: key.as_str().to_string(),
                });
            }
            if let Some(answer) = &kept.answer {
                return Ok(Some(answer.clone()));
            }
            let Some(store) = store else { return Ok(None) };
            if !settled && e.inflight.load(std::sync::atomic::Ordering::Acquire) > 0 {
                store
                    .flush()
                    .map_err(|x| ServiceError::Storage(x.to_string()))?;
                continue;
            }
            let text = store
                .idempotency_answer(id, key.as_str())
                .map_err(|x| ServiceError::Storage(x.to_string()))?;
            let parsed = text.as_deref().map(|t| {
                serde_json::from_str::<Json>(t)
                    .ok()
                    .and_then(|v| MutationResult::from_json(&v))
                    .ok_or_else(|| {
                        ServiceError::Storage(format!(
                            "the stored answer of idempotency key `{}` of model `{id}` does not parse",
                            key.as_str()
                        ))
                    })
            });
            return parsed.transpose().map(|a| a.map(Arc::new));
        }
        Ok(None)
    }

    /// Remember `keyed` for model `id`'s write that answered `result`; with a store, `op` (its
    /// audit record) carries the key so that both commit together.
    pub(super) fn keep_key(
        &mut self,
        id: &str,
        keyed: Keyed,
        result: &Arc<MutationResult>,
        op: Option<Op>,
    ) -> Option<Op> {
        let durable = self.store.is_some();
        let answer = (!durable).then(|| {
            Arc::new(MutationResult {
                traces: Default::default(),
                ..(**result).clone()
            })
        });
        if let Some(m) = self.models.get_mut(id).and_then(|e| e.keys.as_mut()) {
            m.remember(keyed.key.as_str(), keyed.request.clone(), answer);
        }
        op.map(|op| match op {
            Op::AppendAudit(a) => Op::AppendAudit(a.with_key(KeyedWrite {
                key: keyed.key.as_str().to_string(),
                request: keyed.request,
                answer: result.to_json(false).to_string(),
            })),
            other => other,
        })
    }
}

impl Keyed {
    pub(super) fn new(key: IdempotencyKey, request: String) -> Keyed {
        Keyed { key, request }
    }
}
