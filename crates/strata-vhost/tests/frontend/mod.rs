//! A vhost-user frontend for tests: the `vhost` crate's frontend for the messages, guest memory
//! in a shared file (as QEMU's `memory-backend-memfd,share=on`), and one split virtqueue written
//! by hand, so that a test can send any descriptor a hostile driver could. Used by this crate's
//! protocol tests and by the daemon's vhost-user race test (`strata/tests/vhost_ops.rs`).
#![allow(dead_code)]

use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

pub const QSIZE: u16 = 16;
pub const DESC: u64 = 0x0;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;
pub const DATA: u64 = 0x10000;
pub const MEM: usize = 40 << 20;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub fe: Frontend,
    pub kick: EventFd,
    _call: EventFd,
    /// Next free descriptor and next avail slot (we never reuse within a test's few requests,
    /// except by wrapping, which `submit` handles).
    pub next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    _file: std::fs::File,
}

/// A well-behaved frontend's setup of queue 0 (what QEMU does at guest boot).
pub fn connect(path: &Path) -> Guest {
    try_connect(path).unwrap()
}

/// [`connect`], failing softly (the socket is not there yet, the backend went away).
pub fn try_connect(path: &Path) -> vhost::Result<Guest> {
    try_connect_with(path, !0)
}

/// Guest memory as a VMM shares it: a memfd sealed against shrinking and growing (QEMU's
/// `memory-backend-memfd` default), or, `sealed` false, a plain file a VMM could truncate.
pub fn guest_memory_file(sealed: bool) -> std::fs::File {
    if !sealed {
        let file = tempfile::tempfile().unwrap();
        file.set_len(MEM as u64).unwrap();
        return file;
    }
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd =
        rustix::fs::memfd_create("guest", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(MEM as u64).unwrap();
    rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    file
}

/// [`try_connect`] acknowledging only the offered features in `mask`.
pub fn try_connect_with(path: &Path, mask: u64) -> vhost::Result<Guest> {
    try_connect_memory(path, mask, guest_memory_file(true))
}

/// [`try_connect_with`] over the guest memory in `file` (`MEM` bytes).
pub fn try_connect_memory(path: &Path, mask: u64, file: std::fs::File) -> vhost::Result<Guest> {
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(0),
        MEM,
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
    )])
    .unwrap();
    let mut fe = Frontend::connect(path, 2)?;
    // Every message acknowledged (REPLY_ACK), so a refusal shows as an error here.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe.set_owner()?;
    let features = fe.get_features()? & mask;
    fe.set_features(features)?;
    let proto = fe.get_protocol_features()?;
    assert!(proto.contains(VhostUserProtocolFeatures::CONFIG));
    fe.set_protocol_features(proto)?;
    let hva = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    fe.set_mem_table(&[region(0, MEM as u64, hva, file.as_raw_fd())])?;
    fe.set_vring_num(0, QSIZE)?;
    fe.set_vring_addr(0, &ring(hva, hva + AVAIL))?;
    fe.set_vring_base(0, 0)?;
    let kick = EventFd::new(0).unwrap();
    let call = EventFd::new(0).unwrap();
    fe.set_vring_call(0, &call)?;
    fe.set_vring_kick(0, &kick)?;
    fe.set_vring_enable(0, true)?;
    Ok(Guest {
        mem,
        fe,
        kick,
        _call: call,
        next_desc: 0,
        avail_idx: 0,
        used_seen: 0,
        _file: file,
    })
}

/// Queue 0's ring addresses (frontend virtual addresses) with the avail ring at `avail`.
pub fn ring(hva: u64, avail: u64) -> VringConfigData {
    VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: 0,
        desc_table_addr: hva + DESC,
        used_ring_addr: hva + USED,
        avail_ring_addr: avail,
        log_addr: None,
    }
}

pub fn region(
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
pub type D = (u64, u32, u16);

impl Guest {
    /// Writes a chain (descriptors linked in order unless `links` overrides the next of one)
    /// and makes it available; returns its head.
    pub fn chain(&mut self, descs: &[D], links: Option<(usize, u16)>) -> u16 {
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
    pub fn complete(&mut self, n: u16) -> Vec<(u32, u32)> {
        self.try_complete(n, Duration::from_secs(10))
            .expect("backend did not answer")
    }

    /// [`Guest::complete`], or `None` if the entries do not come within `within`.
    pub fn try_complete(&mut self, n: u16, within: Duration) -> Option<Vec<(u32, u32)>> {
        let _ = self.kick.write(1);
        let deadline = Instant::now() + within;
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            if idx.wrapping_sub(self.used_seen) >= n {
                break;
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut out = vec![];
        for _ in 0..n {
            let e = GuestAddress(USED + 4 + (self.used_seen % QSIZE) as u64 * 8);
            let id: u32 = self.mem.read_obj(e).unwrap();
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        Some(out)
    }

    /// Kicks and spins (no sleep) until `n` more used entries are there: for measuring the
    /// backend, where a sleeping poll would measure the sleep.
    pub fn spin_complete(&mut self, n: u16) {
        let _ = self.kick.write(1);
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            if idx.wrapping_sub(self.used_seen) >= n {
                self.used_seen = idx;
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Nothing more comes back within a short wait.
    pub fn quiet(&self) -> bool {
        self.kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        idx == self.used_seen
    }

    pub fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    pub fn status(&self, at: u64) -> u8 {
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// A whole request: header at `h`, data descriptors, status byte at `s`; returns (status, used len).
    pub fn request(&mut self, kind: u32, sector: u64, data: &[D]) -> (u8, u32) {
        self.try_request(kind, sector, data, Duration::from_secs(10))
            .expect("backend did not answer")
    }

    /// [`Guest::request`], or `None` if no answer comes within `within` (the backend went away).
    pub fn try_request(
        &mut self,
        kind: u32,
        sector: u64,
        data: &[D],
        within: Duration,
    ) -> Option<(u8, u32)> {
        let (h, s) = (DATA, DATA + 0x100);
        self.header(h, kind, sector);
        self.mem.write_obj(0xffu8, GuestAddress(s)).unwrap();
        let mut descs = vec![(h, 16, 0)];
        descs.extend_from_slice(data);
        descs.push((s, 1, F_WRITE));
        let head = self.chain(&descs, None);
        let used = self.try_complete(1, within)?;
        assert_eq!(used[0].0, head as u32);
        Some((self.status(s), used[0].1))
    }
}

pub const OK: u8 = 0;
pub const IOERR: u8 = 1;
pub const UNSUPP: u8 = 2;
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
