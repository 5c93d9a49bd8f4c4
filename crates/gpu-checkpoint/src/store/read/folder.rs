//! The sink that takes chunks in any order into the image files of a folder (`materialize`).

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::pool::on_workers;
use super::verify::fetch_any;
use super::{MaterializeStats, Task};
use crate::store::error::{Error, Result};
use crate::store::manifest::{CheckpointInfo, ChunkRef};
use crate::store::{Inner, Progress};
use crate::util::{create_private_dir_all, create_private_file};

pub(in crate::store) fn materialize(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    progress: &dyn Progress,
) -> Result<MaterializeStats> {
    materialize_selected(inner, info, dest, &|_, _, _| true, progress)
}

/// [`materialize`] of the chunks `keep(path, offset, len)` selects; the others stay holes.
pub(in crate::store) fn materialize_selected(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    keep: &(dyn Fn(&str, u64, u64) -> bool + Sync),
    progress: &dyn Progress,
) -> Result<MaterializeStats> {
    let started = Instant::now();
    let created_dest = !dest.exists();
    create_private_dir_all(dest).map_err(Error::io("cannot create folder", dest))?;
    let mut created: Vec<PathBuf> = Vec::new();
    let result = write_all(inner, info, dest, keep, progress, &mut created);
    if result.is_err() {
        // Leave no partial image behind for CRIU to trip over.
        for p in &created {
            let _ = fs::remove_file(p);
        }
        if created_dest {
            let _ = fs::remove_dir_all(dest);
        }
    }
    let mut stats = result?;
    stats.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(stats)
}

fn write_all(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    keep: &(dyn Fn(&str, u64, u64) -> bool + Sync),
    progress: &dyn Progress,
    created: &mut Vec<PathBuf>,
) -> Result<MaterializeStats> {
    let mut files = Vec::with_capacity(info.files.len());
    for f in &info.files {
        // Relative, inside the folder: manifest::decode refuses any other path.
        let path = dest.join(&f.path);
        if let Some(parent) = path.parent() {
            create_private_dir_all(parent).map_err(Error::io("cannot create folder", parent))?;
        }
        let file =
            create_private_file(&path).map_err(Error::io("cannot create image file", &path))?;
        created.push(path.clone());
        // Sized up front: all-zero chunks are simply never written and read back as zeros (holes).
        file.set_len(f.size)
            .map_err(Error::io("cannot size image file", &path))?;
        files.push((file, path));
    }

    let stored = |fi: usize, off: u64, c: &ChunkRef, kept: bool| {
        c.id.is_some() && keep(&info.files[fi].path, off, c.len as u64) == kept
    };
    let tasks: Vec<Task> = info
        .chunk_refs()
        .filter(|(fi, _, off, c)| stored(*fi, *off, c, true))
        .map(|(fi, ci, off, _)| (fi, ci, off))
        .collect();
    // Left as holes: counted as done for the progress bar.
    let skipped: u64 = info
        .chunk_refs()
        .filter(|(fi, _, off, c)| stored(*fi, *off, c, false))
        .map(|(_, _, _, c)| c.len as u64)
        .sum();
    let total: u64 = info.stats.logical_bytes;
    let zero_bytes: u64 = info
        .chunk_refs()
        .filter(|(_, _, _, c)| c.id.is_none())
        .map(|(_, _, _, c)| c.len as u64)
        .sum();
    let (stored, count) = (AtomicU64::new(0), AtomicU64::new(0));
    progress.start("restore images", total);
    progress.advance(zero_bytes + skipped);
    let chunk_of = |&(fi, ci, _): &Task| {
        let c = &info.files[fi].chunks[ci];
        (c.id, c.len)
    };
    let result = on_workers(inner, info, &tasks, chunk_of, |&(fi, ci, off), scratch| {
        let (raw, stored_len) = fetch_any(inner, info, scratch, fi, ci, off)?;
        let (file, path) = &files[fi];
        file.write_all_at(raw, off)
            .map_err(Error::io("cannot write image file", path))?;
        let n = raw.len() as u64;
        stored.fetch_add(stored_len, Ordering::Relaxed);
        count.fetch_add(1, Ordering::Relaxed);
        progress.advance(n);
        Ok(())
    });
    progress.finish();
    result?;
    let (stored_bytes_read, chunks_read) = (stored.into_inner(), count.into_inner());
    Ok(MaterializeStats {
        files: files.len() as u64,
        logical_bytes: total,
        stored_bytes_read,
        chunks_read,
        zero_bytes,
        elapsed_ms: 0,
    })
}
