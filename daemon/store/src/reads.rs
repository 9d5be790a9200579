//! The SQLite store's reads: models, audit records (streamed or filtered), snapshots, blobs,
//! and the verification of a model's chain and checkpoints, each in one read snapshot of a
//! pooled read-only connection.

use super::*;

impl SqliteStore {
    /// Every stored model.
    pub fn load_models(&self) -> Result<Vec<StoredModel>, StoreError> {
        self.all_rows(
            "SELECT m.id, m.spec, m.version, m.created_us, m.updated_us, m.head_seq,
                 m.head_hash, s.body
             FROM models m LEFT JOIN spec_texts s ON s.hash = m.spec_hash
             ORDER BY m.id",
            [],
            stored_model,
        )
    }

    /// One stored model, `None` when the store does not hold it.
    pub fn load_model(&self, id: &str) -> Result<Option<StoredModel>, StoreError> {
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT m.id, m.spec, m.version, m.created_us, m.updated_us, m.head_seq,
                         m.head_hash, s.body
                     FROM models m LEFT JOIN spec_texts s ON s.hash = m.spec_hash
                     WHERE m.id = ?1",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            st.query_row([id], stored_model)
                .optional()
                .map_err(|e| sql_err(&self.db, e))
        })
    }

    /// The ids of the stored models, in order; only those whose stored spec text contains
    /// `needle` when one is given (a cheap prefilter, read without parsing any spec).
    pub fn model_ids(&self, needle: Option<&str>) -> Result<Vec<String>, StoreError> {
        self.all_rows(
            "SELECT m.id FROM models m LEFT JOIN spec_texts s ON s.hash = m.spec_hash
             WHERE ?1 IS NULL OR instr(coalesce(s.body, m.spec), ?1) > 0 ORDER BY m.id",
            [needle],
            |r| r.get::<_, String>(0),
        )
    }

    /// Every row `sql` (with `params`) yields, as `row` reads it, in one read snapshot.
    fn all_rows<T, P: rusqlite::Params>(
        &self,
        sql: &str,
        params: P,
        row: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, StoreError> {
        self.with_reader(|c| {
            let mut st = c.prepare_cached(sql).map_err(|e| sql_err(&self.db, e))?;
            let rows = st
                .query_map(params, row)
                .map_err(|e| sql_err(&self.db, e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| sql_err(&self.db, e))
        })
    }

    /// Stream a model's records with sequence > `after_seq` (all when `None`) oldest first, stopping
    /// before the first record committed after `up_to`, or when `f` breaks. Returns how many
    /// records `f` saw. Records are read one at a time (no full load), in one read snapshot.
    pub fn audit_after(
        &self,
        model_id: &str,
        after: Option<Seq>,
        up_to: Option<Timestamp>,
        mut f: impl FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        let up_to_at_us = up_to.map(Timestamp::us);
        let after = match after {
            None => -1,
            Some(s) => i64::try_from(s.get()).unwrap_or(i64::MAX),
        };
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT sequence, at_us, record FROM audit
                     WHERE model_id = ?1 AND sequence > ?2 ORDER BY sequence",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let mut rows = st
                .query(params![model_id, after])
                .map_err(|e| sql_err(&self.db, e))?;
            let mut seen = 0u64;
            while let Some(r) = rows.next().map_err(|e| sql_err(&self.db, e))? {
                let (seq, at_us): (i64, i64) = (
                    r.get(0).map_err(|e| sql_err(&self.db, e))?,
                    r.get(1).map_err(|e| sql_err(&self.db, e))?,
                );
                if up_to_at_us.is_some_and(|t| at_us > t) {
                    break;
                }
                let sequence = self.stored_seq(seq, model_id)?;
                let text: String = r.get(2).map_err(|e| sql_err(&self.db, e))?;
                let record = self.parse(&text, || {
                    format!("audit record {sequence} of model `{model_id}`")
                })?;
                seen += 1;
                if f(AuditEntry {
                    sequence: Seq::new(sequence),
                    at: Timestamp::from_us(at_us),
                    record,
                })
                .is_break()
                {
                    break;
                }
            }
            Ok(seen)
        })
    }

    /// A model's records matching `filter`, newest first (indexed: by path, by time, by sequence).
    pub fn query_audit(
        &self,
        model_id: &str,
        filter: &AuditFilter,
    ) -> Result<Vec<Json>, StoreError> {
        let limit = filter
            .limit
            .unwrap_or(DEFAULT_QUERY_LIMIT)
            .min(MAX_QUERY_LIMIT) as i64;
        let prefix = filter.path_prefix.as_deref().filter(|p| !p.is_empty());
        let upper = prefix.and_then(prefix_upper_bound);
        let mut sql = String::from("SELECT sequence, record FROM audit WHERE model_id = :m");
        let mut args: Vec<(&str, &dyn ToSql)> = vec![(":m", &model_id), (":limit", &limit)];
        if let Some(p) = &prefix {
            sql.push_str(
                " AND sequence IN (SELECT sequence FROM audit_paths WHERE model_id = :m AND path >= :lo",
            );
            args.push((":lo", p));
            if let Some(u) = &upper {
                sql.push_str(" AND path < :hi");
                args.push((":hi", u));
            }
            sql.push(')');
        }
        let (from, to) = (filter.from.map(Timestamp::us), filter.to.map(Timestamp::us));
        if let Some(from) = &from {
            sql.push_str(" AND at_us >= :from");
            args.push((":from", from));
        }
        if let Some(to) = &to {
            sql.push_str(" AND at_us <= :to");
            args.push((":to", to));
        }
        sql.push_str(" ORDER BY sequence DESC LIMIT :limit");
        self.with_reader(|c| {
            let mut st = c.prepare_cached(&sql).map_err(|e| sql_err(&self.db, e))?;
            let mut rows = st
                .query(args.as_slice())
                .map_err(|e| sql_err(&self.db, e))?;
            let mut out = Vec::new();
            while let Some(r) = rows.next().map_err(|e| sql_err(&self.db, e))? {
                let seq: i64 = r.get(0).map_err(|e| sql_err(&self.db, e))?;
                let text: String = r.get(1).map_err(|e| sql_err(&self.db, e))?;
                out.push(self.parse(&text, || {
                    format!("audit record {seq} of model `{model_id}`")
                })?);
            }
            Ok(out)
        })
    }

    /// A model's snapshots, oldest first.
    /// The records of the tasks kept (MCP's tasks extension), oldest first.
    pub fn tasks(&self) -> Result<Vec<String>, StoreError> {
        self.all_rows("SELECT record FROM tasks ORDER BY at_us, id", [], |r| {
            r.get::<_, String>(0)
        })
    }

    /// A model's idempotency keys, newest first (at most [`KEYS_KEPT`]).
    pub fn idempotency_keys(&self, model_id: &str) -> Result<Vec<StoredKey>, StoreError> {
        self.all_rows(
            "SELECT key, request, sequence FROM idempotency WHERE model_id = ?1
             ORDER BY sequence DESC LIMIT ?2",
            rusqlite::params![model_id, KEYS_KEPT as i64],
            |r| {
                Ok(StoredKey {
                    key: r.get(0)?,
                    request: r.get(1)?,
                    sequence: Seq::new(r.get::<_, i64>(2)?.max(0) as u64),
                })
            },
        )
    }

    /// The answer a write made under `key` was given (`None`: no such key kept).
    pub fn idempotency_answer(
        &self,
        model_id: &str,
        key: &str,
    ) -> Result<Option<String>, StoreError> {
        self.with_reader(|c| {
            c.prepare_cached("SELECT answer FROM idempotency WHERE model_id = ?1 AND key = ?2")
                .and_then(|mut s| s.query_row([model_id, key], |r| r.get(0)).optional())
                .map_err(|e| sql_err(&self.db, e))
        })
    }

    pub fn snapshots(&self, model_id: &str) -> Result<Vec<StoredSnapshot>, StoreError> {
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT snapshot_id, at_us, snapshot FROM snapshots WHERE model_id = ?1
                     ORDER BY at_us, snapshot_id",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let rows = st
                .query_map([model_id], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })
                .map_err(|e| sql_err(&self.db, e))?;
            let mut out = Vec::new();
            for row in rows {
                let (snapshot_id, at_us, text) = row.map_err(|e| sql_err(&self.db, e))?;
                let snapshot = self.parse(&text, || {
                    format!("snapshot `{snapshot_id}` of model `{model_id}`")
                })?;
                out.push(StoredSnapshot {
                    snapshot_id,
                    at: Timestamp::from_us(at_us),
                    snapshot,
                });
            }
            Ok(out)
        })
    }

    /// Blob metadata by blob id.
    pub fn blob(&self, id: &str) -> Result<Option<BlobMeta>, StoreError> {
        self.with_reader(|c| {
            c.prepare_cached(
                "SELECT id, hash, size, media_type, filename, created_us FROM blobs WHERE id = ?1",
            )
            .and_then(|mut s| {
                s.query_row([id], |r| {
                    Ok(BlobMeta {
                        id: r.get(0)?,
                        hash: r.get(1)?,
                        size: r.get::<_, i64>(2)?.max(0) as u64,
                        media_type: r.get(3)?,
                        filename: r.get(4)?,
                        created: Timestamp::from_us(r.get(5)?),
                    })
                })
                .optional()
            })
            .map_err(|e| sql_err(&self.db, e))
        })
    }

    /// Write blob bytes durably (temp file, fsync, rename, fsync of the directory) under their
    /// blake3 hash and return the hash. Idempotent; call before submitting `Op::PutBlob`, so
    /// metadata never names missing bytes (a crash in between leaves an unreferenced file).
    pub fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let size = bytes.len() as u64;
        if size > self.opts.max_blob_bytes {
            return Err(StoreError::BlobTooLarge {
                size,
                limit: self.opts.max_blob_bytes,
            });
        }
        let hash = blake3::hash(bytes).to_hex().to_string();
        let (sub, path) = self.blob_path(&hash)?;
        if let Ok(existing) = fs::read(&path) {
            if blake3::hash(&existing).to_hex().as_str() == hash {
                return Ok(hash);
            }
        }
        let new_dir = !sub.exists();
        fs::create_dir_all(&sub).map_err(|e| StoreError::io(&sub, e))?;
        if new_dir {
            sync_dir(&self.dir.join("blobs"))?;
        }
        static TMP_SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = sub.join(format!(
            ".tmp-{}-{}-{}",
            &hash[2..],
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(StoreError::io(&path, e));
        }
        sync_dir(&sub)?;
        Ok(hash)
    }

    /// Blob bytes by hash, checked against the hash (a damaged file is `Corrupt`).
    pub fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError> {
        let (_, path) = self.blob_path(hash)?;
        let len = match fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::BlobNotFound {
                    hash: hash.to_string(),
                })
            }
            Err(e) => return Err(StoreError::io(&path, e)),
        };
        if len > self.opts.max_blob_bytes {
            return Err(StoreError::BlobTooLarge {
                size: len,
                limit: self.opts.max_blob_bytes,
            });
        }
        let bytes = fs::read(&path).map_err(|e| StoreError::io(&path, e))?;
        if blake3::hash(&bytes).to_hex().as_str() != hash {
            return Err(StoreError::Corrupt {
                path,
                detail: "the blob's bytes do not match its blake3 hash".into(),
            });
        }
        Ok(bytes)
    }

    pub(super) fn blob_path(&self, hash: &str) -> Result<(PathBuf, PathBuf), StoreError> {
        check_blob_hash(hash)?;
        let sub = self.dir.join("blobs").join(&hash[..2]);
        let path = sub.join(&hash[2..]);
        Ok((sub, path))
    }

    /// Walk a model's stored audit chain oldest first (one read snapshot) and check every link,
    /// hash and sequence against the chain head recorded in `models` (in a keyed store, keyed
    /// hashes from the model's `key_from` on, and the anchor that pins it); then every
    /// checkpoint against its state and the chain ([`checkpoints`]).
    pub fn verify_chain(&self, model_id: &str) -> Result<ChainReport, StoreError> {
        self.with_reader(|c| {
            c.execute_batch("BEGIN").map_err(|e| sql_err(&self.db, e))?;
            type Head = (
                Option<i64>,
                String,
                Option<i64>,
                Option<i64>,
                Option<String>,
            );
            let head: Option<Head> = c
                .prepare_cached(
                    "SELECT head_seq, head_hash, base_seq, key_from, key_anchor FROM models
                     WHERE id = ?1",
                )
                .and_then(|mut s| {
                    s.query_row([model_id], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                    })
                    .optional()
                })
                .map_err(|e| sql_err(&self.db, e))?;
            let Some((head_seq, head_hash, base_seq, key_from, anchor)) = head else {
                return Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                });
            };
            let mut st = c
                .prepare_cached(
                    "SELECT sequence, prev_hash, hash, record FROM audit WHERE model_id = ?1
                     ORDER BY sequence",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            // A column of another type (tampering) reads as an empty string or sequence -1.
            let rows = st
                .query_map([model_id], |r| {
                    let text = |i| {
                        r.get_ref(i)
                            .map(|x| x.as_str().unwrap_or_default().to_string())
                    };
                    Ok(crate::chain::AuditRow {
                        sequence: r.get_ref(0)?.as_i64().unwrap_or(-1),
                        prev_hash: text(1)?,
                        hash: text(2)?,
                        record: text(3)?,
                    })
                })
                .map_err(|e| sql_err(&self.db, e))?;
            let mut rows = rows.map(|r| r.map_err(|e| sql_err(&self.db, e)));
            let key = self.opts.audit_key;
            let mut report = crate::chain::walk_chain(
                key.as_ref(),
                model_id,
                &crate::chain::ChainHead {
                    head_seq,
                    head_hash: &head_hash,
                    key_from,
                    key_anchor: anchor.as_deref(),
                },
                &mut rows,
            )?;
            drop(rows);
            drop(st);
            let (checked, broken) = self.verify_checkpoints(c, model_id, base_seq)?;
            checkpoints::fold_into(&mut report, checked, broken);
            Ok(report)
        })
    }
}

/// A `models` row (`id, spec, version, created_us, updated_us, head_seq, head_hash`) and the
/// body of the spec text it names (`spec_texts.body`, when it names one).
fn stored_model(r: &rusqlite::Row<'_>) -> rusqlite::Result<StoredModel> {
    let id: String = r.get(0)?;
    let spec_text = match r.get::<_, Option<String>>(7)? {
        Some(body) => crate::spec_text::join(&id, &body),
        None => r.get(1)?,
    };
    Ok(StoredModel {
        id,
        spec_text,
        version: r.get(2)?,
        created: Timestamp::from_us(r.get(3)?),
        updated: Timestamp::from_us(r.get(4)?),
        head_seq: r
            .get::<_, Option<i64>>(5)?
            .map(|s| s.max(0) as u64)
            .map(Seq::new),
        head_hash: r.get(6)?,
    })
}
