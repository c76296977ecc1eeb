//! Building this crate needs the `bpf-linker` binary, which cargo cannot express as a
//! dependency: rebuild whenever it changes. `cargo xtask provision` installs it.
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(e) => {
            println!("cargo:warning=bpf-linker not found ({e}); run `cargo xtask provision` first")
        }
    }
}
