//! A container's settings for a dump driven from outside its runtime: what runc tells CRIU about the
//! container when it checkpoints it (its root, the mounts that come from the host, its freezer cgroup, its
//! network namespace left empty), so that the images are the ones runc's own checkpoint would write and
//! `runc restore` restores them. The container flow reads these from runc's state
//! (`flows::container::direct`); here they only reach CRIU, over the RPC or on its command line.

use std::path::PathBuf;

use rust_criu::rust_criu_protobuf::rpc;

/// CRIU's settings for dumping a container's init and its tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerDump {
    /// The container's root file system on the host (CRIU's `--root`).
    pub root: PathBuf,
    /// The container's freezer cgroup: CRIU freezes the tree with it instead of one ptrace stop per task
    /// (`--freeze-cgroup`); a cgroup already frozen (`runc pause`) stays frozen.
    pub freeze_cgroup: Option<PathBuf>,
    /// Mounts that come from outside the container (bind mounts, masked paths, device nodes), as
    /// (mount point inside the container, the name the images record): `--external mnt[KEY]:VAL`. The
    /// runtime's restore names the same mounts again.
    pub ext_mounts: Vec<(String, String)>,
    /// The network namespace is recorded empty (`--empty-ns net`): the runtime sets up networking again.
    pub empty_net_ns: bool,
}

impl ContainerDump {
    /// The settings in CRIU's RPC.
    pub(super) fn apply_rpc(&self, opts: &mut rpc::Criu_opts) {
        opts.set_root(self.root.display().to_string());
        if let Some(cg) = &self.freeze_cgroup {
            opts.set_freeze_cgroup(cg.display().to_string());
        }
        for (key, val) in &self.ext_mounts {
            let mut m = rpc::Ext_mount_map::new();
            m.set_key(key.clone());
            m.set_val(val.clone());
            opts.ext_mnt.push(m);
        }
        if self.empty_net_ns {
            opts.set_empty_ns(libc::CLONE_NEWNET as u32);
        }
    }

    /// The same settings as `criu dump` arguments (a streamed dump runs the command).
    pub(super) fn cli_args(&self) -> Vec<String> {
        let mut args = vec!["--root".to_string(), self.root.display().to_string()];
        if let Some(cg) = &self.freeze_cgroup {
            args.extend(["--freeze-cgroup".into(), cg.display().to_string()]);
        }
        for (key, val) in &self.ext_mounts {
            args.extend(["--external".into(), format!("mnt[{key}]:{val}")]);
        }
        if self.empty_net_ns {
            args.extend(["--empty-ns".into(), "net".into()]);
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ContainerDump {
        ContainerDump {
            root: "/b/rootfs".into(),
            freeze_cgroup: Some("/sys/fs/cgroup/freezer/c1".into()),
            ext_mounts: vec![("/proc/kcore".into(), "/dev/null".into())],
            empty_net_ns: true,
        }
    }

    #[test]
    fn every_setting_reaches_the_command_line() {
        assert_eq!(
            settings().cli_args(),
            [
                "--root",
                "/b/rootfs",
                "--freeze-cgroup",
                "/sys/fs/cgroup/freezer/c1",
                "--external",
                "mnt[/proc/kcore]:/dev/null",
                "--empty-ns",
                "net"
            ]
        );
    }

    #[test]
    fn every_setting_reaches_the_rpc() {
        let mut opts = rpc::Criu_opts::new();
        settings().apply_rpc(&mut opts);
        assert_eq!(opts.root(), "/b/rootfs");
        assert_eq!(opts.freeze_cgroup(), "/sys/fs/cgroup/freezer/c1");
        assert_eq!(opts.ext_mnt.len(), 1);
        assert_eq!(opts.ext_mnt[0].key(), "/proc/kcore");
        assert_eq!(opts.ext_mnt[0].val(), "/dev/null");
        assert_eq!(opts.empty_ns(), libc::CLONE_NEWNET as u32);
    }
}
