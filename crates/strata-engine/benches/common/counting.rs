//! An object store that counts the requests made of it (bench-only): each call is one request,
//! a listing one per page of 1,000 keys, a batch delete one per key. Wrap an
//! `object_store::throttle::ThrottledStore` in it to add latency.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};

#[derive(Debug)]
pub struct Counting<T> {
    inner: T,
    requests: Arc<AtomicU64>,
}

impl<T> Counting<T> {
    pub fn new(inner: T) -> (Counting<T>, Arc<AtomicU64>) {
        let requests = Arc::new(AtomicU64::new(0));
        (
            Counting {
                inner,
                requests: requests.clone(),
            },
            requests,
        )
    }
    fn one(&self) {
        self.requests.fetch_add(1, Relaxed);
    }
}

impl<T: ObjectStore> std::fmt::Display for Counting<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

/// A listing's requests: one per page of 1,000 keys (at least one).
fn paged(
    s: BoxStream<'static, Result<ObjectMeta>>,
    n: Arc<AtomicU64>,
) -> BoxStream<'static, Result<ObjectMeta>> {
    n.fetch_add(1, Relaxed);
    let mut seen = 0u64;
    s.inspect(move |_| {
        seen += 1;
        if seen.is_multiple_of(1000) {
            n.fetch_add(1, Relaxed);
        }
    })
    .boxed()
}

#[async_trait]
impl<T: ObjectStore> ObjectStore for Counting<T> {
    async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> Result<PutResult> {
        self.one();
        self.inner.put_opts(l, p, o).await
    }
    async fn put_multipart_opts(
        &self,
        l: &Path,
        o: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.one();
        self.inner.put_multipart_opts(l, o).await
    }
    async fn get_opts(&self, l: &Path, o: GetOptions) -> Result<GetResult> {
        self.one();
        self.inner.get_opts(l, o).await
    }
    async fn get_ranges(&self, l: &Path, r: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.requests.fetch_add(r.len().max(1) as u64, Relaxed);
        self.inner.get_ranges(l, r).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let n = self.requests.clone();
        self.inner.delete_stream(
            locations
                .inspect(move |_| {
                    n.fetch_add(1, Relaxed);
                })
                .boxed(),
        )
    }
    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        paged(self.inner.list(prefix), self.requests.clone())
    }
    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        paged(
            self.inner.list_with_offset(prefix, offset),
            self.requests.clone(),
        )
    }
    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.one();
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(&self, from: &Path, to: &Path, o: CopyOptions) -> Result<()> {
        self.one();
        self.inner.copy_opts(from, to, o).await
    }
    async fn rename_opts(&self, from: &Path, to: &Path, o: RenameOptions) -> Result<()> {
        self.one();
        self.inner.rename_opts(from, to, o).await
    }
}
