//! Encryption at rest of a tenant's keys (envelope encryption, aws-lc-rs).
//!
//! - A **master key** (32 bytes, 64 hex digits in a file each node is given) wraps each
//!   encrypted tenant's **data key** with AES-256-GCM; the wrapped key is kept in the catalog,
//!   bound to the tenant's name, and never reaches the bucket. The master key's id (the first
//!   16 hex digits of a keyed BLAKE3 of it) is recorded with it, so a node holding another
//!   master key says so instead of failing to decrypt.
//! - **Objects** (`t/{tenant}/obj/…`) are read by range: they are enciphered with AES-256-CTR,
//!   length-preserving, under a key derived from the data key and an IV derived from the key
//!   path. A path names its content (the object id hashes the salted, framed bytes), so no two
//!   contents share a keystream. Integrity is the hash chain that already verifies every read
//!   (catalog → manifest hash → object id → frame table → frame hashes): a changed byte of
//!   ciphertext deciphers to bytes that fail it.
//! - **Everything else** (manifests, relay files and their metadata) is read whole: sealed with
//!   AES-256-GCM under a random nonce, the key path as associated data, so a sealed value
//!   cannot be moved to another key.
//! - Deleting the wrapped key (tenant deletion does it before it deletes the objects) leaves
//!   ciphertext nobody can open: crypto-shredding.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::cipher::{EncryptingKey, EncryptionContext, UnboundCipherKey, AES_256};
use aws_lc_rs::iv::FixedLength;

use crate::{Result, StoreError};

const WRAP_VERSION: &str = "v1";
/// Sealed values start with this (and a version byte), then the nonce, then ciphertext + tag.
const VALUE_MAGIC: &[u8; 4] = b"SSV1";
const TAG_LEN: usize = 16;

fn sealing(message: impl Into<String>) -> StoreError {
    StoreError::Placement {
        message: message.into(),
        retryable: false,
    }
}

fn random32() -> [u8; 32] {
    let mut k = [0u8; 32];
    aws_lc_rs::rand::fill(&mut k).expect("the system's random source");
    k
}

fn gcm(key: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte key"))
}

/// The node's key-encrypting key.
pub struct MasterKey {
    key: [u8; 32],
    id: String,
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MasterKey({})", self.id)
    }
}

impl MasterKey {
    /// From 64 hex digits (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<MasterKey> {
        let t = text.trim();
        if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(sealing(
                "a master key is 64 hex digits (32 bytes; e.g. `openssl rand -hex 32`)",
            ));
        }
        let mut key = [0u8; 32];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).expect("hex");
        }
        let id = blake3::keyed_hash(&key, b"strata master key id").to_hex()[..16].to_string();
        Ok(MasterKey { key, id })
    }

    /// Reads a key file; refused if others may read it.
    pub fn from_file(path: &std::path::Path) -> Result<MasterKey> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(sealing(format!(
                "{} may be read by others (chmod 600 it)",
                path.display()
            )));
        }
        MasterKey::from_hex(&std::fs::read_to_string(path)?)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// A new data key for `tenant`, wrapped: what the catalog keeps.
    pub fn new_wrapped(&self, tenant: &str) -> String {
        let secret = random32();
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).expect("the system's random source");
        let mut buf = secret.to_vec();
        gcm(&self.key)
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(tenant.as_bytes()),
                &mut buf,
            )
            .expect("sealing a data key");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        format!("{WRAP_VERSION}:{}:{}", self.id, hex(&out))
    }

    /// The data key `wrapped` holds for `tenant`.
    pub fn unwrap(&self, tenant: &str, wrapped: &str) -> Result<DataKey> {
        let mut parts = wrapped.splitn(3, ':');
        let (Some(WRAP_VERSION), Some(id), Some(body)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(sealing(format!(
                "tenant {tenant:?}: unreadable wrapped data key"
            )));
        };
        if id != self.id {
            return Err(sealing(format!(
                "tenant {tenant:?} is encrypted under master key {id}; this node's master key is {}",
                self.id
            )));
        }
        let mut raw = unhex(body)
            .filter(|r| r.len() == NONCE_LEN + 32 + TAG_LEN)
            .ok_or_else(|| sealing(format!("tenant {tenant:?}: unreadable wrapped data key")))?;
        let (nonce, ct) = raw.split_at_mut(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).expect("12 bytes");
        let plain = gcm(&self.key)
            .open_in_place(nonce, Aad::from(tenant.as_bytes()), ct)
            .map_err(|_| {
                sealing(format!(
                    "tenant {tenant:?}: its data key does not open under this node's master key"
                ))
            })?;
        let mut secret = [0u8; 32];
        secret.copy_from_slice(plain);
        Ok(DataKey::from_secret(&secret))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A tenant's data key, as the two keys derived from it.
pub struct DataKey {
    object: [u8; 32],
    iv: [u8; 32],
    value: LessSafeKey,
    /// Keys the BLAKE3 of an object's frames and of its id (object format version 2), so an id
    /// in the bucket says nothing of the content.
    id: [u8; 32],
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(..)")
    }
}

impl DataKey {
    fn from_secret(secret: &[u8; 32]) -> DataKey {
        DataKey {
            object: blake3::derive_key("strata 2026-12 object AES-256-CTR", secret),
            iv: blake3::derive_key("strata 2026-12 object IV", secret),
            value: gcm(&blake3::derive_key(
                "strata 2026-12 value AES-256-GCM",
                secret,
            )),
            id: blake3::derive_key("strata 2026-12 object id keyed BLAKE3", secret),
        }
    }

    /// The key an encrypted tenant's object ids and frame hashes are keyed with.
    pub fn object_id_key(&self) -> [u8; 32] {
        self.id
    }

    /// Whether `path` is an object (read by range, enciphered in place) rather than a value.
    pub fn is_object(path: &str) -> bool {
        crate::keys::is_object(path)
    }

    /// Enciphers (or deciphers: CTR is its own inverse) `buf`, the bytes of object `path`
    /// from `offset` on.
    pub fn object_xor(&self, path: &str, offset: u64, buf: &mut [u8]) {
        if buf.is_empty() {
            return;
        }
        let base = u128::from_be_bytes(
            blake3::keyed_hash(&self.iv, path.as_bytes()).as_bytes()[..16]
                .try_into()
                .expect("16 bytes"),
        );
        let iv = base.wrapping_add((offset / 16) as u128).to_be_bytes();
        let skip = (offset % 16) as usize;
        let key = UnboundCipherKey::new(&AES_256, &self.object).expect("a 32-byte key");
        let ctr = EncryptingKey::ctr(key).expect("AES-CTR");
        let ctx = EncryptionContext::Iv128(FixedLength::from(iv));
        if skip == 0 {
            ctr.less_safe_encrypt(buf, ctx).expect("AES-CTR");
        } else {
            let mut tmp = vec![0u8; skip + buf.len()];
            tmp[skip..].copy_from_slice(buf);
            ctr.less_safe_encrypt(&mut tmp, ctx).expect("AES-CTR");
            buf.copy_from_slice(&tmp[skip..]);
        }
    }

    /// Seals a value stored at `path`.
    pub fn seal_value(&self, path: &str, plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).expect("the system's random source");
        let mut out = Vec::with_capacity(VALUE_MAGIC.len() + NONCE_LEN + plain.len() + TAG_LEN);
        out.extend_from_slice(VALUE_MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let mut body = out.split_off(VALUE_MAGIC.len() + NONCE_LEN);
        self.value
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(path.as_bytes()),
                &mut body,
            )
            .expect("sealing a value");
        out.extend_from_slice(&body);
        out
    }

    /// Opens a value sealed at `path`; anything else is refused as corrupt.
    pub fn open_value(&self, path: &str, sealed: &[u8]) -> Result<Vec<u8>> {
        let head = VALUE_MAGIC.len() + NONCE_LEN;
        if sealed.len() < head + TAG_LEN || &sealed[..VALUE_MAGIC.len()] != VALUE_MAGIC {
            return Err(StoreError::Corrupt(format!("{path}: not a sealed value")));
        }
        let nonce =
            Nonce::try_assume_unique_for_key(&sealed[VALUE_MAGIC.len()..head]).expect("12 bytes");
        let mut body = sealed[head..].to_vec();
        let n = self
            .value
            .open_in_place(nonce, Aad::from(path.as_bytes()), &mut body)
            .map_err(|_| StoreError::Corrupt(format!("{path}: sealed value does not open")))?
            .len();
        body.truncate(n);
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_keys_and_sealed_bytes() {
        let m = MasterKey::from_hex(&"ab".repeat(32)).unwrap();
        let other = MasterKey::from_hex(&"cd".repeat(32)).unwrap();
        assert!(MasterKey::from_hex("abc").is_err());
        let w = m.new_wrapped("acme");
        assert!(w.starts_with(&format!("v1:{}:", m.id())));
        let k = m.unwrap("acme", &w).unwrap();
        // Bound to its tenant and its master key.
        assert!(m.unwrap("other", &w).is_err());
        let e = other.unwrap("acme", &w).unwrap_err().to_string();
        assert!(e.contains(m.id()) && e.contains(other.id()), "{e}");
        // Objects: length-preserving, any range deciphers alone.
        let plain: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let path = "t/acme/obj/ab/abcdef";
        let mut ct = plain.clone();
        k.object_xor(path, 0, &mut ct);
        assert_ne!(ct, plain);
        assert!(!ct.windows(64).any(|w| w == &plain[1000..1064]));
        for (a, b) in [
            (0, 10),
            (5, 37),
            (16, 32),
            (1000, 70_001),
            (99_999, 100_000),
        ] {
            let mut r = ct[a..b].to_vec();
            k.object_xor(path, a as u64, &mut r);
            assert_eq!(r, &plain[a..b], "{a}..{b}");
        }
        let mut r = ct[..64].to_vec();
        k.object_xor("t/acme/obj/ab/other", 0, &mut r);
        assert_ne!(r, &plain[..64]);
        // Values: sealed with a fresh nonce each time, bound to their path.
        let v = k.seal_value("t/acme/man/x", b"manifest");
        assert_ne!(v, k.seal_value("t/acme/man/x", b"manifest"));
        assert_eq!(k.open_value("t/acme/man/x", &v).unwrap(), b"manifest");
        assert!(k.open_value("t/acme/man/y", &v).is_err());
        let mut bad = v.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(k.open_value("t/acme/man/x", &bad).is_err());
        assert!(k.open_value("t/acme/man/x", b"manifest").is_err());
        assert!(DataKey::is_object(path));
        assert!(!DataKey::is_object("t/acme/man/x"));
        assert!(!DataKey::is_object("t/acme/relay/s/data/obj"));
    }
}
