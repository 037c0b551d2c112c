//! Conformance: the incremental mark (the change log the triggers keep) against the full mark,
//! over a random history of heads, forks, expiries, deletions, templates, crashed publishes
//! and references to unrecorded manifests.

use std::collections::{HashMap, HashSet};

use super::*;

/// A small deterministic generator (the suite has no RNG dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What GC built on the incremental mark would do, checked against the full mark after every
/// round: everything the log finds stale is unreferenced by the full mark (it never condemns a
/// live key), and everything the full mark finds stale was found, now or by an earlier round
/// whose condemnation still stands (it misses nothing the catalog knows). The re-mark of
/// condemned keys agrees with the full mark, and condemned keys are pruned as GC would.
pub(super) async fn the_change_log_finds_what_the_full_mark_finds(cat: &dyn Catalog, time: &Time) {
    const T: &str = "inc";
    cat.create_tenant(T).await.unwrap();
    let mut rng = Rng(0x5eed_1234_abcd);
    let next_id = std::cell::Cell::new(0u32);
    let fresh_hash = |tag: &str| {
        next_id.set(next_id.get() + 1);
        Hash::of(format!("{tag}{}", next_id.get()).as_bytes())
    };
    let mut objects: Vec<ObjectRef> = vec![];
    // Workspaces: name → (head version, lease).
    let mut ws: HashMap<String, (u64, LeaseGrant)> = HashMap::new();
    let mut manifests: Vec<Hash> = vec![];
    let (mut cond_m, mut cond_o): (HashSet<Hash>, HashSet<Hash>) = Default::default();
    let mut found = 0usize;
    for round in 0..60u32 {
        for _ in 0..6 {
            // A manifest recorded with a few new objects and a few old ones.
            let record = async |rng: &mut Rng, objects: &mut Vec<ObjectRef>, m: Hash| {
                let mut objs = vec![];
                for _ in 0..1 + rng.below(3) {
                    let o = ObjectRef {
                        id: fresh_hash("object"),
                        data_len: 4096 * (1 + rng.below(4)),
                    };
                    objects.push(o);
                    objs.push(o);
                }
                for _ in 0..rng.below(3) {
                    if !objects.is_empty() {
                        objs.push(objects[rng.below(objects.len() as u64) as usize]);
                    }
                }
                cat.record_manifest(T, m, &objs).await.unwrap();
            };
            let names: Vec<String> = ws.keys().cloned().collect();
            let pick = |rng: &mut Rng| names[rng.below(names.len() as u64) as usize].clone();
            match rng.below(10) {
                // A new workspace, or a fork of an existing manifest, or (rarely) one whose
                // manifest the catalog has no record of.
                0 | 1 if ws.len() < 8 => {
                    let name = format!("w{}", fresh_hash("name").to_hex().get(..8).unwrap());
                    let m = match rng.below(4) {
                        0 if !manifests.is_empty() => {
                            manifests[rng.below(manifests.len() as u64) as usize]
                        }
                        1 => fresh_hash("unrecorded"),
                        _ => {
                            let m = fresh_hash("manifest");
                            record(&mut rng, &mut objects, m).await;
                            m
                        }
                    };
                    manifests.push(m);
                    cat.create_workspace(&new_ws(T, &name, m)).await.unwrap();
                    let g = cat
                        .acquire_lease(T, &name, "node", 3_600_000)
                        .await
                        .unwrap();
                    ws.insert(name, (1, g));
                }
                // A publish (or a crashed one: recorded, never referenced).
                2..=5 if !ws.is_empty() => {
                    let m = fresh_hash("manifest");
                    record(&mut rng, &mut objects, m).await;
                    if rng.below(5) == 0 {
                        continue;
                    }
                    manifests.push(m);
                    let name = pick(&mut rng);
                    let (v, g) = ws.get_mut(&name).unwrap();
                    *v = cat
                        .advance_head(T, &name, *v, g, &cp(m, None))
                        .await
                        .unwrap();
                }
                // Retention: some versions expire.
                6 if !ws.is_empty() => {
                    let name = pick(&mut rng);
                    let head = ws[&name].0;
                    let vs: Vec<u64> = (1..head).filter(|_| rng.below(2) == 0).collect();
                    cat.expire_checkpoints(T, &name, &vs).await.unwrap();
                }
                // A workspace deleted.
                7 if !ws.is_empty() => {
                    let name = pick(&mut rng);
                    let (_, g) = ws.remove(&name).unwrap();
                    cat.release_lease(T, &name, &g).await.unwrap();
                    cat.delete_workspace(T, &name).await.unwrap();
                }
                // A template made from a manifest, or one deleted.
                8 if !manifests.is_empty() => {
                    let name = format!("t{}", rng.below(3));
                    match cat.delete_template(T, &name).await {
                        Ok(()) | Err(CatalogError::NotFound { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if rng.below(2) == 0 {
                        let m = manifests[rng.below(manifests.len() as u64) as usize];
                        cat.create_template(&Template {
                            tenant: T.into(),
                            name,
                            manifest: m,
                            disk_size: 1 << 30,
                            stored_bytes: 0,
                            created_ms: now_ms(),
                        })
                        .await
                        .unwrap();
                    }
                }
                // A manifest nothing names yet (an upload in flight), recorded.
                _ => {
                    let m = fresh_hash("manifest");
                    record(&mut rng, &mut objects, m).await;
                    manifests.push(m);
                }
            }
        }
        // A GC round with no grace: purge, the incremental mark, the full mark to judge it.
        time.pass(std::time::Duration::from_millis(3)).await;
        cat.purge_expired_checkpoints(T, 0).await.unwrap();
        let ch = cat.gc_changes(T, 0, 0, 1 << 20).await.unwrap();
        assert!(!ch.more);
        let full = cat.gc_mark(T, 0).await.unwrap();
        let live_m: HashSet<Hash> = full.manifests.iter().copied().collect();
        let live_o: HashSet<Hash> = full.objects.iter().copied().collect();
        for m in &ch.stale_manifests {
            assert!(
                !live_m.contains(m),
                "round {round}: the log condemns live manifest {m}"
            );
        }
        for (o, _) in &ch.stale_objects {
            assert!(
                !live_o.contains(o),
                "round {round}: the log condemns live object {o}"
            );
        }
        let unrecorded: HashSet<Hash> = ch.unrecorded.iter().copied().collect();
        assert_eq!(
            unrecorded,
            full.unrecorded.iter().copied().collect::<HashSet<_>>(),
            "round {round}: referenced manifests without a record"
        );
        found += ch.stale_manifests.len() + ch.stale_objects.len();
        cond_m.extend(ch.stale_manifests.iter().copied());
        cond_o.extend(ch.stale_objects.iter().map(|(o, _)| *o));
        cat.gc_settle(T, &ch.settled).await.unwrap();
        // The re-mark: what was referenced again is forgotten; it agrees with the full mark.
        let ms: Vec<Hash> = cond_m.iter().copied().collect();
        let os: Vec<Hash> = cond_o.iter().copied().collect();
        let l = cat.gc_live(T, &ms, &os).await.unwrap();
        for m in &ms {
            assert_eq!(
                l.manifests.contains(m),
                live_m.contains(m),
                "round {round}: re-mark of {m}"
            );
        }
        for o in &os {
            assert_eq!(
                l.objects.contains(o),
                live_o.contains(o),
                "round {round}: re-mark of {o}"
            );
            if !l.objects.contains(o) {
                assert!(
                    l.dead_objects.iter().any(|(d, _)| d == o),
                    "its recorded length"
                );
            }
        }
        cond_m.retain(|m| !live_m.contains(m));
        cond_o.retain(|o| !live_o.contains(o));
        for m in &full.stale_manifests {
            assert!(
                cond_m.contains(m),
                "round {round}: the log missed stale manifest {m}"
            );
        }
        for (o, _) in &full.stale_objects {
            assert!(
                cond_o.contains(o),
                "round {round}: the log missed stale object {o}"
            );
        }
        // Every third round, what stayed condemned is deleted, its rows pruned with it.
        if round % 3 == 2 {
            let ms: Vec<Hash> = cond_m.drain().collect();
            let os: Vec<Hash> = cond_o.drain().collect();
            cat.prune_references(T, &ms, &os).await.unwrap();
            manifests.retain(|m| !ms.contains(m));
            objects.retain(|o| !os.contains(&o.id));
        }
    }
    assert!(found > 50, "the history made garbage: {found}");
    // A look with nothing changed since reads nothing but what it must keep looking at
    // (referenced manifests without a record).
    time.pass(std::time::Duration::from_millis(3)).await;
    let ch = cat.gc_changes(T, 0, 0, 1 << 20).await.unwrap();
    cat.gc_settle(T, &ch.settled).await.unwrap();
    let again = cat.gc_changes(T, 0, 0, 1 << 20).await.unwrap();
    assert_eq!(again.looked as usize, again.unrecorded.len(), "{again:?}");
    assert!(again.stale_manifests.is_empty() && again.stale_objects.is_empty());
    // A limit shorter than the log: the rest is for the next look.
    let m = fresh_hash("manifest");
    cat.record_manifest(T, m, &[]).await.unwrap();
    cat.record_manifest(T, fresh_hash("manifest"), &[])
        .await
        .unwrap();
    let part = cat.gc_changes(T, 60_000, 0, 1).await.unwrap();
    assert!(part.more && part.looked == 1, "{part:?}");
}

/// Retention's bookkeeping: a workspace is due when a checkpoint is added, labelled or kept,
/// or when the time retention named has come; done only as of the generation it looked at.
pub(super) async fn retention_is_due_on_change_or_time(cat: &dyn Catalog) {
    const T: &str = "due";
    cat.create_tenant(T).await.unwrap();
    cat.create_workspace(&new_ws(T, "a", h(1))).await.unwrap();
    cat.create_workspace(&new_ws(T, "b", h(1))).await.unwrap();
    let names = |d: &[RetentionDue]| d.iter().map(|d| d.workspace.clone()).collect::<Vec<_>>();
    let now = now_ms();
    let due = cat.retention_due(T, now, false).await.unwrap();
    assert_eq!(names(&due), ["a", "b"], "new workspaces are due");
    for d in &due {
        assert!(cat
            .retention_done(T, &d.workspace, d.generation, now + 1000)
            .await
            .unwrap());
    }
    assert!(cat.retention_due(T, now, false).await.unwrap().is_empty());
    assert_eq!(
        cat.retention_due(T, now, true).await.unwrap().len(),
        2,
        "all"
    );
    assert_eq!(
        names(&cat.retention_due(T, now + 1000, false).await.unwrap()),
        ["a", "b"],
        "time came"
    );
    for d in &due {
        assert!(cat
            .retention_done(T, &d.workspace, d.generation, u64::MAX)
            .await
            .unwrap());
    }
    // A checkpoint added: due, at the new head. Done as of an older generation: still due.
    let g = cat.acquire_lease(T, "a", "node", 60_000).await.unwrap();
    cat.advance_head(T, "a", 1, &g, &cp(h(2), None))
        .await
        .unwrap();
    let due = cat.retention_due(T, now, false).await.unwrap();
    assert_eq!(names(&due), ["a"]);
    assert_eq!(due[0].head_version, 2);
    assert!(!cat
        .retention_done(T, "a", due[0].generation - 1, u64::MAX)
        .await
        .unwrap());
    assert_eq!(cat.retention_due(T, now, false).await.unwrap().len(), 1);
    assert!(cat
        .retention_done(T, "a", due[0].generation, u64::MAX)
        .await
        .unwrap());
    assert!(
        cat.retention_due(T, u64::MAX - 1, false)
            .await
            .unwrap()
            .is_empty(),
        "never by time"
    );
    // Compaction candidates: a's lease released after its own publish; b never attached.
    let later = now_ms() + 60_000;
    assert!(
        cat.compaction_candidates(T, later, false)
            .await
            .unwrap()
            .is_empty(),
        "a's lease is held"
    );
    cat.release_lease(T, "a", &g).await.unwrap();
    assert!(
        cat.compaction_candidates(T, 0, false)
            .await
            .unwrap()
            .is_empty(),
        "not idle long enough"
    );
    assert_eq!(
        cat.compaction_candidates(T, later, false).await.unwrap(),
        [("a".to_string(), h(2))]
    );
    cat.compaction_judged(T, "a", h(1)).await.unwrap(); // not its head: ignored
    assert_eq!(
        cat.compaction_candidates(T, later, false)
            .await
            .unwrap()
            .len(),
        1
    );
    cat.compaction_judged(T, "a", h(2)).await.unwrap();
    assert!(
        cat.compaction_candidates(T, later, false)
            .await
            .unwrap()
            .is_empty(),
        "judged at its head"
    );
    assert!(
        cat.compaction_candidates(T, later, true)
            .await
            .unwrap()
            .is_empty(),
        "looked at again (all), still judged"
    );
    // Its head moves: a candidate again once detached.
    let g = cat.acquire_lease(T, "a", "node", 60_000).await.unwrap();
    cat.advance_head(T, "a", 2, &g, &cp(h(3), None))
        .await
        .unwrap();
    cat.release_lease(T, "a", &g).await.unwrap();
    assert_eq!(
        cat.compaction_candidates(T, later, false).await.unwrap(),
        [("a".to_string(), h(3))]
    );
}

/// The change log's edges (cold review of issue 46): every referenced manifest without a
/// record is reported whatever the read's limit; a stale manifest whose unreferenced object is
/// younger than the grace period keeps its rows until that object is stale too, so the object
/// is judged again rather than forgotten.
pub(super) async fn the_change_log_keeps_what_it_cannot_judge_yet(cat: &dyn Catalog, time: &Time) {
    const T: &str = "edge";
    cat.create_tenant(T).await.unwrap();
    let m = |n: u8| Hash::of(&[b'm', n]);
    let o = |n: u8| ObjectRef {
        id: Hash::of(&[b'o', n]),
        data_len: 4096,
    };
    // Many recorded manifests ahead of two referenced ones without a record.
    for n in 0..20 {
        cat.record_manifest(T, m(n), &[]).await.unwrap();
    }
    cat.create_workspace(&new_ws(T, "a", m(100))).await.unwrap();
    cat.create_workspace(&new_ws(T, "b", m(101))).await.unwrap();
    let first = cat.gc_changes(T, 60_000, 0, 3).await.unwrap();
    assert!(first.more && first.last_seq > 0, "{first:?}");
    let mut unrecorded = first.unrecorded.clone();
    unrecorded.sort();
    let mut want = vec![m(100), m(101)];
    want.sort();
    assert_eq!(unrecorded, want, "beyond the limit too");
    let next = cat.gc_changes(T, 60_000, first.last_seq, 3).await.unwrap();
    assert!(next.last_seq > first.last_seq, "paging: {next:?}");

    // M (old) links O; O's row is pruned and recorded again by N: O is younger than M.
    cat.record_manifest(T, m(50), &[o(1)]).await.unwrap();
    time.pass(std::time::Duration::from_millis(300)).await;
    cat.prune_references(T, &[], &[o(1).id]).await.unwrap();
    cat.record_manifest(T, m(51), &[o(1)]).await.unwrap();
    // Grace 150 ms: M is old, O is not: neither is condemned yet, and M's rows stay.
    let ch = cat.gc_changes(T, 150, 0, 1 << 20).await.unwrap();
    assert!(!ch.stale_manifests.contains(&m(50)), "{ch:?}");
    assert!(!ch.stale_objects.iter().any(|(id, _)| *id == o(1).id));
    cat.gc_settle(T, &ch.settled).await.unwrap();
    time.pass(std::time::Duration::from_millis(300)).await;
    let later = cat.gc_changes(T, 150, 0, 1 << 20).await.unwrap();
    assert!(
        later.stale_manifests.contains(&m(50)),
        "M's rows stayed while O was young: {later:?}"
    );
    assert!(
        later.stale_objects.iter().any(|(id, _)| *id == o(1).id),
        "O judged once stale: {later:?}"
    );
}
