//! `hypoll serve`: exports devices over NBD on per-core reactors until SIGINT or SIGTERM,
//! then stops gracefully (stop accepting, finish in-flight requests, flush).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use hypoll_nbd::server::{
    COALESCE_NS_DEFAULT, COALESCE_NS_MAX, CONNECTIONS_MAX_DEFAULT, CONNECTION_BYTES_MAX_DEFAULT,
    HANDSHAKE_TIMEOUT_DEFAULT, IDLE_SPIN_NS_DEFAULT, QUEUE_DEPTH_DEFAULT,
};
use hypoll_nbd::session::REQUEST_BYTES_MAX_DEFAULT;
use hypoll_nbd::{ListenAddr, Server, ServerConfig};
use hypoll_nvme::parse_size_bytes;
use hypoll_reactor::CoreList;

#[derive(Parser)]
pub struct ServeArgs {
    /// An export: NAME=DEVICE_SPEC (mem=emu:dram,size=4G; disk=emu:dram,backing=file:/path,
    /// size=8G). Repeat for several; the first is the default export.
    #[arg(long = "export", value_name = "NAME=SPEC", required = true, value_parser = parse_export)]
    exports: Vec<(String, String)>,
    /// Where to listen: ADDR:PORT (port 0 picks a free one) or unix:PATH.
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: ListenAddr,
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
    /// Queue depth of each reactor's queue pair on each export.
    #[arg(long, default_value_t = QUEUE_DEPTH_DEFAULT as u16,
          value_parser = clap::value_parser!(u16).range(1..=4096))]
    queue_depth: u16,
    /// Microseconds a reactor with nothing in flight keeps watching its sockets before it
    /// parks, while its clients send one request at a time (parked, their next request costs
    /// a wake-up; watching costs CPU). Under load it parks at once. 0: always park.
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
    spec.parse::<hypoll_nvme::DeviceConfig>()
        .map_err(|e| format!("export {name}: {e}"))?;
    Ok((name.to_string(), spec.to_string()))
}

pub fn serve_command(args: ServeArgs) -> ExitCode {
    let Ok(request_bytes_max) = u32::try_from(args.request_bytes_max) else {
        return crate::usage_error(format!(
            "--max-request-bytes {}: at most 1G",
            args.request_bytes_max
        ));
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
    // Signals are watched before any thread starts, so none of them can take one.
    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hypoll serve: watching SIGINT and SIGTERM: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = ServerConfig {
        cores: Some(cores),
        policy: args.policy,
        metrics: args.metrics,
        connections_max: args.connections_max,
        request_bytes_max,
        connection_bytes_max: usize::try_from(args.connection_bytes_max).unwrap_or(usize::MAX),
        queue_depth: usize::from(args.queue_depth),
        idle_spin_ns: (args.idle_spin_us * 1000.0) as u64,
        coalesce_ns: (args.coalesce_us * 1000.0) as u64,
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout_s),
        ..ServerConfig::new(args.exports, args.listen)
    };
    let server = match Server::start(cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hypoll serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on {}", server.local_addr());
        if let Some(m) = server.metrics_addr() {
            let _ = writeln!(out, "metrics on http://{m}/metrics");
        }
        for e in server.exports() {
            let _ = writeln!(
                out,
                "export {} = {} ({} bytes, {}-byte blocks)",
                e.name, e.description, e.size_bytes, e.block_bytes
            );
        }
        let _ = out.flush();
    }
    let signal = signals.forever().next();
    eprintln!(
        "hypoll serve: signal {}: stopping (finishing in-flight requests, then flushing)",
        signal.unwrap_or_default()
    );
    let report = server.stop();
    let mut ok = true;
    if report.connections_left > 0 {
        eprintln!(
            "hypoll serve: {} connections did not finish in time and were cut",
            report.connections_left
        );
        ok = false;
    }
    for f in &report.flush_failures {
        eprintln!("hypoll serve: final flush: {f}");
        ok = false;
    }
    for p in &report.panics {
        eprintln!("hypoll serve: {p}");
        ok = false;
    }
    if report.failed_ios > 0 {
        eprintln!(
            "hypoll serve: {} I/Os were failed at shutdown",
            report.failed_ios
        );
        ok = false;
    }
    if ok {
        eprintln!("hypoll serve: stopped cleanly");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
