//! Opening a volume: deciding whether a local journal still applies to the catalog head,
//! loading the base manifest, replaying the journal and making what survived durable.

use super::*;

impl Volume {
    /// Opens the volume for a workspace whose lease `p.lease` is held: decides whether the local
    /// journal (if any) still applies to the catalog head, loads the base manifest, replays the
    /// journal and makes the replayed records durable.
    pub(crate) async fn open(p: VolumeParts) -> Result<Arc<Volume>> {
        let ws = p.catalog.get_workspace(&p.tenant, &p.name).await?;
        let head = p
            .catalog
            .get_checkpoint(&p.tenant, &p.name, ws.head_version)
            .await?;
        let local = LocalState::load(&*p.fs, &p.dir)?;
        let loaded = local.clone();
        // Based on the catalog's head, of this very workspace (not of a deleted one whose
        // name was given again to a workspace starting from the same manifest).
        let ours = |l: &LocalState| {
            l.base_version == ws.head_version
                && l.base_manifest == ws.head_manifest
                && l.same_incarnation(ws.created_ms)
        };
        if head.kind == CheckpointKind::LiveFork && !local.as_ref().is_some_and(ours) {
            // Its head is only the base: the rest is in a journal on the node that forked it.
            return Err(Error::Unavailable(
                p.name.clone(),
                "a fork of a live workspace whose data is still only on the node that forked it; it can be attached anywhere once it has published (that node publishes it right after the fork). If that node is lost for good, the fork is lost with it: delete it".into(),
            ));
        }
        let (journal_id, base_seq) = match local {
            Some(l) if head.journal_id.as_deref() == Some(l.journal_id.as_str()) => {
                // We published the head ourselves (possibly without recording it locally).
                (l.journal_id, head.cut_seq.max(l.base_seq))
            }
            Some(l) if ours(&l) => (l.journal_id, l.base_seq),
            Some(l) => {
                tracing::warn!(
                    tenant = %p.tenant, workspace = %p.name, local_base = l.base_version,
                    head = ws.head_version,
                    "local journal is based on a head that has since moved elsewhere; discarding it"
                );
                p.fs.remove_dir_all(&p.dir)
                    .map_err(Error::io("discarding stale journal"))?;
                (new_journal_id(), 0)
            }
            None => {
                // Without local state nothing here is this workspace's: not a journal (an
                // interrupted fork's links), not recorded cuts.
                p.fs.remove_dir_all(&p.dir)
                    .map_err(Error::io("clearing a volume directory without state"))?;
                (new_journal_id(), 0)
            }
        };
        p.fs.create_dir_all(&p.dir)
            .map_err(Error::io(format!("creating {}", p.dir.display())))?;
        // A live fork's base is its source's, already decoded there: shared, not read again.
        let inherited_base = p
            .inherit
            .as_ref()
            .filter(|i| i.base.0 == ws.head_manifest)
            .map(|i| i.base.1.clone());
        let base = match inherited_base {
            Some(b) => b,
            None => Arc::new(
                p.reader
                    .store()
                    .get_manifest(&p.tenant, &ws.head_manifest)
                    .await?,
            ),
        };
        if base.disk_size != ws.disk_size {
            return Err(Error::Invalid(format!(
                "manifest {} describes {} bytes, workspace says {}",
                ws.head_manifest, base.disk_size, ws.disk_size
            )));
        }
        let inherited = p.inherit.is_some();
        let state = LocalState {
            format: crate::local::LOCAL_FORMAT,
            tenant: p.tenant.clone(),
            workspace: p.name.clone(),
            journal_id: journal_id.clone(),
            base_version: ws.head_version,
            base_manifest: ws.head_manifest,
            base_seq,
            // A live fork keeps the state it just wrote (the first publish records the row's).
            created_ms: (!inherited).then_some(ws.created_ms),
        };
        if loaded.as_ref() != Some(&state) {
            state.store(&*p.fs, &p.dir)?;
        } else if !inherited {
            // Unchanged. Its content was synced before its rename (`write_atomic`), but a
            // process that stopped before the directory's fsync may have left the name
            // volatile. (A live fork's was stored whole by the fork, just before, in this
            // process.)
            p.fs.sync_dir(&p.dir)
                .map_err(Error::io(format!("syncing {}", p.dir.display())))?;
        }

        // Cuts recorded and not yet published: their records replay into their own layers.
        // Those the head already holds are published (two cuts with no write between them
        // share a sequence number: the reserved version tells them apart).
        let (fs, dir, jid) = (p.fs.clone(), p.dir.clone(), journal_id.clone());
        let (cut_log, entries) =
            crate::engine::blocking(move || super::cutlog::CutLog::open(fs, &dir, &jid)).await?;
        let mut recorded = super::cutlog::pending(entries);
        recorded.retain(|r| r.version > ws.head_version && r.cut >= base_seq);
        // Each recorded cut commits as the version its receipt named: a number whose cut was
        // never recorded (its record failed; no receipt was given) is kept by an empty stand-in.
        let mut recs: Vec<LayerRecord> = Vec::new();
        let mut last_cut = base_seq;
        for mut r in recorded {
            while ws.head_version + recs.len() as u64 + 1 < r.version {
                recs.push(LayerRecord {
                    cut: last_cut,
                    version: ws.head_version + recs.len() as u64 + 1,
                    kind: CheckpointKind::Auto,
                    label: None,
                    keep_until_ms: None,
                    disk_size: 0,
                    taken_ms: r.taken_ms,
                    adopt: None,
                    rollback_to: None,
                });
            }
            if r.cut < last_cut || r.disk_size > strata_format::manifest::MAX_DISK_SIZE {
                tracing::error!(tenant = %p.tenant, workspace = %p.name, version = r.version, "a recorded cut out of order or past the largest disk; kept at the previous cut");
                r.cut = last_cut;
                r.disk_size = 0;
            }
            last_cut = r.cut;
            recs.push(r);
        }
        let cuts: Vec<u64> = recs.iter().map(|r| r.cut).collect();
        // One overlay per layer, then the active one.
        let mut overlays: Vec<Overlay> = (0..=cuts.len()).map(|_| Overlay::default()).collect();
        let mut layer_bytes: Vec<u64> = vec![0; cuts.len() + 1];
        let mut files: HashMap<u64, SegFile> = HashMap::new();
        let disk_blocks = base.disk_blocks();
        // A live fork's inherited layer, shared with its source's.
        let mut shared: Option<(usize, Arc<Overlay>)> = None;
        let opened = if let Some(inh) = p.inherit {
            // A live fork: the source's merged layers stand for the replay of the linked
            // segments (the same records: its journal wrote and synced them at the cut).
            let (fs, dir, max) = (
                p.fs.clone(),
                p.dir.join("journal"),
                p.opts.segment_max_bytes,
            );
            let segs = inh.segs.clone();
            let j = crate::engine::blocking(move || {
                Journal::adopt(fs, &dir, &segs, inh.last_seq, max)
                    .map_err(Error::io("opening the fork's journal"))
            })
            .await?;
            for (id, ..) in &inh.segs {
                if let Some(f) = j.file(*id) {
                    files.insert(*id, SegFile::new(f));
                }
            }
            // In the layer recorded for them (the fork's first, `rebase.rs`), else the active.
            let at = cuts.partition_point(|&c| c < inh.last_seq);
            if at < cuts.len() {
                shared = Some((at, inh.overlay)); // a pending layer: kept shared
            } else {
                overlays[at] = Arc::unwrap_or_clone(inh.overlay); // the active one is written
            }
            layer_bytes[at] = inh.bytes;
            (j, 0)
        } else {
            Journal::open(
                p.fs.clone(),
                &p.dir.join("journal"),
                base_seq,
                p.opts.segment_max_bytes,
                |r, file| {
                    if r.lba + r.nblocks > disk_blocks {
                        tracing::error!(
                            lba = r.lba,
                            "journal record past the end of the disk; ignored"
                        );
                        return;
                    }
                    files
                        .entry(r.seg)
                        .or_insert_with(|| SegFile::new(file.clone()));
                    let layer = cuts.partition_point(|&c| c < r.seq);
                    let loc = match r.kind {
                        Kind::Write => {
                            layer_bytes[layer] += r.nblocks * BLOCK_SIZE;
                            Loc::Journal {
                                seg: r.seg,
                                off: r.data_off,
                            }
                        }
                        Kind::Zero => Loc::Zero,
                    };
                    overlays[layer].insert(r.lba, r.nblocks, r.seq, loc);
                },
            )
            .map_err(Error::io("replaying journal"))?
        };
        let (mut journal, discarded) = opened;
        if discarded > 0 {
            tracing::info!(tenant = %p.tenant, workspace = %p.name, discarded, "dropped torn journal tail");
        }
        // What survived a process crash may still be only in the page cache, the segments'
        // names too: make it durable now, so that "replayed" implies "flushed". (The new
        // active segment opening made is left to its first record, `Journal::fresh`. A live
        // fork's linked segments were synced by its source, their names by the fork.)
        let batch = journal.take_dirty();
        let replayed = files.values().map(|f| &f.file).filter(|_| !inherited);
        for f in replayed.chain(batch.files.iter().map(|(_, f)| f)) {
            f.sync_data()
                .map_err(Error::io("syncing replayed journal"))?;
        }
        let journal_dir = (!inherited).then(|| journal.dir().to_path_buf());
        if let Some(d) = batch.dir.or(journal_dir) {
            p.fs.sync_dir(&d)
                .map_err(Error::io("syncing journal directory"))?;
        }
        let active_seg = journal.active();
        if let Some(f) = journal.file(active_seg) {
            files.insert(active_seg, SegFile::new(f));
        }
        let last = journal.last_seq();
        let flush_honoured = match ws.mode {
            Mode::Ephemeral => false,
            Mode::Durable => !p.opts.cache_unsafe,
            Mode::Sync => true,
        };
        let active = overlays.pop().unwrap_or_default();
        let active_bytes = layer_bytes.pop().unwrap_or(0);
        let window = Window {
            bytes: active_bytes,
            since: (active_bytes > 0).then(Instant::now),
        };
        let mut pending: VecDeque<Layer> = recs
            .into_iter()
            .zip(overlays)
            .zip(layer_bytes)
            .enumerate()
            .map(|(i, ((rec, o), bytes))| Layer {
                rec,
                overlay: match shared.take_if(|(at, _)| *at == i) {
                    Some((_, layer)) => layer,
                    None => Arc::new(o),
                },
                bytes,
                since: Some(Instant::now()),
                under: None,
            })
            .collect();
        // A local rollback whose target is published reads that version's manifest.
        for l in pending.iter_mut() {
            match l.rec.rollback_to {
                Some(v) if v == ws.head_version => l.under = Some((ws.head_manifest, base.clone())),
                Some(v) if v < ws.head_version => {
                    let cp = p.catalog.get_checkpoint(&p.tenant, &p.name, v).await?;
                    let m = p
                        .reader
                        .store()
                        .get_manifest(&p.tenant, &cp.manifest)
                        .await?;
                    l.under = Some((cp.manifest, Arc::new(m)));
                }
                _ => {}
            }
        }
        if !pending.is_empty() {
            tracing::info!(tenant = %p.tenant, workspace = %p.name, pending = pending.len(), "resuming the publication of cuts taken before the restart");
        }
        Ok(Arc::new_cyclic(|me| Volume {
            me: me.clone(),
            freeze: tokio::sync::Mutex::new(None),
            frozen_flag: AtomicBool::new(false),
            sealed: AtomicBool::new(false),
            ambiguous: AtomicBool::new(false),
            tenant: p.tenant,
            name: p.name,
            mode: ws.mode,
            disk_size: AtomicU64::new(ws.disk_size),
            flush_honoured,
            dir: p.dir,
            fs: p.fs,
            reader: p.reader,
            catalog: p.catalog,
            space: p.space,
            budget: {
                p.budget.register(&journal.held());
                p.budget
            },
            lease: Mutex::new(p.lease),
            lease_deadline: Mutex::new(super::lease::lease_deadline(
                p.lease_asked,
                p.opts.lease_ttl,
            )),
            renewal_stopped: AtomicBool::new(false),
            journal_id,
            created_ms: ws.created_ms,
            opts: p.opts,
            gate: Arc::new(tokio::sync::RwLock::new(())),
            journal_held: journal.held(),
            writer: tokio::sync::Mutex::new(journal),
            in_flight: AtomicU64::new(0),
            landed: tokio::sync::Notify::new(),
            unlanded: Mutex::new(Default::default()),
            prefix_landed: tokio::sync::Notify::new(),
            state: RwLock::new(State {
                base,
                base_id: ws.head_manifest,
                base_version: ws.head_version,
                pending,
                active,
                files,
                keep_fixed: ws.head_version,
            }),
            sync_lock: tokio::sync::Mutex::new(()),
            cut_lock: tokio::sync::Mutex::new(()),
            cut_waiting: Default::default(),
            publish_lock: tokio::sync::Mutex::new(()),
            cut_log: Mutex::new(cut_log),
            retire_lock: tokio::sync::Mutex::new(()),
            live_fork: AtomicBool::new(head.kind == CheckpointKind::LiveFork),
            adopt_source: Mutex::new(None),
            receipts: Mutex::new(VecDeque::new()),
            acked_seq: AtomicU64::new(last),
            synced_seq: AtomicU64::new(last),
            published_seq: AtomicU64::new(base_seq),
            window: Mutex::new(window),
            upload_due: Default::default(),
            publish_total: AtomicU64::new(0),
            publish_done: AtomicU64::new(0),
            failed: Mutex::new(None),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
        }))
    }
}
