//! The async log store example (`examples/logstore_async`), held to what the callback
//! version's test (`reactor/tests/logstore.rs`) holds it to, driven the same way from a
//! client thread, on an emulated NAND drive (512-byte blocks) and on an io_uring file
//! (4 KiB blocks, O_DIRECT): every acknowledged record reads back byte for byte, the log is
//! dense, every request is answered exactly once (refusals included: each one the store
//! counted reached the client), and appends were batched by group commit.

// The store's modules as the example has them, and the callback version's checks.
#[path = "../../reactor/examples/logstore/policy.rs"]
mod policy;
#[path = "../examples/logstore_async/shard.rs"]
mod shard;
#[path = "../../reactor/examples/logstore/store.rs"]
mod store;

#[path = "../../reactor/tests/logstore_checks/mod.rs"]
mod logstore_checks;

#[test]
fn every_acknowledged_record_reads_back_on_emulated_nand() {
    logstore_checks::on_emulated_nand();
}

#[test]
fn every_acknowledged_record_reads_back_on_a_uring_file() {
    logstore_checks::on_a_uring_file();
}
