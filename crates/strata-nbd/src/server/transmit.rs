//! Transmission: the reader loop parses requests, charges them to the connection's budget,
//! reads payloads and spawns each operation; every reply goes through one writer task (see
//! the crate's `server` module docs).

use super::*;

impl Server {
    pub(super) async fn transmit<R, W>(
        &self,
        rd: R,
        wr: W,
        neg: Negotiated,
    ) -> Result<(), ConnError>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<Reply>(128);
        let mut writer = AbortOnDrop(tokio::spawn(send_replies(rx, wr)));
        // Pipelined requests arrive together: one read takes many headers (and small
        // payloads) instead of two system calls per request.
        let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER, rd);
        let budget = Arc::new(Semaphore::new(self.cfg.max_inflight_bytes as usize));
        let mut tasks = JoinSet::new();
        let dev = neg.export.device.clone();
        // Named in every error the connection logs (no span on the request path: entering one
        // per poll costs every connection a shared lock).
        let export: Arc<str> = neg.name.as_str().into();
        let ro = dev.read_only();
        let batches = dev.batches_writes();
        let structured = neg.structured;
        let mut stop = self.stopped();
        let result: Result<(), ConnError> = 'conn: loop {
            let mut head = [0u8; REQUEST_LEN];
            let read = async {
                match self.cfg.idle_timeout {
                    Some(t) => tokio::time::timeout(t, rd.read_exact(&mut head)).await.ok(),
                    None => Some(rd.read_exact(&mut head).await),
                }
            };
            // Shutdown takes effect between requests: a request whose header arrived is
            // served to completion; none is accepted after.
            let got = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => break Ok(()),
                r = read => match r {
                    Some(r) => r,
                    None => break Ok(()),
                },
            };
            match got {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break Ok(()),
                Err(e) => break Err(e.into()),
            }
            let req = match parse_request(&head) {
                Ok(r) => r,
                Err(e) => break Err(e.into()),
            };
            if neg.alive.as_ref().is_some_and(|a| !a()) {
                break Ok(());
            }
            while tasks.try_join_next().is_some() {}
            if req.kind == CMD_DISC {
                break Ok(());
            }
            let len = req.length;
            // A WRITE's payload is always consumed, even when the request is refused.
            if req.kind == CMD_WRITE && len > self.cfg.max_request {
                if len as u64 > 4 * self.cfg.max_request as u64 {
                    break Err(ProtoError::TooLarge("write payload").into());
                }
                let mut left = len as u64;
                let mut sink = vec![0u8; 1 << 20];
                while left > 0 {
                    let n = left.min(sink.len() as u64) as usize;
                    if let Err(e) = rd.read_exact(&mut sink[..n]).await {
                        break 'conn Err(e.into());
                    }
                    left -= n as u64;
                }
                let _ = tx
                    .send(
                        error_reply(
                            structured,
                            &req,
                            EINVAL,
                            "request larger than the advertised maximum",
                        )
                        .into(),
                    )
                    .await;
                continue;
            }
            let reserve = match req.kind {
                CMD_READ | CMD_WRITE => len.min(self.cfg.max_request),
                // Its plan and reply grow with the span it covers (clamped to max_request).
                CMD_BLOCK_STATUS => self.cfg.max_request / 16,
                _ => 0,
            };
            let charge = reserve.max(MIN_CHARGE);
            let conn_permit = match budget.clone().acquire_many_owned(charge).await {
                Ok(p) => p,
                Err(_) => break Ok(()),
            };
            // The owner's budget across all its connections (a tenant's, over every export):
            // many connections cannot hold more than it between them. Only requests that
            // carry or return data are charged: a FLUSH (or trim, or zeroing) holds no buffer,
            // and must never wait behind another export's stalled reads.
            let shared = match self.cfg.shared_budget.as_ref().filter(|_| reserve > 0) {
                Some(s) => match s.clone().acquire_many_owned(charge).await {
                    Ok(p) => Some(p),
                    Err(_) => break Ok(()),
                },
                None => None,
            };
            let permit = Charge {
                _conn: conn_permit,
                _shared: shared,
            };
            let mut payload = Vec::new();
            if req.kind == CMD_WRITE {
                payload = vec![0u8; len as usize];
                if let Err(e) = rd.read_exact(&mut payload).await {
                    break Err(e.into());
                }
            }
            // The device's size now, not at the handshake: a disk grown since is usable by
            // a client told of it (the kernel's, after a RECONFIGURE of its size).
            if let Some((errno, msg)) = validate(
                &req,
                dev.size(),
                ro,
                structured,
                neg.meta,
                self.cfg.max_request,
            ) {
                let mut r: Reply = error_reply(structured, &req, errno, msg).into();
                r.permit = Some(permit);
                let _ = tx.send(r).await;
                continue;
            }
            let (dev, tx, export) = (dev.clone(), tx.clone(), export.clone());
            let metrics = self.cfg.metrics.clone();
            let max_span = self.cfg.max_request;
            let alive = neg.alive.clone();
            if req.kind == CMD_WRITE && req.flags == 0 && batches {
                // Pipelined writes already in the read buffer go to the device together (one
                // journal write, one task), each still charged and answered on its own.
                let mut batch = vec![(req, payload, permit)];
                let mut bytes = len as usize;
                while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
                    let Some(next) = self.buffered_write(&rd, dev.size(), ro, structured, neg.meta)
                    else {
                        break;
                    };
                    let charge = next.length.max(MIN_CHARGE);
                    let Ok(conn_permit) = budget.clone().try_acquire_many_owned(charge) else {
                        break;
                    };
                    let shared = match self.cfg.shared_budget.as_ref() {
                        Some(s) => match s.clone().try_acquire_many_owned(charge) {
                            Ok(p) => Some(p),
                            Err(_) => break,
                        },
                        None => None,
                    };
                    let at = REQUEST_LEN + next.length as usize;
                    let payload = rd.buffer()[REQUEST_LEN..at].to_vec();
                    tokio::io::AsyncBufRead::consume(std::pin::Pin::new(&mut rd), at);
                    bytes += payload.len();
                    let permit = Charge {
                        _conn: conn_permit,
                        _shared: shared,
                    };
                    batch.push((next, payload, permit));
                }
                tasks.spawn(async move {
                    if alive.is_some_and(|a| !a()) {
                        return; // never answered, as below
                    }
                    let started = std::time::Instant::now();
                    let writes: Vec<(u64, &[u8])> =
                        batch.iter().map(|(r, p, _)| (r.offset, &p[..])).collect();
                    let results = dev.write_many(&writes).await;
                    drop(writes);
                    for ((req, _, permit), res) in batch.into_iter().zip(results) {
                        let ok = res.is_ok();
                        let mut reply: Reply = status_reply(&export, &req, structured, res).into();
                        if let Some(h) = metrics.as_ref().and_then(|m| m.for_command(CMD_WRITE)) {
                            let bytes = if ok { req.length as u64 } else { 0 };
                            h.record(started.elapsed(), bytes, ok);
                        }
                        reply.permit = Some(permit);
                        let _ = tx.send(reply).await;
                    }
                });
                continue;
            }
            tasks.spawn(async move {
                let changes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
                if changes && alive.is_some_and(|a| !a()) {
                    // Never answered: the client resends it on a live connection.
                    return;
                }
                let started = std::time::Instant::now();
                let mut reply = execute(&*dev, &export, &req, payload, structured, max_span).await;
                if let Some(h) = metrics.as_ref().and_then(|m| m.for_command(req.kind)) {
                    let ok = reply_ok(&reply.head);
                    let bytes = if matches!(req.kind, CMD_READ | CMD_WRITE) && ok {
                        req.length as u64
                    } else {
                        0
                    };
                    h.record(started.elapsed(), bytes, ok);
                }
                reply.permit = Some(permit);
                let _ = tx.send(reply).await;
            });
        };
        // Finish what was accepted, then close: acknowledged work is never abandoned.
        while tasks.join_next().await.is_some() {}
        drop(tx);
        match (&mut writer.0).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(e) => return Err(io::Error::other(e.to_string()).into()),
        }
        result
    }
}

/// At most this many writes, and about this many bytes, go to the device together.
const MAX_BATCH: usize = 64;
const MAX_BATCH_BYTES: usize = 1 << 20;

impl Server {
    /// The next request if it is a plain WRITE (no flags) that is already whole in the read
    /// buffer and passes every check: it may join a batch. Anything else is left for the
    /// reader loop to take as usual.
    fn buffered_write<R: AsyncRead>(
        &self,
        rd: &tokio::io::BufReader<R>,
        size: u64,
        ro: bool,
        structured: bool,
        meta: bool,
    ) -> Option<Request> {
        let buf = rd.buffer();
        let req = parse_request(buf.get(..REQUEST_LEN)?.try_into().ok()?).ok()?;
        let fits = req.kind == CMD_WRITE
            && req.flags == 0
            && req.length <= self.cfg.max_request
            && buf.len() >= REQUEST_LEN + req.length as usize;
        (fits && validate(&req, size, ro, structured, meta, self.cfg.max_request).is_none())
            .then_some(req)
    }
}

/// Checks a request against the export and the negotiated features; Some((errno, why)) refuses.
fn validate(
    req: &Request,
    size: u64,
    ro: bool,
    structured: bool,
    meta: bool,
    max: u32,
) -> Option<(u32, &'static str)> {
    let allowed = match req.kind {
        CMD_READ => {
            if structured {
                CMD_FLAG_DF
            } else {
                0
            }
        }
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_FLUSH => 0,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        _ => return Some((EINVAL, "unknown or unadvertised command")),
    };
    if req.flags & !allowed != 0 {
        return Some((EINVAL, "flag not valid for this command"));
    }
    let write = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if write && ro {
        return Some((EPERM, "export is read-only"));
    }
    if req.kind == CMD_FLUSH {
        return (req.offset != 0 || req.length != 0)
            .then_some((EINVAL, "FLUSH must have zero offset and length"));
    }
    // BLOCK_STATUS carries no payload: its length is a hint, not bounded by the block size.
    if req.kind == CMD_READ && req.length > max {
        return Some((EINVAL, "request larger than the advertised maximum"));
    }
    if req.kind == CMD_BLOCK_STATUS && (!meta || req.length == 0) {
        return Some((
            EINVAL,
            "BLOCK_STATUS needs base:allocation negotiated and a non-zero length",
        ));
    }
    match req.offset.checked_add(req.length as u64) {
        Some(end) if end <= size => None,
        _ if write => Some((ENOSPC, "beyond the end of the export")),
        _ => Some((EINVAL, "beyond the end of the export")),
    }
}

/// Whether an encoded reply reports success.
fn reply_ok(reply: &[u8]) -> bool {
    match reply.get(..4) {
        Some(m) if m == SIMPLE_REPLY_MAGIC.to_be_bytes() => {
            reply.get(4..8) == Some(&[0, 0, 0, 0][..])
        }
        Some(_) => reply
            .get(6..8)
            .is_some_and(|t| u16::from_be_bytes([t[0], t[1]]) & (1 << 15) == 0),
        None => false,
    }
}

fn error_reply(structured: bool, req: &Request, errno: u32, msg: &str) -> Vec<u8> {
    if structured && matches!(req.kind, CMD_READ | CMD_BLOCK_STATUS) {
        structured_error(req.cookie, errno, msg)
    } else {
        simple_reply(errno, req.cookie, &[])
    }
}

/// Whether an ENOSPC reply may be logged now (at most one a second).
fn enospc_log_due() -> bool {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(Relaxed);
    now != last && LAST.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
}

/// The reply to a request that returns no data.
fn status_reply(export: &str, req: &Request, structured: bool, r: Result<(), DevError>) -> Vec<u8> {
    match r {
        Ok(()) => simple_reply(0, req.cookie, &[]),
        Err(e) => {
            // A guest at its quota or on a full disk may retry in a tight loop: its ENOSPC
            // replies are logged at most once a second per process, not once each.
            if e.errno != ENOSPC || enospc_log_due() {
                tracing::warn!(export, errno = e.errno, error = %e.msg, "nbd request failed");
            }
            error_reply(structured, req, e.errno, &e.msg)
        }
    }
}

async fn execute(
    dev: &dyn BlockDevice,
    export: &str,
    req: &Request,
    payload: Vec<u8>,
    structured: bool,
    max_span: u32,
) -> Reply {
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let done = |r: Result<(), DevError>| status_reply(export, req, structured, r);
    let head = match req.kind {
        CMD_READ => match dev.read(req.offset, req.length).await {
            Ok(data) if structured => {
                let mut head = structured_header(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    req.cookie,
                    8 + data.len(),
                );
                head.extend_from_slice(&req.offset.to_be_bytes());
                return Reply {
                    head,
                    data,
                    permit: None,
                };
            }
            Ok(data) => {
                return Reply {
                    head: simple_reply(0, req.cookie, &[]),
                    data,
                    permit: None,
                }
            }
            Err(e) => {
                tracing::warn!(export, errno = e.errno, error = %e.msg, "nbd read failed");
                // A simple error reply for a read carries no data.
                error_reply(structured, req, e.errno, &e.msg)
            }
        },
        CMD_WRITE => done(dev.write(req.offset, &payload, fua).await),
        CMD_FLUSH => done(dev.flush().await),
        CMD_TRIM => done(dev.trim(req.offset, req.length, fua).await),
        // NO_HOLE asks for the range to stay provisioned so later writes cannot run out of
        // space. A copy-on-write device cannot promise that (every write appends), and writing
        // real zeros would only fill its journal, so both forms record the range as zeros:
        // metadata only, and fast.
        CMD_WRITE_ZEROES => done(dev.write_zeroes(req.offset, req.length, fua).await),
        // A prefix of the range at most `max_span` long: the spec lets the client ask again.
        CMD_BLOCK_STATUS => match dev.allocation(req.offset, req.length.min(max_span)).await {
            Ok(runs) => {
                let mut p = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                let most = if req.flags & CMD_FLAG_REQ_ONE != 0 {
                    1
                } else {
                    MAX_EXTENTS
                };
                for (len, zero) in runs.iter().take(most) {
                    // Lengths are bounded by the request length (u32).
                    p.extend_from_slice(&(*len as u32).to_be_bytes());
                    p.extend_from_slice(
                        &(if *zero { STATE_HOLE | STATE_ZERO } else { 0 }).to_be_bytes(),
                    );
                }
                structured_chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, req.cookie, &[&p])
            }
            Err(e) => structured_error(req.cookie, e.errno, &e.msg),
        },
        _ => error_reply(structured, req, EINVAL, "unknown command"),
    };
    head.into()
}
