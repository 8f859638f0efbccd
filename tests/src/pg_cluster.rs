//! A PostgreSQL primary and one streaming standby of a test's own, on loopback,
//! started from the machine's PostgreSQL install beside the shared server, never
//! touching it.
//!
//! Both servers live under one temporary directory: their own data directories,
//! free ports picked when they start, their own socket directory and log files. They
//! run as the `postgres` user when the test runs as root (PostgreSQL refuses root;
//! the directory is then owned by that user). The standby is a `pg_basebackup` of
//! the primary that streams from it under the application name `standby1`; with
//! synchronous replication the primary waits for it at every commit
//! (`synchronous_standby_names = 'standby1'`, `synchronous_commit = on`).
//!
//! The standby's own configuration clears `synchronous_standby_names`: a base backup
//! copies the primary's, and a promoted standby that kept it would wait at every
//! commit for a standby that does not exist. With two servers that is the operator's
//! choice to make at promotion (see docs/postgres-failover.md); the harness makes it.
//! Dropping the pair kills both servers and deletes the directory.
//!
//! Running a pair by hand (what [`PgPair::start`] does; as root, prefix each server
//! command with `runuser -u postgres --` and `chown -R postgres: $D` first):
//!
//! ```text
//! B=/usr/lib/postgresql/15/bin; D=/tmp/pgpair; mkdir -p $D/sock
//! $B/initdb -D $D/primary -U postgres --auth=trust --no-sync
//! cat >> $D/primary/postgresql.conf <<CONF
//! port = 6601
//! listen_addresses = '127.0.0.1'
//! unix_socket_directories = '$D/sock'
//! wal_level = replica
//! synchronous_standby_names = 'standby1'   # leave out for asynchronous replication
//! CONF
//! $B/pg_ctl -D $D/primary -l $D/primary.log -w start
//! $B/pg_basebackup -h 127.0.0.1 -p 6601 -U postgres -D $D/standby -X stream --no-sync
//! touch $D/standby/standby.signal
//! cat >> $D/standby/postgresql.conf <<CONF
//! port = 6602
//! synchronous_standby_names = ''
//! primary_conninfo = 'host=127.0.0.1 port=6601 user=postgres application_name=standby1'
//! CONF
//! $B/pg_ctl -D $D/standby -l $D/standby.log -w start
//! # the failover: kill -9 the primary's postmaster and its children, then
//! $B/pg_ctl -D $D/standby -w promote
//! ```
//!
//! A store reaches whichever is the primary through the multi-host URL
//! [`PgPair::url`] (`target_session_attrs=read-write`).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The application name the standby streams under.
const STANDBY: &str = "standby1";

/// A primary and a standby of the test's own (see the [module](self)).
pub struct PgPair {
    dir: PathBuf,
    bin: PathBuf,
    /// Ports of the first primary and the standby.
    ports: [u16; 2],
    synchronous: bool,
    primary_killed: bool,
}

/// The newest PostgreSQL install's binaries (`/usr/lib/postgresql/<v>/bin`), if any.
pub fn binaries() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// Whether the PostgreSQL install this harness needs is on the machine.
pub fn available() -> bool {
    binaries().is_some_and(|b| b.join("pg_basebackup").exists())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

fn check(what: &str, out: io::Result<Output>) -> io::Result<Output> {
    let out = out.map_err(|e| io::Error::other(format!("{what}: {e}")))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(io::Error::other(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

impl PgPair {
    /// Starts a primary and a standby streaming from it, synchronous or not, and
    /// waits until the standby streams (and, when synchronous, is the synchronous
    /// one). About five seconds.
    pub fn start(synchronous: bool) -> io::Result<Self> {
        Self::start_linked(synchronous, |port| port)
    }

    /// As [`start`](Self::start), the standby streaming through the port `link`
    /// returns for the primary's (a proxy of the test's, to cut or freeze
    /// replication).
    pub fn start_linked(synchronous: bool, link: impl FnOnce(u16) -> u16) -> io::Result<Self> {
        let bin = binaries().ok_or_else(|| io::Error::other("no PostgreSQL install"))?;
        let dir = std::env::temp_dir().join(crate::unique_name("pgpair").replace('_', "-"));
        std::fs::create_dir_all(dir.join("sock"))?;
        let pair = Self {
            dir,
            bin,
            ports: [free_port()?, free_port()?],
            synchronous,
            primary_killed: false,
        };
        if is_root() {
            check(
                "chown",
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&pair.dir)
                    .output(),
            )?;
        }
        let (primary, standby) = (pair.data(0), pair.data(1));
        pair.run(
            "initdb",
            &[
                "-D",
                path(&primary),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
            ],
        )?;
        let sync_names = if synchronous { STANDBY } else { "" };
        pair.append(
            &primary.join("postgresql.conf"),
            &format!(
                "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
                 wal_level = replica\nmax_wal_senders = 5\nfsync = on\n\
                 synchronous_commit = on\nsynchronous_standby_names = '{sync_names}'\n",
                pair.ports[0],
                path(&pair.dir.join("sock")),
            ),
        )?;
        pair.pg_ctl(0, "start")?;
        pair.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &pair.ports[0].to_string(),
                "-U",
                "postgres",
                "-D",
                path(&standby),
                "-X",
                "stream",
                "--no-sync",
            ],
        )?;
        pair.append(&standby.join("standby.signal"), "")?;
        pair.append(
            &standby.join("postgresql.conf"),
            &format!(
                "port = {}\nsynchronous_standby_names = ''\n\
                 primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={STANDBY}'\n",
                pair.ports[1],
                link(pair.ports[0]),
            ),
        )?;
        pair.pg_ctl(1, "start")?;
        let state = if synchronous { "sync" } else { "async" };
        let streaming = pair.wait_for(Duration::from_secs(60), || {
            pair.psql(
                0,
                "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
            )
            .is_ok_and(|out| out.trim() == state)
        });
        if !streaming {
            return Err(io::Error::other(format!(
                "the standby is not streaming ({state}) after 60 s"
            )));
        }
        Ok(pair)
    }

    /// The data directory of server `i` (0: the first primary, 1: the standby).
    fn data(&self, i: usize) -> PathBuf {
        self.dir.join(["primary", "standby"][i])
    }

    /// Runs one of the install's programs, as `postgres` when this process is root.
    fn run(&self, program: &str, args: &[&str]) -> io::Result<Output> {
        let program = self.bin.join(program);
        let out = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&program)
                .args(args)
                .output()
        } else {
            Command::new(&program).args(args).output()
        };
        check(&program.display().to_string(), out)
    }

    /// Appends `text` to `file` (created when missing; owned as the servers' files).
    fn append(&self, file: &Path, text: &str) -> io::Result<()> {
        use std::io::Write;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)?
            .write_all(text.as_bytes())?;
        if is_root() {
            check(
                "chown",
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(file)
                    .output(),
            )?;
        }
        Ok(())
    }

    fn pg_ctl(&self, i: usize, action: &str) -> io::Result<Output> {
        let log = self.dir.join(format!("{}.log", ["primary", "standby"][i]));
        self.run(
            "pg_ctl",
            &[
                "-D",
                path(&self.data(i)),
                "-l",
                path(&log),
                "-w",
                "-t",
                "60",
                action,
            ],
        )
    }

    /// One query's unaligned output on server `i`.
    pub fn psql(&self, i: usize, sql: &str) -> io::Result<String> {
        let out = check(
            "psql",
            Command::new(self.bin.join("psql"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                    "-d",
                    "postgres",
                    "-AtX",
                    "-p",
                ])
                .arg(self.ports[i].to_string())
                .args(["-c", sql])
                .env("PGCONNECT_TIMEOUT", "2")
                .output(),
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn wait_for(&self, within: Duration, mut ready: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if ready() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Whether the primary waits for the standby at every commit.
    pub fn synchronous(&self) -> bool {
        self.synchronous
    }

    /// The URL of server `i` alone (0: the first primary, 1: the standby), database
    /// `postgres`.
    pub fn node_url(&self, i: usize) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=2",
            self.ports[i]
        )
    }

    /// The multi-host URL a store uses: both servers, the read-write one chosen.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
            self.ports[0], self.ports[1]
        )
    }

    /// `kill -9` of the primary's postmaster and every process it started, at once:
    /// nothing of the primary answers afterwards.
    pub fn kill_primary(&mut self) -> io::Result<()> {
        let pid_file = std::fs::read_to_string(self.data(0).join("postmaster.pid"))?;
        let pid = pid_file
            .lines()
            .next()
            .ok_or_else(|| io::Error::other("an empty postmaster.pid"))?
            .trim()
            .to_owned();
        let children = Command::new("pgrep").args(["-P", &pid]).output()?;
        let mut victims = vec![pid.clone()];
        victims.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_owned),
        );
        check(
            "kill -9",
            Command::new("kill").arg("-9").args(&victims).output(),
        )?;
        self.primary_killed = true;
        // Gone when its port refuses connections.
        let port = self.ports[0];
        let gone = self.wait_for(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        });
        if gone {
            Ok(())
        } else {
            Err(io::Error::other("the primary still answers after kill -9"))
        }
    }

    /// Promotes the standby and waits until it takes writes.
    pub fn promote(&self) -> io::Result<()> {
        self.pg_ctl(1, "promote")?;
        let writable = self.wait_for(Duration::from_secs(30), || {
            self.psql(1, "SELECT pg_is_in_recovery()")
                .is_ok_and(|out| out.trim() == "f")
        });
        if writable {
            Ok(())
        } else {
            Err(io::Error::other(
                "the standby does not take writes 30 s after promote",
            ))
        }
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        for i in [1, 0] {
            if i == 0 && self.primary_killed {
                continue;
            }
            let _ = self.run(
                "pg_ctl",
                &["-D", path(&self.data(i)), "-m", "immediate", "stop"],
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}
