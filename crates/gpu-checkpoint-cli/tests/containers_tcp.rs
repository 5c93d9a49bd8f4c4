//! An established TCP connection inside a real runc container, checkpointed with `--tcp-established`
//! (by our CRIU directly, and through `--runtime-checkpoint`), stopped and restored: the same connection
//! carries data both ways afterwards. Needs root, CRIU, runc, busybox-static and iproute2: fails in CI
//! without them, skips locally.

mod container_support;

use container_support::*;
use gpu_checkpoint_workloads::{chain, field_u64, read_state};

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

/// `workload sockets --tcp-pair 1` in a container that joined a network namespace by path (its loopback
/// up, as CNI sets one up: runc restores a namespace of its own empty, without the loopback the
/// connection's addresses need): a client and a server in the container exchange a value chain over an
/// established loopback connection every tick, and the workload stops on any error of it (it never
/// reconnects). Checkpointed with `--tcp-established` (`extra` picks the path), the container stopped,
/// then restored: the chain goes on over the same connection (the same ports), without an error.
fn a_connection_survives(tag: &str, extra: &[&str], dump: &str) {
    if !containers_ready() {
        return;
    }
    let Some(ns) = NetNs::add(&format!("gc-{}-{tag}", std::process::id())) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let runc = Runc::new(dir.path());
    let args = ["exec workload sockets --state /state/s --unix /tmp/u --tcp-pair 1"];
    let bundle = Bundle::new(&dir.path().join("bundle"), &args, &[]);
    bundle.join_netns(&ns);
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
    let mut ck = vec![
        "checkpoint",
        "--container",
        &id,
        "--tcp-established",
        "--format",
        "json",
    ];
    ck.extend_from_slice(extra);
    let o = gc(&ck);
    assert!(o.status.success(), "{tag}: checkpoint: {}", text(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["dump"], dump, "{out}");
    assert_eq!(out["container"]["tcp_established"], true, "{out}");
    assert_eq!(runc.state(&id), None, "{tag}: the container is deleted");
    let rounds = field("tcp_rounds").unwrap();

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
}

#[test]
fn an_established_connection_survives_the_direct_dump_with_tcp_established() {
    a_connection_survives("tcpd", &[], "direct");
}

#[test]
fn an_established_connection_survives_runcs_checkpoint_with_tcp_established() {
    a_connection_survives("tcpr", &["--runtime-checkpoint"], "runtime");
}
