//! What a durable test's daemon keeps its models in: a data directory (the embedded SQLite
//! store) or a database on a real PostgreSQL server started for the test (`--store`), so one
//! scenario runs on both stores.

use valem_store::pg::testing::TestServer;

use crate::Daemon;

/// The database a PostgreSQL backing creates on its server.
const DB: &str = "valem";

/// A store for a test's daemons; dropping it removes the directory or stops the server.
pub enum Backing {
    /// `--data-dir` in a temporary directory.
    Sqlite(tempfile::TempDir),
    /// `--store postgres://…` on a throwaway server.
    Postgres { server: TestServer, url: String },
}

impl Backing {
    /// A fresh data directory.
    pub fn sqlite() -> Backing {
        Backing::Sqlite(tempfile::tempdir().expect("a temporary data directory"))
    }

    /// A fresh database on a PostgreSQL server of its own (fails with the reason when the
    /// server's binaries are missing: scripts/test installs them).
    pub fn postgres() -> Backing {
        let server =
            TestServer::start().unwrap_or_else(|e| panic!("a PostgreSQL test server: {e}"));
        let url = server
            .create_db(DB)
            .unwrap_or_else(|e| panic!("create the test database: {e}"));
        Backing::Postgres { server, url }
    }

    /// The daemon's flags for this store.
    pub fn args(&self) -> Vec<String> {
        match self {
            Backing::Sqlite(d) => vec![
                "--data-dir".into(),
                d.path().to_str().expect("a UTF-8 path").into(),
            ],
            Backing::Postgres { url, .. } => vec!["--store".into(), url.clone()],
        }
    }

    /// These flags followed by `extra`, as `Daemon::start` takes them.
    pub fn with<'a>(&'a self, args: &'a [String], extra: &[&'a str]) -> Vec<&'a str> {
        args.iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .collect()
    }

    /// Start `valem serve` on this store, with `extra` flags.
    pub fn start(&self, extra: &[&str]) -> Daemon {
        let args = self.args();
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend_from_slice(extra);
        Daemon::start(&all)
    }

    /// Run `sql` on the store's database from a connection of its own, as someone with access
    /// to it would (the store's tables by their plain names on both).
    pub fn sql(&self, sql: &str) {
        match self {
            Backing::Sqlite(d) => {
                let c = rusqlite::Connection::open(d.path().join(valem_store::DB_FILE))
                    .expect("open the database");
                c.execute_batch(sql).expect("the SQL runs");
            }
            Backing::Postgres { server, .. } => {
                server.sql(DB, sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
            }
        }
    }

    /// The one integer `sql` (a `SELECT count(*) …`, say) answers on the store's database.
    pub fn count(&self, sql: &str) -> i64 {
        match self {
            Backing::Sqlite(d) => rusqlite::Connection::open(d.path().join(valem_store::DB_FILE))
                .and_then(|c| c.query_row(sql, [], |r| r.get(0)))
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
            Backing::Postgres { server, .. } => server
                .count(DB, sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
        }
    }

    /// Whether this is the PostgreSQL store.
    pub fn is_postgres(&self) -> bool {
        matches!(self, Backing::Postgres { .. })
    }

    /// The data directory (SQLite only).
    pub fn dir(&self) -> Option<&std::path::Path> {
        match self {
            Backing::Sqlite(d) => Some(d.path()),
            Backing::Postgres { .. } => None,
        }
    }

    /// The PostgreSQL server (PostgreSQL only), to stop and restart it.
    pub fn server(&mut self) -> Option<&mut TestServer> {
        match self {
            Backing::Sqlite(_) => None,
            Backing::Postgres { server, .. } => Some(server),
        }
    }
}

/// `mod $name { sqlite, postgres }`: test scenario `$f` (a `fn(&Backing)` of the calling test
/// file) on each store.
#[macro_export]
macro_rules! on_both_stores {
    ($name:ident, $f:ident) => {
        mod $name {
            #[test]
            fn sqlite() {
                super::$f(&$crate::backing::Backing::sqlite());
            }
            #[test]
            fn postgres() {
                super::$f(&$crate::backing::Backing::postgres());
            }
        }
    };
}
