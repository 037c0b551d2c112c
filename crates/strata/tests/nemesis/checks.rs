//! The campaign's checker: every workspace read back on a fresh connection and judged against
//! its model, and pending checkpoints and forks verified.

use super::*;

impl Campaign {
    /// The checker: flush and read each workspace on a fresh connection and judge it against
    /// its model; then the verification of pending checkpoints and forks.
    pub(crate) async fn check(&mut self) {
        for p in self.pending.iter_mut() {
            if let Some(starts) = p.open_window.take() {
                p.allowed = lock(&self.ws[p.ws].model).window(&starts);
            }
        }
        for name in ["d", "s"] {
            let (_, v) = self
                .api_for(name)
                .get(&format!("/v1/workspaces/{name}"))
                .await;
            let size = v["workspace"]["disk_size"].as_u64().unwrap_or(0);
            if size < self.grown.get(name).copied().unwrap_or(0) {
                self.fail(format!("{name}: the disk shrank to {size}: {v}"));
            }
            let w = self.ws[name].clone();
            let sock = lock(&w.socket).clone();
            let Some(sock) = sock else {
                self.fail(format!("{name}: not served after the step"));
                continue;
            };
            // A node just resumed from SIGSTOP refuses flushes until its lease is renewed
            // (a fraction of a second): the checker waits for that, no longer.
            let mut seen = None;
            for _ in 0..50 {
                seen = read_all(&sock, name, true).await;
                if seen.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let Some(seen) = seen else {
                self.fail(format!("{name}: unreadable for 10 s after the step"));
                continue;
            };
            let mut codes = Vec::with_capacity(BLOCKS as usize);
            let mut bad = vec![];
            {
                let m = lock(&w.model);
                for b in 0..BLOCKS as usize {
                    match matches(seen[b], m.allowed(b)) {
                        Some(c) => codes.push(c),
                        None => {
                            bad.push((b, seen[b], m.durable[b]));
                            codes.push(m.durable[b]);
                        }
                    }
                }
            }
            let t = &self.tally;
            t.verified.fetch_add(BLOCKS, SeqCst);
            for &(_, got, _) in &bad {
                if got == u64::MAX {
                    t.wrong.fetch_add(1, SeqCst);
                } else {
                    t.lost.fetch_add(1, SeqCst);
                }
            }
            if !bad.is_empty() {
                self.fail(format!(
                    "{name}: {} blocks read back older or foreign data, e.g. (block, read, flushed) {:?}",
                    bad.len(),
                    &bad[..bad.len().min(4)]
                ));
            }
            lock(&w.model).settle(&codes);
        }
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            self.verify_checkpoint(p).await;
        }
    }

    /// Reads a checkpoint through a fork of it (made on A) and judges every block.
    pub(crate) async fn verify_checkpoint(&mut self, p: Pending) {
        let api = self.api_for(p.ws);
        let version = match p.version {
            Some(v) => Some(v),
            None => {
                let (_, log) = api.get(&format!("/v1/workspaces/{}/log", p.ws)).await;
                log.as_array()
                    .into_iter()
                    .flatten()
                    .find(|c| c["label"] == p.label.as_str())
                    .and_then(|c| c["version"].as_u64())
            }
        };
        let Some(version) = version else {
            return; // the cut-off checkpoint never happened: nothing promised
        };
        self.n += 1;
        let a = self.a.api(&self.token);
        let fork = match p.fork {
            Some(f) => f,
            None => {
                let f = format!("v{}", self.n);
                let (s, v) = api
                    .post(
                        &format!("/v1/workspaces/{}/fork", p.ws),
                        json!({"name": f, "version": version}),
                    )
                    .await;
                if s != StatusCode::CREATED {
                    self.fail(format!(
                        "{}@{version}: fork for checking failed: {s} {v}",
                        p.ws
                    ));
                    return;
                }
                f
            }
        };
        let Some(sock) = attach(&a, &fork, Duration::from_secs(10)).await else {
            self.fail(format!(
                "{fork}: a fork of {}@{version} does not attach",
                p.ws
            ));
            return;
        };
        let seen = read_all(&sock, &fork, false).await;
        let _ = a
            .post(&format!("/v1/workspaces/{fork}/detach"), json!({}))
            .await;
        let _ = a.delete(&format!("/v1/workspaces/{fork}")).await;
        let Some(seen) = seen else {
            self.fail(format!("{fork}: unreadable"));
            return;
        };
        let mut codes = vec![];
        let mut bad = vec![];
        for b in 0..BLOCKS as usize {
            match matches(seen[b], &p.allowed[b]) {
                Some(c) => codes.push(c),
                None => {
                    bad.push((b, seen[b], p.allowed[b].first().copied()));
                    codes.push(0);
                }
            }
        }
        self.tally.verified.fetch_add(BLOCKS, SeqCst);
        self.tally.lost.fetch_add(bad.len() as u64, SeqCst);
        if bad.is_empty() {
            self.verified
                .entry(p.ws)
                .or_default()
                .push((version, codes));
        } else {
            self.fail(format!(
                "{}@{version} (fork {fork}): {} blocks do not hold what was flushed before it was requested, e.g. {:?}",
                p.ws,
                bad.len(),
                &bad[..bad.len().min(4)]
            ));
        }
    }
}
