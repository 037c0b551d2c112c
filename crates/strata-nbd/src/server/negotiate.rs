//! Fixed-newstyle negotiation: the options a client may send before transmission (LIST,
//! INFO, GO, EXPORT_NAME, STRUCTURED_REPLY, LIST/SET_META_CONTEXT, ABORT; anything else
//! ERR_UNSUP), each parsed as untrusted bytes.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{ConnError, Export, Negotiated, Server};
use crate::proto::*;

impl Server {
    pub(super) fn tflags(&self, e: &Export, structured: bool) -> u16 {
        let mut f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA;
        if e.device.read_only() {
            f |= TF_READ_ONLY;
        } else {
            f |= TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
        }
        if e.multi_conn {
            f |= TF_CAN_MULTI_CONN;
        }
        if structured {
            f |= TF_SEND_DF;
        }
        f
    }

    pub(super) async fn negotiate<R, W>(
        &self,
        rd: &mut R,
        wr: &mut W,
    ) -> Result<Option<Negotiated>, ConnError>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut hello = Vec::with_capacity(18);
        hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
        hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        wr.write_all(&hello).await?;
        wr.flush().await?;
        let cflags = rd.read_u32().await?;
        if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(ProtoError::Malformed("unknown client flags").into());
        }
        let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
        let mut structured = false;
        let mut meta = false;
        loop {
            let magic = rd.read_u64().await?;
            if magic != IHAVEOPT {
                return Err(ProtoError::BadMagic(magic).into());
            }
            let opt = rd.read_u32().await?;
            let len = rd.read_u32().await?;
            if len > MAX_OPTION_LEN {
                // Too big to buffer; the stream cannot be resynchronised cheaply.
                wr.write_all(&option_reply(opt, REP_ERR_TOO_BIG, b"option too large"))
                    .await?;
                return Err(ProtoError::TooLarge("option").into());
            }
            let mut data = vec![0u8; len as usize];
            rd.read_exact(&mut data).await?;
            let reply = |kind: u32, payload: &[u8]| option_reply(opt, kind, payload);
            let err = |kind: u32, msg: &str| option_reply(opt, kind, msg.as_bytes());
            match opt {
                OPT_EXPORT_NAME => {
                    let name = String::from_utf8_lossy(&data).into_owned();
                    let Some(export) = self.exports.get(&name) else {
                        // No way to report an error to EXPORT_NAME: close.
                        return Err(ConnError::Aborted);
                    };
                    let mut v = Vec::with_capacity(10 + 124);
                    v.extend_from_slice(&export.device.size().to_be_bytes());
                    v.extend_from_slice(&self.tflags(&export, false).to_be_bytes());
                    if !no_zeroes {
                        v.extend_from_slice(&[0u8; 124]);
                    }
                    wr.write_all(&v).await?;
                    wr.flush().await?;
                    return Ok(Some(Negotiated {
                        name,
                        export,
                        structured: false,
                        meta: false,
                        alive: None,
                    }));
                }
                OPT_ABORT => {
                    let _ = wr.write_all(&reply(REP_ACK, &[])).await;
                    let _ = wr.flush().await;
                    return Ok(None);
                }
                OPT_LIST => {
                    if !data.is_empty() {
                        wr.write_all(&err(REP_ERR_INVALID, "NBD_OPT_LIST takes no data"))
                            .await?;
                    } else {
                        for name in self.exports.names() {
                            let mut p = (name.len() as u32).to_be_bytes().to_vec();
                            p.extend_from_slice(name.as_bytes());
                            wr.write_all(&reply(REP_SERVER, &p)).await?;
                        }
                        wr.write_all(&reply(REP_ACK, &[])).await?;
                    }
                }
                OPT_STARTTLS => {
                    wr.write_all(&err(
                        REP_ERR_POLICY,
                        "TLS is not offered: exports are local (unix socket or loopback)",
                    ))
                    .await?;
                }
                OPT_STRUCTURED_REPLY => {
                    if !data.is_empty() {
                        wr.write_all(&err(
                            REP_ERR_INVALID,
                            "NBD_OPT_STRUCTURED_REPLY takes no data",
                        ))
                        .await?;
                    } else {
                        structured = true;
                        wr.write_all(&reply(REP_ACK, &[])).await?;
                    }
                }
                OPT_INFO | OPT_GO => {
                    let req = match parse_go(&data) {
                        Ok(r) => r,
                        Err(e) => {
                            wr.write_all(&err(REP_ERR_INVALID, &e.to_string())).await?;
                            wr.flush().await?;
                            continue;
                        }
                    };
                    let Some(export) = self.exports.get(&req.name) else {
                        wr.write_all(&err(
                            REP_ERR_UNKNOWN,
                            &format!("no export named {:?}", req.name),
                        ))
                        .await?;
                        wr.flush().await?;
                        continue;
                    };
                    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                    info.extend_from_slice(&export.device.size().to_be_bytes());
                    info.extend_from_slice(&self.tflags(&export, structured).to_be_bytes());
                    wr.write_all(&reply(REP_INFO, &info)).await?;
                    let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    bs.extend_from_slice(&1u32.to_be_bytes());
                    bs.extend_from_slice(&4096u32.to_be_bytes());
                    bs.extend_from_slice(&self.cfg.max_request.to_be_bytes());
                    wr.write_all(&reply(REP_INFO, &bs)).await?;
                    if req.infos.contains(&INFO_NAME) {
                        let mut p = INFO_NAME.to_be_bytes().to_vec();
                        p.extend_from_slice(req.name.as_bytes());
                        wr.write_all(&reply(REP_INFO, &p)).await?;
                    }
                    if req.infos.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
                        let mut p = INFO_DESCRIPTION.to_be_bytes().to_vec();
                        p.extend_from_slice(export.description.as_bytes());
                        wr.write_all(&reply(REP_INFO, &p)).await?;
                    }
                    wr.write_all(&reply(REP_ACK, &[])).await?;
                    wr.flush().await?;
                    if opt == OPT_GO {
                        return Ok(Some(Negotiated {
                            name: req.name.clone(),
                            export,
                            structured,
                            meta,
                            alive: None,
                        }));
                    }
                }
                OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                    let set = opt == OPT_SET_META_CONTEXT;
                    let req = match parse_meta(&data) {
                        Ok(r) => r,
                        Err(e) => {
                            wr.write_all(&err(REP_ERR_INVALID, &e.to_string())).await?;
                            wr.flush().await?;
                            continue;
                        }
                    };
                    if !structured {
                        wr.write_all(&err(
                            REP_ERR_INVALID,
                            "negotiate NBD_OPT_STRUCTURED_REPLY first",
                        ))
                        .await?;
                    } else if self.exports.get(&req.name).is_none() {
                        wr.write_all(&err(
                            REP_ERR_UNKNOWN,
                            &format!("no export named {:?}", req.name),
                        ))
                        .await?;
                    } else {
                        let wants = if req.queries.is_empty() {
                            !set
                        } else {
                            req.queries
                                .iter()
                                .any(|q| q == BASE_ALLOCATION || (!set && q == "base:"))
                        };
                        if set {
                            meta = wants;
                        }
                        if wants {
                            let mut p = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                            p.extend_from_slice(BASE_ALLOCATION.as_bytes());
                            wr.write_all(&reply(REP_META_CONTEXT, &p)).await?;
                        }
                        wr.write_all(&reply(REP_ACK, &[])).await?;
                    }
                }
                _ => {
                    wr.write_all(&err(
                        REP_ERR_UNSUP,
                        &format!("option {opt} is not supported"),
                    ))
                    .await?;
                }
            }
            wr.flush().await?;
        }
    }
}
