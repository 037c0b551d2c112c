//! The bucket layout: every key strata writes, spelled here and nowhere else
//! (docs/FORMATS.md, "Object store keys" and "Relay keys").
//!
//! ```text
//! t/{tenant}/obj/{hex[..2]}/{hex}                       an immutable object (packed blocks)
//! t/{tenant}/man/{hex}                                   a manifest
//! t/{tenant}/relay/{stream}/{meta,data}/{name}           relay files of the legacy layout
//! t/{tenant}/relay2/{incarnation}/{stream}/{meta,data,parts}/…   relay files since incarnations
//! ```
//!
//! Tenant and stream names are validated before they get here (a name with `/` never does);
//! what the store lists is parsed back with [`parse`], which says whose and what a key is.

use object_store::path::Path;
use strata_format::Hash;

/// Everything of `tenant`'s: listings for GC's reconciliation, a tenant's purge.
pub fn tenant(tenant: &str) -> Path {
    Path::from(format!("t/{tenant}"))
}

/// Immutable object `id` of `tenant` (fanned out by the id's first byte).
pub fn object(tenant: &str, id: &Hash) -> Path {
    let hex = id.to_hex();
    Path::from(format!("t/{tenant}/obj/{}/{hex}", &hex[..2]))
}

/// Manifest `id` of `tenant`.
pub fn manifest(tenant: &str, id: &Hash) -> Path {
    Path::from(format!("t/{tenant}/man/{}", id.to_hex()))
}

/// Where a relay stream's keys are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayLayout {
    /// `t/{T}/relay/{stream}/…`: files stored before incarnations were in keys.
    Legacy,
    /// `t/{T}/relay2/{incarnation}/{stream}/…`: the tenant's `created_ms` in every key.
    Incarnation(u64),
}

fn relay_root(tenant: &str, stream: &str, layout: RelayLayout) -> String {
    match layout {
        RelayLayout::Legacy => format!("t/{tenant}/relay/{stream}"),
        RelayLayout::Incarnation(inc) => format!("t/{tenant}/relay2/{inc}/{stream}"),
    }
}

/// The prefix of a relay stream's `what` keys (`meta`, `data` or `parts`) in `layout`.
pub fn relay_prefix(tenant: &str, stream: &str, layout: RelayLayout, what: &str) -> Path {
    Path::from(format!("{}/{what}", relay_root(tenant, stream, layout)))
}

/// A key under a relay stream: `what` is `meta`, `data` or `parts`, `rest` the file's part.
pub fn relay(tenant: &str, stream: &str, layout: RelayLayout, what: &str, rest: &str) -> Path {
    Path::from(format!(
        "{}/{what}/{rest}",
        relay_root(tenant, stream, layout)
    ))
}

/// The root of every incarnation's relay keys of `tenant` (each a `{incarnation}/` below it).
pub fn relay_incarnations(tenant: &str) -> Path {
    Path::from(format!("t/{tenant}/relay2"))
}

/// What a key is, read back from a listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Object(Hash),
    Manifest(Hash),
    /// Anything else under the tenant's prefix (relay files, keys of other layouts).
    Other,
}

/// The tenant a key belongs to and what it is; `None` for a key outside every tenant's prefix.
pub fn parse(key: &str) -> Option<(&str, Kind)> {
    let rest = key.strip_prefix("t/")?;
    let (tenant, rest) = rest.split_once('/')?;
    if tenant.is_empty() {
        return None;
    }
    let kind = if let Some(o) = rest.strip_prefix("obj/") {
        o.split_once('/')
            .and_then(|(_, hex)| hex.parse().ok())
            .map_or(Kind::Other, Kind::Object)
    } else if let Some(hex) = rest.strip_prefix("man/") {
        hex.parse().map_or(Kind::Other, Kind::Manifest)
    } else {
        Kind::Other
    };
    Some((tenant, kind))
}

/// Whether a key is an object's (what an encrypted tenant enciphers in counter mode).
pub fn is_object(key: &str) -> bool {
    key.split('/').nth(2) == Some("obj")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_back_to_what_made_them() {
        let h = Hash::of(b"x");
        for t in ["acme", "a-b"] {
            assert_eq!(parse(object(t, &h).as_ref()), Some((t, Kind::Object(h))));
            assert_eq!(
                parse(manifest(t, &h).as_ref()),
                Some((t, Kind::Manifest(h)))
            );
            assert!(is_object(object(t, &h).as_ref()));
            assert!(!is_object(manifest(t, &h).as_ref()));
            for layout in [RelayLayout::Legacy, RelayLayout::Incarnation(7)] {
                let k = relay(t, "s", layout, "data", "f");
                assert_eq!(parse(k.as_ref()), Some((t, Kind::Other)));
                assert!(!is_object(k.as_ref()));
            }
            assert!(relay(t, "s", RelayLayout::Incarnation(7), "meta", "f")
                .as_ref()
                .starts_with(relay_incarnations(t).as_ref()));
            assert!(object(t, &h)
                .as_ref()
                .starts_with(&format!("{}/", tenant(t))));
        }
        assert_eq!(parse("x/acme/man/00"), None);
        assert_eq!(parse("t//man/00"), None);
        assert_eq!(parse("t/acme/obj/zz/nothex"), Some(("acme", Kind::Other)));
    }
}
