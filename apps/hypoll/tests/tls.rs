//! `hypoll serve --tls require --tls-verify-peer` with certificates made for the test
//! (openssl): real clients (nbdinfo, nbdcopy, qemu-io, qemu-img; `scripts/test` installs
//! them) read and write over TLS with a client certificate; a client without one, with one
//! from another CA, or without TLS is refused; bytes sent in plaintext after STARTTLS are
//! never taken as if they came under TLS; an export restricted to named clients serves
//! them alone.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nbd::client;
use hypoll_nbd::proto::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use support::certs::Certs;
use support::nbd::{connect, option_reply, read_to_close, simple_reply};
use support::serve::Serve;
use support::{random_file, run_fails, run_ok};

/// A server that requires TLS and a client certificate of its CA.
fn serve_tls(certs: &Certs, extra: &[&str]) -> Serve {
    let dir = certs.server.to_str().unwrap();
    let mut args = vec![
        "--tls",
        "require",
        "--tls-certificates",
        dir,
        "--tls-verify-peer",
    ];
    args.extend_from_slice(extra);
    Serve::start_with(&["mem=emu:dram,size=64M"], &args)
}

fn nbds_uri(s: &Serve, export: &str, certs_dir: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{}/{export}?tls-certificates={}",
        s.port,
        certs_dir.display()
    )
}

/// qemu's `--object` for a client's certificate folder.
fn qemu_creds(dir: &Path, verify_peer: bool) -> String {
    format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={},verify-peer={}",
        dir.display(),
        if verify_peer { "yes" } else { "no" }
    )
}

/// qemu's image options for an export over TLS.
fn qemu_image(s: &Serve, export: &str) -> String {
    format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export={export},\
         tls-creds=tls0",
        s.port
    )
}

#[test]
fn nbdinfo_and_nbdcopy_read_and_write_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(&certs, &[]);
    let uri = nbds_uri(&s, "mem", &certs.client);
    let info = run_ok("nbdinfo", &[&uri]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains("with TLS"), "{text}");
    assert!(text.contains("export-size: 67108864"), "{text}");

    let data = dir.path().join("data.img");
    let back = dir.path().join("back.img");
    random_file(&data, 8 << 20, 7);
    run_ok("nbdcopy", &[data.to_str().unwrap(), &uri]);
    run_ok("nbdcopy", &[&uri, back.to_str().unwrap()]);
    let back = std::fs::read(&back).unwrap();
    assert_eq!(back.len(), 64 << 20);
    assert!(
        back[..8 << 20] == std::fs::read(&data).unwrap()[..],
        "data differs"
    );
    assert!(back[8 << 20..].iter().all(|&b| b == 0));
}

#[test]
fn qemu_io_and_qemu_img_read_and_write_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(&certs, &[]);
    let creds = qemu_creds(&certs.client, true);
    let image = qemu_image(&s, "mem");
    let out = run_ok(
        "qemu-io",
        &[
            "--object",
            &creds,
            "--image-opts",
            &image,
            "-c",
            "write -P 0xab 1M 1M",
            "-c",
            "read -P 0xab 1M 1M",
            "-c",
            "read -P 0 0 1M",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Pattern verification failed"), "{text}");

    let data = dir.path().join("data.img");
    random_file(&data, 4 << 20, 11);
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "--object",
            &creds,
            "-f",
            "raw",
            data.to_str().unwrap(),
            "--target-image-opts",
            &image,
        ],
    );
    // Compared over TLS against the file: the export's first 4 MiB are the file's.
    let local = format!(
        "driver=raw,file.driver=file,file.filename={}",
        data.display()
    );
    let remote = format!(
        "driver=raw,size={},file.{}",
        4 << 20,
        image.replace(',', ",file.")
    );
    run_ok(
        "qemu-img",
        &[
            "compare",
            "--object",
            &creds,
            "--image-opts",
            &remote,
            &local,
        ],
    );
}

#[test]
fn clients_without_a_certificate_with_another_cas_or_without_tls_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(&certs, &[]);
    // libnbd: no certificate, a certificate of another CA, no TLS at all.
    for folder in [&certs.no_cert, &certs.rogue] {
        run_fails("nbdinfo", &[&nbds_uri(&s, "mem", folder)]);
    }
    let plain = run_fails("nbdinfo", &[&format!("nbd://127.0.0.1:{}/mem", s.port)]);
    assert!(!plain.contains("export-size"), "{plain}");
    // qemu: no certificate; its own CA's certificate (it checks that against its folder's
    // CA, so it does not verify the server here, which changes nothing for the server).
    run_fails(
        "qemu-io",
        &[
            "--object",
            &qemu_creds(&certs.no_cert, true),
            "--image-opts",
            &qemu_image(&s, "mem"),
            "-c",
            "read 0 4k",
        ],
    );
    run_fails(
        "qemu-io",
        &[
            "--object",
            &qemu_creds(&certs.rogue_own_ca, false),
            "--image-opts",
            &qemu_image(&s, "mem"),
            "-c",
            "write -P 0xee 0 4k",
        ],
    );
    // gnutls clients send no certificate the server's CA did not sign; this client sends
    // its other CA's certificate whatever the server asks, so it is the verification that
    // refuses it.
    let mut rogue = starttls(s.port, client_config(&certs, &certs.rogue));
    let refused = rogue
        .write_all(&client::info_or_go(OPT_GO, "mem", &[]))
        .and_then(|()| rogue.read(&mut [0u8; 1]));
    assert!(matches!(refused, Ok(0) | Err(_)), "{refused:?}");
    let log = s.log_until("UnknownIssuer", Duration::from_secs(10));
    assert!(log.contains("UnknownIssuer"), "{log}");
    // Nothing the refused clients tried reached the export, and it still serves.
    let out = run_ok(
        "qemu-io",
        &[
            "--object",
            &qemu_creds(&certs.client, true),
            "--image-opts",
            &qemu_image(&s, "mem"),
            "-c",
            "read -P 0 0 4k",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

/// A rustls client presenting the certificate of `folder`, trusting the server's CA.
fn client_config(certs: &Certs, folder: &Path) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(certs.client.join("ca-cert.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let chain = CertificateDer::pem_file_iter(folder.join("client-cert.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(folder.join("client-key.pem")).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    Arc::new(config)
}

type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A raw client through STARTTLS; the TLS handshake runs on its first read or write.
fn starttls(port: u16, config: Arc<rustls::ClientConfig>) -> TlsStream {
    let mut c = connect(port);
    c.write_all(&client::client_flags(
        FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES,
    ))
    .unwrap();
    c.write_all(&client::option(OPT_STARTTLS, &[])).unwrap();
    assert_eq!(option_reply(&mut c), (OPT_STARTTLS, REP_ACK, vec![]));
    let name = "localhost".try_into().unwrap();
    rustls::StreamOwned::new(rustls::ClientConnection::new(config, name).unwrap(), c)
}

/// GO on `export` over `c`, through to its ACK.
fn go(c: &mut TlsStream, export: &str) {
    c.write_all(&client::info_or_go(OPT_GO, export, &[]))
        .unwrap();
    loop {
        let (_, reply, data) = option_reply(c);
        assert_eq!(
            reply & (1 << 31),
            0,
            "{reply:#x}: {:?}",
            String::from_utf8_lossy(&data)
        );
        if reply == REP_ACK {
            return;
        }
    }
}

fn pattern(i: u64, at: usize) -> u8 {
    (i as u8).wrapping_mul(31) ^ (at as u8)
}

/// A client that sends many writes without waiting, past a small connection byte bound,
/// gets every reply and reads its data back: decrypted input the server holds while the
/// bound stops it is served once the bound allows, with no new packet to announce it.
#[test]
fn a_pipelining_client_over_tls_gets_every_reply_and_its_data_back() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(&certs, &["--max-connection-bytes", "64K"]);
    let mut c = starttls(s.port, client_config(&certs, &certs.client));
    go(&mut c, "mem");
    const COUNT: u64 = 64;
    const LEN: usize = 16 << 10;
    let mut writes = Vec::new();
    for i in 0..COUNT {
        let offset = i * LEN as u64;
        writes.extend(client::request(CMD_WRITE, 0, i, offset, LEN as u32));
        writes.extend((0..LEN).map(|at| pattern(i, at)));
    }
    c.write_all(&writes).unwrap();
    c.flush().unwrap();
    c.sock
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answered: Vec<u64> = (0..COUNT)
        .map(|_| simple_reply(&mut c))
        .map(|(cookie, error)| {
            assert_eq!(error, 0, "write {cookie}");
            cookie
        })
        .collect();
    answered.sort_unstable();
    assert_eq!(answered, (0..COUNT).collect::<Vec<_>>());
    // Every write answered: the reads, pipelined too, must see them.
    let mut reads = Vec::new();
    for i in 0..COUNT {
        reads.extend(client::request(CMD_READ, 0, i, i * LEN as u64, LEN as u32));
    }
    c.write_all(&reads).unwrap();
    c.flush().unwrap();
    for _ in 0..COUNT {
        let (i, error) = simple_reply(&mut c);
        assert_eq!(error, 0, "read {i}");
        let mut data = vec![0u8; LEN];
        c.read_exact(&mut data).unwrap();
        let good = data.iter().enumerate().all(|(at, &b)| b == pattern(i, at));
        assert!(good, "read {i} returned other data");
    }
}

#[test]
fn bytes_sent_in_plaintext_after_starttls_are_never_taken_as_if_under_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(&certs, &[]);

    // Before TLS, an option other than STARTTLS and ABORT gets TLS_REQD and nothing else.
    let mut c = connect(s.port);
    c.write_all(&client::client_flags(FLAG_C_FIXED_NEWSTYLE))
        .unwrap();
    c.write_all(&client::option(OPT_LIST, &[])).unwrap();
    let (option, reply, _) = option_reply(&mut c);
    assert_eq!((option, reply), (OPT_LIST, REP_ERR_TLS_REQD));

    // In the same packet as STARTTLS: found unparsed when TLS would start.
    let mut c = connect(s.port);
    let mut msg = client::client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    msg.extend(client::option(OPT_STARTTLS, &[]));
    msg.extend(client::info_or_go(OPT_GO, "mem", &[]));
    c.write_all(&msg).unwrap();
    assert_eq!(option_reply(&mut c), (OPT_STARTTLS, REP_ACK, vec![]));
    let rest = read_to_close(&mut c);
    assert!(rest.is_empty(), "{rest:?}");
    let log = s.log_until(
        "in plaintext after the request to start TLS",
        Duration::from_secs(10),
    );
    assert!(
        log.contains("in plaintext after the request to start TLS"),
        "{log}"
    );

    // Sent after the server took STARTTLS: read as TLS, which it is not, so refused by
    // TLS (an alert at most), never answered as an option.
    let mut c = connect(s.port);
    let mut msg = client::client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    msg.extend(client::option(OPT_STARTTLS, &[]));
    c.write_all(&msg).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    c.write_all(&client::info_or_go(OPT_GO, "mem", &[]))
        .unwrap();
    assert_eq!(option_reply(&mut c), (OPT_STARTTLS, REP_ACK, vec![]));
    let rest = read_to_close(&mut c);
    const TLS_ALERT: u8 = 21;
    assert!(rest.is_empty() || rest[0] == TLS_ALERT, "{rest:?}");
    let magic = OPT_REPLY_MAGIC.to_be_bytes();
    assert!(
        !rest.windows(8).any(|w| w == magic),
        "an option reply: {rest:?}"
    );
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients_alike() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let server = certs.server.to_str().unwrap();
    let s = Serve::start_with(
        &["mem=emu:dram,size=16M"],
        &["--tls", "on", "--tls-certificates", server],
    );
    let plain = run_ok("nbdinfo", &[&format!("nbd://127.0.0.1:{}/mem", s.port)]);
    assert!(String::from_utf8_lossy(&plain.stdout).contains("without TLS"));
    // No client certificate is asked for without --tls-verify-peer.
    let tls = run_ok("nbdinfo", &[&nbds_uri(&s, "mem", &certs.no_cert)]);
    assert!(String::from_utf8_lossy(&tls.stdout).contains("with TLS"));
}

#[test]
fn bad_tls_settings_stop_the_server_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let hypoll = env!("CARGO_BIN_EXE_hypoll");
    let cases: [(&[&str], &str); 3] = [
        (&["--tls", "require"], "--tls-certificates"),
        (&["--tls-verify-peer"], "--tls-verify-peer"),
        (
            &[
                "--tls",
                "on",
                "--tls-certificates",
                dir.path().to_str().unwrap(),
            ],
            "server-cert.pem",
        ),
    ];
    for (args, says) in cases {
        let out = std::process::Command::new(hypoll)
            .args(["serve", "--listen", "127.0.0.1:0", "--export", "m=null"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn an_export_restricted_to_named_clients_serves_them_alone() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::make(dir.path());
    let s = serve_tls(
        &certs,
        &[
            "--export",
            "secret=emu:dram,size=16M,clients=alice.test+carol.test",
        ],
    );
    // Alice's certificate names alice.test: she sees it, reads and writes it.
    let list = run_ok("nbdinfo", &["--list", &nbds_uri(&s, "", &certs.client)]);
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(text.contains("export=\"secret\""), "{text}");
    run_ok(
        "qemu-io",
        &[
            "--object",
            &qemu_creds(&certs.client, true),
            "--image-opts",
            &qemu_image(&s, "secret"),
            "-c",
            "write -P 0x5e 0 64k",
            "-c",
            "read -P 0x5e 0 64k",
        ],
    );
    // Bob's, signed by the same CA, does not: the export is neither listed nor opened, and
    // the others still serve him.
    let list = run_ok("nbdinfo", &["--list", &nbds_uri(&s, "", &certs.bob)]);
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(
        !text.contains("secret") && text.contains("export=\"mem\""),
        "{text}"
    );
    // (libnbd 1.14 reports NBD_REP_ERR_POLICY as "Operation not supported", without the
    // server's message.)
    let refused = run_fails("nbdinfo", &[&nbds_uri(&s, "secret", &certs.bob)]);
    assert!(refused.contains("opt_go"), "{refused}");
    run_ok("nbdinfo", &["--size", &nbds_uri(&s, "mem", &certs.bob)]);
}
