//! strata's NBD front-end: a server written from the protocol specification
//! (NetworkBlockDevice/nbd `doc/proto.md`) and a small client for tests and tools.
//!
//! - [`proto`]: wire constants and parsers of untrusted bytes.
//! - [`server`]: negotiation and concurrent transmission over unix sockets and TCP.
//! - what is served is a [`BlockDevice`] (`strata-block`: engine volumes, an in-memory disk);
//!   this crate knows nothing of the engine.
//! - [`client`]: a minimal fixed-newstyle client with structured replies and block status.

pub mod client;
pub mod metrics;
pub mod proto;
pub mod server;

pub use metrics::NbdMetrics;
pub use server::{Alive, Conn, Export, Exports, Server, ServerConfig};
pub use strata_block::{BlockDevice, DevError, DevResult, MemDevice, ReadOnly};
