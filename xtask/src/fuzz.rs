//! `cargo xtask fuzz`: every target of `fuzz/` in turn under libFuzzer (cargo-fuzz, nightly),
//! for a share of the time each; prints and saves executions and findings per target.
//!
//! The seed corpus in the repository (`fuzz/corpus/TARGET`) is read, never written: what the
//! fuzzer adds goes to `target/fuzz/corpus/TARGET`, kept between runs, and a finding to
//! `target/fuzz/artifacts/TARGET`, to be copied into `fuzz/regressions/TARGET` once fixed
//! (the test suite runs every file there).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::{StatusOk as _, cargo};

/// The cargo-fuzz this project was checked with.
const CARGO_FUZZ: &str = "0.13.2";

/// libFuzzer's limits: an input's allocation past this is a finding (nothing may allocate
/// without bound from a length the input gave), and so is a process past the RSS one.
const MALLOC_LIMIT_MB: u32 = 64;
const RSS_LIMIT_MB: u32 = 1024;

/// One target's run.
#[derive(Debug, Clone)]
pub struct TargetRun {
    pub target: String,
    pub seconds: u64,
    pub executions: u64,
    pub per_second: u64,
    pub corpus: usize,
    /// Inputs that failed the property (crash, leak, timeout or out-of-memory files).
    pub findings: Vec<PathBuf>,
}

pub fn run(root: &Path, seconds: u64, only: &[String]) -> Result<()> {
    ensure_cargo_fuzz(root)?;
    let targets = targets(root)?;
    let chosen: Vec<&String> = if only.is_empty() {
        targets.iter().collect()
    } else {
        for t in only {
            if !targets.contains(t) {
                bail!("no fuzz target {t:?} (there are: {})", targets.join(", "));
            }
        }
        targets.iter().filter(|t| only.contains(t)).collect()
    };
    let each = (seconds / chosen.len() as u64).max(1);
    println!("==> cargo +nightly fuzz build (no sanitizer: the decoders are safe Rust)");
    fuzz_cmd(root)
        .args(["build", "-s", "none", "--fuzz-dir", "fuzz"])
        .status_ok("cargo fuzz build")?;
    let mut runs = Vec::new();
    for (i, target) in chosen.iter().enumerate() {
        println!("==> [{}/{}] {target}: {each} s", i + 1, chosen.len());
        runs.push(run_target(root, target, each)?);
    }
    println!(
        "\n{:<10} {:>8} {:>12} {:>10} {:>7} {:>8}",
        "target", "seconds", "executions", "per s", "corpus", "findings"
    );
    for r in &runs {
        println!(
            "{:<10} {:>8} {:>12} {:>10} {:>7} {:>8}",
            r.target,
            r.seconds,
            r.executions,
            r.per_second,
            r.corpus,
            r.findings.len()
        );
    }
    let out = root.join("target/fuzz/fuzz.json");
    let json: Vec<serde_json::Value> = runs
        .iter()
        .map(|r| {
            serde_json::json!({
                "target": r.target, "seconds": r.seconds, "executions": r.executions,
                "per_second": r.per_second, "corpus": r.corpus,
                "findings": r.findings.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            })
        })
        .collect();
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    println!("saved {}", out.display());
    let found: Vec<_> = runs.iter().flat_map(|r| &r.findings).collect();
    if !found.is_empty() {
        for f in &found {
            println!("FINDING {}", f.display());
        }
        bail!(
            "{} finding(s): fix each, then copy it into fuzz/regressions/TARGET (the test \
             suite runs them); `cargo +nightly fuzz run -s none --fuzz-dir fuzz TARGET FILE` \
             replays one",
            found.len()
        );
    }
    Ok(())
}

fn fuzz_cmd(root: &Path) -> Command {
    let mut c = Command::new("rustup");
    c.args(["run", "nightly", "cargo", "fuzz"])
        .current_dir(root);
    c
}

fn ensure_cargo_fuzz(root: &Path) -> Result<()> {
    let there = fuzz_cmd(root)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !there {
        println!("==> cargo install cargo-fuzz {CARGO_FUZZ}");
        cargo(root)
            .args(["install", "--locked", "cargo-fuzz", "--version", CARGO_FUZZ])
            .status_ok("cargo install cargo-fuzz")?;
    }
    Ok(())
}

/// The targets fuzz/Cargo.toml declares, in its order.
fn targets(root: &Path) -> Result<Vec<String>> {
    let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml"))?;
    let names: Vec<String> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|b| {
            b.lines()
                .find_map(|l| l.trim().strip_prefix("name = "))
                .map(|n| n.trim_matches('"').to_owned())
        })
        .collect();
    if names.is_empty() {
        bail!("no [[bin]] target in fuzz/Cargo.toml");
    }
    Ok(names)
}

fn run_target(root: &Path, target: &str, seconds: u64) -> Result<TargetRun> {
    let work = root.join("target/fuzz/corpus").join(target);
    let artifacts = root.join("target/fuzz/artifacts").join(target);
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&artifacts)?;
    let before = files(&artifacts)?;
    let log = root.join(format!("target/fuzz/{target}.log"));
    let status = fuzz_cmd(root)
        .args(["run", "-s", "none", "--fuzz-dir", "fuzz", target])
        .arg(&work)
        .arg(root.join("fuzz/corpus").join(target))
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg(format!("-malloc_limit_mb={MALLOC_LIMIT_MB}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .status()
        .context("could not start cargo fuzz run")?;
    let said = String::from_utf8_lossy(&std::fs::read(&log)?).into_owned();
    let stat = |name: &str| -> u64 {
        said.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let findings: Vec<PathBuf> = files(&artifacts)?
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    if !status.success() && findings.is_empty() {
        bail!(
            "{target}: cargo fuzz run failed ({status}) without a finding; see {}",
            log.display()
        );
    }
    Ok(TargetRun {
        target: target.to_owned(),
        seconds,
        executions: stat("number_of_executed_units"),
        per_second: stat("average_exec_per_sec"),
        corpus: files(&work)?.len(),
        findings,
    })
}

fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_targets_are_read_from_the_fuzz_manifest() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let t = targets(&root).unwrap();
        assert_eq!(
            t,
            ["wire", "policy", "cm_status", "iblink", "hwaddr", "parse"]
        );
        for name in &t {
            assert!(
                root.join(format!("fuzz/fuzz_targets/{name}.rs")).exists(),
                "{name}"
            );
        }
    }
}
