//! The operator's side of `ipoib-ctl`: the systemd unit as systemd reads it, the shell
//! completions in a real bash, the man pages through groff, and the logs in a real journald.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use ipoib_tests::{lab::ctl_path, programs::output};

fn ctl(args: &[&str]) -> std::process::Output {
    output(Command::new(ctl_path()).args(args)).unwrap()
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ipoib-service-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn unit_text() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipoib-ctl/ipoib-ctl@.service"),
    )
    .unwrap()
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
    use ipoib_tests::lab::{Lab, lab_unavailable};
    let test = "logs_reach_journald_with_priorities_and_stderr_without_colour";
    if let Some(why) = lab_unavailable() {
        assert!(
            std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
            "{test}: {why}"
        );
        ipoib_tests::loud_skip(test, &why);
        return;
    }
    ipoib_tests::programs::require("journalctl").unwrap();
    let journald = Path::new("/lib/systemd/systemd-journald");
    assert!(
        journald.exists(),
        "no {} (Debian's systemd)",
        journald.display()
    );
    let lab = Lab::new("jrn", false).unwrap();
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

    use ipoib_tests::lab::{Lab, Which, lab_unavailable};
    let test = "node_exporter_serves_the_metrics_and_they_match_status";
    if let Some(why) = lab_unavailable() {
        assert!(
            std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
            "{test}: {why}"
        );
        ipoib_tests::loud_skip(test, &why);
        return;
    }
    let dir = scratch("metrics");
    let mut lab = Lab::new("met", false).unwrap();
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
