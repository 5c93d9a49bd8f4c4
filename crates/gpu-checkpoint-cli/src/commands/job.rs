//! `gpu-checkpoint job`: the coordinator's side of a multi-node job: register members, checkpoint and
//! restore the job consistently through etcd, list jobs and their checkpoints, show one's status.

use std::sync::Arc;
use std::time::Duration;

use gpu_checkpoint::flows::cluster::{
    self, job, Coordinator, EtcdCoordinator, JobCheckpointOptions, PeriodicOptions, Registration,
    Round, Timeouts,
};
use serde_json::json;
use std::sync::atomic::Ordering;

use super::cuda::{parse_timeout, Timeout};
pub use super::etcd_args::EtcdArgs;
use super::Format;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Register a member of a job: a process tree (or container) on this node, with its rank, through
    /// this node's agent (run it on the member's node).
    Add(AddArgs),
    /// Checkpoint every member of a job with a consistent cut; prints the job checkpoint's id.
    Checkpoint(CheckpointArgs),
    /// Restore every member of a job checkpoint, on the same nodes or others (--node-map).
    Restore(RestoreArgs),
    /// The jobs, their members, the registered agents and the job checkpoints.
    List(ListArgs),
    /// One job checkpoint's manifest (members, cut, timings), or a job's operations under way.
    Status(StatusArgs),
    /// Delete a job checkpoint: from etcd, and its member checkpoints from the stores (by the agents).
    Delete(DeleteArgs),
}

#[derive(clap::Args)]
pub struct AddArgs {
    #[arg(long)]
    pub job: String,
    #[arg(long)]
    pub rank: u32,
    /// The node (checked against the agent's: this command registers members of its own node only).
    #[arg(long)]
    pub node: Option<String>,
    /// The member's process tree (its root) on its node.
    #[arg(long, required_unless_present = "container", conflicts_with = "container", value_parser = clap::value_parser!(i32).range(1..))]
    pub pid: Option<i32>,
    /// Or its container (its id in the runtime of the node's agent, `agent --runtime`): the agent
    /// checkpoints and restores it with the container flow.
    #[arg(long)]
    pub container: Option<String>,
    /// The member's processes share CUDA IPC memory with other members' (driver r610 and later): every
    /// checkpoint of the job locks its members in rank order (as `job checkpoint --ordered`), and
    /// restores in that order.
    #[arg(long)]
    pub ordered: bool,
    /// The node's agent's socket (`agent --socket`).
    #[arg(long, value_name = "PATH", env = "GPU_CHECKPOINT_AGENT_SOCKET", default_value = gpu_checkpoint::flows::cluster::DEFAULT_SOCKET)]
    pub agent_socket: std::path::PathBuf,
}

#[derive(clap::Args)]
pub struct CheckpointArgs {
    #[arg(long)]
    pub job: String,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Keep every member running after the checkpoint (default: stop them once the job is committed).
    #[arg(long)]
    pub leave_running: bool,
    /// How long locking a member's CUDA processes may wait for their GPU work (0: no limit); any
    /// member's timeout aborts the job.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    pub lock_timeout: Timeout,
    /// The quiesce hook each agent runs before locking its member (one of those its node's agent was
    /// started with, `agent --quiesce-hook NAME=PROGRAM`): how the application reaches a collective
    /// boundary. A name: nothing executable goes through etcd.
    #[arg(long, value_name = "NAME")]
    pub quiesce: Option<String>,
    /// Lock the members one after the other in rank order, and restore and unlock this checkpoint in
    /// the same order later: jobs whose processes share CUDA IPC memory (driver r610 and later).
    #[arg(long)]
    pub ordered: bool,
    /// How long the whole prepare phase (every member locked) may take.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    pub prepare_timeout: Duration,
    /// The coordinator's etcd lease: how long after this command dies the members undo their part.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// Checkpoint the job periodically (30m, 2h, ...), each round a job checkpoint with
    /// --leave-running (implied), until SIGTERM or SIGINT; a failed round is reported, the next runs.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub every: Option<Duration>,
    /// With --every: after each round delete the job's checkpoints beyond the newest N.
    #[arg(long, value_name = "N", requires = "every", value_parser = clap::value_parser!(u32).range(1..))]
    pub keep: Option<u32>,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(clap::Args)]
pub struct DeleteArgs {
    /// The job checkpoint's id.
    pub id: String,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
}

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// The job checkpoint's id (as `job checkpoint` printed it).
    pub id: String,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Restore members on other nodes: OLD=NEW,... (nodes not named keep theirs; a node not named
    /// whose agent is gone gets a free agent with its GPUs' models and store, said on stderr).
    #[arg(long, value_name = "OLD=NEW,...")]
    pub node_map: Option<String>,
    /// Restore the GPU state of the members restored on NODE onto other GPUs of it, as `restore
    /// --device-map` (indices or GPU-... UUIDs); once per node.
    #[arg(long, value_name = "NODE:OLD=NEW,...")]
    pub device_map: Vec<String>,
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(clap::Args)]
pub struct ListArgs {
    /// Only this job's checkpoints.
    #[arg(long)]
    pub job: Option<String>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(clap::Args)]
pub struct StatusArgs {
    /// A job checkpoint's id, or a job's name (its operations under way and its newest checkpoint).
    pub target: String,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

pub fn run(cmd: Command) -> super::Result<()> {
    match cmd {
        Command::Add(a) => add(a),
        Command::Checkpoint(a) => checkpoint(a),
        Command::Restore(a) => restore(a),
        Command::List(a) => list(a),
        Command::Status(a) => status(a),
        Command::Delete(a) => delete(a),
    }
}

fn add(a: AddArgs) -> super::Result<()> {
    let reg = Registration {
        job: a.job,
        rank: a.rank,
        pid: a.pid,
        container: a.container,
        ordered: a.ordered,
        node: a.node,
    };
    let node = cluster::register_member(&a.agent_socket, &reg)?;
    eprintln!(
        "job {}: rank {} on node {node} registered{}",
        reg.job,
        reg.rank,
        if reg.ordered {
            " (ordered: the job's checkpoints go in rank order)"
        } else {
            ""
        }
    );
    Ok(())
}

fn checkpoint(a: CheckpointArgs) -> super::Result<()> {
    let opts = JobCheckpointOptions {
        job: a.job,
        leave_running: a.leave_running,
        lock_timeout: a.lock_timeout.0,
        quiesce: a.quiesce,
        ordered: a.ordered,
        timeouts: Timeouts {
            lease_ttl: a.lease_ttl,
            prepare: a.prepare_timeout,
            ..Timeouts::default()
        },
    };
    opts.check()?;
    let coord = a.etcd.connect()?;
    if let Some(every) = a.every {
        return periodic(coord, opts, every, a.keep, a.format);
    }
    let m = cluster::checkpoint_job(coord as Arc<dyn Coordinator>, &opts)?;
    match a.format {
        Format::Json => super::print_json(&m)?,
        Format::Text => {
            println!("{}", m.id);
            let t = &m.timings_ms;
            eprintln!(
                "job {}: {} members checkpointed with one cut: prepare {:.0} ms, checkpoint {:.0} ms, commit {:.0} ms, release {:.0} ms; total {:.0} ms (etcd {:.0} ms)",
                m.job, m.members.len(), t.prepare, t.checkpoint, t.commit, t.release, t.total, t.etcd
            );
        }
    }
    Ok(())
}

/// `job checkpoint --every`: rounds until SIGTERM or SIGINT. Each committed round prints its id (or,
/// with --format json, its manifest on one line); failures and retention go to stderr.
fn periodic(
    coord: Arc<EtcdCoordinator>,
    opts: JobCheckpointOptions,
    every: Duration,
    keep: Option<u32>,
    format: Format,
) -> super::Result<()> {
    let _signals = gpu_checkpoint::interrupt::InterruptGuard::new();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let popts = PeriodicOptions {
        checkpoint: opts,
        every,
        keep: keep.map(|k| k as usize),
    };
    let mut failed = 0u64;
    std::thread::scope(|s| {
        let stop = &stop;
        let watcher = s.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if gpu_checkpoint::interrupt::interrupted() {
                    stop.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let mut report = |round: u64, r: Round| {
            match r {
            Round::Committed(m) => {
                match format {
                    Format::Json => println!("{}", serde_json::to_string(&m).unwrap_or_default()),
                    Format::Text => println!("{}", m.id),
                }
                eprintln!(
                    "round {round}: job checkpoint {} committed in {:.0} ms",
                    m.id, m.timings_ms.total
                );
            }
            Round::Failed(e) => {
                failed += 1;
                eprintln!("round {round} failed (the next round still runs): {e}");
            }
            Round::Retention(Ok(d)) if d.left.is_empty() => {
                eprintln!("round {round}: retention deleted job checkpoint {}", d.id)
            }
            Round::Retention(Ok(d)) => eprintln!(
                "round {round}: job checkpoint {} deleted, but member checkpoints are left (retried next round):{}",
                d.id,
                d.left.iter().map(|l| format!("\n  - {l}")).collect::<String>()
            ),
            Round::Retention(Err(e)) => eprintln!("round {round}: retention: {e}"),
        }
        };
        cluster::run_periodic(coord as Arc<dyn Coordinator>, &popts, stop, &mut report);
        stop.store(true, Ordering::SeqCst);
        let _ = watcher.join();
    });
    if let Some(sig) = gpu_checkpoint::interrupt::last_signal() {
        eprintln!("job checkpoint --every: {sig}: stopped ({failed} failed rounds)");
    }
    Ok(())
}

fn delete(a: DeleteArgs) -> super::Result<()> {
    let coord = a.etcd.connect()?;
    let timeouts = Timeouts {
        lease_ttl: a.lease_ttl,
        ..Timeouts::default()
    };
    let d = cluster::delete_job_checkpoint(coord as Arc<dyn Coordinator>, &a.id, &timeouts)?;
    if d.left.is_empty() {
        eprintln!(
            "job checkpoint {} deleted, with its member checkpoints",
            d.id
        );
    } else {
        // The job checkpoint is gone; what is left stays in etcd's trash, retried by the next delete
        // or retention round of the job.
        eprintln!(
            "job checkpoint {} deleted; member checkpoints left for a later delete:{}",
            d.id,
            d.left
                .iter()
                .map(|l| format!("\n  - {l}"))
                .collect::<String>()
        );
    }
    Ok(())
}

fn restore(a: RestoreArgs) -> super::Result<()> {
    let coord = a.etcd.connect()?;
    let map = cluster::parse_node_map(a.node_map.as_deref().unwrap_or(""))?;
    let device_maps = cluster::parse_device_maps(&a.device_map)?;
    let timeouts = Timeouts {
        lease_ttl: a.lease_ttl,
        ..Timeouts::default()
    };
    let out = cluster::restore_job(
        coord as Arc<dyn Coordinator>,
        &a.id,
        &map,
        &device_maps,
        &timeouts,
    )?;
    for p in &out.placed {
        eprintln!(
            "node {} has no agent: its members were restored on {}{}",
            p.from,
            p.to,
            p.device_map
                .as_deref()
                .map(|m| format!(" (device map {m})"))
                .unwrap_or_default()
        );
    }
    match a.format {
        Format::Json => super::print_json(&out)?,
        Format::Text => {
            for m in &out.members {
                println!("{} {} {}", m.rank, m.node, m.pid);
            }
            eprintln!(
                "job {} restored from {}: {} members in {:.0} ms (etcd {:.0} ms)",
                out.job,
                out.id,
                out.members.len(),
                out.timings_ms.total,
                out.timings_ms.etcd
            );
        }
    }
    Ok(())
}

fn list(a: ListArgs) -> super::Result<()> {
    let coord = a.etcd.connect()?;
    let c = coord.as_ref();
    let jobs = job::jobs(c)?;
    let agents = job::agents(c)?;
    let checkpoints = job::checkpoints(c, a.job.as_deref())?;
    match a.format {
        Format::Json => super::print_json(&json!({
            "jobs": jobs, "agents": agents, "checkpoints": checkpoints,
        }))?,
        Format::Text => {
            for a in &agents {
                println!(
                    "agent {} (pid {}, store {}, {} GPU(s))",
                    a.node,
                    a.pid,
                    a.storage,
                    a.gpus.len()
                );
            }
            for (name, members) in &jobs {
                let m: Vec<String> = members
                    .iter()
                    .map(|m| format!("{}@{}", m.rank, m.node))
                    .collect();
                let ordered = members.iter().any(|m| m.ordered);
                println!(
                    "job {name}: {}{}",
                    m.join(" "),
                    if ordered { ", ordered" } else { "" }
                );
            }
            for m in &checkpoints {
                println!(
                    "checkpoint {} of job {}: {} members{}",
                    m.id,
                    m.job,
                    m.members.len(),
                    if m.ordered { ", ordered" } else { "" }
                );
            }
        }
    }
    Ok(())
}

fn status(a: StatusArgs) -> super::Result<()> {
    let coord = a.etcd.connect()?;
    let c = coord.as_ref();
    let value = match job::checkpoint(c, &a.target) {
        Ok(m) => json!({ "checkpoint": m }),
        Err(cluster::ClusterError::NotFound { .. }) => {
            let running: Vec<_> = job::running(c)?
                .into_iter()
                .filter(|o| o.job == a.target)
                .collect();
            let newest = job::checkpoints(c, Some(&a.target))?.pop();
            if running.is_empty() && newest.is_none() && job::members(c, &a.target)?.is_empty() {
                return Err(cluster::ClusterError::NotFound { id: a.target }.into());
            }
            json!({ "job": a.target, "running": running, "newest_checkpoint": newest })
        }
        Err(e) => return Err(e.into()),
    };
    // The text form is the same document: a person reads JSON as well as a table here.
    let _ = a.format;
    super::print_json(&value)?;
    Ok(())
}
