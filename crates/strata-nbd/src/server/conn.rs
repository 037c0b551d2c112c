//! A connection's byte streams: lock-free halves, buffered requests, coalesced replies.

use std::io;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// The connection's read buffer: a queue of pipelined 4 KiB writes fits in a few reads.
pub(super) const READ_BUFFER: usize = 256 << 10;

/// Replies whose data is at most this long are copied into one buffer with the replies queued
/// beside them and sent in one write; longer data is written from its own buffer.
const COALESCE_MAX: usize = 64 << 10;

/// Sends replies as they come: whatever is queued when the socket is free goes in one write
/// (small data copied beside its header; large data written from its own buffer). A request's
/// budget is returned only once its reply has left.
pub(super) async fn send_replies<W: AsyncWrite + Unpin>(
    mut rx: mpsc::Receiver<Reply>,
    mut wr: W,
) -> io::Result<()> {
    let mut out = Vec::with_capacity(COALESCE_MAX * 2);
    let mut sent = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(r) = next.take() {
            out.extend_from_slice(&r.head);
            if r.data.len() <= COALESCE_MAX {
                out.extend_from_slice(&r.data);
            } else {
                wr.write_all(&out).await?;
                out.clear();
                wr.write_all(&r.data).await?;
            }
            sent.push(r.permit);
            if out.len() >= COALESCE_MAX {
                break;
            }
            next = rx.try_recv().ok();
        }
        wr.write_all(&out).await?;
        out.clear();
        wr.flush().await?;
        sent.clear();
    }
    wr.flush().await
}

/// A connection split into halves that are used at once without a lock between them (the
/// reader waits for requests while the writer sends replies).
pub trait Conn: Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Read, Self::Write);
}

impl Conn for tokio::net::UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl Conn for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

/// In-memory pipes (tests): split with tokio's shared lock.
impl Conn for tokio::io::DuplexStream {
    type Read = tokio::io::ReadHalf<tokio::io::DuplexStream>;
    type Write = tokio::io::WriteHalf<tokio::io::DuplexStream>;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

/// A request's charge against the in-flight budgets: its connection's, and the one shared by
/// every connection of the server's owner (a tenant's, across all its exports), if any.
/// Held, never read: dropping it returns the bytes to both budgets.
pub(super) struct Charge {
    pub _conn: OwnedSemaphorePermit,
    pub _shared: Option<OwnedSemaphorePermit>,
}

/// A reply on its way to the wire: header, then (for reads) the data, and the request's share
/// of the in-flight budgets, returned once written.
pub(super) struct Reply {
    pub head: Vec<u8>,
    pub data: Vec<u8>,
    pub permit: Option<Charge>,
}

impl From<Vec<u8>> for Reply {
    fn from(head: Vec<u8>) -> Self {
        Reply {
            head,
            data: Vec::new(),
            permit: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;
    use tokio::sync::Semaphore;

    fn reply(tag: u8, data_len: usize) -> Reply {
        Reply {
            head: vec![tag; 16],
            data: (0..data_len).map(|i| (i as u8) ^ tag).collect(),
            permit: None,
        }
    }

    /// Replies queued together, small ones coalesced and large ones written on their own,
    /// arrive whole and in the order they were queued.
    #[tokio::test]
    async fn queued_replies_arrive_whole_and_in_order() {
        let (mut client, server) = tokio::io::duplex(4096);
        let (tx, rx) = mpsc::channel(128);
        let sizes = [
            0,
            4096,
            0,
            COALESCE_MAX,
            COALESCE_MAX + 1,
            17,
            1 << 20,
            0,
            4096,
        ];
        let mut expect = vec![];
        for round in 0..3u8 {
            for (i, &n) in sizes.iter().enumerate() {
                let r = reply(round * 16 + i as u8, n);
                expect.extend_from_slice(&r.head);
                expect.extend_from_slice(&r.data);
                tx.send(r).await.unwrap();
            }
        }
        drop(tx);
        let sender = tokio::spawn(send_replies(rx, server));
        let mut got = vec![];
        client.read_to_end(&mut got).await.unwrap();
        sender.await.unwrap().unwrap();
        assert_eq!(got.len(), expect.len());
        assert!(got == expect, "reply bytes differ from what was queued");
    }

    /// A request's budget comes back only once its reply has left: a client that stops
    /// reading holds the server's memory for its replies, never more.
    #[tokio::test]
    async fn a_permit_is_returned_only_after_its_reply_is_written() {
        let (mut client, server) = tokio::io::duplex(1024);
        let budget = Arc::new(Semaphore::new(1));
        let (tx, rx) = mpsc::channel(4);
        let sender = tokio::spawn(send_replies(rx, server));
        let mut r = reply(7, 8 << 10); // coalesced: copied, then written later
        r.permit = Some(Charge {
            _conn: budget.clone().acquire_owned().await.unwrap(),
            _shared: None,
        });
        tx.send(r).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(
            budget.available_permits(),
            0,
            "returned before the reply left"
        );
        let mut got = vec![0u8; 16 + (8 << 10)];
        client.read_exact(&mut got).await.unwrap();
        let back = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while budget.available_permits() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(back.is_ok(), "the permit never came back");
        drop(tx);
        sender.await.unwrap().unwrap();
    }
}
