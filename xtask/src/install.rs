//! `cargo xtask install`: the release binary, the systemd unit, the completions and the man
//! pages in their places, under `--destdir` for a package (nothing outside it is touched).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{StatusOk as _, cargo};

/// Where each part goes.
pub struct Layout {
    /// Prepended to every path (a package's staging root); `/` installs for real.
    pub destdir: PathBuf,
    /// The binary's prefix: PREFIX/sbin/ipoib-ctl, PREFIX/share/...
    pub prefix: PathBuf,
    /// Where the unit goes: the administrator's directory for a hand install, the vendor's
    /// (/usr/lib/systemd/system) for a package.
    pub unit_dir: PathBuf,
}

/// The unit's `ExecStart` and `ExecReload` name the binary where the repository's copy says.
const UNIT_BINARY: &str = "/usr/local/sbin/ipoib-ctl";

impl Layout {
    pub fn at(&self, path: &Path) -> PathBuf {
        self.destdir.join(path.strip_prefix("/").unwrap_or(path))
    }

    pub fn binary(&self) -> PathBuf {
        self.prefix.join("sbin/ipoib-ctl")
    }

    fn share(&self, rel: &str) -> PathBuf {
        self.prefix.join("share").join(rel)
    }
}

pub fn run(root: &Path, layout: &Layout) -> Result<()> {
    if !layout.prefix.is_absolute() {
        bail!(
            "--prefix must be an absolute path: {}",
            layout.prefix.display()
        );
    }
    println!("==> cargo build --release -p ipoib-ctl");
    cargo(root)
        .args([
            "build",
            "-q",
            "--release",
            "-p",
            "ipoib-ctl",
            "--bin",
            "ipoib-ctl",
        ])
        .status_ok("cargo build --release ipoib-ctl")?;
    let built = root.join("target/release/ipoib-ctl");
    let unit = std::fs::read_to_string(root.join("ipoib-ctl/ipoib-ctl@.service"))
        .context("reading ipoib-ctl/ipoib-ctl@.service")?;
    for path in install(&built, &unit, layout)? {
        println!("    {}", path.display());
    }
    let real = layout.destdir == Path::new("/");
    if real && Path::new("/run/systemd/system").exists() {
        Command::new("systemctl")
            .arg("daemon-reload")
            .status_ok("systemctl daemon-reload")?;
    }
    println!(
        "==> installed. Per interface: `systemctl enable --now ipoib-ctl@ib0`; its policy, if \
         any, in /etc/ipoib-ctl/ib0.policy (`systemctl reload ipoib-ctl@ib0` after a change); \
         logs: `journalctl -u ipoib-ctl@ib0`"
    );
    Ok(())
}

/// Puts `built` and what it prints (completions, man pages) and `unit` (its binary path set
/// to the layout's) in place; returns every path written.
pub fn install(built: &Path, unit: &str, layout: &Layout) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut put = |path: PathBuf, bytes: &[u8], mode: u32| -> Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let at = layout.at(&path);
        let dir = at.parent().expect("a file's directory");
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        // Next to it, then renamed: a running binary is replaced, never written into.
        let tmp = at.with_extension("tmp-install");
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, &at).with_context(|| format!("placing {}", at.display()))?;
        written.push(at);
        Ok(())
    };
    let binary = std::fs::read(built).with_context(|| format!("reading {}", built.display()))?;
    put(layout.binary(), &binary, 0o755)?;
    let bin = layout.binary().display().to_string();
    put(
        layout.unit_dir.join("ipoib-ctl@.service"),
        unit.replace(UNIT_BINARY, &bin).as_bytes(),
        0o644,
    )?;
    for (shell, rel) in [
        ("bash", "bash-completion/completions/ipoib-ctl"),
        ("zsh", "zsh/site-functions/_ipoib-ctl"),
        ("fish", "fish/vendor_completions.d/ipoib-ctl.fish"),
    ] {
        put(
            layout.share(rel),
            &printed(built, &["completions", shell])?,
            0o644,
        )?;
    }
    put(
        layout.share("man/man8/ipoib-ctl.8"),
        &printed(built, &["man"])?,
        0o644,
    )?;
    for sub in subcommands(built)? {
        put(
            layout.share(&format!("man/man8/ipoib-ctl-{sub}.8")),
            &printed(built, &["man", &sub])?,
            0o644,
        )?;
    }
    let etc = layout.at(Path::new("/etc/ipoib-ctl"));
    std::fs::create_dir_all(&etc).with_context(|| format!("creating {}", etc.display()))?;
    written.push(etc);
    Ok(written)
}

/// What `built ARGS` prints on stdout (it must succeed).
fn printed(built: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new(built)
        .args(args)
        .output()
        .with_context(|| format!("running {}", built.display()))?;
    if !out.status.success() {
        bail!(
            "{} {}: {}\n{}",
            built.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The subcommands `--help` lists (each gets a man page), but `help`.
fn subcommands(built: &Path) -> Result<Vec<String>> {
    let help = String::from_utf8(printed(built, &["--help"])?)?;
    let list = help
        .split("Commands:")
        .nth(1)
        .context("no Commands: in --help")?;
    Ok(list
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|s| *s != "help")
        .map(str::to_owned)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The debug ipoib-ctl that `cargo xtask test` builds before the tests.
    fn built() -> Option<PathBuf> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/ipoib-ctl");
        p.exists().then_some(p)
    }

    #[test]
    fn everything_lands_under_destdir_with_the_units_paths_set() {
        let Some(built) = built() else {
            panic!("target/debug/ipoib-ctl is not built: `cargo build -p ipoib-ctl` first");
        };
        let dest = std::env::temp_dir().join(format!("ipoib-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dest);
        let layout = Layout {
            destdir: dest.clone(),
            prefix: PathBuf::from("/opt/ib"),
            unit_dir: PathBuf::from("/etc/systemd/system"),
        };
        let unit = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipoib-ctl/ipoib-ctl@.service"),
        )
        .unwrap();
        let written = install(&built, &unit, &layout).unwrap();
        for w in &written {
            assert!(w.starts_with(&dest), "{} outside the destdir", w.display());
            assert!(w.exists(), "{}", w.display());
        }
        let placed =
            std::fs::read_to_string(dest.join("etc/systemd/system/ipoib-ctl@.service")).unwrap();
        assert!(
            placed.contains("ExecStart=/opt/ib/sbin/ipoib-ctl attach %i"),
            "{placed}"
        );
        assert!(placed.contains("ExecReload=/opt/ib/sbin/ipoib-ctl set-policy %i"));
        assert!(!placed.contains(UNIT_BINARY));
        let man8 = dest.join("opt/ib/share/man/man8");
        for page in [
            "ipoib-ctl.8",
            "ipoib-ctl-attach.8",
            "ipoib-ctl-set-policy.8",
        ] {
            let text = std::fs::read_to_string(man8.join(page)).unwrap();
            assert!(
                text.starts_with(".ie") || text.contains(".TH"),
                "{page}: {text}"
            );
        }
        // The man page of `man` itself is not made: it is hidden.
        assert!(!man8.join("ipoib-ctl-man.8").exists());
        std::fs::remove_dir_all(&dest).unwrap();
    }
}
