//! The audit hash chain as pure functions: RFC 8785 canonical JSON, the record hash and a
//! verifier that walks records oldest first. No I/O and no `Store`: `service/audit.rs` uses the
//! same functions for its in-memory trail.
//!
//! Construction (fixed; changing it breaks every stored chain):
//! `hash = hex(blake3(prev_hash_bytes || canonical(record without its top-level "hash" key)))`,
//! where `prev_hash_bytes` are the 64 ASCII hex characters of the previous record's `hash` (of
//! [`GENESIS`] for sequence 0) and the canonical bytes include the record's own `prevHash` field.
//! With an [`AuditKey`] the same bytes go through `blake3::keyed_hash` instead ([`ChainHasher`]:
//! from the model's `keyed_from` record on), so nobody without the key can recompute the chain.
//!
//! Checkpoints are bound to the chain by [`checkpoint_hash`]: blake3 (keyed with the store's key,
//! if any) over a domain tag and the canonical form of `{modelId, sequence, atUs, kind,
//! headHash, stateHash}`, where `headHash` is the hash of the record the checkpoint follows
//! ([`GENESIS`] before the first) and `stateHash` the blake3 of the stored state text.

use serde::Serialize;
use serde_json::Value as Json;

/// The `prevHash` of sequence 0: 64 ASCII zeros (not a blake3 output, so it cannot collide).
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Largest integer magnitude an IEEE-754 double represents exactly (2^53).
const MAX_SAFE_INTEGER: u64 = 1 << 53;

/// RFC 8785 (JCS) canonical JSON text of `v`: object keys sorted by their UTF-16 code units, no
/// whitespace, numbers printed as ECMAScript `Number.prototype.toString` prints the nearest double
/// (integers beyond 2^53 lose precision, as the RFC requires), strings escaped as `JSON.stringify`
/// escapes them. Recursion depth is that of `v` (≤ 128 for values parsed by serde_json).
pub fn canonical(v: &Json) -> String {
    let mut out = String::with_capacity(256);
    write_value(v, &mut out, None);
    out
}

/// The chain hash of a record: blake3 hex over `prev_hash` bytes followed by the canonical bytes of
/// `record` without its top-level `"hash"` key (a `"hash"` key present in `record` is ignored, so a
/// stored record can be passed as it is).
pub fn record_hash(prev_hash: &str, record: &Json) -> String {
    let mut text = String::with_capacity(256);
    write_value(record, &mut text, Some("hash"));
    let mut h = blake3::Hasher::new();
    h.update(prev_hash.as_bytes());
    h.update(text.as_bytes());
    h.finalize().to_hex().to_string()
}

/// The keyed form of [`record_hash`]: the same bytes through `blake3::keyed_hash`.
pub fn record_hash_keyed(key: &AuditKey, prev_hash: &str, record: &Json) -> String {
    let mut text = String::with_capacity(256);
    write_value(record, &mut text, Some("hash"));
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(prev_hash.as_bytes());
    h.update(text.as_bytes());
    h.finalize().to_hex().to_string()
}

/// A record's place in its model's audit chain: 0 for the first record, each next one more.
/// `Option<Seq>` is a position in the chain, `None` before its first record. Serialised as the
/// integer.
#[derive(
    Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Seq(u64);

impl Seq {
    /// The first record's.
    pub const FIRST: Seq = Seq(0);

    /// The `n`th record's (counting from 0).
    pub const fn new(n: u64) -> Seq {
        Seq(n)
    }

    /// The number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The record after this one's.
    pub const fn next(self) -> Seq {
        Seq(self.0.saturating_add(1))
    }

    /// The sequence after a chain position (`None`: before the first record).
    pub const fn after(head: Option<Seq>) -> Seq {
        match head {
            Some(s) => s.next(),
            None => Seq::FIRST,
        }
    }
}

impl std::fmt::Display for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The bare number, as messages that show an `Option<Seq>` with `{:?}` always have.
impl std::fmt::Debug for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// An audit record chained and hashed once, by [`Sealed::seal`]: the only way to make one, so its
/// `hash` is the record's hash by construction and the store appends it without hashing again.
#[derive(Clone, Debug)]
pub struct Sealed {
    model_id: String,
    sequence: Seq,
    prev_hash: String,
    hash: String,
    json: Json,
}

impl Sealed {
    /// Chain `record` (its fields without `modelId`, `sequence`, `prevHash` and `hash`, which
    /// this adds) after `prev_hash`, hashing with `key` when the store has one.
    pub fn seal(
        model_id: &str,
        sequence: Seq,
        prev_hash: &str,
        fields: serde_json::Map<String, Json>,
        key: Option<&AuditKey>,
    ) -> Sealed {
        // Served in this order: modelId, sequence, the fields, prevHash, hash.
        let mut record = serde_json::Map::with_capacity(fields.len() + 4);
        record.insert("modelId".into(), Json::String(model_id.to_string()));
        record.insert("sequence".into(), Json::from(sequence.get()));
        for (k, v) in fields {
            if !matches!(k.as_str(), "modelId" | "sequence" | "prevHash" | "hash") {
                record.insert(k, v);
            }
        }
        record.insert("prevHash".into(), Json::String(prev_hash.to_string()));
        let mut json = Json::Object(record);
        let hash = match key {
            Some(k) => record_hash_keyed(k, prev_hash, &json),
            None => record_hash(prev_hash, &json),
        };
        if let Json::Object(m) = &mut json {
            m.insert("hash".into(), Json::String(hash.clone()));
        }
        Sealed {
            model_id: model_id.to_string(),
            sequence,
            prev_hash: prev_hash.to_string(),
            hash,
            json,
        }
    }

    /// The record as served, with `prevHash` and `hash`.
    pub fn json(&self) -> &Json {
        &self.json
    }

    /// The record's chain hash.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The record's sequence.
    pub fn sequence(&self) -> Seq {
        self.sequence
    }

    /// The record as served, given up.
    pub fn into_json(self) -> Json {
        self.json
    }

    pub(crate) fn parts(&self) -> (&str, &str) {
        (&self.model_id, &self.prev_hash)
    }
}

/// A key file's content that is not an audit key, and what it holds instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotAKey {
    #[error(
        "it holds 32 hex characters, a 16-byte key; an audit key is 64 hex characters (32 bytes)"
    )]
    HalfLength,
    #[error(
        "expected 64 hex characters (e.g. `openssl rand -hex 32`) or exactly 32 raw bytes, found {bytes} bytes{}",
        hex.map(|n| format!(" ({n} hex characters)")).unwrap_or_default()
    )]
    Length { bytes: usize, hex: Option<usize> },
}

/// A 32-byte secret that makes record and checkpoint hashes keyed blake3. `Debug` shows only
/// the start of its fingerprint.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AuditKey([u8; 32]);

impl std::fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuditKey({}…)", &self.fingerprint()[..16])
    }
}

impl AuditKey {
    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> AuditKey {
        AuditKey(bytes)
    }

    /// A key file's content: 64 hex characters (surrounding whitespace, such as a final newline,
    /// allowed) or exactly 32 raw bytes. The error says what was found instead.
    pub fn parse(content: &[u8]) -> Result<AuditKey, NotAKey> {
        let text = content.trim_ascii();
        if text.len() == 64 && text.iter().all(u8::is_ascii_hexdigit) {
            let mut key = [0u8; 32];
            for (i, pair) in text.chunks(2).enumerate() {
                let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                key[i] = digit(pair[0]) << 4 | digit(pair[1]);
            }
            return Ok(AuditKey(key));
        }
        if content.len() == 32 {
            if content.iter().all(u8::is_ascii_hexdigit) {
                return Err(NotAKey::HalfLength);
            }
            let mut key = [0u8; 32];
            key.copy_from_slice(content);
            return Ok(AuditKey(key));
        }
        Err(NotAKey::Length {
            bytes: content.len(),
            hex: (text.iter().all(u8::is_ascii_hexdigit) && !text.is_empty()).then_some(text.len()),
        })
    }

    /// What a keyed store records to recognise its key (64 hex characters; reveals nothing of
    /// the key).
    pub fn fingerprint(&self) -> String {
        blake3::Hasher::new_derive_key("valem audit key fingerprint v1")
            .update(&self.0)
            .finalize()
            .to_hex()
            .to_string()
    }
}

/// How one model's chain is hashed: plain blake3, or keyed blake3 from record `keyed_from` on
/// (the records before it were written before the store had a key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChainHasher {
    key: Option<AuditKey>,
    keyed_from: u64,
}

impl ChainHasher {
    /// Plain blake3 for every record.
    pub fn plain() -> ChainHasher {
        ChainHasher::default()
    }

    /// Keyed with `key` from record `keyed_from` on.
    pub fn keyed(key: AuditKey, keyed_from: u64) -> ChainHasher {
        ChainHasher {
            key: Some(key),
            keyed_from,
        }
    }

    /// The key, if the chain is keyed at all.
    pub fn key(&self) -> Option<&AuditKey> {
        self.key.as_ref()
    }

    /// The hash record `sequence` must carry.
    pub fn record_hash(&self, sequence: u64, prev_hash: &str, record: &Json) -> String {
        match &self.key {
            Some(k) if sequence >= self.keyed_from => record_hash_keyed(k, prev_hash, record),
            _ => record_hash(prev_hash, record),
        }
    }
}

/// The fields a checkpoint's hash covers.
#[derive(Clone, Copy, Debug)]
pub struct CheckpointHeader<'a> {
    /// The model.
    pub model_id: &'a str,
    /// The last record applied (`None`: before the first).
    pub sequence: Option<Seq>,
    /// Its commit time (epoch µs).
    pub at_us: i64,
    /// `periodic`, `base` or `legacy` (see `store::CheckpointKind`).
    pub kind: &'a str,
    /// The hash of record `sequence` ([`GENESIS`] before the first).
    pub head_hash: &'a str,
    /// [`state_hash`] of the stored state text.
    pub state_hash: &'a str,
}

/// blake3 hex of a checkpoint's stored state text. The stored bytes are hashed rather than their
/// RFC 8785 form: a document's member order is part of a model's state, and canonical JSON sorts
/// it away (a reordering edit would pass), and the writer serializes the state only once.
pub fn state_hash(state_text: &[u8]) -> String {
    blake3::hash(state_text).to_hex().to_string()
}

/// A checkpoint's hash: blake3 (keyed when the store has a key) over
/// `"valem checkpoint v1\n"` and the canonical JSON of its header. The tag keeps a checkpoint
/// hash from ever equalling a record hash over the same bytes.
pub fn checkpoint_hash(key: Option<&AuditKey>, h: &CheckpointHeader<'_>) -> String {
    let header = serde_json::json!({
        "modelId": h.model_id,
        "sequence": h.sequence,
        "atUs": h.at_us,
        "kind": h.kind,
        "headHash": h.head_hash,
        "stateHash": h.state_hash,
    });
    tagged_hash(key, "valem checkpoint v1\n", &header)
}

/// The anchor of a keyed chain: a keyed hash over `{modelId, keyedFrom, prevHash}`, where
/// `prevHash` is the hash of record `keyed_from - 1` ([`GENESIS`] when the chain is keyed from
/// its start). Stored beside the model, it pins where keying starts and the plain records
/// before it: moving `keyed_from`, or rewriting an earlier record, needs the key.
pub fn key_anchor(key: &AuditKey, model_id: &str, keyed_from: u64, prev_hash: &str) -> String {
    let body = serde_json::json!({
        "modelId": model_id,
        "keyedFrom": keyed_from,
        "prevHash": prev_hash,
    });
    tagged_hash(Some(key), "valem key anchor v1\n", &body)
}

fn tagged_hash(key: Option<&AuditKey>, tag: &str, body: &Json) -> String {
    let mut h = match key {
        Some(k) => blake3::Hasher::new_keyed(&k.0),
        None => blake3::Hasher::new(),
    };
    h.update(tag.as_bytes());
    h.update(canonical(body).as_bytes());
    h.finalize().to_hex().to_string()
}

/// A checkpoint that does not verify, as `verify` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BrokenCheckpoint {
    /// The last record it claims to follow (`None`: before the first record).
    pub sequence: Option<Seq>,
    /// What does not match.
    pub detail: String,
}

/// What `verify` reports: `{valid, recordsChecked, firstBrokenSequence, detail}`, and from the
/// store also `checkpointsChecked` and, when one does not verify, `brokenCheckpoint`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainReport {
    /// Whether every record links and hashes correctly up to the chain head (and, from the
    /// store, every checkpoint matches its state and the chain).
    pub valid: bool,
    /// Records verified before the first break (all of them when valid).
    pub records_checked: u64,
    /// The sequence of the first broken (or missing) record; `None` when the records are sound.
    pub first_broken_sequence: Option<u64>,
    /// `"ok"`, or what is wrong at `first_broken_sequence` (or, when only a checkpoint is
    /// broken, at that checkpoint).
    pub detail: String,
    /// Checkpoints verified (reports of the store only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoints_checked: Option<u64>,
    /// The first checkpoint (by sequence) that does not verify.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broken_checkpoint: Option<BrokenCheckpoint>,
}

/// Walks a chain oldest first; stops at the first break.
#[derive(Clone, Debug)]
pub struct ChainVerifier {
    next_seq: u64,
    prev_hash: String,
    checked: u64,
    broken: Option<(u64, String)>,
    hasher: ChainHasher,
}

impl Default for ChainVerifier {
    fn default() -> Self {
        Self::new()
    }
}

impl ChainVerifier {
    /// A verifier expecting sequence 0 with `prevHash` = [`GENESIS`].
    pub fn new() -> ChainVerifier {
        Self::starting_at(0, GENESIS)
    }

    /// A verifier for a chain whose records before `sequence` are gone (a bounded in-memory trail):
    /// the first record must have this sequence and `prevHash`.
    pub fn starting_at(sequence: u64, prev_hash: &str) -> ChainVerifier {
        ChainVerifier {
            next_seq: sequence,
            prev_hash: prev_hash.to_string(),
            checked: 0,
            broken: None,
            hasher: ChainHasher::plain(),
        }
    }

    /// Check hashes as `hasher` makes them (a keyed chain).
    pub fn with_hasher(mut self, hasher: ChainHasher) -> ChainVerifier {
        self.hasher = hasher;
        self
    }

    /// The hash of the last record checked ([`GENESIS`] or the starting `prevHash` before any).
    pub fn prev_hash(&self) -> &str {
        &self.prev_hash
    }

    /// Whether a break has been found (later calls are ignored).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// The sequence the next record must have.
    pub fn next_sequence(&self) -> u64 {
        self.next_seq
    }

    /// Mark the chain broken at `sequence` for a reason found outside the record (a storage column
    /// that disagrees with it, a record that is not JSON).
    pub fn fail(&mut self, sequence: u64, detail: impl Into<String>) {
        if self.broken.is_none() {
            self.broken = Some((sequence, detail.into()));
        }
    }

    /// Check the next record, found at `stored_sequence` (its storage key). Returns false once the
    /// chain is broken.
    pub fn check(&mut self, stored_sequence: u64, record: &Json) -> bool {
        if self.broken.is_some() {
            return false;
        }
        let expected = self.next_seq;
        if stored_sequence > expected {
            self.fail(
                expected,
                format!(
                    "record {expected} is missing (deleted): the next stored record is {stored_sequence}"
                ),
            );
            return false;
        }
        if stored_sequence < expected {
            self.fail(
                stored_sequence,
                format!(
                    "record {stored_sequence} appears after record {}",
                    expected - 1
                ),
            );
            return false;
        }
        let said = record.get("sequence").and_then(Json::as_u64);
        if said != Some(expected) {
            let said = said.map_or_else(|| "no sequence".to_string(), |s| format!("sequence {s}"));
            self.fail(
                expected,
                format!("the record stored at sequence {expected} says {said} (reordered or renumbered)"),
            );
            return false;
        }
        let (Some(prev), Some(hash)) = (
            record.get("prevHash").and_then(Json::as_str),
            record.get("hash").and_then(Json::as_str),
        ) else {
            self.fail(
                expected,
                "the record has no prevHash or hash (not hash-chained)",
            );
            return false;
        };
        if prev != self.prev_hash {
            self.fail(
                expected,
                "prevHash does not match the hash of the preceding record (a record was inserted, deleted or reordered before it)",
            );
            return false;
        }
        let computed = self.hasher.record_hash(expected, prev, record);
        if computed != hash {
            let unkeyed = self.hasher.key().is_some() && record_hash(prev, record) == hash;
            self.fail(
                expected,
                if unkeyed {
                    "content hash mismatch: the record was hashed without this store's audit key (rewritten by someone without it)"
                } else {
                    "content hash mismatch: the record was altered or its hash edited"
                },
            );
            return false;
        }
        self.prev_hash = computed;
        self.next_seq += 1;
        self.checked += 1;
        true
    }

    /// The report, given the chain head recorded at commit time (`None`: no record committed).
    /// A head beyond the last checked record means a truncated tail; records beyond the head
    /// were never committed through the store (inserted).
    pub fn finish(mut self, head: Option<(u64, &str)>) -> ChainReport {
        if self.broken.is_none() {
            let last = self.next_seq.checked_sub(1);
            match (head, last) {
                (None, None) => {}
                (None, Some(_)) => self.fail(
                    0,
                    "records are stored but the chain head says none was committed (inserted)",
                ),
                (Some((h, _)), None) => self.fail(
                    self.next_seq,
                    format!("truncated: the chain head is record {h} but no record is stored"),
                ),
                (Some((h, _)), Some(l)) if l < h => self.fail(
                    l + 1,
                    format!(
                        "truncated: the chain head is record {h} but the last stored record is {l}"
                    ),
                ),
                (Some((h, _)), Some(l)) if l > h => self.fail(
                    h + 1,
                    format!(
                        "record {} is beyond the committed chain head {h} (inserted)",
                        h + 1
                    ),
                ),
                (Some((h, hash)), Some(_)) => {
                    if hash != self.prev_hash {
                        self.fail(
                            h,
                            "the last record's hash differs from the chain head's hash",
                        );
                    }
                }
            }
        }
        match self.broken {
            None => ChainReport {
                valid: true,
                records_checked: self.checked,
                first_broken_sequence: None,
                detail: "ok".into(),
                checkpoints_checked: None,
                broken_checkpoint: None,
            },
            Some((seq, detail)) => ChainReport {
                valid: false,
                records_checked: self.checked,
                first_broken_sequence: Some(seq),
                detail,
                checkpoints_checked: None,
                broken_checkpoint: None,
            },
        }
    }
}

/// A model's chain head as its registry row keeps it, for [`walk_chain`].
pub(crate) struct ChainHead<'a> {
    /// The last record's sequence (`None`: no record).
    pub(crate) head_seq: Option<i64>,
    /// Its hash.
    pub(crate) head_hash: &'a str,
    /// In a keyed store, the first keyed record.
    pub(crate) key_from: Option<i64>,
    /// In a keyed store, the anchor binding the chain where keying starts.
    pub(crate) key_anchor: Option<&'a str>,
}

/// One stored audit row, as text (a column of another type reads as an empty string).
pub(crate) struct AuditRow {
    pub(crate) sequence: i64,
    pub(crate) prev_hash: String,
    pub(crate) hash: String,
    pub(crate) record: String,
}

/// Walk a model's stored records oldest first and check every link, hash and sequence against
/// `head` (in a keyed store, keyed hashes from `key_from` on, and the anchor that pins it).
pub(crate) fn walk_chain<E>(
    key: Option<&AuditKey>,
    model_id: &str,
    head: &ChainHead<'_>,
    rows: &mut dyn Iterator<Item = Result<AuditRow, E>>,
) -> Result<ChainReport, E> {
    // In a keyed store a model without an anchor is held to the key from record 0.
    let keyed_from = head.key_from.map_or(0, |f| f.max(0) as u64);
    let mut v = match key {
        Some(k) => ChainVerifier::new().with_hasher(ChainHasher::keyed(*k, keyed_from)),
        None => ChainVerifier::new(),
    };
    // The hash of record `keyed_from - 1` as the walk verified it: what the anchor binds.
    let mut anchored_prev: Option<String> = None;
    for row in rows {
        let row = row?;
        let Ok(seq) = u64::try_from(row.sequence) else {
            v.fail(
                0,
                format!("a record is stored at invalid sequence {}", row.sequence),
            );
            break;
        };
        let record: Json = match serde_json::from_str(&row.record) {
            Ok(j) => j,
            // A gap before it is the earlier break; otherwise the record itself is.
            Err(_) if seq != v.next_sequence() => Json::Null,
            Err(e) => {
                v.fail(
                    seq,
                    format!("record {seq} is not valid JSON (altered): {e}"),
                );
                break;
            }
        };
        let matches = |col: &str, key: &str| record.get(key).and_then(Json::as_str) == Some(col);
        if seq == v.next_sequence()
            && (!matches(&row.prev_hash, "prevHash") || !matches(&row.hash, "hash"))
        {
            v.fail(
                seq,
                format!("record {seq}: the stored hash columns differ from the record (edited)"),
            );
            break;
        }
        if seq == keyed_from && seq == v.next_sequence() {
            anchored_prev = Some(v.prev_hash().to_string());
        }
        if !v.check(seq, &record) {
            break;
        }
    }
    if let Some(k) = key.filter(|_| !v.is_broken()) {
        if anchored_prev.is_none() && v.next_sequence() == keyed_from {
            anchored_prev = Some(v.prev_hash().to_string());
        }
        match (head.key_anchor, anchored_prev) {
            (None, _) => v.fail(
                0,
                "the store is keyed but this model has no audit key anchor (removed)",
            ),
            (Some(_), None) => v.fail(
                keyed_from,
                format!("keying starts at record {keyed_from}, beyond the stored chain (edited)"),
            ),
            (Some(a), Some(prev)) => {
                if key_anchor(k, model_id, keyed_from, &prev) != a {
                    v.fail(
                        keyed_from,
                        format!(
                            "the audit key anchor does not match the chain at record {keyed_from}: records before it were rewritten, or where keying starts was edited"
                        ),
                    );
                }
            }
        }
    }
    let head_seq = head.head_seq.map(|s| s.max(0) as u64);
    Ok(v.finish(head_seq.map(|s| (s, head.head_hash))))
}

/// `skip_key`: a top-level key left out (only at the outermost object).
fn write_value(v: &Json, out: &mut String, skip_key: Option<&str>) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => write_number(n, out),
        Json::String(s) => write_string(s, out),
        Json::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(x, out, None);
            }
            out.push(']');
        }
        Json::Object(m) => {
            let mut entries: Vec<(&String, &Json)> = m
                .iter()
                .filter(|(k, _)| skip_key != Some(k.as_str()))
                .collect();
            entries.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_value(x, out, None);
            }
            out.push('}');
        }
    }
}

fn write_number(n: &serde_json::Number, out: &mut String) {
    // Integers within ±2^53 print as their digits, exactly what ECMAScript prints for that double.
    if let Some(u) = n.as_u64() {
        if u <= MAX_SAFE_INTEGER {
            out.push_str(&u.to_string());
            return;
        }
    } else if let Some(i) = n.as_i64() {
        if i.unsigned_abs() <= MAX_SAFE_INTEGER {
            out.push_str(&i.to_string());
            return;
        }
    }
    // serde_json numbers are finite (it has no NaN or infinity), so `as_f64` always succeeds here.
    let f = n.as_f64().unwrap_or(0.0);
    let mut buf = ryu_js::Buffer::new();
    out.push_str(buf.format_finite(f));
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{0C}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_seq_counts_from_the_first_record_and_shows_as_its_number() {
        assert_eq!(Seq::after(None), Seq::FIRST);
        assert_eq!(Seq::after(Some(Seq::new(41))), Seq::new(42));
        assert_eq!(Seq::new(u64::MAX).next(), Seq::new(u64::MAX));
        assert!(Seq::new(2) > Seq::new(1));
        assert_eq!(
            format!("{} {:?}", Seq::new(7), Some(Seq::new(7))),
            "7 Some(7)"
        );
        assert_eq!(serde_json::to_string(&Seq::new(7)).unwrap(), "7");
        assert_eq!(serde_json::from_str::<Seq>("7").unwrap(), Seq::new(7));
    }

    fn parse(s: &str) -> Json {
        serde_json::from_str(s).expect("test JSON parses")
    }

    #[test]
    fn rfc8785_example_and_number_forms() {
        // The example of RFC 8785 §3.2.3 (numbers, literals, string escapes).
        let input = parse(
            r#"{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],
                "string":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
                "literals":[null,true,false]}"#,
        );
        assert_eq!(
            canonical(&input),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        assert_eq!(canonical(&json!(-0.0)), "0");
        assert_eq!(canonical(&json!(1.0)), "1");
        assert_eq!(canonical(&json!(-7)), "-7");
        assert_eq!(canonical(&json!(9007199254740992u64)), "9007199254740992");
        // Beyond 2^53 an integer is the nearest double, printed the ECMAScript way.
        assert_eq!(canonical(&json!(u64::MAX)), "18446744073709552000");
        assert_eq!(canonical(&json!(1e21)), "1e+21");
        assert_eq!(canonical(&json!("\u{7f}\u{2028}")), "\"\u{7f}\u{2028}\"");
    }

    #[test]
    fn strings_escape_as_ecmascript_does() {
        // JSON.stringify's forms, which serde_json writes too: the short escapes, other
        // controls as lowercase \u00xx, everything else (any script, astral characters) as is.
        let mut cases: Vec<String> = (0u8..0x20).map(|b| format!("a{}b", b as char)).collect();
        cases.extend(
            [
                "",
                "plain",
                "q\"uote",
                "back\\slash",
                "é€𝄞\u{7f}\u{2028}",
                "\"\\\n𝄞x\u{1}",
            ]
            .map(String::from),
        );
        for c in &cases {
            let mut out = String::new();
            write_string(c, &mut out);
            assert_eq!(out, serde_json::to_string(c).unwrap(), "{c:?}");
        }
    }

    #[test]
    fn keys_sort_by_utf16_code_units_not_bytes() {
        // RFC 8785 §3.2.3 sorting example: U+1F600 is the surrogate pair D83D DE00 in UTF-16 and
        // sorts before U+FB33; in UTF-8 byte order it would sort after.
        let v = json!({"\u{fb33}": 1, "\u{1f600}": 2, "\r": 3, "1": 4, "\u{80}": 5, "\u{f6}": 6, "\u{20ac}": 7});
        assert_eq!(
            canonical(&v),
            "{\"\\r\":3,\"1\":4,\"\u{80}\":5,\"\u{f6}\":6,\"\u{20ac}\":7,\"\u{1f600}\":2,\"\u{fb33}\":1}"
        );
        // Insertion order (serde_json preserve_order) does not matter.
        assert_eq!(
            canonical(&json!({"b": [1, {"d": 1, "c": 2}], "a": null})),
            r#"{"a":null,"b":[1,{"c":2,"d":1}]}"#
        );
    }

    #[test]
    fn record_hash_is_blake3_over_prev_then_canonical_without_hash() {
        let rec = json!({"sequence": 0, "prevHash": GENESIS, "b": 1, "a": "x"});
        let expected = blake3::hash(
            format!("{GENESIS}{{\"a\":\"x\",\"b\":1,\"prevHash\":\"{GENESIS}\",\"sequence\":0}}")
                .as_bytes(),
        )
        .to_hex()
        .to_string();
        assert_eq!(record_hash(GENESIS, &rec), expected);
        let mut with_hash = rec.clone();
        with_hash["hash"] = json!("whatever");
        assert_eq!(
            record_hash(GENESIS, &with_hash),
            expected,
            "top-level hash is ignored"
        );
        // A nested "hash" key is content.
        let nested = json!({"sequence": 0, "prevHash": GENESIS, "b": 1, "a": {"hash": 1}});
        assert_ne!(record_hash(GENESIS, &nested), expected);
        assert_ne!(
            record_hash(&"1".repeat(64), &rec),
            expected,
            "prev hash is bound"
        );
    }

    fn chain(n: u64) -> Vec<Json> {
        let mut prev = GENESIS.to_string();
        (0..n)
            .map(|i| {
                let mut r = json!({"modelId": "m", "sequence": i, "mutations": {"$.x": i}, "prevHash": prev});
                let h = record_hash(&prev, &r);
                r["hash"] = json!(h);
                prev = h;
                r
            })
            .collect()
    }

    fn verify(recs: &[(u64, Json)], head: Option<(u64, &str)>) -> ChainReport {
        let mut v = ChainVerifier::new();
        for (s, r) in recs {
            if !v.check(*s, r) {
                break;
            }
        }
        v.finish(head)
    }

    #[test]
    fn verifier_accepts_a_chain_and_reports_each_kind_of_break() {
        let recs: Vec<(u64, Json)> = chain(5)
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i as u64, r))
            .collect();
        let head_hash = recs[4].1["hash"].as_str().expect("hash").to_string();
        let head = Some((4, head_hash.as_str()));
        let ok = verify(&recs, head);
        assert_eq!(
            (ok.valid, ok.records_checked, ok.first_broken_sequence),
            (true, 5, None)
        );
        assert_eq!(
            serde_json::to_value(&ok).expect("serializes"),
            json!({"valid": true, "recordsChecked": 5, "firstBrokenSequence": null, "detail": "ok"})
        );

        let mut altered = recs.clone();
        altered[2].1["mutations"]["$.x"] = json!(99);
        let r = verify(&altered, head);
        assert_eq!(
            (r.valid, r.records_checked, r.first_broken_sequence),
            (false, 2, Some(2))
        );
        assert!(r.detail.contains("altered"), "{}", r.detail);

        let mut deleted = recs.clone();
        deleted.remove(3);
        let r = verify(&deleted, head);
        assert_eq!(r.first_broken_sequence, Some(3));
        assert!(r.detail.contains("missing"), "{}", r.detail);

        let mut swapped = recs.clone();
        let (a, b) = (swapped[1].1.clone(), swapped[2].1.clone());
        swapped[1].1 = b;
        swapped[2].1 = a;
        assert_eq!(verify(&swapped, head).first_broken_sequence, Some(1));

        let r = verify(&recs[..3], head);
        assert_eq!((r.first_broken_sequence, r.records_checked), (Some(3), 3));
        assert!(r.detail.contains("truncated"), "{}", r.detail);

        let r = verify(&recs, Some((3, "x")));
        assert_eq!(r.first_broken_sequence, Some(4));
        assert!(r.detail.contains("beyond"), "{}", r.detail);

        assert!(verify(&[], None).valid);
        let resumed = {
            let mut v = ChainVerifier::starting_at(2, recs[1].1["hash"].as_str().expect("hash"));
            assert!(recs[2..].iter().all(|(s, r)| v.check(*s, r)));
            v.finish(head)
        };
        assert_eq!((resumed.valid, resumed.records_checked), (true, 3));
    }
}
