//! The packages as a site installs them: the .deb with dpkg in a fresh Debian root (Debian's
//! essential set, systemd, and what the .deb says it depends on, from the archive), the .rpm
//! through rpm's own queries and an rpm database in a root of its own. Built from the debug
//! ipoib-ctl that `cargo xtask test` builds first; needs root (chroot, mounts).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
};

use super::{Built, NAME, OWNED_DIRS, Version, binary_version, build};

/// Two versions of both packages, one revision apart (built once for every test here).
struct Packages {
    v1: Built,
    v2: Built,
    upstream: String,
    dir: PathBuf,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn debug_ctl() -> PathBuf {
    let p = repo().join("target/debug/ipoib-ctl");
    assert!(
        p.exists(),
        "target/debug/ipoib-ctl is not built: `cargo build -p ipoib-ctl` first"
    );
    p
}

/// The packages, or None (said loudly) where this is not root; CI is root and must not skip.
fn packages() -> Option<&'static Packages> {
    if !crate::is_root() {
        assert!(
            std::env::var_os("IPOIB_REQUIRE_BPF").is_none(),
            "the package tests need root (chroot, mounts), and IPOIB_REQUIRE_BPF forbids a skip"
        );
        eprintln!("!!! SKIP: the package tests need root (chroot, mounts); CI runs them");
        return None;
    }
    static BUILT: OnceLock<Packages> = OnceLock::new();
    Some(BUILT.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ipoib-packages-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let upstream = binary_version(&debug_ctl()).unwrap();
        let version = |release| Version {
            upstream: upstream.clone(),
            release,
        };
        let v1 = build(&repo(), &debug_ctl(), &dir, &version(1)).unwrap();
        let v2 = build(&repo(), &debug_ctl(), &dir, &version(2)).unwrap();
        Packages {
            v1,
            v2,
            upstream,
            dir,
        }
    }))
}

fn ok(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn lines(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A Debian root made for one test by mmdebstrap, from the host's own archive and suite;
/// removed when dropped. Mounts into it live only in the mount namespace of one command.
struct FreshRoot {
    dir: PathBuf,
}

impl FreshRoot {
    fn new(tag: &str, include: &[String]) -> Self {
        let dir = std::env::temp_dir().join(format!("ipoib-root-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let release = std::fs::read_to_string("/etc/os-release").unwrap();
        let suite = release
            .lines()
            .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
            .expect("VERSION_CODENAME in /etc/os-release")
            .trim_matches('"')
            .to_owned();
        let mut cmd = Command::new("mmdebstrap");
        cmd.args(["--variant=essential", "--quiet"])
            .arg(format!("--include={}", include.join(",")))
            .arg(&suite)
            .arg(&dir);
        // The host's archive: the one this machine reaches.
        for sources in [
            "/etc/apt/sources.list.d/debian.sources",
            "/etc/apt/sources.list",
        ] {
            if std::fs::metadata(sources).is_ok_and(|m| m.len() > 0) {
                cmd.arg(sources);
                break;
            }
        }
        ok(&mut cmd);
        FreshRoot { dir }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel.trim_start_matches('/'))
    }

    fn chroot(&self, args: &[&str]) -> Command {
        let mut c = Command::new("chroot");
        c.arg(&self.dir).args(args);
        c
    }

    /// `dpkg ARGS` in the root, a package file first copied into its /tmp.
    fn dpkg(&self, args: &[&str], deb: Option<&Path>) -> String {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        if let Some(deb) = deb {
            let name = deb.file_name().unwrap().to_str().unwrap();
            std::fs::copy(deb, self.path("tmp").join(name)).unwrap();
            all.push(format!("/tmp/{name}"));
        }
        let mut cmd = self.chroot(&["dpkg"]);
        cmd.args(&all);
        ok(&mut cmd)
    }

    /// `args` in the root with the host's /proc and /sys (so bpffs too) mounted there.
    fn with_host_kernel(&self, args: &[&str]) -> Output {
        let root = self.dir.display();
        let script = format!(
            "set -e; mount --rbind /sys {root}/sys; mount -t proc proc {root}/proc; \
             exec chroot {root} \"$@\""
        );
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(script)
            .arg("sh")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Every path in the root but dpkg's own records, its logs and the scratch directories.
    fn paths(&self) -> BTreeSet<String> {
        fn walk(dir: &Path, base: &Path, found: &mut BTreeSet<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                let rel = format!("/{}", path.strip_prefix(base).unwrap().display());
                let skip = [
                    "/var/lib/dpkg",
                    "/var/log",
                    "/tmp",
                    "/proc",
                    "/sys",
                    "/dev",
                    "/run",
                ];
                if skip.iter().any(|s| rel.starts_with(s)) {
                    continue;
                }
                let is_dir = std::fs::symlink_metadata(&path).unwrap().is_dir();
                found.insert(rel);
                if is_dir {
                    walk(&path, base, found);
                }
            }
        }
        let mut found = BTreeSet::new();
        walk(&self.dir, &self.dir, &mut found);
        found
    }
}

impl Drop for FreshRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The package names of a Depends field (the first of any alternatives).
fn depends_names(field: &str) -> Vec<String> {
    field
        .split(',')
        .filter_map(|d| d.split(['|', '(']).next())
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect()
}

#[test]
fn depends_names_takes_each_package_name() {
    assert_eq!(
        depends_names("libc6 (>= 2.34), libgcc-s1 (>= 4.2) | libgcc1, libibverbs1"),
        ["libc6", "libgcc-s1", "libibverbs1"]
    );
}

/// The .deb in a fresh root: it installs with the dependencies it declares and nothing else
/// of the host's, its binary runs there, systemd there accepts its unit, an upgrade keeps the
/// operator's edits, and removing then purging it leaves the root as it was.
#[test]
fn the_deb_installs_into_a_fresh_root_upgrades_keeping_the_policy_and_purges_clean() {
    let Some(pk) = packages() else { return };
    let depends = ok(Command::new("dpkg-deb")
        .arg("-f")
        .arg(&pk.v1.deb)
        .arg("Depends"));
    let mut include = depends_names(depends.trim());
    assert!(include.contains(&"libibverbs1".to_owned()), "{depends}");
    let recommends = ok(Command::new("dpkg-deb")
        .arg("-f")
        .arg(&pk.v1.deb)
        .arg("Recommends"));
    assert_eq!(recommends.trim(), "ibverbs-providers");
    include.push("systemd".into());
    let root = FreshRoot::new("deb", &include);
    let before = root.paths();

    root.dpkg(&["-i"], Some(&pk.v1.deb));
    let version = ok(&mut root.chroot(&["/usr/sbin/ipoib-ctl", "--version"]));
    assert_eq!(version.trim(), format!("ipoib-ctl {}", pk.upstream));
    // doctor from the root, on this machine's kernel: every check runs, none fails (6: a
    // warning, as where no RDMA device is).
    let doctor = root.with_host_kernel(&["/usr/sbin/ipoib-ctl", "doctor", "--json"]);
    let said = String::from_utf8_lossy(&doctor.stdout);
    assert!(
        matches!(doctor.status.code(), Some(0 | 6)),
        "doctor: {}\n{said}{}",
        doctor.status,
        String::from_utf8_lossy(&doctor.stderr)
    );
    let checks: Vec<serde_json::Value> = serde_json::from_str(&said).unwrap();
    for what in ["kernel", "bpffs", "rdma"] {
        assert!(
            checks
                .iter()
                .any(|c| c["what"] == what && c["level"] != "FAIL"),
            "{what}: {said}"
        );
    }
    // The root's own systemd on the installed unit (it checks the binary is there too).
    let verify = root
        .chroot(&[
            "systemd-analyze",
            "verify",
            "--man=no",
            "ipoib-ctl@ib0.service",
        ])
        .output()
        .unwrap();
    assert!(
        verify.status.success() && verify.stderr.is_empty(),
        "systemd-analyze verify: {}\n{}",
        verify.status,
        String::from_utf8_lossy(&verify.stderr)
    );
    let conffiles = ok(&mut root.chroot(&["dpkg-query", "-W", "-f=${Conffiles}", NAME]));
    assert!(
        conffiles.contains("/etc/ipoib-ctl/example.policy "),
        "{conffiles}"
    );

    // The operator edits the example and writes a policy of their own; the next revision
    // installs over both without a question (stdin is closed) and keeps them.
    let example = root.path("/etc/ipoib-ctl/example.policy");
    let edited = std::fs::read_to_string(&example).unwrap() + "mode=datagram\n";
    std::fs::write(&example, &edited).unwrap();
    let own = root.path("/etc/ipoib-ctl/ib0.policy");
    std::fs::write(&own, "cm-threshold=4096\n").unwrap();
    root.dpkg(&["-i"], Some(&pk.v2.deb));
    let installed = ok(&mut root.chroot(&["dpkg-query", "-W", "-f=${Version}", NAME]));
    assert_eq!(installed, format!("{}-2", pk.upstream));
    assert_eq!(std::fs::read_to_string(&example).unwrap(), edited);
    assert_eq!(
        std::fs::read_to_string(&own).unwrap(),
        "cm-threshold=4096\n"
    );
    let beside: Vec<_> = std::fs::read_dir(root.path("/etc/ipoib-ctl"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".dpkg-"))
        .collect();
    assert!(beside.is_empty(), "{beside:?}");

    // Removed: the program goes, the configuration stays; purged: nothing of it stays.
    root.dpkg(&["-r", NAME], None);
    assert!(!root.path("/usr/sbin/ipoib-ctl").exists());
    assert!(
        !root
            .path("/usr/lib/systemd/system/ipoib-ctl@.service")
            .exists()
    );
    assert_eq!(std::fs::read_to_string(&example).unwrap(), edited);
    std::fs::remove_file(&own).unwrap();
    root.dpkg(&["-P", NAME], None);
    let after = root.paths();
    let left: Vec<_> = after.difference(&before).collect();
    let lost: Vec<_> = before.difference(&after).collect();
    assert!(
        left.is_empty() && lost.is_empty(),
        "left {left:?}, lost {lost:?}"
    );
}

/// The .rpm: the .deb's files (rpm -qlp), the example policy as its one configuration file,
/// a requirement for each library the binary links and no other (rpm -qRp), scripts that
/// reload systemd and start nothing; and in an rpm database of its own, an upgrade that keeps
/// an edited policy.
#[test]
fn the_rpm_holds_the_debs_files_needs_the_linked_libraries_and_keeps_an_edited_policy() {
    let Some(pk) = packages() else { return };
    let rpm_q = |args: &[&str], rpm: &Path| ok(Command::new("rpm").args(args).arg("-p").arg(rpm));
    let listed = lines(&rpm_q(&["-ql"], &pk.v1.rpm));
    let in_deb: BTreeSet<String> = ok(Command::new("dpkg-deb").arg("-c").arg(&pk.v1.deb))
        .lines()
        .filter(|l| !l.starts_with('d'))
        .filter_map(|l| l.split_whitespace().last())
        .map(|p| p.trim_start_matches('.').to_owned())
        .collect();
    let owned: BTreeSet<String> = OWNED_DIRS.iter().map(|d| d.to_string()).collect();
    let deb_and_dirs: BTreeSet<String> = in_deb.union(&owned).cloned().collect();
    assert_eq!(listed, deb_and_dirs);
    for file in [
        "/usr/sbin/ipoib-ctl",
        "/usr/lib/systemd/system/ipoib-ctl@.service",
        "/usr/share/man/man8/ipoib-ctl.8",
        "/usr/share/man/man8/ipoib-ctl-attach.8",
        "/usr/share/bash-completion/completions/ipoib-ctl",
        "/usr/share/zsh/site-functions/_ipoib-ctl",
        "/usr/share/fish/vendor_completions.d/ipoib-ctl.fish",
        "/usr/share/ipoib-hybrid/prometheus/ipoib-hybrid.rules.yml",
        "/usr/share/ipoib-hybrid/grafana/ipoib-hybrid.json",
        "/usr/share/doc/ipoib-hybrid/README.md",
    ] {
        assert!(listed.contains(file), "{file} not in {listed:?}");
    }
    let config = lines(&rpm_q(&["-qc"], &pk.v1.rpm));
    assert_eq!(config, lines("/etc/ipoib-ctl/example.policy"));

    // Requirements: the sonames the binary links (its ELF NEEDED entries), rpm's own
    // features, and the scripts' shell.
    let needed: BTreeSet<String> = ok(Command::new("readelf").arg("-d").arg(debug_ctl()))
        .lines()
        .filter_map(|l| l.split("Shared library: [").nth(1))
        .map(|l| l.trim_end_matches(']').to_owned())
        .collect();
    assert!(needed.contains("libibverbs.so.1"), "{needed:?}");
    let requires = lines(&rpm_q(&["-qR"], &pk.v1.rpm));
    let mut sonames = BTreeSet::new();
    for r in &requires {
        let name = r.split('(').next().unwrap();
        if name.contains(".so") {
            sonames.insert(name.to_owned());
        } else {
            assert!(
                ["rpmlib", "rtld", "/bin/sh", "config"].contains(&name),
                "{r}: not a library the binary links"
            );
        }
    }
    assert_eq!(sonames, needed);

    let scripts = rpm_q(&["-q", "--scripts"], &pk.v1.rpm);
    assert!(
        scripts.contains("systemctl --system daemon-reload"),
        "{scripts}"
    );
    for never in ["systemctl start", "systemctl enable", "systemctl restart"] {
        assert!(!scripts.contains(never), "{never}: {scripts}");
    }

    // rpm -U in a root of its own (no scripts: nothing of RHEL's is there to run them).
    let root = pk.dir.join("rpm-root");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let rpm = |args: &[&str], pkg: Option<&Path>| {
        let mut c = Command::new("rpm");
        c.arg("--root").arg(&root).args(args);
        if let Some(p) = pkg {
            c.arg(p);
        }
        ok(&mut c)
    };
    rpm(&["--initdb"], None);
    rpm(&["-i", "--nodeps", "--noscripts"], Some(&pk.v1.rpm));
    let example = root.join("etc/ipoib-ctl/example.policy");
    let edited = std::fs::read_to_string(&example).unwrap() + "mode=datagram\n";
    std::fs::write(&example, &edited).unwrap();
    rpm(&["-U", "--nodeps", "--noscripts"], Some(&pk.v2.rpm));
    let v2_file = pk.v2.rpm.file_stem().unwrap().to_str().unwrap();
    assert_eq!(rpm(&["-q", NAME], None).trim(), v2_file);
    assert_eq!(std::fs::read_to_string(&example).unwrap(), edited);
    assert!(!root.join("etc/ipoib-ctl/example.policy.rpmnew").exists());
    std::fs::remove_dir_all(&root).unwrap();
}
