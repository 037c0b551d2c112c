//! A small NBD client (fixed newstyle, structured replies, base:allocation), one request at a
//! time per connection. For tests and tools; real workloads use the kernel, QEMU or libnbd.

use std::io;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::proto::*;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("server error {errno}: {msg}")]
    Nbd { errno: u32, msg: String },
    #[error("protocol: {0}")]
    Proto(String),
}

pub type Result<T> = std::result::Result<T, ClientError>;

fn proto_err<T>(m: impl Into<String>) -> Result<T> {
    Err(ClientError::Proto(m.into()))
}

pub struct Client<S> {
    s: S,
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    pub meta: bool,
    cookie: u64,
}

/// One option reply: (type, payload).
async fn read_opt_reply<S: AsyncRead + Unpin>(s: &mut S, opt: u32) -> Result<(u32, Vec<u8>)> {
    if s.read_u64().await? != OPT_REPLY_MAGIC {
        return proto_err("bad option reply magic");
    }
    if s.read_u32().await? != opt {
        return proto_err("option reply for another option");
    }
    let kind = s.read_u32().await?;
    let len = s.read_u32().await?;
    if len > MAX_OPTION_LEN {
        return proto_err("option reply too large");
    }
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p).await?;
    Ok((kind, p))
}

async fn send_opt<S: AsyncWrite + Unpin>(s: &mut S, opt: u32, data: &[u8]) -> Result<()> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    s.write_all(&v).await?;
    s.flush().await?;
    Ok(())
}

async fn greet<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> Result<()> {
    if s.read_u64().await? != NBDMAGIC || s.read_u64().await? != IHAVEOPT {
        return proto_err("not a fixed-newstyle NBD server");
    }
    let hflags = s.read_u16().await?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return proto_err("server is not fixed newstyle");
    }
    s.write_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .await?;
    Ok(())
}

impl Client<UnixStream> {
    pub async fn connect_unix(path: &Path, export: &str) -> Result<Self> {
        Client::handshake(UnixStream::connect(path).await?, export).await
    }

    pub async fn list_unix(path: &Path) -> Result<Vec<String>> {
        let mut s = UnixStream::connect(path).await?;
        greet(&mut s).await?;
        send_opt(&mut s, OPT_LIST, &[]).await?;
        let mut names = vec![];
        loop {
            let (kind, p) = read_opt_reply(&mut s, OPT_LIST).await?;
            match kind {
                REP_SERVER if p.len() >= 4 => {
                    let n = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) as usize;
                    names
                        .push(String::from_utf8_lossy(p.get(4..4 + n).unwrap_or(&[])).into_owned());
                }
                REP_ACK => break,
                k => return proto_err(format!("unexpected list reply {k:#x}")),
            }
        }
        send_opt(&mut s, OPT_ABORT, &[]).await?;
        Ok(names)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Client<S> {
    /// Negotiates structured replies, base:allocation and then GO on `export`.
    pub async fn handshake(mut s: S, export: &str) -> Result<Self> {
        greet(&mut s).await?;
        send_opt(&mut s, OPT_STRUCTURED_REPLY, &[]).await?;
        let structured = read_opt_reply(&mut s, OPT_STRUCTURED_REPLY).await?.0 == REP_ACK;
        let mut meta = false;
        if structured {
            let mut d = (export.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(export.as_bytes());
            d.extend_from_slice(&1u32.to_be_bytes());
            d.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
            d.extend_from_slice(BASE_ALLOCATION.as_bytes());
            send_opt(&mut s, OPT_SET_META_CONTEXT, &d).await?;
            loop {
                let (kind, _) = read_opt_reply(&mut s, OPT_SET_META_CONTEXT).await?;
                match kind {
                    REP_META_CONTEXT => meta = true,
                    REP_ACK => break,
                    k if k & (1 << 31) != 0 => break,
                    k => return proto_err(format!("unexpected meta reply {k:#x}")),
                }
            }
        }
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        send_opt(&mut s, OPT_GO, &d).await?;
        let (mut size, mut flags) = (None, 0);
        loop {
            let (kind, p) = read_opt_reply(&mut s, OPT_GO).await?;
            match kind {
                REP_INFO if p.len() >= 12 && p[..2] == INFO_EXPORT.to_be_bytes() => {
                    size = Some(u64::from_be_bytes(
                        p[2..10]
                            .try_into()
                            .map_err(|_| ClientError::Proto("info".into()))?,
                    ));
                    flags = u16::from_be_bytes([p[10], p[11]]);
                }
                REP_INFO => {}
                REP_ACK => break,
                k => {
                    return Err(ClientError::Nbd {
                        errno: k,
                        msg: String::from_utf8_lossy(&p).into_owned(),
                    });
                }
            }
        }
        let Some(size) = size else {
            return proto_err("server sent no export info");
        };
        Ok(Client {
            s,
            size,
            flags,
            structured,
            meta,
            cookie: 0,
        })
    }

    /// Sends a request (with payload for writes) and collects the reply: (data, block status).
    pub async fn request(
        &mut self,
        flags: u16,
        kind: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<(Vec<u8>, Vec<(u32, u32)>)> {
        self.cookie += 1;
        let cookie = self.cookie;
        let mut v = encode_request(&Request {
            flags,
            kind,
            cookie,
            offset,
            length,
        })
        .to_vec();
        v.extend_from_slice(payload);
        self.s.write_all(&v).await?;
        self.s.flush().await?;
        let magic = self.s.read_u32().await?;
        if magic == SIMPLE_REPLY_MAGIC {
            let err = self.s.read_u32().await?;
            if self.s.read_u64().await? != cookie {
                return proto_err("reply for another request");
            }
            if err != 0 {
                return Err(ClientError::Nbd {
                    errno: err,
                    msg: String::new(),
                });
            }
            let mut data = vec![];
            if kind == CMD_READ {
                data = vec![0u8; length as usize];
                self.s.read_exact(&mut data).await?;
            }
            return Ok((data, vec![]));
        }
        let mut data = vec![0u8; if kind == CMD_READ { length as usize } else { 0 }];
        let mut status = vec![];
        let mut magic = magic;
        loop {
            if magic != STRUCTURED_REPLY_MAGIC {
                return proto_err(format!("bad reply magic {magic:#x}"));
            }
            let rflags = self.s.read_u16().await?;
            let rtype = self.s.read_u16().await?;
            if self.s.read_u64().await? != cookie {
                return proto_err("reply for another request");
            }
            let len = self.s.read_u32().await? as usize;
            if len > (64 << 20) {
                return proto_err("reply chunk too large");
            }
            let mut p = vec![0u8; len];
            self.s.read_exact(&mut p).await?;
            match rtype {
                REPLY_TYPE_NONE => {}
                REPLY_TYPE_OFFSET_DATA if len >= 8 => {
                    let off = u64::from_be_bytes(
                        p[..8]
                            .try_into()
                            .map_err(|_| ClientError::Proto("offset".into()))?,
                    );
                    let at = off
                        .checked_sub(offset)
                        .map(|a| a as usize)
                        .filter(|a| a + len - 8 <= data.len());
                    let Some(at) = at else {
                        return proto_err("data chunk outside the request");
                    };
                    data[at..at + len - 8].copy_from_slice(&p[8..]);
                }
                REPLY_TYPE_OFFSET_HOLE if len == 12 => {}
                REPLY_TYPE_BLOCK_STATUS if len >= 4 => {
                    for d in p[4..].chunks_exact(8) {
                        status.push((
                            u32::from_be_bytes([d[0], d[1], d[2], d[3]]),
                            u32::from_be_bytes([d[4], d[5], d[6], d[7]]),
                        ));
                    }
                }
                t if t & (1 << 15) != 0 && len >= 6 => {
                    let errno = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
                    let ml = u16::from_be_bytes([p[4], p[5]]) as usize;
                    let msg = String::from_utf8_lossy(p.get(6..6 + ml).unwrap_or(&[])).into_owned();
                    return Err(ClientError::Nbd { errno, msg });
                }
                t => return proto_err(format!("unexpected reply type {t}")),
            }
            if rflags & REPLY_FLAG_DONE != 0 {
                return Ok((data, status));
            }
            magic = self.s.read_u32().await?;
        }
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>> {
        Ok(self.request(0, CMD_READ, offset, len, &[]).await?.0)
    }
    pub async fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let f = if fua { CMD_FLAG_FUA } else { 0 };
        self.request(f, CMD_WRITE, offset, data.len() as u32, data)
            .await
            .map(|_| ())
    }
    pub async fn flush(&mut self) -> Result<()> {
        self.request(0, CMD_FLUSH, 0, 0, &[]).await.map(|_| ())
    }
    pub async fn trim(&mut self, offset: u64, len: u32) -> Result<()> {
        self.request(0, CMD_TRIM, offset, len, &[])
            .await
            .map(|_| ())
    }
    pub async fn write_zeroes(&mut self, offset: u64, len: u32) -> Result<()> {
        self.request(0, CMD_WRITE_ZEROES, offset, len, &[])
            .await
            .map(|_| ())
    }
    /// base:allocation descriptors: (length, flags).
    pub async fn block_status(&mut self, offset: u64, len: u32) -> Result<Vec<(u32, u32)>> {
        Ok(self.request(0, CMD_BLOCK_STATUS, offset, len, &[]).await?.1)
    }
    pub async fn disconnect(mut self) -> Result<()> {
        let v = encode_request(&Request {
            flags: 0,
            kind: CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        });
        self.s.write_all(&v).await?;
        self.s.flush().await?;
        Ok(())
    }
    /// The raw stream, for tests that send malformed bytes.
    pub fn stream(&mut self) -> &mut S {
        &mut self.s
    }
}
