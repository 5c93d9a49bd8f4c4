//! The library's shape, checked from its sources (docs/architecture.md): no circle of files that import
//! each other, no import that runs from a lower layer back up to a higher one, no flow reaching into another
//! flow's inner modules, and no library file over 700 lines before its tests.
//!
//! A file "imports" another when it names one of that file's items through a path (`use` or a path in
//! code: `crate::store::Store`, `super::Error`, `stream::dump_tree`). A module naming its own descendants
//! (re-exporting or calling into the files it declares) and a file naming its ancestors (`super::Error`)
//! are how Rust modules are built; each direction is checked for circles together with the edges between
//! unrelated files, so that a parent and a child naming each other is fine, and everything longer is not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// The longest a library file may be before its `#[cfg(test)]` part.
const MAX_LINES: usize = 700;

/// Modules of the crate root that are leaves: they import nothing of the crate.
const LEAVES: &[&str] = &[
    "exit",
    "proc",
    "interrupt",
    "fault",
    "util",
    "fmt",
    "path_search",
    "fdpass",
    "testdata",
    "beneath",
    "validate",
    "thp",
];

/// The stages, bottom up: a stage names only the leaves and the stages before it.
const STAGES: &[&str] = &["detect", "freeze", "dump", "store"];

struct Source {
    path: PathBuf,
    /// The file's text up to its tests (a `#[cfg(test)] mod x { ... }` block or `#[cfg(test)] mod x;`).
    code: String,
    lines_before_tests: usize,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn module_of(root: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(root).unwrap().with_extension("");
    let mut parts: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn is_test_module(m: &Module) -> bool {
    m.last()
        .is_some_and(|n| n == "tests" || n.ends_with("_tests"))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Drops comments and the contents of string literals, which may hold anything path-like.
fn strip(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < b.len() {
        if b[i] == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if b[i] == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if b[i] == '\'' && b.get(i + 2) == Some(&'\'') {
            // A char literal such as '"' or '{'.
            out.push_str("' '");
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn read_source(path: &Path) -> Source {
    let text = std::fs::read_to_string(path).unwrap();
    // Only an inline test module ends the library code; `#[cfg(test)] mod x;` may stand anywhere.
    let cut = text
        .match_indices("#[cfg(test)]\nmod ")
        .map(|(at, _)| at)
        .find(|&at| {
            let rest = &text[at + "#[cfg(test)]\nmod ".len()..];
            let name_end = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
            rest[name_end..].trim_start().starts_with('{')
        })
        .unwrap_or(text.len());
    let before = &text[..cut];
    Source {
        path: path.to_path_buf(),
        code: strip(before),
        lines_before_tests: before.lines().count(),
    }
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e` (aliases dropped).
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or("").trim();
        return vec![path.to_string()];
    };
    let close = tree.rfind('}').unwrap_or(tree.len());
    let prefix = &tree[..open];
    let body = &tree[open + 1..close];
    let mut items = Vec::new();
    let (mut depth, mut cur) = (0, String::new());
    for ch in body.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if ch == ',' && depth == 0 {
            items.push(std::mem::take(&mut cur));
        } else {
            cur.push(ch);
        }
    }
    items.push(cur);
    items
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .flat_map(|item| expand_use(item).into_iter().map(|e| format!("{prefix}{e}")))
        .collect()
}

/// The file a path names from module `cur`: the longest prefix of it that is a module of the crate.
fn resolve(files: &BTreeSet<Module>, cur: &Module, path: &str) -> Option<Module> {
    let mut segs: Vec<&str> = path
        .split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if segs.is_empty() {
        return None;
    }
    let mut base: Module;
    if segs[0] == "crate" {
        base = Vec::new();
        segs.remove(0);
    } else if segs[0] == "super" || segs[0] == "self" {
        base = cur.clone();
        while let Some(&s) = segs.first() {
            match s {
                "super" => {
                    base.pop();
                }
                "self" => {}
                _ => break,
            }
            segs.remove(0);
        }
    } else {
        let mut child = cur.clone();
        child.push(segs[0].to_string());
        if !files.contains(&child) {
            return None;
        }
        base = cur.clone();
    }
    (0..=segs.len()).rev().find_map(|k| {
        let mut m = base.clone();
        m.extend(segs[..k].iter().map(|s| s.to_string()));
        files.contains(&m).then_some(m)
    })
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path in `code` that starts at `crate`, `super`, `self` or a child module of `cur`.
fn paths_in(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let starts =
            (i == 0 || !(is_word(chars[i - 1]) || chars[i - 1] == ':')) && is_word(chars[i]);
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        loop {
            while j < chars.len() && is_word(chars[j]) {
                j += 1;
            }
            if j + 2 < chars.len()
                && chars[j] == ':'
                && chars[j + 1] == ':'
                && is_word(chars[j + 2])
            {
                j += 2;
            } else {
                break;
            }
        }
        let path: String = chars[i..j].iter().collect();
        if path.contains("::") {
            out.push(path);
        }
        i = j.max(i + 1);
    }
    out
}

struct Crate {
    files: BTreeMap<Module, Source>,
    /// file -> the files it names (test modules left out).
    edges: BTreeMap<Module, BTreeSet<Module>>,
}

fn load() -> Crate {
    let root = src_dir();
    let mut paths = Vec::new();
    walk(&root, &mut paths);
    let files: BTreeMap<Module, Source> = paths
        .iter()
        .map(|p| (module_of(&root, p), read_source(p)))
        .collect();
    let modules: BTreeSet<Module> = files.keys().cloned().collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, src) in &files {
        if is_test_module(m) {
            continue;
        }
        let mut named = BTreeSet::new();
        let code = &src.code;
        let mut rest = code.as_str();
        while let Some(at) = rest.find("use ") {
            let before = rest[..at].chars().last();
            let after = &rest[at + 4..];
            rest = after;
            if before.is_some_and(is_word) {
                continue;
            }
            let Some(end) = after.find(';') else { break };
            for path in expand_use(&after[..end]) {
                named.extend(resolve(&modules, m, &path));
            }
        }
        for path in paths_in(code) {
            named.extend(resolve(&modules, m, &path));
        }
        named.remove(m);
        edges.insert(m.clone(), named);
    }
    Crate { files, edges }
}

fn is_prefix(a: &Module, b: &Module) -> bool {
    a.len() <= b.len() && a[..] == b[..a.len()]
}

/// Circles (strongly connected sets of more than one file) among `edges` filtered by `keep`.
fn circles(c: &Crate, keep: impl Fn(&Module, &Module) -> bool) -> Vec<Vec<String>> {
    let nodes: Vec<&Module> = c.edges.keys().collect();
    let index: BTreeMap<&Module, usize> = nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let adj: Vec<Vec<usize>> = nodes
        .iter()
        .map(|a| {
            c.edges[*a]
                .iter()
                .filter(|b| keep(a, b))
                .filter_map(|b| index.get(b).copied())
                .collect()
        })
        .collect();
    // Tarjan's algorithm, iteratively.
    let n = nodes.len();
    let (mut idx, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on, mut stack, mut out, mut next) = (vec![false; n], Vec::new(), Vec::new(), 0);
    for s in 0..n {
        if idx[s] != usize::MAX {
            continue;
        }
        let mut work = vec![(s, 0usize)];
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k == 0 && idx[v] == usize::MAX {
                idx[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on[v] = true;
            }
            if let Some(&w) = adj[v].get(*k) {
                *k += 1;
                if idx[w] == usize::MAX {
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(idx[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(u, _)) = work.last() {
                low[u] = low[u].min(low[v]);
            }
            if low[v] == idx[v] {
                let mut comp = Vec::new();
                loop {
                    let w = stack.pop().unwrap();
                    on[w] = false;
                    comp.push(nodes[w].join("::"));
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    out.push(comp);
                }
            }
        }
    }
    out
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "lib".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_circle_of_files_importing_each_other() {
    let c = load();
    let mut found = circles(&c, |a, b| !is_prefix(b, a));
    found.extend(circles(&c, |a, b| !is_prefix(a, b)));
    found.sort();
    found.dedup();
    assert!(
        found.is_empty(),
        "{} circle(s) of files naming each other:\n{}",
        found.len(),
        found
            .iter()
            .map(|c| format!("  {}\n", c.join(" <-> ")))
            .collect::<String>()
    );
}

#[test]
fn no_import_runs_back_up_a_layer() {
    let c = load();
    // Bottom up: the leaves, the stages in pipeline order, the umbrella error of the stages, the flows.
    // The crate root (lib.rs) only re-exports, so a path through it (`crate::Result`) names no layer.
    let order: Vec<&str> = STAGES.iter().copied().chain(["error", "flows"]).collect();
    let layer = |m: &Module| -> Option<usize> {
        let top = m.first()?.as_str();
        if LEAVES.contains(&top) {
            return Some(0);
        }
        Some(1 + order.iter().position(|x| *x == top)?)
    };
    assert_no_import(
        &c,
        "imports that run up a layer (or between leaves)",
        |a, b| {
            a.first() != b.first()
                && matches!((layer(a), layer(b)), (Some(la), Some(lb)) if lb >= la)
        },
    );
}

/// Fails naming every import `a -> b` (between files) that `bad` picks out, as `what`.
fn assert_no_import(c: &Crate, what: &str, bad: impl Fn(&Module, &Module) -> bool) {
    let found: Vec<String> = c
        .edges
        .iter()
        .flat_map(|(a, named)| named.iter().map(move |b| (a, b)))
        .filter(|(a, b)| bad(a, b))
        .map(|(a, b)| format!("  {} -> {}\n", name(a), name(b)))
        .collect();
    assert!(found.is_empty(), "{what}:\n{}", found.concat());
}

#[test]
fn every_module_of_the_crate_root_has_a_layer() {
    // A module the layer check does not know would escape it: each is a leaf, a stage or the flows.
    let c = load();
    let unknown: BTreeSet<&str> = c
        .files
        .keys()
        .filter_map(|m| m.first())
        .map(String::as_str)
        .filter(|top| !LEAVES.contains(top) && !STAGES.contains(top) && *top != "flows")
        .collect();
    assert!(
        unknown.is_empty(),
        "modules of the crate root that are neither a leaf, a stage nor the flows: {unknown:?}"
    );
}

#[test]
fn no_flow_reaches_into_another_flows_inner_modules() {
    let c = load();
    assert_no_import(&c, "flows naming another flow's inner modules", |a, b| {
        a.len() >= 2 && a[0] == "flows" && b.len() >= 3 && b[0] == "flows" && b[1] != a[1]
    });
}

#[test]
fn no_library_file_over_700_lines_before_its_tests() {
    let c = load();
    let long: Vec<String> = c
        .files
        .iter()
        .filter(|(m, s)| !is_test_module(m) && s.lines_before_tests > MAX_LINES)
        .map(|(_, s)| format!("  {} ({} lines)\n", s.path.display(), s.lines_before_tests))
        .collect();
    assert!(
        long.is_empty(),
        "library files over {MAX_LINES} lines:\n{}",
        long.concat()
    );
}

#[test]
fn the_checks_see_what_they_check() {
    // The parser finds the imports it must: a sanity check that a change to the sources' style cannot
    // make the other tests pass by seeing nothing.
    let c = load();
    // The checkpoint sequence (the pipeline) strings the stages together.
    let flow: Module = vec!["flows".into(), "pipeline".into(), "checkpoint".into()];
    assert!(c.edges[&flow].contains(&vec!["store".to_string()]));
    assert!(c.edges[&flow].contains(&vec!["freeze".to_string()]));
    assert!(c.files.len() > 100);
    assert_eq!(
        expand_use("crate::a::{b, c::{d as e, f}}"),
        ["crate::a::b", "crate::a::c::d", "crate::a::c::f"]
    );
}
