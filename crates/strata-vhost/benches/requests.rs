//! The per-request CPU cost of the vhost-user-blk backend, beside strata's own NBD server on
//! the same in-memory device: 4 KiB reads and writes, CPU time of the serving threads only
//! (from `/proc/self/task/*/stat`; the client runs on the main thread and is not counted).
//!
//! `cargo bench -p strata-vhost --bench requests` (full); under `cargo test` a smoke run.
//! Results and the command: docs/BENCHMARKS.md.

#[path = "../tests/frontend/mod.rs"]
mod frontend;

use std::sync::Arc;
use std::time::Instant;

use frontend::{connect, F_WRITE, T_IN, T_OUT};
use strata_nbd::{BlockDevice, Export, Exports, MemDevice, Server, ServerConfig};
use vm_memory::{Bytes, GuestAddress};

const DISK: u64 = 64 << 20;
/// Most requests per kick: a ring of 16 descriptors holds five 3-descriptor chains.
const MAX_DEPTH: u16 = 5;

/// CPU seconds of every thread of this process but the main one.
fn server_cpu() -> f64 {
    let me = std::process::id().to_string();
    let mut ticks = 0u64;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if t.file_name().to_string_lossy() == me {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // Fields after the parenthesised name: utime is the 14th field, stime the 15th.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    ticks as f64 / 100.0
}

struct Row {
    name: &'static str,
    requests: u64,
    wall: f64,
    cpu: f64,
}

fn vhost(n: u64, write: bool, depth: u16, rt: &tokio::runtime::Runtime) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.sock");
    let dev: Arc<dyn BlockDevice> = MemDevice::new(DISK);
    let features = strata_vhost::Features {
        read_only: false,
        flush: true,
        num_queues: 1,
        queue_size: 256,
        serial: "bench".into(),
        unsealed_memory: false,
    };
    let served = strata_vhost::serve(&path, dev, features, rt.handle().clone()).unwrap();
    let mut g = connect(&path);
    let blocks = DISK / 4096;
    let (kind, flag) = if write { (T_OUT, 0) } else { (T_IN, F_WRITE) };
    for i in 0..MAX_DEPTH as u64 {
        g.mem
            .write_slice(&[i as u8; 4096], GuestAddress(0x100000 + i * 0x1000))
            .unwrap();
    }
    let (c0, t0) = (server_cpu(), Instant::now());
    let mut lba = 0u64;
    let mut done = 0;
    while done < n {
        for i in 0..depth as u64 {
            let h = 0x10000 + i * 0x200;
            g.header(h, kind, (lba % blocks) * 8);
            g.chain(
                &[
                    (h, 16, 0),
                    (0x100000 + i * 0x1000, 4096, flag),
                    (h + 0x100, 1, F_WRITE),
                ],
                None,
            );
            lba = lba
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407)
                >> 11;
        }
        g.spin_complete(depth);
        done += depth as u64;
    }
    let row = Row {
        name: match (write, depth) {
            (false, 1) => "vhost-user 4 KiB read, QD1",
            (true, 1) => "vhost-user 4 KiB write, QD1",
            (false, _) => "vhost-user 4 KiB read, 5 per kick",
            (true, _) => "vhost-user 4 KiB write, 5 per kick",
        },
        requests: done,
        wall: t0.elapsed().as_secs_f64(),
        cpu: server_cpu() - c0,
    };
    drop(g);
    served.stop();
    row
}

fn nbd(n: u64, write: bool, rt: &tokio::runtime::Runtime) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("n.sock");
    let exports = Exports::new();
    exports.insert(
        "d",
        Export {
            device: MemDevice::new(DISK),
            description: String::new(),
            multi_conn: true,
        },
    );
    let server = Server::new(exports, ServerConfig::default());
    let l = {
        let _g = rt.enter();
        Server::bind_unix(&path).unwrap()
    };
    rt.spawn(server.clone().serve_unix(l));
    // The client on the main thread, on a runtime of its own.
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client_rt.block_on(async {
        let mut c = strata_nbd::client::Client::connect_unix(&path, "d")
            .await
            .unwrap();
        let blocks = DISK / 4096;
        let buf = vec![7u8; 4096];
        let (c0, t0) = (server_cpu(), Instant::now());
        let mut lba = 0u64;
        for _ in 0..n {
            let off = (lba % blocks) * 4096;
            if write {
                c.write(off, &buf, false).await.unwrap();
            } else {
                c.read(off, 4096).await.unwrap();
            }
            lba = lba
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407)
                >> 11;
        }
        Row {
            name: if write {
                "NBD (strata) 4 KiB write, QD1"
            } else {
                "NBD (strata) 4 KiB read, QD1"
            },
            requests: n,
            wall: t0.elapsed().as_secs_f64(),
            cpu: server_cpu() - c0,
        }
    })
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full { 200_000 } else { 2_000 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let rows = [
        vhost(n, false, 1, &rt),
        vhost(n, true, 1, &rt),
        vhost(n, false, MAX_DEPTH, &rt),
        vhost(n, true, MAX_DEPTH, &rt),
        nbd(n, false, &rt),
        nbd(n, true, &rt),
    ];
    println!(
        "| front-end, request | requests | µs CPU per request (serving threads) | requests/s |"
    );
    println!("|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.0} |",
            r.name,
            r.requests,
            r.cpu * 1e6 / r.requests as f64,
            r.requests as f64 / r.wall
        );
    }
    if !full {
        println!("(smoke run: `cargo bench -p strata-vhost --bench requests` measures)");
    }
}
