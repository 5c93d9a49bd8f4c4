//! `gpu-checkpoint export` and `import`: a container checkpoint to and from the checkpoint archive of
//! podman, CRI-O and checkpointctl (`gpu_checkpoint::flows::container::archive`).

use std::path::PathBuf;

use gpu_checkpoint::flows::container::archive;
use gpu_checkpoint::store::StoreOptions;
use serde_json::json;

use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, Bar};

/// The archive formats `export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ArchiveFormat {
    /// podman's `container checkpoint --export` archive (uncompressed tar), which CRI-O and
    /// checkpointctl read too.
    OciCheckpoint,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The container checkpoint's id or name.
    pub checkpoint: String,
    /// The archive's format.
    #[arg(long, value_enum, default_value = "oci-checkpoint")]
    pub format: ArchiveFormat,
    /// The archive to write (never overwritten).
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: PathBuf,
    /// The checkpoint store (a folder or `s3://BUCKET/PREFIX`).
    #[arg(long, env = "GPU_CHECKPOINT_STORAGE")]
    pub storage: String,
    /// The S3 endpoint, as for the other store commands.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Also accept a local store of USER, read-only, as for the other store commands.
    #[arg(long, value_name = "USER", env = "GPU_CHECKPOINT_TRUST_STORE_OWNER", value_parser = super::list::user_id)]
    pub trust_store_owner: Option<u32>,
    #[command(flatten)]
    pub trust: super::key::TrustArgs,
    /// For `podman container restore --import` of a checkpoint taken by `checkpoint --container`: the
    /// name of an image in podman's storage whose root file system is the container's (`podman import`
    /// of the bundle's rootfs). With --podman-image-id.
    #[arg(long, value_name = "NAME", requires = "podman_image_id")]
    pub podman_image: Option<String>,
    /// That image's id (64 hexadecimal digits: `podman image inspect --format '{{.Id}}' NAME`).
    #[arg(long, value_name = "ID", requires = "podman_image")]
    pub podman_image_id: Option<String>,
    /// The root file system the container started from (for podman: `podman image mount ID`): the
    /// bundle's rootfs is compared with it and the archive carries the differences (`rootfs-diff.tar`,
    /// `deleted.files`), which an engine restoring on top of the image applies. Without it the archive
    /// carries none, and the restore needs a root file system as it was at the checkpoint.
    #[arg(long, value_name = "DIR")]
    pub rootfs_base: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ImportArgs {
    /// A podman/CRI-O checkpoint archive (uncompressed or zstd).
    pub archive: PathBuf,
    /// A name for the stored checkpoint.
    #[arg(long)]
    pub name: Option<String>,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub sign: super::key::SignArgs,
}

pub fn export(args: ExportArgs) -> super::Result<()> {
    let ArchiveFormat::OciCheckpoint = args.format;
    let store = StoreArgs {
        storage: args.storage,
        s3_endpoint: args.s3_endpoint,
        format: Format::Text,
        trust_store_owner: args.trust_store_owner,
        trust: args.trust,
    }
    .open()?;
    let podman = args
        .podman_image
        .zip(args.podman_image_id)
        .map(|(name, id)| archive::PodmanImage { name, id });
    let out = archive::export_oci(
        &store,
        &args.checkpoint,
        &args.output,
        podman.as_ref(),
        args.rootfs_base.as_deref(),
        &Bar::new(true),
    )?;
    println!(
        "exported {} to {} ({}, {} files)",
        out.checkpoint,
        out.path.display(),
        bytes(out.bytes),
        out.entries.len()
    );
    match &out.rootfs_changes {
        Some(c) => {
            println!(
                "root file system changes: {} added or changed, {} removed",
                c.changed, c.deleted
            );
            for s in &c.skipped {
                eprintln!("warning: not carried in rootfs-diff.tar: {s}");
            }
        }
        None if podman.is_some() => eprintln!(
            "note: no --rootfs-base: the archive carries no root file system changes; the engine restores on the image's files as they are"
        ),
        None => {}
    }
    Ok(())
}

pub fn import(args: ImportArgs) -> super::Result<()> {
    // The key is read and checked before anything is stored (a bad key file is exit 2).
    let store = args.store.open_or_create(StoreOptions {
        sign_key: args.sign.key()?,
        ..StoreOptions::default()
    })?;
    let bar = Bar::new(args.store.format == Format::Text);
    let out = archive::import_oci(&store, &args.archive, args.name.as_deref(), &bar)?;
    let stats = &out.info.stats;
    match args.store.format {
        Format::Json => super::print_json(&json!({
            "id": out.info.id,
            "name": out.info.name,
            "container": out.container,
            "runtime": out.runtime,
            "stats": stats,
        }))?,
        Format::Text => println!(
            "imported {} as {} (container {}, {}): {} in {} files, {} new",
            args.archive.display(),
            out.info.id,
            out.container,
            out.runtime,
            bytes(stats.logical_bytes),
            stats.files,
            bytes(stats.new_bytes)
        ),
    }
    Ok(())
}
