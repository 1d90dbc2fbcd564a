//! hypoll-nvmf: an NVMe over TCP target, written from the NVMe over Fabrics and NVMe/TCP
//! transport specifications: the protocol as a socket-free state machine, and the front
//! end that drives it over sockets on hypoll reactors (the shared machinery of
//! `hypoll_frontend`).
//!
//! - [`session`]: one connection (one queue) as a state machine over bytes, with no
//!   sockets, clocks or devices: ICReq/ICResp, Connect, the admin command set a Linux host
//!   uses, the I/O commands, in-capsule and R2T-solicited write data, C2HData for reads,
//!   termination requests. Bytes go in, bytes and I/O commands come out, completions go
//!   back in. Fuzzed by `tests/fuzz.rs` over the conversations of `fuzz-corpus/`.
//! - [`target`]: what all connections to one target share.
//! - [`config`]: the subsystem, its namespaces and the limits.
//! - [`identify`]: Identify data structures and log pages.
//! - [`client`]: what a host sends, byte for byte, for tests and the fuzz corpus.
//! - `shard.rs`: NVMe/TCP's state on a reactor ([`Nvmf`]) and per connection, the parser
//!   loop and the keep-alive tick; `pipeline.rs`: a command as device commands;
//!   `answer.rs`: its answer, a read's data sent from the device's buffers.
//! - [`server`]: a server of its own ([`NvmfServer`]), and the target an export list makes.
//!
//! # What the queues of one controller share
//!
//! A controller is an admin queue and its I/O queues, each a TCP connection that may live
//! on a different reactor. The protocol lets them share very little, and they share no
//! more:
//!
//! - in the target's registry, behind one lock that only Connect, Set Features (Number of
//!   Queues), a controller reset and a connection's end take: the controller ID, the host's
//!   NQN and host ID (an I/O queue's Connect must match them), whether it is a discovery
//!   controller, the I/O queues granted and which queue IDs are connected;
//! - in the controller's link, two atomic flags: whether it lives (an I/O queue reads it
//!   once per step and closes when it clears) and whether it is ready (CSTS.RDY, which an
//!   I/O queue's Connect requires).
//!
//! CC, CSTS, KATO, the keep-alive deadline, the async event configuration and the held
//! Asynchronous Event Requests are the admin queue's alone: Property Get/Set, Keep Alive,
//! Set/Get Features and AER travel only on the admin queue, and the controller does not
//! announce traffic-based keep-alive (TBKAS), so an I/O command does not reset the timer.
//! The I/O path therefore takes no lock.
//!
//! # Limits
//!
//! Everything a host can make the target hold is bounded ([`config::Limits`]): controllers,
//! I/O queues per controller, commands per queue (its entries, at most
//! `queue_entries_max`), bytes per command (MDTS), in-capsule bytes per command, bytes per
//! H2CData PDU (MAXH2CDATA), solicited write bytes and R2Ts per connection, held AERs per
//! controller, Dataset Management ranges per command (256), and the longest PDU
//! ([`Session::pdu_bytes_max`]).

mod answer;
pub mod client;
pub mod config;
pub mod identify;
mod pipeline;
pub mod server;
pub mod session;
mod shard;
pub mod target;

pub use config::{ConfigError, DiscoveryEntry, Limits, NamespaceConfig, TargetConfig};
pub use server::{NvmfConfig, NvmfError, NvmfExport, NvmfServer};
pub use session::{BlockRange, Close, CompleteError, IoCommand, IoOp, Session, Step, WriteData};
pub use shard::{Nvmf, NvmfConn, TICK_PERIOD};
pub use target::Target;
