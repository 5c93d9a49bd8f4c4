//! runc's command line as the engines write it (containerd's shim through go-runc, CRI-O, podman's conmon,
//! a user): the global flags before the command, the command, and, for `checkpoint` and `restore`, the
//! flags this wrapper acts on. Everything is kept as given, so that the real runc gets exactly the
//! engine's command line.
//!
//! runc parses with urfave/cli v1: a flag may be written `-f` or `--f`, its value `--f V` or `--f=V`, a
//! boolean `--f` or `--f=true|false`, and flag parsing stops at the first argument that is no flag;
//! `checkpoint` and `restore` take exactly one, the container's id.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

/// runc's global flags that take a value (1.1 to 1.4: `--root`, `--log`, `--log-format`, `--criu`,
/// `--rootless`); the others are booleans.
const GLOBAL_VALUES: &[&str] = &["root", "log", "log-format", "criu", "rootless"];

/// `checkpoint` and `restore` flags that take a value (runc 1.1 to 1.4).
const COMMAND_VALUES: &[&str] = &[
    "image-path",
    "work-path",
    "parent-path",
    "page-server",
    "status-fd",
    "manage-cgroups-mode",
    "empty-ns",
    "console-socket",
    "bundle",
    "b",
    "pid-file",
    "lsm-profile",
    "lsm-mount-context",
];

/// One parsed flag: its name without dashes, and its value (a boolean's is `true` unless `=false`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Flag {
    name: String,
    value: Option<String>,
}

/// A runc command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncCall {
    /// Everything, as given (without the program's name).
    pub args: Vec<OsString>,
    /// The global flags before the command, as given.
    pub global: Vec<OsString>,
    /// The command (`checkpoint`, `restore`, `create`, ...); `None` for a bare `runc --version`.
    pub command: Option<String>,
    global_flags: Vec<Flag>,
    command_flags: Vec<Flag>,
    /// The arguments after the command's flags (the container's id for `checkpoint` and `restore`).
    pub positional: Vec<OsString>,
}

fn parse_flag(arg: &OsStr) -> Option<(String, Option<String>)> {
    let s = arg.to_str()?;
    let body = s.strip_prefix("--").or_else(|| s.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n.to_string(), Some(v.to_string())),
        None => (body.to_string(), None),
    })
}

/// Reads flags from `args` until the first argument that is none; returns them and where that argument is.
fn flags(args: &[OsString], with_value: &[&str]) -> (Vec<Flag>, usize) {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--" {
            return (out, i + 1);
        }
        let Some((name, inline)) = parse_flag(&args[i]) else {
            break;
        };
        let value = match inline {
            Some(v) => Some(v),
            None if with_value.contains(&name.as_str()) => {
                i += 1;
                args.get(i).map(|v| v.to_string_lossy().into_owned())
            }
            None => None,
        };
        out.push(Flag { name, value });
        i += 1;
    }
    (out, i)
}

impl RuncCall {
    pub fn parse(args: &[OsString]) -> RuncCall {
        let (global_flags, at) = flags(args, GLOBAL_VALUES);
        let command = args.get(at).and_then(|c| c.to_str()).map(str::to_string);
        let rest = args.get(at + 1..).unwrap_or_default();
        let (command_flags, pos) = flags(rest, COMMAND_VALUES);
        RuncCall {
            args: args.to_vec(),
            global: args[..at.min(args.len())].to_vec(),
            command,
            global_flags,
            command_flags,
            positional: rest.get(pos..).unwrap_or_default().to_vec(),
        }
    }

    fn value_of<'a>(flags: &'a [Flag], names: &[&str]) -> Option<&'a str> {
        flags
            .iter()
            .rev()
            .find(|f| names.contains(&f.name.as_str()))
            .and_then(|f| f.value.as_deref())
    }

    fn is_set(flags: &[Flag], name: &str) -> bool {
        flags
            .iter()
            .rev()
            .find(|f| f.name == name)
            .is_some_and(|f| {
                !matches!(
                    f.value.as_deref().map(str::to_ascii_lowercase).as_deref(),
                    Some("false" | "0" | "f")
                )
            })
    }

    /// A global flag's value (`root`, `log`, `log-format`, `criu`).
    pub fn global_value(&self, name: &str) -> Option<&str> {
        Self::value_of(&self.global_flags, &[name])
    }

    /// Whether a boolean flag of the command is set (`leave-running`, `detach`, `pre-dump`, ...).
    pub fn flag(&self, name: &str) -> bool {
        Self::is_set(&self.command_flags, name)
    }

    /// A command flag's value.
    pub fn value(&self, names: &[&str]) -> Option<&str> {
        Self::value_of(&self.command_flags, names)
    }

    /// The container's id: the command's one argument, when runc would take it as one (`None` when
    /// there is not exactly one, or it is no valid id: runc itself refuses those). The id names folders
    /// (runc's state folder for it), so nothing else is acted on.
    pub fn id(&self) -> Option<&str> {
        match self.positional.as_slice() {
            [id] => id
                .to_str()
                .filter(|s| crate::validate::container_id(s).is_ok()),
            _ => None,
        }
    }

    /// The folder of CRIU's images: `--image-path`, or runc's default `./checkpoint`.
    pub fn image_path(&self) -> std::io::Result<PathBuf> {
        match self.value(&["image-path"]) {
            Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
            _ => Ok(std::env::current_dir()?.join("checkpoint")),
        }
    }

    /// The bundle a restore creates the container from: `--bundle`, or the current folder (runc's).
    pub fn bundle(&self) -> std::io::Result<PathBuf> {
        match self.value(&["bundle", "b"]) {
            Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
            _ => std::env::current_dir(),
        }
    }

    /// The command line with `criu` as runc's CRIU (`--criu PATH` first), unless the engine named one.
    pub fn with_criu(&self, criu: Option<&std::path::Path>) -> Vec<OsString> {
        let mut out = Vec::with_capacity(self.args.len() + 2);
        if let Some(c) = criu.filter(|_| self.global_value("criu").is_none()) {
            out.push("--criu".into());
            out.push(c.as_os_str().to_owned());
        }
        out.extend(self.args.iter().cloned());
        out
    }

    /// The global flags the runtime's other commands need besides `--root` (`--systemd-cgroup`,
    /// `--rootless`), without the log flags (ours would write into the engine's log) or `--criu` (given
    /// apart).
    pub fn other_global_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for f in &self.global_flags {
            match (f.name.as_str(), &f.value) {
                ("rootless", Some(v)) => out.push(format!("--rootless={v}")),
                ("systemd-cgroup", _)
                    if Self::is_set(std::slice::from_ref(f), "systemd-cgroup") =>
                {
                    out.push("--systemd-cgroup".into())
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(line: &str) -> RuncCall {
        let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
        RuncCall::parse(&args)
    }

    #[test]
    fn containerds_checkpoint_line_is_read() {
        // As go-runc writes it for containerd's shim.
        let c = call(
            "--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json checkpoint \
             --image-path /tmp/img --work-path /var/lib/w --leave-running 0123abcd",
        );
        assert_eq!(c.command.as_deref(), Some("checkpoint"));
        assert_eq!(c.id(), Some("0123abcd"));
        assert_eq!(c.global_value("root"), Some("/run/containerd/runc/k8s.io"));
        assert_eq!(c.global_value("log-format"), Some("json"));
        assert!(c.flag("leave-running"));
        assert!(!c.flag("pre-dump"));
        assert_eq!(c.image_path().unwrap(), PathBuf::from("/tmp/img"));
        assert_eq!(c.global.len(), 6);
        assert!(c.other_global_args().is_empty());
    }

    #[test]
    fn a_restore_line_with_inline_values_and_short_flags() {
        let c = call(
            "-root=/r --systemd-cgroup restore -d --pid-file /p -b /bundle --image-path=/i \
             --leave-running=false c1",
        );
        assert_eq!(c.command.as_deref(), Some("restore"));
        assert_eq!(c.id(), Some("c1"));
        assert!(c.flag("d"));
        assert!(!c.flag("leave-running"));
        assert_eq!(c.bundle().unwrap(), PathBuf::from("/bundle"));
        assert_eq!(c.image_path().unwrap(), PathBuf::from("/i"));
        assert_eq!(c.global_value("root"), Some("/r"));
        assert_eq!(c.other_global_args(), ["--systemd-cgroup"]);
    }

    #[test]
    fn our_criu_is_given_first_unless_the_engine_named_one() {
        let c = call("--root /r checkpoint c1");
        let line = c.with_criu(Some(std::path::Path::new("/our/criu")));
        assert_eq!(line[..2], [OsString::from("--criu"), "/our/criu".into()]);
        assert_eq!(line[2..], c.args[..]);
        let theirs = call("--criu /theirs checkpoint c1");
        assert_eq!(
            theirs.with_criu(Some(std::path::Path::new("/our/criu"))),
            theirs.args
        );
    }

    #[test]
    fn other_commands_and_odd_lines() {
        assert_eq!(call("--version").command, None);
        let c = call("--root /r state c1");
        assert_eq!(c.command.as_deref(), Some("state"));
        assert_eq!(c.id(), Some("c1"));
        // No id, or two: runc refuses these itself.
        assert_eq!(call("checkpoint --image-path /i").id(), None);
        assert_eq!(call("checkpoint a b").id(), None);
        // What runc would refuse, never a folder name of ours.
        for bad in ["..", ".", "a/b", "../x", "a b"] {
            let c = RuncCall::parse(&["checkpoint".into(), bad.into()]);
            assert_eq!(c.id(), None, "{bad:?}");
        }
        assert_eq!(call("checkpoint gc-1.a_b+c").id(), Some("gc-1.a_b+c"));
        // Without --image-path: runc's default, ./checkpoint.
        let here = std::env::current_dir().unwrap().join("checkpoint");
        assert_eq!(call("checkpoint c1").image_path().unwrap(), here);
    }
}
