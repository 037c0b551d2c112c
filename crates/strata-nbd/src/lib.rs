//! strata's NBD front-end: a server written from the protocol specification
//! (NetworkBlockDevice/nbd `doc/proto.md`) and a small client for tests and tools.
//!
//! - [`proto`]: wire constants and parsers of untrusted bytes.
//! - [`server`]: negotiation and concurrent transmission over unix sockets and TCP.
//! - [`device`]: what is served: engine volumes or an in-memory disk.
//! - [`client`]: a minimal fixed-newstyle client with structured replies and block status.

pub mod client;
pub mod device;
pub mod metrics;
pub mod proto;
pub mod server;

pub use device::{BlockDevice, DevError, MemDevice, ReadOnly};
pub use metrics::NbdMetrics;
pub use server::{Alive, Conn, Export, Exports, Server, ServerConfig};
