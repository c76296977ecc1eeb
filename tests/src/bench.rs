//! What the benchmarks share: the machine's busy CPU time, the median of rounds, and running
//! the commands that build their devices.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};

/// /proc/stat's unit (USER_HZ): ticks per second.
pub const TICKS_PER_S: f64 = 100.0;

/// Busy ticks of all CPUs together (everything but idle and iowait), from /proc/stat.
pub fn busy_ticks() -> Result<u64> {
    Ok(CpuSplit::now()?.busy)
}

/// Busy ticks of all CPUs together, and split by what ran: userspace, the kernel on behalf
/// of a process (system), and interrupts and softirqs (where soft-RoCE and the network
/// stack's receive side do most of their work). From /proc/stat's first line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuSplit {
    /// Every column but idle and iowait.
    pub busy: u64,
    pub user: u64,
    pub system: u64,
    pub irq: u64,
}

impl CpuSplit {
    pub fn now() -> Result<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat")?)
    }

    /// From /proc/stat's text: `cpu user nice system idle iowait irq softirq steal ...`.
    pub fn parse(stat: &str) -> Result<Self> {
        let v: Vec<u64> = stat
            .lines()
            .next()
            .context("/proc/stat")?
            .split_whitespace()
            .skip(1)
            .filter_map(|w| w.parse().ok())
            .collect();
        ensure!(v.len() >= 7, "/proc/stat: {v:?}");
        Ok(Self {
            busy: v.iter().sum::<u64>() - v[3] - v[4],
            user: v[0] + v[1],
            system: v[2],
            irq: v[5] + v[6],
        })
    }

    /// What ran between `before` and `self`.
    pub fn since(self, before: Self) -> Self {
        Self {
            busy: self.busy.saturating_sub(before.busy),
            user: self.user.saturating_sub(before.user),
            system: self.system.saturating_sub(before.system),
            irq: self.irq.saturating_sub(before.irq),
        }
    }
}

/// user + system ticks of a process or thread, from its `stat` file (`/proc/PID/stat`, or
/// `/proc/self/task/TID/stat` for a thread): every thread of a process is in its own.
pub fn stat_ticks(path: &str) -> Result<u64> {
    let (user, system) = stat_user_system(path)?;
    Ok(user + system)
}

/// user and system ticks of a process or thread apart, as [`stat_ticks`].
pub fn stat_user_system(path: &str) -> Result<(u64, u64)> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    // After the command's closing parenthesis: field 3 (state) onward; utime and stime are
    // fields 14 and 15.
    let rest = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|w| w.parse().unwrap_or(0))
        .collect();
    ensure!(f.len() == 2, "{path}: {stat}");
    Ok((f[0], f[1]))
}

/// The median of `v` (the upper one of an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The mean of the middle half of `v` (sorted): robust to the outliers a median is, and finer
/// than the clock's step when every sample is a multiple of it (a single BPF_PROG_TEST_RUN
/// is timed to 10 ns steps here).
pub fn interquartile_mean(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = &v[v.len() / 4..v.len() - v.len() / 4];
    if mid.is_empty() {
        return f64::NAN;
    }
    mid.iter().sum::<f64>() / mid.len() as f64
}

/// Prints `result` as the one line after `BENCH-JSON ` and saves it to `out` when given.
pub fn publish(result: &serde_json::Value, out: Option<&Path>) -> Result<()> {
    println!("BENCH-JSON {result}");
    if let Some(out) = out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(out, format!("{result}\n"))
            .with_context(|| format!("saving {}", out.display()))?;
        println!("==> saved {}", out.display());
    }
    Ok(())
}

/// Runs `args` (a program and its arguments); its stderr is the error when it fails.
pub fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// That `ethtool -k` shows `dev` with `features` (pairs of short name and on|off) as asked:
/// a stand-in whose offloads did not change would measure something else.
fn check_features(ns: &str, dev: &str, features: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "ethtool", "-k", dev])
        .output()
        .context("ethtool -k")?;
    let shown = String::from_utf8_lossy(&out.stdout);
    for kv in features.chunks(2) {
        let long = match kv[0] {
            "tso" => "tcp-segmentation-offload",
            "gso" => "generic-segmentation-offload",
            "gro" => "generic-receive-offload",
            other => bail!("no long name known for feature {other}"),
        };
        let want = format!("{long}: {}", kv[1]);
        ensure!(
            shown.lines().any(|l| l.trim_start().starts_with(&want)),
            "{dev} in {ns}: asked for {want}, ethtool -k shows:\n{shown}"
        );
    }
    Ok(())
}

/// Two network namespaces a benchmark's path joins (`NAME-a`, the sender, and `NAME-b`), with
/// an iperf3 server in the second once [`NsPair::serve`] started it; the server is killed and
/// the namespaces (and their devices) deleted when dropped.
pub struct NsPair {
    pub ns: [String; 2],
    /// Each end's address (a /24).
    pub ip: [String; 2],
    server: Option<Child>,
}

impl Drop for NsPair {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// What one iperf3 run moved.
#[derive(Clone, Copy, Debug)]
pub struct Iperf {
    pub gbit_s: f64,
    pub bytes: f64,
    /// Busy ticks of all CPUs across the run ([`busy_ticks`]).
    pub busy_ticks: u64,
}

impl Iperf {
    /// CPU seconds per GB moved, over all CPUs.
    pub fn cpu_s_per_gb(&self) -> f64 {
        self.busy_ticks as f64 / TICKS_PER_S / (self.bytes / 1e9)
    }
}

impl NsPair {
    /// The namespaces `NAME-a` and `NAME-b` (any left by a run stopped with Ctrl-C deleted
    /// first), loopback up; `subnet` picks the ends' addresses, 10.`subnet`.1 and .2.
    pub fn new(name: &str, subnet: [u8; 2]) -> Result<Self> {
        let ns = ["a", "b"].map(|end| format!("{name}-{end}"));
        for n in &ns {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        let pair = Self {
            ns,
            ip: [1, 2].map(|h| format!("10.{}.{}.{h}", subnet[0], subnet[1])),
            server: None,
        };
        for n in &pair.ns {
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// A veth pair between the two namespaces, `names[i]` in `ns[i]`, at `mtu`, each end
    /// given its `ethtool -K` settings (checked: a stand-in whose offloads did not change
    /// would measure something else).
    pub fn veth(&self, names: [&str; 2], mtu: &str, features: [&[&str]; 2]) -> Result<()> {
        let (ns, [a, b]) = (&self.ns, names);
        sh(&[
            "ip", "link", "add", a, "mtu", mtu, "netns", &ns[0], "type", "veth", "peer", "name", b,
            "mtu", mtu, "netns", &ns[1],
        ])?;
        for i in 0..2 {
            if !features[i].is_empty() {
                let k = ["ip", "netns", "exec", &ns[i], "ethtool", "-K", names[i]];
                sh(&[&k[..], features[i]].concat())?;
                check_features(&ns[i], names[i], features[i])?;
            }
        }
        Ok(())
    }

    /// Gives `devs[i]` in `ns[i]` its address and brings it up.
    pub fn address(&self, devs: [&str; 2]) -> Result<()> {
        for (i, dev) in devs.iter().enumerate() {
            let cidr = format!("{}/24", self.ip[i]);
            sh(&["ip", "-n", &self.ns[i], "addr", "add", &cidr, "dev", dev])?;
            sh(&["ip", "-n", &self.ns[i], "link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// Starts the iperf3 server on the second end's address.
    pub fn serve(&mut self) -> Result<()> {
        let server = Command::new("ip")
            .args(["netns", "exec", &self.ns[1], "iperf3", "-s", "-p", "5201"])
            .args(["-B", &self.ip[1]])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("iperf3 server")?;
        self.server = Some(server);
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    /// One iperf3 run from the first end to the server, `streams` TCP streams for `secs`
    /// seconds; `what` names the path in an error.
    pub fn iperf3(&self, streams: u32, secs: u32, what: &str) -> Result<Iperf> {
        self.iperf3_writes(streams, secs, None, what)
    }

    /// [`NsPair::iperf3`] with the sender writing `len` bytes at a time (iperf3's `-l`; its
    /// default, 128 KiB, when None).
    pub fn iperf3_writes(
        &self,
        streams: u32,
        secs: u32,
        len: Option<u32>,
        what: &str,
    ) -> Result<Iperf> {
        let busy0 = busy_ticks()?;
        let len = len.map(|l| ["-l".to_string(), l.to_string()]);
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns[0], "iperf3", "-J", "-p", "5201"])
            .args(["-c", &self.ip[1], "-t", &secs.to_string()])
            .args(["-P", &streams.to_string()])
            .args(len.iter().flatten())
            .output()
            .context("iperf3 client")?;
        let busy1 = busy_ticks()?;
        ensure!(
            out.status.success(),
            "iperf3 over {what}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let r: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let bytes = r["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
        let bps = r["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        ensure!(bytes > 0.0, "nothing crossed {what}");
        Ok(Iperf {
            gbit_s: bps / 1e9,
            bytes,
            busy_ticks: busy1 - busy0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_split_reads_proc_stat_columns() {
        let stat = "cpu  10 2 30 400 5 6 7 0 0 0\ncpu0 1 1 1 1 1 1 1 0 0 0\n";
        let s = CpuSplit::parse(stat).unwrap();
        assert_eq!(
            s,
            CpuSplit {
                busy: 55,
                user: 12,
                system: 30,
                irq: 13
            }
        );
        let later = CpuSplit {
            busy: 66,
            user: 20,
            system: 31,
            irq: 13,
        };
        assert_eq!(
            later.since(s),
            CpuSplit {
                busy: 11,
                user: 8,
                system: 1,
                irq: 0
            }
        );
        assert!(CpuSplit::parse("cpu 1 2 3\n").is_err());
    }

    #[test]
    fn stat_ticks_of_this_process_and_a_missing_one() {
        let spin = |ms: u64| {
            let t = std::time::Instant::now();
            let mut x = 0u64;
            while t.elapsed() < std::time::Duration::from_millis(ms) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        };
        // Half a second spinning on this thread: its process is charged for some of it (a
        // field that does not count CPU time, such as the start time, would not move).
        let a = stat_ticks("/proc/self/stat").unwrap();
        spin(500);
        let b = stat_ticks("/proc/self/stat").unwrap();
        assert!(b > a, "{a} -> {b} ticks after 0.5 s spinning");
        // Spinning in userspace is user time, not system time.
        let (u0, s0) = stat_user_system("/proc/self/stat").unwrap();
        spin(300);
        let (u1, s1) = stat_user_system("/proc/self/stat").unwrap();
        assert!(u1 - u0 > s1 - s0, "user {u0} -> {u1}, system {s0} -> {s1}");
        assert!(stat_ticks("/proc/0/stat").is_err());
    }

    #[test]
    fn median_of_odd_even_and_none() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn interquartile_mean_drops_the_outer_quarters() {
        // 8 samples: the middle four are 20, 20, 30, 30; 1 and 1000 are outliers.
        let v = [30.0, 1.0, 20.0, 1000.0, 20.0, 30.0, 10.0, 40.0];
        assert_eq!(interquartile_mean(&v), 25.0);
        assert_eq!(interquartile_mean(&[7.0]), 7.0);
        assert!(interquartile_mean(&[]).is_nan());
    }

    #[test]
    fn busy_ticks_grow_with_work() {
        let a = busy_ticks().unwrap();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(100) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(busy_ticks().unwrap() > a);
    }
}
