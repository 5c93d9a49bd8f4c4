//! A CRIU the user named, whose version check runs on a thread while the caller goes on.
//!
//! Why: discovery runs `criu --version`, and on a cold cache that first start of CRIU (its wrapper, its
//! loader, its libraries) took about 30 ms here, as long as the runtime's first command (`runc state`, 16
//! ms cold). A container checkpoint needs both before CRIU dumps anything, but neither needs the other's
//! answer: the named CRIU is the one used whatever its version (a too-old one is an error, never
//! replaced), so its check can run beside the container's discovery. The caller asks
//! [`Criu::version`] before it touches anything; that waits for the check and fails as discovery would.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::JoinHandle;

use super::discover::require;
use super::rpc::require_root;
use super::{
    CheckOutcome, Criu, CriuRpc, CriuSource, CriuVersion, DumpRequest, Error, FoundCriu,
    RestoreRequest,
};

/// A [`Criu`] whose discovery ([`super::discover`]'s version check) is still running; every call but
/// [`Criu::describe`] and [`Criu::check_permitted`] waits for it and fails with its error.
pub struct PendingCriu {
    path: PathBuf,
    state: Mutex<State>,
}

enum State {
    Checking(JoinHandle<Result<FoundCriu, Error>>),
    Ready(CriuRpc),
    /// The check failed (its error went to the first caller).
    Failed(String),
}

impl PendingCriu {
    /// Starts checking the CRIU at `path` (from [`super::named`]) on a thread.
    pub fn start(path: PathBuf, source: CriuSource) -> PendingCriu {
        let probe = path.clone();
        PendingCriu {
            path,
            state: Mutex::new(State::Checking(std::thread::spawn(move || {
                require(&probe, source)
            }))),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checked CRIU, waiting for the check if it is still running. The first caller after a failed
    /// check gets its error (with its exit status), later ones a reference to it.
    fn rpc(&self) -> Result<CriuRpc, Error> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*state, State::Checking(_)) {
            let panicked = State::Failed("the version check panicked".into());
            if let State::Checking(thread) = std::mem::replace(&mut *state, panicked) {
                match thread.join() {
                    Ok(Ok(found)) => *state = State::Ready(CriuRpc::from_found(&found)),
                    Ok(Err(e)) => {
                        *state = State::Failed(e.to_string());
                        return Err(e);
                    }
                    Err(_) => {}
                }
            }
        }
        match &*state {
            State::Ready(rpc) => Ok(rpc.clone()),
            State::Failed(first) => Err(self.failed(first)),
            State::Checking(_) => unreachable!("joined above"),
        }
    }

    fn failed(&self, first: &str) -> Error {
        Error::Protocol {
            path: self.path.clone(),
            detail: format!("this CRIU failed its check before: {first}"),
        }
    }
}

impl Criu for PendingCriu {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn version(&self) -> Result<CriuVersion, Error> {
        self.rpc()?.version()
    }

    /// Root only: no need to wait for the version.
    fn check_permitted(&self) -> Result<(), Error> {
        require_root()
    }

    fn check(&self) -> Result<CheckOutcome, Error> {
        self.rpc()?.check()
    }

    fn dump(&self, req: &DumpRequest<'_>) -> Result<(), Error> {
        self.rpc()?.dump(req)
    }

    fn restore(&self, req: &RestoreRequest<'_>) -> Result<i32, Error> {
        self.rpc()?.restore(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// The version comes from the script's `--version` (checked on the thread), the same answer every time,
    /// and the path is known before the check ends.
    #[test]
    fn a_named_criu_is_checked_on_a_thread_and_answers_its_version() {
        let t = tempfile::tempdir().unwrap();
        let path = script(t.path(), "criu", "sleep 0.2; echo 'Version: 4.2.1'");
        let started = std::time::Instant::now();
        let criu = PendingCriu::start(path.clone(), CriuSource::Flag);
        assert!(started.elapsed() < std::time::Duration::from_millis(150));
        assert_eq!(criu.describe(), path.display().to_string());
        let v = criu.version().unwrap();
        assert_eq!((v.major, v.minor, v.sublevel), (4, 2, 1));
        assert_eq!(criu.version().unwrap(), v);
    }

    /// A too-old CRIU fails as discovery would (its own error, with its exit status), and every later call
    /// fails too instead of running it.
    #[test]
    fn a_too_old_named_criu_fails_every_call() {
        let t = tempfile::tempdir().unwrap();
        let path = script(t.path(), "criu", "echo 'Version: 3.17'");
        let criu = PendingCriu::start(path, CriuSource::Env);
        assert!(matches!(criu.version(), Err(Error::TooOld { .. })));
        let again = criu.check().unwrap_err().to_string();
        assert!(again.contains("failed its check before"), "{again}");
        assert!(again.contains("3.17"), "{again}");
    }
}
