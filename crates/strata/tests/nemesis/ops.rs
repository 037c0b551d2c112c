//! The nemesis operations that involve a second tenant or a second node: a busy tenant
//! deleted, a workspace taken over by node B.

use super::*;

impl Campaign {
    /// Another tenant on node A writes, checkpoints and is deleted while its detach is in
    /// flight (the deletion is refused while attached and retried): the campaign's tenant,
    /// writing throughout, must lose nothing, and nothing of the other may remain.
    pub(crate) async fn delete_busy_tenant(&mut self) {
        self.n += 1;
        let t = format!("gone{}", self.n);
        let admin = Api::with_timeout(&self.a.url, ADMIN, Duration::from_secs(120));
        let (s, v) = admin.post("/v1/tenants", json!({ "name": t })).await;
        if s != StatusCode::CREATED {
            return self.fail(format!("creating tenant {t}: {s} {v}"));
        }
        let api = Api::new(&self.a.url, v["token"].as_str().unwrap_or_default());
        let (s, v) = api
            .post("/v1/workspaces", json!({"name": "w", "size": 8u64 << 20}))
            .await;
        if s != StatusCode::CREATED {
            return self.fail(format!("{t}: create: {s} {v}"));
        }
        let Some(sock) = attach(&api, "w", Duration::from_secs(20)).await else {
            return self.fail(format!("{t}: attach"));
        };
        match Client::connect_unix(Path::new(&sock), "w").await {
            Ok(mut c) => {
                let wrote = async {
                    c.write(0, &vec![0x77u8; 256 << 10], false).await?;
                    c.flush().await
                };
                if let Err(e) = wrote.await {
                    return self.fail(format!("{t}: write: {e}"));
                }
            }
            Err(e) => return self.fail(format!("{t}: connect: {e}")),
        }
        let (s, v) = api
            .post("/v1/workspaces/w/checkpoint", json!({"wait": true}))
            .await;
        if s != StatusCode::OK {
            return self.fail(format!("{t}: checkpoint: {s} {v}"));
        }
        let path = format!("/v1/tenants/{t}");
        let deleted = async {
            for _ in 0..200 {
                let (s, v) = admin.delete(&path).await;
                match s {
                    StatusCode::OK => return Ok(v),
                    StatusCode::CONFLICT => tokio::time::sleep(Duration::from_millis(50)).await,
                    _ => return Err(format!("{s} {v}")),
                }
            }
            Err("still attached after 10 s".to_string())
        };
        let (detached, deleted) =
            tokio::join!(api.post("/v1/workspaces/w/detach", json!({})), deleted);
        if detached.0 != StatusCode::OK {
            return self.fail(format!("{t}: detach: {detached:?}"));
        }
        match deleted {
            Ok(v) if v["workspaces"] == 1 => {}
            Ok(v) => return self.fail(format!("{t}: deleted {v}")),
            Err(e) => return self.fail(format!("{t}: delete: {e}")),
        }
        let (_, list) = admin.get("/v1/tenants").await;
        if list.to_string().contains(&format!("\"{t}\"")) {
            self.fail(format!("{t} still listed: {list}"));
        }
    }

    /// Node A stops past its lease (2 s); B takes `s` over; A resumes and must acknowledge
    /// nothing more for `s`.
    pub(crate) async fn takeover(&mut self) {
        let w = self.ws["s"].clone();
        let old = lock(&w.socket).clone();
        let a = self.a.daemon.as_ref().expect("A runs");
        a.signal("STOP");
        let b = self.b.api(&self.token);
        let sock = attach(&b, "s", Duration::from_secs(20)).await;
        a.signal("CONT");
        if sock.is_none() {
            self.fail("B could not take s over".into());
            return;
        }
        w.epoch.fetch_add(1, SeqCst);
        self.s_on_b = true;
        *lock(&w.socket) = sock;
        w.epoch.fetch_add(1, SeqCst);
        // The fenced node acknowledges nothing: a write and flush through its old export fail.
        if let Some(old) = old {
            if let Ok(Ok(mut c)) = tokio::time::timeout(
                Duration::from_secs(5),
                Client::connect_unix(Path::new(&old), "s"),
            )
            .await
            {
                let tag = 1 << 62;
                let w_ok = c.write(0, &block(tag, 0), false).await.is_ok();
                let f_ok = c.flush().await.is_ok();
                if w_ok && f_ok {
                    self.fail("A acknowledged a flushed write to s after B took it over".into());
                }
            }
        }
    }
}
