//! What the shipped binary and CRIU plugin hold: no test double in the binary (they are compiled for the
//! library's unit tests only), not the library in the plugin (only the crate of its record types).
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

/// `cargo tree --offline ARGS` (the workspace's resolution, as a build of the named package makes it).
fn cargo_tree(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// The in-memory storage backend is the library's test support, behind its `test-support` feature: the
/// tool's own dependency tree never turns the feature on, and a binary built without it holds none of it.
/// (`cargo test --workspace` unifies the library's features for every crate it builds, the CLI's test
/// build included: there the second check has nothing to look at.)
#[test]
fn the_tool_is_built_without_the_library_s_test_support() {
    let tree = cargo_tree(&[
        "-p",
        "gpu-checkpoint-cli",
        "-e",
        "no-dev",
        "-f",
        "{p} [{f}]",
    ]);
    let lib: Vec<&str> = tree
        .lines()
        .filter(|l| l.contains("gpu-checkpoint v"))
        .collect();
    assert!(!lib.is_empty(), "the library is in the tool's tree: {tree}");
    assert!(
        lib.iter().all(|l| !l.contains("test-support")),
        "the tool's build turns the library's test support on: {lib:?}"
    );
    if !gpu_checkpoint::TEST_SUPPORT {
        let bin = Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint"));
        let found = occurrences(bin, &["MemoryBackend"]);
        assert!(found.is_empty(), "{} holds {found:?}", bin.display());
    }
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

/// The plugin (`libgpu_checkpoint_devices.so`, loaded into CRIU) is built from its record types, not from
/// the whole library: a dependency on `gpu-checkpoint` would make it tens of MB again.
#[test]
fn the_criu_plugin_does_not_link_the_library() {
    let tree = cargo_tree(&[
        "-e",
        "normal",
        "--prefix",
        "none",
        "-p",
        "gpu-checkpoint-criu-devices",
        "--format",
        "{p}",
    ]);
    let crates: Vec<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(crates.contains(&"gpu-checkpoint-device-records"), "{tree}");
    assert!(!crates.contains(&"gpu-checkpoint"), "{tree}");
}
