//! A stand-in for `criu swrk` that lets runc restore a container from images streamed out of the store.
//!
//! Why: runc drives CRIU over its RPC (`criu swrk 3`), and CRIU 4.2.1 cannot stream in that mode: its
//! service opens the images folder with no streaming mode, and `stream` (which the RPC has no field for,
//! but `CRIU_CONFIG_FILE`, read in swrk mode too, can set) makes it abort (`BUG()` in the streamer's
//! socket name: SIGABRT, seen with the real CRIU here). So runc is given this program as its `--criu`
//! (`runc --criu GPU_CHECKPOINT swrk 3`, told apart from our own commands by [`REAL_CRIU_ENV`], which
//! runc passes on with the rest of its environment). It
//! - hands every request but a RESTORE to the real CRIU untouched (it `exec`s it: runc's version check);
//! - turns runc's RESTORE request into CRIU's command line, `criu restore --stream` with the same
//!   settings (runc 1.1's request: its root, external mounts, inherited descriptors, cgroup roots, joined
//!   namespaces, ...), run in the images folder, where our store serves the images;
//! - refuses any setting it does not translate (a clear error in `restore.log` and runc's failure): the
//!   caller only streams where none is expected (`flows/container/restore.rs`);
//! - answers runc as CRIU's service would: the `post-restore` notification with the restored init's PID
//!   (runc records the container then), and the RESTORE answer. runc's other notifications for a
//!   restore (`setup-namespaces`, which runs the bundle's prestart hooks; `orphan-pts-master`, a
//!   terminal) are not sent: the caller does not stream a bundle with hooks or a terminal.
//!
//! The command line has no notifications, but it has action scripts, which CRIU runs at the same
//! moments it would notify its RPC client: `post-restore` comes once every process is restored and
//! before any of them resumes. So CRIU is given this program again as its `--action-script`, through
//! which the proxy tells runc then, and a refusal makes CRIU kill the tree before it ever ran, as its
//! service does (`swrk_notify.rs`).

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use protobuf::{Message, MessageField};
use rust_criu::rust_criu_protobuf::rpc;

use super::rpc::{recv, send};
use super::swrk_notify::{tell_runc, Gate, NOTIFY_ENV};

/// The real CRIU's path. Set on runc's command line by the container restore; its presence makes
/// `gpu-checkpoint swrk FD` act as this proxy.
pub const REAL_CRIU_ENV: &str = "GPU_CHECKPOINT_SWRK_PROXY_CRIU";

/// The file the restored init's PID is written to, in the work folder.
pub(crate) const PIDFILE: &str = "restored.pid";

/// runc's requests are a few KiB.
const MAX_MESSAGE: usize = 1 << 20;

/// `Some((real CRIU, socket))` when this process was started by runc as its CRIU (`swrk FD`, with
/// [`REAL_CRIU_ENV`] set).
pub fn proxy_call(args: &[OsString]) -> Option<(PathBuf, RawFd)> {
    let real = std::env::var_os(REAL_CRIU_ENV)?;
    match args {
        [_, verb, fd] if verb == "swrk" => {
            let fd = fd.to_str()?.parse().ok()?;
            Some((PathBuf::from(real), fd))
        }
        _ => None,
    }
}

/// Serves runc's request on `fd` (see the module documentation); returns the exit status.
pub fn run(real: &Path, fd: RawFd) -> i32 {
    let mut buf = vec![0u8; MAX_MESSAGE];
    // Peeked, not taken: anything but a RESTORE goes to the real CRIU, which reads it itself.
    let n = match peek(fd, &mut buf) {
        Ok(n) if n > 0 && n <= buf.len() => n,
        _ => return exec_real(real, fd),
    };
    match rpc::Criu_req::parse_from_bytes(&buf[..n]) {
        Ok(req) if req.type_() == rpc::Criu_req_type::RESTORE => {
            // Taken off the socket now; the real CRIU never sees it.
            if recv(fd, &mut buf).is_err() {
                return 1;
            }
            restore(real, fd, req)
        }
        _ => exec_real(real, fd),
    }
}

fn exec_real(real: &Path, fd: RawFd) -> i32 {
    let e = Command::new(real)
        .arg("swrk")
        .arg(fd.to_string())
        .env_remove(REAL_CRIU_ENV)
        .exec();
    tracing::error!("running {}: {e}", real.display());
    1
}

fn peek(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    crate::util::retry_interrupted(|| unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_TRUNC,
        )
    })
}

/// CRIU's command line for runc's restore request, and where it runs.
#[derive(Debug, PartialEq, Eq)]
pub struct Translated {
    /// The images folder (CRIU runs in it and names it `.`: the socket path stays short).
    pub images: PathBuf,
    pub work: PathBuf,
    pub log_file: String,
    /// Everything after `criu restore`.
    pub args: Vec<String>,
}

/// Translates runc's RESTORE options into `criu restore --stream` arguments; `Err` names a setting that
/// has no translation here. `path_of(fd)` says which folder a descriptor of runc's is.
pub fn translate(
    mut o: rpc::Criu_opts,
    path_of: &dyn Fn(i32) -> std::io::Result<PathBuf>,
) -> Result<Translated, String> {
    let folder = |what: &str, fd: Option<i32>| -> Result<PathBuf, String> {
        let fd = fd.ok_or_else(|| format!("no {what} descriptor"))?;
        path_of(fd).map_err(|e| format!("{what} descriptor {fd}: {e}"))
    };
    let images = folder("images folder", o.images_dir_fd.take())?;
    let work = match o.work_dir_fd.take() {
        Some(fd) => folder("work folder", Some(fd))?,
        None => images.clone(),
    };
    let log_file = o
        .log_file
        .take()
        .unwrap_or_else(|| "restore.log".to_string());
    let mut args: Vec<String> = vec![
        "--stream".into(),
        "-D".into(),
        ".".into(),
        "-W".into(),
        work.display().to_string(),
        "-o".into(),
        log_file.clone(),
        format!("-v{}", o.log_level.take().unwrap_or(2)),
        "--pidfile".into(),
        work.join(PIDFILE).display().to_string(),
        // Detached, as the service restores; the tree is then a child of this proxy, and runc's
        // (a subreaper) once we exit.
        "--restore-detached".into(),
    ];
    let mut flag = |on: Option<bool>, name: &str| {
        if on == Some(true) {
            args.push(name.into());
        }
    };
    flag(o.rst_sibling.take(), "--restore-sibling");
    flag(o.evasive_devices.take(), "--evasive-devices");
    flag(o.shell_job.take(), "--shell-job");
    flag(o.ext_unix_sk.take(), "--ext-unix-sk");
    flag(o.tcp_established.take(), "--tcp-established");
    flag(o.file_locks.take(), "--file-locks");
    flag(o.link_remap.take(), "--link-remap");
    flag(o.tcp_close.take(), "--tcp-close");
    // We answer runc's notifications ourselves (post-restore).
    o.notify_scripts.take();
    // Only acts on a terminal's master, which the caller does not stream.
    o.orphan_pts_master.take();
    if o.auto_dedup.take() == Some(true) || o.lazy_pages.take() == Some(true) {
        return Err(
            "auto-dedup and lazy pages read image files, which a streamed restore has not".into(),
        );
    }
    if let Some(file) = o.config_file.take() {
        // The RPC's configuration file overrides the request; on the command line, `--config` would
        // be overridden by it. CRIU ignores a file that does not exist (runc's default names one).
        if Path::new(&file).exists() {
            return Err(format!("the CRIU configuration file {file}"));
        }
    }
    if let Some(root) = o.root.take() {
        args.extend(["--root".into(), root]);
    }
    for m in std::mem::take(&mut o.ext_mnt) {
        args.extend(["--external".into(), format!("mnt[{}]:{}", m.key(), m.val())]);
    }
    for e in std::mem::take(&mut o.external) {
        args.extend(["--external".into(), e]);
    }
    for fd in std::mem::take(&mut o.inherit_fd) {
        args.extend([
            "--inherit-fd".into(),
            format!("fd[{}]:{}", fd.fd(), fd.key()),
        ]);
    }
    for c in std::mem::take(&mut o.cg_root) {
        let root = match c.ctrl.as_deref() {
            Some(ctrl) => format!("{ctrl}:{}", c.path()),
            None => c.path().to_string(),
        };
        args.extend(["--cgroup-root".into(), root]);
    }
    for j in std::mem::take(&mut o.join_ns) {
        let mut spec = format!("{}:{}", j.ns(), j.ns_file());
        if let Some(extra) = j.extra_opt.as_deref() {
            spec.push(',');
            spec.push_str(extra);
        }
        args.extend(["--join-ns".into(), spec]);
    }
    if let Some(on) = o.manage_cgroups.take() {
        args.push(
            if on {
                "--manage-cgroups=soft"
            } else {
                "--manage-cgroups=ignore"
            }
            .into(),
        );
    }
    if let Some(mode) = o.manage_cgroups_mode.take() {
        use rpc::Criu_cg_mode as M;
        let name = match mode.enum_value() {
            Ok(M::IGNORE) => "ignore",
            Ok(M::CG_NONE) => "none",
            Ok(M::PROPS) => "props",
            Ok(M::SOFT) => "soft",
            Ok(M::FULL) => "full",
            Ok(M::STRICT) => "strict",
            _ => return Err(format!("cgroup mode {}", mode.value())),
        };
        args.push(format!("--manage-cgroups={name}"));
    }
    if let Some(ns) = o.empty_ns.take() {
        if ns & !(libc::CLONE_NEWNET as u32) != 0 {
            return Err(format!("empty namespaces {ns:#x}"));
        }
        if ns != 0 {
            args.extend(["--empty-ns".into(), "net".into()]);
        }
    }
    if let Some(method) = o.network_lock.take() {
        use rpc::Criu_network_lock_method as N;
        let name = match method.enum_value() {
            Ok(N::IPTABLES) => "iptables",
            Ok(N::NFTABLES) => "nftables",
            Ok(N::SKIP) => "skip",
            Err(v) => return Err(format!("network lock method {v}")),
        };
        args.extend(["--network-lock".into(), name.into()]);
    }
    if let Some(p) = o.lsm_profile.take() {
        args.extend(["--lsm-profile".into(), p]);
    }
    if let Some(c) = o.lsm_mount_context.take() {
        args.extend(["--lsm-mount-context".into(), c]);
    }
    // Whatever is left (a field not translated above, or one this rpc.proto does not know) is refused:
    // restoring without it could restore something else than runc asked for.
    if o != rpc::Criu_opts::new() {
        return Err(format!("the RPC options {o:?}"));
    }
    Ok(Translated {
        images,
        work,
        log_file,
        args,
    })
}

/// The process at the other end of runc's socket (runc), as CRIU's service finds it.
fn peer_pid(fd: RawFd) -> i32 {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is valid for writes of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r == 0 && cred.pid > 0 {
        cred.pid
    } else {
        // SAFETY: getppid has no preconditions; runc started us.
        unsafe { libc::getppid() }
    }
}

fn answer(fd: RawFd, resp: &rpc::Criu_resp) -> bool {
    resp.write_to_bytes()
        .ok()
        .is_some_and(|b| send(fd, &b).is_ok())
}

fn failed(fd: RawFd, why: &str) -> i32 {
    let mut resp = rpc::Criu_resp::new();
    resp.set_type(rpc::Criu_req_type::RESTORE);
    resp.set_success(false);
    resp.set_cr_errmsg(why.to_string());
    answer(fd, &resp);
    1
}

/// Appends a line to CRIU's log in the work folder, where runc points the user after a failure.
fn note(t: Option<&Translated>, line: &str) {
    if let Some(t) = t {
        let path = t.work.join(&t.log_file);
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
        {
            use std::io::Write;
            let _ = writeln!(f, "gpu-checkpoint swrk proxy: {line}");
        }
    }
}

fn restore(real: &Path, fd: RawFd, req: rpc::Criu_req) -> i32 {
    let opts = req.opts.into_option().unwrap_or_default();
    // The folders' descriptors are runc's, as CRIU's service reads them: `/proc/RUNC/fd/N`.
    let runc = peer_pid(fd);
    let path_of = |n: i32| std::fs::read_link(format!("/proc/{runc}/fd/{n}"));
    let work = opts.work_dir_fd.or(opts.images_dir_fd).map(path_of);
    let t = match translate(opts, &path_of) {
        Ok(t) => t,
        Err(why) => {
            let why = format!("a streamed restore cannot take {why}");
            if let Some(Ok(work)) = work {
                let log = Translated {
                    images: work.clone(),
                    work,
                    log_file: "restore.log".into(),
                    args: Vec::new(),
                };
                note(Some(&log), &why);
            }
            return failed(fd, &why);
        }
    };
    // runc hears of the restored tree from our action script, before the tree resumes
    // (`swrk_notify.rs`).
    let exe = std::env::current_exe();
    let gate = Gate::open(&t.work);
    let (exe, mut gate) = match (exe, gate) {
        (Ok(e), Ok(g)) => (e, g),
        (Err(e), _) | (_, Err(e)) => {
            note(Some(&t), &format!("the post-restore script: {e}"));
            return failed(fd, &format!("the post-restore script: {e}"));
        }
    };
    // runc's descriptors (stdio, the images and work folders, namespaces) are inherited as they are.
    let criu = Command::new(real)
        .arg("restore")
        .args(&t.args)
        .arg("--action-script")
        .arg(&exe)
        .env(NOTIFY_ENV, gate.path())
        .current_dir(&t.images)
        .env_remove(REAL_CRIU_ENV)
        .spawn();
    let status = criu.and_then(|mut c| gate.serve(&mut c, &mut |pid| tell_runc(fd, pid)));
    match status {
        Ok(s) if s.success() && gate.told() => {}
        Ok(s) if s.success() => {
            note(Some(&t), "CRIU ran no post-restore script");
            return failed(fd, "CRIU ran no post-restore script");
        }
        Ok(s) => return failed(fd, &format!("criu restore --stream exited ({s})")),
        Err(e) => {
            note(Some(&t), &format!("running {}: {e}", real.display()));
            return failed(fd, &format!("running {}: {e}", real.display()));
        }
    }
    let pidfile = t.work.join(PIDFILE);
    let pid: i32 = match std::fs::read_to_string(&pidfile)
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        Some(p) => p,
        None => {
            note(Some(&t), "CRIU wrote no PID");
            return failed(fd, "CRIU wrote no PID");
        }
    };
    let _ = std::fs::remove_file(&pidfile);
    let kill = |why: &str| {
        note(Some(&t), why);
        // SAFETY: kill has no memory-safety preconditions; the restored tree's init, ours alone.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        failed(fd, why)
    };
    let mut done = rpc::Criu_restore_resp::new();
    done.set_pid(pid);
    let mut resp = rpc::Criu_resp::new();
    resp.set_type(rpc::Criu_req_type::RESTORE);
    resp.set_success(true);
    resp.restore = MessageField::some(done);
    if !answer(fd, &resp) {
        return kill("runc went away before the answer");
    }
    // runc closes its end once it has the answer, then waits for us.
    let mut buf = [0u8; 64];
    let _ = recv(fd, &mut buf);
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runc_like() -> rpc::Criu_opts {
        let mut o = rpc::Criu_opts::new();
        o.set_images_dir_fd(5);
        o.set_work_dir_fd(6);
        o.set_evasive_devices(true);
        o.set_log_level(4);
        o.set_log_file("restore.log".into());
        o.set_rst_sibling(true);
        o.set_root("/run/runc/x/criu-root".into());
        o.set_manage_cgroups(true);
        o.set_notify_scripts(true);
        o.set_shell_job(false);
        o.set_tcp_established(false);
        o.set_empty_ns(libc::CLONE_NEWNET as u32);
        o.set_orphan_pts_master(true);
        o.set_auto_dedup(false);
        o.set_lazy_pages(false);
        o.set_config_file("/nonexistent/runc.conf".into());
        let mut m = rpc::Ext_mount_map::new();
        m.set_key("/dev/null".into());
        m.set_val("/dev/null".into());
        o.ext_mnt.push(m);
        let mut c = rpc::Cgroup_root::new();
        c.set_ctrl("cpu".into());
        c.set_path("/x".into());
        o.cg_root.push(c);
        let mut f = rpc::Inherit_fd::new();
        f.set_key("pipe:[12]".into());
        f.set_fd(1);
        o.inherit_fd.push(f);
        o
    }

    fn folders(fd: i32) -> std::io::Result<PathBuf> {
        Ok(PathBuf::from(format!("/w/{fd}")))
    }

    #[test]
    fn runcs_restore_request_becomes_a_streamed_command_line() {
        let t = translate(runc_like(), &folders).unwrap();
        assert_eq!(t.images, Path::new("/w/5"));
        assert_eq!(t.work, Path::new("/w/6"));
        let line = t.args.join(" ");
        for want in [
            "--stream -D . -W /w/6 -o restore.log -v4",
            "--restore-detached",
            "--restore-sibling",
            "--evasive-devices",
            "--root /run/runc/x/criu-root",
            "--external mnt[/dev/null]:/dev/null",
            "--inherit-fd fd[1]:pipe:[12]",
            "--cgroup-root cpu:/x",
            "--manage-cgroups=soft",
            "--empty-ns net",
        ] {
            assert!(line.contains(want), "{want:?} not in {line:?}");
        }
        assert!(!line.contains("--tcp-established"), "{line}");
    }

    #[test]
    fn settings_without_a_translation_are_refused() {
        let mut o = runc_like();
        o.set_lazy_pages(true);
        assert!(translate(o, &folders).unwrap_err().contains("lazy"));
        let mut o = runc_like();
        o.set_ghost_limit(1);
        assert!(translate(o, &folders).unwrap_err().contains("ghost_limit"));
        // An existing configuration file would override the request on the RPC, not on the command line.
        let conf = tempfile::NamedTempFile::new().unwrap();
        let mut o = runc_like();
        o.set_config_file(conf.path().display().to_string());
        assert!(translate(o, &folders)
            .unwrap_err()
            .contains("configuration"));
    }
}
