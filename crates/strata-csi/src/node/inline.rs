//! An inline ephemeral volume's attributes (`volumeAttributes` in the pod spec):
//!
//! | attribute     | meaning                                                              |
//! |---------------|----------------------------------------------------------------------|
//! | `workspace`   | the stable workspace id; `{pod.namespace}`, `{pod.name}`, `{pod.uid}`, `{serviceAccount.name}` are replaced (default `{pod.namespace}.{pod.name}`) |
//! | `template`    | create the workspace from this template when it does not exist       |
//! | `size`        | or create an empty disk of this size (`10Gi`, `512Mi`, bytes)        |
//! | `mode`        | `durable` (default), `sync` or `ephemeral`                           |
//! | `onUnpublish` | `checkpoint` (default): keep the work, resumable on any node; `discard`: delete the workspace |
//!
//! Any other attribute (outside `csi.storage.k8s.io/`) is refused: a typo must not silently
//! give a pod the wrong disk.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tonic::Status;

use crate::invalid;

/// The largest empty disk a pod's attributes may ask for (1 TiB).
pub const MAX_INLINE_SIZE: u64 = 1 << 40;

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnUnpublish {
    Checkpoint,
    Discard,
    /// A persistent volume: unpublish only detaches.
    Keep,
}

#[derive(Debug, PartialEq)]
pub struct Inline {
    pub workspace: String,
    pub template: Option<String>,
    pub size: Option<u64>,
    pub mode: Option<String>,
    pub on_unpublish: OnUnpublish,
}

const POD_KEYS: [(&str, &str); 4] = [
    ("{pod.namespace}", "csi.storage.k8s.io/pod.namespace"),
    ("{pod.name}", "csi.storage.k8s.io/pod.name"),
    ("{pod.uid}", "csi.storage.k8s.io/pod.uid"),
    (
        "{serviceAccount.name}",
        "csi.storage.k8s.io/serviceAccount.name",
    ),
];

impl Inline {
    pub fn parse(ctx: &HashMap<String, String>) -> Result<Inline, Status> {
        for k in ctx.keys() {
            let known = matches!(
                k.as_str(),
                "workspace" | "template" | "size" | "mode" | "onUnpublish"
            ) || k.starts_with("csi.storage.k8s.io/");
            if !known {
                return Err(invalid(format!(
                    "unknown volume attribute {k:?} (known: workspace, template, size, mode, onUnpublish)"
                )));
            }
        }
        let pattern = ctx
            .get("workspace")
            .map(String::as_str)
            .unwrap_or("{pod.namespace}.{pod.name}");
        let mut workspace = pattern.to_string();
        for (placeholder, key) in POD_KEYS {
            if workspace.contains(placeholder) {
                let v = ctx.get(key).filter(|v| !v.is_empty()).ok_or_else(|| {
                    invalid(format!(
                        "workspace {pattern:?} uses {placeholder} but the kubelet sent no {key} (is podInfoOnMount set on the CSIDriver?)"
                    ))
                })?;
                workspace = workspace.replace(placeholder, v);
            }
        }
        // A pod reaches only its own namespace's inline workspaces: the name is always
        // `NAMESPACE.…` (namespaces hold no dots), never another namespace's nor a
        // controller volume's (those hold no dots either).
        if !pattern.starts_with("{pod.namespace}.") {
            let ns = ctx
                .get("csi.storage.k8s.io/pod.namespace")
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    invalid("the kubelet sent no csi.storage.k8s.io/pod.namespace (is podInfoOnMount set on the CSIDriver?)")
                })?;
            workspace = format!("{ns}.{workspace}");
        }
        strata_format::name::validate("workspace name", &workspace).map_err(|e| {
            invalid(format!(
                "workspace {workspace:?} (from {pattern:?}) is not a valid workspace name: {e}"
            ))
        })?;
        let template = ctx.get("template").cloned();
        if let Some(t) = &template {
            strata_format::name::validate("template name", t)
                .map_err(|e| invalid(format!("template {t:?}: {e}")))?;
        }
        let size = ctx.get("size").map(|s| parse_size(s)).transpose()?;
        if size.is_some_and(|s| s > MAX_INLINE_SIZE) {
            return Err(invalid(format!(
                "size: an inline workspace is at most {} GiB",
                MAX_INLINE_SIZE >> 30
            )));
        }
        if template.is_some() && size.is_some() {
            return Err(invalid(
                "give template or size, not both (a template's disk has the template's size)",
            ));
        }
        let mode = ctx.get("mode").cloned();
        if let Some(m) = &mode {
            if !matches!(m.as_str(), "durable" | "sync" | "ephemeral") {
                return Err(invalid(format!(
                    "mode {m:?}: expected durable, sync or ephemeral"
                )));
            }
        }
        let on_unpublish = match ctx.get("onUnpublish").map(String::as_str) {
            None | Some("checkpoint") => OnUnpublish::Checkpoint,
            Some("discard") => OnUnpublish::Discard,
            Some(o) => {
                return Err(invalid(format!(
                    "onUnpublish {o:?}: expected checkpoint or discard"
                )))
            }
        };
        Ok(Inline {
            workspace,
            template,
            size,
            mode,
            on_unpublish,
        })
    }

    /// The body that creates this workspace, if the attributes say how.
    pub fn create_body(&self) -> Option<Value> {
        if self.template.is_none() && self.size.is_none() {
            return None;
        }
        let mut b = json!({ "name": self.workspace });
        if let Some(t) = &self.template {
            b["template"] = json!(t);
        }
        if let Some(s) = self.size {
            b["size"] = json!(s);
        }
        if let Some(m) = &self.mode {
            b["mode"] = json!(m);
        }
        Some(b)
    }
}

/// `1073741824`, `10Gi`, `512Mi`, `1Ti`, `100M`, `1G` (Kubernetes quantities, integral).
pub fn parse_size(s: &str) -> Result<u64, Status> {
    let bad = || {
        invalid(format!(
            "size {s:?}: expected bytes or a quantity such as 10Gi"
        ))
    };
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let mul: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    let v = n.checked_mul(mul).ok_or_else(bad)?;
    if v == 0 {
        return Err(bad());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const POD: [(&str, &str); 3] = [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.namespace", "agents"),
        ("csi.storage.k8s.io/pod.name", "run-7"),
    ];

    #[test]
    fn the_workspace_comes_from_the_attributes_and_the_pod() {
        let mut c = ctx(&POD);
        assert_eq!(Inline::parse(&c).unwrap().workspace, "agents.run-7");
        c.insert("workspace".into(), "ws-{pod.name}".into());
        c.insert("template".into(), "fs-7f3".into());
        let i = Inline::parse(&c).unwrap();
        assert_eq!(
            i.workspace, "agents.ws-run-7",
            "always in the pod's namespace"
        );
        assert_eq!(i.on_unpublish, OnUnpublish::Checkpoint);
        assert_eq!(
            i.create_body().unwrap(),
            json!({"name": "agents.ws-run-7", "template": "fs-7f3"})
        );
    }

    #[test]
    fn bad_attributes_are_refused() {
        let with = |k: &str, v: &str| {
            let mut c = ctx(&POD);
            c.insert(k.into(), v.into());
            Inline::parse(&c)
        };
        assert!(with("tempalte", "x").is_err());
        assert!(with("workspace", "../etc").is_err());
        // Another namespace's workspace by name: it lands in this pod's namespace.
        let mut c = ctx(&POD);
        c.insert("workspace".into(), "victims.run-1".into());
        assert_eq!(Inline::parse(&c).unwrap().workspace, "agents.victims.run-1");
        assert!(with("size", "2Ti").is_err(), "over the inline limit");
        assert!(with("workspace", "{pod.uid}").is_err(), "no pod.uid sent");
        assert!(with("template", "a/b").is_err());
        assert!(with("mode", "fast").is_err());
        assert!(with("onUnpublish", "keep").is_err());
        assert!(with("size", "-1").is_err());
        let mut c = ctx(&POD);
        c.insert("template".into(), "t".into());
        c.insert("size".into(), "1Gi".into());
        assert!(Inline::parse(&c).is_err());
        // A namespace and name that together are too long for a workspace name.
        let mut c = ctx(&POD);
        c.insert("csi.storage.k8s.io/pod.name".into(), "n".repeat(60));
        assert!(Inline::parse(&c).is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10Gi").unwrap(), 10 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1_000_000_000);
        for bad in [
            "",
            "0",
            "1.5Gi",
            "Gi",
            "99999999999999999999",
            "16777216Ti",
            "1gi",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
