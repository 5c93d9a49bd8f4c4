//! `--peers`: the ranks of a SIMULATED distributed job, computing in lockstep over TCP, so that a job
//! restored from an inconsistent cut finds out by itself (the cluster tests' detector, docs/cluster.md).
//!
//! Every rank runs the same kernels on the same initial device memory, so after step `k` all ranks hold
//! identical memory (as data-parallel replicas hold identical weights after each step's all-reduce).
//! Each step is one kernel (the simulator's worker 0; `--workers 1`), then an exchange with every other
//! rank (a full mesh: rank `i` connects to each lower rank and accepts the higher ones): `STEP k SUM`,
//! the step number and the checksum of this rank's device memory after it. A rank starts step `k + 1`
//! only once every peer reported step `k` or later, so two ranks' step counters never differ by more
//! than one, and ranks at the same step hold the same memory. A lock drains the kernel, so once every
//! rank is locked no counter moves: a consistent cut holds counters at most one apart.
//!
//! Broken lockstep, reported on stderr (`LOCKSTEP BROKEN: ...`) and in `STATUS` (`lockstep=broken`),
//! after which the rank computes no more (as a real rank would hang or crash): a peer more than one
//! step away, a peer whose counter went back, or a peer at the same step with other memory.
//!
//! Connections do not survive a checkpoint: the tests' checkpoints use CRIU's `--tcp-close` (dumped
//! without their state, restored closed). A rank whose connection ends connects again (or waits for
//! the peer to) and both sides send their current step at once, so a message lost with the old
//! connection is replaced: counters only move forward, and the latest is all a peer needs.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::device::{checksum, DeviceRange};
use crate::sim::Sim;

/// The lockstep state of this rank.
struct State {
    /// Steps made (kernels run) and the memory's checksum after the latest and the one before.
    step: u64,
    sum: String,
    prev_sum: String,
    /// The latest step and checksum each peer reported.
    seen: Vec<Option<(u64, String)>>,
    /// The connection to each peer, for sending, with its number (`gen`); `None` while there is none.
    conns: Vec<Option<(u64, TcpStream)>>,
    /// Connections made so far (each one's number): a restore whose connections came back whole
    /// makes none.
    gen: u64,
    broken: Option<String>,
}

pub struct Lockstep {
    rank: usize,
    peers: Vec<String>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Lockstep {
    /// Rank `rank` of the job whose ranks listen on `peers` (rank order); `sum` is the checksum of the
    /// device memory before any step.
    pub fn new(rank: usize, peers: Vec<String>, sum: String) -> Arc<Self> {
        let n = peers.len();
        Arc::new(Lockstep {
            rank,
            peers,
            state: Mutex::new(State {
                step: 0,
                sum: sum.clone(),
                prev_sum: sum,
                seen: vec![None; n],
                conns: (0..n).map(|_| None).collect(),
                gen: 0,
                broken: None,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `STATUS`'s fields: `lockstep=ok|broken lockstep_rank=R lockstep_step=K lockstep_connections=N`.
    pub fn status(&self) -> String {
        let g = self.lock();
        format!(
            "lockstep={} lockstep_rank={} lockstep_step={} lockstep_connections={}",
            if g.broken.is_some() { "broken" } else { "ok" },
            self.rank,
            g.step,
            g.gen
        )
    }

    /// Listens, connects to the lower ranks, and runs the steps; returns once the threads run.
    pub fn start(self: &Arc<Self>, sim: Arc<Sim>) -> Result<(), String> {
        let addr = &self.peers[self.rank];
        let listener =
            TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let me = Arc::clone(self);
        std::thread::spawn(move || me.accept(listener));
        for peer in 0..self.rank {
            let me = Arc::clone(self);
            std::thread::spawn(move || me.connect(peer));
        }
        let me = Arc::clone(self);
        std::thread::spawn(move || me.steps(&sim));
        Ok(())
    }

    /// One kernel, then waits until every peer made at least as many steps; for ever, unless broken.
    fn steps(&self, sim: &Sim) {
        loop {
            let (step, sum) = sim.kernel(0, |devs: &[DeviceRange]| {
                // SAFETY: called while this kernel is in flight, by the only worker (`--workers 1`):
                // nothing writes or remaps the devices now.
                let sums: Vec<String> = devs.iter().map(|d| checksum(unsafe { d.all() })).collect();
                sums.join(",")
            });
            let mut g = self.lock();
            g.prev_sum = std::mem::replace(&mut g.sum, sum);
            g.step = step;
            // Peers already at this step: their memory must be ours.
            for peer in 0..self.peers.len() {
                if let Some((s, their)) = g.seen[peer].clone() {
                    if s == step && their != g.sum {
                        let why = format!(
                            "rank {peer} at step {s} has memory {their}, this rank {}",
                            g.sum
                        );
                        self.broken(&mut g, why);
                    }
                }
            }
            let msg = format!("STEP {} {}\n", g.step, g.sum);
            for c in g.conns.iter_mut() {
                // A failed send ends that connection: its reader sees it and it is made again.
                if let Some((_, s)) = c {
                    if s.write_all(msg.as_bytes()).is_err() {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                        *c = None;
                    }
                }
            }
            loop {
                let behind = (0..self.peers.len())
                    .any(|p| p != self.rank && g.seen[p].as_ref().is_none_or(|(s, _)| *s < step));
                if g.broken.is_none() && !behind {
                    break;
                }
                g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    fn broken(&self, g: &mut State, why: String) {
        if g.broken.is_none() {
            eprintln!(
                "gpu-sim-workload (SIMULATED GPU) rank {}: LOCKSTEP BROKEN: {why} (an inconsistent cut?)",
                self.rank
            );
            g.broken = Some(why);
        }
    }

    /// Peer `peer` reports step `s` with memory checksum `sum`.
    fn report(&self, peer: usize, s: u64, sum: String) {
        let mut g = self.lock();
        let k = g.step;
        if let Some((before, _)) = &g.seen[peer] {
            if s < *before {
                let why = format!("rank {peer} went back from step {before} to {s}");
                self.broken(&mut g, why);
            }
        }
        if s > k + 1 || s + 1 < k {
            let why = format!("rank {peer} is at step {s}, this rank at {k}");
            self.broken(&mut g, why);
        } else if (s == k && sum != g.sum) || (s + 1 == k && sum != g.prev_sum) {
            let why = format!("rank {peer} at step {s} has memory {sum}, unlike this rank's");
            self.broken(&mut g, why);
        }
        g.seen[peer] = Some((s, sum));
        self.cv.notify_all();
    }

    /// Takes `stream` as the connection to `peer`, sends it this rank's step, and reads its reports
    /// until it ends. A connection made later for the same peer replaces this one (`gen` tells them
    /// apart, so an old one ending late does not take the new one's place).
    fn serve(&self, peer: usize, mut reader: BufReader<TcpStream>) {
        let stream = reader.get_ref();
        let _ = stream.set_nodelay(true);
        let gen = {
            let mut g = self.lock();
            let Ok(mut w) = stream.try_clone() else {
                return;
            };
            let hello = format!("STEP {} {}\n", g.step, g.sum);
            if w.write_all(hello.as_bytes()).is_err() {
                return;
            }
            g.gen += 1;
            let gen = g.gen;
            g.conns[peer] = Some((gen, w));
            gen
        };
        let mut line = String::new();
        loop {
            line.clear();
            if !matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                break;
            }
            let mut f = line.split_whitespace();
            match (f.next(), f.next().and_then(|s| s.parse().ok()), f.next()) {
                (Some("STEP"), Some(s), Some(sum)) => self.report(peer, s, sum.to_string()),
                _ => break,
            }
        }
        let mut g = self.lock();
        if g.conns[peer].as_ref().is_some_and(|(n, _)| *n == gen) {
            g.conns[peer] = None;
        }
    }

    /// The higher ranks connect to us: `RANK r` first, then reports.
    fn accept(self: &Arc<Self>, listener: TcpListener) {
        loop {
            // accept() is restarted after CRIU restores the listening socket; errors just loop.
            let Ok((stream, _)) = listener.accept() else {
                continue;
            };
            let me = Arc::clone(self);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let mut first = String::new();
                if reader.read_line(&mut first).is_err() {
                    return;
                }
                let peer = first
                    .strip_prefix("RANK ")
                    .and_then(|p| p.trim().parse::<usize>().ok())
                    .filter(|&p| p > me.rank && p < me.peers.len());
                if let Some(peer) = peer {
                    me.serve(peer, reader);
                }
            });
        }
    }

    /// We connect to the lower rank `peer`, again whenever the connection ends.
    fn connect(&self, peer: usize) {
        loop {
            match TcpStream::connect(&self.peers[peer]) {
                Ok(mut s) => {
                    if s.write_all(format!("RANK {}\n", self.rank).as_bytes())
                        .is_ok()
                    {
                        self.serve(peer, BufReader::new(s));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> Arc<Lockstep> {
        let l = Lockstep::new(0, vec!["a".into(), "b".into(), "c".into()], "s0".into());
        {
            let mut g = l.lock();
            g.step = step;
            g.sum = format!("s{step}");
            g.prev_sum = format!("s{}", step.saturating_sub(1));
        }
        l
    }

    fn broken(l: &Lockstep) -> Option<String> {
        l.lock().broken.clone()
    }

    #[test]
    fn peers_one_step_apart_with_the_same_memory_are_in_lockstep() {
        let l = at(10);
        l.report(1, 9, "s9".into());
        l.report(1, 10, "s10".into());
        l.report(2, 11, "whatever: checked when this rank gets there".into());
        assert_eq!(broken(&l), None);
        assert!(l
            .status()
            .starts_with("lockstep=ok lockstep_rank=0 lockstep_step=10"));
    }

    #[test]
    fn a_peer_two_steps_away_breaks_lockstep() {
        let l = at(10);
        l.report(1, 12, "s12".into());
        assert!(broken(&l)
            .unwrap()
            .contains("rank 1 is at step 12, this rank at 10"));
        assert!(l.status().starts_with("lockstep=broken"));
        let l = at(10);
        l.report(2, 8, "s8".into());
        assert!(broken(&l).is_some());
    }

    #[test]
    fn a_peer_going_back_or_with_other_memory_breaks_lockstep() {
        let l = at(10);
        l.report(1, 11, "s11".into());
        l.report(1, 10, "s10".into());
        assert!(broken(&l).unwrap().contains("went back from step 11 to 10"));
        let l = at(10);
        l.report(1, 10, "other".into());
        assert!(broken(&l).unwrap().contains("has memory other"));
        let l = at(10);
        l.report(2, 9, "other".into());
        assert!(broken(&l).is_some());
    }
}
