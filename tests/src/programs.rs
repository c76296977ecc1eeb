//! The programs the tests run, and where each comes from: the table provisioning installs
//! from (`xtask/src/provision/programs.rs`, included here as it is), and the one way the test
//! libraries and tests run a program ([`output`], [`must`], [`sh`], [`sh_ok`]), which names the
//! package when the program is missing.

use std::process::{Command, Output};

#[path = "../../xtask/src/provision/programs.rs"]
mod table;

pub use table::{PROGRAMS, Program, Scope, Source, missing_message, on_path, program};

/// Fails with [`missing_message`] (the program and its package) when `name` is not on PATH.
pub fn require(name: &str) -> anyhow::Result<()> {
    match on_path(name) {
        Some(_) => Ok(()),
        None => anyhow::bail!(missing_message(name)),
    }
}

/// Runs `cmd` to completion. A program that cannot be started is an error naming it and its
/// package (not a bare "No such file or directory").
pub fn output(cmd: &mut Command) -> anyhow::Result<Output> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            anyhow::anyhow!(missing_message(&name))
        } else {
            anyhow::anyhow!("could not run {name}: {e}")
        }
    })
}

/// Runs `cmd`, which must succeed; its stdout. A failure carries the command and what it
/// printed.
pub fn must(cmd: &mut Command) -> anyhow::Result<String> {
    let out = output(cmd)?;
    if !out.status.success() {
        anyhow::bail!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `args[0] args[1..]` run to completion, for tests: a program that cannot start fails the
/// test, naming its package.
pub fn sh(args: &[&str]) -> Output {
    output(Command::new(args[0]).args(&args[1..])).unwrap_or_else(|e| panic!("{e:#}"))
}

/// [`sh`] for a command that must succeed.
pub fn sh_ok(args: &[&str]) {
    let out = sh(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_program_is_named_with_its_package() {
        // Through a variable: the source scan in xtask would take a literal for a real use.
        let absent = "modprobe-not-here";
        let e = output(&mut Command::new(absent)).unwrap_err();
        assert!(
            e.to_string()
                .contains("`modprobe-not-here` is not installed"),
            "{e}"
        );
        assert!(missing_message("modprobe").contains("Debian package kmod"));
        assert!(missing_message("nft").contains("provision --vm"));
        assert!(require("sh-surely-not-a-program").is_err());
        assert!(require("sh").is_ok());
    }
}
