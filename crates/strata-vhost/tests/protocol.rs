//! The backend against a frontend we control: the `vhost` crate's own frontend for the messages,
//! guest memory in a shared file (as QEMU's `memory-backend-memfd,share=on`), and a split
//! virtqueue written by hand, so that every descriptor a hostile driver could send can be sent.
//!
//! What must hold: well-formed requests do what virtio-blk says; malformed and hostile ones get
//! an error status or come back unanswered, never touch memory outside what the frontend
//! shared, never reach the device, and never stop the backend from serving the next request or
//! the next frontend.

mod frontend;

use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use frontend::*;
use strata_block::{BlockDevice, MemDevice};
use strata_vhost::{blk, serve, Features, Served};
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VringConfigData};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const DISK: u64 = 8 << 20;

struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    served: Option<Served>,
    dev: Arc<MemDevice>,
    rt: tokio::runtime::Runtime,
}

/// The whole config space, as a driver reads it.
fn config(g: &mut Guest) -> Vec<u8> {
    let all = [0; blk::CONFIG_LEN];
    let flags = VhostUserConfigFlags::WRITABLE;
    g.fe.get_config(0, blk::CONFIG_LEN as u32, flags, &all)
        .unwrap()
        .1
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn setup(read_only: bool) -> Setup {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vhost.sock");
    let dev = MemDevice::new(DISK);
    let d: Arc<dyn BlockDevice> = if read_only {
        Arc::new(strata_block::ReadOnly(dev.clone()))
    } else {
        dev.clone()
    };
    let served = serve(&path, d, features(read_only), rt.handle().clone()).unwrap();
    Setup {
        _dir: dir,
        path,
        served: Some(served),
        dev,
        rt,
    }
}

fn features(read_only: bool) -> Features {
    Features {
        read_only,
        flush: true,
        num_queues: 2,
        queue_size: QSIZE,
        serial: "strata-test-serial-0123456789".into(),
        unsealed_memory: false,
    }
}

#[test]
fn well_formed_requests_do_what_virtio_blk_says() {
    let s = setup(false);
    let mut g = connect(&s.path);
    // Config space: capacity in sectors, writeback on, two queues.
    let cfg = config(&mut g);
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        DISK / 512
    );
    assert_eq!(cfg[blk::CONFIG_WRITEBACK], 1);
    assert_eq!(u16::from_le_bytes(cfg[34..36].try_into().unwrap()), 2);

    // A write split over two descriptors, then a read of it split differently.
    let payload: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    g.mem.write_slice(&payload, GuestAddress(0x20000)).unwrap();
    let (st, len) = g.request(T_OUT, 16, &[(0x20000, 4096, 0), (0x21000, 4096, 0)]);
    assert_eq!((st, len), (OK, 1));
    let (st, len) = g.request(
        T_IN,
        16,
        &[(0x30000, 512, F_WRITE), (0x31000, 7680, F_WRITE)],
    );
    assert_eq!((st, len), (OK, 8193));
    let mut back = vec![0u8; 8192];
    g.mem
        .read_slice(&mut back[..512], GuestAddress(0x30000))
        .unwrap();
    g.mem
        .read_slice(&mut back[512..], GuestAddress(0x31000))
        .unwrap();
    assert_eq!(back, payload);
    let on_disk = s.rt.block_on(s.dev.read(16 * 512, 8192)).unwrap();
    assert_eq!(on_disk, payload);

    assert_eq!(g.request(T_FLUSH, 0, &[]), (OK, 1));

    let (st, len) = g.request(T_GET_ID, 0, &[(0x40000, 20, F_WRITE)]);
    assert_eq!((st, len), (OK, 21));
    let mut id = [0u8; 20];
    g.mem.read_slice(&mut id, GuestAddress(0x40000)).unwrap();
    assert_eq!(&id, b"strata-test-serial-0");

    // WRITE_ZEROES over the first 4 KiB of what we wrote; DISCARD of the rest.
    let seg = |sector: u64, n: u32, flags: u32| {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&sector.to_le_bytes());
        b[8..12].copy_from_slice(&n.to_le_bytes());
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        b
    };
    g.mem
        .write_slice(&seg(16, 8, 1), GuestAddress(0x50000))
        .unwrap();
    assert_eq!(g.request(T_WRITE_ZEROES, 0, &[(0x50000, 16, 0)]), (OK, 1));
    let z = s.rt.block_on(s.dev.read(16 * 512, 4096)).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    assert_eq!(
        s.rt.block_on(s.dev.read(24 * 512, 4096)).unwrap(),
        payload[4096..]
    );
    g.mem
        .write_slice(&seg(24, 8, 0), GuestAddress(0x50000))
        .unwrap();
    assert_eq!(g.request(T_DISCARD, 0, &[(0x50000, 16, 0)]), (OK, 1));

    // No CONFIG_WCE: the cache mode is fixed (a guest's choice cannot be lost across a
    // reconnect or a restart); every field is read-only.
    assert_eq!(g.fe.get_features().unwrap() & (1 << 11), 0, "no CONFIG_WCE");
    assert_eq!(config(&mut g)[blk::CONFIG_WRITEBACK], 1);
    // (A refused SET_CONFIG ends the session in the vhost crate: the last message here.)
    assert!(g
        .fe
        .set_config(
            blk::CONFIG_WRITEBACK as u32,
            VhostUserConfigFlags::WRITABLE,
            &[0]
        )
        .is_err());
    assert!(g
        .fe
        .set_config(0, VhostUserConfigFlags::WRITABLE, &[0; 8])
        .is_err());
    assert!(g.quiet());
}

#[test]
fn hostile_requests_fail_alone() {
    let s = setup(false);
    let mut g = connect(&s.path);
    let before = s.rt.block_on(s.dev.read(0, DISK as u32)).unwrap();
    let sectors = DISK / 512;

    // Past the end, at the end, and a sector whose byte offset overflows u64.
    assert_eq!(
        g.request(T_IN, sectors, &[(0x30000, 512, F_WRITE)]).0,
        IOERR
    );
    assert_eq!(
        g.request(T_OUT, sectors - 1, &[(0x30000, 1024, 0)]).0,
        IOERR
    );
    assert_eq!(
        g.request(T_OUT, u64::MAX / 256, &[(0x30000, 512, 0)]).0,
        IOERR
    );
    // Not a multiple of the sector.
    assert_eq!(g.request(T_OUT, 0, &[(0x30000, 100, 0)]).0, IOERR);
    assert_eq!(g.request(T_IN, 0, &[(0x30000, 700, F_WRITE)]).0, IOERR);
    // More data than a request may carry (memory holds it, the backend must not take it).
    assert_eq!(
        g.request(
            T_IN,
            0,
            &[(0x100000, (blk::MAX_REQUEST_BYTES + 512) as u32, F_WRITE)]
        )
        .0,
        IOERR
    );
    // Unknown request type; a DISCARD with a flag; too many segments; a segment past the end;
    // a segment list that is not a whole number of segments.
    assert_eq!(g.request(99, 0, &[]).0, UNSUPP);
    g.mem
        .write_slice(&[0u8; 16 * 40], GuestAddress(0x50000))
        .unwrap();
    g.mem.write_obj(1u32, GuestAddress(0x50000 + 12)).unwrap();
    g.mem.write_obj(8u32, GuestAddress(0x50000 + 8)).unwrap();
    assert_eq!(g.request(T_DISCARD, 0, &[(0x50000, 16, 0)]).0, UNSUPP);
    assert_eq!(
        g.request(T_WRITE_ZEROES, 0, &[(0x50010, 16 * 40, 0)]).0,
        IOERR
    );
    g.mem.write_obj(sectors - 4, GuestAddress(0x50000)).unwrap();
    g.mem.write_obj(0u32, GuestAddress(0x50000 + 12)).unwrap();
    assert_eq!(g.request(T_WRITE_ZEROES, 0, &[(0x50000, 16, 0)]).0, IOERR);
    assert_eq!(g.request(T_DISCARD, 0, &[(0x50000, 15, 0)]).0, IOERR);
    // A header shorter than 16 bytes: the write of its data must not happen.
    g.header(DATA, T_OUT, 0);
    g.mem.write_obj(0xffu8, GuestAddress(DATA + 0x100)).unwrap();
    let head = g.chain(
        &[(DATA, 8, 0), (0x30000, 512, 0), (DATA + 0x100, 1, F_WRITE)],
        None,
    );
    let u = g.complete(1);
    assert_eq!(u[0].0, head as u32);
    // 8 header bytes + the first 8 of the data form a header of "type OUT, sector <garbage>".
    assert_ne!(g.status(DATA + 0x100), OK);

    // Descriptors outside guest memory: in data, in the header, as the status byte. The chain
    // comes back with nothing written (used length 0).
    let far = MEM as u64 + 0x1000;
    for descs in [
        vec![
            (DATA, 16, 0),
            (far, 512, F_WRITE),
            (DATA + 0x100, 1, F_WRITE),
        ],
        vec![(far, 16, 0), (DATA + 0x100, 1, F_WRITE)],
        vec![
            (DATA, 16, 0),
            (0x30000, 512, F_WRITE),
            (u64::MAX - 10, 1, F_WRITE),
        ],
        // Straddling the end of memory.
        vec![
            (DATA, 16, 0),
            (MEM as u64 - 256, 512, F_WRITE),
            (DATA + 0x100, 1, F_WRITE),
        ],
    ] {
        g.header(DATA, T_IN, 0);
        g.chain(&descs, None);
        assert_eq!(g.complete(1)[0].1, 0);
    }
    // No device-writable byte at all: unanswerable.
    g.header(DATA, T_FLUSH, 0);
    g.chain(&[(DATA, 16, 0)], None);
    assert_eq!(g.complete(1)[0].1, 0);
    // A descriptor loop (the last links back to the head): the chain ends, the queue goes on.
    g.header(DATA, T_OUT, 0);
    g.chain(&[(DATA, 16, 0), (0x30000, 512, 0)], Some((1, g.next_desc)));
    g.complete(1);
    // A next index past the table.
    g.chain(&[(DATA, 16, 0), (0x30000, 512, 0)], Some((1, 999)));
    g.complete(1);

    // Nothing above changed the disk, and the queue still serves.
    assert_eq!(s.rt.block_on(s.dev.read(0, DISK as u32)).unwrap(), before);
    assert_eq!(g.request(T_FLUSH, 0, &[]), (OK, 1));
}

/// CPU seconds this process has used (utime + stime, 100 Hz ticks).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    (f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()) as f64 / 100.0
}

/// A device that counts write-through writes and flushes.
struct Counting {
    dev: Arc<MemDevice>,
    fua: std::sync::atomic::AtomicU64,
    flushes: std::sync::atomic::AtomicU64,
}

#[async_trait::async_trait]
impl BlockDevice for Counting {
    fn size(&self) -> u64 {
        self.dev.size()
    }
    async fn read(&self, o: u64, l: u32) -> strata_block::DevResult<Vec<u8>> {
        self.dev.read(o, l).await
    }
    async fn write(&self, o: u64, d: &[u8], fua: bool) -> strata_block::DevResult<()> {
        if fua {
            self.fua.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.dev.write(o, d, fua).await
    }
    async fn flush(&self) -> strata_block::DevResult<()> {
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dev.flush().await
    }
    async fn trim(&self, o: u64, l: u32, fua: bool) -> strata_block::DevResult<()> {
        self.dev.trim(o, l, fua).await
    }
    async fn write_zeroes(&self, o: u64, l: u32, fua: bool) -> strata_block::DevResult<()> {
        self.dev.write_zeroes(o, l, fua).await
    }
    async fn allocation(&self, o: u64, l: u32) -> strata_block::DevResult<Vec<(u64, bool)>> {
        self.dev.allocation(o, l).await
    }
}

#[test]
fn a_driver_without_a_write_back_cache_gets_durable_writes() {
    use std::sync::atomic::Ordering::Relaxed;
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.sock");
    let dev = Arc::new(Counting {
        dev: MemDevice::new(DISK),
        fua: Default::default(),
        flushes: Default::default(),
    });
    let _served = serve(&path, dev.clone(), features(false), rt.handle().clone()).unwrap();
    // A driver that never accepts FLUSH (a write-through disk to it): every write durable.
    let mut g = frontend::try_connect_with(&path, !(1u64 << 9)).unwrap();
    assert_eq!(g.request(T_OUT, 0, &[(0x30000, 4096, 0)]), (OK, 1));
    assert_eq!(dev.fua.load(Relaxed), 1);
    drop(g);
    // With FLUSH accepted and the cache on, writes wait for the FLUSH.
    let mut g = connect(&path);
    assert_eq!(g.request(T_OUT, 0, &[(0x30000, 4096, 0)]), (OK, 1));
    assert_eq!(dev.fua.load(Relaxed), 1);
    // Writing the cache mode is refused: the disk stays write-back, nothing flushed.
    let f0 = dev.flushes.load(Relaxed);
    assert!(g
        .fe
        .set_config(
            blk::CONFIG_WRITEBACK as u32,
            VhostUserConfigFlags::WRITABLE,
            &[0]
        )
        .is_err());
    assert_eq!(dev.flushes.load(Relaxed), f0);
    drop(g);
    // A driver without FLUSH after one with it: write-through again (the reset between them).
    let mut g = frontend::try_connect_with(&path, !(1u64 << 9)).unwrap();
    assert_eq!(g.request(T_OUT, 16, &[(0x30000, 4096, 0)]), (OK, 1));
    assert_eq!(dev.fua.load(Relaxed), 2);
}

#[test]
fn read_only_device_refuses_every_change() {
    let s = setup(true);
    let mut g = connect(&s.path);
    let features = g.fe.get_features().unwrap();
    assert_ne!(features & (1 << 5), 0, "VIRTIO_BLK_F_RO offered");
    assert_eq!(features & (1 << 13), 0, "no DISCARD on a read-only device");
    g.mem
        .write_slice(&[0xaa; 512], GuestAddress(0x30000))
        .unwrap();
    assert_eq!(g.request(T_OUT, 0, &[(0x30000, 512, 0)]).0, IOERR);
    g.mem
        .write_slice(&[0u8; 16], GuestAddress(0x50000))
        .unwrap();
    g.mem.write_obj(8u32, GuestAddress(0x50008)).unwrap();
    assert_eq!(g.request(T_WRITE_ZEROES, 0, &[(0x50000, 16, 0)]).0, IOERR);
    assert_eq!(g.request(T_IN, 0, &[(0x30000, 512, F_WRITE)]).0, OK);
    assert!(s
        .rt
        .block_on(s.dev.read(0, 512))
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn hostile_frontend_messages_leave_the_backend_serving() {
    let mut s = setup(false);
    {
        // A ring size that is not a power of two, one over the maximum, a queue that does not
        // exist, ring addresses outside the memory table, a memory region whose file is smaller
        // than it claims, and an avail index far past the ring.
        let g = connect(&s.path);
        assert!(g.fe.set_vring_num(0, 17).is_err() || g.fe.set_vring_num(0, QSIZE).is_ok());
        let _ = g.fe.set_vring_num(0, 32768);
        assert!(g.fe.set_vring_num(7, QSIZE).is_err());
        let small = tempfile::tempfile().unwrap();
        small.set_len(4096).unwrap();
        let _ =
            g.fe.set_mem_table(&[region(0, 1 << 30, 0x7000_0000_0000, small.as_raw_fd())]);
        let _ = g.fe.set_vring_addr(
            1,
            &VringConfigData {
                queue_max_size: QSIZE,
                queue_size: QSIZE,
                flags: 0,
                desc_table_addr: 0xdead_0000_0000,
                used_ring_addr: 0xdead_0001_0000,
                avail_ring_addr: 0xdead_0002_0000,
                log_addr: None,
            },
        );
        g.mem.write_obj(0x8000u16, GuestAddress(AVAIL + 2)).unwrap();
        let _ = g.kick.write(1);
        std::thread::sleep(Duration::from_millis(200));
        // The frontend goes away without a word.
    }
    // A ring whose avail index is readable but whose entries lie past the end of memory
    // (EVENT_IDX negotiated): the worker must not spin on it.
    {
        let mut g = connect(&s.path);
        let hva = g.mem.get_host_address(GuestAddress(0)).unwrap() as u64;
        g.fe.set_vring_enable(0, false).unwrap();
        let _ = g.fe.get_vring_base(0);
        g.fe.set_vring_num(0, QSIZE).unwrap();
        g.fe.set_vring_addr(0, &ring(hva, hva + MEM as u64 - 4))
            .unwrap();
        g.fe.set_vring_base(0, 0).unwrap();
        g.fe.set_vring_kick(0, &g.kick).unwrap();
        g.fe.set_vring_enable(0, true).unwrap();
        g.mem.write_obj(3u16, GuestAddress(MEM as u64 - 2)).unwrap();
        let before = cpu_seconds();
        for _ in 0..5 {
            let _ = g.kick.write(1);
            std::thread::sleep(Duration::from_millis(200));
        }
        let spent = cpu_seconds() - before;
        assert!(
            spent < 0.5,
            "{spent} s of CPU in 1 s: a worker spins on the broken ring"
        );
    }
    // The next frontend is served as if nothing happened.
    let mut g = connect(&s.path);
    g.mem
        .write_slice(&[0x5a; 4096], GuestAddress(0x20000))
        .unwrap();
    assert_eq!(g.request(T_OUT, 8, &[(0x20000, 4096, 0)]), (OK, 1));
    assert_eq!(g.request(T_IN, 8, &[(0x30000, 4096, F_WRITE)]), (OK, 4097));
    assert_eq!(
        s.rt.block_on(s.dev.read(8 * 512, 4096)).unwrap(),
        vec![0x5a; 4096]
    );

    // A stop with a frontend connected ends the connection and returns; the socket is gone.
    let served = s.served.take().unwrap();
    let path = served.path().to_path_buf();
    let t = std::thread::spawn(move || served.stop());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !t.is_finished() {
        assert!(Instant::now() < deadline, "stop did not return");
        std::thread::sleep(Duration::from_millis(10));
    }
    t.join().unwrap();
    assert!(!path.exists());
    assert!(
        g.fe.get_features().is_err(),
        "connection closed by the stop"
    );
}

/// Issue 41, item 7: a VMM that truncated its memory file after `SET_MEM_TABLE` made the
/// daemon's next access to it a SIGBUS, taking every tenant's exports down. Guest memory must
/// now be sealed against shrinking: an unsealed file is refused at `SET_MEM_TABLE` (and the
/// backend serves the next frontend), and the sealed memfd a VMM shares cannot be truncated.
#[test]
fn guest_memory_a_vmm_could_truncate_is_refused() {
    let s = setup(false);
    let refused = frontend::try_connect_memory(&s.path, !0, frontend::guest_memory_file(false));
    assert!(refused.is_err(), "unsealed guest memory accepted");
    // The sealed memory of a well-behaved VMM cannot shrink under the backend.
    let mut g = connect(&s.path);
    let sealed = frontend::guest_memory_file(true);
    let e = sealed.set_len(4096).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(rustix::io::Errno::PERM.raw_os_error()),
        "{e}"
    );
    g.mem
        .write_slice(&[0x33; 4096], GuestAddress(0x20000))
        .unwrap();
    assert_eq!(g.request(T_OUT, 0, &[(0x20000, 4096, 0)]), (OK, 1));
}

/// An operator that trusts its VMM (one that cannot seal its memory) turns the check off.
#[test]
fn unsealed_memory_is_served_when_the_operator_allows_it() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("u.sock");
    let dev: Arc<dyn BlockDevice> = MemDevice::new(DISK);
    let f = Features {
        unsealed_memory: true,
        ..features(false)
    };
    let _served = serve(&path, dev, f, rt.handle().clone()).unwrap();
    let mut g =
        frontend::try_connect_memory(&path, !0, frontend::guest_memory_file(false)).unwrap();
    g.mem
        .write_slice(&[0x44; 4096], GuestAddress(0x20000))
        .unwrap();
    assert_eq!(g.request(T_OUT, 0, &[(0x20000, 4096, 0)]), (OK, 1));
}
