//! The verified read path against a real local object directory.

use std::sync::Arc;

use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use strata_store::{NodeCache, ObjectReader, Store, StoreError};

/// A reader whose store is a local directory seen as a remote store would be (through
/// `object_store` only), so verified units are copied into the node cache.
fn reader(objs: &std::path::Path, cache: &std::path::Path, cap: u64) -> ObjectReader {
    let local = Store::open(&format!("file:{}", objs.display())).unwrap();
    let store = Store::from_object_store(local.default_inner().clone(), "remote-like");
    ObjectReader::new(store, NodeCache::open(cache, cap).unwrap(), 256 * 1024)
}

/// A reader on the embedded default: the local object directory itself.
fn local_reader(objs: &std::path::Path, cache: &std::path::Path) -> ObjectReader {
    let store = Store::open(&format!("file:{}", objs.display())).unwrap();
    ObjectReader::new(store, NodeCache::open(cache, 1 << 30).unwrap(), 256 * 1024)
}

fn cache_files(dir: &std::path::Path) -> usize {
    walk(dir)
        .into_iter()
        .filter(|p| !p.starts_with(dir.join("tmp")))
        .count()
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The embedded default keeps one copy of uploaded bytes: the object directory. Nothing is
/// written through to the node cache, and a unit verified once is read from the object file
/// in place (no second GET, no copy).
#[tokio::test]
async fn a_local_store_is_not_copied_into_the_node_cache() {
    let d = tempfile::tempdir().unwrap();
    let (objs, cdir) = (d.path().join("o"), d.path().join("c"));
    let r = local_reader(&objs, &cdir);
    let bytes = data(1_000_000);
    let obj = r.put_object("t1", &bytes).await.unwrap();
    let mut buf = vec![0; 4096];
    r.read_into("t1", &obj, 300_000, &mut buf).await.unwrap();
    assert_eq!(buf, &bytes[300_000..304_096]);
    assert_eq!(r.stats().gets, 0, "verified at upload, read in place");
    assert_eq!(cache_files(&cdir), 0, "no second copy in the node cache");
    // After a restart, a unit is fetched and verified once, then read in place.
    let r2 = local_reader(&objs, &cdir);
    r2.read_into("t1", &obj, 300_000, &mut buf).await.unwrap();
    let gets = r2.stats().gets;
    r2.read_into("t1", &obj, 310_000, &mut buf).await.unwrap();
    assert_eq!(buf, &bytes[310_000..314_096]);
    assert_eq!(r2.stats().gets, gets);
    assert_eq!(cache_files(&cdir), 0);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Reads in place keep object files open for the next read, a bounded number of them: 400
/// objects read twice leave at most 128 open (plus what tests running beside this one open).
/// A read across a unit boundary comes from the file in one piece.
#[tokio::test]
async fn reads_in_place_keep_a_bounded_number_of_files_open() {
    let d = tempfile::tempdir().unwrap();
    let r = local_reader(&d.path().join("o"), &d.path().join("c"));
    let bytes = data(600_000);
    let mut objs = vec![];
    for i in 0..400 {
        objs.push(r.put_object(&format!("t{}", i % 3), &bytes).await.unwrap());
    }
    let before = open_fds();
    let mut buf = vec![0; 8192];
    for _ in 0..2 {
        for (i, obj) in objs.iter().enumerate() {
            let at = 256 * 1024 - 4096 + i as u64; // spans units 0 and 1
            r.read_into(&format!("t{}", i % 3), obj, at, &mut buf)
                .await
                .unwrap();
            assert_eq!(buf, &bytes[at as usize..at as usize + 8192]);
        }
    }
    assert_eq!(r.stats().gets, 0, "verified at upload, read in place");
    let grown = open_fds().saturating_sub(before);
    assert!(grown <= 128 + 32, "{grown} files left open");
    assert!(grown >= 64, "object files are not kept open ({grown})");
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
}

#[tokio::test]
async fn range_reads_are_verified_and_cached() {
    let d = tempfile::tempdir().unwrap();
    let r = reader(&d.path().join("o"), &d.path().join("c"), 1 << 30);
    let bytes = data(1_000_000);
    let obj = r.put_object("t1", &bytes).await.unwrap();
    // A fresh reader (another node): nothing cached, everything fetched and verified.
    let r2 = reader(&d.path().join("o"), &d.path().join("c2"), 1 << 30);
    let mut buf = vec![0; 300_000];
    r2.read_into("t1", &obj, 123_456, &mut buf).await.unwrap();
    assert_eq!(buf, &bytes[123_456..423_456]);
    let s = r2.stats();
    assert_eq!(s.gets, 1 + 2, "one trailer GET plus two 256 KiB units");
    r2.read_into("t1", &obj, 200_000, &mut buf[..1000])
        .await
        .unwrap();
    assert_eq!(r2.stats().gets, 3, "second read is a cache hit");
    assert_eq!(&buf[..1000], &bytes[200_000..201_000]);
}

#[tokio::test]
async fn corrupt_objects_are_never_served() {
    let d = tempfile::tempdir().unwrap();
    let r = reader(&d.path().join("o"), &d.path().join("c"), 1 << 30);
    let bytes = data(600_000);
    let obj = r.put_object("t1", &bytes).await.unwrap();
    // Flip a byte of the stored object behind strata's back.
    let store = Store::open(&format!("file:{}", d.path().join("o").display())).unwrap();
    let key: Path = Store::object_key("t1", &obj.id);
    let mut raw = store
        .default_inner()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    raw[300_000] ^= 1;
    store
        .default_inner()
        .put(&key, PutPayload::from(raw))
        .await
        .unwrap();
    let r2 = reader(&d.path().join("o"), &d.path().join("c2"), 1 << 30);
    let mut buf = vec![0; 10];
    // Unit 0 is intact: reads there still work.
    r2.read_into("t1", &obj, 0, &mut buf).await.unwrap();
    // The unit holding the flipped byte is refused; nothing wrong is returned.
    let mut buf = vec![0; 4096];
    let e = r2
        .read_into("t1", &obj, 299_000, &mut buf)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(_)), "{e}");
    assert!(r2.stats().verify_failures >= 2);
}

#[tokio::test]
async fn cache_survives_restart_and_reverifies() {
    let d = tempfile::tempdir().unwrap();
    let cdir = d.path().join("c");
    let r = reader(&d.path().join("o"), &cdir, 1 << 30);
    let bytes = data(600_000);
    let obj = r.put_object("t1", &bytes).await.unwrap();
    drop(r);
    // Corrupt one cache entry on disk, as a crash or bit rot might.
    let hex = obj.id.to_hex();
    let entry = cdir.join("t1").join(&hex[..2]).join(format!("{hex}.1"));
    let mut e = std::fs::read(&entry).unwrap();
    e[5] ^= 0xff;
    std::fs::write(&entry, e).unwrap();
    let r2 = reader(&d.path().join("o"), &cdir, 1 << 30);
    let mut buf = vec![0; 600_000];
    r2.read_into("t1", &obj, 0, &mut buf).await.unwrap();
    assert_eq!(buf, bytes);
    let s = r2.stats();
    // Trailer + the one bad unit re-fetched; the two good units served from the cache.
    assert_eq!(s.gets, 2, "{s:?}");
    assert_eq!(s.cache_hits, 2);
}

#[tokio::test]
async fn concurrent_misses_share_one_get_and_cache_is_bounded() {
    let d = tempfile::tempdir().unwrap();
    let r = reader(&d.path().join("o"), &d.path().join("c"), 1 << 30);
    let bytes = data(256 * 1024);
    let obj = r.put_object("t1", &bytes).await.unwrap();
    let r2 = Arc::new(reader(
        &d.path().join("o"),
        &d.path().join("c2"),
        300 * 1024,
    ));
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let r2 = r2.clone();
            tokio::spawn(async move {
                let mut b = vec![0; 4096];
                r2.read_into("t1", &obj, i * 4096, &mut b).await.unwrap();
                b
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), &bytes[i * 4096..(i + 1) * 4096]);
    }
    assert!(r2.stats().gets <= 3, "{:?}", r2.stats());
    let big = data(1 << 20);
    let o2 = r2.put_object("t1", &big).await.unwrap();
    assert!(r2.cache().used() <= 300 * 1024);
    let mut b = vec![0; 1 << 20];
    r2.read_into("t1", &o2, 0, &mut b).await.unwrap();
    assert_eq!(b, big);
}

/// A sequential reader gets the next units fetched ahead (each unit still fetched once); a
/// random reader gets no read-ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_readers_are_read_ahead_and_random_ones_are_not() {
    let d = tempfile::tempdir().unwrap();
    let w = reader(&d.path().join("o"), &d.path().join("c"), 1 << 30);
    let unit = 256 * 1024;
    let bytes = data(16 * unit);
    let obj = w.put_object("t1", &bytes).await.unwrap();

    let seq = Arc::new(reader(&d.path().join("o"), &d.path().join("c2"), 1 << 30));
    let mut buf = vec![0; 64 * 1024];
    for off in (0..bytes.len()).step_by(buf.len()) {
        seq.read_ahead("t1", &obj, off as u64, buf.len() as u64);
        seq.read_into("t1", &obj, off as u64, &mut buf)
            .await
            .unwrap();
        assert_eq!(buf, &bytes[off..off + buf.len()]);
    }
    let s = seq.stats();
    assert!(s.prefetches >= 8, "read-ahead ran: {} units", s.prefetches);
    assert_eq!(s.gets, 1 + 16, "one trailer GET and each unit once");

    let rnd = Arc::new(reader(&d.path().join("o"), &d.path().join("c3"), 1 << 30));
    for u in [9usize, 2, 14, 5, 11, 0, 7] {
        let off = u * unit + 4096;
        rnd.read_ahead("t1", &obj, off as u64, 4096);
        rnd.read_into("t1", &obj, off as u64, &mut buf[..4096])
            .await
            .unwrap();
        assert_eq!(&buf[..4096], &bytes[off..off + 4096]);
    }
    let s = rnd.stats();
    assert_eq!(s.prefetches, 0);
    assert_eq!(s.gets, 1 + 7);
}

/// Issue 41, item 1: the reader's frame tables are bounded in bytes, whatever a tenant writes
/// and reads (before, one per object for the life of the process), and a deleted tenant leaves
/// nothing of it behind: tables, verified units, cached units.
#[tokio::test]
async fn frame_tables_stay_within_their_budget_and_leave_with_their_tenant() {
    let d = tempfile::tempdir().unwrap();
    let (objs, cdir) = (d.path().join("o"), d.path().join("c"));
    let r = reader(&objs, &cdir, 1 << 30);
    // A 256 KiB object's table: 4 frames of 32 bytes, and 128 for its entry.
    let budget = 20 * (4 * 32 + 128);
    r.set_table_budget(budget);
    let mut objects = vec![];
    for i in 0..200 {
        let tenant = if i % 2 == 0 { "noisy" } else { "quiet" };
        let bytes = data(256 * 1024);
        let obj = r.put_object(tenant, &bytes).await.unwrap();
        objects.push((tenant, obj, bytes));
        assert!(r.stats().table_bytes <= budget, "{:?}", r.stats());
    }
    assert_eq!(r.stats().tables, 20, "the 20 most recent");
    // A table evicted is fetched again when its object is read from the store; the read is
    // verified as before.
    let cold = reader(&objs, &d.path().join("c2"), 1 << 30);
    cold.set_table_budget(budget);
    for (tenant, obj, bytes) in &objects[..4] {
        let mut buf = vec![0; 4096];
        cold.read_into(tenant, obj, 100_000, &mut buf)
            .await
            .unwrap();
        assert_eq!(buf, &bytes[100_000..104_096]);
    }
    assert_eq!(cold.stats().tables, 4);
    // The noisy tenant is deleted: nothing of it stays, in memory or in the node cache.
    assert!(walk(&cdir)
        .iter()
        .any(|p| p.to_string_lossy().contains("noisy")));
    r.forget_tenant("noisy").unwrap();
    assert!(!walk(&cdir)
        .iter()
        .any(|p| p.to_string_lossy().contains("noisy")));
    assert_eq!(r.stats().tables, 10, "the quiet tenant's tables alone");
}
