//! Retention's verdicts: which versions expire now, and when the verdict can next change by
//! time alone.

use std::collections::HashSet;

use strata_catalog::{Checkpoint, CheckpointKind};

use super::GcOptions;

/// Whether a version was published without anyone asking for a restore point: by the
/// background uploader or a sync-mode flush (`auto`), by a detach (`detach`), or by GC's
/// compaction (`compact`, the same data as the version before it).
pub fn is_automatic(kind: CheckpointKind) -> bool {
    matches!(
        kind,
        CheckpointKind::Auto | CheckpointKind::Detach | CheckpointKind::Compact
    )
}

/// Retention: which of `cps` (a workspace's visible checkpoints) expire now. `keep_last`
/// counts the unlabelled versions users made, `keep_auto` the automatic ones (see
/// [`is_automatic`]), each newest first and never counting the head. The version right before
/// a rollback is the state the rollback set aside (a rollback first publishes everything
/// acknowledged): whatever its kind, it counts as one a user made, so a rollback can be undone.
pub fn expired_versions(cps: &[Checkpoint], head: u64, now_ms: u64, opts: &GcOptions) -> Vec<u64> {
    let max_age_ms = opts.max_age.as_millis() as u64;
    let mut out = vec![];
    let (mut made_seen, mut auto_seen) = (0usize, 0usize);
    let set_aside: HashSet<u64> = cps
        .iter()
        .filter(|c| c.kind == CheckpointKind::Rollback)
        .map(|c| c.version - 1)
        .collect();
    for c in cps.iter().rev() {
        if c.version == head {
            continue;
        }
        let kept_until = c.keep_until_ms.is_some_and(|k| k > now_ms);
        if c.label.is_some() {
            if c.keep_until_ms.is_some() && !kept_until {
                out.push(c.version);
            }
            continue;
        }
        let too_many = if is_automatic(c.kind) && !set_aside.contains(&c.version) {
            auto_seen += 1;
            auto_seen > opts.keep_auto
        } else {
            made_seen += 1;
            made_seen > opts.keep_last
        };
        if kept_until {
            continue;
        }
        let too_old = now_ms.saturating_sub(c.created_ms) > max_age_ms;
        if too_many || too_old {
            out.push(c.version);
        }
    }
    out.sort();
    out
}

/// When retention's verdict on a workspace's checkpoints next changes by time alone (no
/// checkpoint added or kept): the earliest `keep_until` still ahead, or the earliest instant
/// at which an unlabelled one it keeps grows older than `max_age`, among the checkpoints it
/// keeps besides the head; `u64::MAX` if none.
pub fn retention_next(
    cps: &[Checkpoint],
    head: u64,
    expired: &[u64],
    now_ms: u64,
    opts: &GcOptions,
) -> u64 {
    let max_age_ms = opts.max_age.as_millis() as u64;
    let mut next = u64::MAX;
    for c in cps {
        if c.version == head || expired.contains(&c.version) {
            continue;
        }
        // Kept until later: nothing about it changes before then (after, it expires if
        // labelled, or by count or age if not).
        if let Some(k) = c.keep_until_ms.filter(|k| *k > now_ms) {
            next = next.min(k);
        } else if c.label.is_none() {
            next = next.min(c.created_ms.saturating_add(max_age_ms).saturating_add(1));
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use strata_format::Hash;

    fn cp(version: u64, kind: CheckpointKind, label: Option<&str>, age_s: u64) -> Checkpoint {
        Checkpoint {
            workspace: "w".into(),
            version,
            manifest: Hash([version as u8; 32]),
            label: label.map(str::to_string),
            kind,
            created_ms: NOW - age_s * 1000,
            bytes: 0,
            cut_seq: 0,
            journal_id: None,
            epoch: 1,
            keep_until_ms: None,
        }
    }

    const NOW: u64 = 1_000_000_000;

    fn opts(keep_last: usize, keep_auto: usize) -> GcOptions {
        GcOptions {
            grace: Duration::ZERO,
            keep_last,
            keep_auto,
            max_age: Duration::from_secs(3600),
            dry_run: false,
            reconcile: false,
            stop_after: None,
            compact_below: None,
            compact_detached_after: None,
        }
    }

    /// The next time retention's verdict can change by time alone: the earliest `keep_until`
    /// ahead or the earliest unlabelled kept version's `max_age`, never the head's or an
    /// expired one's; a labelled version without `keep_until` never expires.
    #[test]
    fn retention_looks_again_when_the_first_kept_version_would_age_out() {
        use CheckpointKind::*;
        let o = opts(16, 16); // max_age 3600 s
        let age_out = |age_s: u64| NOW - age_s * 1000 + 3_600_000 + 1;
        let mut cps = vec![
            cp(1, Create, None, 100),
            cp(2, Checkpoint, Some("kept"), 90),
            cp(3, Auto, None, 80),
            cp(4, Auto, None, 10),
        ];
        assert_eq!(retention_next(&cps, 4, &[], NOW, &o), age_out(100));
        assert_eq!(
            retention_next(&cps, 4, &[1], NOW, &o),
            age_out(80),
            "1 expired"
        );
        assert_eq!(
            retention_next(&cps, 1, &[3, 4], NOW, &o),
            u64::MAX,
            "only the head and a label"
        );
        cps[1].keep_until_ms = Some(NOW + 5);
        assert_eq!(
            retention_next(&cps, 4, &[], NOW, &o),
            NOW + 5,
            "a keep_until ahead"
        );
        cps[1].keep_until_ms = Some(NOW - 5);
        assert_eq!(
            retention_next(&cps, 4, &[], NOW, &o),
            age_out(100),
            "one passed"
        );
        // An unlabelled version past max_age kept until later: looked at again then, not at
        // every pass (its age-out time is behind).
        let mut old = vec![cp(1, Auto, None, 7200), cp(2, Auto, None, 10)];
        old[0].keep_until_ms = Some(NOW + 60_000);
        assert_eq!(retention_next(&old, 2, &[], NOW, &o), NOW + 60_000);
    }

    /// Automatic versions and the ones users made are counted apart; the head, labelled
    /// versions and versions kept until later are never expired by count.
    #[test]
    fn automatic_versions_are_retained_apart_from_the_ones_users_made() {
        use CheckpointKind::*;
        let mut cps = vec![
            cp(1, Create, None, 100),
            cp(2, Auto, None, 90),
            cp(3, Checkpoint, None, 80),
            cp(4, Auto, None, 70),
            cp(5, Checkpoint, Some("kept"), 60),
            cp(6, Detach, None, 50),
            cp(7, Compact, None, 40),
            cp(8, Rollback, None, 30),
            cp(9, Auto, None, 20),
            cp(10, Auto, None, 10),
        ];
        cps[3].keep_until_ms = Some(NOW + 1);
        // Every automatic version goes by default, but the head, one kept until later and the
        // one a rollback set aside (7, before 8), which counts as a user's.
        assert_eq!(expired_versions(&cps, 10, NOW, &opts(16, 0)), vec![2, 6, 9]);
        // The newest two automatic ones besides the head (9, 6; 4 is kept until later anyway)
        // and the newest two a user made (8, and 7 set aside by it).
        assert_eq!(expired_versions(&cps, 10, NOW, &opts(2, 2)), vec![1, 2, 3]);
        // The head is never expired, whatever its kind or age.
        assert_eq!(
            expired_versions(&cps, 7, NOW, &opts(0, 0)),
            vec![1, 2, 3, 6, 8, 9, 10]
        );
        // Age applies to both classes.
        let mut old = opts(16, 16);
        old.max_age = Duration::from_secs(45);
        assert_eq!(expired_versions(&cps, 10, NOW, &old), vec![1, 2, 3, 6]);
    }
}
