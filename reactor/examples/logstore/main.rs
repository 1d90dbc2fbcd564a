//! A small append-only log store embedded in hypoll: two reactors each own a shard of the
//! device; appends are batched into 4 KiB blocks and acknowledged once their write has
//! completed; records are read back by the offset an append answered; the reactors run a
//! poll policy of the store's own ("spin 20 us, then wait for the interrupt").
//!
//! `cargo run --release -p hypoll-reactor --example logstore -- [device] [records]`
//! e.g. `... -- emu:nand 20000` (the defaults) or `... -- uring:/tmp/log.img,size=256M`
//!
//! The client (`demo.rs`) appends `records` records of 1 to 4088 bytes, keeping up to
//! `WINDOW` requests out at once and sending again those refused for back-pressure, reads
//! every one back and compares it, then prints what each shard did. `store.rs` is the
//! store's interface, `shard.rs` a reactor's part of it (its I/O, by callbacks), `log.rs`
//! the shard's log (ring, limits, record format), `policy.rs` the poll policy.

mod demo;
mod policy;
mod shard;
mod store;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    demo::main()
}
