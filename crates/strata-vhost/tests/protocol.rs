//! The backend against a frontend we control: the `vhost` crate's own frontend for the messages,
//! guest memory in a shared file (as QEMU's `memory-backend-memfd,share=on`), and a split
//! virtqueue written by hand, so that every descriptor a hostile driver could send can be sent.
//!
//! What must hold: well-formed requests do what virtio-blk says; malformed and hostile ones get
//! an error status or come back unanswered, never touch memory outside what the frontend
//! shared, never reach the device, and never stop the backend from serving the next request or
//! the next frontend.

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_nbd::{BlockDevice, MemDevice};
use strata_vhost::{blk, serve, Features, Served};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const DATA: u64 = 0x10000;
const MEM: usize = 40 << 20;
const DISK: u64 = 8 << 20;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

struct Guest {
    mem: GuestMemoryMmap,
    fe: Frontend,
    kick: EventFd,
    _call: EventFd,
    /// Next free descriptor and next avail slot (we never reuse within a test's few requests,
    /// except by wrapping, which `submit` handles).
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    _file: std::fs::File,
}

struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    served: Option<Served>,
    dev: Arc<MemDevice>,
    rt: tokio::runtime::Runtime,
}

fn setup(read_only: bool) -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vhost.sock");
    let dev = MemDevice::new(DISK);
    let d: Arc<dyn BlockDevice> = if read_only {
        Arc::new(strata_nbd::ReadOnly(dev.clone()))
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
    }
}

/// A well-behaved frontend's setup of queue 0 (what QEMU does at guest boot).
fn connect(path: &Path) -> Guest {
    let file = tempfile::tempfile().unwrap();
    file.set_len(MEM as u64).unwrap();
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(0),
        MEM,
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
    )])
    .unwrap();
    let mut fe = Frontend::connect(path, 2).unwrap();
    // Every message acknowledged (REPLY_ACK), so a refusal shows as an error here.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe.set_owner().unwrap();
    let features = fe.get_features().unwrap();
    fe.set_features(features).unwrap();
    let proto = fe.get_protocol_features().unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::CONFIG));
    fe.set_protocol_features(proto).unwrap();
    let hva = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    fe.set_mem_table(&[region(0, MEM as u64, hva, file.as_raw_fd())])
        .unwrap();
    fe.set_vring_num(0, QSIZE).unwrap();
    fe.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: hva + DESC,
            used_ring_addr: hva + USED,
            avail_ring_addr: hva + AVAIL,
            log_addr: None,
        },
    )
    .unwrap();
    fe.set_vring_base(0, 0).unwrap();
    let kick = EventFd::new(0).unwrap();
    let call = EventFd::new(0).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    Guest {
        mem,
        fe,
        kick,
        _call: call,
        next_desc: 0,
        avail_idx: 0,
        used_seen: 0,
        _file: file,
    }
}

fn region(
    gpa: u64,
    size: u64,
    hva: u64,
    fd: std::os::unix::io::RawFd,
) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: gpa,
        memory_size: size,
        userspace_addr: hva,
        mmap_offset: 0,
        mmap_handle: fd,
    }
}

/// One descriptor: guest address, length, flags (`F_WRITE` for device-writable).
type D = (u64, u32, u16);

impl Guest {
    /// Writes a chain (descriptors linked in order unless `links` overrides the next of one)
    /// and makes it available; returns its head.
    fn chain(&mut self, descs: &[D], links: Option<(usize, u16)>) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let idx = (head + i as u16) % QSIZE;
            let last = i + 1 == descs.len();
            let mut next = (idx + 1) % QSIZE;
            let mut f = flags | if last { 0 } else { F_NEXT };
            if let Some((at, to)) = links {
                if at == i {
                    next = to;
                    f |= F_NEXT;
                }
            }
            let a = GuestAddress(DESC + idx as u64 * 16);
            self.mem.write_obj(addr, a).unwrap();
            self.mem.write_obj(len, a.unchecked_add(8)).unwrap();
            self.mem.write_obj(f, a.unchecked_add(12)).unwrap();
            self.mem.write_obj(next, a.unchecked_add(14)).unwrap();
        }
        self.next_desc = (head + descs.len() as u16) % QSIZE;
        let slot = self.avail_idx % QSIZE;
        self.mem
            .write_obj(head, GuestAddress(AVAIL + 4 + slot as u64 * 2))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
        head
    }

    /// Kicks and waits for `n` more used entries; returns them (id, len).
    fn complete(&mut self, n: u16) -> Vec<(u32, u32)> {
        self.kick.write(1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            if idx.wrapping_sub(self.used_seen) >= n {
                break;
            }
            assert!(Instant::now() < deadline, "backend did not answer");
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut out = vec![];
        for _ in 0..n {
            let e = GuestAddress(USED + 4 + (self.used_seen % QSIZE) as u64 * 8);
            let id: u32 = self.mem.read_obj(e).unwrap();
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// Nothing more comes back within a short wait.
    fn quiet(&self) -> bool {
        self.kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        idx == self.used_seen
    }

    fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn status(&self, at: u64) -> u8 {
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// A whole request: header at `h`, data descriptors, status byte at `s`; returns (status, used len).
    fn request(&mut self, kind: u32, sector: u64, data: &[D]) -> (u8, u32) {
        let (h, s) = (DATA, DATA + 0x100);
        self.header(h, kind, sector);
        self.mem.write_obj(0xffu8, GuestAddress(s)).unwrap();
        let mut descs = vec![(h, 16, 0)];
        descs.extend_from_slice(data);
        descs.push((s, 1, F_WRITE));
        let head = self.chain(&descs, None);
        let used = self.complete(1);
        assert_eq!(used[0].0, head as u32);
        (self.status(s), used[0].1)
    }
}

const OK: u8 = 0;
const IOERR: u8 = 1;
const UNSUPP: u8 = 2;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;

#[test]
fn well_formed_requests_do_what_virtio_blk_says() {
    let s = setup(false);
    let mut g = connect(&s.path);
    // Config space: capacity in sectors, writeback on, two queues.
    let (_, cfg) =
        g.fe.get_config(
            0,
            blk::CONFIG_LEN as u32,
            VhostUserConfigFlags::WRITABLE,
            &[0; blk::CONFIG_LEN],
        )
        .unwrap();
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

    // The driver turns its write cache off (CONFIG_WCE): accepted, and reads back.
    g.fe.set_config(
        blk::CONFIG_WRITEBACK as u32,
        VhostUserConfigFlags::WRITABLE,
        &[0],
    )
    .unwrap();
    let (_, cfg) =
        g.fe.get_config(
            0,
            blk::CONFIG_LEN as u32,
            VhostUserConfigFlags::WRITABLE,
            &[0; blk::CONFIG_LEN],
        )
        .unwrap();
    assert_eq!(cfg[blk::CONFIG_WRITEBACK], 0);
    // Any other field is read-only.
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
