//! A private PostgreSQL 15 server for the tests that stop, restart or
//! reconfigure one, never the machine's: its own data directory (0700, under
//! `/tmp`, owned by `postgres`), a free TCP port on 127.0.0.1, a socket
//! directory of its own and trust authentication. `initdb` and `pg_ctl`
//! refuse to run as root, so they run as the `postgres` user (`runuser`,
//! which needs root). Stopped and removed on drop.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::process::Command;
use tokio_postgres::NoTls;

use crate::broker::free_port;
use crate::wait::wait_until;

/// Where Debian's PostgreSQL 15 keeps `initdb` and `pg_ctl` (`apt-get
/// install postgresql-15`).
pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// The operating-system user the server runs as.
const OWNER: &str = "postgres";

pub struct PrivatePostgres {
    pub port: u16,
    /// Holds `data/`, `socket/` and `postgres.log`; removed on drop.
    dir: PathBuf,
    data: String,
    socket: String,
    log: String,
    running: bool,
}

impl PrivatePostgres {
    /// A new cluster (`initdb`), started, answering queries.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// [`Self::start`] with `settings` (`("track_commit_timestamp", "on")`)
    /// added to its `postgresql.conf`, so that they hold after
    /// [`Self::start_again`] too.
    pub async fn start_with(settings: &[(&str, &str)]) -> Self {
        assert!(
            Path::new(PG_BIN).join("initdb").is_file(),
            "a private PostgreSQL needs {PG_BIN}/initdb (apt-get install postgresql-15)"
        );
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "shardline-pg-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let text = |sub: &str| dir.join(sub).to_string_lossy().into_owned();
        let mut pg = Self {
            port: free_port(),
            data: text("data"),
            socket: text("socket"),
            log: text("postgres.log"),
            dir,
            running: false,
        };
        // Made by the owner, so that initdb and the server may write there.
        let top = pg.dir.to_string_lossy().into_owned();
        as_owner("mkdir", &["-m", "0700", &top, &pg.socket]).await;
        as_owner(
            &format!("{PG_BIN}/initdb"),
            &[
                "--pgdata",
                &pg.data,
                "--username",
                OWNER,
                "--auth-local",
                "trust",
                "--auth-host",
                "trust",
                "--encoding",
                "UTF8",
                "--locale",
                "C.UTF-8",
                "--no-sync",
            ],
        )
        .await;
        let socket = &pg.socket;
        let mut conf = vec![
            ("port".to_owned(), pg.port.to_string()),
            ("listen_addresses".to_owned(), "'127.0.0.1'".to_owned()),
            ("unix_socket_directories".to_owned(), format!("'{socket}'")),
            // Durability against a machine crash, which no test makes.
            ("fsync".to_owned(), "off".to_owned()),
        ];
        conf.extend(
            settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        // Appended by root to a file the owner keeps owning.
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(Path::new(&pg.data).join("postgresql.conf"))
            .unwrap();
        writeln!(file, "\n# shardline test kit").unwrap();
        for (key, value) in conf {
            writeln!(file, "{key} = {value}").unwrap();
        }
        pg.start_again().await;
        pg
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://{OWNER}@127.0.0.1:{}/postgres", self.port)
    }

    /// `pg_ctl stop -m fast`: sessions are ended, open transactions rolled
    /// back, and the server shuts down cleanly.
    pub async fn stop(&mut self) {
        assert!(self.running, "the private PostgreSQL is not running");
        self.pg_ctl(&["stop", "-m", "fast", "-w"]).await;
        self.running = false;
    }

    /// Starts the server again on the same port and data, and waits until it
    /// answers a query.
    pub async fn start_again(&mut self) {
        assert!(!self.running, "the private PostgreSQL is already running");
        let log = self.log.clone();
        self.pg_ctl(&["start", "-w", "-t", "60", "-l", &log]).await;
        self.running = true;
        let url = self.url();
        wait_until(
            &format!("the private PostgreSQL on port {} to answer", self.port),
            crate::STARTUP,
            || {
                let url = url.clone();
                async move {
                    let (client, connection) = tokio::time::timeout(
                        Duration::from_secs(5),
                        tokio_postgres::connect(&url, NoTls),
                    )
                    .await
                    .map_err(|_| "connecting timed out".to_owned())?
                    .map_err(|e| e.to_string())?;
                    let connection = tokio::spawn(connection);
                    let answer = client.simple_query("SELECT 1").await.map(drop);
                    drop(client);
                    let _ = connection.await;
                    answer.map_err(|e| e.to_string())
                }
            },
        )
        .await;
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn pg_ctl(&self, args: &[&str]) {
        let mut all = vec!["--pgdata", self.data.as_str()];
        all.extend_from_slice(args);
        let out = owner_command(&format!("{PG_BIN}/pg_ctl"), &all)
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run runuser … pg_ctl: {e}"));
        assert!(
            out.status.success(),
            "pg_ctl {args:?} failed ({}): {}{}\n---- server log ----\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log_text()
        );
    }
}

/// `program args…` as the owner, from `/tmp` (its own working directory may
/// be closed to it).
fn owner_command(program: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", OWNER, "--", program])
        .args(args)
        .current_dir(std::env::temp_dir())
        .kill_on_drop(true);
    cmd
}

/// Runs `program args…` as the owner; fails the test with its output.
async fn as_owner(program: &str, args: &[&str]) {
    let out = owner_command(program, args)
        .output()
        .await
        .unwrap_or_else(|e| {
            panic!("cannot run `runuser -u {OWNER} -- {program}` (the test kit runs as root): {e}")
        });
    assert!(
        out.status.success(),
        "runuser -u {OWNER} -- {program} {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            eprintln!(
                "---- private PostgreSQL on port {} log, last lines ----\n{}\n---- end ----",
                self.port,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        if self.running {
            let data = &self.data;
            let stopped = std::process::Command::new("runuser")
                .args(["-u", OWNER, "--", &format!("{PG_BIN}/pg_ctl"), "stop"])
                .args(["-m", "immediate", "-w", "--pgdata", data])
                .current_dir(std::env::temp_dir())
                .output();
            match stopped {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!(
                    "cleanup: pg_ctl stop {data}: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(e) => eprintln!("cleanup: cannot run pg_ctl stop: {e}"),
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("cleanup: removing {}: {e}", self.dir.display());
        }
    }
}
