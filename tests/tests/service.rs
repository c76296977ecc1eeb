//! The operator's side of `ipoib-ctl`: the systemd unit as systemd reads it, the shell
//! completions in a real bash, the man pages through groff, and the logs in a real journald.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use ipoib_tests::{lab::ctl_path, programs::output, sandbox::unit_text};

fn ctl(args: &[&str]) -> std::process::Output {
    output(Command::new(ctl_path()).args(args)).unwrap()
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ipoib-service-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `systemd-analyze verify` on an instance of the unit, its binary this build's: no error,
/// no warning about it.
#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let dir = scratch("unit");
    let unit = unit_text().replace("/usr/local/sbin/ipoib-ctl", ctl_path().to_str().unwrap());
    std::fs::write(dir.join("ipoib-ctl@.service"), &unit).unwrap();
    std::os::unix::fs::symlink("ipoib-ctl@.service", dir.join("ipoib-ctl@lo.service")).unwrap();
    let out = output(
        Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(dir.join("ipoib-ctl@lo.service"))
            .current_dir(&dir),
    )
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("systemd-analyze verify: {}\n{err}", out.status);
    let about_ours: Vec<&str> = err.lines().filter(|l| l.contains("ipoib-ctl")).collect();
    assert!(
        out.status.success() && about_ours.is_empty(),
        "systemd-analyze verify: {}\n{err}",
        out.status
    );
    // What the unit promises: notify, the watchdog, the policy file, the reload, no restart
    // on a permanent error.
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "--policy-if-present /etc/ipoib-ctl/%i.policy",
        "ExecReload=",
        "RestartPreventExitStatus=2 3 5",
        "BindsTo=sys-subsystem-net-devices-%i.device",
    ] {
        assert!(unit.contains(line), "the unit lacks {line}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `systemd-analyze security` rates the shipped unit's sandbox 5.0 or below (9.6 without
/// one; Debian's rdma-ndd, iwpmd and prometheus-node-exporter rate 9.2 to 9.3).
#[test]
fn the_unit_is_sandboxed_to_an_exposure_of_5_or_below() {
    let dir = scratch("security");
    let unit = unit_text().replace("/usr/local/sbin/ipoib-ctl", ctl_path().to_str().unwrap());
    std::fs::write(dir.join("ipoib-ctl@ib0.service"), &unit).unwrap();
    let out = output(
        Command::new("systemd-analyze")
            .args(["security", "--offline=true", "--no-pager"])
            .arg(dir.join("ipoib-ctl@ib0.service")),
    )
    .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    let level: f64 = said
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for ipoib-ctl@ib0.service: ")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure level:\n{said}{:?}", out));
    eprintln!("systemd-analyze security: {level}");
    assert!(level <= 5.0, "exposure {level}:\n{said}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The bash completion script loads in bash and completes subcommands and options.
#[test]
fn bash_completes_subcommands_and_options() {
    let out = ctl(&["completions", "bash"]);
    assert!(out.status.success(), "{out:?}");
    let dir = scratch("bash");
    let script = dir.join("ipoib-ctl.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    // What bash offers after `ipoib-ctl se<TAB>` and `ipoib-ctl attach ib0 --pol<TAB>`.
    let complete = |words: &str| -> Vec<String> {
        let sh = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
             COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}; \
             f=$(complete -p ipoib-ctl | sed -n 's/.*-F \\([^ ]*\\).*/\\1/p'); \
             $f ipoib-ctl \"${{COMP_WORDS[COMP_CWORD]}}\" \
             \"${{COMP_WORDS[COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display()
        );
        let out = output(Command::new("bash").args(["-c", &sh])).unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let subs = complete("ipoib-ctl se");
    assert_eq!(subs, ["set-policy"], "after `ipoib-ctl se`");
    let opts = complete("ipoib-ctl attach ib0 --pol");
    assert!(
        opts.contains(&"--policy".to_owned()) && opts.contains(&"--policy-if-present".to_owned()),
        "after `attach ib0 --pol`: {opts:?}"
    );
    let shells = complete("ipoib-ctl completions ''");
    assert!(shells.contains(&"zsh".to_owned()), "{shells:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The man pages render in groff with no warning and say what `--help` says.
#[test]
fn the_man_pages_render_without_warnings() {
    for page in [None, Some("attach"), Some("set-policy")] {
        let mut args = vec!["man"];
        args.extend(page);
        let roff = ctl(&args);
        assert!(roff.status.success(), "{roff:?}");
        let mut groff = Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-P-cbou"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("groff (groff-base)");
        use std::io::Write as _;
        groff.stdin.take().unwrap().write_all(&roff.stdout).unwrap();
        let out = groff.wait_with_output().unwrap();
        let (text, warn) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success() && warn.is_empty(), "{page:?}: {warn}");
        let want = match page {
            None => "Control plane of the IPoIB hybrid datapath",
            Some("attach") => "--policy-if-present",
            Some(_) => "validated whole",
        };
        assert!(text.contains(want), "{page:?} lacks {want:?}:\n{text}");
    }
    assert!(!ctl(&["man", "nosuch"]).status.success());
}

/// Logs: where stderr is the journal's stream (`JOURNAL_STREAM`, as systemd sets it), a real
/// journald (started in a mount namespace of its own, so the host's journal, if any, is not
/// touched) gets every line at its level's priority and stderr gets nothing; elsewhere stderr
/// gets the lines, with no colour codes when it is not a terminal.
#[test]
fn logs_reach_journald_with_priorities_and_stderr_without_colour() {
    use ipoib_tests::lab::lab_or_skip;
    let test = "logs_reach_journald_with_priorities_and_stderr_without_colour";
    let Some(lab) = lab_or_skip(test, "jrn", false) else {
        return;
    };
    ipoib_tests::programs::require("journalctl").unwrap();
    let journald = Path::new("/lib/systemd/systemd-journald");
    assert!(
        journald.exists(),
        "no {} (Debian's systemd)",
        journald.display()
    );
    let a = lab.a.clone();
    let dir = scratch("journal");
    let ctl = ctl_path();
    // Each run: attach for 3 s then SIGINT (info lines), then attach to a missing interface
    // (an error), stderr into a file of its own.
    let runs = |tag: &str| {
        format!(
            "nsenter --net=/run/netns/{ns} -- timeout -s INT 3 {ctl} attach {iface} \
               2>{d}/{tag}.attach || true\n\
             {ctl} attach nosuch0 2>{d}/{tag}.bad || true\n",
            ns = a.ns,
            iface = a.iface,
            ctl = ctl.display(),
            d = dir.display(),
        )
    };
    let script = format!(
        "set -eu\n\
         {plain}\
         mkdir -p /run/systemd/journal /run/log\n\
         mount -t tmpfs tmpfs /run/systemd/journal\n\
         mount -t tmpfs tmpfs /run/log\n\
         {journald} & jd=$!\n\
         for i in $(seq 100); do [ -S /run/systemd/journal/socket ] && break; sleep 0.1; done\n\
         touch {d}/j.attach {d}/j.bad\n\
         JOURNAL_STREAM=$(stat -L -c %d:%i {d}/j.attach) \
           nsenter --net=/run/netns/{ns} -- timeout -s INT 3 {ctl} attach {iface} \
           2>>{d}/j.attach || true\n\
         JOURNAL_STREAM=$(stat -L -c %d:%i {d}/j.bad) {ctl} attach nosuch0 2>>{d}/j.bad || true\n\
         sleep 0.5\n\
         journalctl -D /run/log/journal -o json --no-pager SYSLOG_IDENTIFIER=ipoib-ctl\n\
         kill $jd\n",
        plain = runs("plain"),
        journald = journald.display(),
        ns = a.ns,
        iface = a.iface,
        ctl = ctl.display(),
        d = dir.display(),
    );
    let out = output(Command::new("unshare").args(["--mount", "--", "sh", "-c", &script])).unwrap();
    let journal = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{journal}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();

    // Not a terminal: plain lines.
    let (plain, bad) = (read("plain.attach"), read("plain.bad"));
    assert!(plain.contains("control loop running"), "{plain}");
    assert!(bad.contains("nosuch0"), "{bad}");
    for (f, t) in [("plain.attach", &plain), ("plain.bad", &bad)] {
        assert!(!t.contains('\x1b'), "colour codes in {f}: {t:?}");
    }

    // The journal: every line there, at its priority; nothing on stderr.
    let entries: Vec<serde_json::Value> = journal
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let at = |needle: &str| -> Vec<String> {
        entries
            .iter()
            .filter(|e| e["MESSAGE"].as_str().is_some_and(|m| m.contains(needle)))
            .map(|e| e["PRIORITY"].as_str().unwrap_or("?").to_owned())
            .collect()
    };
    eprintln!("{} journal entries from ipoib-ctl", entries.len());
    assert_eq!(at("control loop running"), ["6"], "{journal}");
    assert_eq!(at("nosuch0"), ["3"], "{journal}");
    for f in ["j.attach", "j.bad"] {
        let t = read(f);
        assert!(
            t.is_empty(),
            "{f} got lines that belong in the journal: {t}"
        );
    }
    drop(lab);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Metrics: `attach --metrics-textfile DIR` writes what Debian's node_exporter (its textfile
/// collector) reads without error, and what it serves over HTTP on 127.0.0.1 matches
/// `status --json`.
#[test]
fn node_exporter_serves_the_metrics_and_they_match_status() {
    use std::{
        io::{Read as _, Write as _},
        time::{Duration, Instant},
    };

    use ipoib_tests::lab::{Which, lab_or_skip};
    let test = "node_exporter_serves_the_metrics_and_they_match_status";
    let Some(mut lab) = lab_or_skip(test, "met", false) else {
        return;
    };
    let dir = scratch("metrics");
    lab.attach(
        Which::A,
        &[
            "--metrics-textfile",
            dir.to_str().unwrap(),
            "--metrics-peers",
        ],
    )
    .unwrap();
    lab.attach(Which::B, &[]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let ping = a
        .cmd("ping")
        .args(["-n", "-q", "-c", "20", "-i", "0.05", "-s", "1400"])
        .arg(b.ip4.to_string())
        .output()
        .unwrap();
    assert!(ping.status.success(), "{ping:?}");

    let port = 19100 + (std::process::id() % 500) as u16;
    let listen = format!("127.0.0.1:{port}");
    let exporter = Command::new("prometheus-node-exporter")
        .arg(format!("--web.listen-address={listen}"))
        .args(["--collector.disable-defaults", "--collector.textfile"])
        .arg(format!("--collector.textfile.directory={}", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("prometheus-node-exporter (Debian's prometheus-node-exporter)");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _exporter = Kill(exporter);
    let scrape = || -> Option<String> {
        let mut c = std::net::TcpStream::connect(&listen).ok()?;
        c.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .ok()?;
        let mut body = String::new();
        c.read_to_string(&mut body).ok()?;
        Some(body)
    };
    let value = |text: &str, series: &str| -> Option<f64> {
        text.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    };
    let file = ipoib_ctl::metrics::textfile_path(&dir, &a.iface);
    // Right after the loop rewrites the file, status and the scrape see the same counters
    // (the lab is quiet once the ping is done); a stray packet in between: try again.
    let mut last = String::new();
    for attempt in 0..4 {
        let mtime = || std::fs::metadata(&file).and_then(|m| m.modified()).ok();
        let before = mtime();
        let t = Instant::now();
        while mtime() == before && t.elapsed() < Duration::from_secs(12) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_ne!(mtime(), None, "{} never written", file.display());
        let status = a.status_json().unwrap();
        let Some(text) = scrape() else {
            std::thread::sleep(Duration::from_millis(500));
            continue;
        };
        assert_eq!(
            value(&text, "node_textfile_scrape_error"),
            Some(0.0),
            "node_exporter could not read the file:\n{text}"
        );
        let reasons = status["reasons"].as_object().unwrap();
        let mut mismatch = Vec::new();
        let mut seen = 0;
        for (reason, c) in reasons {
            let series =
                |name: &str| format!("{name}{{iface=\"{}\",reason=\"{reason}\"}}", a.iface);
            for (name, key) in [
                ("ipoib_decisions_total", "packets"),
                ("ipoib_decision_bytes_total", "bytes"),
            ] {
                let want = c[key].as_u64().unwrap() as f64;
                let got = value(&text, &series(name));
                seen += usize::from(got.is_some() && want > 0.0);
                if got != Some(want) {
                    mismatch.push(format!("{}: {got:?}, status {want}", series(name)));
                }
            }
        }
        let flag = |name: &str| value(&text, &format!("{name}{{iface=\"{}\"}}", a.iface));
        if status["loop_running"] != true || flag("ipoib_loop_running") != Some(1.0) {
            mismatch.push("loop_running".into());
        }
        if flag("ipoib_failsafe_active") != Some(0.0) {
            mismatch.push("failsafe_active".into());
        }
        let to_b = format!(
            "ipoib_peer_tx_bytes_total{{iface=\"{}\",path=\"ud\",peer=\"{}\"}}",
            a.iface, b.ip4
        );
        let b_view = a.peer_json(&b.ip4.to_string()).unwrap().unwrap();
        if value(&text, &to_b) != b_view["tx_ud_bytes"].as_f64() {
            mismatch.push(format!(
                "{to_b}: {:?}, peers {}",
                value(&text, &to_b),
                b_view
            ));
        }
        if mismatch.is_empty() {
            assert!(seen >= 2, "no non-zero decision counters:\n{text}");
            eprintln!("attempt {attempt}: {seen} non-zero decision series match status --json");
            drop(lab);
            // The loop removes its file on exit.
            assert!(!file.exists(), "{} left behind", file.display());
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        last = format!("{mismatch:#?}\n{text}");
    }
    panic!("the scraped metrics never matched status --json: {last}");
}

/// A systemd user manager (the real one, Debian's) run by root beside the test: in a mount
/// namespace of its own, where /run/systemd/system exists (systemd refuses to run a user
/// instance on a machine not booted with it) on a tmpfs the host never sees. It runs
/// services as root, like the system manager. Stopped (and with it its units) when dropped.
struct UserManager {
    child: std::process::Child,
    env: Vec<(String, String)>,
    log: PathBuf,
}

impl UserManager {
    fn start(dir: &Path) -> Self {
        use std::time::{Duration, Instant};
        let systemd = Path::new("/lib/systemd/systemd");
        assert!(
            systemd.exists(),
            "no {} (Debian's systemd)",
            systemd.display()
        );
        let rt = dir.join("rt");
        std::fs::create_dir_all(&rt).unwrap();
        std::fs::set_permissions(&rt, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        // The mount point; empty, and systemd's own directory.
        std::fs::create_dir_all("/run/systemd").unwrap();
        // What the system manager's RuntimeDirectory= makes before it sets up the unit's
        // namespace (ReadWritePaths= names it); a user manager makes it under
        // XDG_RUNTIME_DIR instead.
        std::fs::create_dir_all("/run/ipoib-ctl").unwrap();
        let env = vec![
            ("XDG_RUNTIME_DIR".to_string(), rt.display().to_string()),
            (
                "XDG_CONFIG_HOME".to_string(),
                dir.join("config").display().to_string(),
            ),
        ];
        // Its log: a user manager closes stderr, so to "kmsg", here a file bound over
        // /dev/kmsg (the host's kernel log stays clean).
        let log = dir.join("manager.log");
        std::fs::write(&log, "").unwrap();
        let script = format!(
            "set -e\nmount -t tmpfs tmpfs /run/systemd\nmkdir /run/systemd/system\n\
             mount --bind {log} /dev/kmsg\nexec {} --user --log-target=kmsg \
             --log-level=info",
            systemd.display(),
            log = log.display()
        );
        let child = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &script,
            ])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("unshare.log")).unwrap())
            .spawn()
            .expect("unshare");
        let m = Self { child, env, log };
        let private = rt.join("systemd/private");
        let t = Instant::now();
        while !private.exists() && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            private.exists(),
            "the user manager did not start:\n{}",
            m.log()
        );
        m
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn systemctl(&self, args: &[&str]) -> std::process::Output {
        output(
            Command::new("systemctl")
                .args(["--user", "--no-pager"])
                .args(args)
                .envs(self.env.iter().map(|(k, v)| (k, v))),
        )
        .unwrap()
    }

    /// `systemctl show -p ...` of `unit` as key -> value.
    fn show(&self, unit: &str) -> std::collections::HashMap<String, String> {
        let out = self.systemctl(&[
            "show",
            unit,
            "-p",
            "ActiveState,SubState,MainPID,NRestarts,StatusText,Result,ExecMainStatus",
        ]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

impl Drop for UserManager {
    fn drop(&mut self) {
        // SIGTERM: the manager stops its units, then exits.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_secs(10)
            && matches!(self.child.try_wait(), Ok(None))
        {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The unit as shipped, for this machine: the binary this build's, the interface in the
/// lab's namespace, and the watchdog at 3 s instead of 30 (for a short test). BindsTo/After
/// on the device unit go: a manager without udev never sees a device unit (the unit would
/// wait for it). Everything else (Type=notify, Restart, RestartPreventExitStatus,
/// StartLimitIntervalSec, the policy file) is the shipped unit's.
fn unit_for_test(ns: &str) -> String {
    let shipped = unit_text();
    for want in [
        "/usr/local/sbin/ipoib-ctl",
        "WatchdogSec=30s",
        "BindsTo=sys-subsystem-net-devices-%i.device",
        "After=sys-subsystem-net-devices-%i.device",
        "[Service]\n",
    ] {
        assert!(shipped.contains(want), "the unit no longer has `{want}`");
    }
    shipped
        .lines()
        .filter(|l| !l.starts_with("BindsTo=") && !l.starts_with("After=sys-subsystem"))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("/usr/local/sbin/ipoib-ctl", ctl_path().to_str().unwrap())
        .replace("WatchdogSec=30s", "WatchdogSec=3s")
        .replace(
            "[Service]\n",
            &format!("[Service]\nNetworkNamespacePath=/run/netns/{ns}\n"),
        )
}

/// The unit under a real systemd manager: `start` returns once the daemon said READY, by
/// then attached (its status names the pid systemd watches); `kill -9` is restarted; a
/// stopped process (SIGSTOP) misses its watchdog pings and systemd aborts and restarts it;
/// `stop` ends it cleanly. A name that is no interface fails once (exit 2, not restarted);
/// an interface that is down is retried until it comes up.
#[test]
fn the_unit_under_a_real_systemd_restarts_and_fires_its_watchdog() {
    use std::time::{Duration, Instant};

    use ipoib_tests::lab::lab_or_skip;
    let test = "the_unit_under_a_real_systemd_restarts_and_fires_its_watchdog";
    let Some(lab) = lab_or_skip(test, "sdu", false) else {
        return;
    };
    ipoib_tests::programs::require("systemctl").unwrap();
    let a = lab.a.clone();
    let dir = scratch("systemd");
    let units = dir.join("config/systemd/user");
    std::fs::create_dir_all(&units).unwrap();
    std::fs::write(units.join("ipoib-ctl@.service"), unit_for_test(&a.ns)).unwrap();
    let m = UserManager::start(&dir);
    let unit = format!("ipoib-ctl@{}.service", a.iface);
    let pid_of = |props: &std::collections::HashMap<String, String>| -> u32 {
        props["MainPID"].parse().unwrap()
    };
    let wait_for =
        |what: &str, done: &dyn Fn(&std::collections::HashMap<String, String>) -> bool| {
            let t = Instant::now();
            loop {
                let p = m.show(&unit);
                if done(&p) {
                    eprintln!("{what} after {:.1?}: {p:?}", t.elapsed());
                    return p;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "{what}: not within 30 s: {p:?}\nthe manager's log:\n{}",
                    m.log()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        };
    let loop_pid = || a.status().ok().and_then(|s| s.loop_pid);

    // Started: READY came after attach.
    let t = Instant::now();
    let out = m.systemctl(&["start", &unit]);
    assert!(out.status.success(), "start: {out:?}\n{}", m.log());
    let (p, took) = (m.show(&unit), t.elapsed());
    eprintln!("started in {took:.1?}: {p:?}");
    assert_eq!((&*p["ActiveState"], &*p["SubState"]), ("active", "running"));
    assert_eq!(p["NRestarts"], "0");
    assert!(!p["StatusText"].is_empty(), "no STATUS= sent: {p:?}");
    let first = pid_of(&p);
    assert_eq!(
        loop_pid(),
        Some(first),
        "READY before the loop was attached"
    );

    // kill -9: restarted, and the new process runs the loop.
    // SAFETY: a signal to the service's process.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let p = wait_for("restarted after kill -9", &|p| {
        p["SubState"] == "running" && pid_of(p) != first && pid_of(p) != 0
    });
    assert_eq!(p["NRestarts"], "1");
    let second = pid_of(&p);
    let adopted = Instant::now();
    while loop_pid() != Some(second) && adopted.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(loop_pid(), Some(second));

    // Stopped: no more WATCHDOG=1. systemd's watchdog fires (SIGABRT, and SIGCONT so a
    // stopped process takes it), then the restart.
    unsafe { libc::kill(second as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    let p = wait_for("restarted after SIGSTOP", &|p| {
        p["SubState"] == "running" && pid_of(p) != second && pid_of(p) != 0
    });
    let after = stopped.elapsed();
    assert_eq!(p["NRestarts"], "2");
    let log = m.log();
    let fired: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(&unit) && l.contains("atchdog"))
        .collect();
    eprintln!("restarted {after:.1?} after SIGSTOP (WatchdogSec=3s); the manager said: {fired:#?}");
    assert!(
        fired.iter().any(|l| l.contains("Watchdog timeout")),
        "no watchdog timeout in the manager's log:\n{log}"
    );
    assert!(
        after >= Duration::from_millis(2500),
        "restarted before the watchdog's 3 s"
    );

    // Stopped by the operator: a clean exit.
    let out = m.systemctl(&["stop", &unit]);
    assert!(out.status.success(), "{out:?}");
    let p = m.show(&unit);
    eprintln!("stopped: {p:?}");
    assert_eq!((&*p["ActiveState"], &*p["Result"]), ("inactive", "success"));

    // No such interface: bad configuration, exit 2, not restarted.
    let bad = "ipoib-ctl@nosuch0.service";
    assert!(!m.systemctl(&["start", bad]).status.success());
    std::thread::sleep(Duration::from_secs(5));
    let p = m.show(bad);
    eprintln!("{bad}: {p:?}");
    assert_eq!(
        (&*p["ActiveState"], &*p["ExecMainStatus"], &*p["NRestarts"]),
        ("failed", "2", "0")
    );

    // Down at start (the device exists before it is up, as at boot): retried until up.
    let down = "sdudown0";
    let ip = |args: &[&str]| {
        let out = a.cmd("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}");
    };
    ip(&[
        "link", "add", down, "type", "veth", "peer", "name", "sdudown1",
    ]);
    let late = format!("ipoib-ctl@{down}.service");
    assert!(!m.systemctl(&["start", &late]).status.success());
    std::thread::sleep(Duration::from_secs(3));
    ip(&["link", "set", "sdudown1", "up"]);
    ip(&["link", "set", down, "up"]);
    let t = Instant::now();
    let p = loop {
        let p = m.show(&late);
        if p["SubState"] == "running" || t.elapsed() > Duration::from_secs(20) {
            break p;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("{late} once {down} was up: {p:?}");
    assert_eq!(p["SubState"], "running", "{}", m.log());
    assert!(p["NRestarts"].parse::<u32>().unwrap() >= 1, "{p:?}");
    let _ = m.systemctl(&["stop", &late]);
    let _ = a.ctl(&["detach", down]);
    drop(m);
    drop(lab);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn deploy(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(rel)
}

/// The shipped alerting rules pass `promtool check rules`, and their unit tests
/// (`ipoib-hybrid.rules.test.yml`: each alert fires on series shaped as ipoib-ctl writes them,
/// and stays silent beside them on a healthy twin) pass `promtool test rules`.
#[test]
fn the_alerting_rules_pass_their_promtool_tests() {
    let rules = deploy("prometheus/ipoib-hybrid.rules.yml");
    let check = output(
        Command::new("promtool")
            .arg("check")
            .arg("rules")
            .arg(&rules),
    )
    .unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(said.contains("SUCCESS: 8 rules found"), "{said}");
    let test = output(
        Command::new("promtool")
            .args(["test", "rules"])
            .arg(deploy("prometheus/ipoib-hybrid.rules.test.yml")),
    )
    .unwrap();
    assert!(
        test.status.success(),
        "{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );
}

/// Every query of the shipped dashboard is PromQL that Prometheus parses (its variables set
/// to match anything): each becomes a recording rule for `promtool check rules`. That the
/// series it names are ones ipoib-ctl writes is checked beside the metrics' code.
#[test]
fn the_dashboards_queries_parse() {
    let dash: serde_json::Value =
        serde_json::from_slice(&std::fs::read(deploy("grafana/ipoib-hybrid.json")).unwrap())
            .unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut n = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let expr = expr.replace("$iface", ".*").replace("$instance", ".*");
            n += 1;
            rules.push_str(&format!(
                "      - record: dashboard:query{n}\n        expr: {}\n",
                serde_json::to_string(&expr).unwrap()
            ));
        }
    }
    assert!(n >= 8, "{n} queries");
    let dir = scratch("dashboard");
    let file = dir.join("dashboard.rules.yml");
    std::fs::write(&file, &rules).unwrap();
    let check = output(Command::new("promtool").args(["check", "rules"]).arg(&file)).unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && said.contains(&format!("SUCCESS: {n} rules found")),
        "{said}{}\n{rules}",
        String::from_utf8_lossy(&check.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
