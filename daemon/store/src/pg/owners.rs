//! Ownership in a fleet: each model has at most one owner node at a time, recorded in
//! `valem.owners` with an epoch. Each node has one lease (`valem.nodes.lease_until_us`), which
//! it renews every third of a lease by updating its own row only — never a model's row, so a
//! renewal never waits on a commit's fence and costs the same for 10 models or 100,000. A model's
//! claim holds while its owner's lease does and it was not released. A node claims a model
//! before it loads or creates it (unowned, released, its owner's lease run out, or its own
//! already); and every commit that touches a model checks, in its own transaction, that this
//! node still holds the epoch it claimed (the writer's fence, see `writer.rs`). A node paused or cut off past its lease may find its models claimed by
//! another node with a higher epoch: its next commit on them fails with
//! [`StoreError::Fenced`], so a chain is never written by two nodes. Lease times are the
//! database's clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::PgStore;
use crate::{StoreError, Timestamp};

/// This node's identity in a fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfig {
    /// A name unique in the fleet (one process per name at a time).
    pub id: String,
    /// How the other nodes reach this one (`http://host:port`).
    pub url: String,
    /// How long a claim or renewal holds a model.
    pub lease: Duration,
    /// Renew this node's leases on a thread of the store's, every third of a lease (tests
    /// renew by hand with [`PgStore::renew`]).
    pub renew: bool,
}

/// Who owns a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// The model.
    pub model_id: String,
    /// The owner node's id.
    pub node: String,
    /// How to reach it (`None`: it has not registered, or left).
    pub url: Option<String>,
    /// The owner's epoch: one higher at every change of owner.
    pub epoch: i64,
    /// When its lease runs out (the database's clock).
    pub lease_until: Timestamp,
}

/// What this node's claims did since it started (for `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimStats {
    /// Models nobody owned before (first claim).
    pub new: u64,
    /// Models this node owned already (woken again, or claimed again after a restart).
    pub again: u64,
    /// Models another node released (evicted) and this node took.
    pub handovers: u64,
    /// Models another node owned whose lease had run out (it died or was cut off): failovers.
    pub failovers: u64,
    /// Claims refused: another live node owns the model.
    pub refused: u64,
    /// Models a renewal found taken by another node.
    pub lost: u64,
}

/// The counters behind [`ClaimStats`].
#[derive(Default)]
pub(crate) struct ClaimCounters {
    new: AtomicU64,
    again: AtomicU64,
    handovers: AtomicU64,
    failovers: AtomicU64,
    refused: AtomicU64,
    lost: AtomicU64,
}

impl ClaimCounters {
    pub(crate) fn stats(&self) -> ClaimStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ClaimStats {
            new: g(&self.new),
            again: g(&self.again),
            handovers: g(&self.handovers),
            failovers: g(&self.failovers),
            refused: g(&self.refused),
            lost: g(&self.lost),
        }
    }
}

/// A node of the fleet, as `valem.nodes` holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its id.
    pub id: String,
    /// Its URL.
    pub url: String,
    /// Its lease has not run out.
    pub alive: bool,
    /// Models it owns with a lease not run out.
    pub models: i64,
}

/// The epochs this node holds, shared with the writer's fence.
pub(crate) type Held = Arc<Mutex<HashMap<String, i64>>>;

/// When this node's lease runs out at the latest, on this process's clock: the lease was set
/// on the database's clock by a statement sent after the instant it is counted from, so a node
/// that was paused (or cut off) past it stops serving what it held before the database says so.
pub(crate) type LeaseEnd = Arc<AtomicU64>;

/// An instant as µs since a second before the first one this process asked for (0 is "never":
/// no lease yet), so that a lease's end fits an atomic read on every access to a model.
fn micros(at: std::time::Instant) -> u64 {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| at.checked_sub(Duration::from_secs(1)).unwrap_or(at));
    u64::try_from(at.saturating_duration_since(base).as_micros()).unwrap_or(u64::MAX)
}

fn lease_renewed(end: &LeaseEnd, sent: std::time::Instant, node: &NodeConfig) {
    end.fetch_max(micros(sent + node.lease), Ordering::AcqRel);
}

/// Whether this node's lease still runs, by [`LeaseEnd`].
pub(crate) fn lease_runs(end: &LeaseEnd) -> bool {
    micros(std::time::Instant::now()) < end.load(Ordering::Acquire)
}

/// What renewing needs, shared by the store and its lease thread.
struct Leases {
    node: NodeConfig,
    held: Held,
    lost: Arc<Mutex<Vec<String>>>,
    end: LeaseEnd,
    counters: Arc<ClaimCounters>,
}

impl Leases {
    fn renew(&self, client: &mut postgres::Client) -> Result<Vec<String>, postgres::Error> {
        let lease = lease_us(&self.node);
        let renew = format!(
            "UPDATE valem.nodes SET seen_us = {NOW_US}, lease_until_us = {NOW_US} + $2
             WHERE id = $1"
        );
        let sent = std::time::Instant::now();
        client.execute(&renew, &[&self.node.id, &lease])?;
        // What this node still owns (read without locks: a claim in flight shows at the next
        // renewal, and the fence stops a write meanwhile).
        let rows = client.query(
            "SELECT model_id, epoch FROM valem.owners WHERE node_id = $1 AND NOT released",
            &[&self.node.id],
        )?;
        let owned: HashMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let mut lost = Vec::new();
        if let Ok(mut held) = self.held.lock() {
            held.retain(|m, e| {
                let keep = owned.get(m) == Some(e);
                if !keep {
                    lost.push(m.clone());
                }
                keep
            });
        }
        lost.sort();
        self.counters
            .lost
            .fetch_add(lost.len() as u64, Ordering::Relaxed);
        if let Ok(mut l) = self.lost.lock() {
            l.extend(lost.iter().cloned());
        }
        // Only now, with what it lost dropped from `held`, does the lease count as running.
        lease_renewed(&self.end, sent, &self.node);
        Ok(lost)
    }
}

/// The database's clock in µs, in SQL.
pub(crate) const NOW_US: &str = "(extract(epoch from clock_timestamp()) * 1000000)::bigint";

fn lease_us(node: &NodeConfig) -> i64 {
    i64::try_from(node.lease.as_micros()).unwrap_or(i64::MAX / 4)
}

impl PgStore {
    fn node(&self) -> Result<&NodeConfig, StoreError> {
        self.opts.node.as_ref().ok_or_else(|| StoreError::Postgres {
            path: self.target.label(),
            detail: "this store was opened without a node identity (--node-id)".into(),
        })
    }

    /// Register (or refresh) this node in `valem.nodes`.
    pub(crate) fn register_node(&self) -> Result<(), StoreError> {
        let node = self.node()?.clone();
        let sql = format!(
            "INSERT INTO valem.nodes (id, url, started_us, seen_us, lease_until_us)
             VALUES ($1, $2, {NOW_US}, {NOW_US}, {NOW_US} + $3)
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, started_us = excluded.started_us,
                 seen_us = excluded.seen_us, lease_until_us = excluded.lease_until_us"
        );
        let lease = lease_us(&node);
        self.with_reader(|c| c.client.execute(&sql, &[&node.id, &node.url, &lease]))?;
        Ok(())
    }

    /// Take model `model_id` for this node (unowned, released, its owner's lease run out, or
    /// this node's already): the ownership held now. Owned by another node whose lease holds:
    /// [`StoreError::OwnedElsewhere`] naming it.
    pub fn claim(&self, model_id: &str) -> Result<Ownership, StoreError> {
        let node = self.node()?.clone();
        let lease = lease_us(&node);
        // This node's own lease is renewed with the claim, so the claim holds from now on.
        let sql = format!(
            "WITH before AS (
                 SELECT node_id, released FROM valem.owners WHERE model_id = $1
             ), me AS (
                 UPDATE valem.nodes SET seen_us = {NOW_US}, lease_until_us = {NOW_US} + $3
                 WHERE id = $2 RETURNING lease_until_us
             )
             INSERT INTO valem.owners AS o (model_id, node_id, epoch, released)
             VALUES ($1, $2, 1, false)
             ON CONFLICT (model_id) DO UPDATE SET
                 node_id = excluded.node_id,
                 epoch = CASE WHEN o.node_id = excluded.node_id THEN o.epoch ELSE o.epoch + 1 END,
                 released = false
             WHERE o.node_id = excluded.node_id OR o.released OR NOT EXISTS (
                 SELECT 1 FROM valem.nodes n
                 WHERE n.id = o.node_id AND n.lease_until_us > {NOW_US})
             RETURNING epoch, (SELECT lease_until_us FROM me),
                 (SELECT node_id FROM before), (SELECT released FROM before)"
        );
        let sent = std::time::Instant::now();
        let claimed =
            self.with_reader(|c| c.client.query_opt(&sql, &[&model_id, &node.id, &lease]))?;
        if let Some(row) = claimed {
            let (epoch, until): (i64, Option<i64>) = (row.get(0), row.get(1));
            let until = until.unwrap_or(0);
            let (before, released): (Option<String>, Option<bool>) = (row.get(2), row.get(3));
            let c = &self.claims;
            match before {
                None => &c.new,
                Some(n) if n == node.id => &c.again,
                Some(_) if released == Some(true) => &c.handovers,
                Some(_) => &c.failovers,
            }
            .fetch_add(1, Ordering::Relaxed);
            if let Ok(mut held) = self.held.lock() {
                // After a lapse of the lease, what was held may have been taken: the next
                // renewal says what is still this node's; until then, nothing else is.
                if !lease_runs(&self.lease_end) {
                    held.clear();
                }
                held.insert(model_id.to_string(), epoch);
            }
            lease_renewed(&self.lease_end, sent, &node);
            return Ok(Ownership {
                model_id: model_id.to_string(),
                node: node.id,
                url: Some(node.url),
                epoch,
                lease_until: Timestamp::from_us(until),
            });
        }
        match self.owner(model_id)? {
            Some(o) => {
                self.claims.refused.fetch_add(1, Ordering::Relaxed);
                Err(StoreError::OwnedElsewhere {
                    model_id: model_id.to_string(),
                    url: o.url.clone().unwrap_or_default(),
                    node: o.node,
                    lease_until: o.lease_until,
                })
            }
            // Released between the two statements: try again.
            None => self.claim(model_id),
        }
    }

    /// Forget model `model_id` here (after the writer committed `Op::Release` for it: another
    /// node may claim it at once). No database call (a writer's completion calls it).
    pub fn release(&self, model_id: &str) -> Result<(), StoreError> {
        if let Ok(mut held) = self.held.lock() {
            held.remove(model_id);
        }
        Ok(())
    }

    /// Renew the leases of the models this node holds, and its own row; the models it held and
    /// lost meanwhile (another node claimed them after a lease ran out), which it must drop.
    pub fn renew(&self) -> Result<Vec<String>, StoreError> {
        let leases = self.leases()?;
        self.with_reader(|c| leases.renew(&mut c.client))
    }

    fn leases(&self) -> Result<Leases, StoreError> {
        Ok(Leases {
            node: self.node()?.clone(),
            held: self.held.clone(),
            lost: self.lost.clone(),
            end: self.lease_end.clone(),
            counters: self.claims.clone(),
        })
    }

    /// Start the thread that renews this node's leases every third of a lease until `stop`
    /// fires or is dropped.
    pub(crate) fn spawn_renewal(
        &self,
        stop: std::sync::mpsc::Receiver<()>,
    ) -> Result<std::thread::JoinHandle<()>, StoreError> {
        let leases = self.leases()?;
        let target = self.target.clone();
        let every = (leases.node.lease / 3).max(Duration::from_millis(10));
        std::thread::Builder::new()
            .name("valem-store-leases".into())
            .spawn(move || {
                let mut client: Option<postgres::Client> = None;
                loop {
                    match stop.recv_timeout(every) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    if client.as_ref().is_none_or(postgres::Client::is_closed) {
                        client = target.connect().ok();
                    }
                    if let Some(c) = client.as_mut() {
                        // A failure (the database is away) is retried at the next tick; a
                        // lease that runs out meanwhile is caught by the fence.
                        if leases.renew(c).is_err() {
                            client = None;
                        }
                    }
                }
            })
            .map_err(|e| StoreError::Postgres {
                path: self.target.label(),
                detail: format!("cannot start the lease thread: {e}"),
            })
    }

    /// The models lost since the last call (found by the renewal thread).
    pub fn take_lost(&self) -> Vec<String> {
        self.lost
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default()
    }

    /// Who owned `model_id` last (`None`: nobody has claimed it); a released model or one
    /// whose lease ran out shows its last owner with a lease in the past.
    pub fn owner(&self, model_id: &str) -> Result<Option<Ownership>, StoreError> {
        let row = self.with_reader(|c| {
            c.client.query_opt(
                "SELECT o.node_id, n.url, o.epoch,
                     CASE WHEN o.released THEN 0 ELSE coalesce(n.lease_until_us, 0) END
                 FROM valem.owners o
                 LEFT JOIN valem.nodes n ON n.id = o.node_id WHERE o.model_id = $1",
                &[&model_id],
            )
        })?;
        Ok(row.map(|r| Ownership {
            model_id: model_id.to_string(),
            node: r.get(0),
            url: r.get(1),
            epoch: r.get(2),
            lease_until: Timestamp::from_us(r.get(3)),
        }))
    }

    /// The fleet's nodes, by id.
    pub fn nodes(&self) -> Result<Vec<NodeInfo>, StoreError> {
        let sql = format!(
            "SELECT n.id, n.url, n.lease_until_us > {NOW_US},
                 CASE WHEN n.lease_until_us > {NOW_US} THEN
                     (SELECT count(*) FROM valem.owners o WHERE o.node_id = n.id AND NOT o.released)
                 ELSE 0 END
             FROM valem.nodes n ORDER BY n.id"
        );
        let rows = self.with_reader(|c| c.client.query(&sql, &[]))?;
        Ok(rows
            .iter()
            .map(|r| NodeInfo {
                id: r.get(0),
                url: r.get(1),
                alive: r.get(2),
                models: r.get(3),
            })
            .collect())
    }
}
