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
    pub server_ns: &'a str,
    pub client_ns: Option<&'a str>,
    pub server: IpAddr,
}

impl SendBw<'_> {
    /// Messages per second (all QPs together) over a run of `iters` messages per QP.
    pub fn msg_per_s(&self, iters: u64) -> Result<f64> {
        let short = u64::from(2 * self.window);
        let iters = iters.max(4 * short);
        let t0 = self.once(short)?;
        let t1 = self.once(iters)?;
        ensure!(
            t1 > t0,
            "ib_send_bw: {iters} messages took no longer than {short}"
        );
        Ok(((iters - short) * u64::from(self.qps)) as f64 / (t1 - t0))
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

    /// One run; the client's wall time in seconds.
    fn once(&self, iters: u64) -> Result<f64> {
        let common = [
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
            let o = Self::in_ns(self.client_ns)
                .args(&common)
                .arg(self.server.to_string())
                .output()
                .context("ib_send_bw (perftest) client")?;
            let secs = t.elapsed().as_secs_f64();
            if o.status.success() {
                let _ = srv.wait();
                let text = String::from_utf8_lossy(&o.stdout);
                ensure!(
                    text.contains("#bytes"),
                    "ib_send_bw printed no result:\n{text}"
                );
                return Ok(secs);
            }
        }
        let _ = srv.kill();
        let _ = srv.wait();
        bail!("ib_send_bw client never ran")
    }
}
