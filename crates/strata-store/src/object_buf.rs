//! Objects built where a local store can write them from: page-aligned buffers, kept in a small
//! pool between objects.

use bytes::Bytes;

/// The bytes of an object being built, starting at an address aligned for direct I/O, so that
/// a local store writes the sealed object with `O_DIRECT` from where it is instead of copying
/// it into an aligned buffer (a copy that cost a tenth of strata's CPU under 4 KiB random
/// writes: the source is cold and misaligned against the destination). Aligned as long as it
/// stays within the capacity it was made with.
pub struct ObjectBuf {
    vec: Vec<u8>,
    /// Padding before the object's first byte.
    lead: usize,
}

/// Buffers of objects whose bytes nobody holds any more, kept for the next objects: a fresh
/// 8 MiB buffer is 2,048 page faults, each clearing its page (a tenth of strata's CPU under
/// 4 KiB random writes before buffers were kept). The [`POOL_MAX`] most recent are kept.
static POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());
const POOL_MAX: usize = 4;
/// Smaller buffers are not worth keeping.
const POOL_MIN_BYTES: usize = 1 << 20;

/// An object's bytes, `lead` bytes into a buffer that goes back to [`POOL`] when dropped.
struct Pooled(Vec<u8>, usize);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0[self.1..]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() >= POOL_MIN_BYTES {
            let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
            // The most recent are kept (a buffer of a size no object asks for again ages out).
            if pool.len() >= POOL_MAX {
                pool.remove(0);
            }
            pool.push(v);
        }
    }
}

impl ObjectBuf {
    /// Room for `cap` bytes (the object and its trailer) without moving: a kept buffer of
    /// about that size if there is one (its old bytes are never exposed: the object is written
    /// over them from its start), else a new one.
    pub fn with_capacity(cap: usize) -> ObjectBuf {
        let align = crate::local_put::DIRECT_ALIGN;
        let want = cap + align;
        let kept = {
            let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
            pool.iter()
                .position(|v| v.capacity() >= want && v.capacity() <= 2 * want)
                .map(|i| pool.swap_remove(i))
        };
        let mut vec: Vec<u8> = kept.unwrap_or_else(|| Vec::with_capacity(want));
        vec.clear();
        let lead = vec.as_ptr().addr().next_multiple_of(align) - vec.as_ptr().addr();
        vec.resize(lead, 0);
        ObjectBuf { vec, lead }
    }

    pub fn len(&self) -> usize {
        self.vec.len() - self.lead
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.vec.extend_from_slice(bytes);
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.vec[self.lead..]
    }
}

impl ObjectBuf {
    /// The buffer and its lead (the object starts that many bytes in).
    pub(crate) fn into_parts(self) -> (Vec<u8>, usize) {
        (self.vec, self.lead)
    }
}

/// The bytes of a sealed object `lead` bytes into `vec`, whose buffer goes back to the pool
/// once the last holder of these bytes lets go.
pub(crate) fn pooled(vec: Vec<u8>, lead: usize) -> Bytes {
    Bytes::from_owner(Pooled(vec, lead))
}

impl From<Vec<u8>> for ObjectBuf {
    fn from(vec: Vec<u8>) -> ObjectBuf {
        ObjectBuf { vec, lead: 0 }
    }
}
