//! Hibernation (`--max-resident-models`): a shard keeps at most its share of the bound in
//! memory. Past it, the least recently used models are evicted — their state is durable
//! already, and a checkpoint at their head is written so that waking replays nothing — and a
//! request for one wakes it: its stored spec, its newest usable checkpoint and the records
//! after it, as recovery at start does. Nothing observable changes: the audit chain continues
//! from the stored head, and subscribers (which the service holds, not the shard) stay.

use super::*;
use std::sync::atomic::Ordering;

impl Shard {
    /// Register a stored model without loading it (start-up with a residency bound).
    pub(crate) fn hibernate_stored(&mut self, id: String) {
        if !self.models.contains_key(&id) && self.hibernated.insert(id) {
            self.residency.hibernated(true);
        }
    }

    /// Load model `id` from the store when it is hibernated (a model that is not is left to
    /// the caller's lookup, which answers for it). In a fleet, any stored model wakes here,
    /// once this node has claimed it: owned by another node, the answer is
    /// [`ServiceError::Elsewhere`].
    pub(super) fn wake(&mut self, id: &str) -> Result<(), ServiceError> {
        // Only a shard with a store hibernates models.
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        let fleet = store.is_fleet();
        if !fleet && !self.hibernated.contains(id) {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        if fleet {
            if let Some((node, url, until)) = self.elsewhere.get(id) {
                if *until > now() {
                    return Err(ServiceError::Elsewhere {
                        id: id.to_string(),
                        node: node.clone(),
                        url: url.clone(),
                    });
                }
                self.elsewhere.remove(id);
            }
            // Claimed only when stored: a request for an unknown id leaves no owner row.
            if store.load_model(id).map_err(storage)?.is_none() {
                if self.hibernated.remove(id) {
                    self.residency.hibernated(false);
                }
                return Err(ServiceError::NotFound(id.to_string()));
            }
            claim(&*store, id, Some(&mut self.elsewhere))?;
        }
        let stored = store.load_model(id).map_err(storage)?;
        if self.hibernated.remove(id) {
            self.residency.hibernated(false);
        }
        let Some(stored) = stored else {
            // Deleted behind our back (in a fleet, by another node): forget it.
            return Err(ServiceError::NotFound(id.to_string()));
        };
        match self.recover(stored) {
            Ok(()) => {
                self.residency.wakes.record(started.elapsed());
                Ok(())
            }
            Err(e) => {
                self.residency.wake_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(model = %id, error = %e, "a hibernated model could not be woken: it is not served, its stored data stays as it is");
                Err(e)
            }
        }
    }

    /// Drop model `id` from memory when this node no longer holds it (another node of the
    /// fleet claimed it after this one's lease ran out, or the lease ran out on this node's
    /// clock: it was paused or cut off): its state here may be behind. Its subscribers here
    /// hear `Moved`.
    pub(super) fn drop_if_lost(&mut self, id: &str) {
        let lost = self
            .store
            .as_ref()
            .is_some_and(|s| s.is_fleet() && !s.holds(id));
        if !lost {
            return;
        }
        // Writes still on their way settle first (committed, or fenced): a wake must not
        // read the store before them.
        let inflight = self
            .models
            .get(id)
            .is_some_and(|e| e.inflight.load(Ordering::Acquire) > 0);
        if inflight {
            if let Some(s) = &self.store {
                let _ = s.flush();
            }
        }
        if self.unload(id) {
            tracing::warn!(model = %id, "this node lost the model to another node (its lease ran out): dropped from memory");
            self.subscribers.publish(crate::Event::Moved {
                model_id: id.to_string(),
            });
        }
    }

    /// Evict the least recently used models while more than this shard's bound are in memory,
    /// down to 15/16 of it, so evictions come in batches (one selection per batch). A model with
    /// a write still on its way to the store stays: waking it now would miss that write.
    /// `current` (the model being served) is never evicted.
    pub(super) fn evict_over_bound(&mut self, current: &str) {
        let Some(max) = self.resident_max else { return };
        if self.store.is_none() || self.models.len() <= max {
            return;
        }
        let keep = max - max / 16;
        let mut idle: Vec<(u64, &String)> = self
            .models
            .iter()
            .filter(|(id, e)| *id != current && e.inflight.load(Ordering::Acquire) == 0)
            .map(|(id, e)| (e.used, id))
            .collect();
        let excess = self.models.len() - keep;
        if idle.len() > excess {
            idle.select_nth_unstable(excess);
            idle.truncate(excess);
        }
        let out: Vec<String> = idle.into_iter().map(|(_, id)| id.clone()).collect();
        for id in out {
            self.evict(&id);
        }
    }

    /// Write a checkpoint at model `id`'s head (when it has records past the last one) and drop
    /// it from memory; its next request wakes it.
    fn evict(&mut self, id: &str) {
        let held = self.store.as_ref().is_none_or(|s| s.holds(id));
        if held {
            self.checkpoint(id);
        }
        if self.unload(id) {
            self.hibernated.insert(id.to_string());
            self.residency.hibernated(true);
            self.residency.evicted.fetch_add(1, Ordering::Relaxed);
        }
        // In a fleet, another node may claim it once the checkpoint committed (the writer
        // keeps the order; the checkpoint is fenced by this node's epoch).
        if let Some(store) = self.store.as_ref().filter(|s| s.is_fleet() && held) {
            self.subscribers.publish(crate::Event::Moved {
                model_id: id.to_string(),
            });
            let s = store.clone();
            let id = id.to_string();
            store.writer().submit(
                valem_store::Op::Release {
                    model_id: id.clone(),
                },
                Box::new(move |r| {
                    if r.is_ok() {
                        let _ = s.release(&id);
                    }
                }),
            );
        }
    }
}

/// Claim `id` for this node of the fleet: owned elsewhere is [`ServiceError::Elsewhere`]
/// (remembered in `elsewhere` until the owner's lease ends, when given).
pub(super) fn claim(
    store: &dyn valem_store::Store,
    id: &str,
    elsewhere: Option<&mut HashMap<String, (String, String, Timestamp)>>,
) -> Result<(), ServiceError> {
    match store.claim(id) {
        Ok(_) => Ok(()),
        Err(valem_store::StoreError::OwnedElsewhere {
            node,
            url,
            lease_until,
            ..
        }) => {
            if let Some(cache) = elsewhere {
                cache.insert(id.to_string(), (node.clone(), url.clone(), lease_until));
            }
            Err(ServiceError::Elsewhere {
                id: id.to_string(),
                node,
                url,
            })
        }
        Err(e) => Err(ServiceError::Storage(e.to_string())),
    }
}
