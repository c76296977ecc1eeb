//! `cargo xtask shape`: the checks a newcomer's way in rests on (docs/architecture.md): the
//! control plane's modules import in one direction, no source file is over 800 lines outside
//! its tests, a child module names what it takes from its parent (no `use super::*` outside
//! tests), and README.md is a user's guide of under 300 lines. Each is a unit test too.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

/// Lines a source file may have before its tests.
pub const MAX_FILE_LINES: usize = 800;
/// Lines README.md may have.
pub const MAX_README_LINES: usize = 300;

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The code of a source file without its unit tests (`#[cfg(test)] mod tests`, or a whole
/// `tests.rs`) and without comments.
fn code_of(path: &Path, text: &str) -> String {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return String::new();
    }
    let before_tests = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |i| &text[..i]);
    before_tests
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate's top-level modules that `code` names: `crate::NAME` paths, and the names at
/// the top of `use crate::{...}`.
fn named_modules(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: those at depth 0, split by commas.
            let (mut depth, mut start) = (0usize, 0usize);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.insert(ident(group[start..j].trim()));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(group[start..j].trim()));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// Each top-level module of the crate at `src` and the modules its code (tests aside) names.
pub fn module_graph(src: &Path) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in rust_files(src)? {
        let rel = f.strip_prefix(src)?;
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .context("a file under src")?;
        if top == "main" || top == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&f)?;
        let mut deps = named_modules(&code_of(&f, &text));
        deps.remove(&top);
        graph.entry(top).or_default().extend(deps);
    }
    Ok(graph)
}

/// A cycle among the modules of `graph` (as a path that ends where it starts), if any.
pub fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

/// Source files longer than [`MAX_FILE_LINES`] before their tests, with that length. Test
/// files (under `tests/tests`, and `tests.rs`) do not count.
pub fn long_files(root: &Path) -> Result<Vec<(PathBuf, usize)>> {
    let mut out = Vec::new();
    for dir in [
        "ipoib-common/src",
        "ipoib-ebpf/src",
        "ipoib-ctl/src",
        "tests/src",
        "xtask/src",
    ] {
        for f in rust_files(&root.join(dir))? {
            if f.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&f)?;
            let lines = text
                .find("#[cfg(test)]\nmod tests")
                .map_or(text.as_str(), |i| &text[..i])
                .lines()
                .count();
            if lines > MAX_FILE_LINES {
                out.push((f.strip_prefix(root)?.to_path_buf(), lines));
            }
        }
    }
    Ok(out)
}

/// Whether `code` (a file's, tests and comments left out) takes all of its parent's names.
fn has_parent_glob(code: &str) -> bool {
    code.lines().any(|l| l.trim() == "use super::*;")
}

/// The control plane's source files that take their parent's names by a glob outside their
/// tests: a reader cannot tell from them where a name comes from.
pub fn parent_globs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for f in rust_files(&root.join("ipoib-ctl/src"))? {
        if has_parent_glob(&code_of(&f, &std::fs::read_to_string(&f)?)) {
            out.push(f.strip_prefix(root)?.to_path_buf());
        }
    }
    Ok(out)
}

/// Runs the four checks, printing each; fails if any does.
pub fn run(root: &Path) -> Result<()> {
    let mut failed = Vec::new();
    let graph = module_graph(&root.join("ipoib-ctl/src"))?;
    match find_cycle(&graph) {
        None => println!("ok    ipoib-ctl's modules import in one direction"),
        Some(c) => {
            println!(
                "FAIL  ipoib-ctl's modules import in a circle: {}",
                c.join(" -> ")
            );
            failed.push("import cycles");
        }
    }
    let long = long_files(root)?;
    if long.is_empty() {
        println!("ok    no source file over {MAX_FILE_LINES} lines outside its tests");
    } else {
        println!("FAIL  source files over {MAX_FILE_LINES} lines outside their tests:");
        for (f, n) in &long {
            println!("        {n:>5}  {}", f.display());
        }
        failed.push("long files");
    }
    let globs = parent_globs(root)?;
    if globs.is_empty() {
        println!("ok    no module of ipoib-ctl takes its parent's names by `use super::*`");
    } else {
        println!("FAIL  `use super::*` outside tests (name what is taken):");
        for f in &globs {
            println!("        {}", f.display());
        }
        failed.push("glob imports");
    }
    let readme = std::fs::read_to_string(root.join("README.md"))?
        .lines()
        .count();
    if readme < MAX_README_LINES {
        println!("ok    README.md is {readme} lines (under {MAX_README_LINES})");
    } else {
        println!("FAIL  README.md is {readme} lines (at most {MAX_README_LINES})");
        failed.push("README");
    }
    if !failed.is_empty() {
        bail!("shape: {}", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        crate::workspace_root()
    }

    #[test]
    fn modules_named_in_paths_and_use_groups_are_found() {
        let code = "use crate::{\n    attach::{self, AttachError},\n    clock::monotonic_ns,\n    \
                    self,\n};\nfn f() { crate::files::replace(); let x = crate::plan::X; }";
        let names: Vec<String> = named_modules(code).into_iter().collect();
        assert_eq!(names, ["attach", "clock", "files", "plan"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_tree_has_none() {
        let g = |edges: &[(&str, &str)]| {
            let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (a, b) in edges {
                g.entry(a.to_string()).or_default().insert(b.to_string());
                g.entry(b.to_string()).or_default();
            }
            g
        };
        assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
        let c = find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")])).unwrap();
        assert_eq!(c.first(), c.last());
        assert_eq!(c.len(), 4, "{c:?}");
    }

    /// Comments and unit tests do not count: a test may reach anything.
    #[test]
    fn comments_and_unit_tests_are_left_out() {
        let text =
            "// crate::daemon\nuse crate::plan;\n#[cfg(test)]\nmod tests {\n use crate::status;\n}";
        let code = code_of(Path::new("x.rs"), text);
        let names: Vec<String> = named_modules(&code).into_iter().collect();
        assert_eq!(names, ["plan"]);
        assert_eq!(code_of(Path::new("a/tests.rs"), text), "");
    }

    #[test]
    fn ipoib_ctls_modules_import_in_one_direction() {
        let graph = module_graph(&root().join("ipoib-ctl/src")).unwrap();
        assert!(graph.contains_key("connmgr") && graph["connmgr"].contains("engine"));
        assert_eq!(find_cycle(&graph), None, "{graph:#?}");
    }

    #[test]
    fn a_parent_glob_counts_outside_tests_only() {
        let text = "use super::{A, b};\nfn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n}";
        assert!(!has_parent_glob(&code_of(Path::new("x.rs"), text)));
        assert!(has_parent_glob(&code_of(
            Path::new("x.rs"),
            &format!("//! Docs.\n\nuse super::*;\n{text}")
        )));
        assert!(!has_parent_glob(&code_of(
            Path::new("a/tests.rs"),
            "use super::*;"
        )));
        assert!(parent_globs(&root()).unwrap().is_empty());
    }

    /// A tree with one glob outside tests, one inside: only the first is named.
    #[test]
    fn parent_globs_names_the_files_that_glob() {
        let tmp = std::env::temp_dir().join(format!("xtask-shape-{}", std::process::id()));
        let src = tmp.join("ipoib-ctl/src/m");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("a.rs"), "use super::*;\nfn f() {}\n").unwrap();
        std::fs::write(src.join("tests.rs"), "use super::*;\n").unwrap();
        std::fs::write(tmp.join("ipoib-ctl/src/b.rs"), "use super::{A};\n").unwrap();
        let found = parent_globs(&tmp).unwrap();
        let _ = std::fs::remove_dir_all(&tmp);
        assert_eq!(found, [PathBuf::from("ipoib-ctl/src/m/a.rs")]);
    }

    #[test]
    fn no_source_file_is_over_800_lines_outside_its_tests() {
        let long = long_files(&root()).unwrap();
        assert!(long.is_empty(), "{long:?}");
    }

    #[test]
    fn the_readme_is_a_users_guide_in_length() {
        let n = std::fs::read_to_string(root().join("README.md"))
            .unwrap()
            .lines()
            .count();
        assert!(n < MAX_README_LINES, "README.md is {n} lines");
    }
}
