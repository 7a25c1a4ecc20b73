//! The crate's shape, checked: no module imports from a layer above its own, and no two files
//! import each other (a parent module and its child excepted: the parent declares and
//! re-exports the child). Reads `src/` as text and resolves every `crate::` and `super::` path
//! (in `use` declarations, braces expanded, and inline) to the file that defines it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crate's top-level modules, bottom layer first. A module may import from its own layer
/// and the ones below, never from above.
const LAYERS: &[&[&str]] = &[
    // Internals and the ground every layer stands on.
    &["util", "error", "rng", "logging"],
    // Process groups, rendezvous, transports, collectives.
    &["distributed"],
    // Layers and training utilities.
    &[
        "nn",
        "optim",
        "init",
        "checkpoint",
        "memory",
        "threads",
        "sampler",
        "shard",
        "amp",
        "activation_checkpointing",
    ],
    // The wrappers.
    &[
        "ddp",
        "fsdp",
        "parallel",
        "model_parallel",
        "pipeline",
        "tensor_parallel",
    ],
    // Example support.
    &["cifar"],
    // Starting the ranks.
    &["launch", "bin"],
];

fn layer(top: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&top))
        .unwrap_or_else(|| panic!("module `{top}` is in no layer of tests/layout.rs: add it"))
}

/// A source file and the module path it defines (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`).
struct File {
    path: PathBuf,
    module: Vec<String>,
}

fn files(dir: &Path, module: &[String], out: &mut Vec<File>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            let mut m = module.to_vec();
            m.push(name);
            files(&path, &m, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let mut m = module.to_vec();
            if name != "mod" && !(module.is_empty() && name == "lib") {
                m.push(name);
            }
            out.push(File { path, module: m });
        }
    }
}

/// The code of a file that counts: comments dropped, and the unit tests at its end
/// (`#[cfg(test)] mod tests`, whose `super::` means the file itself) left out.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path in `code` that starts at `crate` or `super`, as segments, with `use` braces
/// expanded (`use super::{a, b::c}` gives `super::a` and `super::b::c`).
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts = |w: &str| code[char_offset(code, i)..].starts_with(w);
        let word_start = i == 0 || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_');
        if word_start && (starts("crate::") || starts("super::")) {
            let (found, end) = path_at(&bytes, i);
            out.extend(found);
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

fn char_offset(s: &str, chars: usize) -> usize {
    s.char_indices().nth(chars).map_or(s.len(), |(b, _)| b)
}

/// The paths written at `i` (a prefix, then an identifier, or a `{...}` group), and where
/// they end.
fn path_at(c: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        while i < c.len() && c[i].is_whitespace() {
            i += 1;
        }
        if i < c.len() && c[i] == '{' {
            let mut out = Vec::new();
            i += 1;
            loop {
                while i < c.len() && (c[i].is_whitespace() || c[i] == ',') {
                    i += 1;
                }
                if i >= c.len() || c[i] == '}' {
                    return (out, i + 1);
                }
                let (inner, end) = path_at(c, i);
                for p in inner {
                    out.push([prefix.clone(), p].concat());
                }
                i = end.max(i + 1);
            }
        }
        let start = i;
        while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
            i += 1;
        }
        if start == i {
            return (vec![prefix], i);
        }
        prefix.push(c[start..i].iter().collect());
        if i + 1 < c.len() && c[i] == ':' && c[i + 1] == ':' {
            i += 2;
        } else {
            // `as name` and the like end the path.
            return (vec![prefix], i);
        }
    }
}

/// The file that defines `path`, seen from module `from`: the longest prefix that is a module.
fn resolve<'a>(
    path: &[String],
    from: &[String],
    by_module: &'a BTreeMap<Vec<String>, PathBuf>,
) -> Option<&'a PathBuf> {
    let mut base: Vec<String> = Vec::new();
    let mut rest = path;
    if rest.first().map(String::as_str) == Some("crate") {
        rest = &rest[1..];
    } else {
        base = from.to_vec();
        while rest.first().map(String::as_str) == Some("super") {
            base.pop();
            rest = &rest[1..];
        }
    }
    let full: Vec<String> = base.into_iter().chain(rest.iter().cloned()).collect();
    (0..=full.len())
        .rev()
        .find_map(|n| by_module.get(&full[..n].to_vec()))
}

#[test]
fn no_module_imports_from_above_and_no_two_files_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &[], &mut all);
    // The bin folder holds programs, not modules of the crate.
    let by_module: BTreeMap<Vec<String>, PathBuf> = all
        .iter()
        .filter(|f| f.module.first().map(String::as_str) != Some("bin"))
        .map(|f| (f.module.clone(), f.path.clone()))
        .collect();
    let mut edges: BTreeSet<(PathBuf, PathBuf)> = BTreeSet::new();
    let mut wrong_way = Vec::new();
    for f in &all {
        let text = std::fs::read_to_string(&f.path).unwrap();
        for p in paths(&code(&text)) {
            let Some(target) = resolve(&p, &f.module, &by_module) else {
                continue;
            };
            if *target == f.path {
                continue;
            }
            let target_module = &all.iter().find(|g| g.path == *target).unwrap().module;
            if let (Some(from), Some(to)) = (f.module.first(), target_module.first()) {
                if layer(to) > layer(from) {
                    wrong_way.push(format!(
                        "{} imports {} ({} is above {})",
                        f.path.display(),
                        p.join("::"),
                        to,
                        from
                    ));
                }
            }
            edges.insert((f.path.clone(), target.clone()));
        }
    }
    let module_of = |p: &PathBuf| all.iter().find(|f| f.path == *p).unwrap().module.clone();
    let mut mutual = Vec::new();
    for (a, b) in &edges {
        if a < b && edges.contains(&(b.clone(), a.clone())) {
            let (ma, mb) = (module_of(a), module_of(b));
            if !(ma.starts_with(&mb) || mb.starts_with(&ma)) {
                mutual.push(format!("{} <-> {}", a.display(), b.display()));
            }
        }
    }
    assert!(
        wrong_way.is_empty() && mutual.is_empty(),
        "imports from a layer above:\n  {}\nfiles that import each other:\n  {}",
        wrong_way.join("\n  "),
        mutual.join("\n  ")
    );
    // The check sees the imports it is meant to see.
    assert!(edges.len() > 100, "only {} imports found", edges.len());
}
