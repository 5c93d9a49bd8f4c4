//! Established TCP connections of a process tree with real CRIU and `--tcp-established`: they survive a
//! checkpoint and restore, and a checkpoint that fails after CRIU's dump (the tool's undo, or the
//! guardian's when the tool is killed) leaves them working. Needs root and CRIU: fails in CI without
//! them, skips locally with the reason.

mod common;

use std::path::Path;

use common::*;
use gpu_checkpoint_workloads::chain;

/// `workload sockets --tcp-pair 1` (an established loopback connection inside the process), ticking.
fn tcp_pair_workload(dir: &Path) -> Workload {
    let sock = dir.join("wl.sock");
    let w = Workload::start(
        "sockets",
        dir,
        &["--unix", sock.to_str().unwrap(), "--tcp-pair", "1"],
    );
    w.wait_state("ticking", |r| r.len() == 1 && num(&r[0], "tcp_rounds") >= 3);
    w
}

#[test]
fn established_tcp_connection_survives_with_tcp_established() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    let w = tcp_pair_workload(dir.path());
    let ck = checkpoint(w.pid, &store, &["--tcp-established"]);
    assert!(!w.alive());
    let before = gpu_checkpoint_workloads::read_state(&w.state).unwrap();
    let r0 = num(&before[0], "tcp_rounds");
    wait_pid_free(w.pid);
    assert_eq!(restore(ck["id"].as_str().unwrap(), &store), w.pid);
    let after = w.wait_state("the connection carrying on", |r| {
        num(&r[0], "tcp_rounds") > r0 + 5
    });
    assert_eq!(num(&after[0], "errors"), 0);
    assert_eq!(
        num(&after[0], "tcp_value"),
        chain(7, num(&after[0], "tcp_rounds"))
    );
}

/// A checkpoint with `--tcp-established` that fails after CRIU's dump (SIGTERM there: exit 10; the store
/// failing as it takes the staged images: exit 1): CRIU left the tree stopped with its connections in TCP repair mode and locked
/// (per connection: an nftables set, or iptables rules), and the undo releases them before continuing the
/// tree (the guardian does, when the tool is killed there): the established connection carries the
/// ping-pong both ways again, without an error.
#[test]
fn a_failed_checkpoint_with_tcp_established_leaves_the_connection_working() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    let w = tcp_pair_workload(dir.path());
    // (lock method, fault, exit code: None when killed, staged)
    let cells = [
        ("nftables", "checkpoint.after-dump=term", Some(10), false),
        ("nftables", "store.write=eio", Some(1), true),
        ("iptables", "checkpoint.after-dump=term", Some(10), false),
        ("nftables", "checkpoint.after-dump=kill", None, false),
        ("iptables", "checkpoint.after-dump=kill", None, false),
    ];
    for (lock, fault, code, staged) in cells {
        let mut args = vec!["--tcp-established", "--network-lock", lock];
        if staged {
            args.push("--staged");
        }
        fails_and_the_connection_goes_on(&w, &store, &args, fault, code);
        assert!(list_ids(&store).is_empty(), "{fault}: nothing listed");
    }
}

/// `workload sockets --tcp-pair 1` in a network namespace of its own (`unshare -n`, its loopback brought
/// up by `ip`), ticking: `None` (skipped with the reason; a failure in CI) without `unshare` or `ip`.
fn tcp_pair_workload_in_own_netns(dir: &Path) -> Option<Workload> {
    let state = dir.join("sockets.state");
    let script = format!(
        "ip link set lo up && exec {} sockets --state {} --detach --unix {} --tcp-pair 1",
        workload_bin().display(),
        state.display(),
        dir.join("wl.sock").display()
    );
    let out = std::process::Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        other => {
            let why = format!("unshare -n / ip link (util-linux, iproute2): {other:?}");
            assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "{why}");
            eprintln!("SKIPPED: {why}; run scripts/setup.sh as root");
            return None;
        }
    };
    let pid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let w = Workload { pid, state };
    w.wait_state("ticking", |r| r.len() == 1 && num(&r[0], "tcp_rounds") >= 3);
    Some(w)
}

/// A process tree in a network namespace of its own, checkpointed with `--tcp-established` under the
/// default nftables lock, failing after CRIU's dump (SIGTERM there: the tool's undo; SIGKILL there: the
/// guardian's): CRIU locked the whole namespace with a table of its own (`inet CRIU-<run id>`, its
/// chains dropping everything), which the undo deletes there before continuing the tree (it did not:
/// the tree ran on, its connection dead). The connection carries the ping-pong both ways again, no CRIU
/// table is left in the namespace, nothing is stored.
#[test]
fn a_failed_checkpoint_of_a_tree_in_its_own_network_namespace_leaves_the_connection_working() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    let Some(w) = tcp_pair_workload_in_own_netns(dir.path()) else {
        return;
    };
    let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", w.pid));
    for (fault, code) in [
        ("checkpoint.after-dump=term", Some(10)),
        ("checkpoint.after-dump=kill", None),
    ] {
        let args = ["--tcp-established", "--network-lock", "nftables"];
        fails_and_the_connection_goes_on(&w, &store, &args, fault, code);
        let locks = gpu_checkpoint::dump::criu_lock_tables(&netns).unwrap();
        assert_eq!(locks, Vec::<String>::new(), "{fault}: CRIU's lock left");
        assert!(list_ids(&store).is_empty(), "{fault}: nothing listed");
    }
}

/// A checkpoint of `w` with `args` that fails by `fault` (exit `code`; `None`: killed, and the guardian
/// undoes it): the tree runs again, not stopped, and its connection carries the ping-pong both ways
/// without an error.
fn fails_and_the_connection_goes_on(
    w: &Workload,
    store: &Path,
    args: &[&str],
    fault: &str,
    code: Option<i32>,
) {
    let out = run_checkpoint_env(w.pid, store, args, &[("GPU_CHECKPOINT_FAULT", fault)]);
    match code {
        Some(code) => drop(fails_with(&out, code)),
        None => {
            // The guardian releases the network and continues the tree.
            assert_eq!(out.status.code(), None, "{fault}: killed");
            w.wait_state("the guardian's continue", |_| !w.stopped());
        }
    }
    assert!(w.alive() && !w.stopped(), "{fault}: the tree runs");
    let r0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "tcp_rounds",
    );
    let after = w.wait_state("the connection carrying on", |r| {
        num(&r[0], "tcp_rounds") > r0 + 5 || !w.alive()
    });
    assert!(w.alive(), "{fault}: the workload ended on its connection");
    assert_eq!(num(&after[0], "errors"), 0, "{fault}: {after:?}");
    assert!(num(&after[0], "tcp_rounds") > r0 + 5, "{fault}: {after:?}");
    assert_eq!(
        num(&after[0], "tcp_value"),
        chain(7, num(&after[0], "tcp_rounds")),
        "{fault}"
    );
}

/// A checkpoint with `--tcp-established` that stops the tree keeps CRIU's network lock for the restore,
/// under either lock method: the manifest records it (this boot, the nftables table or the iptables
/// rules); a restore that fails before CRIU's (SIGTERM there: exit 10) says the lock is still in place,
/// what it drops and both remedies, and the lock is still there; `release-network-lock` deletes exactly
/// it, and a second one says there is nothing left to release; the checkpoint, whose connection has both
/// ends in it, still restores whole. A checkpoint that left no lock has nothing to release either.
#[test]
fn a_failed_restore_names_the_kept_network_lock_and_release_network_lock_lets_it_go() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    let storage = store.to_str().unwrap();
    let release = |id: &str| {
        let out = gc(&[
            "release-network-lock",
            id,
            "--storage",
            storage,
            "--format",
            "json",
        ]);
        let said: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
        said["outcome"].as_str().unwrap().to_string()
    };
    for lock in ["nftables", "iptables"] {
        let w = tcp_pair_workload(dir.path());
        let args = ["--tcp-established", "--network-lock", lock];
        let ck = checkpoint(w.pid, &store, &args);
        let id = ck["id"].as_str().unwrap().to_string();
        let _release = ReleaseIfFailed(&id, storage);
        let inspected = ok(&gc(&[
            "inspect",
            &id,
            "--storage",
            storage,
            "--format",
            "json",
        ]));
        let inspected: serde_json::Value = serde_json::from_str(&inspected).unwrap();
        let recorded = &inspected["metadata"]["kept_network_lock"];
        assert_eq!(
            &ck["kept_network_lock"], recorded,
            "checkpoint's JSON says it too"
        );
        assert_eq!(
            recorded["boot_id"].as_str(),
            Some(gpu_checkpoint::dump::boot_id().unwrap().as_str()),
            "{lock}: {recorded}"
        );
        let tables: Vec<String> = recorded["nft_tables"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        let rules = recorded["iptables_rules"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let held = || {
            let here =
                gpu_checkpoint::dump::criu_lock_tables(Path::new("/proc/self/ns/net")).unwrap();
            let rule_held = rules.iter().any(|r| {
                let args: Vec<&str> = r
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap())
                    .collect();
                let args: Vec<&str> = args
                    .iter()
                    .map(|a| if *a == "-I" { "-C" } else { a })
                    .collect();
                std::process::Command::new(args[0])
                    .args(&args[1..])
                    .output()
                    .unwrap()
                    .status
                    .success()
            });
            tables.iter().any(|t| here.contains(t)) || rule_held
        };
        match lock {
            "nftables" => assert_eq!(tables.len(), 1, "{recorded}"),
            _ => assert!(!rules.is_empty(), "{recorded}"),
        }
        assert!(held(), "{lock}: the lock is in place after the checkpoint");

        wait_pid_free(w.pid);
        let out = std::process::Command::new(gc_bin())
            .args(restore_args(&id, &store, &[]))
            .env("GPU_CHECKPOINT_FAULT", "restore.before-criu=term")
            .output()
            .unwrap();
        let said = fails_with(&out, 10);
        for words in [
            format!("checkpoint {id}'s network lock is still in place on this node"),
            "are dropped here until a restore succeeds".into(),
            format!("gpu-checkpoint restore {id} --storage {storage}"),
            format!("gpu-checkpoint release-network-lock {id} --storage {storage}"),
        ] {
            assert!(said.contains(&words), "{lock}: {words:?} in {said}");
        }
        if let Some(t) = tables.first() {
            assert!(
                said.contains(&format!("the nftables table inet {t}")),
                "{said}"
            );
        }
        assert!(held(), "{lock}: the failed restore kept the lock");

        assert_eq!(release(&id), "released", "{lock}");
        assert!(!held(), "{lock}: released");
        assert_eq!(
            release(&id),
            "none-left",
            "{lock}: nothing left the second time"
        );
        // Both ends of the connection are in the checkpoint: it restores whole without the lock.
        assert_eq!(restore(&id, &store), w.pid, "{lock}");
        let r0 = num(
            &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
            "tcp_rounds",
        );
        let after = w.wait_state("the connection carrying on", |r| {
            num(&r[0], "tcp_rounds") > r0 + 3
        });
        assert_eq!(num(&after[0], "errors"), 0, "{lock}: {after:?}");
        w.kill_and_wait_free();
    }
    // Nothing was recorded: a checkpoint without --tcp-established.
    let w = Workload::start("counter", dir.path(), &[]);
    w.wait_state("the counter ticking", |r| {
        r.len() == 1 && num(&r[0], "seq") >= 1
    });
    let id = checkpoint(w.pid, &store, &[])["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(release(&id), "none-recorded");
    let out = gc(&["release-network-lock", &id, "--storage", storage]);
    assert!(
        ok(&out).starts_with("nothing to release"),
        "{}",
        text(&out.stdout)
    );
}

/// Releases checkpoint `.0`'s network lock (in store `.1`) should the test fail before it did, so that no
/// lock is left on the node.
struct ReleaseIfFailed<'a>(&'a str, &'a str);

impl Drop for ReleaseIfFailed<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            gc(&["release-network-lock", self.0, "--storage", self.1]);
        }
    }
}
