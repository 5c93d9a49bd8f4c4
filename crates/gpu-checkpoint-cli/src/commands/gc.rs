//! `gpu-checkpoint gc`

use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, millis};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub store: StoreArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = args.store.open()?;
    let r = store.gc()?;
    match args.store.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&r)?),
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
