//! A `hypoll serve` child for a test: on a free port, with its metrics on another, its
//! stderr collected, and killed when the test ends, passed or failed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `hypoll serve`, killed when dropped.
pub struct Serve {
    child: Child,
    pub port: u16,
    pub metrics_port: u16,
    /// With `--nvme-tcp`: its port and the subsystem's NQN, as the server printed them.
    pub nvme: Option<(u16, String)>,
    /// vhost-user-blk sockets it said it listens on.
    pub vhost_sockets: usize,
    stderr: mpsc::Receiver<String>,
}

impl Serve {
    /// A server of `exports` (each an `--export` spec) on a free loopback port.
    pub fn start(exports: &[&str]) -> Serve {
        Serve::start_with(exports, &[])
    }

    /// A server of `exports`, with `extra` flags after them.
    pub fn start_with(exports: &[&str], extra: &[&str]) -> Serve {
        Serve::spawn(Serve::command("127.0.0.1:0", exports, extra))
    }

    /// The command line of a server listening on `listen` (a free port) with its metrics
    /// on a free port of the loopback: for a test that changes how it is run.
    pub fn command(listen: &str, exports: &[&str], extra: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hypoll"));
        cmd.args(["serve", "--listen", listen, "--metrics", "127.0.0.1:0"]);
        for e in exports {
            cmd.args(["--export", e]);
        }
        cmd.args(extra);
        cmd
    }

    /// Runs `cmd` (from [`Serve::command`]) and waits until it listens.
    pub fn spawn(cmd: Command) -> Serve {
        Serve::spawn_until(cmd, |s| s.port != 0 && s.metrics_port != 0)
    }

    /// Runs `cmd`, a server of vhost-user-blk sockets without NBD (no `--listen`, no
    /// `--metrics`), and waits until it has said where each of its `sockets` is.
    #[allow(dead_code)] // Not every test binary serves vhost-user-blk alone.
    pub fn spawn_vhost_only(cmd: Command, sockets: usize) -> Serve {
        Serve::spawn_until(cmd, |s| s.vhost_sockets == sockets)
    }

    /// Runs `cmd` and reads its announcements until `ready` holds.
    fn spawn_until(mut cmd: Command, ready: impl Fn(&Serve) -> bool) -> Serve {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hypoll starts");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = etx.send(line);
            }
        });
        let mut serve = Serve {
            child,
            port: 0,
            metrics_port: 0,
            nvme: None,
            vhost_sockets: 0,
            stderr: erx,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while !ready(&serve) {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "hypoll serve did not start listening; stderr:\n{}",
                    serve.stderr_text()
                )
            });
            let port = |l: &str| -> u16 {
                l.rsplit(':')
                    .next()
                    .unwrap()
                    .trim_end_matches("/metrics")
                    .parse()
                    .unwrap()
            };
            if let Some(rest) = line.strip_prefix("nvme-tcp listening on ") {
                let (addr, nqn) = rest
                    .split_once(", subsystem ")
                    .expect("ADDR, subsystem NQN");
                serve.nvme = Some((port(addr), nqn.to_string()));
            } else if let Some(addr) = line.strip_prefix("listening on ") {
                serve.port = port(addr);
            } else if let Some(addr) = line.strip_prefix("metrics on ") {
                serve.metrics_port = port(addr);
            } else if line.starts_with("vhost-user-blk ") {
                serve.vhost_sockets += 1;
            }
        }
        serve
    }

    /// The server's process id, to read its memory and CPU from /proc.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time (user + system) the server has used so far, from /proc.
    pub fn cpu_ns(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        // Fields after the command name (which may hold spaces) start after its ')'.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // SAFETY: sysconf takes no pointers.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        ticks * 1_000_000_000 / hz
    }

    /// Waits 2 s with the clients connected and idle (`what` says how), and asserts the
    /// server used under 5 % of a core meanwhile: its reactors park rather than spin.
    pub fn assert_idle_parks(&self, what: &str) {
        let before = self.cpu_ns();
        let idle = Duration::from_secs(2);
        std::thread::sleep(idle);
        let used = self.cpu_ns() - before;
        eprintln!("idle, {what}: {used} ns of CPU in {idle:?}");
        assert!(
            used < idle.as_nanos() as u64 / 20,
            "an idle server ({what}) used {used} ns of CPU in {idle:?}"
        );
    }

    /// An `nbd://` URI of `export` on this server.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    /// Stderr lines written since the last call.
    pub fn stderr_text(&self) -> String {
        let mut s = String::new();
        while let Ok(line) = self.stderr.try_recv() {
            s.push_str(&line);
            s.push('\n');
        }
        s
    }

    /// Stderr until it contains `what`, or `within` passes.
    pub fn log_until(&self, what: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut log = String::new();
        while !log.contains(what) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            log.push_str(&self.stderr_text());
        }
        log
    }

    /// One scrape of the metrics endpoint, which must answer 200.
    pub fn metrics(&self) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        text
    }

    /// Sends `signal` and waits (bounded) for the exit; returns the status and stderr.
    pub fn signal_and_wait(mut self, signal: libc::c_int) -> (ExitStatus, String) {
        // SAFETY: kill on our own child's pid, which has not been reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                return (status, self.stderr_text());
            }
            assert!(Instant::now() < deadline, "hypoll serve did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of one metric line, as a number.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The first core this process may run on, as `--cores` takes it: one reactor.
pub fn one_core() -> String {
    hypoll_reactor::allowed_cores().unwrap()[0].to_string()
}

/// The first two cores this process may run on, or its only one, as `--cores` takes them:
/// two reactors where the machine has two cores.
pub fn two_cores() -> String {
    let cores = hypoll_reactor::allowed_cores().unwrap();
    if cores.len() >= 2 {
        format!("{},{}", cores[0], cores[1])
    } else {
        cores[0].to_string()
    }
}
