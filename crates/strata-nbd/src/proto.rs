//! NBD wire format (fixed newstyle negotiation, simple and structured replies), written from
//! NetworkBlockDevice/nbd `doc/proto.md`. Parsing functions take untrusted bytes and return
//! errors, never panic; they are property-tested for that.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// NBD_OPT_INFO / NBD_OPT_GO information types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Structured reply types and flags.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// Errors.
pub use strata_block::errno::*;

// base:allocation states.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

pub const BASE_ALLOCATION: &str = "base:allocation";
/// Context id we hand out for base:allocation.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Longest string (export name, query) accepted in negotiation.
pub const MAX_STRING: usize = 4096;
/// Largest option payload accepted.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("too large: {0}")]
    TooLarge(&'static str),
}

struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.0.len() < n {
            return Err(ProtoError::Malformed("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_be_bytes(
            self.take(2)?
                .try_into()
                .map_err(|_| ProtoError::Malformed("u16"))?,
        ))
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_be_bytes(
            self.take(4)?
                .try_into()
                .map_err(|_| ProtoError::Malformed("u32"))?,
        ))
    }
    fn string(&mut self, len: usize) -> Result<String, ProtoError> {
        if len > MAX_STRING {
            return Err(ProtoError::TooLarge("string"));
        }
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| ProtoError::Malformed("string is not UTF-8"))
    }
}

/// A transmission-phase request header (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

pub const REQUEST_LEN: usize = 28;

pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Result<Request, ProtoError> {
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic(magic as u64));
    }
    Ok(Request {
        flags: u16::from_be_bytes([b[4], b[5]]),
        kind: u16::from_be_bytes([b[6], b[7]]),
        cookie: u64::from_be_bytes(
            b[8..16]
                .try_into()
                .map_err(|_| ProtoError::Malformed("cookie"))?,
        ),
        offset: u64::from_be_bytes(
            b[16..24]
                .try_into()
                .map_err(|_| ProtoError::Malformed("offset"))?,
        ),
        length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
    })
}

pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.kind.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.length.to_be_bytes());
    b
}

/// NBD_OPT_INFO / NBD_OPT_GO payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

pub fn parse_go(data: &[u8]) -> Result<GoRequest, ProtoError> {
    let mut c = Cur(data);
    let n = c.u32()? as usize;
    let name = c.string(n)?;
    let k = c.u16()? as usize;
    let mut infos = Vec::with_capacity(k.min(16));
    for _ in 0..k {
        infos.push(c.u16()?);
    }
    if !c.0.is_empty() {
        return Err(ProtoError::Malformed("trailing bytes"));
    }
    Ok(GoRequest { name, infos })
}

/// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub name: String,
    pub queries: Vec<String>,
}

pub fn parse_meta(data: &[u8]) -> Result<MetaRequest, ProtoError> {
    let mut c = Cur(data);
    let n = c.u32()? as usize;
    let name = c.string(n)?;
    let k = c.u32()? as usize;
    if k > 256 {
        return Err(ProtoError::TooLarge("too many queries"));
    }
    let mut queries = Vec::with_capacity(k);
    for _ in 0..k {
        let l = c.u32()? as usize;
        queries.push(c.string(l)?);
    }
    if !c.0.is_empty() {
        return Err(ProtoError::Malformed("trailing bytes"));
    }
    Ok(MetaRequest { name, queries })
}

/// Encodes an option reply header plus payload.
pub fn option_reply(opt: u32, kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + payload.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

pub fn simple_reply(error: u32, cookie: u64, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + data.len());
    v.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&error.to_be_bytes());
    v.extend_from_slice(&cookie.to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// The 20-byte header of a structured reply chunk whose payload is `len` bytes.
pub fn structured_header(flags: u16, kind: u16, cookie: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + len.min(64));
    v.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&cookie.to_be_bytes());
    v.extend_from_slice(&(len as u32).to_be_bytes());
    v
}

/// A structured reply chunk header followed by `payload` parts.
pub fn structured_chunk(flags: u16, kind: u16, cookie: u64, payload: &[&[u8]]) -> Vec<u8> {
    let mut v = structured_header(flags, kind, cookie, payload.iter().map(|p| p.len()).sum());
    for p in payload {
        v.extend_from_slice(p);
    }
    v
}

pub fn structured_error(cookie: u64, error: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    structured_chunk(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        &[&error.to_be_bytes(), &(msg.len() as u16).to_be_bytes(), msg],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_round_trip() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 77,
            offset: 4096,
            length: 512,
        };
        assert_eq!(parse_request(&encode_request(&r)), Ok(r));
        let mut b = encode_request(&r);
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn go_and_meta() {
        let mut d = vec![];
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        assert_eq!(
            parse_go(&d),
            Ok(GoRequest {
                name: "abc".into(),
                infos: vec![INFO_BLOCK_SIZE]
            })
        );
        assert!(parse_go(&d[..d.len() - 1]).is_err());
        let mut m = vec![];
        m.extend_from_slice(&0u32.to_be_bytes());
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&15u32.to_be_bytes());
        m.extend_from_slice(b"base:allocation");
        assert_eq!(
            parse_meta(&m),
            Ok(MetaRequest {
                name: "".into(),
                queries: vec![BASE_ALLOCATION.into()]
            })
        );
        let mut huge = vec![];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_go(&huge).is_err());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_go(&bytes);
            let _ = parse_meta(&bytes);
            if bytes.len() >= REQUEST_LEN {
                let mut b = [0u8; REQUEST_LEN];
                b.copy_from_slice(&bytes[..REQUEST_LEN]);
                let _ = parse_request(&b);
            }
        }
    }
}
