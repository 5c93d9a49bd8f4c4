//! `gpu-checkpoint inspect`

use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, millis};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint id, or name (its newest checkpoint).
    pub checkpoint: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

pub fn run(args: Args) -> super::Result<()> {
    let store = args.store.open()?;
    let info = store.get(&args.checkpoint)?;
    let manifest = store.manifest_location(&info.id);
    let signature = store.signature(&info.id)?;
    match args.store.format {
        Format::Json => {
            let mut v = serde_json::to_value(&info).map_err(super::Failure::other)?;
            v["manifest"] = serde_json::Value::String(manifest.clone());
            v["signature"] = serde_json::to_value(&signature).map_err(super::Failure::other)?;
            super::print_json(&v)?;
        }
        Format::Text => {
            let s = &info.stats;
            println!("checkpoint   {}", info.id);
            println!("name         {}", info.name.as_deref().unwrap_or("-"));
            println!("created      {}", info.created);
            println!("manifest     {manifest}");
            println!("signature    {}", signature.describe());
            println!(
                "logical      {} in {} files, {} chunks ({} zero)",
                bytes(s.logical_bytes),
                s.files,
                s.chunks,
                bytes(s.zero_bytes)
            );
            println!(
                "stored       {} ({} distinct chunks; {} new chunks, {} written by this checkpoint)",
                bytes(s.stored_bytes),
                s.unique_chunks,
                s.new_chunks,
                bytes(s.new_bytes)
            );
            println!(
                "ratios       dedup {:.2}x, compression {:.2}x, overall {:.2}x",
                s.dedup_ratio, s.compression_ratio, s.reduction_ratio
            );
            println!(
                "ingest       {} (sync {})",
                millis(s.ingest_ms),
                millis(s.sync_ms)
            );
            let c = &info.chunking;
            println!(
                "chunking     {} {}/{}/{} bytes, {}, {} level {}",
                c.algorithm, c.min_size, c.avg_size, c.max_size, c.hash, c.compression, c.level
            );
            if !info.metadata.is_null() {
                println!(
                    "metadata     {}",
                    serde_json::to_string_pretty(&info.metadata)
                        .map_err(super::Failure::other)?
                        .replace('\n', "\n             ")
                );
            }
            println!("files");
            for f in &info.files {
                println!(
                    "  {:<40} {:>10} {:>5} chunks  mode {:o}",
                    f.path,
                    bytes(f.size),
                    f.chunks.len(),
                    f.mode
                );
            }
        }
    }
    Ok(())
}
