//! A RabbitMQ cluster of a test's own, on loopback: nodes started from the machine's
//! RabbitMQ install beside the shared node, never touching it.
//!
//! Each node has its own name (`rbt-<unique>-<i>@localhost`), AMQP and distribution
//! ports (free ones, picked when it starts), data, log and plugin files, an empty env
//! file in place of the shared `/etc/rabbitmq/rabbitmq-env.conf` (which names the
//! shared node), a config file of its own and an Erlang cookie of its own (the
//! `.erlang.cookie` of a `HOME` of its own), all under one temporary directory. The
//! server is `/usr/lib/rabbitmq/bin/rabbitmq-server` run directly (Debian's wrapper
//! in `/usr/sbin` switches to the shared node's user and home), as the `rabbitmq`
//! user when the test runs as root (the directory is then owned by it). epmd is the
//! machine's, shared, and never stopped. Dropping the cluster kills its nodes and
//! deletes the directory.
//!
//! Running one by hand (what [`RabbitCluster::start`] does for each node):
//!
//! ```text
//! D=/tmp/rbt-1; mkdir -p $D/home $D/mnesia $D/log; : > $D/env.conf
//! echo '[].' > $D/enabled_plugins; echo 'loopback_users = none' > $D/rabbitmq.conf
//! printf mycookie > $D/home/.erlang.cookie; chmod 400 $D/home/.erlang.cookie
//! chown -R rabbitmq: $D
//! runuser -u rabbitmq -- env HOME=$D/home RABBITMQ_NODENAME=rbt-1@localhost \
//!   RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=5801 RABBITMQ_DIST_PORT=25801 \
//!   RABBITMQ_MNESIA_BASE=$D/mnesia RABBITMQ_LOG_BASE=$D/log \
//!   RABBITMQ_ENABLED_PLUGINS_FILE=$D/enabled_plugins RABBITMQ_PID_FILE=$D/pid \
//!   RABBITMQ_CONF_ENV_FILE=$D/env.conf RABBITMQ_CONFIG_FILE=$D/rabbitmq.conf \
//!   /usr/lib/rabbitmq/bin/rabbitmq-server &
//! runuser -u rabbitmq -- env HOME=$D/home rabbitmqctl -n rbt-1@localhost await_startup
//! ```
//!
//! and for the second and third node, with their own directory, name and ports (and
//! the same cookie): `rabbitmqctl -n rbt-2@localhost stop_app`, `join_cluster
//! rbt-1@localhost`, `start_app`.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// The RabbitMQ install's own scripts (not Debian's wrappers).
const BIN: &str = "/usr/lib/rabbitmq/bin";

/// One node of the cluster.
struct Node {
    name: String,
    port: u16,
    dist_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A cluster of nodes of the test's own (see the [module](self)).
pub struct RabbitCluster {
    dir: PathBuf,
    home: PathBuf,
    nodes: Vec<Node>,
}

/// A port free on loopback now.
fn free_port() -> io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Whether this process runs as root (the nodes then run as `rabbitmq`).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Whether the RabbitMQ install this harness needs is on the machine.
pub fn available() -> bool {
    Path::new(BIN).join("rabbitmq-server").exists()
}

impl RabbitCluster {
    /// Starts `n` nodes and joins them into one cluster (about 15 s a node, started
    /// together). Errors name the node and the step that failed.
    pub fn start(n: usize) -> io::Result<Self> {
        assert!(n >= 1, "a cluster of no node");
        let tag = crate::unique_name("rbt").replace('_', "-");
        let dir = std::env::temp_dir().join(&tag);
        let home = dir.join("home");
        std::fs::create_dir_all(&home)?;
        let cookie = home.join(".erlang.cookie");
        std::fs::write(&cookie, tag.to_uppercase().replace('-', "X"))?;
        let mut nodes = Vec::with_capacity(n);
        for i in 1..=n {
            let node_dir = dir.join(format!("n{i}"));
            std::fs::create_dir_all(node_dir.join("mnesia"))?;
            std::fs::create_dir_all(node_dir.join("log"))?;
            std::fs::write(node_dir.join("env.conf"), "")?;
            std::fs::write(node_dir.join("enabled_plugins"), "[].\n")?;
            std::fs::write(node_dir.join("rabbitmq.conf"), "loopback_users = none\n")?;
            nodes.push(Node {
                name: format!("{tag}-{i}@localhost"),
                port: free_port()?,
                dist_port: free_port()?,
                dir: node_dir,
                child: None,
            });
        }
        if is_root() {
            let chown = Command::new("chown")
                .args(["-R", "rabbitmq:rabbitmq"])
                .arg(&dir)
                .status()?;
            if !chown.success() {
                return Err(io::Error::other("chown of the cluster's directory failed"));
            }
        }
        set_cookie_mode(&cookie)?;
        let mut cluster = Self { dir, home, nodes };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        for i in 0..n {
            cluster.await_startup(i)?;
        }
        let first = cluster.nodes[0].name.clone();
        for i in 1..n {
            cluster.ctl_ok(i, &["stop_app"])?;
            cluster.ctl_ok(i, &["join_cluster", &first])?;
            cluster.ctl_ok(i, &["start_app"])?;
        }
        for i in 0..n {
            cluster.await_startup(i)?;
        }
        Ok(cluster)
    }

    /// How many nodes it has.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Each node's AMQP URL (user guest), in node order.
    pub fn urls(&self) -> Vec<String> {
        (self.nodes.iter())
            .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.port))
            .collect()
    }

    /// Every node's URL in one setting, as the consumer and the relay take it.
    pub fn url_list(&self) -> String {
        self.urls().join(" ")
    }

    /// The node name of node `i` (`rbt-...-<i+1>@localhost`).
    pub fn node_name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// Kills node `i` with SIGKILL (its Erlang VM, by its pid file), as a crash.
    pub fn kill_node(&mut self, i: usize) -> io::Result<()> {
        let pid = std::fs::read_to_string(self.nodes[i].dir.join("pid"))?;
        let killed = Command::new("kill").args(["-9", pid.trim()]).status()?;
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if killed.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill -9 {} failed", pid.trim())))
        }
    }

    /// Stops node `i` politely (`rabbitmqctl stop`).
    pub fn stop_node(&mut self, i: usize) -> io::Result<()> {
        self.ctl_ok(i, &["stop"])?;
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.wait();
        }
        Ok(())
    }

    /// Starts node `i` again (after [`kill_node`](Self::kill_node) or
    /// [`stop_node`](Self::stop_node)) and waits until it runs.
    pub fn restart_node(&mut self, i: usize) -> io::Result<()> {
        self.spawn(i)?;
        self.await_startup(i)
    }

    /// The index of the node leading the quorum queue `queue`, asked of any live
    /// node; `None` while it has none or no node answers.
    pub fn leader_of(&self, queue: &str) -> Option<usize> {
        for i in 0..self.nodes.len() {
            let Ok(out) = self.ctl(
                i,
                &["list_queues", "name", "leader", "--no-table-headers", "-q"],
            ) else {
                continue;
            };
            if !out.status.success() {
                continue;
            }
            let text = String::from_utf8_lossy(&out.stdout);
            return text.lines().find_map(|line| {
                let mut cols = line.split('\t');
                (cols.next()? == queue).then_some(())?;
                let leader = cols.next()?.trim();
                self.nodes.iter().position(|n| n.name == leader)
            });
        }
        None
    }

    /// Runs `rabbitmqctl -n <node i> args` with the cluster's cookie.
    pub fn ctl(&self, i: usize, args: &[&str]) -> io::Result<Output> {
        let mut cmd = self.as_node_user(&Path::new(BIN).join("rabbitmqctl"));
        cmd.args(["-n", &self.nodes[i].name]).args(args);
        cmd.stdin(Stdio::null()).output()
    }

    fn ctl_ok(&self, i: usize, args: &[&str]) -> io::Result<()> {
        let out = self.ctl(i, args)?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "rabbitmqctl -n {} {}: {}{}",
                self.nodes[i].name,
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    /// Waits until node `i` runs: `await_startup`, tried again while the node has
    /// not registered with epmd yet (it then answers "not running" at once).
    fn await_startup(&self, i: usize) -> io::Result<()> {
        let deadline = std::time::Instant::now() + CLUSTER_WAIT;
        loop {
            match self.ctl_ok(i, &["await_startup", "--timeout", "120"]) {
                Ok(()) => return Ok(()),
                Err(_) if std::time::Instant::now() < deadline && self.running(i) => {
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(err) => {
                    let log = std::fs::read_to_string(self.nodes[i].dir.join("server.out"))
                        .unwrap_or_default();
                    return Err(io::Error::other(format!("{err}\nserver output:\n{log}")));
                }
            }
        }
    }

    /// Whether node `i`'s server process is still alive.
    fn running(&self, i: usize) -> bool {
        // `try_wait` needs `&mut`; a process that exited leaves a status to read.
        let pid = self.nodes[i].child.as_ref().map(Child::id);
        pid.is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists() && !zombie(pid))
    }

    /// A command run as the nodes' user, with the cluster's `HOME` (its cookie).
    fn as_node_user(&self, program: &Path) -> Command {
        let mut cmd = if is_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "rabbitmq", "--", "env"]);
            cmd.arg(format!("HOME={}", self.home.display()));
            cmd.arg(program);
            cmd
        } else {
            let mut cmd = Command::new(program);
            cmd.env("HOME", &self.home);
            cmd
        };
        cmd.env("HOME", &self.home);
        cmd
    }

    fn spawn(&mut self, i: usize) -> io::Result<()> {
        let node = &self.nodes[i];
        let d = |name: &str| node.dir.join(name).display().to_string();
        let env = [
            ("RABBITMQ_NODENAME", node.name.clone()),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".to_owned()),
            ("RABBITMQ_NODE_PORT", node.port.to_string()),
            ("RABBITMQ_DIST_PORT", node.dist_port.to_string()),
            ("RABBITMQ_MNESIA_BASE", d("mnesia")),
            ("RABBITMQ_LOG_BASE", d("log")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins")),
            ("RABBITMQ_PID_FILE", d("pid")),
            ("RABBITMQ_CONF_ENV_FILE", d("env.conf")),
            ("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf")),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".to_owned()),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}".to_owned(),
            ),
        ];
        let mut cmd = self.as_node_user(&Path::new(BIN).join("rabbitmq-server"));
        if is_root() {
            // `env` of runuser's command line: the variables must be its arguments.
            let program = cmd.get_args().last().map(ToOwned::to_owned);
            let mut with_env = Command::new("runuser");
            with_env.args(["-u", "rabbitmq", "--", "env"]);
            with_env.arg(format!("HOME={}", self.home.display()));
            for (key, value) in &env {
                with_env.arg(format!("{key}={value}"));
            }
            with_env.arg(program.unwrap_or_default());
            cmd = with_env;
        } else {
            cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        }
        let log = std::fs::File::create(node.dir.join("server.out"))?;
        let child = cmd
            .current_dir(&node.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.nodes[i].child = Some(child);
        Ok(())
    }
}

/// Whether process `pid` has exited and waits to be reaped.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

#[cfg(unix)]
fn set_cookie_mode(cookie: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(cookie, std::fs::Permissions::from_mode(0o400))
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_some() {
                let _ = self.kill_node(i);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How long a test waits for a cluster condition, polling.
pub const CLUSTER_WAIT: Duration = Duration::from_secs(120);
