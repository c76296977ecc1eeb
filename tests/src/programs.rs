//! The programs the tests run, and where each comes from: the table provisioning installs
//! from (`xtask/src/programs.rs`, included here as it is), and the one way the test
//! libraries start a program, which names the package when the program is missing.

use std::process::{Command, Output};

#[path = "../../xtask/src/programs.rs"]
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
