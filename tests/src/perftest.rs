//! perftest's `ib_send_bw` as the yardstick of the benchmarks, timed from outside.
//!
//! Its own figures cannot be used in the VM: under software emulation its cycle-counter clock
//! is off by orders of magnitude (it printed "640 iterations, 0.00 MB/sec" for a run that took
//! seconds: seen here), and its duration mode (-D) counted 0 iterations. So the client is
//! timed from outside, twice, with a short run and with `iters`, and the rate is the
//! difference of messages over the difference of times: the fixed costs (process start,
//! device open, the TCP exchange, QP setup) cancel.

use std::{
    net::IpAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

/// One `ib_send_bw` configuration: server in network namespace `server_ns` listening on
/// `server`, client in `client_ns` (None: this namespace).
pub struct SendBw<'a> {
    pub dev: &'a str,
    pub gid_index: u8,
    /// Message size in bytes (-s).
    pub size: u32,
    /// Sends in flight per QP (-t).
    pub window: u32,
    /// QPs (-q).
    pub qps: u32,
    /// Wait for completions on a completion channel (-e), as the engine does, instead of
    /// polling the CQ in a loop: the client's CPU time is then its work, not its wait.
    pub events: bool,
    pub server_ns: &'a str,
    pub client_ns: Option<&'a str>,
    pub server: IpAddr,
}

/// What a run of `ib_send_bw` measured (the short run's fixed costs taken out).
#[derive(Clone, Copy, Debug)]
pub struct SendBwRate {
    /// Messages per second, all QPs together.
    pub msg_per_s: f64,
    /// The client's CPU time (user + system: on soft-RoCE its sends are built in the kernel
    /// within its own post calls) per message, in seconds. Without `events` it spins on its
    /// CQ: this is then its wall time, an upper bound on its work.
    pub client_cpu_s_per_msg: f64,
}

impl SendBw<'_> {
    /// Messages per second (all QPs together) over a run of `iters` messages per QP, and the
    /// client's CPU time per message.
    pub fn rate(&self, iters: u64) -> Result<SendBwRate> {
        let short = u64::from(2 * self.window);
        let iters = iters.max(4 * short);
        let (t0, cpu0) = self.once(short)?;
        let (t1, cpu1) = self.once(iters)?;
        ensure!(
            t1 > t0,
            "ib_send_bw: {iters} messages took no longer than {short}"
        );
        let msgs = ((iters - short) * u64::from(self.qps)) as f64;
        Ok(SendBwRate {
            msg_per_s: msgs / (t1 - t0),
            client_cpu_s_per_msg: (cpu1 - cpu0).max(0.0) / msgs,
        })
    }

    fn in_ns(ns: Option<&str>) -> Command {
        match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "ib_send_bw"]);
                c
            }
            None => Command::new("ib_send_bw"),
        }
    }

    /// One run; the client's wall time and CPU time in seconds.
    fn once(&self, iters: u64) -> Result<(f64, f64)> {
        let mut common = vec![
            "-d".to_string(),
            self.dev.to_string(),
            "-x".into(),
            self.gid_index.to_string(),
            "-s".into(),
            self.size.to_string(),
            "-t".into(),
            self.window.to_string(),
            "-q".into(),
            self.qps.to_string(),
            "-n".into(),
            iters.to_string(),
            "-F".into(),
        ];
        if self.events {
            common.push("-e".into());
        }
        let mut srv = Self::in_ns(Some(self.server_ns))
            .args(&common)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("ib_send_bw (perftest) server")?;
        // The client is retried until the server listens; only the run that worked is timed.
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(200));
            let t = Instant::now();
            // The client is the only child reaped in between (`ip netns exec` execs it).
            let cpu = children_cpu_s();
            let o = Self::in_ns(self.client_ns)
                .args(&common)
                .arg(self.server.to_string())
                .output()
                .context("ib_send_bw (perftest) client")?;
            let secs = t.elapsed().as_secs_f64();
            let cpu = children_cpu_s() - cpu;
            if o.status.success() {
                let _ = srv.wait();
                let text = String::from_utf8_lossy(&o.stdout);
                ensure!(
                    text.contains("#bytes"),
                    "ib_send_bw printed no result:\n{text}"
                );
                return Ok((secs, cpu));
            }
        }
        let _ = srv.kill();
        let _ = srv.wait();
        bail!("ib_send_bw client never ran")
    }
}

/// User + system CPU seconds of this process's children that have been waited for.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(ru.ru_utime) + s(ru.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waited_childs_cpu_time_is_counted() {
        let before = children_cpu_s();
        // A child that spins for about 0.3 s of CPU.
        let st = Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(st.success());
        let spent = children_cpu_s() - before;
        assert!(spent > 0.05, "the child's CPU: {spent} s");
    }
}
