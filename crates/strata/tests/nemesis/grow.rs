//! The nemesis's grow of a disk (its checker asserts that no size ever goes down), and its
//! requests whose client gives up.

use std::time::Duration;

use rand::Rng;
use reqwest::StatusCode;
use serde_json::json;

use crate::common::Api;
use crate::Campaign;

impl Campaign {
    /// Grows the disk by 1 to 63 blocks past its end (the model's blocks stay where they
    /// are), sometimes with the client cut off; the size must never go down.
    pub(crate) async fn grow(&mut self, name: &'static str, api: &Api) {
        let (_, v) = api.get(&format!("/v1/workspaces/{name}")).await;
        let Some(size) = v["workspace"]["disk_size"].as_u64() else {
            self.fail(format!("{name}: no disk size: {v}"));
            return;
        };
        let to = size + 4096 * self.rng.random_range(1..64);
        let path = format!("/v1/workspaces/{name}/resize");
        if self.rng.random_bool(0.3) {
            self.count("grow the disk (client cut off)");
            self.post_cut_off(api, &path, json!({ "size": to })).await;
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..300))).await;
            return;
        }
        self.count("grow the disk");
        let (s, v) = api.post(&path, json!({ "size": to })).await;
        if s != StatusCode::OK || v["disk_size"].as_u64() != Some(to) {
            self.fail(format!("grow of {name} to {to}: {s} {v}"));
        }
        let g = self.grown.entry(name).or_default();
        *g = (*g).max(to);
    }

    /// POSTs `body` to `path` with a client that gives up after 1 to 119 ms.
    pub(crate) async fn post_cut_off(&mut self, api: &Api, path: &str, body: serde_json::Value) {
        let quick = reqwest::Client::builder()
            .timeout(Duration::from_millis(self.rng.random_range(1..120)))
            .build()
            .unwrap();
        let _ = quick
            .post(format!("{}{path}", api.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await;
    }
}
