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
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{StatusOk as _, cargo, is_root, provision, slow::CpuCap};

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

/// Tests the VM does not run again: they check the CLI's own logic (bad input, privilege,
/// status across namespaces) and its talk with systemd (sd_notify), which no kernel version
/// changes, and run on this machine's kernel in the same `cargo xtask test`.
const HOST_ONLY: &[(&str, &[&str])] = &[(
    "lab",
    &[
        "bad_input_is_refused_and_changes_nothing",
        "without_root_every_command_says_so",
        "status_tells_a_gone_interface_from_one_elsewhere",
        "systemd_hears_ready_after_attach_and_a_watchdog_while_the_loop_turns",
    ],
)];

/// libtest's `--skip` arguments for the tests of `target` that run on this machine only.
fn host_only_skips(target: &str) -> String {
    HOST_ONLY
        .iter()
        .filter(|(t, _)| *t == target)
        .flat_map(|(_, tests)| tests.iter())
        .map(|t| format!(" --skip {t}"))
        .collect()
}

/// Test targets run in the VM.
pub const TARGETS: &[&str] = &[
    "fastpath", "lab", "netlink", "upgrade", "verbs", "cm", "engine", "hybrid",
];

/// What `vm-test` runs, and how.
#[derive(Debug, Default)]
pub struct Run {
    /// Test targets (all of [`TARGETS`] when empty).
    pub targets: Vec<String>,
    /// libtest's name filters.
    pub filters: Vec<String>,
    /// The slow-machine mode's factor ([`CpuCap`]), or None to run at full speed.
    pub slow: Option<f64>,
    /// The long run: the ignored tests too (scenarios on their second receive model), and
    /// the full rounds of those the suite runs shorter (IPOIB_TEST_LONG=1).
    pub long: bool,
    /// Variables for the tests inside the VM (NAME, value: digits, letters, `_` only).
    pub env: Vec<(String, String)>,
}

pub fn test(root: &Path, r: &Run) -> Result<()> {
    let plain = |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if let Some((k, v)) = r.env.iter().find(|(k, v)| !plain(k) || !plain(v)) {
        bail!("a VM test variable must be plain (letters, digits, _): {k}={v}");
    }
    for f in &r.filters {
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        if f.is_empty() || !f.chars().all(ok) {
            bail!("--filter takes a test name or part of one (letters, digits, _ and ::): `{f}`");
        }
    }
    if !is_root() {
        bail!("the VM tests need root (the lab inside builds network namespaces)");
    }
    let targets: Vec<&str> = if r.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        for t in &r.targets {
            if !TARGETS.contains(&t.as_str()) {
                bail!(
                    "unknown VM test target `{t}` (targets: {})",
                    TARGETS.join(", ")
                );
            }
        }
        r.targets.iter().map(String::as_str).collect()
    };
    // Before anything is built: a machine without the cgroup controller says so at once.
    let cap = r.slow.map(CpuCap::new).transpose()?;
    provision::run(provision::Scope { vm: true })?;
    cargo(root)
        .args(["build", "-q", "-p", "ipoib-ctl", "--bins"])
        .status_ok("cargo build ipoib-ctl")?;
    let bins = test_binaries(root, &targets)?;
    let names: Vec<&str> = bins.iter().map(|(n, _)| n.as_str()).collect();
    let mut seen = Progress::new(&names);
    let work = crate::slow::workload();
    let t0 = Instant::now();
    // What each test prints shows as it runs, a failure's message too: a binary killed at
    // its timeout would take captured output with it.
    let mut args = r.filters.clone();
    args.push("--nocapture".into());
    if r.long {
        args.push("--include-ignored".into());
    }
    let result = match run(
        root,
        &test_script(&bins, &args, r.long, &r.env),
        cap.as_ref(),
        |line| seen.see(line, t0.elapsed()),
    ) {
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
            let failed_before = seen.failed.clone();
            let again = if rest.is_empty() {
                // Frozen after the last binary's summary (on its way down).
                println!("==> {e}: every binary had finished ({before})");
                Ok(())
            } else {
                println!(
                    "==> {e}: booting it again (once) for {} ({before})",
                    listed(rest.iter().map(|(n, _)| n.as_str())),
                );
                run(
                    root,
                    &test_script(&rest, &args, r.long, &r.env),
                    cap.as_ref(),
                    |line| seen.see(line, t0.elapsed()),
                )
                .context("tests failed inside the VM (second boot)")
            };
            again.and_then(|()| {
                if failed_before.is_empty() {
                    Ok(())
                } else {
                    bail!(
                        "tests failed inside the VM before it froze: {}",
                        failed_before.join(", ")
                    )
                }
            })
        }
        r => r.context("tests failed inside the VM"),
    };
    print!("{}", seen.report(t0.elapsed(), cap.as_ref()));
    println!(
        "==> this machine took {} ms for xtask's fixed workload on one CPU before the run \
         (larger is slower; docs/testing.md has earlier machines')",
        work.as_millis()
    );
    result?;
    println!("==> VM tests passed");
    Ok(())
}

/// The script that runs `bins` in one boot, each with libtest's `args`; its status is the
/// run's status.
fn test_script(
    bins: &[(String, PathBuf)],
    args: &[String],
    long: bool,
    env: &[(String, String)],
) -> String {
    let env: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
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
    // Each binary within 45 minutes: a test that hangs fails the run, with the watchdog's
    // list of what it waited on, inside CI's 90. Each test's time is libtest's own
    // (--report-time), unstable, so unlocked for the stable-built binaries by RUSTC_BOOTSTRAP.
    for (name, exe) in bins {
        script.push_str(&format!(
            "echo '==> {name} on '$(uname -r); {env}IPOIB_REQUIRE_BPF=1 IPOIB_REQUIRE_RDMA=1 \
             IPOIB_TEST_LONG={} RUSTC_BOOTSTRAP=1 timeout -s KILL 2700 {} --test-threads=1 \
             -Z unstable-options --report-time {}{} || rc=1; ",
            u8::from(long),
            exe.display(),
            args.join(" "),
            host_only_skips(name)
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

/// What the boots' lines say of each test binary: passed (its summary said ok), failed (its
/// summary said otherwise, or the next one started without a summary: it was killed or
/// crashed), or not finished (running when the VM froze, or not started); and how long each
/// binary and each test took.
#[derive(Debug, Default)]
struct Progress {
    names: Vec<String>,
    /// The binary running, and when it started (time since the run began).
    running: Option<(String, Duration)>,
    passed: Vec<String>,
    failed: Vec<String>,
    /// Each binary's time, from its start line to its summary.
    binaries: Vec<(String, Duration)>,
    /// Each test's time, as libtest reports it: (binary, test, time).
    tests: Vec<(String, String, Duration)>,
    /// A test whose line began ("test NAME ... ") and whose result has not come yet: what it
    /// printed, or the kernel did, came in between (the VM shows each test's output as it
    /// runs).
    pending: Option<String>,
}

impl Progress {
    fn new(names: &[&str]) -> Self {
        Self {
            names: names.iter().map(|n| n.to_string()).collect(),
            ..Self::default()
        }
    }

    /// One line the VM printed on stdout, `at` this long after the run began.
    fn see(&mut self, line: &str, at: Duration) {
        // "==> NAME on 6.1.0-57-amd64", printed by the script before each binary.
        let started = line
            .strip_prefix("==> ")
            .and_then(|r| r.split_once(" on "))
            .map(|(n, _)| n)
            .filter(|n| self.names.iter().any(|m| m == n));
        if let Some(name) = started {
            if let Some((before, _)) = self.running.replace((name.to_string(), at)) {
                self.failed.push(before);
            }
        } else if let Some(result) = line.strip_prefix("test result: ")
            && let Some((name, since)) = self.running.take()
        {
            self.binaries.push((name.clone(), at.saturating_sub(since)));
            if result.starts_with("ok.") {
                self.passed.push(name);
            } else {
                self.failed.push(name);
            }
        } else if let Some((test, took)) = test_time(line)
            && let Some((bin, _)) = &self.running
        {
            self.pending = None;
            self.tests.push((bin.clone(), test.to_string(), took));
        } else if let Some(test) = test_started(line) {
            self.pending = Some(test.to_string());
        } else if let Some(took) = result_time(line)
            && let (Some((bin, _)), Some(test)) = (&self.running, self.pending.take())
        {
            self.tests.push((bin.clone(), test, took));
        }
    }

    fn unfinished(&self, name: &str) -> bool {
        !self.passed.iter().chain(&self.failed).any(|n| n == name)
    }

    /// Each binary's time, then the ten slowest tests, after a run of `total`.
    fn report(&self, total: Duration, cap: Option<&CpuCap>) -> String {
        let mut out = format!(
            "==> VM run: {:.0} s in all{}\n",
            total.as_secs_f64(),
            cap.map(|c| {
                let throttled = c
                    .throttled()
                    .map(|t| format!("; throttled in {:.0}% of its periods", t * 100.0))
                    .unwrap_or_default();
                format!(" ({}{throttled})", c.describe())
            })
            .unwrap_or_default()
        );
        for (bin, took) in &self.binaries {
            let n = self.tests.iter().filter(|(b, ..)| b == bin).count();
            out += &format!("    {:>7.1} s  {bin} ({n} tests)\n", took.as_secs_f64());
        }
        let mut slowest: Vec<_> = self.tests.iter().collect();
        slowest.sort_by_key(|t| std::cmp::Reverse(t.2));
        if !slowest.is_empty() {
            out += "==> the ten slowest tests:\n";
        }
        for (bin, test, took) in slowest.into_iter().take(10) {
            out += &format!("    {:>7.1} s  {bin}::{test}\n", took.as_secs_f64());
        }
        out
    }
}

/// A test's name and time from libtest's line for it under --report-time
/// (`test hybrid_x::srq ... ok <12.345s>`).
fn test_time(line: &str) -> Option<(&str, Duration)> {
    let (name, rest) = line.strip_prefix("test ")?.split_once(" ... ")?;
    let secs = rest.rsplit_once(" <")?.1.strip_suffix("s>")?;
    Some((name, Duration::try_from_secs_f64(secs.parse().ok()?).ok()?))
}

/// The test a libtest line begins (`test NAME ... `, the rest of the line anything but its
/// result: the test's own output, or the kernel's).
fn test_started(line: &str) -> Option<&str> {
    let (name, _) = line.strip_prefix("test ")?.split_once(" ... ")?;
    Some(name)
}

/// The time of a result that came on a line of its own (`ok <12.345s>`, `FAILED <3.000s>`),
/// after its test's output.
fn result_time(line: &str) -> Option<Duration> {
    let (status, rest) = line.trim().split_once(" <")?;
    if !matches!(status, "ok" | "FAILED") {
        return None;
    }
    let secs = rest.strip_suffix("s>")?;
    Duration::try_from_secs_f64(secs.parse().ok()?).ok()
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
/// starting with `==> `) or the script exits non-zero. With `cap`, the VM runs inside it.
pub fn run(
    root: &Path,
    script: &str,
    cap: Option<&CpuCap>,
    mut on_line: impl FnMut(&str),
) -> Result<()> {
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
    if let Some(cap) = cap {
        println!("==> {}", cap.describe());
        cap.hold(&mut vng);
    }
    let mut child = vng
        .arg("-r")
        .arg(&kernel)
        .args([
            "--cpus",
            &crate::slow::VM_CPUS.to_string(),
            "--memory",
            "2G",
            "--exec",
        ])
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
            p.see(line, Duration::ZERO);
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
    fn each_binary_and_test_has_its_time_and_the_slowest_come_first() {
        let mut p = Progress::new(&["cm", "hybrid"]);
        let s = Duration::from_secs;
        for (at, line) in [
            (0, "==> cm on 6.1.0-57-amd64"),
            (5, "test a ... ok <4.500s>"),
            (9, "test b ... FAILED <3.000s>"),
            (
                10,
                "test result: FAILED. 1 passed; 1 failed; finished in 10.00s",
            ),
            (11, "==> hybrid on 6.1.0-57-amd64"),
            // Not a test's line: its own output, or libtest without --report-time.
            (12, "test c ... ok"),
            (13, "test d ... ok <x>"),
            (40, "test e::srq ... ok <28.250s>"),
            // A test's output, then its result on a line of its own.
            (
                41,
                "test f ... [ 2976.2] hrtimer: interrupt took 21656910 ns",
            ),
            (42, "the port up: connected mode on both after 3.4s"),
            (43, "thread 'f' panicked at tests/x.rs:1:1:"),
            (44, "FAILED <3.500s>"),
            // A result with no test begun is nobody's.
            (45, "ok <9.000s>"),
            (46, "test g ... "),
            (47, "ok <x>"),
            (48, "ignored, the scenario on its second model"),
            (51, "test result: ok. 2 passed; 0 failed"),
        ] {
            p.see(line, s(at));
        }
        assert_eq!(p.binaries, [("cm".into(), s(10)), ("hybrid".into(), s(40))]);
        let tests: Vec<(&str, &str, f64)> = p
            .tests
            .iter()
            .map(|(b, t, d)| (b.as_str(), t.as_str(), d.as_secs_f64()))
            .collect();
        assert_eq!(
            tests,
            [
                ("cm", "a", 4.5),
                ("cm", "b", 3.0),
                ("hybrid", "e::srq", 28.25),
                ("hybrid", "f", 3.5)
            ]
        );
        let report = p.report(s(52), None);
        assert_eq!(
            report,
            "==> VM run: 52 s in all\n\
             \x20      10.0 s  cm (2 tests)\n\
             \x20      40.0 s  hybrid (2 tests)\n\
             ==> the ten slowest tests:\n\
             \x20      28.2 s  hybrid::e::srq\n\
             \x20       4.5 s  cm::a\n\
             \x20       3.5 s  hybrid::f\n\
             \x20       3.0 s  cm::b\n"
        );
    }

    #[test]
    fn the_vm_skips_only_the_host_only_tests_of_their_target() {
        let bins = [
            ("lab".to_string(), PathBuf::from("/t/lab-1")),
            ("hybrid".to_string(), PathBuf::from("/t/hybrid-1")),
        ];
        let script = test_script(&bins, &["--nocapture".into()], false, &[]);
        let line = |name: &str| {
            script
                .split("; ")
                .find(|c| c.contains(&format!("/t/{name}-1")))
                .unwrap()
                .to_string()
        };
        let lab = line("lab");
        for t in HOST_ONLY[0].1 {
            assert!(lab.contains(&format!("--skip {t}")), "{lab}");
        }
        assert!(lab.contains("--nocapture"), "{lab}");
        assert!(!line("hybrid").contains("--skip"), "{}", line("hybrid"));
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
