//! `gpu-checkpoint list`

use std::path::PathBuf;

use anyhow::Context;
use gpu_checkpoint::store::{CheckpointInfo, ListEntry, Store, StoreOptions};
use serde::Serialize;

use super::Format;
use crate::progress::{bytes, millis};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub store: StoreArgs,
}

/// One `list --format json` element: the manifest without its file and chunk lists.
#[derive(Serialize)]
struct Summary<'a> {
    id: &'a str,
    name: Option<&'a str>,
    created: &'a str,
    manifest: PathBuf,
    stats: &'a gpu_checkpoint::store::IngestStats,
    metadata: &'a serde_json::Value,
}

#[derive(Serialize)]
struct Damaged<'a> {
    id: &'a str,
    damaged: &'a str,
}

/// The options every store command shares.
#[derive(clap::Args)]
pub struct StoreArgs {
    /// The checkpoint store (a folder).
    #[arg(long, env = "GPU_CHECKPOINT_STORAGE")]
    pub storage: PathBuf,
    /// `json` prints results as JSON on stdout and nothing else.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

impl StoreArgs {
    /// Opens an existing store for the read-side commands (list, inspect, delete, verify, gc): a missing
    /// folder is "no such checkpoint" rather than a new empty store.
    pub fn open(&self) -> anyhow::Result<Store> {
        open_store(&self.storage)
    }
}

/// Opens an existing store for the commands that only read or tidy one: a missing folder, or a folder that is
/// not a store (an empty one included), is "no checkpoint here" (exit 7), and is not turned into a store.
fn open_store(storage: &std::path::Path) -> anyhow::Result<Store> {
    if storage.exists() && !storage.is_dir() {
        return Err(super::usage(format!(
            "storage {} is not a folder",
            storage.display()
        )));
    }
    if !gpu_checkpoint::store::LocalBackend::holds_store(storage)? {
        return Err(gpu_checkpoint::store::Error::NotFound {
            what: "any checkpoint (no store here)".into(),
            storage: storage.to_path_buf(),
        }
        .into());
    }
    Store::open(storage, StoreOptions::default())
        .with_context(|| format!("cannot open store {}", storage.display()))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = args.store.open()?;
    let entries = store.list_entries()?;
    match args.store.format {
        Format::Json => {
            let values: Vec<serde_json::Value> = entries
                .iter()
                .map(|e| match e {
                    ListEntry::Ok(i) => serde_json::to_value(summary(&store, i)),
                    ListEntry::Damaged { id, reason } => serde_json::to_value(Damaged {
                        id,
                        damaged: reason,
                    }),
                })
                .collect::<Result<_, _>>()?;
            println!("{}", serde_json::to_string_pretty(&values)?);
        }
        Format::Text => {
            if entries.is_empty() {
                println!("no checkpoints in {}", store.location().display());
                return Ok(());
            }
            // Columns sized to their content: ids and names of any length stay aligned.
            let mut table = comfy_table::Table::new();
            table.load_style(comfy_table::presets::NOTHING);
            table.set_header([
                "ID", "NAME", "CREATED", "LOGICAL", "STORED", "NEW", "DEDUP", "COMPR", "INGEST",
            ]);
            let mut damaged = Vec::new();
            for e in &entries {
                match e {
                    ListEntry::Ok(i) => {
                        let s = &i.stats;
                        table.add_row([
                            i.id.clone(),
                            i.name.clone().unwrap_or_else(|| "-".into()),
                            i.created.clone(),
                            bytes(s.logical_bytes),
                            bytes(s.stored_bytes),
                            bytes(s.new_bytes),
                            format!("{:.2}x", s.dedup_ratio),
                            format!("{:.2}x", s.compression_ratio),
                            millis(s.ingest_ms),
                        ]);
                    }
                    ListEntry::Damaged { id, reason } => damaged.push((id, reason)),
                }
            }
            for (i, col) in table.column_iter_mut().enumerate() {
                col.set_padding((0, 2));
                if i >= 3 {
                    col.set_cell_alignment(comfy_table::CellAlignment::Right);
                }
            }
            println!("{}", table.trim_fmt());
            for (id, reason) in damaged {
                println!("{id} DAMAGED: {reason}");
            }
        }
    }
    Ok(())
}

fn summary<'a>(store: &Store, i: &'a CheckpointInfo) -> Summary<'a> {
    Summary {
        id: &i.id,
        name: i.name.as_deref(),
        created: &i.created,
        manifest: store.manifest_path(&i.id),
        stats: &i.stats,
        metadata: &i.metadata,
    }
}
