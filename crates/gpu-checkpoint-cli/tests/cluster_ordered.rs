//! Ordered job checkpoints and restores, for jobs whose processes share CUDA IPC memory (driver r610
//! and later): `job checkpoint --ordered` locks the members one after the other in rank order, and
//! its restore restores and unlocks them in the same order. The SIMULATED ranks record their driver
//! calls in one file (`GPU_SIM_EVENT_FILE`), which the test reads back in order. Real etcd, 2 agents in
//! network namespaces, CRIU; needs root and iproute2: fails in CI without them, skips locally with
//! the reason.
#![cfg(feature = "cluster")]

mod cluster_support;
#[path = "cluster_support/scene.rs"]
mod scene;
mod sim_support;

use cluster_support::netns::{in_hub, job_add_on};
use scene::Scene;
use sim_support::{assert_healthy, text, wait_gone};

/// Four ranks whose kernels run longer the lower the rank (1.2 s for rank 0, 0.3 s for rank 3): a lock
/// waits for the kernel in flight, so locks started together finish in reverse rank order.
fn start() -> Option<Scene> {
    Scene::start(
        &[],
        |_| Vec::new(),
        |rank, _, _| {
            let kernel_us = ((4 - rank) * 300_000).to_string();
            ["--mib", "4", "--workers", "1", "--kernel-us", &kernel_us]
                .map(String::from)
                .to_vec()
        },
    )
}

/// Whether each of the 4 ranks' `call` began after the one before it was answered.
fn in_rank_order(events: &[(usize, String, String)], call: &str) -> bool {
    sim_support::in_rank_order(events, call, 4)
}

/// The job checkpoint `ordered` was taken with `--ordered`, `unordered` without: `job list` (text and
/// JSON), `job status` and the members' stores say which is which, and the stored copy of the ordered
/// one's manifest is version 2 (which a gpu-checkpoint that does not know about ordering refuses).
fn assert_recorded(s: &Scene, ordered: &str, unordered: &str) {
    let out = in_hub(&s.lab, &["job", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let list = String::from_utf8_lossy(&out.stdout).to_string();
    let line = |id: &str| {
        let found = list
            .lines()
            .find(|l| l.contains(&format!("checkpoint {id} ")));
        found
            .unwrap_or_else(|| panic!("{id} not in {list}"))
            .to_string()
    };
    assert!(line(ordered).ends_with(", ordered"), "{list}");
    assert!(!line(unordered).contains("ordered"), "{list}");
    let out = in_hub(&s.lab, &["job", "list", "--format", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = |id: &str| {
        let all = list["checkpoints"].as_array().unwrap();
        all.iter().find(|c| c["id"] == id).unwrap()["ordered"].clone()
    };
    assert_eq!(listed(ordered), true, "{list}");
    assert_eq!(listed(unordered), false, "{list}");
    for (id, is_ordered, version) in [(ordered, true, 2), (unordered, false, 1)] {
        let out = in_hub(&s.lab, &["job", "status", id]);
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(status["checkpoint"]["ordered"], is_ordered, "{status}");
        let kept = std::fs::read(s.store().join("jobs").join(format!("{id}.json"))).unwrap();
        let kept: serde_json::Value = serde_json::from_slice(&kept).unwrap();
        assert_eq!(kept["schema"], "gpu-checkpoint/cluster", "{kept}");
        assert_eq!(kept["schema_version"], version, "{kept}");
        assert_eq!(kept["ordered"], is_ordered, "{kept}");
    }
}

#[test]
fn an_ordered_job_checkpoint_locks_restores_and_unlocks_its_members_in_rank_order() {
    let Some(s) = start() else { return };
    let ckpt = ["job", "checkpoint", "--job", "train", "--lease-ttl", "10s"];
    // Without --ordered the members lock all at once: the control, showing that the order checked
    // below is the option's doing.
    let out = in_hub(&s.lab, &[&ckpt[..], &["--leave-running"]].concat());
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let unordered_id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let unordered = s.sim_events();
    assert!(!in_rank_order(&unordered, "LOCK"), "{unordered:?}");

    let out = in_hub(&s.lab, &[&ckpt[..], &["--ordered"]].concat());
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let ordered = s.sim_events()[unordered.len()..].to_vec();
    assert!(in_rank_order(&ordered, "LOCK"), "{ordered:?}");
    wait_gone(&s.pids());
    assert_recorded(&s, &id, &unordered_id);

    // The restore, not told, follows the checkpoint's recorded order: restored, then unlocked, rank
    // after rank.
    let seen = s.sim_events().len();
    let out = in_hub(&s.lab, &["job", "restore", &id, "--lease-ttl", "10s"]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let restore = s.sim_events()[seen..].to_vec();
    assert!(in_rank_order(&restore, "RESTORE"), "{restore:?}");
    assert!(in_rank_order(&restore, "UNLOCK"), "{restore:?}");
    assert_healthy(&s.pids());

    // One member registered again as sharing CUDA IPC memory (`job add --ordered`) makes the job's
    // checkpoints ordered without asking (`job list` says so); the one asked without is ordered too.
    let (pid, node) = (s.pids()[2].to_string(), scene::node_of(2));
    let add = ["--job", "train", "--rank", "2", "--pid", &pid, "--ordered"];
    let out = job_add_on(&s.lab, s.dir.path(), node, &add);
    assert!(out.status.success(), "{}", text(&out));
    let out = in_hub(&s.lab, &["job", "list"]);
    let list = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        list.lines()
            .any(|l| l.starts_with("job train: ") && l.ends_with(", ordered")),
        "{list}"
    );
    let seen = s.sim_events().len();
    let out = in_hub(&s.lab, &[&ckpt[..], &["--leave-running"]].concat());
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let locks = s.sim_events()[seen..].to_vec();
    assert!(in_rank_order(&locks, "LOCK"), "{locks:?}");
    assert_recorded(&s, &id, &unordered_id);
    assert_healthy(&s.pids());
}
