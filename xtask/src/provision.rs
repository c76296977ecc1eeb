//! Installs what a fresh machine of this kind lacks, and nothing else. Idempotent: each step
//! checks first, so a second run on a provisioned machine only checks and takes seconds.
//!
//! The facts behind each step are in ../shared/notes/toolchain.md: bpf-linker 0.13 needs a
//! shared libLLVM 22, which Debian 12 does not package, so it is built against the nightly
//! toolchain's own libLLVM through a shim prefix kept under ~/.cache (the binary keeps an rpath
//! to it, so the shim must stay put).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{StatusOk as _, is_root};

pub mod programs;
use programs::{PROGRAMS, Program, Source, on_path};

#[derive(Default, Clone, Copy)]
pub struct Scope {
    pub vm: bool,
}

/// Debian packages that are no program our sources run: build dependencies, and what the
/// programs in [`PROGRAMS`] need beside them. Checked with dpkg.
const BUILD_PACKAGES: &[(&str, &str)] = &[
    // ipoib-ctl's verbs module builds ibverbs-sys (cmake on its bundled rdma-core, bindgen)
    // and links libibverbs.
    (
        "libibverbs-dev",
        "ipoib-ctl links libibverbs (verbs discovery)",
    ),
    ("cmake", "ibverbs-sys builds its bundled rdma-core"),
    ("pkg-config", "ibverbs-sys"),
    ("libnl-3-dev", "ibverbs-sys"),
    ("libnl-route-3-dev", "ibverbs-sys"),
    ("libclang-dev", "bindgen in ibverbs-sys"),
    ("clang", "bindgen in ibverbs-sys"),
];

/// What the soft-RoCE VM needs beside its programs.
const VM_PACKAGES: &[(&str, &str)] = &[
    (
        "linux-image-amd64",
        "Debian's 6.1 kernel with rdma_rxe, the VM's kernel",
    ),
    ("rdma-core", "soft-RoCE (rxe) userspace"),
    ("ibverbs-providers", "the rxe verbs provider"),
    (
        "librdmacm1",
        "path records (ipoib-ctl opens librdmacm at run time)",
    ),
];

const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn run(scope: Scope) -> Result<()> {
    let mut did = Vec::new();
    nightly_rust_src(&mut did)?;
    bpf_linker(&mut did)?;
    let mut pkgs: Vec<_> = BUILD_PACKAGES.to_vec();
    if scope.vm {
        pkgs.extend_from_slice(VM_PACKAGES);
    }
    let wanted: Vec<&Program> = PROGRAMS
        .iter()
        .filter(|p| scope.vm || p.scope == programs::Scope::Host)
        .collect();
    for p in &wanted {
        if let Source::Debian(pkg) = p.source
            && on_path(p.name).is_none()
            && !pkgs.iter().any(|(q, _)| *q == pkg)
        {
            pkgs.push((pkg, p.why));
        }
    }
    debian_packages(&pkgs, &mut did)?;
    if scope.vm {
        virtme_ng(&mut did)?;
    }
    // Every program, looked up as the code will run it: a package that installed but left the
    // program off PATH is a failure here, not a panic in a test later.
    let absent: Vec<String> = wanted
        .iter()
        .filter(|p| on_path(p.name).is_none())
        .map(|p| programs::missing_message(p.name))
        .collect();
    if !absent.is_empty() {
        bail!(
            "after provisioning, still not on PATH ({}):\n  {}",
            std::env::var("PATH").unwrap_or_default(),
            absent.join("\n  ")
        );
    }
    if did.is_empty() {
        println!("provision: everything already present");
    } else {
        println!("provision: installed {}", did.join(", "));
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A clean command: nothing of the cargo process that runs xtask leaks into it.
fn clean(program: &str) -> Command {
    let mut c = Command::new(program);
    for v in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTUP_TOOLCHAIN",
        "CARGO_TARGET_DIR",
        "RUSTFLAGS",
    ] {
        c.env_remove(v);
    }
    c
}

fn nightly_sysroot() -> Result<PathBuf> {
    let out = output(clean("rustc").args(["+nightly", "--print", "sysroot"])).context(
        "no nightly Rust toolchain: the eBPF crate needs one (`rustup toolchain install \
         nightly`); machines of this kind ship with it",
    )?;
    Ok(PathBuf::from(out.trim()))
}

fn nightly_rust_src(did: &mut Vec<String>) -> Result<()> {
    let installed = output(clean("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .unwrap_or_default();
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    println!("provision: adding rust-src to nightly (for -Z build-std=core on bpfel-unknown-none)");
    clean("rustup")
        .args(["component", "add", "rust-src", "--toolchain", "nightly"])
        .status_ok("rustup component add rust-src")?;
    did.push("rust-src (nightly)".into());
    Ok(())
}

fn bpf_linker_ok() -> bool {
    output(clean("bpf-linker").arg("--version"))
        .is_some_and(|v| v.split_whitespace().nth(1) == Some(BPF_LINKER_VERSION))
}

/// The nightly toolchain's libLLVM shared object (`libLLVM.so.<maj>.<min>-rust-...`; the
/// `libLLVM-<maj>-rust-*.so` beside it is a linker script, not the library).
fn nightly_libllvm(sysroot: &Path) -> Result<(PathBuf, u32)> {
    let lib = sysroot.join("lib");
    for entry in std::fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix("libLLVM.so.") {
            let major = rest
                .split('.')
                .next()
                .and_then(|m| m.parse::<u32>().ok())
                .with_context(|| format!("cannot read the LLVM version of {name}"))?;
            return Ok((entry.path(), major));
        }
    }
    bail!("no libLLVM.so.* in {}", lib.display())
}

fn bpf_linker(did: &mut Vec<String>) -> Result<()> {
    if bpf_linker_ok() {
        return Ok(());
    }
    let sysroot = nightly_sysroot()?;
    let (libllvm, major) = nightly_libllvm(&sysroot)?;
    if major != 22 {
        bail!(
            "bpf-linker {BPF_LINKER_VERSION} is built here for LLVM 22, but the nightly \
             toolchain has LLVM {major} ({}); update BPF_LINKER_VERSION and the feature",
            libllvm.display()
        );
    }
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let shim = PathBuf::from(home).join(".cache/ipoib-hybrid/llvm-shim");
    let shim_lib = shim.join("lib");
    std::fs::create_dir_all(&shim_lib)?;
    let file_name = libllvm.file_name().expect("file name");
    for link in [shim_lib.join("libLLVM.so"), shim_lib.join(file_name)] {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    println!(
        "provision: building bpf-linker {BPF_LINKER_VERSION} against the nightly toolchain's \
         libLLVM {major} (shim {}; about 3 minutes on 2 cores)",
        shim.display()
    );
    clean("cargo")
        .env("LLVM_PREFIX", &shim)
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features", "llvm-22", "--force"])
        .status_ok("cargo install bpf-linker")?;
    if !bpf_linker_ok() {
        bail!(
            "bpf-linker was installed but `bpf-linker --version` does not run: is ~/.cargo/bin on PATH?"
        );
    }
    did.push(format!("bpf-linker {BPF_LINKER_VERSION}"));
    Ok(())
}

fn dpkg_installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.trim() == "install ok installed")
}

fn debian_packages(pkgs: &[(&str, &str)], did: &mut Vec<String>) -> Result<()> {
    let missing: Vec<_> = pkgs.iter().filter(|(p, _)| !dpkg_installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    for (p, why) in &missing {
        println!("provision: Debian package {p}: {why}");
    }
    if !is_root() {
        let names: Vec<_> = missing.iter().map(|(p, _)| *p).collect();
        bail!(
            "installing Debian packages needs root: run `sudo apt-get install {}` or run \
             this as root",
            names.join(" ")
        );
    }
    Command::new("apt-get")
        .arg("update")
        .arg("-qq")
        .status_ok("apt-get update")?;
    Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(missing.iter().map(|(p, _)| *p))
        .status_ok("apt-get install")?;
    did.extend(missing.iter().map(|(p, _)| p.to_string()));
    Ok(())
}

fn virtme_ng(did: &mut Vec<String>) -> Result<()> {
    if output(Command::new("vng").arg("--version")).is_some() {
        return Ok(());
    }
    let Some(Program {
        source: Source::Pypi(spec),
        why,
        ..
    }) = programs::program("vng")
    else {
        bail!("the program table has no PyPI row for vng");
    };
    println!("provision: {spec} from PyPI: {why}");
    Command::new("python3")
        .args(["-m", "pip", "install", "-q", spec])
        .status_ok("pip install virtme-ng")?;
    did.push("virtme-ng".into());
    Ok(())
}
