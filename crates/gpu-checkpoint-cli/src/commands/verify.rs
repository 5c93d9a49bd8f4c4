//! `gpu-checkpoint verify`

use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, millis, Bar};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint id or name; without it, every checkpoint in the store.
    pub checkpoint: Option<String>,
    #[command(flatten)]
    pub store: StoreArgs,
}

pub fn run(args: Args) -> super::Result<()> {
    let store = args.store.open()?;
    let bar = Bar::new(args.store.format == Format::Text);
    let report = store.verify(args.checkpoint.as_deref(), &bar)?;
    match args.store.format {
        Format::Json => super::print_json(&report)?,
        Format::Text => {
            for p in &report.problems {
                println!("DAMAGED {p}");
            }
            for (id, signature) in &report.signatures {
                println!("checkpoint {id}: {}", signature.describe());
            }
            println!(
                "{}: {} checkpoint(s), {} distinct chunks, {} checked ({} read) in {}",
                if report.is_ok() { "OK" } else { "FAILED" },
                report.checkpoints.len(),
                report.chunks_checked,
                bytes(report.bytes_checked),
                bytes(report.stored_bytes_read),
                millis(report.elapsed_ms)
            );
        }
    }
    report.into_result()?;
    Ok(())
}
