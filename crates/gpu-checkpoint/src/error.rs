//! The library's umbrella error type, and how the binary finds the exit status in any error chain.
//!
//! Each stage and flow has its own error enum (`detect::Error`, `store::Error`, `checkpoint::Error`, ...),
//! each classifying itself into an exit code ([`Classify`], in the leaf module [`crate::exit`]). [`enum@Error`]
//! collects them for code that strings several stages together (the flows, the GPU hook). The binary does
//! not convert anything: it passes whatever error it got up, and [`exit_status_of`] finds the first
//! library error in the chain, whichever type it is.

use thiserror::Error;

use crate::exit::{Classify, ExitStatus};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Detect(#[from] crate::detect::Error),
    #[error(transparent)]
    Freeze(#[from] crate::freeze::Error),
    #[error(transparent)]
    Dump(#[from] crate::dump::Error),
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::Error),
    #[error(transparent)]
    Restore(#[from] crate::restore::Error),
    #[error(transparent)]
    Guardian(#[from] crate::flows::guardian::Error),
    #[error(transparent)]
    Container(#[from] crate::flows::container::Error),
    #[error(transparent)]
    Engine(#[from] crate::flows::engine::Error),
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Detect(e) => e.exit_status(),
            Error::Freeze(e) => e.exit_status(),
            Error::Dump(e) => e.exit_status(),
            Error::Store(e) => e.exit_status(),
            Error::Checkpoint(e) => e.exit_status(),
            Error::Restore(e) => e.exit_status(),
            Error::Guardian(e) => e.exit_status(),
            Error::Container(e) => e.exit_status(),
            Error::Engine(e) => e.exit_status(),
        }
    }
}

/// Every error type of the library, in one list: [`exit_status_of`] tries each.
macro_rules! classified {
    ($($ty:ty),+ $(,)?) => {
        /// The exit status of `err` when it is one of the library's errors (any of them, wrapped or not).
        pub fn exit_status_of(err: &(dyn std::error::Error + 'static)) -> Option<ExitStatus> {
            $(
                if let Some(e) = err.downcast_ref::<$ty>() {
                    return Some(e.exit_status());
                }
            )+
            None
        }

        #[cfg(test)]
        const CLASSIFIED: &[&str] = &[$(stringify!($ty)),+];
    };
}

classified!(
    Error,
    crate::detect::Error,
    crate::freeze::Error,
    crate::dump::Error,
    crate::store::Error,
    crate::checkpoint::Error,
    crate::restore::Error,
    crate::flows::guardian::Error,
    crate::flows::container::Error,
    crate::flows::engine::Error,
    crate::flows::cluster::ClusterError,
    crate::flows::cluster::CoordError,
    crate::flows::cluster::MemberError,
    crate::flows::cluster::RegisterError,
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `impl Classify for X` in the library's sources must be in [`exit_status_of`]'s list, or the
    /// binary would report that error as a plain failure (exit 1).
    #[test]
    fn every_classified_error_is_listed() {
        fn visit(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    visit(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for line in text.lines() {
                        // `impl Classify for X` or `impl crate::exit::Classify for X`.
                        let rest = line.trim().strip_prefix("impl ").and_then(|l| {
                            let (path, rest) = l.split_once("Classify for ")?;
                            matches!(path, "" | "crate::exit::").then_some(rest)
                        });
                        if let Some(rest) = rest {
                            let ty = rest.trim_end_matches('{').trim().to_string();
                            out.push((path.display().to_string(), ty));
                        }
                    }
                }
            }
        }
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        visit(&src, &mut found);
        assert!(found.len() >= CLASSIFIED.len(), "{found:?}");
        for (file, ty) in found {
            // `Error` in `src/store/error.rs` is `crate::store::Error`: the module path from the file's.
            let rel = file.strip_prefix(&src.display().to_string()).unwrap();
            let module: Vec<&str> = rel
                .trim_start_matches('/')
                .trim_end_matches(".rs")
                .split('/')
                .filter(|p| !matches!(*p, "mod" | "error" | "lib"))
                .collect();
            let listed = CLASSIFIED.iter().any(|c| {
                let c = c.replace(' ', "");
                c == ty
                    || c == format!("crate::{}::{ty}", module.join("::"))
                    // Re-exported by a parent module (`crate::store::Error`, `crate::flows::cluster::CoordError`).
                    || (1..module.len()).any(|k| c == format!("crate::{}::{ty}", module[..k].join("::")))
            });
            assert!(
                listed,
                "{ty} ({file}) implements Classify but is not in exit_status_of's list"
            );
        }
    }

    #[test]
    fn finds_the_status_of_a_stage_error_anywhere_in_a_chain() {
        let store = crate::store::Error::Conflict("busy".into());
        assert_eq!(exit_status_of(&store), Some(ExitStatus::Conflict));
        let wrapped = Error::from(crate::store::Error::Conflict("busy".into()));
        assert_eq!(exit_status_of(&wrapped), Some(ExitStatus::Conflict));
        let io = std::io::Error::other("not ours");
        assert_eq!(exit_status_of(&io), None);
    }
}
