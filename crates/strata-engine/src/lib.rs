//! strata's volume engine.
//!
//! An [`Engine`] is one node: a catalog, an object store with its node cache, and the volumes
//! attached here. A [`Volume`] serves one workspace: writes go to a local journal, FLUSH is a
//! group commit, reads resolve journal → node cache → object store, and publishing (checkpoint,
//! background upload, sync flush) turns the journal into immutable objects and a new manifest
//! and moves the head by compare-and-set. See docs/ARCHITECTURE.md for the map.

mod block;
mod blocking;
mod config;
pub mod confine;
mod engine;
mod error;
/// The injectable file layer (`strata-fs`).
pub use strata_fs as fs;
pub mod gc;
mod journal;
mod local;
mod overlay;
mod pack;
mod space;
pub mod template;
mod volume;

pub use config::{
    cache_unsafe, cache_unsafe_from_env, EngineConfig, MAX_SEGMENT_BYTES, UNSAFE_ENV,
};
pub use engine::{tempdir_in, Engine, Source};
pub use error::{is_no_space, Error, Result};
pub use gc::{GcOptions, GcReport, TenantFailure, RECONCILE_AFTER};
pub use local::LocalState;
pub use volume::{CheckpointState, DurationSchema, Published, Volume, VolumeOptions, VolumeStats};

pub use strata_catalog::{Checkpoint, CheckpointKind, Mode, Template, Workspace};

pub(crate) use strata_format::now_ms;
