//! Property test: random sequences of write / trim / write-zeroes / flush / checkpoint (published,
//! or local: returned at its cut, forks and rollbacks of it wait for its publication) / fork /
//! rollback / grow (and writes at the grown end) / restore-on-another-node / reopen against an
//! in-memory model disk. Every read and every final image must match the model exactly.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use strata_engine::{Engine, Mode, Source};
use strata_simfs::SimFs;

const DISK: u64 = 256 * 4096;

#[derive(Clone, Debug)]
enum Op {
    Write {
        ws: usize,
        off: u64,
        len: u64,
        byte: u8,
    },
    Trim {
        ws: usize,
        off: u64,
        len: u64,
    },
    Zero {
        ws: usize,
        off: u64,
        len: u64,
    },
    Read {
        ws: usize,
        off: u64,
        len: u64,
    },
    Flush {
        ws: usize,
    },
    Checkpoint {
        ws: usize,
    },
    /// A checkpoint returned at its cut (published in the background).
    LocalCheckpoint {
        ws: usize,
    },
    Fork {
        ws: usize,
        pick: usize,
    },
    Rollback {
        ws: usize,
        pick: usize,
    },
    Restore {
        ws: usize,
    },
    /// Grows the disk by `blocks` blocks.
    Grow {
        ws: usize,
        blocks: u64,
    },
    /// Writes the disk's last block (past the first size once grown).
    WriteEnd {
        ws: usize,
        byte: u8,
    },
    Reopen,
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        // Block aligned.
        (0..256u64, 1..24u64).prop_map(|(b, n)| (b * 4096, (n * 4096).min(DISK - b * 4096))),
        // Arbitrary bytes.
        (0..DISK - 1, 1..20_000u64).prop_map(|(o, n)| (o, n.min(DISK - o))),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let ws = 0..3usize;
    prop_oneof![
        6 => (ws.clone(), range(), any::<u8>()).prop_map(|(ws, (off, len), byte)| Op::Write { ws, off, len, byte }),
        1 => (ws.clone(), range()).prop_map(|(ws, (off, len))| Op::Trim { ws, off, len }),
        1 => (ws.clone(), range()).prop_map(|(ws, (off, len))| Op::Zero { ws, off, len }),
        2 => (ws.clone(), range()).prop_map(|(ws, (off, len))| Op::Read { ws, off, len }),
        1 => ws.clone().prop_map(|ws| Op::Flush { ws }),
        1 => ws.clone().prop_map(|ws| Op::Checkpoint { ws }),
        2 => ws.clone().prop_map(|ws| Op::LocalCheckpoint { ws }),
        1 => (ws.clone(), any::<usize>()).prop_map(|(ws, pick)| Op::Fork { ws, pick }),
        1 => (ws.clone(), any::<usize>()).prop_map(|(ws, pick)| Op::Rollback { ws, pick }),
        1 => ws.clone().prop_map(|ws| Op::Restore { ws }),
        1 => (ws.clone(), 1..8u64).prop_map(|(ws, blocks)| Op::Grow { ws, blocks }),
        1 => (ws.clone(), any::<u8>()).prop_map(|(ws, byte)| Op::WriteEnd { ws, byte }),
        1 => Just(Op::Reopen),
    ]
}

struct World {
    cluster: Cluster,
    fs: Arc<SimFs>,
    node: Arc<Engine>,
    /// Workspace names (index -> name) and their model disks.
    names: Vec<String>,
    disks: Vec<Vec<u8>>,
    /// Checkpointed images per workspace name: version -> image.
    history: HashMap<String, Vec<(u64, Vec<u8>)>>,
    forks: usize,
}

impl World {
    async fn new() -> World {
        let cluster = Cluster::new().await;
        let fs = Arc::new(SimFs::new());
        let node = cluster.node_with(cluster.config("a"), fs.clone());
        let mut w = World {
            cluster,
            fs,
            node,
            names: vec![],
            disks: vec![],
            history: HashMap::new(),
            forks: 0,
        };
        for i in 0..3 {
            let name = format!("w{i}");
            let mode = [Mode::Durable, Mode::Sync, Mode::Ephemeral][i];
            w.node
                .create_workspace(TENANT, &name, Source::Empty { size: DISK }, mode, None)
                .await
                .unwrap();
            w.node.attach(TENANT, &name).await.unwrap();
            w.history
                .insert(name.clone(), vec![(1, vec![0; DISK as usize])]);
            w.names.push(name);
            w.disks.push(vec![0; DISK as usize]);
        }
        w
    }

    async fn vol(&self, ws: usize) -> Arc<strata_engine::Volume> {
        self.node.attach(TENANT, &self.names[ws]).await.unwrap()
    }

    async fn apply(&mut self, op: Op) {
        match op {
            Op::Write { ws, off, len, byte } => {
                let data: Vec<u8> = (0..len)
                    .map(|i| byte.wrapping_add((i / 512) as u8) | 1)
                    .collect();
                self.vol(ws)
                    .await
                    .write(off, &data, byte % 5 == 0)
                    .await
                    .unwrap();
                self.disks[ws][off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            Op::Trim { ws, off, len } => {
                self.vol(ws).await.trim(off, len).await.unwrap();
                // Whole blocks inside the range read as zeros; partial blocks are untouched.
                let a = off.div_ceil(4096) * 4096;
                let b = (off + len) / 4096 * 4096;
                if a < b {
                    self.disks[ws][a as usize..b as usize].fill(0);
                }
            }
            Op::Zero { ws, off, len } => {
                self.vol(ws)
                    .await
                    .write_zeroes(off, len, false)
                    .await
                    .unwrap();
                self.disks[ws][off as usize..(off + len) as usize].fill(0);
            }
            Op::Read { ws, off, len } => {
                let got = self.vol(ws).await.read(off, len).await.unwrap();
                assert!(
                    got == self.disks[ws][off as usize..(off + len) as usize],
                    "read {off}+{len} of {} differs",
                    self.names[ws]
                );
            }
            Op::Flush { ws } => self.vol(ws).await.flush().await.unwrap(),
            Op::Checkpoint { ws } => {
                let p = self
                    .node
                    .checkpoint(TENANT, &self.names[ws], None)
                    .await
                    .unwrap();
                self.history
                    .get_mut(&self.names[ws])
                    .unwrap()
                    .push((p.version, self.disks[ws].clone()));
            }
            Op::LocalCheckpoint { ws } => {
                let p = self
                    .vol(ws)
                    .await
                    .checkpoint_with(None, None, false)
                    .await
                    .unwrap();
                assert_eq!(p.state, strata_engine::CheckpointState::Local);
                self.history
                    .get_mut(&self.names[ws])
                    .unwrap()
                    .push((p.version, self.disks[ws].clone()));
            }
            Op::Fork { ws, pick } => {
                let src = self.names[ws].clone();
                let h = &self.history[&src];
                let (version, image) = h[pick % h.len()].clone();
                self.forks += 1;
                let name = format!("f{}", self.forks);
                let w = self
                    .node
                    .fork(TENANT, &src, Some(version), &name, None)
                    .await
                    .unwrap();
                assert_eq!(w.head_version, 1);
                // The fork replaces this slot; the source stays attached and keeps its history.
                self.node.detach(TENANT, &self.names[ws]).await.unwrap();
                self.node.attach(TENANT, &name).await.unwrap();
                self.history.insert(name.clone(), vec![(1, image.clone())]);
                self.names[ws] = name;
                self.disks[ws] = image;
            }
            Op::Rollback { ws, pick } => {
                let name = self.names[ws].clone();
                let h = &self.history[&name];
                let (version, mut image) = h[pick % h.len()].clone();
                // An older, smaller version comes back on today's disk: its new end is zeros.
                image.resize(image.len().max(self.disks[ws].len()), 0);
                let p = self.node.rollback(TENANT, &name, version).await.unwrap();
                self.history
                    .get_mut(&name)
                    .unwrap()
                    .push((p.version, image.clone()));
                self.disks[ws] = image;
            }
            Op::Grow { ws, blocks } => {
                let to = self.disks[ws].len() as u64 + blocks * 4096;
                let p = self.vol(ws).await.grow(to).await.unwrap().unwrap();
                self.disks[ws].resize(to as usize, 0);
                self.history
                    .get_mut(&self.names[ws])
                    .unwrap()
                    .push((p.version, self.disks[ws].clone()));
            }
            Op::WriteEnd { ws, byte } => {
                let off = self.disks[ws].len() - 4096;
                let data = vec![byte | 1; 4096];
                self.vol(ws)
                    .await
                    .write(off as u64, &data, false)
                    .await
                    .unwrap();
                self.disks[ws][off..].copy_from_slice(&data);
            }
            Op::Restore { ws } => {
                // Detach here (publishing), restore on a fresh node, compare, come back.
                let name = self.names[ws].clone();
                let ephemeral =
                    self.node.workspace(TENANT, &name).await.unwrap().mode == Mode::Ephemeral;
                self.node.detach(TENANT, &name).await.unwrap();
                if ephemeral {
                    // Unpublished writes of an ephemeral workspace are discarded on detach.
                    let h = &self.history[&name];
                    let head = self
                        .node
                        .workspace(TENANT, &name)
                        .await
                        .unwrap()
                        .head_version;
                    self.disks[ws] = h
                        .iter()
                        .find(|(v, _)| *v == head)
                        .map(|(_, i)| i.clone())
                        .unwrap_or_else(|| h.last().unwrap().1.clone());
                }
                let b = self.cluster.node_with(
                    self.cluster.config(&format!("b{ws}")),
                    Arc::new(SimFs::new()),
                );
                let v = b.attach(TENANT, &name).await.unwrap();
                assert_eq!(v.size(), self.disks[ws].len() as u64);
                let got = v.read(0, v.size()).await.unwrap();
                assert!(
                    got == self.disks[ws],
                    "restore of {name} on another node differs"
                );
                b.detach(TENANT, &name).await.unwrap();
                // The other node's detach published nothing new; record the head for rollback.
                let head = self
                    .node
                    .workspace(TENANT, &name)
                    .await
                    .unwrap()
                    .head_version;
                self.history
                    .get_mut(&name)
                    .unwrap()
                    .push((head, self.disks[ws].clone()));
                self.node.attach(TENANT, &name).await.unwrap();
            }
            Op::Reopen => {
                // A process crash: volumes dropped without publishing; the page cache survives.
                self.node.abandon().await;
                self.node = self
                    .cluster
                    .node_with(self.cluster.config("a"), self.fs.clone());
                for n in &self.names {
                    self.node.attach(TENANT, n).await.unwrap();
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 200, ..ProptestConfig::default() })]
    #[test]
    fn volumes_match_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let mut w = World::new().await;
            for op in ops {
                w.apply(op).await;
            }
            for ws in 0..3 {
                let v = w.vol(ws).await;
                assert_eq!(v.size(), w.disks[ws].len() as u64, "size of {}", w.names[ws]);
                let got = v.read(0, v.size()).await.unwrap();
                assert!(got == w.disks[ws], "final image of {} differs", w.names[ws]);
            }
        });
    }
}
