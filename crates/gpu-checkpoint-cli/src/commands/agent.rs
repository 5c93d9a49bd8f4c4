//! `gpu-checkpoint agent`: one per node, in the foreground; registers in etcd and carries out the job
//! operations' local parts with the single-node flows (`flows::cluster::LocalWork`), until SIGTERM or
//! SIGINT. It acts only on members registered through its local socket (`job add` on the node), runs
//! only the quiesce hooks it was given, and talks to etcd with TLS and credentials unless told
//! `--insecure-plaintext`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpu_checkpoint::dump::{discover, CriuRpc};
use gpu_checkpoint::flows::cluster::{
    run_agent, Admission, AgentOptions, Coordinator, LocalWork, LocalWorkOptions, MemberError,
    NodePolicy, QuiesceHooks, RegistrationSocket, DEFAULT_SOCKET,
};
use gpu_checkpoint::flows::container::{ContainerRuntime, RuntimeKind};
use gpu_checkpoint::interrupt::InterruptGuard;
use gpu_checkpoint::store::{Store, StoreOptions};

use super::criu_opts::CriuArgs;
use super::cuda::GpuArgs;
use super::job::EtcdArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// This node's name, as `job add --node` names it.
    #[arg(long)]
    pub node: String,
    /// The store the members' checkpoints go to (a folder; shared by the nodes, or each its own).
    #[arg(long, env = "GPU_CHECKPOINT_STORAGE")]
    pub storage: PathBuf,
    /// The CRIU binary to use (as `checkpoint --criu`).
    #[arg(long, value_name = "PATH")]
    pub criu: Option<PathBuf>,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// The agent's etcd lease: how long after this agent dies coordinators abort what it was part of.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    #[command(flatten)]
    pub criu_opts: CriuArgs,
    /// The container runtime of the members given by container (`job add --container`): `runc` or
    /// `runsc`, as `checkpoint --runtime`.
    #[arg(long, value_name = "runc|runsc", default_value = "runc")]
    pub runtime: RuntimeKind,
    /// That runtime's state folder (its global `--root`), where it is not the default.
    #[arg(long, value_name = "DIR")]
    pub runtime_root: Option<PathBuf>,
    /// The agent's local socket, where `job add` on this node registers members (open to every local
    /// user: root registers any process or container, a user only their own processes).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Where the agent keeps the members registered through it (0700; it must survive restarts).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/gpu-checkpoint/agent"
    )]
    pub state_dir: PathBuf,
    /// A quiesce hook a job checkpoint may name (`job checkpoint --quiesce NAME`): PROGRAM (an absolute
    /// path, only root or this user can change it) is run without a shell, with GPU_CHECKPOINT_JOB,
    /// GPU_CHECKPOINT_RANK and GPU_CHECKPOINT_PID (or GPU_CHECKPOINT_CONTAINER), before the member is
    /// locked. Repeatable.
    #[arg(long, value_name = "NAME=PROGRAM")]
    pub quiesce_hook: Vec<String>,
    /// How long a quiesce hook may run before it is killed and its member fails.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    pub quiesce_timeout: Duration,
    /// Register only processes of this user id (repeatable; default: any user's).
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Register only processes in this cgroup (v2 path, such as /system.slice/slurmstepd.scope) or
    /// below it (repeatable; default: any cgroup).
    #[arg(long, value_name = "PATH")]
    pub allow_cgroup: Vec<String>,
    /// Members' checkpoints are signed with this key (as `checkpoint --sign-key`).
    #[command(flatten)]
    pub sign: super::key::SignArgs,
    /// Members are restored only from checkpoints these keys signed (as `restore --trust-key`).
    #[command(flatten)]
    pub trust: super::key::TrustArgs,
}

pub fn run(args: Args) -> super::Result<()> {
    let coord = args.etcd.connect()?;
    let found = discover(args.criu.as_deref())?;
    let criu = CriuRpc::from_found(&found);
    gpu_checkpoint::dump::Criu::check_permitted(&criu)?;
    let opts = StoreOptions {
        sign_key: args.sign.key()?,
        trusted_keys: args.trust.keys()?,
        ..StoreOptions::default()
    };
    let store = Store::open(&args.storage, opts)?;
    let mut hooks = QuiesceHooks::new(args.quiesce_timeout);
    for h in &args.quiesce_hook {
        hooks.add(h)?;
    }
    let policy = NodePolicy {
        allow_uids: args.allow_uid.clone(),
        allow_cgroups: args.allow_cgroup.clone(),
    };
    let admission = Arc::new(Admission::open(&args.state_dir, policy)?);
    let socket = RegistrationSocket::bind(&args.socket)?;
    let exe = std::env::current_exe().map_err(super::Failure::other)?;
    let work = LocalWork::new(LocalWorkOptions {
        node: super::node(store)?.with_criu(Box::new(criu)),
        criu_path: found.path.clone(),
        criu_options: args.criu_opts.options()?,
        backend: args.gpu.gpu_backend,
        runtime: args.runtime,
        runtime_root: args.runtime_root.clone(),
        exe,
        admission: Arc::clone(&admission),
        hooks,
    });
    let mut opts = AgentOptions::new(&args.node, &args.storage.to_string_lossy());
    opts.lease_ttl = args.lease_ttl;
    // Registered with the agent, for job restores that choose a node by its GPUs. A node whose GPU
    // backend does not load (no driver, no GPU) registers none: members that used GPUs are not sent
    // there.
    opts.gpus = match gpu_checkpoint::freeze::open(work.backend()).and_then(|d| d.gpus()) {
        Ok(gpus) => gpus,
        Err(e) => {
            tracing::info!("no GPUs registered: {e}");
            Vec::new()
        }
    };
    // SIGTERM and SIGINT end the agent cleanly: recorded here, then the loop stops taking tasks, finishes
    // or undoes those under way, and revokes its registration.
    let _signals = InterruptGuard::new();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if gpu_checkpoint::interrupt::interrupted() {
                    stop.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    eprintln!(
        "gpu-checkpoint agent: node {} registered in etcd {}; store {}; members registered at {}",
        args.node,
        coord.endpoints(),
        args.storage.display(),
        args.socket.display()
    );
    let coord = coord as Arc<dyn Coordinator>;
    let result = std::thread::scope(|s| {
        // `job add` on this node: checked by the admission, then written to etcd by the agent.
        s.spawn(|| {
            let init = |id: &str| container_init(&work, id);
            socket.serve(&args.node, &admission, &init, coord.as_ref(), &stop)
        });
        let r = run_agent(Arc::clone(&coord), &opts, &work, &stop);
        stop.store(true, Ordering::SeqCst);
        r
    });
    let _ = watcher.join();
    result?;
    if let Some(sig) = gpu_checkpoint::interrupt::last_signal() {
        eprintln!("gpu-checkpoint agent: {sig}: stopped, registration removed");
    }
    Ok(())
}

/// The init PID of container `id` in this agent's runtime, if the runtime knows it and it runs.
fn container_init(work: &LocalWork, id: &str) -> Result<i32, MemberError> {
    let state = work
        .runtime()?
        .state(id)
        .map_err(gpu_checkpoint::Error::from)?;
    match state.status.as_str() {
        "running" | "paused" if state.pid > 0 => Ok(state.pid),
        other => Err(MemberError::Refused(format!(
            "container {id} is {other}, not running"
        ))),
    }
}
