//! `gpu-checkpoint verify`

use gpu_checkpoint::store::signing::Signature;

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
            println!(
                "{}: {} checkpoint(s), {} distinct chunks, {} checked ({} read) in {}",
                if report.is_ok() { "OK" } else { "FAILED" },
                report.checkpoints.len(),
                report.chunks_checked,
                bytes(report.bytes_checked),
                bytes(report.stored_bytes_read),
                millis(report.elapsed_ms)
            );
            // After the verdict, and only for signed ones: a store without signatures reads as before.
            for (id, signature) in &report.signatures {
                if *signature != Signature::Unsigned {
                    println!("checkpoint {id}: {}", signature.describe());
                }
            }
        }
    }
    report.into_result()?;
    Ok(())
}
