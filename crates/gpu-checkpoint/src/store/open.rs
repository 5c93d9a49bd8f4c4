//! Opening a store by what `--storage` names: a local folder or, with the `s3` feature, `s3://BUCKET/PREFIX`
//! (with an optional local read-through cache of chunks for restores).

use std::path::Path;
use std::sync::Arc;

use super::backend::LocalBackend;
#[cfg(feature = "s3")]
use super::{Backend, ReadBackend};
use super::{Error, Result, Store, StoreOptions};

impl Store {
    /// Opens the store at `path` (local filesystem), creating its layout (0700) if the folder is missing or
    /// empty, and validating the format version of an existing one.
    pub fn open(path: &Path, opts: StoreOptions) -> Result<Store> {
        let backend = LocalBackend::new(path).trusting(opts.trusted_owner);
        Store::with_backend(Arc::new(backend), opts)
    }

    /// Opens the store `storage` names: `s3://BUCKET/PREFIX` (an object store, with the `s3` feature; see
    /// [`S3Config`](super::backend::S3Config) for the endpoint and credentials) or a local folder.
    pub fn open_storage(storage: &str, opts: StoreOptions) -> Result<Store> {
        if let Some(url) = storage.strip_prefix("s3://") {
            #[cfg(feature = "s3")]
            {
                let config = super::backend::S3Config::from_env(url)?;
                return Store::with_backend(
                    Arc::new(super::backend::S3Backend::new(config)?),
                    opts,
                );
            }
            #[cfg(not(feature = "s3"))]
            {
                let _ = url;
                return Err(Error::Invalid(format!(
                    "storage {storage}: this build has no S3 support (build with the `s3` feature)"
                )));
            }
        }
        Store::open(Path::new(storage), opts)
    }

    /// Opens the existing store `storage` names (see [`Store::open_storage`]) for commands that only read
    /// or tidy one: where there is no store (a missing folder or prefix, or a folder that is not a store,
    /// an empty one included) it is "no checkpoint here" (exit 7), and no store is made.
    pub fn open_existing(storage: &str, opts: StoreOptions) -> Result<Store> {
        Store::open_existing_cached(storage, opts, None)
    }

    /// [`Store::open_existing`] with, for an object store, a local read-through cache of chunks in folder
    /// `cache` ([`CachedBackend`](super::backend::CachedBackend): a restore on a node that fetched the
    /// chunks before reads them from its disk). A local folder store takes no cache: its chunks are on a
    /// disk already.
    pub fn open_existing_cached(
        storage: &str,
        opts: StoreOptions,
        cache: Option<&Path>,
    ) -> Result<Store> {
        #[cfg(not(feature = "s3"))]
        let _ = cache;
        let none = || Error::NotFound {
            what: "any checkpoint (no store here)".into(),
            storage: storage.into(),
        };
        if let Some(_url) = storage.strip_prefix("s3://") {
            #[cfg(feature = "s3")]
            {
                let config = super::backend::S3Config::from_env(_url)?;
                let backend = super::backend::S3Backend::new(config)?;
                if backend.head(super::backend::STORE_FILE)?.is_none() {
                    return Err(none());
                }
                let backend: Arc<dyn Backend> = Arc::new(backend);
                return match cache {
                    Some(dir) => Store::with_backend(
                        Arc::new(super::backend::CachedBackend::new(backend, dir)?),
                        opts,
                    ),
                    None => Store::with_backend(backend, opts),
                };
            }
        } else {
            let path = Path::new(storage);
            if path.exists() && !path.is_dir() {
                return Err(Error::Invalid(format!("storage {storage} is not a folder")));
            }
            if !LocalBackend::holds_store(path)? {
                return Err(none());
            }
        }
        Store::open_storage(storage, opts)
    }
}
