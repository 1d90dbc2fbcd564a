//! The Prometheus HTTP endpoint (`--metrics ADDR`): a thread that accepts scrapers and
//! answers `GET /metrics` with the service's [`Metrics`], each scrape on a thread of its
//! own (a few at once) within an overall deadline, until it is dropped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hypoll_reactor::ReactorHandle;

use crate::metrics::Metrics;

/// Longest HTTP request head the endpoint reads.
const HTTP_REQUEST_BYTES_MAX: usize = 8192;
/// How long one scrape may take, request and response together: a client that sends (or
/// reads) a byte now and then cannot hold its thread longer.
const HTTP_SCRAPE_MS_MAX: u64 = 2000;
/// Scrapes answered at once, each on its own thread: a few slow clients cannot keep a
/// scraper waiting, and many cannot make the endpoint grow. Past it, a client is answered
/// 503 at once.
const HTTP_SCRAPES_MAX: usize = 4;
/// How often the endpoint's thread checks whether it should stop.
const STOP_CHECK_MS: i32 = 100;

/// The HTTP endpoint's thread; stops when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Serves `GET /metrics` (and `/`) on `addr`, a few scrapes at a time, each within a
    /// deadline: every `Metrics` of `metrics` in order (the first with the reactors'
    /// own counters), in one exposition.
    pub fn start<S: 'static>(
        addr: SocketAddr,
        metrics: Arc<[Arc<Metrics>]>,
        reactors: Arc<[ReactorHandle<S>]>,
    ) -> std::io::Result<Endpoint> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("hypoll-metrics".into())
            .spawn(move || serve(&listener, &stopping, &metrics, &reactors))?;
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

/// The endpoint thread's loop: accepts until `stop`, answers each scraper on a thread of
/// its own while fewer than [`HTTP_SCRAPES_MAX`] run, and waits for them before it ends.
fn serve<S: 'static>(
    listener: &TcpListener,
    stop: &AtomicBool,
    metrics: &Arc<[Arc<Metrics>]>,
    reactors: &Arc<[ReactorHandle<S>]>,
) {
    use std::os::fd::AsFd;
    let mut scrapes: Vec<JoinHandle<()>> = Vec::with_capacity(HTTP_SCRAPES_MAX);
    while !stop.load(Ordering::Acquire) {
        match hypoll_nvme::wait_readable(listener.as_fd(), STOP_CHECK_MS) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::error!("metrics endpoint: {e}; it stops");
                break;
            }
        }
        let Ok((mut stream, _)) = listener.accept() else {
            continue;
        };
        // Finished scrapes are joined here, so at most HTTP_SCRAPES_MAX threads exist.
        scrapes.retain(|t| !t.is_finished());
        if scrapes.len() >= HTTP_SCRAPES_MAX {
            // A short answer fits the socket's buffer: it never waits on the client.
            let _ = stream.set_nonblocking(true);
            let deadline = Instant::now() + Duration::from_millis(HTTP_SCRAPE_MS_MAX);
            let _ = respond(&mut stream, "503 Service Unavailable", "", deadline);
            // Closing with the request unread would reset the connection and could
            // discard the answer at the client: read what has arrived first.
            let _ = stream.shutdown(std::net::Shutdown::Write);
            let _ = stream.read(&mut [0u8; HTTP_REQUEST_BYTES_MAX]);
            continue;
        }
        let (metrics, reactors) = (metrics.clone(), reactors.clone());
        let spawned = std::thread::Builder::new()
            .name("hypoll-scrape".into())
            .spawn(move || {
                if let Err(e) = answer(stream, &metrics, &reactors) {
                    tracing::warn!("metrics scrape failed: {e}");
                }
            });
        match spawned {
            Ok(t) => scrapes.push(t),
            Err(e) => tracing::warn!("metrics scrape not answered: starting its thread: {e}"),
        }
        assert!(scrapes.len() <= HTTP_SCRAPES_MAX);
    }
    // Each ends within HTTP_SCRAPE_MS_MAX.
    for t in scrapes {
        let _ = t.join();
    }
}

/// The time left before `deadline`, or a timeout error once it has passed.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the scrape took longer than {HTTP_SCRAPE_MS_MAX} ms"),
        )),
    }
}

fn answer<S>(
    mut stream: TcpStream,
    metrics: &[Arc<Metrics>],
    reactors: &[ReactorHandle<S>],
) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_millis(HTTP_SCRAPE_MS_MAX);
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        // Each read may wait only for what is left of the whole scrape's time.
        stream.set_read_timeout(Some(left(deadline)?))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
        if head.len() > HTTP_REQUEST_BYTES_MAX {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "",
                deadline,
            );
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next(), parts.next());
    if method != Some("GET") {
        return respond(&mut stream, "405 Method Not Allowed", "", deadline);
    }
    if !matches!(path, Some("/metrics") | Some("/")) {
        return respond(&mut stream, "404 Not Found", "try /metrics\n", deadline);
    }
    respond(
        &mut stream,
        "200 OK",
        &exposition(metrics, reactors),
        deadline,
    )
}

/// One exposition of every `Metrics` in `all`: the reactors' counters go with the first
/// (the others' reactor families stay empty rather than repeat them), and the `# EOF` that
/// ends each encoding is kept only at the end.
fn exposition<S>(all: &[Arc<Metrics>], reactors: &[ReactorHandle<S>]) -> String {
    const EOF: &str = "# EOF\n";
    let mut body = String::new();
    for (i, m) in all.iter().enumerate() {
        let text = if i == 0 {
            m.encode(reactors)
        } else {
            m.encode::<S>(&[])
        };
        body.push_str(text.strip_suffix(EOF).unwrap_or(&text));
    }
    body.push_str(EOF);
    debug_assert_eq!(body.matches(EOF).count(), 1);
    body
}

/// Writes the response, all of it before `deadline`.
fn respond(
    stream: &mut TcpStream,
    status: &str,
    body: &str,
    deadline: Instant,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; \
         charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    for mut bytes in [head.as_bytes(), body.as_bytes()] {
        while !bytes.is_empty() {
            // Each write may wait only for what is left of the whole scrape's time.
            stream.set_write_timeout(Some(left(deadline)?))?;
            match stream.write(bytes) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}
