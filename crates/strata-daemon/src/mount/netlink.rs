//! The kernel's NBD client driven over generic netlink (family `nbd`, as in
//! `include/uapi/linux/nbd-netlink.h`): CONNECT, RECONFIGURE, DISCONNECT, STATUS, and the
//! LINK_DEAD multicast. Blocking calls: run them off the async workers.
//!
//! The kernel only speaks the transmission phase: whoever connects it has negotiated already.
//! Here nothing is negotiated at all: the sockets handed over are one end of socketpairs whose
//! other end this daemon serves, with the flags given in the CONNECT.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use neli::{
    consts::{nl::NlmF, socket::NlFamily},
    genl::{AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, Nlattr, NlattrBuilder},
    neli_enum,
    nl::NlPayload,
    router::synchronous::NlRouter,
    types::{Buffer, GenlBuffer},
    utils::Groups,
};

const FAMILY: &str = "nbd";
const VERSION: u8 = 1;

#[neli_enum(serialized_type = "u8")]
pub enum Cmd {
    Unspec = 0,
    Connect = 1,
    Disconnect = 2,
    Reconfigure = 3,
    LinkDead = 4,
    Status = 5,
}
impl neli::consts::genl::Cmd for Cmd {}

#[neli_enum(serialized_type = "u16")]
pub enum Attr {
    Unspec = 0,
    Index = 1,
    SizeBytes = 2,
    BlockSizeBytes = 3,
    Timeout = 4,
    ServerFlags = 5,
    ClientFlags = 6,
    Sockets = 7,
    DeadConnTimeout = 8,
    DeviceList = 9,
    BackendIdentifier = 10,
}
impl neli::consts::genl::NlAttrType for Attr {}

/// `NBD_SOCK_ITEM` / `NBD_SOCK_FD`, and `NBD_DEVICE_ITEM` / `NBD_DEVICE_INDEX` share numbers.
const ITEM: u16 = 1;
const ITEM_FD: u16 = 1;
const DEVICE_CONNECTED: u16 = 2;

/// What a CONNECT asks of the kernel.
#[derive(Debug, Clone)]
pub struct Connect {
    /// The device (`/dev/nbd{index}`); the kernel creates it if it does not exist.
    pub index: u32,
    pub size: u64,
    pub block_size: u64,
    /// The transmission flags (`NBD_FLAG_*`) the server would have sent in a handshake.
    pub server_flags: u64,
    /// A request unanswered this long is retried on another connection (or after reconnect).
    pub timeout: Duration,
    /// How long requests wait for a RECONFIGURE once every connection is dead, before EIO.
    pub dead_conn_timeout: Duration,
    /// Shown in `/sys/block/nbdN/backend`: how this daemon recognises its own devices.
    pub backend: String,
}

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> io::Error + '_ {
    move |e| io::Error::other(format!("{what}: {e}"))
}

fn attr<P: neli::Size + neli::ToBytes>(t: Attr, p: P) -> io::Result<Nlattr<Attr, Buffer>> {
    NlattrBuilder::default()
        .nla_type(
            AttrTypeBuilder::default()
                .nla_type(t)
                .build()
                .map_err(err("netlink attribute"))?,
        )
        .nla_payload(p)
        .build()
        .map_err(err("netlink attribute"))
}

fn sockets(fds: &[RawFd]) -> io::Result<Nlattr<Attr, Buffer>> {
    let mut outer = NlattrBuilder::default()
        .nla_type(
            AttrTypeBuilder::default()
                .nla_type(Attr::Sockets)
                .nla_nested(true)
                .build()
                .map_err(err("netlink attribute"))?,
        )
        .nla_payload(Vec::<u8>::new())
        .build()
        .map_err(err("netlink attribute"))?;
    for fd in fds {
        let fd_attr = NlattrBuilder::default()
            .nla_type(
                AttrTypeBuilder::default()
                    .nla_type(ITEM_FD)
                    .build()
                    .map_err(err("netlink attribute"))?,
            )
            .nla_payload(*fd as u32)
            .build()
            .map_err(err("netlink attribute"))?;
        let item = NlattrBuilder::default()
            .nla_type(
                AttrTypeBuilder::default()
                    .nla_type(ITEM)
                    .nla_nested(true)
                    .build()
                    .map_err(err("netlink attribute"))?,
            )
            .nla_payload(Vec::<u8>::new())
            .build()
            .map_err(err("netlink attribute"))?
            .nest(&fd_attr)
            .map_err(err("netlink attribute"))?;
        outer = outer.nest(&item).map_err(err("netlink attribute"))?;
    }
    Ok(outer)
}

/// A netlink socket bound to the kernel's `nbd` family.
pub struct Netlink {
    router: NlRouter,
    family: u16,
}

type Reply = Genlmsghdr<Cmd, Attr>;

impl Netlink {
    /// Opens the family; an error of kind `Unsupported` when the kernel has no nbd module
    /// loaded (and `modprobe nbd` did not load one).
    pub fn open() -> io::Result<Netlink> {
        let (router, _unsolicited) =
            NlRouter::connect(NlFamily::Generic, None, Groups::empty()).map_err(err("netlink"))?;
        let family = match router.resolve_genl_family(FAMILY) {
            Ok(f) => f,
            Err(_) => {
                let _ = std::process::Command::new("modprobe")
                    .arg("nbd")
                    .stderr(std::process::Stdio::null())
                    .status();
                router.resolve_genl_family(FAMILY).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::Unsupported,
                        "the kernel has no nbd module (modprobe nbd failed)",
                    )
                })?
            }
        };
        Ok(Netlink { router, family })
    }

    fn call(&self, cmd: Cmd, attrs: Vec<Nlattr<Attr, Buffer>>) -> io::Result<Vec<Reply>> {
        let msg = GenlmsghdrBuilder::<Cmd, Attr>::default()
            .cmd(cmd)
            .version(VERSION)
            .attrs(attrs.into_iter().collect::<GenlBuffer<_, _>>())
            .build()
            .map_err(err("netlink message"))?;
        let recv = self
            .router
            .send::<_, _, u16, Reply>(self.family, NlmF::ACK, NlPayload::Payload(msg))
            .map_err(err("netlink send"))?;
        let mut out = vec![];
        for r in recv {
            match r {
                Ok(m) => {
                    if let Some(p) = m.get_payload() {
                        out.push(p.clone());
                    }
                }
                Err(neli::err::RouterError::Nlmsgerr(e)) => {
                    return Err(io::Error::from_raw_os_error(-*e.error()));
                }
                Err(e) => return Err(io::Error::other(format!("netlink: {e}"))),
            }
        }
        Ok(out)
    }

    /// Connects `/dev/nbd{index}` to `fds` (one connection each). The kernel takes its own
    /// reference to each socket: the caller may close its descriptors afterwards.
    pub fn connect(&self, c: &Connect, fds: &[RawFd]) -> io::Result<u32> {
        let attrs = vec![
            attr(Attr::Index, c.index)?,
            attr(Attr::SizeBytes, c.size)?,
            attr(Attr::BlockSizeBytes, c.block_size)?,
            attr(Attr::ServerFlags, c.server_flags)?,
            attr(Attr::Timeout, c.timeout.as_secs().max(1))?,
            attr(Attr::DeadConnTimeout, c.dead_conn_timeout.as_secs().max(1))?,
            attr(Attr::BackendIdentifier, c.backend.as_str())?,
            sockets(fds)?,
        ];
        let replies = self.call(Cmd::Connect, attrs)?;
        Ok(replies
            .iter()
            .find_map(|p| {
                p.attrs()
                    .get_attr_handle()
                    .get_attr_payload_as::<u32>(Attr::Index)
                    .ok()
            })
            .unwrap_or(c.index))
    }

    /// Swaps `fds` into dead connection slots of a connected device. A socket for which no
    /// slot is dead is dropped by the kernel *without an error* (6.1 turns its ENOSPC into
    /// success): the serving end then sees its connection close at once. The backend name
    /// must be the one given at CONNECT.
    pub fn reconfigure(&self, index: u32, backend: &str, fds: &[RawFd]) -> io::Result<()> {
        self.call(
            Cmd::Reconfigure,
            vec![
                attr(Attr::Index, index)?,
                attr(Attr::BackendIdentifier, backend)?,
                sockets(fds)?,
            ],
        )
        .map(|_| ())
    }

    /// Tells a connected device its disk is now `size` bytes: the kernel sets the new
    /// capacity at once and announces it (a mounted filesystem can then grow onto it).
    pub fn resize(&self, index: u32, backend: &str, size: u64, block_size: u64) -> io::Result<()> {
        self.call(
            Cmd::Reconfigure,
            vec![
                attr(Attr::Index, index)?,
                attr(Attr::BackendIdentifier, backend)?,
                attr(Attr::SizeBytes, size)?,
                attr(Attr::BlockSizeBytes, block_size)?,
            ],
        )
        .map(|_| ())
    }

    /// Disconnects a device: the kernel shuts its sockets; requests not answered fail.
    pub fn disconnect(&self, index: u32) -> io::Result<()> {
        self.call(Cmd::Disconnect, vec![attr(Attr::Index, index)?])
            .map(|_| ())
    }

    /// Whether the kernel holds a configuration for the device (connected, or merely open);
    /// None: no such device. The kernel refuses a CONNECT of a device that has one (EBUSY).
    pub fn connected(&self, index: u32) -> io::Result<Option<bool>> {
        // An index with no device gets an empty list.
        let replies = self.call(Cmd::Status, vec![attr(Attr::Index, index)?])?;
        for p in &replies {
            let h = p.attrs().get_attr_handle();
            let Ok(list) = h.get_nested_attributes::<u16>(Attr::DeviceList) else {
                continue;
            };
            for item in list.iter() {
                let Ok(d) = item.get_attr_handle::<u16>() else {
                    continue;
                };
                if d.get_attr_payload_as::<u32>(ITEM).ok() == Some(index) {
                    return Ok(Some(
                        d.get_attr_payload_as::<u8>(DEVICE_CONNECTED).unwrap_or(0) != 0,
                    ));
                }
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use neli::ToBytes;

    /// (type without flags, nested flag, payload) of each attribute in `b`.
    fn tlvs(mut b: &[u8]) -> Vec<(u16, bool, Vec<u8>)> {
        let mut out = vec![];
        while b.len() >= 4 {
            let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
            let ty = u16::from_ne_bytes([b[2], b[3]]);
            out.push((ty & 0x3fff, ty & 0x8000 != 0, b[4..len].to_vec()));
            b = &b[len.next_multiple_of(4).min(b.len())..];
        }
        out
    }

    fn bytes(a: &Nlattr<Attr, Buffer>) -> Vec<u8> {
        let mut c = std::io::Cursor::new(vec![]);
        a.to_bytes(&mut c).unwrap();
        c.into_inner()
    }

    /// The layout `include/uapi/linux/nbd-netlink.h` and nbd.c's policy expect: INDEX u32,
    /// sizes and timeouts u64, SOCKETS { SOCK_ITEM { SOCK_FD u32 } ... }, the backend a
    /// NUL-terminated string.
    #[test]
    fn connect_attributes_have_the_kernels_layout() {
        let i = tlvs(&bytes(&attr(Attr::Index, 7u32).unwrap()));
        assert_eq!(i, vec![(1, false, 7u32.to_ne_bytes().to_vec())]);
        let s = tlvs(&bytes(&attr(Attr::SizeBytes, 1u64 << 30).unwrap()));
        assert_eq!(s, vec![(2, false, (1u64 << 30).to_ne_bytes().to_vec())]);
        let d = tlvs(&bytes(&attr(Attr::DeadConnTimeout, 600u64).unwrap()));
        assert_eq!(d[0].0, 8);
        assert_eq!(d[0].2.len(), 8);
        let b = tlvs(&bytes(&attr(Attr::BackendIdentifier, "strata-x").unwrap()));
        assert_eq!(b, vec![(10, false, b"strata-x\0".to_vec())]);

        let socks = tlvs(&bytes(&sockets(&[5, 9]).unwrap()));
        assert_eq!(socks.len(), 1);
        let (ty, nested, inner) = &socks[0];
        assert_eq!((*ty, *nested), (7, true));
        let items = tlvs(inner);
        assert_eq!(items.len(), 2);
        for (item, fd) in items.iter().zip([5u32, 9]) {
            assert_eq!((item.0, item.1), (1, true));
            assert_eq!(tlvs(&item.2), vec![(1, false, fd.to_ne_bytes().to_vec())]);
        }
    }
}
