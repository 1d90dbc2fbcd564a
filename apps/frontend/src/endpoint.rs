//! The Prometheus HTTP endpoint (`--metrics ADDR`): a thread that answers `GET /metrics`
//! with the service's [`Metrics`], one scrape at a time, until it is dropped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use hypoll_reactor::ReactorHandle;

use crate::metrics::Metrics;

/// Longest HTTP request head the endpoint reads.
const HTTP_REQUEST_BYTES_MAX: usize = 8192;
/// How long a scraper may take to send its request.
const HTTP_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the endpoint's thread checks whether it should stop.
const STOP_CHECK_MS: i32 = 100;

/// The HTTP endpoint's thread; stops when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Serves `GET /metrics` (and `/`) on `addr`, one scrape at a time.
    pub fn start(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        reactors: Arc<[ReactorHandle]>,
    ) -> std::io::Result<Endpoint> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("hypoll-metrics".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    use std::os::fd::AsFd;
                    match hypoll_nvme::wait_readable(listener.as_fd(), STOP_CHECK_MS) {
                        Ok(true) => {}
                        Ok(false) => continue,
                        Err(e) => {
                            tracing::error!("metrics endpoint: {e}; it stops");
                            return;
                        }
                    }
                    let Ok((stream, _)) = listener.accept() else {
                        continue;
                    };
                    if let Err(e) = answer(stream, &metrics, &reactors) {
                        tracing::warn!("metrics scrape failed: {e}");
                    }
                }
            })?;
        Ok(Endpoint {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(
    mut stream: TcpStream,
    metrics: &Metrics,
    reactors: &[ReactorHandle],
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(HTTP_READ_TIMEOUT))?;
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
        if head.len() > HTTP_REQUEST_BYTES_MAX {
            return respond(&mut stream, "431 Request Header Fields Too Large", "");
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next(), parts.next());
    if method != Some("GET") {
        return respond(&mut stream, "405 Method Not Allowed", "");
    }
    if !matches!(path, Some("/metrics") | Some("/")) {
        return respond(&mut stream, "404 Not Found", "try /metrics\n");
    }
    let body = metrics.encode(reactors);
    respond(&mut stream, "200 OK", &body)
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; \
         charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}
