//! The log store of `reactor/examples/logstore`, written with `async` tasks: two reactors
//! each own a shard of the device; appends are batched into 4 KiB blocks (group commit)
//! and acknowledged once their write has completed; records are read back by the offset an
//! append answered; the reactors run the store's own poll policy ("spin 20 us, then wait
//! for the interrupt"). Same interface, same log on the device, same client below.
//!
//! `cargo run --release -p hypoll-async --example logstore_async -- [device] [records]`
//! e.g. `... -- emu:nand 20000` (the defaults) or `... -- uring:/tmp/log.img,size=256M`
//!
//! The client (`reactor/examples/logstore/demo.rs`), the store's interface (`store.rs`)
//! and its poll policy (`policy.rs`) are the callback version's files; `shard.rs` here,
//! a reactor's part of the store as tasks, is what async changes.

// The store's interface, its policy and the demonstration client are the callback
// version's files; `shard.rs` here is what async changes.
#[path = "../../../reactor/examples/logstore/demo.rs"]
mod demo;
#[path = "../../../reactor/examples/logstore/policy.rs"]
mod policy;
mod shard;
#[path = "../../../reactor/examples/logstore/store.rs"]
mod store;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    demo::main()
}
