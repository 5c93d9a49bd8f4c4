//! Putting it together: which processes to read, reading them, and building the report.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

use rayon::prelude::*;

use super::classify::classify;
use super::connections::{ExternalPeers, TcpTables};
use super::limits::{self, Caller};
use super::needs::ClassifyContext;
use super::nvml::GpuInventory;
use super::parse::{self, socket_inode};
use super::paths::{classify_path, SIM_SHM_PREFIX, SIM_SOCKET_PREFIX};
use super::process::{ProcessSnapshot, Reader};
use super::source::ProcRoot;
use super::strategy::{self, Scope};
use super::{
    DetectOptions, Error, Evidence, Finding, FindingKind, ProcessReport, Report, SCHEMA_VERSION,
};

/// [`super::detect_pid`] with an explicit NVML (or none): the entry point tests use.
pub fn detect_pid_with(
    pid: i32,
    opts: &DetectOptions,
    inventory: Option<&dyn GpuInventory>,
) -> Result<Report, Error> {
    let t0 = Instant::now();
    let root = ProcRoot::open(&opts.proc_root)?;
    if !root.has_pid(pid) {
        return Err(Error::NoSuchProcess {
            pid,
            path: root.pid_dir(pid),
        });
    }
    let mut reader = Reader::default();
    let mut notes = Vec::new();
    let sockets = Sockets::new(&root);

    // The target itself: every error counts (it is what the user asked about).
    let mut snaps = vec![reader.snapshot(&root, pid)?];
    if opts.tree {
        for child in descendants(&root, &mut reader, pid) {
            match reader.snapshot(&root, child) {
                Ok(s) => snaps.push(s),
                // Exited during the scan: it is not part of the tree any more.
                Err(e) if e.is_vanished() => {
                    tracing::debug!("pid {child} exited during the scan");
                    notes.push(format!("process {child} exited during the scan"));
                }
                Err(e) => return Err(e),
            }
        }
    }
    let nvml = nvml_processes(inventory, &root, &mut reader, &mut notes);
    let driver = driver_version(&root, inventory);
    let live = opts.proc_root == std::path::Path::new("/proc");
    let net = Net {
        tcp: TcpTables::new(&root),
        peers: ExternalPeers::of(&snaps, live, &mut notes),
    };
    // What CRIU cannot dump, across the tree; what depends on who checkpoints only on the live /proc.
    let caller = live.then(Caller::here);
    let limits = limits::findings(Some(pid), &snaps, caller.as_ref());
    let mut analysed = Vec::with_capacity(snaps.len());
    let scan = Scan::new(opts, &root, (&sockets, &net), &nvml);
    for snap in snaps {
        let mut findings = scan.analyse(&snap, &mut reader);
        findings.extend(limits.iter().filter(|f| f.pid == snap.pid).cloned());
        analysed.push((snap, findings));
    }
    Ok(build(Some(pid), analysed, driver, opts.tree, notes, t0))
}

/// [`super::detect_all`] with an explicit NVML (or none): the entry point tests use.
pub fn detect_all_with(
    opts: &DetectOptions,
    inventory: Option<&dyn GpuInventory>,
) -> Result<Report, Error> {
    let t0 = Instant::now();
    let root = ProcRoot::open(&opts.proc_root)?;
    let mut reader = Reader::default();
    let mut notes = Vec::new();
    let sockets = Sockets::new(&root);
    // A node has no tree whose outside a UNIX peer could be: only TCP connections are looked at.
    let net = Net {
        tcp: TcpTables::new(&root),
        peers: ExternalPeers::default(),
    };
    let nvml = nvml_processes(inventory, &root, &mut reader, &mut notes);
    let sim_sockets: HashSet<u64> = if opts.simulator {
        sockets.inodes_with_prefix(SIM_SOCKET_PREFIX)
    } else {
        HashSet::new()
    };

    let mut pids = root.pids()?;
    pids.sort_unstable();
    // On the live /proc, leave ourselves out: asking NVML opened /dev/nvidiactl in this very process.
    if opts.proc_root == std::path::Path::new("/proc") {
        let me = std::process::id() as i32;
        pids.retain(|&p| p != me);
    }
    // The cheap filter over every process is most of the cost of a node scan, and each process is
    // independent: spread it over the cores (one read buffer per worker).
    let filtered: Vec<(i32, Result<bool, Error>)> = pids
        .par_iter()
        .map_init(Reader::default, |reader, &pid| {
            (
                pid,
                is_candidate(&root, reader, pid, opts.simulator, &sim_sockets),
            )
        })
        .collect();
    let live = opts.proc_root == std::path::Path::new("/proc");
    let caller = live.then(Caller::here);
    let scan = Scan::new(opts, &root, (&sockets, &net), &nvml);
    let mut analysed = Vec::new();
    let mut denied = 0usize;
    for (pid, filter) in filtered {
        let candidate = nvml.contains_key(&pid)
            || match filter {
                Ok(c) => c,
                Err(Error::PermissionDenied { .. }) => {
                    denied += 1;
                    false
                }
                Err(_) => false, // exited, or a kernel thread's unreadable bits: nothing to report
            };
        if !candidate {
            continue;
        }
        let snap = match reader.snapshot(&root, pid) {
            Ok(s) => s,
            Err(Error::PermissionDenied { .. }) => {
                denied += 1;
                continue;
            }
            Err(
                Error::NoSuchProcess { .. } | Error::KernelThread { .. } | Error::Thread { .. },
            ) => continue,
            // A malformed file in a captured tree is bad input, not something to skip quietly.
            Err(e) => return Err(e),
        };
        let mut findings = scan.analyse(&snap, &mut reader);
        // A node scan has no tree: only what each process holds by itself.
        findings.extend(limits::findings(
            None,
            std::slice::from_ref(&snap),
            caller.as_ref(),
        ));
        if findings.iter().any(Finding::is_state) {
            analysed.push((snap, findings));
        }
    }
    if denied > 0 {
        notes.push(format!(
            "{denied} process(es) could not be read (permission denied): run as root to see every process"
        ));
    }
    let driver = driver_version(&root, inventory);
    Ok(build(None, analysed, driver, false, notes, t0))
}

/// The cheap test that decides whether a process is worth a full read: does any mapping or open fd name
/// a GPU (or other device) file? Reads `maps` and, when that says nothing, the fd links; nothing else.
fn is_candidate(
    root: &ProcRoot,
    reader: &mut Reader,
    pid: i32,
    simulator: bool,
    sim_sockets: &HashSet<u64>,
) -> Result<bool, Error> {
    let maps = reader.raw(root, pid, "maps")?;
    for line in maps.split(|&b| b == b'\n') {
        // The path is the only field that can hold a '/'.
        let Some(slash) = line.iter().position(|&b| b == b'/') else {
            continue;
        };
        let path = &line[slash..];
        if path.starts_with(b"/dev/nvidia")
            || path.starts_with(b"/dev/kfd")
            || path.starts_with(b"/dev/infiniband/")
            || path.starts_with(b"/dev/vfio/")
            || path == b"/dev/mem"
            || path.starts_with(b"/sys/")
            || (simulator && path.starts_with(SIM_SHM_PREFIX.as_bytes()))
        {
            return Ok(true);
        }
    }
    Ok(root.fds(pid)?.iter().any(|(_, target)| {
        classify_path(target).is_device()
            || (simulator && socket_inode(target).is_some_and(|i| sim_sockets.contains(&i)))
    }))
}

/// What the scan knows about the connections of the processes it reads.
struct Net<'a> {
    tcp: TcpTables<'a>,
    peers: ExternalPeers,
}

/// What a scan reads each process with.
struct Scan<'a> {
    opts: &'a DetectOptions,
    root: &'a ProcRoot,
    sockets: &'a Sockets<'a>,
    net: &'a Net<'a>,
    /// What NVML said of each process.
    nvml: &'a HashMap<i32, Vec<(u32, Option<u64>)>>,
}

impl<'a> Scan<'a> {
    fn new(
        opts: &'a DetectOptions,
        root: &'a ProcRoot,
        (sockets, net): (&'a Sockets<'a>, &'a Net<'a>),
        nvml: &'a HashMap<i32, Vec<(u32, Option<u64>)>>,
    ) -> Self {
        Scan {
            opts,
            root,
            sockets,
            net,
            nvml,
        }
    }

    /// Findings of one process: /proc classification plus what NVML said about it.
    fn analyse(&self, snap: &ProcessSnapshot, reader: &mut Reader) -> Vec<Finding> {
        let (opts, root, sockets, net) = (self.opts, self.root, self.sockets, self.net);
        let nvml = self.nvml.get(&snap.pid);
        let pid = snap.pid;
        let lookup = |inode: u64| sockets.path(pid, inode);
        let tcp = net.tcp.of(snap);
        let tcp_socket = |inode: u64| tcp.get(&inode).cloned();
        let external_peer = |inode: u64| net.peers.peer(inode);
        let ctx = ClassifyContext {
            simulator: opts.simulator,
            socket_path: &lookup,
            tcp_socket: &tcp_socket,
            external_peer: &external_peer,
        };
        let mut findings = classify(snap, &ctx, &mut || reader.threads(root, pid));
        for (gpu, used) in nvml.into_iter().flatten() {
            findings.push(Finding {
                kind: FindingKind::Nvml,
                pid,
                evidence: Evidence {
                    detail: match used {
                        Some(b) => format!(
                            "NVML lists it as a compute process on GPU {gpu} ({} of device memory)",
                            crate::fmt::human_bytes(*b)
                        ),
                        None => format!("NVML lists it as a compute process on GPU {gpu}"),
                    },
                    gpu: Some(*gpu),
                    size: *used,
                    ..Default::default()
                },
            });
        }
        findings
    }
}

fn build(
    pid: Option<i32>,
    analysed: Vec<(ProcessSnapshot, Vec<Finding>)>,
    driver_version: Option<String>,
    tree: bool,
    notes: Vec<String>,
    t0: Instant,
) -> Report {
    let scope = Scope {
        driver_major: driver_version.as_deref().and_then(parse::driver_major),
        tree,
    };
    let mut processes = Vec::with_capacity(analysed.len());
    let mut findings = Vec::new();
    let mut decisions = Vec::with_capacity(analysed.len());
    for (snap, f) in analysed {
        let (name, blockers, simulated) = strategy::decide_process(snap.pid, &f, scope);
        let container_id = snap.cgroup.as_deref().and_then(parse::container_id);
        processes.push(ProcessReport {
            pid: snap.pid,
            comm: snap.stat.comm,
            ppid: snap.stat.ppid,
            strategy: name,
            simulated,
            cgroup: snap.cgroup,
            container_id,
            nspid: if snap.nspid.len() > 1 {
                snap.nspid
            } else {
                Vec::new()
            },
        });
        decisions.push((name, blockers));
        findings.extend(f);
    }
    let gpu = findings.iter().any(Finding::is_state);
    let mut report = Report {
        schema_version: SCHEMA_VERSION,
        pid,
        gpu,
        processes,
        findings,
        strategy: strategy::combine(&decisions),
        strategies: Vec::new(),
        ordered: false,
        driver_version,
        elapsed_ms: 0.0,
        notes,
    };
    report.strategies = super::choice::considered(&report);
    report.ordered = report.processes.len() > 1
        && report.strategy.name != strategy::StrategyName::Unsupported
        && report.findings.iter().any(strategy::is_ipc_channel);
    report.elapsed_ms = t0.elapsed().as_secs_f64() * 1000.0;
    report
}

/// All descendants of `pid`, breadth first. Uses `task/*/children` where the tree has it (the live
/// /proc), else every process's ppid (captured trees).
fn descendants(root: &ProcRoot, reader: &mut Reader, pid: i32) -> Vec<i32> {
    let mut by_ppid: Option<HashMap<i32, Vec<i32>>> = None;
    let mut out = Vec::new();
    let mut queue = vec![pid];
    let mut seen = HashSet::from([pid]);
    while let Some(p) = queue.pop() {
        let children = match reader.children(root, p) {
            Some(c) => c,
            None => {
                let map = by_ppid.get_or_insert_with(|| ppid_map(root, reader));
                map.get(&p).cloned().unwrap_or_default()
            }
        };
        for c in children {
            if seen.insert(c) {
                out.push(c);
                queue.push(c);
            }
        }
    }
    out.sort_unstable();
    out
}

fn ppid_map(root: &ProcRoot, reader: &mut Reader) -> HashMap<i32, Vec<i32>> {
    let mut map: HashMap<i32, Vec<i32>> = HashMap::new();
    for pid in root.pids().unwrap_or_default() {
        if let Ok(stat) = reader.stat(root, pid) {
            map.entry(stat.ppid).or_default().push(pid);
        }
    }
    map
}

/// NVML's compute processes, keyed by pid in this /proc. NVML gives host pids: when a pid is not in
/// this /proc as such, look for a process whose `NSpid` holds it (the namespaces differ).
fn nvml_processes(
    inventory: Option<&dyn GpuInventory>,
    root: &ProcRoot,
    reader: &mut Reader,
    notes: &mut Vec<String>,
) -> HashMap<i32, Vec<(u32, Option<u64>)>> {
    let mut out: HashMap<i32, Vec<(u32, Option<u64>)>> = HashMap::new();
    let Some(inv) = inventory else { return out };
    let procs = match inv.compute_processes() {
        Ok(p) => p,
        Err(e) => {
            notes.push(e);
            return out;
        }
    };
    let mut nspid_index: Option<HashMap<i32, i32>> = None;
    for p in procs {
        let Ok(host_pid) = i32::try_from(p.pid) else {
            continue;
        };
        let pid = if root.has_pid(host_pid) {
            Some(host_pid)
        } else {
            nspid_index
                .get_or_insert_with(|| nspid_map(root, reader))
                .get(&host_pid)
                .copied()
        };
        match pid {
            Some(pid) => out.entry(pid).or_default().push((p.gpu, p.used_memory)),
            None => notes.push(format!(
                "NVML lists process {} on GPU {}, which is not visible in {}",
                p.pid,
                p.gpu,
                root.path().display()
            )),
        }
    }
    out
}

/// Inner-namespace pid -> pid in this /proc, for processes in nested PID namespaces. Ambiguous inner
/// pids (the same number in two containers) are left out rather than guessed.
fn nspid_map(root: &ProcRoot, reader: &mut Reader) -> HashMap<i32, i32> {
    let mut map: HashMap<i32, i32> = HashMap::new();
    let mut ambiguous = HashSet::new();
    for pid in root.pids().unwrap_or_default() {
        let Ok(status) = reader.raw(root, pid, "status") else {
            continue;
        };
        for inner in parse::parse_nspid(status).into_iter().skip(1) {
            if map.insert(inner, pid).is_some_and(|old| old != pid) {
                ambiguous.insert(inner);
            }
        }
    }
    for a in ambiguous {
        map.remove(&a);
    }
    map
}

/// The driver version: `driver/nvidia/version` in the tree, else NVML's.
fn driver_version(root: &ProcRoot, inventory: Option<&dyn GpuInventory>) -> Option<String> {
    root.read_root_file("driver/nvidia/version")
        .and_then(|d| parse::parse_driver_version(&d))
        .or_else(|| inventory.and_then(|i| i.driver_version()))
}

/// UNIX socket paths by inode, read lazily: only processes with GPU state need them, and `net/unix`
/// can be large on a busy node.
struct Sockets<'a> {
    root: &'a ProcRoot,
    table: RefCell<Option<HashMap<u64, String>>>,
    /// Processes whose own `net/unix` (their network namespace's) was merged already.
    merged: RefCell<HashSet<i32>>,
}

impl<'a> Sockets<'a> {
    fn new(root: &'a ProcRoot) -> Self {
        Sockets {
            root,
            table: RefCell::new(None),
            merged: RefCell::new(HashSet::new()),
        }
    }

    fn load(&self) {
        let mut t = self.table.borrow_mut();
        if t.is_none() {
            let data = self.root.read_root_file("net/unix").unwrap_or_default();
            *t = Some(
                parse::parse_net_unix(&data)
                    .into_iter()
                    .map(|s| (s.inode, s.path))
                    .collect(),
            );
        }
    }

    /// The path of socket `inode` held by `pid`. `net/unix` lists the reader's network namespace only;
    /// a miss falls back to the process's own `<pid>/net/unix` once (containers).
    fn path(&self, pid: i32, inode: u64) -> Option<String> {
        self.load();
        if let Some(p) = self.table.borrow().as_ref().and_then(|t| t.get(&inode)) {
            return (!p.is_empty()).then(|| p.clone());
        }
        if !self.merged.borrow_mut().insert(pid) {
            return None;
        }
        let mut buf = Vec::new();
        if let Ok(true) = self.root.read_optional(pid, "net/unix", &mut buf) {
            let mut t = self.table.borrow_mut();
            let t = t.get_or_insert_with(HashMap::new);
            for s in parse::parse_net_unix(&buf) {
                t.entry(s.inode).or_insert(s.path);
            }
            return t.get(&inode).filter(|p| !p.is_empty()).cloned();
        }
        None
    }

    fn inodes_with_prefix(&self, prefix: &str) -> HashSet<u64> {
        self.load();
        self.table
            .borrow()
            .iter()
            .flatten()
            .filter(|(_, p)| p.starts_with(prefix))
            .map(|(i, _)| *i)
            .collect()
    }
}
