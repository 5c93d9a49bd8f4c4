//! Benchmark (not a timed test: run it explicitly; it prints figures and ratios measured in the same run):
//!
//!   cargo test -p gpu-checkpoint-cli --test cluster_bench -- --ignored --nocapture
//!
//! `CLUSTER_BENCH_MIB` sets each rank's size (default 64 MiB), `CLUSTER_BENCH_AGENTS` the agent counts
//! (default `1,2,4,8`), e.g. `CLUSTER_BENCH_MIB=512 CLUSTER_BENCH_AGENTS=8`; `CLUSTER_BENCH_RUNS` the
//! rounds (default 3), `CLUSTER_BENCH_MEMBER` extra arguments of every member's gpu-sim-workload,
//! `CLUSTER_BENCH_RESTORE=0` leaves the job restores out, `CLUSTER_BENCH_TLS=0` talks
//! to etcd in plaintext (default: TLS with client certificates and authentication, docs/cluster.md's
//! secure setup). `scripts/bench-cluster.sh` runs it at fleet scale (64 agents, 1 MiB members).
//!
//! It also counts the requests etcd answered per job checkpoint (from etcd's gRPC metrics: each unary
//! call, and each message on a stream, by method), for the whole fleet: the coordinator's, the
//! agents', and the agents' lease refreshes meanwhile.
//!
//! A job checkpoint (`--leave-running`, so that it can be repeated) of 1, 2, 4 and 8 agents on this
//! machine, one SIMULATED GPU rank each, against a plain `gpu-checkpoint checkpoint --leave-running` of one
//! such rank. Printed per size: the job's total (the command's wall time), the slowest member's own work
//! (its part less its waits at the barriers), the coordinator's etcd requests, the protocol's share
//! (total less the slowest member's work: etcd round trips, barrier waits, process start and connect), and
//! the job's time above the plain checkpoint (the others' per-node work shares this machine's 2 cores).
//! Then the job's last checkpoint restored (`job restore`, every rank killed before each round) against a
//! plain `gpu-checkpoint restore` of one rank: the job's total, its restore phase (every member restored,
//! GPU-locked), the coordinator's etcd requests, and the job's time above the plain restore.
//!
//! The protocol's share is then broken down (medians, ms): the command's start, connect and reads before
//! the operation (its wall time less the coordinator's own total), the coordinator's etcd requests, the
//! watch wake-ups (the last member's state write until the coordinator saw it, summed over the waits;
//! they include that write's round trip, also in the member's work, so the rest can be a little
//! negative), and the rest, itself broken down: the agents' task pick-up (the tasks' transaction to the
//! last member's agent picking its task up), the deliveries of `go` and of `commit` (each written until
//! the last member learnt of it), and what is left (the phases' slowest members differing, the members'
//! own finishing). Pick-up and deliveries are by the members' clocks against the coordinator's (one
//! machine here). Beside it, not part of it: the barrier skew (the first to the last member reaching each
//! state waited for, summed: members' work queueing on this machine's cores, inside the members' work)
//! and the slowest member's state writes (its etcd requests, inside its work).
#![cfg(feature = "cluster")]

mod cluster_support;
mod sim_support;

use cluster_support::*;
use sim_support::{criu_ready, wait_gone, SimProcess};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// `name`'s value, or `default` when it is not set.
fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn job_checkpoint_against_a_plain_checkpoint_for_1_2_4_8_agents() {
    let Some(bin) = etcd_bin() else { return };
    if !criu_ready() {
        return;
    }
    let runs: usize = env_or("CLUSTER_BENCH_RUNS", "3")
        .parse()
        .expect("CLUSTER_BENCH_RUNS");
    let with_restore = env_or("CLUSTER_BENCH_RESTORE", "1") != "0";
    let tls = env_or("CLUSTER_BENCH_TLS", "1") != "0";
    let mib = env_or("CLUSTER_BENCH_MIB", "64");
    let mib: u64 = mib.parse().expect("CLUSTER_BENCH_MIB: a number of MiB");
    let mib = mib.to_string();
    let sizes = env_or("CLUSTER_BENCH_AGENTS", "1,2,4,8");
    let sizes = sizes.split(',').map(|n| n.trim().parse::<usize>());
    let sizes: Vec<usize> = sizes
        .collect::<Result<_, _>>()
        .expect("CLUSTER_BENCH_AGENTS");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    // The baseline: one rank, checkpointed alone.
    // Each member: a SIMULATED GPU process of `mib` MiB, with CLUSTER_BENCH_MEMBER's extra arguments
    // (bench-cluster.sh: one worker with 20 ms kernels, so that 64 members leave the cores to the
    // agents and etcd).
    let extra = env_or("CLUSTER_BENCH_MEMBER", "");
    let member: Vec<&str> = ["--mib", mib.as_str()]
        .into_iter()
        .chain(extra.split_whitespace())
        .collect();
    let one = SimProcess::start(&member);
    let mut plain_id = String::new();
    let plain: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            let out = gc(&[
                "checkpoint",
                "--pid",
                &one.pid.to_string(),
                "--storage",
                store.to_str().unwrap(),
                "--gpu-backend",
                "sim",
                "--leave-running",
                "--format",
                "json",
            ]);
            let wall = t.elapsed().as_secs_f64() * 1000.0;
            assert!(out.status.success(), "{out:?}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            plain_id = v["id"].as_str().unwrap().to_string();
            wall
        })
        .collect();
    let plain = median(plain);
    println!("plain checkpoint of one {mib} MiB rank: {plain:.0} ms (median of {runs}, process start included)");
    let plain_restore = median(
        (0..runs)
            .map(|_| {
                kill(&[one.pid]);
                let t = Instant::now();
                let args = ["restore", &plain_id, "--storage", store.to_str().unwrap()];
                let out = gc(&[&args[..], &["--gpu-backend", "sim"]].concat());
                assert!(out.status.success(), "{out:?}");
                t.elapsed().as_secs_f64() * 1000.0
            })
            .collect(),
    );
    drop(one);
    println!("plain restore of one {mib} MiB rank: {plain_restore:.0} ms (median of {runs})");
    let (mut restores, mut breakdowns) = (Vec::new(), Vec::new());
    println!("agents | job total ms | slowest member's work | etcd ms (share) | protocol (share) | job - plain ms");
    for n in sizes {
        // A fresh etcd per round, in a folder of its own: one started on the last round's data would
        // find its `/ready` and be taken for another test's etcd.
        let round = dir.path().join(format!("etcd-{n}-agents"));
        gpu_checkpoint::util::create_private_dir_all(&round).unwrap();
        let etcd = if tls {
            Etcd::start_secure(&bin, &round)
        } else {
            Etcd::start(&bin, &round, 1)
        };
        let nodes: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
        let _agents: Vec<Agent> = nodes
            .iter()
            // Long leases: 8 agents dumping on a machine of 2 shared cores starve the lease refreshes of
            // a short one (the job then aborts, correctly, and there is nothing to measure).
            .map(|node| Agent::spawn(&etcd, node, &store, dir.path(), &[], "30s", &[]))
            .collect();
        let ranks: Vec<SimProcess> = (0..n).map(|_| SimProcess::start(&member)).collect();
        for (i, r) in ranks.iter().enumerate() {
            let (rank, pid) = (i.to_string(), r.pid.to_string());
            let args = ["--job", "bench", "--rank", &rank, "--pid", &pid];
            let out = job_add(dir.path(), &nodes[i], &args);
            assert!(out.status.success(), "{out:?}");
        }
        let (mut total, mut etcd_ms, mut work, mut phases) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // start, member etcd, watch wake-ups, barrier skew, task pick-up, go and commit delivery
        let mut parts: [Vec<f64>; 7] = Default::default();
        let mut id = String::new();
        let mut asked: Vec<std::collections::BTreeMap<String, f64>> = Vec::new();
        for _ in 0..runs {
            let before = etcd.requests();
            let (wall, m) = timed_job(&etcd, &["checkpoint", "--job", "bench", "--leave-running"]);
            let after = etcd.requests();
            asked.push(
                after
                    .iter()
                    .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
                    .filter(|(_, v)| *v > 0.0)
                    .collect(),
            );
            m["id"].as_str().unwrap().clone_into(&mut id);
            let tm = &m["timings_ms"];
            total.push(wall);
            etcd_ms.push(tm["etcd"].as_f64().unwrap());
            work.push(tm["member_work_max"].as_f64().unwrap());
            let f = |k: &str| tm[k].as_f64().unwrap();
            parts[0].push(wall - f("total"));
            parts[1].push(f("member_etcd_max"));
            parts[2].push(f("watch_wake"));
            parts[3].push(f("barrier_skew"));
            let or0 = |k: &str| tm[k].as_f64().unwrap_or(0.0);
            parts[4].push(or0("task_pickup"));
            parts[5].push(or0("go_delivery"));
            parts[6].push(or0("commit_delivery"));
            phases.push(format!(
                "prepare {:.0} checkpoint {:.0} commit {:.0} release {:.0}",
                f("prepare"),
                f("checkpoint"),
                f("commit"),
                f("release")
            ));
        }
        // The last job checkpoint, restored RUNS times (every rank killed before each; CRIU restores
        // each under its PID, so `ranks` kill the restored copies at the end too).
        print_requests(n, &asked);
        let pids: Vec<i32> = ranks.iter().map(|r| r.pid).collect();
        let (mut r_total, mut r_phase, mut r_etcd) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..if with_restore { runs } else { 0 } {
            kill(&pids);
            let (wall, m) = timed_job(&etcd, &["restore", &id]);
            r_total.push(wall);
            r_phase.push(m["timings_ms"]["checkpoint"].as_f64().unwrap());
            r_etcd.push(m["timings_ms"]["etcd"].as_f64().unwrap());
        }
        if with_restore {
            restores.push((n, median(r_total), median(r_phase), median(r_etcd)));
        }
        let (t, e, w) = (median(total), median(etcd_ms), median(work));
        let [start, member_etcd, wake, skew, pickup, go, commit] = parts.map(median);
        breakdowns.push((
            n,
            t,
            t - w,
            start,
            e,
            member_etcd,
            wake,
            skew,
            [pickup, go, commit],
        ));
        println!(
            "{n:>6} | {t:>12.0} | {w:>19.0} | {e:>7.1} ({:>4.1}%) | {:>10.0} ({:>4.1}%) | {:>14.0}   [{}]",
            100.0 * e / t,
            t - w,
            100.0 * (t - w) / t,
            t - plain,
            phases.last().unwrap()
        );
    }
    println!(
        "agents | protocol ms (share) = start + coordinator etcd + watch wake-ups + rest | \
         barrier skew (not protocol) | slowest member's etcd (in its work)"
    );
    let mut rests = Vec::new();
    for (n, t, p, start, e, member_etcd, wake, skew, rest_parts) in breakdowns {
        let share = |x: f64| 100.0 * x / t;
        let rest = p - start - e - wake;
        rests.push((n, t, rest, rest_parts));
        println!(
            "{n:>6} | {p:>5.0} ({:>4.1}%) = {start:>4.0} ({:>4.1}%) + {e:>5.1} ({:>4.1}%) + {wake:>4.0} ({:>4.1}%) \
             + {rest:>5.0} ({:>4.1}%) | {skew:>5.0} ({:>4.1}%) | {member_etcd:>5.1} ({:>4.1}%)",
            share(p),
            share(start),
            share(e),
            share(wake),
            share(rest),
            share(skew),
            share(member_etcd)
        );
    }
    println!(
        "agents | rest ms (share) = task pick-up + go delivery + commit delivery + other (slowest \
         members differing, members finishing)"
    );
    for (n, t, rest, [pickup, go, commit]) in rests {
        let share = |x: f64| 100.0 * x / t;
        let other = rest - pickup - go - commit;
        println!(
            "{n:>6} | {rest:>5.0} ({:>4.1}%) = {pickup:>4.0} ({:>4.1}%) + {go:>4.0} ({:>4.1}%) + \
             {commit:>4.0} ({:>4.1}%) + {other:>5.0} ({:>4.1}%)",
            share(rest),
            share(pickup),
            share(go),
            share(commit),
            share(other)
        );
    }
    println!("agents | job restore total ms | restore phase ms | etcd ms (share) | job - plain ms");
    for (n, t, p, e) in restores {
        println!(
            "{n:>6} | {t:>20.0} | {p:>16.0} | {e:>7.1} ({:>4.1}%) | {:>14.0}",
            100.0 * e / t,
            t - plain_restore
        );
    }
}

/// The etcd requests of each job checkpoint of `n` agents (medians over the rounds), by kind, and per
/// member.
fn print_requests(n: usize, rounds: &[std::collections::BTreeMap<String, f64>]) {
    let kinds: std::collections::BTreeSet<&String> = rounds.iter().flat_map(|r| r.keys()).collect();
    let med = |k: &str| {
        median(
            rounds
                .iter()
                .map(|r| r.get(k).copied().unwrap_or(0.0))
                .collect(),
        )
    };
    let total = median(rounds.iter().map(|r| r.values().sum()).collect());
    let parts: Vec<String> = kinds.iter().map(|k| format!("{k} {:.0}", med(k))).collect();
    println!(
        "{n:>6} agents: etcd requests per job checkpoint {total:.0} ({:.1} per member): {}",
        total / n as f64,
        parts.join(", ")
    );
}

/// `gpu-checkpoint job ARGS` (JSON, 30 s leases: see the agents'): its wall time in ms and its output.
fn timed_job(etcd: &Etcd, args: &[&str]) -> (f64, serde_json::Value) {
    let t = Instant::now();
    let tail = ["--format", "json", "--lease-ttl", "30s"];
    let etcd_args = etcd.client_args();
    let etcd_args: Vec<&str> = etcd_args.iter().map(String::as_str).collect();
    let out = gc(&[&["job"], args, &tail, &etcd_args].concat());
    let wall = t.elapsed().as_secs_f64() * 1000.0;
    assert!(out.status.success(), "{out:?}");
    (wall, serde_json::from_slice(&out.stdout).unwrap())
}

/// Kills `pids` and waits until they are gone (their PIDs free for a restore).
fn kill(pids: &[i32]) {
    for &p in pids {
        // SAFETY: killing processes this benchmark started (or restored).
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    wait_gone(pids);
}
