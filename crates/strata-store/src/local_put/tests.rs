//! Unit tests of the local put path.

use super::*;

/// Issue 41, item 6: one put thread served every tenant first come, first served, so a
/// heavy writer's backlog delayed another tenant's put (and a sync-mode FLUSH waiting on
/// it) by all of it. Turns take one job per waiting tenant in turn.
#[test]
fn the_put_thread_takes_tenants_in_turn() {
    let ran = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut t = Turns::default();
    let job = |who: &'static str| -> Job {
        let ran = ran.clone();
        Box::new(move || ran.lock().unwrap().push(who))
    };
    for _ in 0..100 {
        t.push("heavy".into(), job("heavy"));
    }
    t.push("light".into(), job("light"));
    t.push("other".into(), job("other"));
    while let Some(j) = t.pop() {
        j();
    }
    let ran = ran.lock().unwrap();
    assert_eq!(ran.len(), 102);
    let at = |who| ran.iter().position(|w| *w == who).unwrap();
    assert!(at("light") <= 2 && at("other") <= 2, "{:?}", &ran[..4]);
    assert!(t.queues.is_empty() && t.order.is_empty());
}

/// Puts of several tenants through the real thread all land.
#[tokio::test]
async fn puts_of_many_tenants_all_land() {
    let dir = tempfile::tempdir().unwrap();
    let mut puts = vec![];
    for i in 0..40u32 {
        let tenant = ["a", "b", "c"][i as usize % 3];
        let path = dir.path().join(format!("t/{tenant}/obj/{i}"));
        puts.push(tokio::spawn(async move {
            put(tenant, path.clone(), Bytes::from(vec![i as u8; 10_000]))
                .await
                .unwrap();
            path
        }));
    }
    for (i, p) in puts.into_iter().enumerate() {
        let path = p.await.unwrap();
        assert_eq!(std::fs::read(path).unwrap(), vec![i as u8; 10_000]);
    }
}

#[tokio::test]
async fn puts_land_whole_under_new_directories_and_leave_no_staged_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t/a/obj/ab/abcdef");
    let data: Vec<u8> = (0..(3 * PIECE + 17)).map(|i| (i % 251) as u8).collect();
    put("a", path.clone(), Bytes::from(data.clone()))
        .await
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), data);
    // Overwrites replace whole (a retry of the same key).
    put("a", path.clone(), Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"x");
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("abcdef")]);
}

/// How `dir`'s file system treats `O_DIRECT`: whether it takes an aligned page, and whether
/// it refuses a length no block size divides (what the fallback test needs of it).
fn direct_behaviour(dir: &Path) -> (bool, bool) {
    use std::os::unix::fs::FileExt;
    let probe = dir.join("probe");
    let f = File::create(&probe).unwrap();
    if set_direct(&f, true).is_err() {
        drop(f);
        std::fs::remove_file(&probe).unwrap();
        return (false, false);
    }
    let mut v = vec![];
    let buf = aligned(&mut v, DIRECT_ALIGN);
    let takes = f.write_all_at(buf, 0).is_ok();
    let refuses = f
        .write_all_at(&buf[..17], DIRECT_ALIGN as u64)
        .is_err_and(|e| refused(&e));
    drop(f);
    std::fs::remove_file(&probe).unwrap();
    (takes, refuses)
}

/// A temporary directory on a file system that takes `O_DIRECT` (the test fails loudly
/// where it cannot exercise the direct path).
fn direct_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        direct_behaviour(dir.path()).0,
        "{} refuses O_DIRECT, so the direct path cannot be tested here: \
         point TMPDIR at a directory on ext4 or xfs",
        dir.path().display()
    );
    dir
}

/// Puts of every shape of length land whole on the `O_DIRECT` path: empty, shorter than the
/// alignment, exact pieces, a padded last piece.
#[test]
fn direct_puts_land_whole_and_cut_back_to_their_length() {
    let dir = direct_dir();
    for (i, len) in [0, 1, 4095, 4096, 4097, PIECE, 2 * PIECE + 4096 + 1]
        .into_iter()
        .enumerate()
    {
        let path = dir.path().join(format!("t/a/obj/{i}"));
        let data: Vec<u8> = (0..len).map(|j| (j % 253) as u8 ^ i as u8).collect();
        let wrote = write_durably(&path, &data, Some(DIRECT_ALIGN)).unwrap();
        assert_eq!(wrote, Wrote::Direct, "length {len}");
        assert_eq!(std::fs::read(&path).unwrap(), data, "length {len}");
    }
}

/// The same from bytes at an aligned address (an object built in an `ObjectBuf`), which are
/// written from where they are: every shape of length lands whole, the unaligned tail too.
#[test]
fn direct_puts_from_aligned_bytes_land_whole() {
    let dir = direct_dir();
    for (i, len) in [0, 1, 4095, 4096, 4097, PIECE, 2 * PIECE + 4096 + 1]
        .into_iter()
        .enumerate()
    {
        let path = dir.path().join(format!("t/a/obj/al{i}"));
        let mut buf = crate::ObjectBuf::with_capacity(len);
        let data: Vec<u8> = (0..len).map(|j| (j % 251) as u8 ^ i as u8).collect();
        buf.extend_from_slice(&data);
        assert_eq!(buf.as_slice().as_ptr().addr() % DIRECT_ALIGN, 0);
        let wrote = write_durably(&path, buf.as_slice(), Some(DIRECT_ALIGN)).unwrap();
        assert_eq!(wrote, Wrote::Direct, "length {len}");
        assert_eq!(std::fs::read(&path).unwrap(), data, "length {len}");
    }
}

/// Pages of `path` in the page cache (`mincore` over a mapping of it), and its pages.
#[allow(unsafe_code)]
fn resident_pages(path: &Path) -> (usize, usize) {
    use std::os::fd::AsRawFd;
    let f = File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    let pages = len.div_ceil(4096);
    // SAFETY: a read-only shared mapping of an open file, unmapped below; mincore writes
    // one byte per page into a vector of that length.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let mut v = vec![0u8; pages];
        assert_eq!(libc::mincore(p, len, v.as_mut_ptr()), 0);
        libc::munmap(p, len);
        (v.iter().filter(|b| **b & 1 == 1).count(), pages)
    }
}

/// An object written with `O_DIRECT` (which leaves nothing of it in the page cache) is read
/// back into the page cache once durable, so a block read soon after its publish does not
/// go to the disk (issue 45: random reads of published data at a third of qemu-nbd's).
#[test]
fn a_direct_put_is_read_back_into_the_page_cache() {
    assert!(
        std::env::var("STRATA_PUT_READBACK").is_err(),
        "STRATA_PUT_READBACK is set: this test checks the default"
    );
    let dir = direct_dir();
    let path = dir.path().join("t/a/obj/o");
    let data: Vec<u8> = (0..8 * PIECE + 100).map(|j| (j % 239) as u8).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(put("a", path.clone(), Bytes::from(data.clone())))
        .unwrap();
    assert!(
        direct_wanted(),
        "the put went buffered: the test checks the direct path"
    );
    // The kernel reads it asynchronously: wait for it, boundedly. Its read-ahead takes
    // whole pages only (a partial last page is left to the first read: 6.1 and later).
    let whole = data.len() / 4096;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut resident = resident_pages(&path).0;
    while resident < whole && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        resident = resident_pages(&path).0;
    }
    assert!(
        resident >= whole,
        "{resident} of the object's {whole} whole pages are in the page cache"
    );
    assert_eq!(std::fs::read(&path).unwrap(), data);
}

/// A write the file system refuses (here the kernel's own `EINVAL` for a length no block
/// size divides, after whole pieces went out direct) is redone buffered, whole.
#[test]
fn a_refused_direct_put_is_rewritten_buffered_whole() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        direct_behaviour(dir.path()) == (true, true),
        "{} does not refuse an unaligned O_DIRECT length, so the fallback cannot be \
         tested here: point TMPDIR at a directory on ext4 or xfs",
        dir.path().display()
    );
    let path = dir.path().join("t/a/obj/x");
    let data: Vec<u8> = (0..(2 * PIECE + 17)).map(|j| (j % 241) as u8).collect();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // What a previous put left under the key is replaced.
    std::fs::write(&path, vec![0xee; 3 * PIECE]).unwrap();
    let wrote = write_durably(&path, &data, Some(1)).unwrap();
    assert!(matches!(wrote, Wrote::Refused(_)), "{wrote:?}");
    assert_eq!(std::fs::read(&path).unwrap(), data);
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("x")]);
    // The buffered path as such.
    assert_eq!(write_durably(&path, b"y", None).unwrap(), Wrote::Buffered);
    assert_eq!(std::fs::read(&path).unwrap(), b"y");
}

#[tokio::test]
async fn a_failed_put_says_why() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t"), b"a file, not a directory").unwrap();
    let e = put("a", dir.path().join("t/a/obj"), Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    assert!(!e.to_string().is_empty());
}
/// Staged files a crash left are swept once old; fresh ones (a put in progress), objects,
/// names that only look alike and anything outside the tenant directories stay.
#[test]
fn old_staged_files_are_swept_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("t/a/obj/ab");
    std::fs::create_dir_all(&d).unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let names = [
        "abcdef#123",
        "abcdef#9",
        "#12",
        "abcdef",
        "abc#x1",
        "abc#",
        "a#1#2",
    ];
    for name in names {
        File::create(d.join(name))
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    std::fs::write(d.join("fresh#77"), b"in progress").unwrap();
    // Outside `t/`: not the store's.
    File::create(dir.path().join("other#1"))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let (n, failed, _) = sweep_staged(dir.path(), std::time::Duration::from_secs(600));
    assert_eq!((n, failed), (3, 0));
    let mut left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["a#1#2", "abc#", "abc#x1", "abcdef", "fresh#77"]);
    assert!(dir.path().join("other#1").exists());
    // A missing root is nothing to sweep, not an error.
    let none = sweep_staged(&dir.path().join("none"), std::time::Duration::ZERO);
    assert_eq!((none.0, none.1), (0, 0));
}
