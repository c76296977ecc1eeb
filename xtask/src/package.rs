//! `cargo xtask package`: a .deb and an .rpm of ipoib-ctl, built by the distributions' own
//! tools (dpkg-deb, rpmbuild: Debian packages, nothing compiled for the job) from one staged
//! tree, so both hold the same files. Their dependencies are worked out from the binary:
//! dpkg-shlibdeps names the Debian packages of the libraries it links, rpmbuild the sonames.

#[cfg(test)]
mod tests;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    StatusOk as _, cargo,
    install::{self, Layout},
};

/// The packages' name (the project's; the binary is ipoib-ctl).
pub const NAME: &str = "ipoib-hybrid";

const SUMMARY: &str = "IPoIB hybrid datapath: UD for every packet, connected mode where it pays";

const DESCRIPTION: &str = "\
An eBPF fast path on the IPoIB interface picks datagram (UD) or connected mode (RC) per
packet; ipoib-ctl attaches it, sets up connections only to the peers that profit, within a
memory budget it works out itself, and falls back to UD on any failure. One systemd
instance per interface (ipoib-ctl@ib0); Prometheus alerts and a Grafana dashboard are in
/usr/share/ipoib-hybrid.";

const MAINTAINER: &str = "ipoib-hybrid developers <ipoib-hybrid@example.invalid>";

/// Connected mode needs the HCA's verbs provider, which libibverbs loads at run time (no
/// link names it); without one every peer stays on UD. RHEL ships them in libibverbs itself.
const RECOMMENDS: &str = "ibverbs-providers";

/// The configuration files: an upgrade keeps the operator's edits.
const CONFFILES: &[&str] = &["/etc/ipoib-ctl/example.policy"];

/// Directories the packages own (removed with them when empty); the others they write into
/// (/usr/sbin, the completions' and man pages' directories) belong to the system.
const OWNED_DIRS: &[&str] = &[
    "/etc/ipoib-ctl",
    "/usr/share/doc/ipoib-hybrid",
    "/usr/share/ipoib-hybrid",
    "/usr/share/ipoib-hybrid/grafana",
    "/usr/share/ipoib-hybrid/prometheus",
];

/// Repository files shipped as they are: (in the repository, on the target).
const SHIPPED: &[(&str, &str)] = &[
    (
        "deploy/package/example.policy",
        "/etc/ipoib-ctl/example.policy",
    ),
    (
        "deploy/prometheus/ipoib-hybrid.rules.yml",
        "/usr/share/ipoib-hybrid/prometheus/ipoib-hybrid.rules.yml",
    ),
    (
        "deploy/prometheus/ipoib-hybrid.rules.test.yml",
        "/usr/share/ipoib-hybrid/prometheus/ipoib-hybrid.rules.test.yml",
    ),
    (
        "deploy/grafana/ipoib-hybrid.json",
        "/usr/share/ipoib-hybrid/grafana/ipoib-hybrid.json",
    ),
    ("README.md", "/usr/share/doc/ipoib-hybrid/README.md"),
    (
        "docs/deploying.md",
        "/usr/share/doc/ipoib-hybrid/deploying.md",
    ),
    (
        "docs/hardware.md",
        "/usr/share/doc/ipoib-hybrid/hardware.md",
    ),
    (
        "deploy/package/copyright",
        "/usr/share/doc/ipoib-hybrid/copyright",
    ),
];

/// systemd rereads the units. Nothing is started or enabled: which interfaces get an
/// instance is the operator's choice.
const RELOAD: &str = "\
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null 2>&1 || true
fi
";

/// On removal (not an upgrade) every instance stops and its interface is detached, so no
/// program stays attached once the binary that manages it is gone; traffic goes on over UD.
const STOP_AND_DETACH: &str = "\
if [ -d /run/systemd/system ]; then
    systemctl list-units --all --plain --no-legend --full 'ipoib-ctl@*.service' |
    while read -r unit _; do
        systemctl stop \"$unit\" || true
        /usr/sbin/ipoib-ctl detach \"$(systemd-escape --unescape --instance \"$unit\")\" \\
            >/dev/null 2>&1 || true
    done
fi
";

/// A package version: the binary's own (`ipoib-ctl --version`) and the package's revision.
#[derive(Debug, Clone)]
pub struct Version {
    pub upstream: String,
    pub release: u32,
}

impl Version {
    fn deb(&self) -> String {
        format!("{}-{}", self.upstream, self.release)
    }
}

/// The two packages built.
#[derive(Debug, Clone)]
pub struct Built {
    pub deb: PathBuf,
    pub rpm: PathBuf,
}

pub fn run(root: &Path, out: &Path, release: u32) -> Result<()> {
    println!("==> cargo build --release -p ipoib-ctl");
    cargo(root)
        .args(["build", "-q", "--release", "-p", "ipoib-ctl", "--bin"])
        .arg("ipoib-ctl")
        .status_ok("cargo build --release ipoib-ctl")?;
    let binary = root.join("target/release/ipoib-ctl");
    let version = Version {
        upstream: binary_version(&binary)?,
        release,
    };
    let built = build(root, &binary, out, &version)?;
    println!("==> {}\n==> {}", built.deb.display(), built.rpm.display());
    Ok(())
}

/// What `binary --version` says after its name: "0.1.0".
pub fn binary_version(binary: &Path) -> Result<String> {
    let out = Command::new(binary).arg("--version").output()?;
    let said = String::from_utf8(out.stdout)?;
    match said.split_whitespace().collect::<Vec<_>>()[..] {
        ["ipoib-ctl", v] if out.status.success() => Ok(v.to_owned()),
        _ => bail!("{} --version said {said:?}", binary.display()),
    }
}

/// Both packages of `binary` into `out` (a work directory beside them is made anew).
pub fn build(root: &Path, binary: &Path, out: &Path, version: &Version) -> Result<Built> {
    if version.upstream.contains('-') || version.upstream.is_empty() {
        bail!(
            "version {:?}: neither package allows a '-' in it",
            version.upstream
        );
    }
    let work = out.join(format!("{NAME}-{}.work", version.deb()));
    let stage = work.join("stage");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(&stage)?;
    stage_files(root, binary, &stage)?;
    let files = files_under(&stage)?;
    let rpm = rpm(&work, &stage, &files, out, version)?;
    // The deb's control files go in the staged tree itself, after the rpm took its copy.
    let deb = deb(&work, &stage, out, version)?;
    std::fs::remove_dir_all(&work)?;
    Ok(Built { deb, rpm })
}

/// Every file of the packages under `stage`, where it goes on the target.
fn stage_files(root: &Path, binary: &Path, stage: &Path) -> Result<()> {
    let layout = Layout {
        destdir: stage.to_owned(),
        prefix: PathBuf::from("/usr"),
        unit_dir: PathBuf::from("/usr/lib/systemd/system"),
    };
    let unit = std::fs::read_to_string(root.join("ipoib-ctl/ipoib-ctl@.service"))
        .context("reading ipoib-ctl/ipoib-ctl@.service")?;
    install::install(binary, &unit, &layout)?;
    // The symbols stay (a backtrace names functions); the debug sections go.
    Command::new("strip")
        .arg("--strip-debug")
        .arg(layout.at(&layout.binary()))
        .status_ok("strip --strip-debug")?;
    for (from, to) in SHIPPED {
        let at = layout.at(Path::new(to));
        std::fs::create_dir_all(at.parent().expect("a file's directory"))?;
        std::fs::copy(root.join(from), &at)
            .with_context(|| format!("copying {from} to {}", at.display()))?;
    }
    Ok(())
}

/// The files (not directories) under `dir`, as absolute paths on the target, sorted.
fn files_under(dir: &Path) -> Result<Vec<String>> {
    fn walk(dir: &Path, base: &Path, found: &mut Vec<String>) -> Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                walk(&path, base, found)?;
            } else {
                found.push(format!("/{}", path.strip_prefix(base)?.display()));
            }
        }
        Ok(())
    }
    let mut found = Vec::new();
    walk(dir, dir, &mut found)?;
    found.sort();
    Ok(found)
}

fn deb(work: &Path, stage: &Path, out: &Path, version: &Version) -> Result<PathBuf> {
    let binary = stage.join("usr/sbin/ipoib-ctl");
    let depends = shlibdeps(work, &binary)?;
    let arch = stdout(Command::new("dpkg").arg("--print-architecture"))?;
    let installed_kib = files_under(stage)?
        .iter()
        .map(|f| std::fs::metadata(stage.join(&f[1..])).map(|m| m.len().div_ceil(1024)))
        .sum::<std::io::Result<u64>>()?;
    let control = stage.join("DEBIAN");
    std::fs::create_dir_all(&control)?;
    let mut text = format!(
        "Package: {NAME}\nVersion: {}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n\
         Installed-Size: {installed_kib}\nDepends: {depends}\nRecommends: {RECOMMENDS}\n\
         Section: net\nPriority: optional\n\
         Description: {SUMMARY}\n",
        version.deb()
    );
    for line in DESCRIPTION.lines() {
        writeln!(text, " {line}")?;
    }
    let put = |name: &str, text: &str, mode: u32| -> Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = control.join(name);
        std::fs::write(&path, text)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    put("control", &text, 0o644)?;
    put("conffiles", &(CONFFILES.join("\n") + "\n"), 0o644)?;
    put("postinst", &format!("#!/bin/sh\nset -e\n{RELOAD}"), 0o755)?;
    put(
        "prerm",
        &format!(
            "#!/bin/sh\nset -e\nif [ \"$1\" = remove ] || [ \"$1\" = deconfigure ]; then\n\
             {STOP_AND_DETACH}fi\n"
        ),
        0o755,
    )?;
    put(
        "postrm",
        &format!(
            "#!/bin/sh\nset -e\nif [ \"$1\" = remove ] || [ \"$1\" = purge ]; then\n{RELOAD}fi\n"
        ),
        0o755,
    )?;
    let deb = out.join(format!("{NAME}_{}_{arch}.deb", version.deb()));
    Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(stage)
        .arg(&deb)
        .stdout(std::process::Stdio::null())
        .status_ok("dpkg-deb --build")?;
    Ok(deb)
}

/// The Depends of `binary`: the Debian packages, at their versions, of the libraries it
/// links, as dpkg-shlibdeps works them out from the installed libraries' symbols files.
fn shlibdeps(work: &Path, binary: &Path) -> Result<String> {
    // dpkg-shlibdeps reads debian/control of the directory it runs in.
    let dir = work.join("shlibdeps");
    std::fs::create_dir_all(dir.join("debian"))?;
    std::fs::write(
        dir.join("debian/control"),
        format!("Source: {NAME}\n\nPackage: {NAME}\nArchitecture: any\n"),
    )?;
    let said = stdout(
        Command::new("dpkg-shlibdeps")
            .arg("-O")
            .arg(format!("-e{}", binary.display()))
            .current_dir(&dir)
            .stderr(std::process::Stdio::null()),
    )?;
    match said.strip_prefix("shlibs:Depends=") {
        Some(d) if !d.is_empty() => Ok(d.to_owned()),
        _ => bail!("dpkg-shlibdeps said {said:?}"),
    }
}

fn rpm(
    work: &Path,
    stage: &Path,
    files: &[String],
    out: &Path,
    version: &Version,
) -> Result<PathBuf> {
    let mut list = String::new();
    for dir in OWNED_DIRS {
        writeln!(list, "%dir {dir}")?;
    }
    for f in files {
        if CONFFILES.contains(&f.as_str()) {
            writeln!(list, "%config(noreplace) {f}")?;
        } else if f.ends_with("/copyright") {
            writeln!(list, "%license {f}")?;
        } else if f.starts_with("/usr/share/doc/") {
            writeln!(list, "%doc {f}")?;
        } else {
            writeln!(list, "{f}")?;
        }
    }
    let spec = format!(
        "# The files are built and staged by `cargo xtask package`; rpmbuild only packs them.
%global debug_package %{{nil}}
%global __os_install_post %{{nil}}
%global _build_id_links none
Name: {NAME}
Version: {upstream}
Release: {release}
Summary: {SUMMARY}
License: MIT OR Apache-2.0

%description
{DESCRIPTION}

%install
cp -a {stage}/. %{{buildroot}}/

%post
{RELOAD}
%preun
if [ \"$1\" -eq 0 ]; then
{STOP_AND_DETACH}fi

%postun
{RELOAD}
%files
{list}",
        upstream = version.upstream,
        release = version.release,
        stage = stage.display(),
    );
    let spec_path = work.join(format!("{NAME}.spec"));
    std::fs::write(&spec_path, spec)?;
    let name = format!(
        "{NAME}-{}-{}.%{{ARCH}}.rpm",
        version.upstream, version.release
    );
    let log = work.join("rpmbuild.log");
    let status = Command::new("rpmbuild")
        .arg("-bb")
        .arg("--define")
        .arg(format!("_topdir {}", work.join("rpmbuild").display()))
        .arg("--define")
        .arg(format!("_rpmdir {}", out.display()))
        .arg("--define")
        .arg(format!("_rpmfilename {name}"))
        .arg(&spec_path)
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::create(work.join("rpmbuild.err"))?)
        .status()
        .context("could not start rpmbuild")?;
    if !status.success() {
        bail!(
            "rpmbuild failed ({status}):\n{}",
            std::fs::read_to_string(work.join("rpmbuild.err")).unwrap_or_default()
        );
    }
    let said = std::fs::read_to_string(&log)?;
    let wrote = said
        .lines()
        .find_map(|l| l.strip_prefix("Wrote: "))
        .with_context(|| format!("rpmbuild wrote no package:\n{said}"))?;
    Ok(PathBuf::from(wrote.trim()))
}

/// What `cmd` prints, trimmed; it must succeed.
fn stdout(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}
