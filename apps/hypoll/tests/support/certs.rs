//! Certificate folders made with openssl for the TLS tests: a CA, the server's certificate,
//! clients' certificates of that CA, and a client of another CA.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::require_tool;

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
