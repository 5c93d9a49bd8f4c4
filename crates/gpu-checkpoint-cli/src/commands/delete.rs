//! `gpu-checkpoint delete`

use gpu_checkpoint::store::Error as StoreError;

use super::list::StoreArgs;
use super::Format;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint id, or name (deletes its newest checkpoint). A damaged manifest is deleted by exact id.
    pub checkpoint: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

pub fn run(args: Args) -> super::Result<()> {
    let store = args.store.open()?;
    let id = match store.get(&args.checkpoint) {
        Ok(info) => {
            store.delete(&info.id)?;
            info.id
        }
        // A damaged manifest can still be deleted by its exact id.
        Err(StoreError::DamagedManifest { checkpoint, .. }) if checkpoint == args.checkpoint => {
            store.delete_damaged(&checkpoint)?;
            checkpoint
        }
        Err(e) => return Err(e.into()),
    };
    if args.store.format == Format::Json {
        println!("{}", serde_json::json!({ "deleted": id }));
        return Ok(());
    }
    println!("deleted {id}");
    eprintln!("its chunks are freed by `gpu-checkpoint gc --storage {}` unless other checkpoints share them", args.store.storage);
    Ok(())
}
