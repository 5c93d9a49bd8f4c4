//! Device descriptors CRIU cannot dump, reopened on restore: the tool's side of the CRIU plugin in
//! `crates/criu-devices` (`libgpu_checkpoint_devices.so`).
//!
//! A process that uses only NVML, or a child forked without exec from a CUDA process, holds
//! `/dev/nvidiactl` / `/dev/nvidiaN` descriptors without a CUDA context: there is no GPU state to save, but
//! CRIU refuses to dump a descriptor of a device it does not know (`Can't dump file N of that type`). CRIU
//! asks its plugins first (`DUMP_EXT_FILE`): ours takes the descriptors of the device nodes it is told to
//! (NVIDIA's, and those the user names with `--reopen-device`), and writes one [`ReopenedDevice`] line per
//! open file into a record file; CRIU then writes an external-file entry (id, owner) into its own images.
//! The checkpoint keeps the records in its manifest. On restore CRIU asks the plugin for each such file by
//! id (`RESTORE_EXT_FILE`) inside the process it restores; the plugin opens the same node with the same
//! status flags (never creating or truncating anything) after checking it is still the same device
//! (character device, same device number), and CRIU puts the descriptor at its old number.
//!
//! A child forked without exec from a CUDA process also keeps its parent's `/dev/nvidiaN` mappings, which CRIU
//! cannot dump either ("Can't handle non-regular mapping"). When the tool says so ([`ENV_REPLACE`]), the
//! plugin answers CRIU's `HANDLE_DEVICE_VMA` for them: CRIU then records such a mapping as a shared
//! mapping of the node (no contents) and, on restore, asks the plugin for a descriptor to map in its place
//! (`UPDATE_VMA_MAP`); the plugin hands it `/dev/zero`, so the restored child has zeroed shared memory
//! where it had windows onto a context that was never its own
//! ([`crate::detect::Report::inherited_mappings`]).
//!
//! The tool hands CRIU a private plugin folder ([`PluginDir`]: 0700, unguessable name) holding a link to the
//! plugin and nothing else, through `CRIU_LIBS_DIR`, and tells the plugin where its record file is
//! ([`ENV_RECORD`]) and which nodes besides NVIDIA's it takes ([`ENV_ALLOW`]). Nothing about the images
//! changes: the plugin writes nothing into the images folder, so streamed and staged dumps work alike.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

pub use gpu_checkpoint_device_records::{
    is_nvidia_node, is_taken, parse_records, ReopenedDevice, ENV_ALLOW, ENV_RECORD, ENV_REPLACE,
};

use super::Error;
use crate::util;

/// The plugin's file name, as cargo builds it (next to the `gpu-checkpoint` binary).
pub const PLUGIN_FILE: &str = "libgpu_checkpoint_devices.so";
/// Names the plugin file to use instead of the one next to the binary.
pub const ENV_PLUGIN: &str = "GPU_CHECKPOINT_DEVICES_PLUGIN";
/// Where CRIU looks for plugins (its own variable).
pub const ENV_CRIU_LIBS_DIR: &str = "CRIU_LIBS_DIR";

/// A private folder holding the plugin alone (for `CRIU_LIBS_DIR`) and the plugin's record file; removed
/// when dropped.
#[derive(Debug)]
pub struct PluginDir {
    dir: PathBuf,
    record: PathBuf,
    allow: Vec<PathBuf>,
    /// Inherited NVIDIA mappings are recorded (dump) or replaced (restore): [`ENV_REPLACE`].
    replace: bool,
}

impl PluginDir {
    /// For a dump: an empty record file the plugin appends to; `allow`: the nodes besides NVIDIA's;
    /// `replace`: inherited NVIDIA mappings are to be recorded for replacement.
    pub fn for_dump(allow: &[PathBuf], replace: bool) -> Result<PluginDir, Error> {
        let mut dir = Self::create()?;
        dir.write_record(&[])?;
        dir.allow = allow.to_vec();
        dir.replace = replace;
        Ok(dir)
    }

    /// For a restore: the records the plugin reopens; `replace`: the checkpoint replaced mappings.
    pub fn for_restore(devices: &[ReopenedDevice], replace: bool) -> Result<PluginDir, Error> {
        let mut dir = Self::create()?;
        dir.write_record(devices)?;
        dir.replace = replace;
        Ok(dir)
    }

    fn create() -> Result<PluginDir, Error> {
        let plugin = find_plugin()?;
        let tmp = std::env::temp_dir();
        let dir = util::create_unique_private_dir(&tmp, "gpu-checkpoint-plugins.")
            .map_err(|e| Error::io(format!("creating a plugin folder in {}", tmp.display()), e))?;
        let this = PluginDir {
            record: dir.join("devices.records"),
            dir,
            allow: Vec::new(),
            replace: false,
        };
        // A link, not a copy (a debug build's plugin is tens of MB): the plugin is as trusted as the binary
        // it lies beside, and the folder holds nothing else for CRIU to load.
        let link = this.dir.join(PLUGIN_FILE);
        std::os::unix::fs::symlink(&plugin, &link).map_err(|e| {
            Error::io(
                format!(
                    "linking the CRIU plugin {} into {}",
                    plugin.display(),
                    this.dir.display()
                ),
                e,
            )
        })?;
        Ok(this)
    }

    fn write_record(&self, devices: &[ReopenedDevice]) -> Result<(), Error> {
        let mut f = util::create_new_private_file(&self.record)
            .map_err(|e| Error::io(format!("creating {}", self.record.display()), e))?;
        let text = devices.iter().fold(String::new(), |mut s, d| {
            let _ = write!(s, "{}", d.line());
            s
        });
        f.write_all(text.as_bytes())
            .map_err(|e| Error::io(format!("writing {}", self.record.display()), e))
    }

    /// The environment CRIU runs with.
    pub fn env(&self) -> Vec<(OsString, OsString)> {
        let mut env = vec![
            (ENV_CRIU_LIBS_DIR.into(), self.dir.clone().into_os_string()),
            (ENV_RECORD.into(), self.record.clone().into_os_string()),
        ];
        let allow: Vec<String> = self.allow.iter().map(|p| p.display().to_string()).collect();
        env.push((ENV_ALLOW.into(), allow.join(":").into()));
        // Always set, so that a value in the caller's environment never counts.
        let replace = if self.replace { "1" } else { "" };
        env.push((ENV_REPLACE.into(), replace.into()));
        env
    }

    /// What the plugin recorded during the dump.
    pub fn records(&self) -> Result<Vec<ReopenedDevice>, Error> {
        let text = std::fs::read_to_string(&self.record)
            .map_err(|e| Error::io(format!("reading {}", self.record.display()), e))?;
        parse_records(&text).map_err(|e| {
            Error::io(
                format!("the CRIU plugin's records {}", self.record.display()),
                std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            )
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PluginDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The plugin: [`ENV_PLUGIN`], else [`PLUGIN_FILE`] next to this executable (where cargo builds it);
/// missing, exit 5 like a missing CRIU.
pub fn find_plugin() -> Result<PathBuf, Error> {
    let path = match std::env::var_os(ENV_PLUGIN) {
        Some(p) => std::path::absolute(PathBuf::from(&p)).unwrap_or_else(|_| PathBuf::from(p)),
        None => {
            let exe = std::env::current_exe()
                .map_err(|e| Error::io("finding this executable's folder", e))?;
            let dir = exe.parent().unwrap_or(Path::new("/"));
            // Test executables live one folder below the binaries (target/debug/deps).
            let here = dir.join(PLUGIN_FILE);
            match (here.is_file(), dir.parent()) {
                (false, Some(up)) if dir.ends_with("deps") => up.join(PLUGIN_FILE),
                _ => here,
            }
        }
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::PluginMissing { path })
    }
}
