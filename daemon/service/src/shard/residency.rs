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
    /// the caller's lookup, which answers for it).
    pub(super) fn wake(&mut self, id: &str) -> Result<(), ServiceError> {
        // Only a shard with a store hibernates models.
        let (true, Some(store)) = (self.hibernated.contains(id), self.store.clone()) else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let stored = store
            .load_model(id)
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        self.hibernated.remove(id);
        self.residency.hibernated(false);
        let Some(stored) = stored else {
            // Deleted behind our back (another process cannot write the store): forget it.
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
        self.checkpoint(id);
        if self.unload(id).is_some() {
            self.hibernated.insert(id.to_string());
            self.residency.hibernated(true);
            self.residency.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}
