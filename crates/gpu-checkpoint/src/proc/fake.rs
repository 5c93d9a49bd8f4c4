//! The test [`Processes`]: pretend processes in a table, every signal sent to them recorded. A SIGSTOP
//! stops one, a SIGCONT runs it again, a SIGKILL ends it (it stays a zombie until [`FakeProcesses::reap`])
//! unless it was made to survive it ([`FakeProcesses::survives_kill`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Hold, ProcStat, Processes, TreeProcess};

#[derive(Debug, Clone)]
struct Fake {
    ppid: i32,
    comm: String,
    state: char,
    resident: u64,
    survives_kill: bool,
}

#[derive(Debug, Default)]
struct Table {
    procs: BTreeMap<i32, Fake>,
    /// Every signal sent, as (pid, signal), in order.
    signals: Vec<(i32, i32)>,
}

/// See the module documentation.
#[derive(Debug, Default, Clone)]
pub struct FakeProcesses(Arc<Mutex<Table>>);

impl FakeProcesses {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds process `pid` (child of `ppid`) in `state` (`S` running, `T` stopped, `Z` zombie).
    pub fn add(&self, pid: i32, ppid: i32, state: char) -> &Self {
        let fake = Fake {
            ppid,
            comm: format!("fake{pid}"),
            state,
            resident: 4096,
            survives_kill: false,
        };
        self.table().procs.insert(pid, fake);
        self
    }

    /// `pid` ignores SIGKILL (a process stuck in the kernel, as far as the flow can tell).
    pub fn survives_kill(&self, pid: i32) -> &Self {
        if let Some(p) = self.table().procs.get_mut(&pid) {
            p.survives_kill = true;
        }
        self
    }

    /// Its parent reaps `pid`: the PID is free.
    pub fn reap(&self, pid: i32) {
        self.table().procs.remove(&pid);
    }

    /// `pid`'s state letter, `None` once reaped.
    pub fn state(&self, pid: i32) -> Option<char> {
        self.table().procs.get(&pid).map(|p| p.state)
    }

    /// Every signal sent so far, as (pid, signal).
    pub fn signals(&self) -> Vec<(i32, i32)> {
        self.table().signals.clone()
    }

    fn send(&self, pid: i32, sig: i32) {
        let mut t = self.table();
        let Some(p) = t.procs.get_mut(&pid) else {
            return;
        };
        match sig {
            libc::SIGSTOP => p.state = 'T',
            libc::SIGCONT if p.state == 'T' => p.state = 'S',
            libc::SIGKILL if !p.survives_kill => p.state = 'Z',
            _ => {}
        }
        t.signals.push((pid, sig));
    }
}

impl Processes for FakeProcesses {
    fn stat(&self, pid: i32) -> Option<ProcStat> {
        let t = self.table();
        let p = t.procs.get(&pid)?;
        Some(ProcStat::leader(pid, p.ppid, &p.comm, p.state))
    }

    fn tree(&self, root: i32) -> Vec<TreeProcess> {
        let t = self.table();
        if !t.procs.contains_key(&root) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut queue = std::collections::VecDeque::from([root]);
        while let Some(pid) = queue.pop_front() {
            let p = &t.procs[&pid];
            out.push(TreeProcess {
                pid,
                ppid: p.ppid,
                comm: p.comm.clone(),
                cmdline: p.comm.clone(),
                threads: 1,
            });
            queue.extend(
                t.procs
                    .iter()
                    .filter(|(_, c)| c.ppid == pid)
                    .map(|(k, _)| *k),
            );
        }
        out
    }

    fn resident_bytes(&self, pids: &[i32]) -> u64 {
        let t = self.table();
        pids.iter()
            .filter_map(|p| t.procs.get(p))
            .map(|p| p.resident)
            .sum()
    }

    fn hold(&self, pids: &[i32]) -> Box<dyn Hold> {
        let held = pids
            .iter()
            .copied()
            .filter(|p| self.table().procs.contains_key(p))
            .collect();
        Box::new(FakeHeld {
            procs: self.clone(),
            pids: held,
        })
    }
}

/// Pretend processes held: signalled only while they are in the table (a reaped PID is never reused).
struct FakeHeld {
    procs: FakeProcesses,
    pids: Vec<i32>,
}

impl Hold for FakeHeld {
    fn pids(&self) -> Vec<i32> {
        self.pids.clone()
    }

    fn signal(&self, sig: i32) {
        for &pid in &self.pids {
            self.procs.send(pid, sig);
        }
    }

    fn kill(&self, _timeout: Duration) -> Vec<i32> {
        self.signal(libc::SIGKILL);
        self.pids
            .iter()
            .copied()
            .filter(|&p| self.procs.is_alive(p))
            .collect()
    }
}
