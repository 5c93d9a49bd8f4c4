//! `gpu-checkpoint gc`

use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, millis};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub store: StoreArgs,
}

pub fn run(args: Args) -> super::Result<()> {
    let store = args.store.open()?;
    let r = store.gc()?;
    // Work folders of killed restores (images, logs) live in the store's folder too.
    let stale_work = match store.local_dir() {
        Some(dir) => gpu_checkpoint::restore::remove_stale_work_dirs(dir).map_err(|e| {
            super::Failure::other(e).context(format!(
                "removing interrupted restores' work folders in {}",
                dir.display()
            ))
        })?,
        None => 0,
    };
    match args.store.format {
        Format::Json => {
            let mut v = serde_json::to_value(&r).map_err(super::Failure::other)?;
            v["stale_restore_work_removed"] = stale_work.into();
            super::print_json(&v)?
        }
        Format::Text => {
            println!(
                "removed {} unreferenced chunks ({}); kept {} chunks ({}) of {} checkpoint(s)",
                r.chunks_removed,
                bytes(r.bytes_removed),
                r.chunks_kept,
                bytes(r.bytes_kept),
                r.checkpoints
            );
            if r.stale_staging_removed + r.stale_temp_removed > 0 {
                println!(
                    "removed what interrupted checkpoints left: {} staging folder(s), {} temporary file(s), {}",
                    r.stale_staging_removed,
                    r.stale_temp_removed,
                    bytes(r.stale_bytes_removed)
                );
            }
            if r.chunks_too_young > 0 {
                println!(
                    "kept {} unreferenced chunk(s) younger than the grace period ({} min; a writer on \
                     another node may be about to use them): the next gc after it removes them",
                    r.chunks_too_young,
                    gpu_checkpoint::store::GRACE.as_secs() / 60
                );
            }
            if r.stale_leases_removed > 0 {
                println!(
                    "removed {} expired lease(s) of writers that died",
                    r.stale_leases_removed
                );
            }
            if r.orphan_signatures_removed > 0 {
                println!(
                    "removed {} signature(s) whose checkpoint is gone",
                    r.orphan_signatures_removed
                );
            }
            if stale_work > 0 {
                println!("removed {stale_work} work folder(s) of interrupted restores");
            }
            if r.waited_ms > 0 {
                println!(
                    "waited {} for checkpoints being written",
                    millis(r.waited_ms)
                );
            }
        }
    }
    Ok(())
}
