use super::*;
use proptest::prelude::*;

fn obj(n: u8, blocks: u64) -> ObjectRef {
    ObjectRef {
        id: Hash::of(&[n]),
        data_len: blocks * BLOCK_SIZE,
    }
}

/// Model: one entry per block: None (zero) or (object id, byte offset).
type Model = Vec<Option<(Hash, u64)>>;

fn model_of(m: &Manifest) -> Model {
    let mut v = vec![None; m.disk_blocks() as usize];
    let mut pieces = vec![];
    m.resolve(0, m.disk_blocks(), &mut pieces);
    let mut lba = 0;
    for p in pieces {
        assert_eq!(p.lba, lba, "pieces must tile the range");
        for i in 0..p.len {
            v[(p.lba + i) as usize] =
                p.at.map(|(o, off)| (m.objects[o as usize].id, off + i * BLOCK_SIZE));
        }
        lba += p.len;
    }
    assert_eq!(lba, m.disk_blocks());
    v
}

#[test]
fn golden_encoding_v1() {
    let a = obj(1, 4);
    let m = Manifest {
        disk_size: 16 * BLOCK_SIZE,
        objects: vec![a],
        extents: vec![Extent {
            lba: 2,
            len: 3,
            object: 0,
            offset: BLOCK_SIZE,
        }],
    };
    let bytes = m.encode();
    assert_eq!(bytes.len(), 40 + 40 + 24 + 32);
    assert_eq!(&bytes[..8], b"STRATAMF");
    assert_eq!(&bytes[8..12], &1u32.to_le_bytes());
    // Frozen: this id changes only if the v1 encoding changes, which must not happen.
    assert_eq!(m.id().to_hex(), GOLDEN_ID);
    assert_eq!(Manifest::decode(&bytes).unwrap(), m);
}

const GOLDEN_ID: &str = "e8aec31dc5285fa90a541189a706ea24c0f013b45e4944a6a8e3a363fb52519b";

#[test]
fn zeros_cost_nothing() {
    let m = Manifest::empty(1 << 40).unwrap();
    assert_eq!(m.encode().len(), 72);
}

#[test]
fn corrupt_and_truncated_manifests_are_errors() {
    let m = Manifest {
        disk_size: 64 * BLOCK_SIZE,
        objects: vec![obj(1, 8), obj(2, 8)],
        extents: vec![
            Extent {
                lba: 0,
                len: 8,
                object: 0,
                offset: 0,
            },
            Extent {
                lba: 10,
                len: 8,
                object: 1,
                offset: 0,
            },
        ],
    };
    let bytes = m.encode();
    for cut in 0..bytes.len() {
        assert!(
            Manifest::decode(&bytes[..cut]).is_err(),
            "truncated at {cut} accepted"
        );
    }
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x40;
        assert!(Manifest::decode(&b).is_err(), "flipped byte {i} accepted");
    }
}

#[test]
fn invalid_structures_are_refused_even_with_a_good_checksum() {
    let bad = [
        Manifest {
            disk_size: 100,
            objects: vec![],
            extents: vec![],
        },
        Manifest {
            disk_size: 8 * BLOCK_SIZE,
            objects: vec![obj(1, 4)],
            extents: vec![Extent {
                lba: 6,
                len: 4,
                object: 0,
                offset: 0,
            }],
        },
        Manifest {
            disk_size: 8 * BLOCK_SIZE,
            objects: vec![obj(1, 4)],
            extents: vec![Extent {
                lba: 0,
                len: 4,
                object: 1,
                offset: 0,
            }],
        },
        Manifest {
            disk_size: 8 * BLOCK_SIZE,
            objects: vec![obj(1, 4)],
            extents: vec![Extent {
                lba: 0,
                len: 4,
                object: 0,
                offset: 4096,
            }],
        },
        Manifest {
            disk_size: 8 * BLOCK_SIZE,
            objects: vec![obj(1, 4)],
            extents: vec![
                Extent {
                    lba: 0,
                    len: 2,
                    object: 0,
                    offset: 0,
                },
                Extent {
                    lba: 1,
                    len: 2,
                    object: 0,
                    offset: 0,
                },
            ],
        },
    ];
    for m in bad {
        assert!(Manifest::decode(&m.encode()).is_err(), "{m:?} accepted");
    }
}

#[test]
fn hostile_counts_do_not_allocate() {
    let mut b = Manifest::empty(BLOCK_SIZE).unwrap().encode();
    b[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    let n = b.len();
    let sum = blake3::hash(&b[..n - 32]);
    b[n - 32..].copy_from_slice(sum.as_bytes());
    assert!(Manifest::decode(&b).is_err());
}

fn arb_changes(blocks: u64) -> impl Strategy<Value = Vec<(u64, u64, Option<u8>)>> {
    proptest::collection::vec((0..blocks, 1..9u64, proptest::option::of(0u8..4)), 0..12)
}

/// Sorts and clips random changes into the non-overlapping form `apply` takes.
fn normalise(blocks: u64, raw: Vec<(u64, u64, Option<u8>)>) -> Vec<Change> {
    let mut raw = raw;
    raw.sort_by_key(|c| c.0);
    let mut out: Vec<Change> = vec![];
    let mut next_free = 0;
    for (lba, len, o) in raw {
        let lba = lba.max(next_free);
        let end = (lba + len).min(blocks);
        if lba >= end {
            continue;
        }
        out.push(Change {
            lba,
            len: end - lba,
            at: o.map(|n| (obj(n, 64), (lba % 8) * BLOCK_SIZE)),
        });
        next_free = end;
    }
    out
}

proptest! {
    #[test]
    fn apply_matches_a_block_model(steps in proptest::collection::vec(arb_changes(48), 1..6)) {
        let blocks = 48;
        let mut m = Manifest::empty(blocks * BLOCK_SIZE).unwrap();
        let mut model: Model = vec![None; blocks as usize];
        for raw in steps {
            let changes = normalise(blocks, raw);
            for c in &changes {
                for i in 0..c.len {
                    model[(c.lba + i) as usize] = c.at.map(|(o, off)| (o.id, off + i * BLOCK_SIZE));
                }
            }
            m = m.apply(&changes).unwrap();
            prop_assert_eq!(&model_of(&m), &model);
            // Round trip and compactness: no two adjacent extents that could merge.
            prop_assert_eq!(Manifest::decode(&m.encode()).unwrap(), m.clone());
            for w in m.extents.windows(2) {
                prop_assert!(!(w[0].end() == w[1].lba && w[0].object == w[1].object
                    && w[0].offset + w[0].len as u64 * BLOCK_SIZE == w[1].offset));
            }
            // Every object in the table is referenced.
            for (i, _) in m.objects.iter().enumerate() {
                prop_assert!(m.extents.iter().any(|e| e.object as usize == i));
            }
        }
    }

    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = Manifest::decode(&bytes);
    }
}
