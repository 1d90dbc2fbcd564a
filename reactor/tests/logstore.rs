//! The log store example (`examples/logstore`), driven from a client thread as an embedder's
//! clients would, on an emulated NAND drive (512-byte blocks) and on an io_uring file
//! (4 KiB blocks, O_DIRECT): every acknowledged record reads back byte for byte, the log is
//! dense, every request is answered exactly once (refusals included: each one the store
//! counted reached the client), and appends were batched by group commit.

// The store's modules, beside each other as in the example.
#[path = "../examples/logstore/policy.rs"]
mod policy;
#[path = "../examples/logstore/shard.rs"]
mod shard;
#[path = "../examples/logstore/store.rs"]
mod store;

mod logstore_checks;

#[test]
fn every_acknowledged_record_reads_back_on_emulated_nand() {
    logstore_checks::on_emulated_nand();
}

#[test]
fn every_acknowledged_record_reads_back_on_a_uring_file() {
    logstore_checks::on_a_uring_file();
}
