//! What the TLS and read-only tests share: a `hypoll serve` on a free port, client tools
//! run under a timeout, a raw NBD client's reads, and a certificate folder made with
//! openssl (a CA, the server's certificate, a client's, and a client of another CA).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hypoll_nbd::proto::*;

/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long any one client command may run.
pub const CLIENT_TIMEOUT_S: &str = "120";

/// A running `hypoll serve`, killed when dropped.
pub struct Serve {
    child: Child,
    pub port: u16,
    stderr: mpsc::Receiver<String>,
}

impl Serve {
    /// Starts `hypoll serve` on a free loopback port with `args`, and waits until it
    /// listens.
    pub fn start(args: &[&str]) -> Serve {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hypoll"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
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
            stderr: erx,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while serve.port == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "hypoll serve did not start listening; stderr:\n{}",
                    serve.stderr_text()
                )
            });
            if let Some(addr) = line.strip_prefix("listening on ") {
                serve.port = addr.rsplit(':').next().unwrap().parse().unwrap();
            }
        }
        serve
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

    /// Stderr until it contains `what` (or 10 s pass).
    pub fn log_until(&self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut log = String::new();
        while !log.contains(what) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            log.push_str(&self.stderr_text());
        }
        log
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fails the test, naming the package, when `tool` is missing: `scripts/test` installs
/// every tool these tests use, so a missing one is a broken setup, never a pass.
pub fn require_tool(tool: &str) {
    let which = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .unwrap();
    assert!(
        which.status.success(),
        "{tool} is not installed: scripts/test installs it (apt: qemu-utils, libnbd-bin, \
         openssl)"
    );
}

/// Runs a client tool under a timeout.
pub fn run(tool: &str, args: &[&str]) -> Output {
    require_tool(tool);
    Command::new("timeout")
        .arg(CLIENT_TIMEOUT_S)
        .arg(tool)
        .args(args)
        .output()
        .unwrap()
}

/// Runs a client tool; panics with its output unless it succeeds.
pub fn run_ok(tool: &str, args: &[&str]) -> Output {
    let out = run(tool, args);
    assert!(
        out.status.success(),
        "{tool} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a client tool that must fail; returns its stderr.
pub fn run_fails(tool: &str, args: &[&str]) -> String {
    let out = run(tool, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{tool} {args:?} succeeded but must not:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_ne!(out.status.code(), Some(124), "{tool} {args:?} timed out");
    stderr
}

/// Reads one option reply: (option, reply type, data).
pub fn option_reply(c: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u64::from_be_bytes(h[..8].try_into().unwrap()),
        OPT_REPLY_MAGIC
    );
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut data = vec![0u8; len];
    c.read_exact(&mut data).unwrap();
    (
        u32::from_be_bytes(h[8..12].try_into().unwrap()),
        u32::from_be_bytes(h[12..16].try_into().unwrap()),
        data,
    )
}

/// Reads one simple reply header: (cookie, error).
pub fn simple_reply(c: &mut impl Read) -> (u64, u32) {
    let mut h = [0u8; REPLY_HEADER_BYTES];
    c.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
    )
}

/// A raw client connected and past the greeting.
pub fn connect(port: u16) -> TcpStream {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; GREETING_BYTES];
    c.read_exact(&mut greeting).unwrap();
    c
}

/// Everything the server sends until it closes (bounded by the read timeout).
pub fn read_to_close(c: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return all,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
}

/// Certificate folders laid out as nbdkit, qemu and libnbd expect them.
pub struct Certs {
    /// The server's: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    pub server: PathBuf,
    /// A client's, signed by the server's CA: `ca-cert.pem`, `client-cert.pem`,
    /// `client-key.pem`; its certificate names `alice.test`.
    pub client: PathBuf,
    /// Another client of the server's CA, whose certificate names `bob.test`.
    pub bob: PathBuf,
    /// The CA only: a client that verifies the server but has no certificate.
    pub no_cert: PathBuf,
    /// A client whose certificate another CA signed, trusting the server's CA.
    pub rogue: PathBuf,
    /// The same rogue client as qemu wants it: its own CA beside its certificate (qemu
    /// checks its certificate against the folder's CA, so it is run with verify-peer=no).
    pub rogue_own_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}-cert.pem"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate for `cn` signed by CA `ca`, for `usage` (serverAuth, clientAuth).
fn leaf(dir: &Path, ca: &str, name: &str, cn: &str, usage: &str, san: &str) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    let ext = format!(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,\
         keyEncipherment\nextendedKeyUsage={usage}\nsubjectKeyIdentifier=hash\n\
         authorityKeyIdentifier=keyid\n{san}\n"
    );
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}-cert.pem"),
            "-CAkey",
            &format!("{ca}-key.pem"),
            "-CAcreateserial",
            "-out",
            &format!("{name}-cert.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

fn folder(dir: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir(&to).unwrap();
    for (from, as_name) in files {
        std::fs::copy(dir.join(from), to.join(as_name)).unwrap();
    }
    to
}

impl Certs {
    /// Makes two CAs and the certificates of every folder under `dir`.
    pub fn make(dir: &Path) -> Certs {
        require_tool("openssl");
        ca(dir, "ca");
        ca(dir, "rogue-ca");
        let san = "subjectAltName=DNS:localhost,IP:127.0.0.1";
        leaf(dir, "ca", "server", "localhost", "serverAuth", san);
        leaf(
            dir,
            "ca",
            "client",
            "alice",
            "clientAuth",
            "subjectAltName=DNS:alice.test",
        );
        leaf(
            dir,
            "ca",
            "bob",
            "bob",
            "clientAuth",
            "subjectAltName=DNS:bob.test",
        );
        leaf(
            dir,
            "rogue-ca",
            "rogue",
            "mallory",
            "clientAuth",
            "subjectAltName=DNS:alice.test",
        );
        Certs {
            server: folder(
                dir,
                "server",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("server-cert.pem", "server-cert.pem"),
                    ("server-key.pem", "server-key.pem"),
                ],
            ),
            client: folder(
                dir,
                "client",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("client-cert.pem", "client-cert.pem"),
                    ("client-key.pem", "client-key.pem"),
                ],
            ),
            bob: folder(
                dir,
                "bob",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("bob-cert.pem", "client-cert.pem"),
                    ("bob-key.pem", "client-key.pem"),
                ],
            ),
            no_cert: folder(dir, "no-cert", &[("ca-cert.pem", "ca-cert.pem")]),
            rogue: folder(
                dir,
                "rogue",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("rogue-cert.pem", "client-cert.pem"),
                    ("rogue-key.pem", "client-key.pem"),
                ],
            ),
            rogue_own_ca: folder(
                dir,
                "rogue-own-ca",
                &[
                    ("rogue-ca-cert.pem", "ca-cert.pem"),
                    ("rogue-cert.pem", "client-cert.pem"),
                    ("rogue-key.pem", "client-key.pem"),
                ],
            ),
        }
    }
}
