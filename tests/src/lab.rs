//! The two-node lab: two network namespaces joined by a veth pair, each end with the
//! datapath attached by a real `ipoib-ctl` process. [`Lab::star`] builds one of more nodes,
//! each on a veth whose other end is in a bridge (the subnet's switch).
//!
//! With `cm_path`, a second veth pair joins the namespaces as a stand-in for the CM device:
//! a peer entry marked CM_UP with its ifindex makes `ipoib_egress` redirect big packets into
//! it, and the other node's stack takes them (same MAC as its lab interface, rp_filter off).
//! That proves the redirect on real traffic, GSO super-packets included, without RDMA.
//!
//! The lab's interfaces have TCP segmentation offload off ([`Node::set_tso`]): they stand in
//! for IPoIB in datagram mode without offloads, where the CPU builds every datagram.
//!
//! Namespaces are entered with `nsenter --net` only, so every process shares one bpffs (the
//! pins); `ip netns exec` would mount a fresh /sys per command.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use crate::programs::{must, output as run};
use anyhow::{Context as _, Result, bail};
use ipoib_ctl::{
    status::cm::CmStatus,
    status::{PeerModeView, PeerView, Status},
};

/// One node of the lab.
#[derive(Debug, Clone)]
pub struct Node {
    pub ns: String,
    /// The lab interface (what `ipoib-ctl attach` is given).
    pub iface: String,
    /// The CM stand-in interface, when the lab has one.
    pub cm_iface: Option<String>,
    pub ip4: Ipv4Addr,
    pub ip6: String,
    /// The `ipoib-ctl` this node runs, when not this build's ([`ctl_path`]): a benchmark's
    /// baseline built from another commit.
    pub ctl_exe: Option<PathBuf>,
}

pub struct Lab {
    pub a: Node,
    pub b: Node,
    /// Nodes past the first two ([`Lab::star`]).
    pub more: Vec<Node>,
    /// The second rail's interfaces of A and B ([`Lab::second_rail`]): the same namespaces.
    rails: Vec<Node>,
    /// The bridge joining the nodes of a star, in the initial namespace.
    bridge: Option<String>,
    children: Vec<Child>,
}

/// The `ipoib-ctl` binary built beside the running test or binary.
pub fn ctl_path() -> PathBuf {
    if let Ok(p) = std::env::var("IPOIB_CTL") {
        return p.into();
    }
    sibling_exe("ipoib-ctl")
}

/// A binary of this workspace built beside the running one (a test binary runs from `deps/`).
pub fn sibling_exe(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

fn ip(args: &[&str]) -> Result<String> {
    must(Command::new("ip").args(args))
}

impl Node {
    /// The bridge's end of this node's veth in a star lab ([`Lab::star`]), in the initial
    /// namespace.
    pub fn switch_port(&self) -> String {
        format!("{}h", self.iface.trim_end_matches('0'))
    }

    /// The `ipoib-ctl` this node runs.
    pub fn ctl_exe(&self) -> PathBuf {
        self.ctl_exe.clone().unwrap_or_else(ctl_path)
    }

    /// Where [`Lab::attach_node`] writes what this node's `ipoib-ctl attach` logs.
    pub fn log_path(&self) -> PathBuf {
        std::env::temp_dir().join(format!("{}.{}.ctl.log", self.ns, self.iface))
    }

    /// A command run inside this node's network namespace (and only that namespace).
    ///
    /// Panics, naming the Debian package, when `program` is not installed: nsenter would
    /// otherwise fail later with a bare exit status 127.
    pub fn cmd(&self, program: &str) -> Command {
        if let Err(e) = crate::programs::require(program) {
            panic!("{e:#}");
        }
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns))
            .arg("--")
            .arg(program);
        c
    }

    /// Turns TCP segmentation offload on or off on this node's interface. The lab builds its
    /// interfaces with it off: they stand in for IPoIB in datagram mode on an HCA without
    /// offloads (the CPU builds every datagram, GSO in software), the case connected mode is
    /// for; with it on they stand in for a UD path that segments in the device (Enhanced
    /// IPoIB), where `attach` promotes no peer by its rate.
    pub fn set_tso(&self, on: bool) -> Result<()> {
        let state = if on { "on" } else { "off" };
        must(self.cmd("ethtool").args(["-K", &self.iface, "tso", state]))?;
        Ok(())
    }

    /// `ipoib-ctl ARGS` in this node's namespace.
    pub fn ctl(&self, args: &[&str]) -> Result<Output> {
        run(self
            .cmd(self.ctl_exe().to_str().expect("utf-8 path"))
            .args(args))
    }

    /// `ipoib-ctl set-policy IFACE SETTING`, which must succeed (its stderr in the error if
    /// not); its output, for what it printed.
    pub fn set_policy(&self, setting: &str) -> Result<Output> {
        let out = self.ctl(&["set-policy", &self.iface, setting])?;
        if !out.status.success() {
            bail!(
                "set-policy {setting} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(out)
    }

    /// `ipoib-ctl status IFACE --json`, as JSON (for tests that read paths of it).
    pub fn status_json(&self) -> Result<serde_json::Value> {
        let out = self.ctl(&["status", &self.iface, "--json"])?;
        if !out.status.success() {
            bail!("status failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok(v[0].clone())
    }

    /// `ipoib-ctl status IFACE --json`, typed.
    pub fn status(&self) -> Result<Status> {
        Ok(serde_json::from_value(self.status_json()?)?)
    }

    /// The JSON status of one peer, if the node knows it.
    pub fn peer_json(&self, addr: &str) -> Result<Option<serde_json::Value>> {
        let s = self.status_json()?;
        Ok(s["peers"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["addr"] == addr).cloned()))
    }

    /// The fast path's view of one peer, if the node knows it.
    pub fn peer(&self, addr: &str) -> Result<Option<PeerView>> {
        Ok(self.status()?.peers.into_iter().find(|p| p.addr == addr))
    }

    /// Connected mode's status as the control loop last wrote it (None: not running).
    pub fn cm(&self) -> Result<Option<CmStatus>> {
        Ok(self.status()?.cm)
    }

    /// Waits up to `within` for this node's entry of `peer` to be in `mode`; the entry then,
    /// or None.
    pub fn wait_peer_mode(
        &self,
        peer: &str,
        mode: PeerModeView,
        within: Duration,
    ) -> Option<PeerView> {
        let mut found = None;
        crate::pace::wait_until(within, || {
            found = self.peer(peer).ok().flatten().filter(|p| p.mode == mode);
            found.is_some()
        });
        found
    }

    /// ifindex of `iface` in this namespace.
    pub fn ifindex(&self, iface: &str) -> Result<u32> {
        let out = must(self.cmd("ip").args(["-o", "link", "show", "dev", iface]))?;
        out.split(':')
            .next()
            .and_then(|n| n.trim().parse().ok())
            .context("parsing ip link output")
    }
}

impl Lab {
    /// Builds the lab. `tag` (at most 6 characters) keeps names unique between labs.
    pub fn new(tag: &str, cm_path: bool) -> Result<Self> {
        Self::build(tag, cm_path, 2)
    }

    /// A lab of `nodes` nodes (3 to 26: a, b, c, ...) joined by a bridge: 10.77.0.1, .2, ...
    pub fn star(tag: &str, nodes: usize) -> Result<Self> {
        assert!((3..=26).contains(&nodes), "a star has 3 to 26 nodes");
        Self::build(tag, false, nodes)
    }

    fn build(tag: &str, cm_path: bool, nodes: usize) -> Result<Self> {
        assert!(tag.len() <= 6, "lab tag too long for interface names");
        let node = |i: usize| {
            let side = char::from(b'a' + i as u8);
            let n = i as u8 + 1;
            Node {
                ns: format!("ipoib-lab-{tag}-{side}"),
                iface: format!("{tag}{side}0"),
                cm_iface: cm_path.then(|| format!("{tag}{side}cm")),
                ip4: Ipv4Addr::new(10, 77, 0, n),
                ip6: format!("fd77::{n}"),
                ctl_exe: None,
            }
        };
        let lab = Lab {
            a: node(0),
            b: node(1),
            more: (2..nodes).map(node).collect(),
            rails: Vec::new(),
            bridge: (nodes > 2).then(|| format!("{tag}br")),
            children: Vec::new(),
        };
        lab.teardown_net();
        for n in lab.nodes() {
            ip(&["netns", "add", &n.ns])?;
            must(n.cmd("ip").args(["link", "set", "lo", "up"]))?;
            for (k, v) in [
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ] {
                let _ = run(n.cmd("sysctl").args(["-qw", &format!("{k}={v}")]));
            }
        }
        if let Some(br) = &lab.bridge {
            ip(&["link", "add", br, "type", "bridge"])?;
            ip(&["link", "set", br, "up"])?;
            for n in lab.nodes() {
                let port = n.switch_port();
                ip(&[
                    "link", "add", &n.iface, "type", "veth", "peer", "name", &port,
                ])?;
                ip(&["link", "set", &port, "master", br, "up"])?;
            }
        } else {
            ip(&[
                "link",
                "add",
                &lab.a.iface,
                "type",
                "veth",
                "peer",
                "name",
                &lab.b.iface,
            ])?;
        }
        for n in lab.nodes() {
            ip(&["link", "set", &n.iface, "netns", &n.ns])?;
            must(
                n.cmd("ip")
                    .args(["addr", "add", &format!("{}/24", n.ip4), "dev", &n.iface]),
            )?;
            must(n.cmd("ip").args([
                "addr",
                "add",
                &format!("{}/64", n.ip6),
                "dev",
                &n.iface,
                "nodad",
            ]))?;
            must(n.cmd("ip").args(["link", "set", &n.iface, "up"]))?;
            n.set_tso(false)?;
        }
        if let (Some(ac), Some(bc)) = (&lab.a.cm_iface, &lab.b.cm_iface) {
            ip(&["link", "add", ac, "type", "veth", "peer", "name", bc])?;
            for n in [&lab.a, &lab.b] {
                let cm = n.cm_iface.as_deref().expect("cm iface");
                ip(&["link", "set", cm, "netns", &n.ns])?;
                // Frames redirected into the stand-in carry the lab interface's destination
                // MAC: give the receiving end that MAC so its stack takes them.
                // (ip link, not /sys: under nsenter --net, sysfs shows another namespace.)
                let mac = lab_mac(n)?;
                must(n.cmd("ip").args(["link", "set", cm, "address", &mac]))?;
                must(n.cmd("ip").args(["link", "set", cm, "up"]))?;
                let _ = run(n
                    .cmd("sysctl")
                    .args(["-qw", &format!("net.ipv4.conf.{cm}.rp_filter=0")]));
            }
        }
        Ok(lab)
    }

    /// Every node: a, b, then the rest of a star.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        [&self.a, &self.b].into_iter().chain(&self.more)
    }

    /// A second link between A and B (two-node labs): a veth pair `TAGa1`-`TAGb1` in their
    /// namespaces, 10.80.0.1 and .2/24, fd80::1 and ::2/64: a second rail. Its ends, as nodes
    /// (A's namespace, its second interface; B's), torn down with the lab.
    pub fn second_rail(&mut self) -> Result<(Node, Node)> {
        assert!(
            self.bridge.is_none() && self.rails.is_empty(),
            "a second rail joins the two nodes of a two-node lab, once"
        );
        let rail = |n: &Node, i: u8| Node {
            ns: n.ns.clone(),
            iface: second_rail_iface(&n.iface),
            cm_iface: None,
            ip4: Ipv4Addr::new(10, 80, 0, i),
            ip6: format!("fd80::{i}"),
            ctl_exe: n.ctl_exe.clone(),
        };
        let (a, b) = (rail(&self.a, 1), rail(&self.b, 2));
        ip(&[
            "link", "add", &a.iface, "type", "veth", "peer", "name", &b.iface,
        ])?;
        for n in [&a, &b] {
            ip(&["link", "set", &n.iface, "netns", &n.ns])?;
            let cidr4 = format!("{}/24", n.ip4);
            let cidr6 = format!("{}/64", n.ip6);
            must(n.cmd("ip").args(["addr", "add", &cidr4, "dev", &n.iface]))?;
            must(
                n.cmd("ip")
                    .args(["addr", "add", &cidr6, "dev", &n.iface, "nodad"]),
            )?;
            must(n.cmd("ip").args(["link", "set", &n.iface, "up"]))?;
            n.set_tso(false)?;
        }
        self.rails = vec![a.clone(), b.clone()];
        Ok((a, b))
    }

    /// Starts `ipoib-ctl attach` on a node, waiting until its heartbeat is fresh.
    pub fn attach(&mut self, which: Which, extra: &[&str]) -> Result<u32> {
        let n = self.node(which).clone();
        self.attach_node(&n, extra)
    }

    /// Starts `ipoib-ctl attach` on any node of the lab, as [`Lab::attach`].
    pub fn attach_node(&mut self, n: &Node, extra: &[&str]) -> Result<u32> {
        self.attach_node_env(n, extra, &[])
    }

    /// As [`Lab::attach_node`], with these variables in its environment (`NOTIFY_SOCKET`).
    pub fn attach_node_env(
        &mut self,
        n: &Node,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<u32> {
        self.attach_node_as(n, &n.ctl_exe(), extra, env)
    }

    /// As [`Lab::attach_node_env`], run as `ctl` (a wrapper that confines this build's
    /// ipoib-ctl, say: [`crate::sandbox::wrapper`]); the node's other commands (`status`)
    /// stay its own.
    pub fn attach_node_as(
        &mut self,
        n: &Node,
        ctl: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<u32> {
        if !ctl.exists() {
            bail!(
                "{} is not built: `cargo xtask test` builds it (or `cargo build -p ipoib-ctl`)",
                ctl.display()
            );
        }
        let log = n.log_path();
        let log_file = std::fs::File::create(&log)?;
        let child = n
            .cmd(ctl.to_str().expect("utf-8 path"))
            .arg("attach")
            .arg(&n.iface)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .context("spawning ipoib-ctl attach")?;
        let pid = child.id();
        self.children.push(child);
        // Loading the programs and setting up connected mode (registering the receive buffers)
        // take seconds under software emulation: seen 11 s for the load alone in the VM.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut looks = crate::pace::Looks::new(Duration::from_millis(100));
        loop {
            let seen = match n.status() {
                Ok(s) if s.loop_running && !s.failsafe_active && s.loop_pid == Some(pid) => {
                    return Ok(pid);
                }
                Ok(s) => format!(
                    "status: loop_running {} failsafe_active {} (heartbeat {:?} ms old) \
                     loop_pid {:?}",
                    s.loop_running, s.failsafe_active, s.heartbeat_age_ms, s.loop_pid
                ),
                Err(e) => format!("status failed: {e:#}"),
            };
            if Instant::now() > deadline {
                bail!(
                    "ipoib-ctl attach {} did not come up: {}\n{seen}\n{}",
                    n.iface,
                    std::fs::read_to_string(&log).unwrap_or_default(),
                    process_state(pid)
                );
            }
            looks.rest();
        }
    }

    /// Every node of the lab runs `exe` as its `ipoib-ctl` from now on (a benchmark's
    /// baseline, built from another commit).
    pub fn run_ctl(&mut self, exe: &std::path::Path) {
        for n in [&mut self.a, &mut self.b]
            .into_iter()
            .chain(self.more.iter_mut())
        {
            n.ctl_exe = Some(exe.to_path_buf());
        }
    }

    pub fn node(&self, which: Which) -> &Node {
        match which {
            Which::A => &self.a,
            Which::B => &self.b,
        }
    }

    /// Kills a control loop the hard way (as a crash would).
    pub fn kill9(&mut self, pid: u32) {
        // SAFETY: plain kill(2).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        for c in &mut self.children {
            if c.id() == pid {
                let _ = c.wait();
            }
        }
    }

    /// Stops every control loop and removes namespaces, links and pins. Idempotent.
    pub fn teardown(&mut self) {
        for n in self.nodes().chain(&self.rails) {
            let _ = n.ctl(&["detach", &n.iface]);
        }
        // detach told each loop to stop: give them a moment to exit cleanly.
        let deadline = Instant::now() + Duration::from_secs(2);
        for c in &mut self.children {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        self.teardown_net();
    }

    fn teardown_net(&self) {
        for n in self.nodes() {
            let _ = run(Command::new("ip").args(["netns", "del", &n.ns]));
            if self.bridge.is_some() {
                let _ = run(Command::new("ip").args(["link", "del", &n.switch_port()]));
            }
            // Pins of an interface that died with its namespace (and of its second rail's,
            // made or not: a run that died leaves them).
            for iface in [n.iface.clone(), second_rail_iface(&n.iface)] {
                let _ = std::fs::remove_dir_all(format!("/sys/fs/bpf/ipoib/{iface}"));
                let _ = std::fs::remove_file(format!("/run/ipoib-ctl/{iface}.json"));
            }
        }
        if let Some(br) = &self.bridge {
            let _ = run(Command::new("ip").args(["link", "del", br]));
        }
    }
}

/// A node's second-rail interface: its lab interface's name (`TAGx0`) ending in 1.
fn second_rail_iface(iface: &str) -> String {
    format!("{}1", iface.strip_suffix('0').unwrap_or(iface))
}

/// What a process is doing, for a failure message: its state, where it waits in the kernel,
/// its threads, and the memory the machine has left.
pub fn process_state(pid: u32) -> String {
    let read = |p: String| std::fs::read_to_string(p).unwrap_or_default();
    let status = read(format!("/proc/{pid}/status"));
    let state = status
        .lines()
        .filter(|l| l.starts_with("State:") || l.starts_with("Threads:") || l.starts_with("VmRSS:"))
        .collect::<Vec<_>>()
        .join("; ");
    let mem = read("/proc/meminfo".into())
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .unwrap_or_default()
        .to_string();
    format!(
        "pid {pid}: {state}; wchan {}; stack:\n{}\n{mem}",
        read(format!("/proc/{pid}/wchan")),
        read(format!("/proc/{pid}/stack"))
    )
}

fn lab_mac(n: &Node) -> Result<String> {
    let out = must(n.cmd("ip").args(["-o", "link", "show", "dev", &n.iface]))?;
    out.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .map(str::to_string)
        .context("no MAC in ip link output")
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.teardown();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    A,
    B,
}

/// A counter in `status --json` output (0 when absent).
pub fn json_u64(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// Whether the lab can run here: root, `ip`, `nsenter`. Returns a reason when it cannot.
pub fn lab_unavailable() -> Option<String> {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the lab needs root (network namespaces, BPF)".into());
    }
    for tool in ["ip", "nsenter", "ping"] {
        if let Err(e) = crate::programs::require(tool) {
            return Some(e.to_string());
        }
    }
    None
}

/// Parses ping's summary: (transmitted, received).
pub fn ping_summary(out: &str) -> Option<(u32, u32)> {
    let line = out.lines().find(|l| l.contains("packets transmitted"))?;
    let mut nums = line
        .split(',')
        .filter_map(|part| part.split_whitespace().next()?.parse::<u32>().ok());
    Some((nums.next()?, nums.next()?))
}

/// A lab of two nodes (`tag`), or `None` after a loud skip where this machine cannot build
/// one (not root, no veth); with `IPOIB_REQUIRE_BPF=1` (CI) that is a failure instead.
pub fn lab_or_skip(test: &str, tag: &str, cm_path: bool) -> Option<Lab> {
    if let Some(why) = lab_unavailable() {
        if std::env::var("IPOIB_REQUIRE_BPF").is_ok_and(|v| v == "1") {
            panic!("{test}: {why}");
        }
        crate::loud_skip(test, &why);
        return None;
    }
    Some(Lab::new(tag, cm_path).unwrap_or_else(|e| panic!("{test}: building the lab: {e:#}")))
}
