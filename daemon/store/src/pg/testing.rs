//! A throwaway PostgreSQL server for tests: `initdb` into a fresh directory, `postgres` on a
//! free loopback port (as the `postgres` user when running as root, which PostgreSQL refuses
//! to run as), stopped and removed on drop. The binaries come from `$VALEM_PG_BIN`, else the
//! newest `/usr/lib/postgresql/*/bin` (Debian's `postgresql` package), else `pg_config
//! --bindir`. Compiled for the store's tests and for crates that enable `pg-testing`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; dropping it stops the server and removes its data directory.
pub struct TestServer {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    as_postgres: bool,
}

fn bin_dir() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("VALEM_PG_BIN") {
        return Ok(PathBuf::from(d));
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    if let Some((_, b)) = found.pop() {
        return Ok(b);
    }
    Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|b| b.join("initdb").exists())
        .ok_or_else(|| {
            "no PostgreSQL server binaries (initdb, postgres): install Debian's `postgresql` package (scripts/test does) or set VALEM_PG_BIN to their directory".to_string()
        })
}

/// An error with the server's message, which `postgres::Error`'s own text leaves out.
fn detail(e: postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{}: {}", d.code().code(), d.message()),
        None => e.to_string(),
    }
}

fn is_root() -> bool {
    // The effective uid of this process, from /proc.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

impl TestServer {
    /// Initialise and start a server; `Err` says what is missing or what failed.
    pub fn start() -> Result<TestServer, String> {
        let bin = bin_dir()?;
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("valem-pg-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let as_postgres = is_root();
        if as_postgres {
            let chown = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .map_err(|e| format!("chown: {e}"))?;
            if !chown.success() {
                return Err(format!("chown postgres {} failed", dir.display()));
            }
        }
        let mut server = TestServer {
            dir,
            bin,
            port: 0,
            child: None,
            as_postgres,
        };
        let data = server.data();
        let out = server
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "valem", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        server.port = free_port()?;
        server.launch()?;
        Ok(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn command(&self, prog: &str) -> Command {
        let path = self.bin.join(prog);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn launch(&mut self) -> Result<(), String> {
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(&self.dir)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("postgres: {e}"))?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match postgres::Client::connect(&self.url("postgres"), postgres::NoTls) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("the test server did not come up in 30 s: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// The URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://valem@127.0.0.1:{}/{db}", self.port)
    }

    /// A fresh empty database; its URL.
    pub fn create_db(&self, db: &str) -> Result<String, String> {
        let mut c =
            postgres::Client::connect(&self.url("postgres"), postgres::NoTls).map_err(detail)?;
        // One statement at a time: CREATE DATABASE cannot run in a transaction block.
        for sql in [
            format!("DROP DATABASE IF EXISTS \"{db}\""),
            format!("CREATE DATABASE \"{db}\""),
        ] {
            c.batch_execute(&sql).map_err(detail)?;
        }
        Ok(self.url(db))
    }

    /// A connection to database `db` whose unqualified table names are the store's (the
    /// schema `valem` first on the search path), to inspect or to tamper.
    pub fn client(&self, db: &str) -> Result<postgres::Client, String> {
        let mut config: postgres::Config = self.url(db).parse().map_err(|e| format!("{e}"))?;
        config.options("-c search_path=valem,public");
        config.connect(postgres::NoTls).map_err(detail)
    }

    /// Run SQL on database `db` (unqualified names are the store's tables).
    pub fn sql(&self, db: &str, sql: &str) -> Result<(), String> {
        self.client(db)?.batch_execute(sql).map_err(detail)
    }

    /// The first column of the first row `sql` yields on database `db`, as an integer.
    pub fn count(&self, db: &str, sql: &str) -> Result<i64, String> {
        self.client(db)?
            .query_one(sql, &[])
            .and_then(|r| r.try_get(0))
            .map_err(detail)
    }

    /// Stop the server at once (SIGKILL of the postmaster would leave its children; an
    /// immediate shutdown is PostgreSQL's crash: no checkpoint, recovery at the next start).
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Start the stopped server again on the same port.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.launch()
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory (under the server's own directory).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
