//! Where the store meets signatures: the check of a checkpoint against the trusted keys, done where a
//! checkpoint is read for use ([`Store::get`]), so that restore, container restores and the agent's
//! restores all go through it; and each checkpoint's signature status for `list`, `inspect` and `verify`.

use super::backend::ReadObjects;
use super::error::{Error, Result};
use super::signing::Signature;
use super::{CheckpointInfo, Store};

impl Store {
    /// `info` as the store holds it, if no trusted keys were given; with them, re-read from the manifest
    /// bytes whose signature is checked (so that what is used is what was checked), or refused.
    pub(super) fn trusted(&self, info: CheckpointInfo) -> Result<CheckpointInfo> {
        let Some(keys) = &self.inner.opts.trusted_keys else {
            return Ok(info);
        };
        let bytes = self.manifest_bytes(&info.id)?;
        let sig = self.inner.backend.get_signature(&info.id)?;
        keys.check(&bytes, sig.as_deref())
            .map_err(|reason| Error::UntrustedCheckpoint {
                checkpoint: info.id.clone(),
                reason,
            })?;
        self.decode_manifest(&info.id, &bytes)
    }

    /// Whether checkpoint `id` (an exact id) is signed, by which key, and whether its signature matches
    /// its manifest. Trusted keys play no part: [`Store::get`] enforces them.
    pub fn signature(&self, id: &str) -> Result<Signature> {
        let bytes = self.manifest_bytes(id)?;
        let sig = self.inner.backend.get_signature(id)?;
        Ok(Signature::of(&bytes, sig.as_deref()))
    }
}
