//! The slow-machine mode: the VM held to a share of the CPU through a cgroup's CPU quota, so
//! that a run as slow as CI's slowest machines can be had on demand (docs/testing.md).

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

/// The vCPUs the VM is given (vng `--cpus`): the quota is a share of what they could take.
pub const VM_CPUS: u32 = 2;

/// A cgroup whose CPU quota holds the processes started in it to `VM_CPUS / factor` CPUs;
/// removed when dropped.
pub struct CpuCap {
    dir: PathBuf,
    procs: File,
    factor: f64,
}

/// The CFS period the quota is a share of (the kernel's default).
const PERIOD_US: u64 = 100_000;

/// The quota, in µs per period, that makes `cpus` CPUs `factor` times slower.
pub fn quota_us(cpus: u32, factor: f64) -> u64 {
    (f64::from(cpus) * PERIOD_US as f64 / factor).round() as u64
}

impl CpuCap {
    /// A new cgroup for a VM `factor` (above 1) times slower than it would run free.
    pub fn new(factor: f64) -> Result<Self> {
        if !(factor.is_finite() && factor > 1.0) {
            bail!(
                "--slow takes a factor above 1 (2.5: the VM gets 2/2.5 = 0.8 of a CPU), not {factor}"
            );
        }
        let name = format!("ipoib-vm-slow-{}", std::process::id());
        let quota = quota_us(VM_CPUS, factor);
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let v2 = Path::new("/sys/fs/cgroup");
        let dir = if v1.join("cpu.cfs_quota_us").exists() {
            let dir = v1.join(&name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
            write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
            dir
        } else if std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"))
        {
            // Best effort: the root may already hand the cpu controller down.
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+cpu");
            let dir = v2.join(&name);
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            write(&dir.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?;
            dir
        } else {
            bail!(
                "the slow-machine mode needs the cgroup cpu controller (cgroup v1 at {} or v2 \
                 at {} with cpu in cgroup.controllers); neither is here",
                v1.display(),
                v2.display()
            );
        };
        let procs = File::options()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .with_context(|| format!("opening {}/cgroup.procs", dir.display()))?;
        Ok(Self { dir, procs, factor })
    }

    /// Starts `cmd` inside the cgroup: what it starts (vng, then qemu) stays there.
    pub fn hold(&self, cmd: &mut Command) {
        let fd = self.procs.as_raw_fd();
        // SAFETY: write(2) is async-signal-safe; "0" moves the writing process (the child,
        // between fork and exec) into the cgroup, on v1 and v2 alike.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    /// How much of the run the VM wanted more CPU than its quota: the share of the quota's
    /// periods in which the cgroup was throttled (its cpu.stat, v1 and v2 alike). Near 1, the
    /// run waited on the CPU, not on the clock.
    pub fn throttled(&self) -> Option<f64> {
        throttled_share(&std::fs::read_to_string(self.dir.join("cpu.stat")).ok()?)
    }

    pub fn describe(&self) -> String {
        format!(
            "slow-machine mode: the VM held to {:.2} CPUs ({}x slower, cgroup {})",
            f64::from(VM_CPUS) / self.factor,
            self.factor,
            self.dir.display()
        )
    }
}

impl Drop for CpuCap {
    fn drop(&mut self) {
        // The killed qemu may take a moment to leave; an empty cgroup is removed at once.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("warning: {} not removed (still in use)", self.dir.display());
    }
}

/// `nr_throttled / nr_periods` of a cgroup's cpu.stat; None before its first period.
pub fn throttled_share(stat: &str) -> Option<f64> {
    let field = |name: &str| {
        stat.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<u64>()
                .ok()
        })
    };
    let periods = field("nr_periods").filter(|p| *p > 0)?;
    Some(field("nr_throttled")? as f64 / periods as f64)
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value} to {}", path.display()))
}

/// How long this machine takes for a fixed piece of work on one CPU (xtask's own arithmetic,
/// about a second): printed beside a run's times, so that a slower run can be told from a
/// slower machine.
pub fn workload() -> Duration {
    let t = std::time::Instant::now();
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    for _ in 0..WORKLOAD_STEPS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x = std::hint::black_box(x);
    }
    t.elapsed()
}

/// The steps of [`workload`].
const WORKLOAD_STEPS: u32 = 100_000_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quota_is_the_vms_cpus_over_the_factor() {
        assert_eq!(quota_us(2, 2.5), 80_000);
        assert_eq!(quota_us(2, 2.0), 100_000);
        assert_eq!(quota_us(1, 4.0), 25_000);
    }

    #[test]
    fn the_throttled_share_is_read_from_cpu_stat() {
        // As cgroup v1 printed it through a rails test in the slow mode.
        let v1 = "nr_periods 1313\nnr_throttled 1302\nthrottled_time 108100580388\n\
                  nr_bursts 0\nburst_time 0\n";
        assert_eq!(throttled_share(v1), Some(1302.0 / 1313.0));
        let v2 = "usage_usec 5000\nuser_usec 4000\nsystem_usec 1000\nnr_periods 10\n\
                  nr_throttled 5\nthrottled_usec 100\n";
        assert_eq!(throttled_share(v2), Some(0.5));
        assert_eq!(throttled_share("nr_periods 0\nnr_throttled 0\n"), None);
        assert_eq!(throttled_share("nr_throttled 3\n"), None);
        assert_eq!(throttled_share("nr_periods 4\n"), None);
    }

    #[test]
    fn a_factor_of_one_or_less_is_refused_before_any_cgroup_is_made() {
        for f in [1.0, 0.5, -2.0, f64::NAN, f64::INFINITY] {
            let e = CpuCap::new(f).err().expect("refused");
            assert!(e.to_string().contains("factor above 1"), "{e}");
        }
    }
}
