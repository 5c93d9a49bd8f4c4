//! Where a job restore puts each member: on the node `--node-map` names for its node, else on its own
//! node while that node has an agent, else on a node chosen for it from the agents registered now.
//!
//! A node is chosen for the members of a node that has no agent (a machine gone, drained or replaced)
//! so that `job restore ID` brings the job back without the user looking up which machines are free:
//! the chosen agent must restore no other member (two nodes' members on one node would compete for its
//! GPUs, which the user can still ask for with `--node-map`), use the store the member checkpoints are
//! in (recorded per member at checkpoint time), and have, for every GPU the node's members used, a GPU
//! of the same model. Of those, the one with the fewest GPUs is taken (the best fit, so that larger
//! nodes stay free for larger members), then by name. Its device map sends each used GPU to one of its
//! own: the same UUID where it has it, else its lowest-indexed free GPU of the model. The restore on
//! that node then checks memory sizes as any restore with a device map does.
//!
//! Checkpoints taken before the records carried models and stores (older tools) are placed by GPU
//! count alone, on any store.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::{AgentRecord, ClusterError, JobManifest};
use crate::freeze::{GpuInfo, GpuUuid};

/// The nodes a job checkpoint's members are restored on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Placement {
    /// Every node of the job checkpoint, and the node its members are restored on.
    pub nodes: BTreeMap<String, String>,
    /// The device maps of the chosen nodes (`OLD=NEW,...` by UUID), by the node restored on.
    pub device_maps: BTreeMap<String, String>,
    /// The nodes chosen (neither given nor kept), in the order of their first member's rank.
    pub chosen: Vec<Chosen>,
}

/// A node chosen for the members of a node that has no agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chosen {
    /// The node the members were checkpointed on.
    pub from: String,
    /// The node they are restored on.
    pub to: String,
    /// Their GPUs onto the chosen node's (none when they used no GPU).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_map: Option<String>,
}

/// The models of `uuids` among `gpus`, in order; empty unless every one is found.
pub fn models_of(uuids: &[String], gpus: &[GpuInfo]) -> Vec<String> {
    let models: Option<Vec<String>> = uuids
        .iter()
        .map(|u| {
            let u: GpuUuid = u.parse().ok()?;
            gpus.iter().find(|g| g.uuid == u).map(|g| g.model.clone())
        })
        .collect();
    models.unwrap_or_default()
}

/// What the members of one node need of the node they are restored on.
#[derive(Debug)]
struct Need {
    node: String,
    /// Each GPU the node's members used (first seen first), with its model when recorded.
    gpus: Vec<(GpuUuid, Option<String>)>,
    /// The store the member checkpoints are in, when recorded.
    storage: Option<String>,
}

impl Need {
    fn of(manifest: &JobManifest, node: &str) -> Need {
        let mut gpus: Vec<(GpuUuid, Option<String>)> = Vec::new();
        let mut storage = None;
        for m in manifest.members.iter().filter(|m| m.node == node) {
            storage = storage.or_else(|| m.storage.clone());
            for (i, u) in m.gpus.iter().enumerate() {
                // A UUID that does not parse cannot be mapped: such a member is restored only where
                // it was or where the user sends it.
                let Ok(u) = u.parse::<GpuUuid>() else {
                    continue;
                };
                if !gpus.iter().any(|(g, _)| *g == u) {
                    gpus.push((u, m.gpu_models.get(i).cloned()));
                }
            }
        }
        Need {
            node: node.to_string(),
            gpus,
            storage,
        }
    }

    /// The GPU pairs onto `agent`'s GPUs, or why it cannot take these members.
    fn fit(&self, agent: &AgentRecord) -> Result<Vec<(GpuUuid, GpuUuid)>, String> {
        if let Some(s) = self.storage.as_deref().filter(|s| *s != agent.storage) {
            return Err(format!(
                "its store is {}, the member checkpoints are in {s}",
                agent.storage
            ));
        }
        let mut free: Vec<&GpuInfo> = agent.gpus.iter().collect();
        free.sort_by_key(|g| g.index);
        let model_ok =
            |want: &Option<String>, g: &GpuInfo| want.as_ref().is_none_or(|m| *m == g.model);
        let mut pairs: Vec<Option<(GpuUuid, GpuUuid)>> = vec![None; self.gpus.len()];
        // The same GPU first (a node that was only renamed, or the simulator's fixed UUIDs), then the
        // lowest-indexed free GPU of the model.
        for (slot, (old, want)) in pairs.iter_mut().zip(&self.gpus) {
            if let Some(at) = free
                .iter()
                .position(|g| g.uuid == *old && model_ok(want, g))
            {
                *slot = Some((*old, free.remove(at).uuid));
            }
        }
        for (slot, (old, want)) in pairs.iter_mut().zip(&self.gpus) {
            if slot.is_none() {
                if let Some(at) = free.iter().position(|g| model_ok(want, g)) {
                    *slot = Some((*old, free.remove(at).uuid));
                }
            }
        }
        pairs
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                if agent.gpus.is_empty() {
                    return format!("it lists no GPU, the members used {}", self.gpus.len());
                }
                let wanted: BTreeSet<String> = self
                    .gpus
                    .iter()
                    .map(|(_, m)| m.clone().unwrap_or_else(|| "any model".into()))
                    .collect();
                format!(
                    "it has {} GPU(s) ({}), the members used {} ({})",
                    agent.gpus.len(),
                    agent
                        .gpus
                        .iter()
                        .map(|g| g.model.as_str())
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.gpus.len(),
                    wanted.into_iter().collect::<Vec<_>>().join(", ")
                )
            })
    }
}

/// Places the members of `manifest` on the agents `agents` (those registered now), `given` naming
/// nodes for some nodes (`--node-map`). Fails, before anything is touched, when a node has no agent and
/// none can be chosen, saying why each agent was not.
pub fn place(
    manifest: &JobManifest,
    given: &BTreeMap<String, String>,
    agents: &[AgentRecord],
) -> Result<Placement, ClusterError> {
    let mut nodes_in_order: Vec<&str> = Vec::new();
    let mut ranks = manifest.members.iter().collect::<Vec<_>>();
    ranks.sort_by_key(|m| m.rank);
    for m in ranks {
        if !nodes_in_order.contains(&m.node.as_str()) {
            nodes_in_order.push(&m.node);
        }
    }
    let alive = |node: &str| agents.iter().any(|a| a.node == node);
    let mut placement = Placement::default();
    let mut open = Vec::new();
    for node in &nodes_in_order {
        match given.get(*node) {
            Some(to) => {
                placement.nodes.insert(node.to_string(), to.clone());
            }
            None if alive(node) => {
                placement.nodes.insert(node.to_string(), node.to_string());
            }
            None => open.push(*node),
        }
    }
    for node in open {
        let need = Need::of(manifest, node);
        let taken: BTreeSet<&String> = placement.nodes.values().collect();
        let mut candidates: Vec<&AgentRecord> = agents.iter().collect();
        candidates.sort_by(|a, b| (a.gpus.len(), &a.node).cmp(&(b.gpus.len(), &b.node)));
        let mut refused = Vec::new();
        let mut found = None;
        for agent in candidates {
            if taken.contains(&agent.node) {
                refused.push(format!("{}: other members are restored there", agent.node));
                continue;
            }
            match need.fit(agent) {
                Ok(pairs) => {
                    found = Some((agent, pairs));
                    break;
                }
                Err(why) => refused.push(format!("{}: {why}", agent.node)),
            }
        }
        let Some((agent, pairs)) = found else {
            let why = if refused.is_empty() {
                "no agent is registered".to_string()
            } else {
                refused.join("; ")
            };
            return Err(ClusterError::NoPlacement {
                node: need.node,
                why,
            });
        };
        let device_map = (!pairs.is_empty()).then(|| {
            pairs
                .iter()
                .map(|(old, new)| format!("{old}={new}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        if let Some(map) = &device_map {
            placement
                .device_maps
                .insert(agent.node.clone(), map.clone());
        }
        placement.nodes.insert(node.to_string(), agent.node.clone());
        placement.chosen.push(Chosen {
            from: node.to_string(),
            to: agent.node.clone(),
            device_map,
        });
    }
    Ok(placement)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::cluster::records::{Cut, JobMember};
    use crate::flows::cluster::JobTimings;

    fn uuid(i: u8) -> GpuUuid {
        GpuUuid([i; 16])
    }

    fn gpu(index: u32, id: u8, model: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid(id),
            model: model.into(),
            memory_bytes: None,
        }
    }

    fn agent(node: &str, storage: &str, gpus: Vec<GpuInfo>) -> AgentRecord {
        AgentRecord {
            node: node.into(),
            pid: 1,
            storage: storage.into(),
            tool_version: "t".into(),
            started_unix_ms: 0,
            gpus,
        }
    }

    fn member(rank: u32, node: &str, gpus: &[(u8, &str)], storage: Option<&str>) -> JobMember {
        JobMember {
            rank,
            node: node.into(),
            pid: Some(100 + rank as i32),
            checkpoint: format!("c{rank}"),
            gpus: gpus.iter().map(|(u, _)| uuid(*u).to_string()).collect(),
            gpu_models: gpus.iter().map(|(_, m)| m.to_string()).collect(),
            storage: storage.map(String::from),
        }
    }

    fn manifest(members: Vec<JobMember>) -> JobManifest {
        JobManifest {
            id: "j-1".into(),
            job: "j".into(),
            leave_running: false,
            ordered: false,
            members,
            cut: Cut {
                started_unix_ms: 0,
                locked_unix_ms: 0,
                committed_unix_ms: 0,
            },
            timings_ms: JobTimings::default(),
        }
    }

    const H: &str = "H100";

    #[test]
    fn members_stay_on_their_nodes_or_go_where_the_map_says() {
        let m = manifest(vec![
            member(0, "a", &[(1, H)], Some("/s")),
            member(1, "b", &[(2, H)], Some("/s")),
        ]);
        let agents = [agent("a", "/s", vec![]), agent("b", "/s", vec![])];
        let p = place(&m, &BTreeMap::new(), &agents).unwrap();
        assert_eq!(p.nodes["a"], "a");
        assert_eq!(p.nodes["b"], "b");
        assert!(p.chosen.is_empty() && p.device_maps.is_empty());
        let given = BTreeMap::from([("a".to_string(), "b".to_string())]);
        let p = place(&m, &given, &agents).unwrap();
        assert_eq!(p.nodes["a"], "b");
        assert!(p.chosen.is_empty());
    }

    #[test]
    fn a_node_without_agent_gets_the_smallest_free_agent_with_its_store_and_gpu_models() {
        // b's two members used GPUs 2 and 3 (H100s) and the store /s; b has no agent now.
        let m = manifest(vec![
            member(0, "a", &[(1, H)], Some("/s")),
            member(1, "b", &[(2, H)], Some("/s")),
            member(2, "b", &[(3, H), (2, H)], Some("/s")),
        ]);
        let agents = [
            agent("a", "/s", vec![gpu(0, 1, H), gpu(1, 9, H)]),
            agent(
                "big",
                "/s",
                (0..8).map(|i| gpu(i, 20 + i as u8, H)).collect(),
            ),
            agent("other-store", "/t", vec![gpu(0, 30, H), gpu(1, 31, H)]),
            agent(
                "wrong-model",
                "/s",
                vec![gpu(0, 40, "A100"), gpu(1, 41, "A100")],
            ),
            agent("one", "/s", vec![gpu(0, 50, H)]),
            agent(
                "fits",
                "/s",
                vec![gpu(1, 61, H), gpu(0, 60, H), gpu(2, 62, H)],
            ),
        ];
        let p = place(&m, &BTreeMap::new(), &agents).unwrap();
        assert_eq!(p.nodes["a"], "a");
        assert_eq!(p.nodes["b"], "fits");
        // Each used GPU onto one of its own, by index.
        let map = format!("{}={},{}={}", uuid(2), uuid(60), uuid(3), uuid(61));
        assert_eq!(p.device_maps["fits"], map);
        assert_eq!(
            p.chosen,
            vec![Chosen {
                from: "b".into(),
                to: "fits".into(),
                device_map: Some(map.clone()),
            }]
        );
        // The map is one `restore --device-map` reads.
        assert_eq!(map.parse::<crate::freeze::DeviceMap>().unwrap().0.len(), 2);
    }

    #[test]
    fn the_same_gpu_is_kept_where_the_chosen_node_has_it() {
        let m = manifest(vec![member(0, "gone", &[(7, H)], None)]);
        let agents = [agent("new", "/s", vec![gpu(0, 5, H), gpu(1, 7, H)])];
        let p = place(&m, &BTreeMap::new(), &agents).unwrap();
        assert_eq!(p.device_maps["new"], format!("{}={}", uuid(7), uuid(7)));
    }

    #[test]
    fn no_fitting_agent_is_refused_with_each_agents_reason() {
        let m = manifest(vec![
            member(0, "a", &[(1, H)], Some("/s")),
            member(1, "b", &[(2, H), (3, H)], Some("/s")),
        ]);
        let agents = [
            agent("a", "/s", vec![gpu(0, 1, H), gpu(1, 2, H), gpu(2, 3, H)]),
            agent("c", "/t", vec![gpu(0, 4, H), gpu(1, 5, H)]),
            agent("d", "/s", vec![gpu(0, 6, H)]),
            agent("e", "/s", vec![gpu(0, 7, "A100"), gpu(1, 8, "A100")]),
        ];
        let e = place(&m, &BTreeMap::new(), &agents).unwrap_err();
        let text = e.to_string();
        for part in [
            "node b has no agent",
            "a: other members are restored there",
            "c: its store is /t, the member checkpoints are in /s",
            "d: it has 1 GPU(s) (H100), the members used 2 (H100)",
            "e: it has 2 GPU(s) (A100), the members used 2 (H100)",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::Conflict
        );
        let none = place(&m, &BTreeMap::new(), &[]).unwrap_err();
        assert!(
            none.to_string().contains("no agent is registered"),
            "{none}"
        );
    }

    #[test]
    fn two_nodes_without_agents_never_share_a_chosen_node_and_cpu_members_need_no_gpu() {
        let m = manifest(vec![
            member(0, "x", &[(1, H)], None),
            member(1, "y", &[], None),
        ]);
        let agents = [
            agent("p", "/s", vec![gpu(0, 9, H)]),
            agent("q", "/s", vec![]),
        ];
        let p = place(&m, &BTreeMap::new(), &agents).unwrap();
        assert_eq!(p.nodes["x"], "p");
        assert_eq!(p.nodes["y"], "q");
        assert_eq!(p.chosen[1].device_map, None);
        // Older records (no models, no store): placed by count on any store.
        let mut old = member(0, "x", &[(1, H)], None);
        old.gpu_models.clear();
        let p = place(&manifest(vec![old]), &BTreeMap::new(), &agents[..1]).unwrap();
        assert_eq!(p.nodes["x"], "p");
    }

    #[test]
    fn models_are_known_only_when_every_gpu_is_listed() {
        let gpus = [gpu(0, 1, H), gpu(1, 2, "A100")];
        let ids = |v: &[u8]| v.iter().map(|i| uuid(*i).to_string()).collect::<Vec<_>>();
        assert_eq!(models_of(&ids(&[2, 1]), &gpus), ["A100", H]);
        assert!(models_of(&ids(&[1, 3]), &gpus).is_empty());
        assert!(models_of(&["junk".into()], &gpus).is_empty());
    }
}
