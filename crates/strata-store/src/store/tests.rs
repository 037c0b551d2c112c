//! The store's unit tests: URLs, placement, sealing.

use super::*;

/// An encrypted tenant's objects and values are ciphertext in the bucket and read back
/// clear, by range too; another master key, or none, opens nothing.
#[tokio::test]
async fn encrypted_tenants_store_ciphertext() {
    let master = || MasterKey::from_hex(&"5a".repeat(32)).unwrap();
    let store = Store::open("memory:")
        .unwrap()
        .with_named(vec![], Some(master()))
        .unwrap();
    let wrapped = store.new_data_key("enc").unwrap();
    let w2 = wrapped.clone();
    store.set_resolver(Arc::new(move |t: String| {
        let w = w2.clone();
        Box::pin(async move {
            Ok(Placed {
                store: None,
                data_key: (t == "enc").then_some(w),
                incarnation: 0,
            })
        })
    }));
    let plain: Vec<u8> = b"the quick brown fox ".repeat(20_000);
    let (r, _) = store.put_object("enc", &plain).await.unwrap();
    let key = Store::object_key("enc", &r.id);
    let raw = store
        .default_inner()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(!raw.windows(20).any(|w| w == b"the quick brown fox "));
    let (rc, _) = store.put_object("clear", &plain).await.unwrap();
    let rawc = store
        .default_inner()
        .get(&Store::object_key("clear", &rc.id))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(rawc.windows(20).any(|w| w == b"the quick brown fox "));
    assert_eq!(raw.len(), rawc.len(), "objects keep their length");
    // Issue 41, item 7: an encrypted tenant's ids are keyed (object format 2). The same bytes
    // under the same salt are one id for a clear tenant (content addressing, anyone can
    // recompute it), and an id for the encrypted one that nobody without its key can.
    let (ce, _) = store
        .put_object_salted("enc", plain.clone(), 42)
        .await
        .unwrap();
    let (ce2, _) = store
        .put_object_salted("enc", plain.clone(), 43)
        .await
        .unwrap();
    let (cc, _) = store
        .put_object_salted("clear", plain.clone(), 42)
        .await
        .unwrap();
    let unkeyed = strata_format::object::encode_salted(&plain, 42).0;
    assert_eq!(cc.id, unkeyed);
    assert_ne!(
        ce.id, unkeyed,
        "an encrypted tenant's id is not the unkeyed hash"
    );
    assert_ne!(ce.id, ce2.id);
    let cdir = tempfile::tempdir().unwrap();
    let reader = crate::ObjectReader::new(
        store.clone(),
        crate::NodeCache::open(cdir.path(), 1 << 30).unwrap(),
        256 << 10,
    );
    let mut buf = vec![0u8; 100];
    reader.read_into("enc", &ce, 5000, &mut buf).await.unwrap();
    assert_eq!(&buf[..], &plain[5000..5100]);
    // Range reads decipher (what the reader verifies against the frame hashes).
    let clear = store.get_range(&key, 0..raw.len() as u64).await.unwrap();
    let part = store.get_range(&key, 1001..70_001).await.unwrap();
    assert_eq!(&part[..], &clear[1001..70_001]);
    assert!(clear.windows(20).any(|w| w == b"the quick brown fox "));
    assert!(store.local_object_path("enc", &r.id).is_none());
    // Manifests and values: sealed whole.
    let m = Manifest::empty(1 << 20).unwrap();
    let id = store.put_manifest("enc", &m).await.unwrap();
    assert_eq!(store.get_manifest("enc", &id).await.unwrap(), m);
    let vk = Path::from("t/enc/relay/s/data/f");
    store
        .put_value_opts(&vk, Bytes::from_static(b"relay bytes"), Default::default())
        .await
        .unwrap();
    assert_eq!(&store.get_value(&vk).await.unwrap()[..], b"relay bytes");
    let rawv = store
        .default_inner()
        .get(&vk)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(!rawv.windows(5).any(|w| w == b"relay"));
    // Another node with another master key, or none: refused, clearly.
    for other in [Some(MasterKey::from_hex(&"a5".repeat(32)).unwrap()), None] {
        let s2 = Store::from_object_store(store.default_inner().clone(), "memory:")
            .with_named(vec![], other)
            .unwrap();
        let w = wrapped.clone();
        s2.set_resolver(Arc::new(move |_| {
            let w = w.clone();
            Box::pin(async move {
                Ok(Placed {
                    store: None,
                    data_key: Some(w),
                    incarnation: 0,
                })
            })
        }));
        let e = s2.get_range(&key, 0..10).await.unwrap_err().to_string();
        assert!(e.contains("master key"), "{e}");
    }
    // The same master key elsewhere opens it.
    let s3 = Store::from_object_store(store.default_inner().clone(), "memory:")
        .with_named(vec![], Some(master()))
        .unwrap();
    s3.bind(
        "enc",
        &Placed {
            store: None,
            data_key: Some(wrapped),
            incarnation: 0,
        },
    )
    .unwrap();
    assert_eq!(s3.get_manifest("enc", &id).await.unwrap(), m);
}

/// Each tenant's keys go to its placement; with a resolver installed, a tenant it cannot
/// place, or places in a store this node lacks, reaches no store at all.
#[tokio::test]
async fn placement_routes_tenants_and_fails_closed() {
    let own = Store::open("memory:").unwrap();
    let store = Store::open("memory:")
        .unwrap()
        .with_named(vec![("own".into(), own.clone())], None)
        .unwrap();
    assert!(Store::open("memory:")
        .unwrap()
        .with_named(vec![("../x".into(), own.clone())], None)
        .is_err());
    // Without a resolver (no catalog: tools and tests) every tenant is on the default.
    let (r, _) = store.put_object("a", b"default").await.unwrap();
    assert!(store
        .default_inner()
        .head(&Store::object_key("a", &r.id))
        .await
        .is_ok());
    store.set_resolver(Arc::new(|t: String| {
        Box::pin(async move {
            let at = |s: &str| Placed {
                store: Some(s.to_string()),
                data_key: None,
                incarnation: 0,
            };
            match t.as_str() {
                "mine" => Ok(at("own")),
                "elsewhere" => Ok(at("missing")),
                "down" => Err(StoreError::Placement {
                    message: "catalog down".into(),
                    retryable: true,
                }),
                "sealed" => Ok(Placed {
                    store: None,
                    data_key: Some("v1:0:00".into()),
                    incarnation: 0,
                }),
                _ => Ok(Placed::default()),
            }
        })
    }));
    let (r, _) = store.put_object("mine", b"own bucket").await.unwrap();
    let key = Store::object_key("mine", &r.id);
    assert!(own.default_inner().head(&key).await.is_ok());
    assert!(store.default_inner().head(&key).await.is_err());
    assert_eq!(
        &store.get_range(&key, 0..1).await.unwrap()[..],
        &own.default_inner().get_range(&key, 0..1).await.unwrap()[..]
    );
    let e = store.put_object("elsewhere", b"x").await.unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    assert!(!e.is_retryable());
    let e = store.put_object("down", b"x").await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    // Unplaced: nothing local, nothing listed in any store for it.
    assert!(store.local_object_path("down", &r.id).is_none());
    assert!(store.inner_for("down").await.is_err());
    assert!(store
        .bind(
            "x",
            &Placed {
                store: Some("missing".into()),
                data_key: None,
                incarnation: 0
            }
        )
        .is_err());
    // Encrypted, and this node has no master key: no store at all.
    let e = store.put_object("sealed", b"x").await.unwrap_err();
    assert!(e.to_string().contains("master key"), "{e}");
    assert!(store.new_data_key("t").is_err());
    let bad = Path::from("not-a-tenant/key");
    assert!(store.exists(&bad).await.is_err());
}

fn why(url: &str) -> String {
    match Store::open(url) {
        Err(StoreError::BadUrl(_, why)) => why,
        Err(e) => panic!("{url}: {e}"),
        Ok(_) => panic!("{url}: accepted"),
    }
}

/// S3 options are object_store's own configuration keys, parsed by object_store: any of
/// them works (with or without `aws_`), a bad value or an unknown key is refused, and
/// secrets are refused in a URL.
#[test]
fn s3_urls_take_object_stores_keys_and_no_secrets() {
    for ok in [
        "s3://b?endpoint=http://127.0.0.1:9&region=us-east-1&allow_http=true",
        "s3://b/p?aws_endpoint=http://127.0.0.1:9&aws_region=eu-west-1&aws_allow_http=true",
        "s3://b?region=us-east-1&checksum_algorithm=sha256&virtual_hosted_style_request=false",
        "s3://b?region=us-east-1&timeout=30s&connect_timeout=2s&retries=3&timeout_ms=500",
        "s3://b?region=us-east-1&virtual_hosted=true",
    ] {
        Store::open(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    assert!(why("s3://b?regoin=x").contains("unknown parameter"));
    assert!(why("s3://b?region=x&checksum_algorithm=md5").contains("md5"));
    assert!(why("s3://b?region=x&timeout=soon").contains("soon"));
    for secret in [
        "secret_access_key",
        "aws_access_key_id",
        "token",
        "sse_customer_key_base64",
    ] {
        let w = why(&format!("s3://b?region=x&{secret}=abc"));
        assert!(w.contains("secret"), "{secret}: {w}");
    }
    assert!(why("s3://b?bucket=other").contains("bucket"));
    assert!(why("s3://b?region=x&proxy_url=http://u:p@proxy:3128").contains("secret"));
    assert!(why("s3://?region=x").contains("bucket"));
}
