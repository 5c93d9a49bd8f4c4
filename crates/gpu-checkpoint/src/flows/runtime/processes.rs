//! The processes of a container, found from the host: every process whose cgroups (`/proc/PID/cgroup`)
//! and PID namespace are those of the container's init (the runtime's `state`). That works the same for
//! cgroup v1 and v2, and finds processes `exec`ed into the container, which are not children of its init.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;

use crate::detect::parse::parse_nspid;

/// One process of a container (the manifest keeps them).
pub use crate::flows::manifest::ContainerProcess as Member;

/// The processes sharing `init`'s cgroups and PID namespace, `init` first, then by host PID. Empty when
/// `init` is gone.
pub fn members(init: i32) -> Vec<Member> {
    members_in(std::path::Path::new("/proc"), init)
}

/// [`members`] over another /proc (tests).
fn members_in(proc_root: &std::path::Path, init: i32) -> Vec<Member> {
    let key = |pid: i32| -> Option<(String, (u64, u64))> {
        let dir = proc_root.join(pid.to_string());
        let cgroup = std::fs::read_to_string(dir.join("cgroup")).ok()?;
        let ns = std::fs::metadata(dir.join("ns/pid")).ok()?;
        Some((cgroup, (ns.dev(), ns.ino())))
    };
    let Some(want) = key(init) else {
        return Vec::new();
    };
    let mut found: BTreeMap<i32, Member> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if key(pid).as_ref() != Some(&want) {
            continue;
        }
        let status =
            std::fs::read(proc_root.join(pid.to_string()).join("status")).unwrap_or_default();
        let ns_pid = parse_nspid(&status).last().copied().unwrap_or(pid);
        found.insert(pid, Member { pid, ns_pid });
    }
    let mut out: Vec<Member> = found.remove(&init).into_iter().collect();
    out.extend(found.into_values());
    out
}

/// Old host PID → new host PID, through the PIDs inside the container (which CRIU restores exactly).
pub fn pid_map(before: &[Member], after: &[Member]) -> BTreeMap<i32, i32> {
    before
        .iter()
        .filter_map(|b| {
            after
                .iter()
                .find(|a| a.ns_pid == b.ns_pid)
                .map(|a| (b.pid, a.pid))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_a_member_of_its_own_group_and_maps_through_its_namespace_pid() {
        let me = std::process::id() as i32;
        let found = members(me);
        assert_eq!(found.first().map(|m| m.pid), Some(me), "init first");
        assert!(
            members(i32::MAX - 1).is_empty(),
            "a gone init has no members"
        );
        let before = [
            Member {
                pid: 100,
                ns_pid: 1,
            },
            Member {
                pid: 101,
                ns_pid: 7,
            },
        ];
        let after = [
            Member {
                pid: 900,
                ns_pid: 7,
            },
            Member {
                pid: 800,
                ns_pid: 1,
            },
        ];
        let map = pid_map(&before, &after);
        assert_eq!(map.get(&100), Some(&800));
        assert_eq!(map.get(&101), Some(&900));
        assert_eq!(
            pid_map(&before, &after[..1]).len(),
            1,
            "a process gone is not mapped"
        );
    }
}
