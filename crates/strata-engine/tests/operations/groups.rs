//! Writes that arrive together ([`strata_engine::Volume::write_many`]) where no room is
//! written in place: one journal write under the writer lock.

use super::*;

/// Writes that arrive together on a segment with no room written in place (a new file, not
/// from the pool) are appended under the writer lock in one write: each reads back, and once
/// flushed each survives a power cut, torn or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_arrive_together_on_a_new_segment_are_appended_in_one_write() {
    let c = Cluster::new().await;
    let fs = SimFs::new();
    let cfg = c.config("n");
    for round in 0..4u64 {
        let node = c.node_with(cfg.clone(), Arc::new(fs.process()));
        let name = format!("new{round}");
        let v = empty_volume(&node, &name, DISK, Mode::Durable).await;
        let mut flushed = vec![0u64; 64];
        for i in 1..=20u64 {
            let blocks: Vec<(u64, Vec<u8>)> = (0..8)
                .map(|d| (i * 3 + d * 7) % 64)
                .map(|b| (b * 4096, tagged(i, b)))
                .collect();
            let writes: Vec<(u64, &[u8])> = blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
            for r in v.write_many(&writes).await {
                r.unwrap();
            }
            v.flush().await.unwrap();
            for (at, _) in &blocks {
                flushed[(*at / 4096) as usize] = i;
            }
        }
        let st = v.stats();
        assert_eq!(st.appends_unlocked, 0, "{st:?}");
        assert_eq!(st.appends_grouped, 160, "{st:?}");
        // One more group, never flushed: it may or may not survive, whole or in part.
        let blocks: Vec<(u64, Vec<u8>)> = (0..8).map(|b| (b * 4096, tagged(99, b))).collect();
        let writes: Vec<(u64, &[u8])> = blocks.iter().map(|(at, d)| (*at, &d[..])).collect();
        for r in v.write_many(&writes).await {
            r.unwrap();
        }
        fs.power_loss(40 + round, round % 2 == 0);
        node.abandon().await;
        drop(v);
        let node2 = c.node_with(cfg.clone(), Arc::new(fs.process()));
        let v = node2.attach(TENANT, &name).await.unwrap();
        let img = image(&v).await;
        for b in 0..64 {
            let got = img[b];
            assert!(
                got == flushed[b] || (b < 8 && got == 99),
                "round {round}, block {b}: {got} after the power cut, flushed {}",
                flushed[b]
            );
        }
        node2.abandon().await;
    }
}
