//! The audit trail kept in memory by the service: one record per committed cycle, chained as the
//! store chains it (`store::record_hash`: blake3 over `prevHash` and the RFC 8785 form of the
//! record without `hash`, keyed with the store's audit key when it has one), so `verify_audit`
//! means the same with and without a data directory. Bounded: the oldest records are dropped
//! past the limit (verification then starts at the oldest kept record).

use std::collections::VecDeque;

use serde_json::{json, Map, Value as Json};

use super::time::{iso, Timestamp};

pub(crate) use valem_store::GENESIS;
use valem_store::{record_hash, AuditAppend, AuditKey, ChainHasher, Sealed, Seq, StoreError};

/// One committed cycle.
#[derive(Clone, Debug)]
pub struct AuditRecord {
    pub sequence: Seq,
    pub at: Timestamp,
    /// The record as served (with `prevHash` and `hash`).
    pub json: Json,
    /// Paths a `pathPrefix` filter matches: mutation keys, derived updates, trace targets.
    pub paths: Vec<String>,
}

/// Filters of `get_audit`.
#[derive(Clone, Debug, Default)]
pub struct AuditQuery {
    pub path_prefix: Option<String>,
    pub from: Option<Timestamp>,
    pub to: Option<Timestamp>,
    pub limit: Option<usize>,
}

pub(crate) struct AuditTrail {
    records: VecDeque<AuditRecord>,
    /// The newest record's sequence (`None`: no record yet).
    head: Option<Seq>,
    last_hash: String,
    max: usize,
    /// The store's audit key: every record appended is hashed with it.
    key: Option<AuditKey>,
}

/// What one record says, before chaining.
pub(crate) struct Entry<'a> {
    pub model_id: &'a str,
    pub model_version: &'a str,
    pub source: &'a str,
    pub at: Timestamp,
    pub mutations: Map<String, Json>,
    pub result: &'a valem_engine::MutationResult,
}

impl AuditTrail {
    /// A trail keeping the newest `max` records (at least the newest, which an audit-store
    /// plugin is fed), hashing with `key` (a keyed store's key).
    pub(crate) fn new(max: usize, key: Option<AuditKey>) -> AuditTrail {
        AuditTrail {
            records: VecDeque::new(),
            head: None,
            last_hash: GENESIS.to_string(),
            max: max.max(1),
            key,
        }
    }

    /// Continue a stored chain whose head is record `sequence` with hash `hash` (recovery from a
    /// checkpoint: the records before it are in the store, not here).
    pub(crate) fn resume(&mut self, sequence: Seq, hash: &str) {
        self.head = Some(sequence);
        self.last_hash = hash.to_string();
    }

    /// The sequence of the newest record, if any.
    pub(crate) fn head(&self) -> Option<Seq> {
        self.head
    }

    /// A record read back from the store (recovery): it continues the chain as it is.
    pub(crate) fn push_stored(&mut self, sequence: Seq, at: Timestamp, json: Json) {
        debug_assert!(
            self.records.back().is_none_or(|r| r.sequence < sequence),
            "stored records come back in increasing sequence"
        );
        let mut paths: Vec<String> = Vec::new();
        if let Some(Json::Object(m)) = json.get("mutations") {
            paths.extend(m.keys().cloned());
        }
        let strings = |v: Option<&Json>| -> Vec<String> {
            v.and_then(Json::as_array)
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        };
        paths.extend(strings(json.get("derivedUpdated")));
        if let Some(Json::Array(ts)) = json.get("traces") {
            paths.extend(ts.iter().filter_map(|t| {
                t.get("targetPath")
                    .and_then(Json::as_str)
                    .map(str::to_string)
            }));
        }
        self.last_hash = json
            .get("hash")
            .and_then(Json::as_str)
            .unwrap_or(GENESIS)
            .to_string();
        self.head = Some(sequence);
        self.records.push_back(AuditRecord {
            sequence,
            at,
            json,
            paths,
        });
        while self.records.len() > self.max {
            self.records.pop_front();
        }
    }

    /// Chain and keep the record of one committed cycle, hashed once ([`Sealed`]); with
    /// `durable`, also the store's append of it, serialised once.
    pub(crate) fn append(
        &mut self,
        e: Entry<'_>,
        durable: bool,
    ) -> Result<Option<AuditAppend>, StoreError> {
        let r = e.result;
        let mut paths: Vec<String> = e.mutations.keys().cloned().collect();
        paths.extend(r.derived_updated.iter().map(|d| d.to_string()));
        paths.extend(r.traces.iter().map(|t| t.target_path.to_string()));
        let fields = json!({
            "timestamp": iso(e.at),
            "modelVersion": e.model_version,
            "source": e.source,
            "mutations": e.mutations,
            "derivedUpdated": r.derived_updated,
            "flaggedConstraints": r.flagged_constraints.iter().map(|c| c.constraint_id.clone()).collect::<Vec<_>>(),
            "dispatchedEffects": r.dispatched_effects.iter().map(|c| c.effect_id.clone()).collect::<Vec<_>>(),
            "traces": r.traces,
        });
        let Json::Object(fields) = fields else {
            unreachable!("json! of an object literal is an object")
        };
        let sequence = Seq::after(self.head);
        // A keyed store's chains are keyed from their adoption on: new records always are.
        let sealed = Sealed::seal(
            e.model_id,
            sequence,
            &self.last_hash,
            fields,
            self.key.as_ref(),
        );
        let append = if durable {
            Some(AuditAppend::sealed(e.at, &sealed, paths.clone())?)
        } else {
            None
        };
        self.last_hash = sealed.hash().to_string();
        self.records.push_back(AuditRecord {
            sequence,
            at: e.at,
            json: sealed.into_json(),
            paths,
        });
        self.head = Some(sequence);
        while self.records.len() > self.max {
            self.records.pop_front();
        }
        Ok(append)
    }

    /// Newest first, filtered.
    pub(crate) fn query(&self, q: &AuditQuery) -> Vec<Json> {
        let limit = q.limit.unwrap_or(100);
        self.records
            .iter()
            .rev()
            .filter(|r| q.from.is_none_or(|f| r.at >= f))
            .filter(|r| q.to.is_none_or(|t| r.at <= t))
            .filter(|r| {
                q.path_prefix
                    .as_deref()
                    .is_none_or(|p| r.paths.iter().any(|x| x.starts_with(p)))
            })
            .take(limit)
            .map(|r| r.json.clone())
            .collect()
    }

    /// The newest record.
    pub(crate) fn last(&self) -> Option<&AuditRecord> {
        self.records.back()
    }

    /// Walk the chain oldest first; report the first broken record.
    pub(crate) fn verify(&self) -> Json {
        let hasher = match self.key {
            Some(k) => ChainHasher::keyed(k, 0),
            None => ChainHasher::plain(),
        };
        verify_records(self.records.iter().map(|r| &r.json), &hasher)
    }
}

/// Verify a sequence of records (oldest first): each `prevHash` must be the previous record's
/// `hash`, and each `hash` must be the hash of the record's content, as `hasher` makes it.
pub(crate) fn verify_records<'a>(
    records: impl Iterator<Item = &'a Json>,
    hasher: &ChainHasher,
) -> Json {
    let mut expected_prev: Option<String> = None;
    let mut checked = 0u64;
    for r in records {
        let seq = r.get("sequence").cloned().unwrap_or(Json::Null);
        let (Some(prev), Some(hash)) = (
            r.get("prevHash").and_then(|h| h.as_str()),
            r.get("hash").and_then(|h| h.as_str()),
        ) else {
            return broken(checked, seq, "record is not hash-chained");
        };
        if let Some(exp) = &expected_prev {
            if prev != exp {
                return broken(
                    checked,
                    seq,
                    "prevHash does not match the preceding record (reorder or deletion)",
                );
            }
        }
        let sequence = r.get("sequence").and_then(Json::as_u64).unwrap_or(0);
        if hasher.record_hash(sequence, prev, r) != hash {
            let detail = if hasher.key().is_some() && record_hash(prev, r) == hash {
                "content hash mismatch (record was hashed without the audit key: rewritten)"
            } else {
                "content hash mismatch (record was altered)"
            };
            return broken(checked, seq, detail);
        }
        expected_prev = Some(hash.to_string());
        checked += 1;
    }
    json!({"valid": true, "recordsChecked": checked, "firstBrokenSequence": null, "detail": "ok"})
}

/// Verify the chain an audit-store plugin returned: from genesis, linked, each hash right (as
/// `hasher` makes them: the model's chain in the store), and reaching the model's head (`head`:
/// its newest sequence) so a truncated tail is caught.
pub(crate) fn verify_stored(
    records: &[valem_sdk::AuditEntry],
    head: Option<Seq>,
    hasher: &ChainHasher,
) -> Json {
    let head = head.map(Seq::get);
    let broken = |checked: usize, seq: Json, detail: String| json!({"valid": false, "recordsChecked": checked, "firstBrokenSequence": seq, "detail": detail});
    if let Some(first) = records.first() {
        if first.record.get("prevHash").and_then(|h| h.as_str()) != Some(GENESIS) {
            return broken(
                0,
                json!(first.sequence),
                "the audit store's chain does not start at genesis (records missing at the start)"
                    .into(),
            );
        }
    }
    let v = verify_records(records.iter().map(|e| &e.record), hasher);
    if v["valid"] != Json::Bool(true) {
        return v;
    }
    let last = records.last().map(|e| e.sequence);
    match head {
        Some(h) if last.is_none_or(|l| l < h) => broken(
            records.len(),
            json!(last.map_or(0, |l| l + 1)),
            format!(
                "the audit store holds records up to {} but the model is at {h} (truncated tail)",
                last.map_or("none".to_string(), |l| l.to_string())
            ),
        ),
        _ => v,
    }
}

fn broken(checked: u64, seq: Json, detail: &str) -> Json {
    json!({"valid": false, "recordsChecked": checked, "firstBrokenSequence": seq, "detail": detail})
}

#[cfg(test)]
mod tests {
    use super::*;
    use valem_engine::MutationResult;

    fn trail(n: usize) -> AuditTrail {
        trail_keyed(n, None)
    }

    fn trail_keyed(n: usize, key: Option<AuditKey>) -> AuditTrail {
        let mut t = AuditTrail::new(100, key);
        let r = MutationResult {
            success: true,
            derived_updated: ["$.total"].into_iter().collect(),
            ..Default::default()
        };
        for i in 0..n {
            let mut m = Map::new();
            m.insert("$.qty".into(), json!(i));
            let append = t
                .append(
                    Entry {
                        model_id: "m",
                        model_version: "1.0.0",
                        source: "client",
                        at: Timestamp::from_us(i as i64),
                        mutations: m,
                        result: &r,
                    },
                    true,
                )
                .expect("a sequence far below 2^63");
            let append = append.expect("durable: the store's append");
            assert_eq!(append.sequence(), Seq::new(i as u64));
        }
        t
    }

    #[test]
    fn chain_verifies_and_detects_tampering() {
        let t = trail(5);
        assert_eq!(t.verify()["valid"], true);
        assert_eq!(t.verify()["recordsChecked"], 5);
        let mut recs: Vec<Json> = t.records.iter().map(|r| r.json.clone()).collect();
        recs[2]["mutations"]["$.qty"] = json!(99);
        let plain = ChainHasher::plain();
        let v = verify_records(recs.iter(), &plain);
        assert_eq!(v["valid"], false);
        assert_eq!(v["firstBrokenSequence"], 2);
        assert!(v["detail"].as_str().unwrap().contains("altered"));
        let mut recs: Vec<Json> = t.records.iter().map(|r| r.json.clone()).collect();
        recs.remove(1);
        let v = verify_records(recs.iter(), &plain);
        assert_eq!(v["firstBrokenSequence"], 2);
        assert!(v["detail"].as_str().unwrap().contains("deletion"));
    }

    #[test]
    fn a_keyed_trail_verifies_with_its_key_only() {
        let key = AuditKey::from_bytes([7; 32]);
        let t = trail_keyed(4, Some(key));
        assert_eq!(t.verify()["valid"], true);
        let recs: Vec<Json> = t.records.iter().map(|r| r.json.clone()).collect();
        let v = verify_records(recs.iter(), &ChainHasher::plain());
        assert_eq!(
            (v["valid"].clone(), v["firstBrokenSequence"].clone()),
            (json!(false), json!(0))
        );
        // Keyed from record 2 on: records 0 and 1 must be plain.
        let v = verify_records(recs.iter(), &ChainHasher::keyed(key, 2));
        assert_eq!(v["firstBrokenSequence"], 0, "{v}");
        // A plain trail rewritten: the keyed verifier says it was made without the key.
        let plain: Vec<Json> = trail(4).records.iter().map(|r| r.json.clone()).collect();
        let v = verify_records(plain.iter(), &ChainHasher::keyed(key, 0));
        assert!(
            v["detail"]
                .as_str()
                .unwrap()
                .contains("without the audit key"),
            "{v}"
        );
    }

    #[test]
    fn query_filters_newest_first() {
        let t = trail(5);
        let all = t.query(&AuditQuery::default());
        assert_eq!(all[0]["sequence"], 4);
        let q = AuditQuery {
            from: Some(Timestamp::from_us(1)),
            to: Some(Timestamp::from_us(3)),
            limit: Some(2),
            ..Default::default()
        };
        let got: Vec<_> = t.query(&q).iter().map(|r| r["sequence"].clone()).collect();
        assert_eq!(got, vec![json!(3), json!(2)]);
        let q = AuditQuery {
            path_prefix: Some("$.tot".into()),
            ..Default::default()
        };
        assert_eq!(t.query(&q).len(), 5);
        let q = AuditQuery {
            path_prefix: Some("$.nothing".into()),
            ..Default::default()
        };
        assert!(t.query(&q).is_empty());
    }
}
