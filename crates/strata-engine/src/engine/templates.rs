//! Template builds of a node: from an image, a directory on this host (the operator's), or an
//! archive a tenant sent; published only if the build was quick enough for GC (see
//! `publish_template`).

use std::path::Path;
use std::time::Instant;

use strata_catalog::{CatalogError, Template};
use strata_format::manifest::Manifest;
use strata_format::name;

use super::{blocking, tempdir_in, Engine};
use crate::template;
use crate::{Error, Result};

impl Engine {
    /// Publishes a built template. `began` is when its first chunk upload started: chunks that
    /// stayed unreferenced longer than the GC grace period may already be condemned, so a
    /// build slower than half of it gives up (a retry uploads fresh, salted keys).
    async fn publish_template(
        &self,
        tenant: &str,
        name: &str,
        m: Manifest,
        stored: u64,
        began: Instant,
    ) -> Result<Template> {
        let deadline = self.opts().publish_deadline;
        if began.elapsed() > deadline {
            return Err(Error::Unavailable(
                format!("template {name}"),
                format!(
                    "the build took {:?}, more than half the GC grace period; build it again",
                    began.elapsed()
                ),
            ));
        }
        let id = self.reader.store().put_manifest(tenant, &m).await?;
        self.catalog.record_manifest(tenant, id, &m.objects).await?;
        let t = Template {
            tenant: tenant.into(),
            name: name.into(),
            manifest: id,
            disk_size: m.disk_size,
            stored_bytes: stored,
            created_ms: crate::now_ms(),
        };
        self.catalog.create_template(&t).await?;
        Ok(t)
    }

    async fn check_new_template(&self, tenant: &str, name: &str) -> Result<()> {
        name::validate("template name", name)?;
        match self.catalog.get_template(tenant, name).await {
            Ok(_) => Err(CatalogError::AlreadyExists {
                what: "template",
                name: name.into(),
            }
            .into()),
            Err(CatalogError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Builds a template from a raw or qcow2 image file on this host (the operator's own: the
    /// local CLI, an import directory). The format is read from the file's first bytes and then
    /// stated explicitly to qemu-img; a qcow2 image naming a backing or data file is refused.
    pub async fn build_template_from_image(
        &self,
        tenant: &str,
        name: &str,
        image: &Path,
        progress: template::Progress<'_>,
    ) -> Result<Template> {
        let img = image.to_path_buf();
        let format = blocking(move || template::detect_format(&img)).await?;
        let limits = template::ImportLimits::operator();
        self.build_template_from_image_as(tenant, name, image, format, limits, progress)
            .await
    }

    /// [`Engine::build_template_from_image`] with the format given by the caller (an upload
    /// says what it is; raw bytes are imported as they are, without any tool).
    pub async fn build_template_from_image_as(
        &self,
        tenant: &str,
        name: &str,
        image: &Path,
        format: template::ImageFormat,
        limits: template::ImportLimits,
        progress: template::Progress<'_>,
    ) -> Result<Template> {
        self.check_new_template(tenant, name).await?;
        let tmp = tempdir_in(&self.cfg.data_dir)?;
        let res = async {
            let path = match format {
                template::ImageFormat::Raw => {
                    let len = std::fs::metadata(image)
                        .map_err(Error::io("reading image size"))?
                        .len();
                    if len > limits.max_disk {
                        return Err(Error::Invalid(format!(
                            "the image is {len} bytes, more than the {} allowed",
                            limits.max_disk
                        )));
                    }
                    image.to_path_buf()
                }
                template::ImageFormat::Qcow2 => {
                    let raw = tmp.join("image.raw");
                    let (img, out) = (image.to_path_buf(), raw.clone());
                    let space = self.space.clone();
                    blocking(move || {
                        template::qcow2_to_raw(&img, &out, &limits, &|n| space.admit(n))
                    })
                    .await?;
                    raw
                }
            };
            let began = Instant::now();
            let (m, stored) = template::import_raw(&self.reader, tenant, &path, progress).await?;
            Ok::<_, Error>((m, stored, began))
        }
        .await;
        template::remove_tree(&tmp);
        let (m, stored, began) = res?;
        self.publish_template(tenant, name, m, stored, began).await
    }

    /// Builds an ext4 template from a directory on this host (`mkfs.ext4 -d`); size derived
    /// if not given. For the operator's own directories: a tenant's tree arrives as an archive
    /// ([`Engine::build_template_from_archive`]).
    pub async fn build_template_from_dir(
        &self,
        tenant: &str,
        name: &str,
        dir: &Path,
        size: Option<u64>,
        progress: template::Progress<'_>,
    ) -> Result<Template> {
        self.check_new_template(tenant, name).await?;
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "{} is not a directory on this host",
                dir.display()
            )));
        }
        let tmp = tempdir_in(&self.cfg.data_dir)?;
        let res = self
            .mkfs_and_import(tenant, dir, &tmp, size, progress)
            .await;
        template::remove_tree(&tmp);
        let (m, stored, began) = res?;
        self.publish_template(tenant, name, m, stored, began).await
    }

    /// Builds an ext4 template from a tar archive of a directory tree (what `strata template
    /// build --from-dir` streams to a daemon), unpacked as hostile input
    /// ([`template::unpack_archive`]).
    pub async fn build_template_from_archive(
        &self,
        tenant: &str,
        name: &str,
        archive: &Path,
        size: Option<u64>,
        limits: template::ImportLimits,
        progress: template::Progress<'_>,
    ) -> Result<Template> {
        self.check_new_template(tenant, name).await?;
        let tmp = tempdir_in(&self.cfg.data_dir)?;
        let res = async {
            let tree = tmp.join("tree");
            std::fs::create_dir(&tree).map_err(Error::io("creating unpack directory"))?;
            let (a, t) = (archive.to_path_buf(), tree.clone());
            blocking(move || template::unpack_archive(&a, &t, limits)).await?;
            let size = match size {
                Some(s) => s,
                None => {
                    let t = tree.clone();
                    blocking(move || template::derive_size(&t)).await?
                }
            };
            if size > limits.max_disk {
                return Err(Error::Invalid(format!(
                    "a {size}-byte disk is more than the {} allowed",
                    limits.max_disk
                )));
            }
            self.mkfs_and_import(tenant, &tree, &tmp, Some(size), progress)
                .await
        }
        .await;
        template::remove_tree(&tmp);
        let (m, stored, began) = res?;
        self.publish_template(tenant, name, m, stored, began).await
    }

    /// `mkfs.ext4 -d dir` into `tmp/image.raw` and imports it; returns when the uploads began.
    async fn mkfs_and_import(
        &self,
        tenant: &str,
        dir: &Path,
        tmp: &Path,
        size: Option<u64>,
        progress: template::Progress<'_>,
    ) -> Result<(Manifest, u64, Instant)> {
        let size = match size {
            Some(s) => s.div_ceil(strata_format::BLOCK_SIZE) * strata_format::BLOCK_SIZE,
            None => {
                let d = dir.to_path_buf();
                blocking(move || template::derive_size(&d)).await?
            }
        };
        let img = tmp.join("image.raw");
        let (d, i) = (dir.to_path_buf(), img.clone());
        blocking(move || template::mkfs_from_dir(&d, &i, size)).await?;
        let began = Instant::now();
        let (m, stored) = template::import_raw(&self.reader, tenant, &img, progress).await?;
        Ok((m, stored, began))
    }
}
