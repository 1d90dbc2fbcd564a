//! `hypoll serve`: exports devices over NBD, vhost-user-blk and NVMe/TCP (or vhost-user-blk
//! alone, `serve_vhost.rs`) on per-core reactors until SIGINT, SIGTERM, SIGHUP or SIGQUIT,
//! then stops gracefully (stop accepting, finish in-flight requests, flush).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use hypoll_nbd::server::{
    ExportSpec, TlsConfig, TlsMode, UnixOwner, COALESCE_NS_DEFAULT, COALESCE_NS_MAX,
    CONNECTIONS_MAX_DEFAULT, CONNECTION_BYTES_MAX_DEFAULT, HANDSHAKE_TIMEOUT_DEFAULT,
    IDLE_SPIN_NS_DEFAULT, QUEUE_DEPTH_DEFAULT, REQUEST_STALL_TIMEOUT_DEFAULT, UNIX_MODE_DEFAULT,
    UNIX_MODE_MAX,
};
use hypoll_nbd::session::REQUEST_BYTES_MAX_DEFAULT;
use hypoll_nbd::{ListenAddr, Server, ServerConfig, ServiceConfig};

use crate::serve_log::with_flag;
use crate::serve_running::{NbdRunning, Running};
use crate::serve_state::{check_nvme_limits, compose, NvmeTcp};
use crate::serve_vhost::{bind_sockets, vhost_sockets, VhostOnly, VhostOnlyConfig};
use hypoll_frontend::{AddedProtocol, TlsConfig as FrontTlsConfig};
use hypoll_nvme::parse_size_bytes;
use hypoll_nvmf::config::{
    CONTROLLERS_MAX_DEFAULT, IN_CAPSULE_BYTES_MAX_DEFAULT, IO_QUEUES_MAX_DEFAULT,
    MAXH2CDATA_BYTES_DEFAULT, QUEUE_ENTRIES_MAX_DEFAULT,
};
use hypoll_nvmf::server::{nvmf_metrics, PORT_DEFAULT, SUBSYSTEM_NQN_DEFAULT};
use hypoll_nvmf::Limits;
use hypoll_nvmf::Nvmf;
use hypoll_reactor::CoreList;

/// NBD's port (IANA-assigned), where clients look first.
const NBD_PORT_DEFAULT: u16 = 10809;

#[derive(Parser)]
pub struct ServeArgs {
    /// An export: NAME=DEVICE_SPEC (mem=emu:dram,size=4G; disk=emu:dram,backing=file:/path,
    /// size=8G); `ro` (or `readonly`) among the spec's items makes it read-only
    /// (disk=uring:/img,ro), and `clients=NAME+NAME` serves it only to clients whose
    /// certificate names one of them (with --tls-verify-peer). Repeat for several; the first
    /// is the default export.
    #[arg(long = "export", value_name = "NAME=SPEC", required = true, value_parser = parse_export)]
    exports: Vec<(String, String)>,
    /// Every export read-only: clients are told so, and writes, trims and write zeroes are
    /// refused with EPERM.
    #[arg(short = 'r', long)]
    read_only: bool,
    /// Log each client connecting and leaving (NBD, NVMe/TCP, vhost-user front ends) and
    /// the guest memory vhost-user front ends plug in or out, besides warnings and errors,
    /// as nbdkit's -v adds its own events.
    #[arg(short = 'v', long)]
    pub(crate) verbose: bool,
    /// TLS: off; on (clients may upgrade with STARTTLS); require (nothing but STARTTLS is
    /// answered before TLS).
    #[arg(long, value_name = "off|on|require", default_value = "off")]
    tls: TlsMode,
    /// The folder of ca-cert.pem, server-cert.pem and server-key.pem (as nbdkit and qemu lay
    /// it out); needed with --tls on or require.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Clients must show a certificate signed by the CA of ca-cert.pem.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Where NBD clients connect: ADDR:PORT (port 0 picks a free one) or unix:PATH
    /// (default 127.0.0.1:10809). With --vhost-user-blk and no --listen, NBD is not served.
    #[arg(long, value_name = "ADDR:PORT|unix:PATH")]
    listen: Option<ListenAddr>,
    /// Permissions of the unix:PATH socket file, in octal, whatever the umask (connecting
    /// needs write permission): 600 lets its owner only connect, 660 its group too.
    #[arg(long, value_name = "OCTAL", default_value_t = format!("{UNIX_MODE_DEFAULT:o}"), value_parser = parse_unix_mode)]
    unix_mode: String,
    /// Owner of the unix:PATH socket file, USER[:GROUP] or :GROUP (names or numbers), so
    /// a server started as root can let one user or group connect. Needs the privilege to
    /// give the file away.
    #[arg(long, value_name = "USER[:GROUP]", value_parser = parse_unix_owner)]
    unix_owner: Option<UnixOwner>,
    /// Cores, one reactor each: 0, 0-1, 0,2 (default: the first core this process may use).
    #[arg(long, value_parser = crate::parse_cores)]
    cores: Option<CoreList>,
    /// Poll policy of every reactor, for its sockets and devices alike (see `hypoll
    /// policies`).
    #[arg(long, default_value = "adaptive", value_parser = crate::parse_policy)]
    policy: String,
    /// Serve Prometheus metrics on ADDR:PORT (GET /metrics).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<SocketAddr>,
    /// Most connections open at once; more are closed as they arrive.
    #[arg(long = "max-connections", default_value_t = CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Largest read or write one request may carry (a multiple of 4K).
    #[arg(long = "max-request-bytes", default_value_t = REQUEST_BYTES_MAX_DEFAULT as u64, value_parser = parse_size_bytes)]
    request_bytes_max: u64,
    /// Data one connection may hold: replies waiting for its socket plus the writes and
    /// reads it has in flight. Past it, its requests wait unread (by at most one request
    /// more), so a client that pipelines and never reads cannot grow the server (64K to
    /// 64G).
    #[arg(long = "max-connection-bytes", default_value_t = CONNECTION_BYTES_MAX_DEFAULT as u64, value_parser = parse_size_bytes)]
    connection_bytes_max: u64,
    /// Serve export NAME to a virtual machine's virtio-blk over vhost-user on the unix
    /// socket PATH (QEMU: -chardev socket,id=c,path=PATH -device
    /// vhost-user-blk-pci,chardev=c), on the same reactors as NBD (without --listen: no
    /// NBD), one queue offered per reactor. Repeat for several exports; one front end per
    /// socket at a time.
    #[arg(long = "vhost-user-blk", value_name = "NAME=PATH", value_parser = parse_vhost)]
    vhost_user_blk: Vec<(String, PathBuf)>,
    /// Also serve every export over NVMe/TCP, as the namespaces (in --export order) of one
    /// subsystem, on ADDR:PORT (ADDR alone: port 4420; no value: 127.0.0.1:4420), on the
    /// same reactors as NBD. Hosts connect with `nvme connect -t tcp -a ADDR -s PORT -n
    /// NQN` (the NQN is printed at start).
    #[arg(long, value_name = "ADDR:PORT", num_args = 0..=1,
          default_missing_value = "127.0.0.1:4420", value_parser = parse_nvme_tcp)]
    nvme_tcp: Option<SocketAddr>,
    /// The NVMe/TCP subsystem's NQN.
    #[arg(long, value_name = "NQN", default_value = SUBSYSTEM_NQN_DEFAULT, requires = "nvme_tcp")]
    nvme_nqn: String,
    /// NVMe/TCP: controllers (admin queues) alive at once; one more Connect is answered
    /// Controller Busy.
    #[arg(long, value_name = "N", default_value_t = CONTROLLERS_MAX_DEFAULT, requires = "nvme_tcp")]
    nvme_max_controllers: u16,
    /// NVMe/TCP: I/O queues (connections) per controller; a host asking for more is
    /// granted this many.
    #[arg(long, value_name = "N", default_value_t = IO_QUEUES_MAX_DEFAULT, requires = "nvme_tcp")]
    nvme_max_io_queues: u16,
    /// NVMe/TCP: entries of every queue (CAP.MQES + 1), so commands one queue has in
    /// flight.
    #[arg(long, value_name = "N", default_value_t = QUEUE_ENTRIES_MAX_DEFAULT, requires = "nvme_tcp")]
    nvme_queue_entries: u16,
    /// NVMe/TCP: write data an I/O command's capsule may carry (IOCCSZ); larger writes are
    /// asked for with R2T. A multiple of 16 from 1K to 1M.
    #[arg(long, value_name = "B", default_value_t = IN_CAPSULE_BYTES_MAX_DEFAULT as u64,
          value_parser = parse_size_bytes, requires = "nvme_tcp")]
    nvme_in_capsule_bytes: u64,
    /// NVMe/TCP: data one H2CData PDU may carry (ICResp's MAXH2CDATA). A multiple of 4, at
    /// least 4K.
    #[arg(long, value_name = "B", default_value_t = MAXH2CDATA_BYTES_DEFAULT as u64,
          value_parser = parse_size_bytes, requires = "nvme_tcp")]
    nvme_maxh2cdata_bytes: u64,
    /// Queue depth of each reactor's queue pair on each export.
    #[arg(long, default_value_t = QUEUE_DEPTH_DEFAULT as u16,
          value_parser = clap::value_parser!(u16).range(1..=4096))]
    queue_depth: u16,
    /// Microseconds a reactor with nothing in flight keeps watching its sockets before it
    /// parks, while its clients send one request at a time (parked, their next request costs
    /// a wake-up; watching costs CPU). Under load it parks at once. 0: always park. Without
    /// NBD: how long a reactor with nothing in flight polls its guests' rings before it
    /// parks.
    #[arg(long, default_value_t = IDLE_SPIN_NS_DEFAULT as f64 / 1000.0, value_parser = parse_idle_spin_us)]
    idle_spin_us: f64,
    /// Microseconds a reactor lets requests gather between reads of its sockets while its
    /// clients keep many requests in flight (measured: trial windows that gather at least 12
    /// requests turn it on), so one read and one write carry several requests. Clients that
    /// wait on each reply, or keep fewer than 12 in flight, are not delayed. 0: never gather.
    #[arg(long, default_value_t = COALESCE_NS_DEFAULT as f64 / 1000.0, value_parser = parse_coalesce_us)]
    coalesce_us: f64,
    /// Seconds a client may take to finish the handshake before its connection is closed
    /// (clients that connect and say nothing would hold connection slots forever).
    #[arg(long, default_value_t = HANDSHAKE_TIMEOUT_DEFAULT.as_secs_f64(), value_parser = parse_handshake_timeout_s)]
    handshake_timeout_s: f64,
    /// Seconds a connection with nothing in flight may send nothing before it is closed.
    /// 0: never (the default: clients such as the kernel's keep a disk's connection open
    /// through long quiet spells). On a network where strangers may connect, set it, so
    /// idle connections cannot hold every --max-connections slot.
    #[arg(long, default_value_t = 0.0, value_parser = parse_idle_timeout_s)]
    idle_timeout_s: f64,
    /// Seconds a client may pause in the middle of sending a request before its connection
    /// is closed, so a client that starts a request and stops cannot hold the memory it
    /// takes.
    #[arg(long, default_value_t = REQUEST_STALL_TIMEOUT_DEFAULT.as_secs_f64(), value_parser = parse_handshake_timeout_s)]
    request_timeout_s: f64,
}

fn parse_idle_timeout_s(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v == 0.0 || (0.1..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?}: expected 0 (never) or seconds from 0.1 to 86400"
        )),
    }
}

fn parse_unix_owner(s: &str) -> Result<UnixOwner, String> {
    let (user, group) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let uid = match user {
        "" => None,
        u => Some(match u.parse::<u32>() {
            Ok(n) => n,
            Err(_) => nix::unistd::User::from_name(u)
                .map_err(|e| format!("looking up user {u:?}: {e}"))?
                .ok_or_else(|| format!("{u:?}: no such user"))?
                .uid
                .as_raw(),
        }),
    };
    let gid = match group {
        None | Some("") => None,
        Some(g) => Some(match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => nix::unistd::Group::from_name(g)
                .map_err(|e| format!("looking up group {g:?}: {e}"))?
                .ok_or_else(|| format!("{g:?}: no such group"))?
                .gid
                .as_raw(),
        }),
    };
    if uid.is_none() && gid.is_none() {
        return Err(format!("{s:?}: expected USER, USER:GROUP or :GROUP"));
    }
    Ok(UnixOwner { uid, gid })
}

fn parse_unix_mode(s: &str) -> Result<String, String> {
    match u32::from_str_radix(s, 8) {
        Ok(v) if v <= UNIX_MODE_MAX => Ok(s.to_string()),
        _ => Err(format!(
            "{s:?}: expected permission bits in octal, 0 to {UNIX_MODE_MAX:o} (600, 660)"
        )),
    }
}

fn parse_handshake_timeout_s(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: expected seconds from 0.1 to 3600")),
    }
}

fn parse_idle_spin_us(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        // While it watches, the reactor runs no messages or timers: keep that short.
        Ok(v) if (0.0..=1000.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: expected microseconds from 0 to 1000")),
    }
}

fn parse_coalesce_us(s: &str) -> Result<f64, String> {
    let max_us = COALESCE_NS_MAX as f64 / 1000.0;
    match s.parse::<f64>() {
        // While it waits for a window's end, the reactor runs no messages or timers.
        Ok(v) if (0.0..=max_us).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: expected microseconds from 0 to {max_us}")),
    }
}

fn parse_export(s: &str) -> Result<(String, String), String> {
    let (name, spec) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=DEVICE_SPEC, e.g. mem=emu:dram,size=1G"))?;
    if name.is_empty() {
        return Err(format!("{s:?}: the export name is empty"));
    }
    ExportSpec::parse(spec)
        .device
        .parse::<hypoll_nvme::DeviceConfig>()
        .map_err(|e| format!("export {name}: {e}"))?;
    Ok((name.to_string(), spec.to_string()))
}

fn parse_vhost(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!(
            "{s:?}: expected NAME=PATH, e.g. disk=/run/disk.sock"
        )),
    }
}

/// `--nvme-tcp`'s value: ADDR:PORT, or ADDR alone for NVMe/TCP's port.
fn parse_nvme_tcp(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, PORT_DEFAULT))
        .map_err(|_| format!("{s:?}: expected ADDR:PORT (127.0.0.1:4420) or ADDR"))
}

/// NVMe/TCP's limits from the `--nvme-*` flags, checked before anything starts.
fn nvme_limits(args: &ServeArgs) -> Result<Limits, String> {
    let bytes = |flag: &str, b: u64| {
        u32::try_from(b).map_err(|_| format!("{flag}: {b} bytes is more than 4 GiB"))
    };
    let limits = Limits {
        controllers_max: args.nvme_max_controllers,
        io_queues_max: args.nvme_max_io_queues,
        queue_entries_max: args.nvme_queue_entries,
        in_capsule_bytes_max: bytes("--nvme-in-capsule-bytes", args.nvme_in_capsule_bytes)?,
        maxh2cdata_bytes: bytes("--nvme-maxh2cdata-bytes", args.nvme_maxh2cdata_bytes)?,
        ..Limits::default()
    };
    check_nvme_limits(&args.nvme_nqn, limits)
}

/// Where NBD listens: `--listen`, else NBD's port on the loopback, unless `vhost_alone`:
/// vhost-user-blk sockets asked for without `--listen` and without `--nvme-tcp` (then NBD
/// is not served; NVMe/TCP is served beside NBD only).
fn nbd_listen(listen: Option<ListenAddr>, vhost_alone: bool) -> Option<ListenAddr> {
    match listen {
        Some(addr) => Some(addr),
        None if vhost_alone => None,
        None => Some(ListenAddr::Tcp(SocketAddr::from((
            [127, 0, 0, 1],
            NBD_PORT_DEFAULT,
        )))),
    }
}

/// The flags among `args` that set NBD's own settings away from their defaults: they
/// would change nothing in a server without NBD.
fn nbd_settings_given(args: &ServeArgs) -> Vec<&'static str> {
    let mut given = Vec::new();
    let mut check = |set: bool, flag: &'static str| {
        if set {
            given.push(flag);
        }
    };
    check(args.tls != TlsMode::Off, "--tls");
    check(args.tls_certificates.is_some(), "--tls-certificates");
    check(args.tls_verify_peer, "--tls-verify-peer");
    check(
        u32::from_str_radix(&args.unix_mode, 8) != Ok(UNIX_MODE_DEFAULT),
        "--unix-mode",
    );
    check(args.unix_owner.is_some(), "--unix-owner");
    check(args.metrics.is_some(), "--metrics");
    check(
        args.connections_max != CONNECTIONS_MAX_DEFAULT,
        "--max-connections",
    );
    check(
        args.request_bytes_max != REQUEST_BYTES_MAX_DEFAULT as u64,
        "--max-request-bytes",
    );
    check(
        args.connection_bytes_max != CONNECTION_BYTES_MAX_DEFAULT as u64,
        "--max-connection-bytes",
    );
    check(
        (args.coalesce_us * 1000.0) as u64 != COALESCE_NS_DEFAULT,
        "--coalesce-us",
    );
    check(
        Duration::from_secs_f64(args.handshake_timeout_s) != HANDSHAKE_TIMEOUT_DEFAULT,
        "--handshake-timeout-s",
    );
    check(args.idle_timeout_s != 0.0, "--idle-timeout-s");
    check(
        Duration::from_secs_f64(args.request_timeout_s) != REQUEST_STALL_TIMEOUT_DEFAULT,
        "--request-timeout-s",
    );
    given
}

pub fn serve_command(args: ServeArgs) -> ExitCode {
    let Ok(request_bytes_max) = u32::try_from(args.request_bytes_max) else {
        return crate::usage_error(format!(
            "--max-request-bytes {}: at most 1G",
            args.request_bytes_max
        ));
    };
    // NBD is served unless only --vhost-user-blk sockets are asked for.
    let vhost_alone = !args.vhost_user_blk.is_empty() && args.nvme_tcp.is_none();
    let nbd_listen = nbd_listen(args.listen.clone(), vhost_alone);
    let nbd = nbd_listen.is_some();
    if !nbd {
        let given = nbd_settings_given(&args);
        if !given.is_empty() {
            return crate::usage_error(format!(
                "{}: NBD's settings, but NBD is not served (--vhost-user-blk without \
                 --listen); add --listen ADDR:PORT to serve NBD too",
                given.join(", ")
            ));
        }
    }
    let nvme_limits = match nvme_limits(&args) {
        Ok(l) => l,
        Err(e) => return crate::usage_error(e),
    };
    let sockets = match vhost_sockets(&args.exports, &args.vhost_user_blk, nbd) {
        Ok(s) => s,
        Err(message) => return crate::usage_error(message),
    };
    let cores = match args.cores {
        Some(c) => c,
        None => match CoreList::allowed() {
            Ok(all) => CoreList::new(all.as_slice()[..1].to_vec()),
            Err(e) => {
                eprintln!("hypoll serve: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    // Signals are watched before any thread starts, so none of them can take one. Every
    // signal whose default action ends the process is among them (a closed terminal sends
    // SIGHUP, Ctrl-\ SIGQUIT), so none ends it without the drain and the final flush.
    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGQUIT,
    ]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hypoll serve: watching SIGINT, SIGTERM, SIGHUP and SIGQUIT: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (socket_files, listeners) = match bind_sockets(&sockets) {
        Ok(bound) => bound,
        Err(message) => {
            eprintln!("hypoll serve: {message}");
            return ExitCode::FAILURE;
        }
    };
    let running = if let Some(listen) = nbd_listen {
        let service = ServiceConfig {
            cores: Some(cores),
            policy: args.policy,
            metrics: args.metrics,
            connections_max: args.connections_max,
            connection_bytes_max: usize::try_from(args.connection_bytes_max).unwrap_or(usize::MAX),
            idle_spin_ns: (args.idle_spin_us * 1000.0) as u64,
            coalesce_ns: (args.coalesce_us * 1000.0) as u64,
            handshake_timeout: Duration::from_secs_f64(args.handshake_timeout_s),
            idle_timeout: (args.idle_timeout_s > 0.0)
                .then(|| Duration::from_secs_f64(args.idle_timeout_s)),
            request_stall_timeout: Duration::from_secs_f64(args.request_timeout_s),
            unix_mode: u32::from_str_radix(&args.unix_mode, 8).expect("checked by parse_unix_mode"),
            unix_owner: args.unix_owner,
            tls: TlsConfig {
                mode: args.tls,
                certificates_dir: args.tls_certificates,
                verify_peer: args.tls_verify_peer,
            },
            ..ServiceConfig::new(listen)
        };
        let mut cfg = ServerConfig {
            exports: args.exports,
            read_only: args.read_only,
            request_bytes_max,
            queue_depth: usize::from(args.queue_depth),
            service,
        };
        if args.nvme_tcp.is_some() {
            let restricted = cfg
                .exports
                .iter()
                .find(|(_, spec)| ExportSpec::parse(spec).clients.is_some());
            if let Some((name, _)) = restricted {
                return crate::usage_error(format!(
                    "--nvme-tcp: export {name} is restricted to named clients (clients=), \
                     which NVMe/TCP cannot check here (it has no TLS): serve it over NBD only"
                ));
            }
        }
        // NVMe/TCP's socket is bound first: its address goes in the target's discovery
        // log, which the reactors build.
        let nvme = match args.nvme_tcp {
            None => None,
            Some(addr) => {
                let nvme_cfg = ServiceConfig {
                    listen: ListenAddr::Tcp(addr),
                    tls: FrontTlsConfig::default(),
                    ..cfg.service.clone()
                };
                let metrics = std::sync::Arc::new(nvmf_metrics());
                match AddedProtocol::<Nvmf>::bind(&nvme_cfg, metrics.clone()) {
                    Ok(added) => {
                        // Served on `--metrics` after NBD's.
                        cfg.service.metrics_beside.push(metrics);
                        Some(added)
                    }
                    Err(e) => {
                        eprintln!("hypoll serve: --nvme-tcp: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
        };
        let nvme_part = nvme.as_ref().map(|added| {
            let ListenAddr::Tcp(addr) = added.local_addr().clone() else {
                unreachable!("--nvme-tcp takes ADDR:PORT")
            };
            NvmeTcp {
                shards: added.shards(),
                subsystem_nqn: args.nvme_nqn.clone(),
                limits: nvme_limits,
                addr,
                target: Default::default(),
            }
        });
        let composed = sockets.clone();
        let composed_nvme = nvme_part.clone();
        let started = Server::start_with(cfg, move |r, nbd| {
            compose(r, nbd, &composed, &listeners, composed_nvme.as_ref())
        });
        let server = match started {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hypoll serve: {}", with_flag(&e.to_string(), e.setting()));
                return ExitCode::FAILURE;
            }
        };
        let nvme_listener = match (nvme, server.handles()) {
            (Some(added), Some(handles)) => match added.serve(handles.clone()) {
                Ok(l) => Some(l),
                Err(e) => {
                    eprintln!("hypoll serve: --nvme-tcp: {e}");
                    return ExitCode::FAILURE;
                }
            },
            _ => None,
        };
        Running::Nbd(Box::new(NbdRunning {
            server,
            nvme: nvme_listener.zip(nvme_part),
        }))
    } else {
        let cfg = VhostOnlyConfig {
            exports: args.exports,
            read_only: args.read_only,
            cores,
            policy: args.policy,
            queue_depth: usize::from(args.queue_depth),
            idle_spin_ns: (args.idle_spin_us * 1000.0) as u64,
        };
        match VhostOnly::start(cfg, sockets.clone(), listeners) {
            Ok(s) => Running::Vhost(s),
            Err(e) => {
                eprintln!("hypoll serve: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    running.announce(&sockets);
    let signal = signals.forever().next();
    eprintln!(
        "hypoll serve: signal {}: stopping (finishing in-flight requests, then flushing)",
        signal.unwrap_or_default()
    );
    let stopped = running.stop(!sockets.is_empty());
    drop(socket_files);
    let ok = stopped.tell();
    if ok {
        eprintln!("hypoll serve: stopped cleanly");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbd_is_served_unless_only_vhost_user_blk_is_asked_for() {
        let unix: ListenAddr = "unix:/run/nbd.sock".parse().unwrap();
        let default: ListenAddr = "127.0.0.1:10809".parse().unwrap();
        assert_eq!(nbd_listen(None, false), Some(default));
        assert_eq!(nbd_listen(None, true), None);
        assert_eq!(nbd_listen(Some(unix.clone()), true), Some(unix.clone()));
        assert_eq!(nbd_listen(Some(unix.clone()), false), Some(unix));
    }
}
