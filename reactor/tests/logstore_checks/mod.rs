//! What the log store's tests hold it to, whichever way it is written (callbacks here, async
//! tasks in `hypoll-async`'s `tests/logstore_async.rs`): driven from a client thread as an
//! embedder's clients would, every acknowledged record reads back byte for byte, the log is
//! dense, every request is answered exactly once (refusals included: each one the store
//! counted reached the client), and appends were batched by group commit. The including
//! test declares `store`, `policy` and `shard` at its root.

use std::io::Write;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::time::Duration;

use crate::store::{
    Answer, LogClient, LogOffset, LogStore, Reply, StoreConfig, StoreError, RECORD_BYTES_MAX,
    RECORD_HEADER_BYTES, SHARDS,
};
use hypoll_reactor::Device;

/// Records appended per run: enough for the ring to wrap many times on each shard.
const APPENDS: u64 = 3000;
/// Unanswered requests while sending again those refused: a few, so they mostly pass.
const RETRY_WINDOW: usize = 4;
/// Rounds of sending refused requests again before the test calls the store stuck.
const RETRY_ROUNDS_MAX: usize = 1000;
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Small limits, so that a burst from one client meets each of them.
fn config() -> StoreConfig {
    StoreConfig {
        queue_depth: 4,
        appends_max: 16,
        append_bytes_max: 16 << 10,
        reads_max: 8,
    }
}

/// Record `seq`, of 1 to `RECORD_BYTES_MAX` bytes (every 97th the longest), its bytes
/// following from its number.
fn record(seq: u64) -> Vec<u8> {
    let len = if seq.is_multiple_of(97) {
        RECORD_BYTES_MAX
    } else {
        1 + (seq.wrapping_mul(2_654_435_761) % RECORD_BYTES_MAX as u64) as usize
    };
    (0..len)
        .map(|i| (seq as usize * 31 + i * 7 + 1) as u8)
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Request {
    Append(u64),
    Read(u64, LogOffset),
}

/// What the client saw, per shard, to hold against what the shards counted.
#[derive(Debug, Default)]
struct Tally {
    appends_acked: [u64; SHARDS],
    appends_refused: [u64; SHARDS],
    reads_ok: [u64; SHARDS],
    reads_refused: [u64; SHARDS],
    reads_failed: [u64; SHARDS],
    /// Requests refused for back-pressure in the bursts (not the retries).
    burst_refusals: u64,
}

/// Sends `requests`, at most `window` unanswered at once, and returns their answers in
/// order. Each must be answered exactly once, and soon.
fn exchange(
    client: &LogClient,
    channel: &(Sender<Reply>, Receiver<Reply>),
    requests: &[Request],
    window: usize,
) -> Vec<Answer> {
    let (tx, rx) = channel;
    let mut answers: Vec<Option<Answer>> = requests.iter().map(|_| None).collect();
    let (mut sent, mut answered) = (0, 0);
    while answered < requests.len() {
        while sent < requests.len() && sent - answered < window {
            let tag = sent as u64;
            match requests[sent] {
                Request::Append(seq) => client.append(seq, record(seq), tag, tx),
                Request::Read(_, at) => client.read(at, tag, tx),
            }
            .expect("a shard's mailbox makes room within SEND_WAIT");
            sent += 1;
        }
        let reply = rx.recv_timeout(ANSWER_WAIT).unwrap_or_else(|e| {
            panic!("{answered} of {sent} requests answered, then nothing: {e}")
        });
        let answer = &mut answers[reply.tag as usize];
        assert!(answer.is_none(), "request {} answered twice", reply.tag);
        *answer = Some(reply.answer);
        answered += 1;
    }
    answers.into_iter().map(|a| a.expect("answered")).collect()
}

/// Sends `requests` in one burst, then those refused for back-pressure again, a few at a
/// time, until every one is carried out; checks each answer and counts it.
fn settle(
    client: &LogClient,
    channel: &(Sender<Reply>, Receiver<Reply>),
    mut todo: Vec<Request>,
    offsets: &mut [Option<LogOffset>],
    tally: &mut Tally,
) {
    let mut window = usize::MAX;
    for _round in 0..RETRY_ROUNDS_MAX {
        if todo.is_empty() {
            return;
        }
        let answers = exchange(client, channel, &todo, window);
        let mut again = Vec::new();
        for (request, answer) in todo.into_iter().zip(answers) {
            let refused = match (request, answer) {
                (Request::Append(seq), Answer::Appended(Ok(at))) => {
                    assert_eq!(at.shard, seq as usize % SHARDS, "record {seq}'s shard");
                    offsets[seq as usize] = Some(at);
                    tally.appends_acked[at.shard] += 1;
                    None
                }
                (Request::Append(seq), Answer::Appended(Err(e))) if e.is_back_pressure() => {
                    tally.appends_refused[seq as usize % SHARDS] += 1;
                    Some(request)
                }
                (Request::Read(seq, at), Answer::Read(Ok(bytes))) => {
                    assert!(
                        bytes == record(seq),
                        "record {seq} at {at:?} read back wrong"
                    );
                    tally.reads_ok[at.shard] += 1;
                    None
                }
                (Request::Read(_, at), Answer::Read(Err(e))) if e.is_back_pressure() => {
                    tally.reads_refused[at.shard] += 1;
                    Some(request)
                }
                (request, answer) => panic!("{request:?} answered {answer:?}"),
            };
            again.extend(refused);
        }
        if window == usize::MAX {
            tally.burst_refusals += again.len() as u64;
        }
        todo = again;
        window = RETRY_WINDOW;
    }
    panic!("requests still refused after {RETRY_ROUNDS_MAX} rounds");
}

/// The client thread's work: appends, reads mixed with more appends, every record read
/// back, then requests the store must turn down. Returns what it saw, where each record
/// is, and its reply channel, to show nothing more arrives on it.
fn run_client(client: LogClient) -> (Tally, Vec<Option<LogOffset>>, Receiver<Reply>) {
    let channel = mpsc::channel();
    let mut offsets = vec![None; APPENDS as usize];
    let mut tally = Tally::default();
    let half = APPENDS / 2;
    let first = (0..half).map(Request::Append).collect();
    settle(&client, &channel, first, &mut offsets, &mut tally);
    // Reads of the first half among appends of the second: commits and reads share the
    // queue pair.
    let read = |offsets: &[Option<LogOffset>], seq: u64| {
        Request::Read(seq, offsets[seq as usize].expect("acknowledged"))
    };
    let mixed = (half..APPENDS)
        .flat_map(|seq| [Request::Append(seq), read(&offsets, seq - half)])
        .collect();
    settle(&client, &channel, mixed, &mut offsets, &mut tally);
    let all = (0..APPENDS).map(|seq| read(&offsets, seq)).collect();
    settle(&client, &channel, all, &mut offsets, &mut tally);
    bad_requests(&client, &channel, &offsets, &mut tally);
    let (_tx, rx) = channel;
    (tally, offsets, rx)
}

/// Requests the store must turn down, each with its own error.
fn bad_requests(
    client: &LogClient,
    channel: &(Sender<Reply>, Receiver<Reply>),
    offsets: &[Option<LogOffset>],
    tally: &mut Tally,
) {
    let (tx, rx) = channel;
    let ask = |send: &dyn Fn() -> Result<(), hypoll_reactor::SendError>| {
        send().expect("sent");
        rx.recv_timeout(ANSWER_WAIT).expect("answered").answer
    };
    let at = offsets[1].expect("acknowledged");
    let inside = LogOffset {
        offset_bytes: at.offset_bytes + 1,
        ..at
    };
    let not_a_record = StoreError::NotARecord {
        offset_bytes: inside.offset_bytes,
    };
    assert_eq!(
        ask(&|| client.read(inside, 0, tx)),
        Answer::Read(Err(not_a_record))
    );
    tally.reads_failed[at.shard] += 1;
    let past_end = LogOffset {
        offset_bytes: 1 << 40,
        ..at
    };
    let answer = ask(&|| client.read(past_end, 0, tx));
    assert!(
        matches!(answer, Answer::Read(Err(StoreError::NotDurable { .. }))),
        "{answer:?}"
    );
    tally.reads_refused[at.shard] += 1;
    let nowhere = LogOffset {
        shard: SHARDS,
        ..at
    };
    let answer = ask(&|| client.read(nowhere, 0, tx));
    assert!(
        matches!(answer, Answer::Read(Err(StoreError::NoSuchShard { .. }))),
        "{answer:?}"
    );
    let too_long = vec![0; RECORD_BYTES_MAX + 1];
    let answer = ask(&|| client.append(0, too_long.clone(), 0, tx));
    let error = StoreError::RecordTooLarge {
        len_bytes: RECORD_BYTES_MAX + 1,
        max_bytes: RECORD_BYTES_MAX,
    };
    assert_eq!(answer, Answer::Appended(Err(error)));
    tally.appends_refused[0] += 1;
}

/// Drives the store on device `spec` and checks everything above.
pub fn run(spec: &str) {
    let store = LogStore::start(Device::open(spec).unwrap(), config()).unwrap();
    let client = store.client();
    let (tally, offsets, rx) = std::thread::spawn(move || run_client(client))
        .join()
        .expect("the client thread finished");
    let stats = store.shutdown().expect("no reactor panicked");

    // Nothing answered after the client stopped counting, and nothing kept a reply channel.
    assert_eq!(
        rx.try_recv().err(),
        Some(TryRecvError::Disconnected),
        "{spec}"
    );
    assert!(tally.burst_refusals > 0, "{spec}: the bursts met no limit");

    // Each shard's log is dense: its records, by offset, tile it from byte 0.
    for shard in 0..SHARDS {
        let mut records: Vec<(u64, u64)> = (0..APPENDS)
            .filter_map(|seq| offsets[seq as usize].map(|at| (at, seq)))
            .filter(|(at, _)| at.shard == shard)
            .map(|(at, seq)| (at.offset_bytes, seq))
            .collect();
        records.sort_unstable();
        let mut end_bytes = 0;
        for (offset_bytes, seq) in records {
            assert_eq!(
                offset_bytes, end_bytes,
                "{spec}: shard {shard}, record {seq}"
            );
            end_bytes += (RECORD_HEADER_BYTES + record(seq).len()) as u64;
        }
    }

    assert_eq!(stats.len(), SHARDS);
    assert_ne!(
        stats[0].core, stats[1].core,
        "{spec}: each reactor has a core of its own"
    );
    for s in &stats {
        let i = s.shard;
        println!("{spec}: {s:?}");
        assert_eq!(s.policy, crate::policy::POLICY_NAME, "{spec}");
        // What the shard counted is what its client saw: no answer was lost.
        assert_eq!(s.appends_acked, tally.appends_acked[i], "{spec}: shard {i}");
        assert_eq!(
            s.appends_refused, tally.appends_refused[i],
            "{spec}: shard {i}"
        );
        assert_eq!(s.appends_failed, 0, "{spec}: shard {i}");
        assert_eq!(s.reads_ok, tally.reads_ok[i], "{spec}: shard {i}");
        assert_eq!(s.reads_refused, tally.reads_refused[i], "{spec}: shard {i}");
        assert_eq!(s.reads_failed, tally.reads_failed[i], "{spec}: shard {i}");
        // Group commit batched appends, and commits whose span wrapped the ring (two
        // segments) carried records that read back.
        assert!(
            s.commit_appends_max > 1,
            "{spec}: shard {i}: no commit carried two appends"
        );
        assert!(s.commits < s.appends_acked, "{spec}: shard {i}");
        assert!(
            s.commits_wrapped > 0,
            "{spec}: shard {i}: the ring never wrapped"
        );
        // Reads outlast the policy's spin, so the reactor waited for interrupts.
        assert!(s.interrupt_waits > 0, "{spec}: shard {i}");
    }
    let requeued: u64 = stats
        .iter()
        .map(|s| s.reads_requeued + s.commits_requeued)
        .sum();
    assert!(
        requeued > 0,
        "{spec}: the queue pairs never refused an I/O for being full"
    );
}

/// The checks on an emulated NAND drive (512-byte blocks).
pub fn on_emulated_nand() {
    run("emu:nand,size=64M");
}

/// The checks on an io_uring file (4 KiB blocks, O_DIRECT).
pub fn on_a_uring_file() {
    // Under the target directory, on a disk: O_DIRECT (the default) fails on tmpfs.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = dir.path().join("log.img");
    // Not zeros: a read that strayed from what was written would not pass for a record.
    let mut f = std::fs::File::create(&file).unwrap();
    f.write_all(&vec![0xa5u8; 64 << 20]).unwrap();
    f.sync_all().unwrap();
    // iopoll=off: completions by interrupt, which the policy waits for.
    run(&format!("uring:{},iopoll=off", file.display()));
}
