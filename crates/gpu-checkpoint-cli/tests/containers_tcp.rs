//! An established TCP connection inside a real runc container, checkpointed with `--tcp-established`
//! (by our CRIU directly, and through `--runtime-checkpoint`), stopped and restored: the same connection
//! carries data both ways afterwards; with a CRIU configuration file (`org.criu.config`) that names the
//! network lock method, the dump uses the file's (CRIU's images record it). Needs root, CRIU, runc, busybox-static and iproute2: fails in CI
//! without them, skips locally.

mod container_support;

use container_support::*;
use gpu_checkpoint_workloads::{chain, field_u64, read_state};

/// What every test here starts from, or `None` (skipped: containers_ready said why): a network namespace
/// of its own (`tag` in its name), a private folder, and the store's path in it.
fn lab(tag: &str) -> Option<(NetNs, tempfile::TempDir, std::path::PathBuf)> {
    if !containers_ready() {
        return None;
    }
    let ns = NetNs::add(&format!("gc-{}-{tag}", std::process::id()))?;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    Some((ns, dir, store))
}

/// The container's established TCP connections (`local remote`, as `/proc/PID/net/tcp` writes them),
/// seen through its init's network namespace.
fn established(init: i32) -> Vec<String> {
    let table = std::fs::read_to_string(format!("/proc/{init}/net/tcp")).unwrap();
    let mut conns: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(3) == Some(&"01")).then(|| format!("{} {}", f[1], f[2]))
        })
        .collect();
    conns.sort();
    conns
}

/// The network lock method CRIU recorded in a checkpoint's `inventory.img` (`inventory_entry`'s field
/// 11, `network_lock_method`: CRIU's own numbering, 0 iptables, 1 nftables, 2 skip; not the RPC's, which
/// starts at 1), read from its export.
fn network_lock_method(store: &std::path::Path, ckpt: &str, dir: &std::path::Path) -> Option<u64> {
    let archive = dir.join(format!("{ckpt}.tar"));
    let o = gc_run(&[
        "export",
        ckpt,
        "--format",
        "oci-checkpoint",
        "-o",
        archive.to_str().unwrap(),
        "--storage",
        store.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "export: {}", text(&o));
    let img = archive_entries(&archive).remove("checkpoint/inventory.img")?;
    // The inventory's magic (no common magic before it), then one entry: its size and the message.
    let msg = img.get(8..)?;
    let varint = |at: &mut usize| -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *msg.get(*at)?;
            *at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    };
    let mut at = 0;
    while at < msg.len() {
        let key = varint(&mut at)?;
        match key & 7 {
            0 if key >> 3 == 11 => return varint(&mut at),
            0 => drop(varint(&mut at)?),
            1 => at += 8,
            2 => at += usize::try_from(varint(&mut at)?).ok()?,
            5 => at += 4,
            _ => return None,
        }
    }
    None
}

/// `gpu-checkpoint checkpoint --container ID --tcp-established --format json`, with `extra`.
fn checkpoint_tcp(
    store: &std::path::Path,
    runc: &Runc,
    id: &str,
    extra: &[&str],
) -> std::process::Output {
    std::process::Command::new(gpu_checkpoint())
        .args(["checkpoint", "--container", id, "--tcp-established"])
        .args(["--format", "json"])
        .args(extra)
        .args(store_args(store, runc))
        .output()
        .unwrap()
}

/// `workload sockets --tcp-pair 1` in a container that joined a network namespace by path (its loopback
/// up, as CNI sets one up: runc restores a namespace of its own empty, without the loopback the
/// connection's addresses need): a client and a server in the container exchange a value chain over an
/// established loopback connection every tick, and the workload stops on any error of it (it never
/// reconnects). Checkpointed with `--tcp-established` (`extra` picks the path), the container stopped,
/// then restored: the chain goes on over the same connection (the same ports), without an error. With
/// `config`, the container names a CRIU configuration file of that text (`org.criu.config`); returns the
/// network lock method CRIU recorded.
fn a_connection_survives(
    tag: &str,
    extra: &[&str],
    dump: &str,
    config: Option<&str>,
) -> Option<u64> {
    let (ns, dir, store) = lab(tag)?;
    let runc = Runc::new(dir.path());
    let args = ["exec workload sockets --state /state/s --unix /tmp/u --tcp-pair 1"];
    let bundle = Bundle::new(&dir.path().join("bundle"), &args, &[]);
    bundle.join_netns(&ns);
    if let Some(text) = config {
        name_criu_config(&bundle, dir.path(), text);
    }
    let id = format!("gc-{}-{tag}", std::process::id());
    runc.run(&id, &bundle);
    let state = bundle.rootfs().join("state/s");
    let field = |key: &str| -> Option<u64> { field_u64(read_state(&state).ok()?.first()?, key) };
    wait_for("the TCP ping-pong", &|| {
        field("tcp_rounds").is_some_and(|r| r >= 3)
    });
    let (_, init) = runc.state(&id).unwrap();
    let conns = established(init);
    assert_eq!(conns.len(), 2, "both ends of the connection: {conns:?}");

    let gc = |args: &[&str]| {
        std::process::Command::new(gpu_checkpoint())
            .args(args)
            .args(store_args(&store, &runc))
            .output()
            .unwrap()
    };
    let o = checkpoint_tcp(&store, &runc, &id, extra);
    assert!(o.status.success(), "{tag}: checkpoint: {}", text(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["dump"], dump, "{out}");
    assert_eq!(out["container"]["tcp_established"], true, "{out}");
    assert_eq!(runc.state(&id), None, "{tag}: the container is deleted");
    let rounds = field("tcp_rounds").unwrap();
    let ck = out["id"].as_str().unwrap();
    let method = network_lock_method(&store, ck, dir.path());
    // The lock the direct dump left for the restore, recorded: in the container's namespace (joined by
    // path, it outlives the container). runc's own checkpoint is not ours to read.
    let storage = store.display().to_string();
    let ours = |args: &[&str]| {
        let o = std::process::Command::new(gpu_checkpoint())
            .args(args)
            .args(["--storage", &storage, "--format", "json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{tag}: {args:?}: {}", text(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let recorded = ours(&["inspect", ck])["metadata"]["kept_network_lock"].clone();
    if dump == "direct" && method != Some(SKIP) {
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(ns.path()).unwrap());
        assert_eq!(recorded["netns"], ino, "{tag}: {recorded}");
    } else {
        assert!(recorded.is_null(), "{tag}: {recorded}");
    }

    let o = gc(&["restore", out["id"].as_str().unwrap(), "--container", &id]);
    assert!(o.status.success(), "{tag}: restore: {}", text(&o));
    wait_for("the ping-pong over the restored connection", &|| {
        field("tcp_rounds").is_some_and(|r| r > rounds + 5)
    });
    let (_, init) = runc.state(&id).unwrap();
    assert_eq!(established(init), conns, "{tag}: the same connection");
    let rounds = field("tcp_rounds").unwrap();
    assert_eq!(field("errors"), Some(0), "{tag}");
    assert_eq!(field("tcp_value"), Some(chain(7, rounds)), "{tag}");
    // The restore unlocked the namespace (CRIU deletes the dump's nftables table by its run id).
    let locks = gpu_checkpoint::dump::criu_lock_tables(std::path::Path::new(&ns.path()));
    assert_eq!(locks.unwrap(), Vec::<String>::new(), "{tag}: a lock left");
    let none = if recorded.is_null() {
        "none-recorded"
    } else {
        "none-left"
    };
    let released = ours(&["release-network-lock", ck]);
    assert_eq!(released["outcome"], none, "{tag}: {released}");
    method
}

/// Writes a CRIU configuration file of `text` into `dir` and names it in the bundle's `org.criu.config`
/// annotation (runc reads it on its checkpoint and restore; so does the direct dump).
fn name_criu_config(bundle: &Bundle, dir: &std::path::Path, text: &str) {
    let file = dir.join("criu.conf");
    std::fs::write(&file, text).unwrap();
    let path = bundle.dir.join("config.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    spec["annotations"] = serde_json::json!({ "org.criu.config": file });
    std::fs::write(&path, serde_json::to_vec(&spec).unwrap()).unwrap();
}

/// CRIU's network lock method: iptables, what runc's RPC leaves to CRIU (which its restore unlocks with).
const IPTABLES: u64 = 0;
/// What our command line otherwise names (`NetworkLock::default_method`).
const NFTABLES: u64 = 1;
const SKIP: u64 = 2;

#[test]
fn an_established_connection_survives_the_direct_dump_with_tcp_established() {
    if let Some(m) = a_connection_survives("tcpd", &[], "direct", None) {
        assert_eq!(m, IPTABLES, "runc's method");
    }
}

#[test]
fn an_established_connection_survives_runcs_checkpoint_with_tcp_established() {
    if let Some(m) = a_connection_survives("tcpr", &["--runtime-checkpoint"], "runtime", None) {
        assert_eq!(m, IPTABLES, "CRIU's RPC default");
    }
}

/// [`a_connection_survives`] on both dump paths (the direct dump, container `TAGd`; runc's checkpoint,
/// `TAGr`) with CRIU configuration file `conf`: each path's name and lock method (none where skipped).
fn on_both_paths(tag: &str, conf: &str) -> Vec<(&'static str, u64)> {
    let mut methods = Vec::new();
    for (suffix, extra, dump) in [
        ("d", &[][..], "direct"),
        ("r", &["--runtime-checkpoint"][..], "runtime"),
    ] {
        if let Some(m) = a_connection_survives(&format!("{tag}{suffix}"), extra, dump, Some(conf)) {
            methods.push((dump, m));
        }
    }
    methods
}

/// A configuration file that names the lock method decides it on both paths: the direct dump's command
/// line must not override it (it did, with nftables: `--network-lock` on CRIU's command line wins over
/// its `--config` file).
#[test]
fn a_criu_configuration_file_names_the_network_lock_of_both_paths() {
    for (dump, m) in on_both_paths("tcpc", "network-lock skip\n") {
        assert_ne!(m, NFTABLES, "{dump}: our default overrode the file");
        assert_eq!(m, SKIP, "{dump}: the file's skip");
    }
}

/// A configuration file saying `network-lock nftables`: CRIU locks the container's namespace with a table
/// of its own on both paths, and the restore deletes it.
#[test]
fn an_established_connection_survives_a_dump_under_an_nftables_lock() {
    for (dump, m) in on_both_paths("tcpn", "network-lock nftables\n") {
        assert_eq!(m, NFTABLES, "{dump}: the file's nftables");
    }
}

/// Connects to `127.0.0.1:port` inside network namespace `ns` (from a thread that entered it: the socket
/// keeps its namespace wherever it is used), retrying until something listens.
fn connect_in(ns: &NetNs, port: u16) -> std::net::TcpStream {
    let path = ns.path();
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a descriptor we own; it changes only this thread's namespace.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => return s,
                Err(e) if std::time::Instant::now() > deadline => panic!("connect: {e}"),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        }
    })
    .join()
    .unwrap()
}

/// Sends `line` and reads back what the container's `cat` echoes.
fn echo(s: &mut std::io::BufReader<std::net::TcpStream>, line: &str) -> String {
    use std::io::{BufRead, Write};
    s.get_mut()
        .write_all(format!("{line}\n").as_bytes())
        .unwrap();
    let mut back = String::new();
    s.read_line(&mut back).unwrap();
    back.trim_end().to_string()
}

/// A peer outside the container, in the namespace it joined, connected to busybox `nc -l -e cat` in it:
/// checkpointed with `--tcp-established` (the container stopped), the peer writes while the container
/// is gone (CRIU's network lock drops the segments instead of the kernel resetting the connection), and
/// after the restore the echo of that line and of a new one come back over the same connection.
fn a_peer_outside_keeps_its_connection(tag: &str, extra: &[&str]) {
    use std::io::BufRead;
    let Some((ns, dir, store)) = lab(tag) else {
        return;
    };
    let (runc, id, mut peer, _bundle) = nc_container(dir.path(), &ns, tag, &[], None);
    let o = checkpoint_tcp(&store, &runc, &id, extra);
    assert!(o.status.success(), "{tag}: checkpoint: {}", text(&o));
    assert_eq!(runc.state(&id), None, "{tag}: the container is deleted");
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ckpt = out["id"].as_str().unwrap();
    // Written while nothing in the container holds the connection.
    std::io::Write::write_all(peer.get_mut(), b"during\n").unwrap();
    let o = std::process::Command::new(gpu_checkpoint())
        .args(["restore", ckpt, "--container", &id])
        .args(store_args(&store, &runc))
        .output()
        .unwrap();
    assert!(o.status.success(), "{tag}: restore: {}", text(&o));
    peer.get_ref()
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut back = String::new();
    peer.read_line(&mut back).unwrap();
    assert_eq!(
        back, "during\n",
        "{tag}: the line written while checkpointed"
    );
    assert_eq!(echo(&mut peer, "after"), "after", "{tag}");
}

/// A peer connected to busybox `nc -l -e cat` in a container that joined namespace `ns`, after the shell
/// commands `before` (run in the background), naming a CRIU configuration file of text `config`:
/// (runtime, container id, the peer's end, the bundle).
fn nc_container(
    dir: &std::path::Path,
    ns: &NetNs,
    tag: &str,
    before: &[&str],
    config: Option<&str>,
) -> (
    Runc,
    String,
    std::io::BufReader<std::net::TcpStream>,
    Bundle,
) {
    let runc = Runc::new(dir);
    let mut script = before.to_vec();
    script.push("exec nc -l -p 5000 -e cat");
    let bundle = Bundle::new(&dir.join("bundle"), &script, &[]);
    bundle.join_netns(ns);
    if let Some(text) = config {
        name_criu_config(&bundle, dir, text);
    }
    let id = format!("gc-{}-{tag}", std::process::id());
    runc.run(&id, &bundle);
    let mut peer = std::io::BufReader::new(connect_in(ns, 5000));
    assert_eq!(echo(&mut peer, "before"), "before");
    (runc, id, peer, bundle)
}

#[test]
fn a_peer_outside_the_container_keeps_its_connection_through_the_direct_dump() {
    a_peer_outside_keeps_its_connection("tcpod", &[]);
}

/// Through `--runtime-checkpoint` the outside peer loses its connection: the tool runs `runc checkpoint
/// --leave-running` (so that a failure resumes the container), with which CRIU takes the connections out of
/// repair mode and unlocks the namespace after the dump; the kill after the commit then closes them, and
/// the peer reads the end of the stream (FIN) while the container is gone. The tool says so on stderr
/// before it starts (a connection of the container whose other end is not in it).
#[test]
fn a_peer_outside_the_container_loses_its_connection_through_runcs_checkpoint_and_is_warned() {
    use std::io::Read;
    if !containers_ready() {
        return;
    }
    let Some(ns) = NetNs::add(&format!("gc-{}-tcpor", std::process::id())) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let (runc, id, mut peer, _bundle) = nc_container(dir.path(), &ns, "tcpor", &[], None);
    let o = checkpoint_tcp(&store, &runc, &id, &["--runtime-checkpoint"]);
    assert!(o.status.success(), "checkpoint: {}", text(&o));
    assert_eq!(runc.state(&id), None, "the container is deleted");
    peer.get_ref()
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut rest = Vec::new();
    let n = peer
        .read_to_end(&mut rest)
        .expect("the end of the stream, not a timeout");
    assert_eq!(n, 0, "the peer reads the end of the stream (FIN)");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("outside the container") && err.contains("will see it closed"),
        "the warning: {err}"
    );
}

/// A checkpoint with `--tcp-established` that fails after the direct dump (SIGTERM there: exit 10; SIGKILL
/// there: the guardian undoes it), in a
/// container running busybox `nc -l -e cat` for a peer outside it and `workload sockets --tcp-pair 1` (a
/// connection inside): CRIU left the paused container's processes stopped, their connections in repair
/// mode and the namespace locked (iptables), so that the kill after a commit would close nothing. The
/// undo releases them and resumes the container: it runs, none of its processes is stopped, nothing is
/// stored, the peer's line is echoed over the same connection, and the ping-pong inside goes on without
/// an error.
fn a_failed_checkpoint_keeps_the_connections(tag: &str, config: Option<&str>) {
    let Some((ns, dir, store)) = lab(tag) else {
        return;
    };
    let inside = "workload sockets --state /state/s --unix /tmp/u --tcp-pair 1 &";
    let (runc, id, mut peer, bundle) = nc_container(dir.path(), &ns, tag, &[inside], config);
    let state = bundle.rootfs().join("state/s");
    let rounds = || -> Option<u64> { field_u64(read_state(&state).ok()?.first()?, "tcp_rounds") };
    wait_for("the TCP ping-pong", &|| rounds().is_some_and(|r| r >= 3));
    for (action, code) in [("term", Some(10)), ("kill", None)] {
        let o = std::process::Command::new(gpu_checkpoint())
            .args(["checkpoint", "--container", &id, "--tcp-established"])
            .args(store_args(&store, &runc))
            .env(
                "GPU_CHECKPOINT_FAULT",
                format!("checkpoint.after-dump={action}"),
            )
            .output()
            .unwrap();
        assert_eq!(o.status.code(), code, "{tag}: {}", text(&o));
        // Killed, the tool leaves it to the guardian, which resumes the container a moment later.
        let stopped = || {
            runc.pids(&id).into_iter().any(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                stat.rsplit(") ").next().and_then(|s| s.chars().next()) == Some('T')
            })
        };
        wait_for("the container resumed", &|| {
            runc.state(&id).is_some_and(|(s, _)| s == "running") && !stopped()
        });
        peer.get_ref()
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        assert_eq!(
            echo(&mut peer, action),
            action,
            "{tag}: the peer's connection"
        );
        let locks = gpu_checkpoint::dump::criu_lock_tables(std::path::Path::new(&ns.path()));
        assert_eq!(
            locks.unwrap(),
            Vec::<String>::new(),
            "{tag} {action}: CRIU's nftables lock left in the namespace"
        );
        let r0 = rounds().unwrap();
        wait_for("the ping-pong inside going on", &|| {
            rounds().is_some_and(|r| r > r0 + 5)
        });
    }
    let stored = listed(&store);
    assert!(stored.is_empty(), "nothing stored: {stored:?}");
    let errors = field_u64(read_state(&state).unwrap().first().unwrap(), "errors");
    assert_eq!(errors, Some(0), "{tag}");
}

#[test]
fn a_failed_checkpoint_with_tcp_established_leaves_the_container_and_its_connections_working() {
    a_failed_checkpoint_keeps_the_connections("tcpf", None);
}

/// The same with a CRIU configuration file saying `network-lock nftables`: CRIU locks the container's
/// whole namespace with an nftables table of its own (`inet CRIU-<run id>`), which the undo deletes
/// there (it did not: the container ran on, its network dead).
#[test]
fn a_failed_checkpoint_under_an_nftables_lock_leaves_the_container_and_its_connections_working() {
    a_failed_checkpoint_keeps_the_connections("tcpfn", Some("network-lock nftables\n"));
}
