//! Finds the programs the workspace's sources spawn, so a test can hold them against the
//! table in [`crate::provision::programs`]. It reads the source text, not the syntax tree: it knows the
//! shapes this project spawns with, and its own tests pin each shape down.
//!
//! - `Command::new("NAME")` (std and tokio);
//! - the helpers that take a program name first: a lab node's `.cmd("NAME")`, xtask's
//!   `clean("NAME")`, and `sh(&["NAME", ...])` / `run(&["NAME", ...])` in the test libraries;
//! - shell scripts in string literals that start with `set -` (what the VM runs): the first
//!   word of each command, past `VAR=value` assignments.

use std::path::{Path, PathBuf};

/// Call shapes whose first string literal argument is a program name. Each must start a word
/// (`sh(` matches `!sh(` and ` sh(`, not `fresh(`).
const CALLS: &[&str] = &[
    "Command::new(\"",
    ".cmd(\"",
    "clean(\"",
    "sh(&[\"",
    "run(&[\"",
];

/// Shell words that are no program (builtins and keywords).
const SHELL_BUILTINS: &[&str] = &[
    "set", "echo", "exit", "cd", "export", "true", "false", "if", "then", "fi", "for", "do",
    "done", "wait", "test", "[", "exec", "read", "trap",
];

/// The programs `text` spawns, with the line each is on.
pub fn programs_in(text: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        for call in CALLS {
            let mut from = 0;
            while let Some(at) = line[from..].find(call).map(|a| a + from) {
                from = at + call.len();
                let word_start = !line[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
                if let Some(end) = line[from..].find('"')
                    && (word_start || call.starts_with('.'))
                {
                    found.push((line[from..from + end].to_string(), i + 1));
                }
            }
        }
        for lit in string_literals(line) {
            if lit.starts_with("set -") {
                found.extend(shell_programs(lit).into_iter().map(|p| (p, i + 1)));
            }
        }
    }
    found
}

/// The contents of the plain string literals on one line (no escapes handled: enough for
/// scripts, which hold none).
fn string_literals(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('"') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('"') else { break };
        out.push(&after[..end]);
        rest = &after[end + 1..];
    }
    out
}

/// The first word of each command of a one-line shell script (split on `;`, `&&`, `||`, `|`),
/// past `VAR=value` assignments; words from format placeholders (`{}`) or variables (`$x`)
/// are skipped, as are shell builtins.
pub fn shell_programs(script: &str) -> Vec<String> {
    script
        .split([';', '|', '&'])
        .filter_map(|cmd| {
            cmd.split_whitespace()
                .find(|w| !w.contains('='))
                .map(str::to_string)
        })
        .filter(|w| {
            !w.starts_with('{')
                && !w.starts_with('$')
                && !w.starts_with('\'')
                && !SHELL_BUILTINS.contains(&w.as_str())
        })
        .collect()
}

/// Every `.rs` file under `root`, `target/` left out.
pub fn rust_sources(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name();
            if p.is_dir() {
                if name != "target" && !name.to_string_lossy().starts_with('.') {
                    dirs.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provision::programs::{PROGRAMS, Program, program};

    #[test]
    fn each_call_shape_is_found() {
        let src = r#"
            let a = Command::new("alpha").arg("x");
            let b = tokio::process::Command::new("beta");
            n.cmd("gamma").args(["-a"]);
            clean("delta").status();
            let out = sh(&["epsilon", "x"]);
            if !sh(&["epsilon2"]).status.success() {}
            run(&["zeta", "netns", "add"]);
            fresh(&["not-a-program"]);
            // Command::new("commented")
            let s = format!("set -eu; modprobe tun || true; X=1 eta -v; echo hi; {} --x");
        "#;
        let names: Vec<String> = programs_in(src).into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "alpha", "beta", "gamma", "delta", "epsilon", "epsilon2", "zeta", "modprobe",
                "eta",
            ]
        );
    }

    #[test]
    fn shell_scripts_skip_builtins_placeholders_and_assignments() {
        assert_eq!(
            shell_programs("set -u; rc=0; uname -r; A=1 B=2 {} --test || rc=1; exit $rc"),
            ["uname"]
        );
        assert_eq!(shell_programs("a | b && c"), ["a", "b", "c"]);
    }

    /// The programs found in `sources` that `table` lacks, each with a place it is spawned.
    fn missing_from(table: &[Program], root: &Path) -> Vec<String> {
        let mut missing = Vec::new();
        for file in rust_sources(root) {
            // This file's own tests spawn nothing: their sources are examples.
            if file.ends_with("xtask/src/spawned.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (name, line) in programs_in(&text) {
                if !table.iter().any(|p| p.name == name) {
                    let rel = file.strip_prefix(root).unwrap_or(&file);
                    missing.push(format!("{name} ({}:{line})", rel.display()));
                }
            }
        }
        missing
    }

    fn workspace() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .into()
    }

    #[test]
    fn every_spawned_program_is_in_the_table() {
        let missing = missing_from(PROGRAMS, &workspace());
        assert!(
            missing.is_empty(),
            "spawned but not in xtask/src/provision/programs.rs (so nothing installs them on a fresh \
             machine): {missing:?}"
        );
    }

    /// The check can fail: the table without modprobe (the row whose absence broke CI on a
    /// fresh machine) misses it where the sources spawn it.
    #[test]
    fn a_program_left_out_of_the_table_is_caught() {
        assert!(program("modprobe").is_some());
        let without: Vec<Program> = PROGRAMS
            .iter()
            .filter(|p| p.name != "modprobe")
            .copied()
            .collect();
        let missing = missing_from(&without, &workspace());
        assert!(
            missing.iter().any(|m| m.starts_with("modprobe (")),
            "{missing:?}"
        );
        assert!(missing.iter().all(|m| m.starts_with("modprobe (")));
    }

    #[test]
    fn the_table_names_each_program_once() {
        for (i, p) in PROGRAMS.iter().enumerate() {
            assert!(
                PROGRAMS[..i].iter().all(|q| q.name != p.name),
                "{} twice",
                p.name
            );
        }
    }
}
