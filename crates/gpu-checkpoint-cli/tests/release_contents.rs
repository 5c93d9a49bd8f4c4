//! What the shipped binary holds: no test double (they are compiled for the library's unit tests only).
//!
//! The binary these tests look at is the one `cargo test` builds for them, with the library compiled as
//! for any build of the tool (`cfg(test)` is set only in the library's own unit-test harness), so what is
//! absent here is absent from a release build too. Its debug information names every function of the
//! library objects linked in, used or not, so a double that came back would be found even if nothing
//! called it.

use std::path::Path;
use std::process::Command;

/// The names of the test doubles and the crate of the tests' pseudo-random data (`testdata`: its
/// generator's name alone would match rayon's `XorShift64Star`).
const DOUBLES: [&str; 5] = [
    "FakeCriu",
    "FakeRuntime",
    "FakeDriver",
    "MemoryCoordinator",
    "testdata",
];

/// The distinct occurrences of `needles` in `file` (`grep -a -o -F`: the files are 100s of MB).
fn occurrences(file: &Path, needles: &[&str]) -> Vec<String> {
    let mut grep = Command::new("grep");
    grep.args(["-a", "-o", "-F"]);
    for n in needles {
        grep.args(["-e", n]);
    }
    let out = grep.arg(file).output().expect("run grep");
    // 0: found, 1: none found, 2: trouble.
    assert!(
        out.status.code().is_some_and(|c| c < 2),
        "grep {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut found: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    found.sort();
    found.dedup();
    found
}

#[test]
fn no_test_double_is_linked_into_the_binary() {
    let bin = Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint"));
    // The search itself works: names the binary does hold are found.
    assert_eq!(
        occurrences(bin, &["CriuRpc", "OciCli"]),
        ["CriuRpc", "OciCli"],
        "the search finds nothing in {}: does it still carry symbols?",
        bin.display()
    );
    let found = occurrences(bin, &DOUBLES);
    assert!(
        found.is_empty(),
        "{} holds test doubles: {found:?}",
        bin.display()
    );
}

#[test]
fn the_fake_gpu_backend_cannot_be_chosen() {
    let bin = env!("CARGO_BIN_EXE_gpu-checkpoint");
    let by_flag = Command::new(bin)
        .args(["cuda", "state", "--pid", "1", "--gpu-backend", "fake"])
        .env_remove("GPU_CHECKPOINT_GPU_BACKEND")
        .output()
        .unwrap();
    let by_env = Command::new(bin)
        .args(["cuda", "state", "--pid", "1"])
        .env("GPU_CHECKPOINT_GPU_BACKEND", "fake")
        .output()
        .unwrap();
    for out in [by_flag, by_env] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("[possible values: auto, cuda-driver, cuda-cli, sim]"),
            "{err}"
        );
    }
}
