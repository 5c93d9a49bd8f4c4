//! `gpu-checkpoint list`

use gpu_checkpoint::store::signing::Signature;
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
    manifest: String,
    stats: &'a gpu_checkpoint::store::IngestStats,
    metadata: &'a serde_json::Value,
    signature: Signature,
}

#[derive(Serialize)]
struct Damaged<'a> {
    id: &'a str,
    damaged: &'a str,
}

/// The options every store command shares.
#[derive(clap::Args)]
pub struct StoreArgs {
    /// The checkpoint store: a folder, or `s3://BUCKET/PREFIX` on an S3-compatible object store (endpoint
    /// from --s3-endpoint or AWS_ENDPOINT_URL, credentials from the AWS environment variables or profile).
    #[arg(long, env = "GPU_CHECKPOINT_STORAGE")]
    pub storage: String,
    /// The S3 endpoint for another server than AWS (MinIO, Ceph, garage...): `http://HOST:PORT`. The same as
    /// AWS_ENDPOINT_URL; requests are path-style.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// `json` prints results as JSON on stdout and nothing else.
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
    /// Also accept a local store that belongs to USER (a name or a uid), for reading only: nothing is
    /// written, changed or removed in it. A store is otherwise used only when it belongs to the user
    /// running the tool or to root (exit 4). Restoring from a store runs what it holds as root: trust its
    /// owner as much (docs/security.md).
    #[arg(long, value_name = "USER", env = "GPU_CHECKPOINT_TRUST_STORE_OWNER", value_parser = user_id)]
    pub trust_store_owner: Option<u32>,
    #[command(flatten)]
    pub trust: super::key::TrustArgs,
}

/// A user given by name or uid.
pub fn user_id(s: &str) -> Result<u32, String> {
    gpu_checkpoint::store::backend::uid_of(s)
        .ok_or_else(|| format!("no user {s:?} on this system (give a name or a uid)"))
}

impl StoreArgs {
    /// Opens an existing store for the read-side commands (list, inspect, delete, verify, gc): a missing
    /// folder is "no such checkpoint" rather than a new empty store.
    pub fn open(&self) -> super::Result<Store> {
        self.open_cached(None)
    }

    /// [`StoreArgs::open`] with a local read-through cache folder for an object store's chunks (restore's
    /// `--cache-dir`).
    pub fn open_cached(&self, cache: Option<&std::path::Path>) -> super::Result<Store> {
        self.endpoint_to_env();
        let opts = StoreOptions {
            trusted_owner: self.trust_store_owner,
            trusted_keys: self.trust.keys()?,
            ..StoreOptions::default()
        };
        Store::open_existing_cached(&self.storage, opts, cache).map_err(|e| match e {
            gpu_checkpoint::store::Error::Invalid(m) => super::usage(m),
            e => super::Failure::from(e).context(format!("cannot open store {}", self.storage)),
        })
    }

    /// Opens the store, creating it where there is none (checkpoint).
    pub fn open_or_create(&self, opts: StoreOptions) -> super::Result<Store> {
        self.endpoint_to_env();
        let opts = StoreOptions {
            trusted_owner: self.trust_store_owner,
            trusted_keys: self.trust.keys()?,
            ..opts
        };
        Ok(Store::open_storage(&self.storage, opts)?)
    }

    /// `--s3-endpoint` is read by the store as AWS_ENDPOINT_URL, the variable every AWS client knows, so
    /// that one way of giving it serves the library, the CLI and the tools beside it.
    fn endpoint_to_env(&self) {
        if let Some(url) = &self.s3_endpoint {
            // Set before the tool starts any thread (the store's start with the open after this).
            std::env::set_var("AWS_ENDPOINT_URL", url);
        }
    }
}

pub fn run(args: Args) -> super::Result<()> {
    let store = args.store.open()?;
    let entries = store.list_entries()?;
    match args.store.format {
        Format::Json => {
            let values: Vec<serde_json::Value> = entries
                .iter()
                .map(|e| match e {
                    ListEntry::Ok(i) => Ok(serde_json::to_value(summary(&store, i)?)),
                    ListEntry::Damaged { id, reason } => Ok(serde_json::to_value(Damaged {
                        id,
                        damaged: reason,
                    })),
                })
                .collect::<super::Result<Result<_, _>>>()?
                .map_err(super::Failure::other)?;
            super::print_json(&values)?;
        }
        Format::Text => {
            if entries.is_empty() {
                println!("no checkpoints in {}", store.location());
                return Ok(());
            }
            // Columns sized to their content: ids and names of any length stay aligned.
            let mut table = comfy_table::Table::new();
            table.load_style(comfy_table::presets::NOTHING);
            table.set_header([
                "ID", "NAME", "CREATED", "LOGICAL", "STORED", "NEW", "DEDUP", "COMPR", "INGEST",
                "SIGNED",
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
                            match store.signature(&i.id)? {
                                Signature::Unsigned => "-".into(),
                                Signature::Signed { key_id } => key_id,
                                Signature::Bad { .. } => "BAD".into(),
                            },
                        ]);
                    }
                    ListEntry::Damaged { id, reason } => damaged.push((id, reason)),
                }
            }
            for (i, col) in table.column_iter_mut().enumerate() {
                col.set_padding((0, 2));
                if (3..9).contains(&i) {
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

fn summary<'a>(store: &Store, i: &'a CheckpointInfo) -> super::Result<Summary<'a>> {
    Ok(Summary {
        signature: store.signature(&i.id)?,
        id: &i.id,
        name: i.name.as_deref(),
        created: &i.created,
        manifest: store.manifest_location(&i.id),
        stats: &i.stats,
        metadata: &i.metadata,
    })
}
