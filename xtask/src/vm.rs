//! The VM: Debian's kernel booted with virtme-ng under qemu, sharing the host's filesystem, so
//! the test binaries built here run inside it as they are.
//!
//! /dev/kvm on these machines cannot run a stock kernel (see ../shared/notes/toolchain.md):
//! software emulation unless IPOIB_VM_KVM=1.

use std::{
    io::{BufRead as _, BufReader, Read},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::{StatusOk as _, cargo, is_root, provision};

/// The newest Debian 6.1 kernel image installed.
pub fn kernel() -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/boot")
        .context("reading /boot")?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-6.1."))
        })
        .collect();
    found.sort();
    found
        .pop()
        .context("no /boot/vmlinuz-6.1.* (cargo xtask provision --vm installs linux-image-amd64)")
}

/// Builds the test binaries and returns the executables of the named test targets.
fn test_binaries(root: &Path, targets: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    let out = cargo(root)
        .args([
            "test",
            "-p",
            "ipoib-tests",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut bins = Vec::new();
    for line in out.stdout.split(|b| *b == b'\n') {
        let Ok(msg) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        if let (Some(exe), true) = (msg["executable"].as_str(), targets.contains(&name)) {
            bins.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    for t in targets {
        if !bins.iter().any(|(n, _)| n == t) {
            bail!("test target {t} was not built");
        }
    }
    // In the order asked for (cargo reports them as they finish building): a run that
    // fails because of what an earlier binary left behind is then repeatable.
    bins.sort_by_key(|(n, _)| targets.iter().position(|t| t == n));
    Ok(bins)
}

/// Test targets run in the VM.
pub const TARGETS: &[&str] = &[
    "fastpath", "lab", "netlink", "upgrade", "verbs", "cm", "engine", "hybrid",
];

pub fn test(root: &Path, only: &[String], filters: &[String], nocapture: bool) -> Result<()> {
    for f in filters {
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        if f.is_empty() || !f.chars().all(ok) {
            bail!("--filter takes a test name or part of one (letters, digits, _ and ::): `{f}`");
        }
    }
    if !is_root() {
        bail!("the VM tests need root (the lab inside builds network namespaces)");
    }
    provision::run(provision::Scope { vm: true })?;
    cargo(root)
        .args(["build", "-q", "-p", "ipoib-ctl", "--bins"])
        .status_ok("cargo build ipoib-ctl")?;
    let targets: Vec<&str> = if only.is_empty() {
        TARGETS.to_vec()
    } else {
        for t in only {
            if !TARGETS.contains(&t.as_str()) {
                bail!(
                    "unknown VM test target `{t}` (targets: {})",
                    TARGETS.join(", ")
                );
            }
        }
        only.iter().map(String::as_str).collect()
    };
    let bins = test_binaries(root, &targets)?;
    let names: Vec<&str> = bins.iter().map(|(n, _)| n.as_str()).collect();
    let mut seen = Progress::new(&names);
    match run(root, &test_script(&bins, filters, nocapture), |line| {
        seen.see(line)
    }) {
        Err(e) if e.is::<Frozen>() => {
            // A VM that hangs in its boot (as when its script was cut by the kernel command
            // line's limit), freezes or locks up is given one more boot, for the binaries that
            // had not finished: the one it froze in and those after it (a second boot of
            // everything cost 7 minutes in CI). One that failed before still fails the run.
            let rest: Vec<(String, PathBuf)> = bins
                .iter()
                .filter(|(n, _)| seen.unfinished(n))
                .cloned()
                .collect();
            let before = format!(
                "passed before: {}; failed before: {}",
                listed(seen.passed.iter().map(String::as_str)),
                listed(seen.failed.iter().map(String::as_str)),
            );
            if rest.is_empty() {
                // Frozen after the last binary's summary (on its way down).
                println!("==> {e}: every binary had finished ({before})");
            } else {
                println!(
                    "==> {e}: booting it again (once) for {} ({before})",
                    listed(rest.iter().map(|(n, _)| n.as_str())),
                );
                run(root, &test_script(&rest, filters, nocapture), |_| {})
                    .context("tests failed inside the VM (second boot)")?;
            }
            if !seen.failed.is_empty() {
                bail!(
                    "tests failed inside the VM before it froze: {}",
                    seen.failed.join(", ")
                );
            }
        }
        r => r.context("tests failed inside the VM")?,
    }
    println!("==> VM tests passed");
    Ok(())
}

/// The script that runs `bins` in one boot; its status is the run's status.
fn test_script(bins: &[(String, PathBuf)], filters: &[String], nocapture: bool) -> String {
    // The engine's TUN device needs the tun module (devtmpfs then makes /dev/net/tun).
    // The kernel's warnings and errors go to the log as they come (a lockup in rdma_rxe
    // would otherwise show only as a test that never ends).
    // Every 2 minutes, the processes that have run longer than that (the test binaries and
    // the lab's daemons aside): what a test that hangs waits on.
    // A netfilter input hook held for the whole boot: see [`KEEP_HOOKS`].
    let mut script = String::from(
        "set -u; rc=0; uname -r; modprobe tun || true; \
         dmesg -w --level=emerg,alert,crit,err,warn & \
         (while sleep 120; do ps -eo etimes=,pid=,stat=,wchan:32=,args= | \
         while read -r t rest; do case \"$rest\" in *' attach '*|*' --test-threads'*|*'['*|\
         *virtme*|*udevd*|*dmesg*|*/target/vm/script-*) ;; \
         *) [ \"$t\" -gt 120 ] && echo \"[long-running] ${t}s $rest\";; esac; done; done) & ",
    );
    script.push_str(KEEP_HOOKS);
    // Each binary within 45 minutes (the hybrid suite takes about 17): a test that hangs
    // fails the run, with the watchdog's list of what it waited on, inside CI's 90.
    for (name, exe) in bins {
        script.push_str(&format!(
            "echo '==> {name} on '$(uname -r); IPOIB_REQUIRE_BPF=1 IPOIB_REQUIRE_RDMA=1 \
             timeout -s KILL 2700 {} --test-threads=1 {} {} || rc=1; ",
            exe.display(),
            if nocapture { "--nocapture" } else { "" },
            filters.join(" ")
        ));
    }
    script.push_str("exit $rc");
    script
}

/// An input hook registered in the VM's own namespace for the whole boot, so that no test's
/// nftables table flips the kernel's static key for input hooks. Flipping it patches code
/// (`ip_local_deliver`'s jump label) while the other CPU may be running it, and under qemu's
/// emulation that froze the VM: twice in CI (ksoftirqd stuck for good at that very
/// instruction, `ip_local_deliver+0x5c`, its registers unchanged for minutes, while a hybrid
/// test's `nft` added its table), and here in a loop adding and deleting such a table in a
/// namespace under veth traffic (frozen, silent, after 140-150 rounds and after 150-160 in two
/// runs; with this hook held, 420 rounds ran). The hook accepts everything, and no test's
/// namespace sees it.
const KEEP_HOOKS: &str = "{ nft add table inet ipoib_vm_keys && nft add chain inet ipoib_vm_keys \
     keep '{ type filter hook input priority 0; policy accept; }'; } \
     || echo 'warning: no netfilter input hook held (nft failed): a test that adds one may \
     freeze the VM'; ";

/// What one boot's lines say of each test binary: passed (its summary said ok), failed (its
/// summary said otherwise, or the next one started without a summary: it was killed or
/// crashed), or not finished (running when the VM froze, or not started).
#[derive(Debug, Default)]
struct Progress {
    names: Vec<String>,
    running: Option<String>,
    passed: Vec<String>,
    failed: Vec<String>,
}

impl Progress {
    fn new(names: &[&str]) -> Self {
        Self {
            names: names.iter().map(|n| n.to_string()).collect(),
            ..Self::default()
        }
    }

    /// One line the VM printed on stdout.
    fn see(&mut self, line: &str) {
        // "==> NAME on 6.1.0-57-amd64", printed by the script before each binary.
        let started = line
            .strip_prefix("==> ")
            .and_then(|r| r.split_once(" on "))
            .map(|(n, _)| n)
            .filter(|n| self.names.iter().any(|m| m == n));
        if let Some(name) = started {
            if let Some(before) = self.running.replace(name.to_string()) {
                self.failed.push(before);
            }
        } else if let Some(result) = line.strip_prefix("test result: ")
            && let Some(name) = self.running.take()
        {
            if result.starts_with("ok.") {
                self.passed.push(name);
            } else {
                self.failed.push(name);
            }
        }
    }

    fn unfinished(&self, name: &str) -> bool {
        !self.passed.iter().chain(&self.failed).any(|n| n == name)
    }
}

/// Names for a message, "none" for none.
fn listed<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let v: Vec<&str> = names.collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// How long the VM may print nothing before it is taken as frozen: longer than the boot (about
/// a minute) and than any test runs without a line (the longest about 3 minutes; the watchdog
/// in the test script lists long-running processes every 2). `IPOIB_VM_SILENCE_SECS` sets it.
fn silence() -> Duration {
    let secs = std::env::var("IPOIB_VM_SILENCE_SECS").ok();
    Duration::from_secs(secs.and_then(|s| s.parse().ok()).unwrap_or(600))
}

/// The VM stopped making progress and was killed: it printed nothing for [`silence`], or
/// its kernel reported a CPU locked up for [`LOCKUP`].
#[derive(Debug)]
pub enum Frozen {
    Silent(Duration),
    LockedUp(String),
}

impl std::fmt::Display for Frozen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Silent(d) => write!(
                f,
                "the VM printed nothing for {d:?} and was killed (frozen)"
            ),
            Self::LockedUp(line) => write!(
                f,
                "the VM's kernel locked up and the VM was killed (frozen): {line}"
            ),
        }
    }
}

impl std::error::Error for Frozen {}

/// How long a CPU of the VM may be reported stuck before the VM counts as frozen. Seen twice
/// in CI (Debian 6.1 under emulation): ksoftirqd stuck for good at one instruction of the
/// veth's receive path (`ip_local_deliver+0x5c`), the tests on that CPU's network waiting till
/// the 45-minute limit (the cause, and what now avoids it: [`KEEP_HOOKS`]). A lockup that long
/// does not end; a test that waits on one fails anyway.
const LOCKUP: u64 = 120;

/// The seconds a kernel soft lockup report says a CPU was stuck ("watchdog: BUG: soft lockup
/// - CPU#1 stuck for 71s! [ksoftirqd/1:21]").
fn lockup_secs(line: &str) -> Option<u64> {
    let rest = &line[line.find("soft lockup - CPU#")?..];
    let after = &rest[rest.find(" stuck for ")? + " stuck for ".len()..];
    after[..after.find("s!")?].parse().ok()
}

/// Sends each line of `r` to `tx`, marked as stdout or not.
fn lines_to(r: impl Read + Send + 'static, stdout: bool, tx: mpsc::Sender<(bool, String)>) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send((stdout, line)).is_err() {
                return;
            }
        }
    });
}

/// Boots Debian's 6.1 kernel and runs `script` (bash) inside, with the host's filesystem and
/// this directory shared. Every line the VM prints is echoed with a `[vm]` prefix and stdout
/// lines are passed to `on_line`. Fails if the VM did not boot (the script must print a line
/// starting with `==> `) or the script exits non-zero.
pub fn run(root: &Path, script: &str, mut on_line: impl FnMut(&str)) -> Result<()> {
    // The script goes in a file the VM reads through the shared filesystem: vng passes
    // --exec on the kernel command line, which holds 2048 bytes, and a longer script (six test
    // binaries and the watchdog) was cut there: the VM then hung in its boot, printing nothing.
    let file = root
        .join("target/vm")
        .join(format!("script-{}.sh", std::process::id()));
    std::fs::create_dir_all(file.parent().expect("a parent"))?;
    std::fs::write(&file, script).with_context(|| format!("writing {}", file.display()))?;
    let kernel = kernel()?;
    println!(
        "==> booting {} in a VM (software emulation: about a minute to boot)",
        kernel.display()
    );
    let mut vng = Command::new("vng");
    if std::env::var("IPOIB_VM_KVM").as_deref() != Ok("1") {
        vng.arg("--disable-kvm");
    }
    let mut child = vng
        .arg("-r")
        .arg(&kernel)
        .args(["--cpus", "2", "--memory", "2G", "--exec"])
        .arg(format!("bash {}", file.display()))
        .current_dir(root)
        .stdin(Stdio::null())
        // Both piped, never inherited: vng/qemu reopen a file behind their output with
        // O_TRUNC, which wiped everything before the VM run from a CI log (seen here).
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: vng and the qemu it starts are killed together if frozen.
        .process_group(0)
        .spawn()
        .context("starting vng (cargo xtask provision --vm installs virtme-ng)")?;
    let (tx, rx) = mpsc::channel();
    lines_to(child.stdout.take().expect("stdout"), true, tx.clone());
    lines_to(child.stderr.take().expect("stderr"), false, tx);
    let mut booted = false;
    let quiet = silence();
    let frozen = loop {
        match rx.recv_timeout(quiet) {
            Ok((true, line)) => {
                booted |= line.starts_with("==> ");
                println!("[vm] {line}");
                on_line(&line);
                if lockup_secs(&line).is_some_and(|s| s >= LOCKUP) {
                    break Some(Frozen::LockedUp(line));
                }
            }
            Ok((false, line)) => eprintln!("[vm] {line}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => break None,
            Err(mpsc::RecvTimeoutError::Timeout) => break Some(Frozen::Silent(quiet)),
        }
    };
    if let Some(frozen) = frozen {
        // SAFETY: plain kill(2) of the group spawned above.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
        let _ = std::fs::remove_file(&file);
        return Err(frozen.into());
    }
    let status = child.wait()?;
    let _ = std::fs::remove_file(&file);
    if !booted {
        bail!("the VM did not boot or ran nothing ({status})");
    }
    if !status.success() {
        bail!("the script inside the VM failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boot_tells_which_binaries_passed_failed_or_never_finished() {
        let mut p = Progress::new(&["lab", "verbs", "cm", "engine", "hybrid"]);
        for line in [
            "6.1.0-57-amd64",
            "==> lab on 6.1.0-57-amd64",
            "test a ... ok",
            "test result: ok. 10 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out",
            // Killed by its timeout: no summary before the next binary starts.
            "==> verbs on 6.1.0-57-amd64",
            "==> cm on 6.1.0-57-amd64",
            "test result: FAILED. 10 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out",
            // A test's own output that looks like the script's is not a binary.
            "==> booting on the other node",
            "==> engine on 6.1.0-57-amd64",
            "test b ... ",
        ] {
            p.see(line);
        }
        assert_eq!(p.passed, ["lab"]);
        assert_eq!(p.failed, ["verbs", "cm"]);
        let unfinished: Vec<&str> = ["lab", "verbs", "cm", "engine", "hybrid"]
            .into_iter()
            .filter(|n| p.unfinished(n))
            .collect();
        assert_eq!(unfinished, ["engine", "hybrid"]);
        assert_eq!(listed(p.failed.iter().map(String::as_str)), "verbs, cm");
        assert_eq!(listed(std::iter::empty()), "none");
    }

    #[test]
    fn a_soft_lockup_report_gives_its_seconds() {
        let seen =
            "[  328.639665] watchdog: BUG: soft lockup - CPU#1 stuck for 71s! [ksoftirqd/1:21]";
        assert_eq!(lockup_secs(seen), Some(71));
        assert_eq!(
            lockup_secs("watchdog: BUG: soft lockup - CPU#0 stuck for 305s! [qemu:1]"),
            Some(305)
        );
        for other in [
            "[  276.188393] rcu: INFO: rcu_preempt self-detected stall on CPU",
            "test soft lockup - CPU#1 stuck for ... ok",
            "soft lockup - CPU#1 stuck for xs! [a]",
            "",
        ] {
            assert_eq!(lockup_secs(other), None, "{other}");
        }
    }
}
