//! Two CM nodes on real verbs (soft-RoCE): the resources each node shares across its
//! connections, and a message pump that moves payloads through them. `cm-node` (the peer
//! process in the second network namespace) and the tests in `tests/verbs.rs` both use it.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    os::fd::AsRawFd as _,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

pub use crate::programs::{sh, sh_ok as run};
use anyhow::{Result, bail};

use crate::lab::{ctl_path, sibling_exe};
use ipoib_ctl::{
    cm::{Cm, Connection, HwAddr, SetupError},
    plan::{CM_BUF_SIZE, CM_BUF_STRIDE},
    verbs::{
        Completion, CompletionQueue, Device, MemoryRegion, RcQueuePair, ReceiveModel, Resources,
        SharedReceiveQueue,
    },
};

/// Bytes between receive buffers: one CM message in whole pages.
pub const STRIDE: u64 = CM_BUF_STRIDE;

/// A test node's verbs side (the RC tests' stand-in for a control loop; a lab node, its namespace,
/// is [`crate::lab::Node`]): one SRQ of `depth` CM-sized receives (or a ring per connection),
/// one CQ for sends and receives (with a completion channel), and a region of `send_slots`
/// send buffers.
pub struct Verbs {
    pub dev: Device,
    pub res: Arc<Resources>,
    pub cq: Arc<CompletionQueue>,
    pub send: Arc<MemoryRegion>,
}

impl Verbs {
    pub fn open(dev: &str, depth: u32, send_slots: u32) -> Result<Self> {
        Self::open_with(dev, ReceiveModel::Srq { depth }, send_slots)
    }

    /// With receives as `model` says (an SRQ, or a ring per connection).
    pub fn open_with(dev: &str, model: ReceiveModel, send_slots: u32) -> Result<Self> {
        Self::open_buffers(dev, model, CM_BUF_SIZE as u32, send_slots)
    }

    /// With receive buffers of `buffer` bytes (a message longer fails its receive).
    pub fn open_buffers(
        dev: &str,
        model: ReceiveModel,
        buffer: u32,
        send_slots: u32,
    ) -> Result<Self> {
        Self::open_lanes(dev, model, buffer, send_slots, 1)
    }

    /// With `lanes` lanes (an engine each; the pump uses the first lane's CQ alone).
    pub fn open_lanes(
        dev: &str,
        model: ReceiveModel,
        buffer: u32,
        send_slots: u32,
        lanes: u32,
    ) -> Result<Self> {
        let dev = Device::open(dev)?;
        let res = Resources::create_lanes(&dev, 1, 0, model, buffer, send_slots, STRIDE, lanes)?;
        Ok(Self {
            cq: res.lanes[0].cq.clone(),
            send: res.send.clone(),
            res,
            dev,
        })
    }
}

impl Verbs {
    /// The SRQ (a node opened with one).
    pub fn srq(&self) -> &Arc<SharedReceiveQueue> {
        self.res
            .recv
            .srq()
            .expect("this node receives on rings, not an SRQ")
    }
}

/// A received message.
#[derive(Debug)]
pub struct Received {
    pub qp_num: u32,
    pub data: Vec<u8>,
}

/// Moves messages: sends from free send slots, takes receives off the SRQ (copying them out
/// and posting the buffer again at once), recycles send slots on their completions.
pub struct Pump {
    node: Arc<Verbs>,
    free: Vec<u32>,
    pub sent: u64,
    pub send_errors: Vec<(u32, u32)>,
    /// Receives completed without error, and their bytes.
    pub received: u64,
    pub received_bytes: u64,
    /// Copy received messages out to the sink (off: only count them).
    pub keep: bool,
}

impl Pump {
    pub fn new(node: Arc<Verbs>) -> Self {
        let free = (0..node.send.count).rev().collect();
        Self {
            node,
            free,
            sent: 0,
            send_errors: Vec::new(),
            received: 0,
            received_bytes: 0,
            keep: true,
        }
    }

    /// Posts `data` on `qp`, waiting for a free send slot if there is none.
    pub fn send(&mut self, qp: &RcQueuePair, data: &[u8], sink: &mut Vec<Received>) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.free.is_empty() {
            if Instant::now() > deadline {
                bail!("no send slot came free in 10 s");
            }
            self.progress(sink, Duration::from_millis(50))?;
        }
        let slot = self.free.pop().unwrap();
        // SAFETY: the slot is free (not posted) until its send completes.
        unsafe { self.node.send.slot(slot)[..data.len()].copy_from_slice(data) };
        qp.post_send(&self.node.send, slot, data.len() as u32, slot as u64)?;
        Ok(())
    }

    /// Takes completions, waiting on the channel up to `wait` when there are none: receives go
    /// to `sink` (buffers posted again), sends free their slot.
    pub fn progress(&mut self, sink: &mut Vec<Received>, wait: Duration) -> Result<usize> {
        let mut wcs = Vec::with_capacity(64);
        let mut n = self.node.cq.poll(&mut wcs, 64)?;
        if n == 0 && !wait.is_zero() {
            self.node.cq.arm()?;
            n = self.node.cq.poll(&mut wcs, 64)?;
            if n == 0 && self.node.cq.wait(wait)? {
                n = self.node.cq.poll(&mut wcs, 64)?;
            }
        }
        for wc in &wcs {
            if wc.recv {
                self.on_receive(wc, sink)?;
            } else {
                self.free.push(wc.wr_id as u32);
                match wc.error {
                    None => self.sent += 1,
                    Some(status) => self.send_errors.push((wc.qp_num, status)),
                }
            }
        }
        Ok(n)
    }

    /// A receive: copied out (unless `keep` is off) and its buffer posted again, on the SRQ or
    /// its connection's ring (a ring's receive flushed in error is not: its QP is going).
    fn on_receive(&mut self, wc: &Completion, sink: &mut Vec<Received>) -> Result<()> {
        let Some(buf) = self.node.res.recv.filled(wc) else {
            return Ok(());
        };
        if wc.error.is_some() {
            if buf.qp().is_none() {
                buf.repost()?;
            }
            return Ok(());
        }
        self.received += 1;
        self.received_bytes += u64::from(wc.bytes);
        if self.keep {
            sink.push(Received {
                qp_num: wc.qp_num,
                data: buf.bytes().to_vec(),
            });
        }
        buf.repost()?;
        Ok(())
    }

    /// Receives until `want` messages are in `sink` or `timeout` passes.
    pub fn collect(
        &mut self,
        sink: &mut Vec<Received>,
        want: usize,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while sink.len() < want {
            if Instant::now() > deadline {
                bail!("{} of {want} messages arrived in {timeout:?}", sink.len());
            }
            self.progress(sink, Duration::from_millis(100))?;
        }
        Ok(())
    }
}

/// QPs by number, for routing completions to their connection.
pub type QpTable = Arc<Mutex<HashMap<u32, Arc<RcQueuePair>>>>;

/// A deterministic payload: `len` bytes that differ per connection, size and position.
pub fn pattern(conn: u32, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9u32 ^ conn.wrapping_mul(0x85eb_ca6b) ^ len as u32;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// The kernel's view of `dev`'s memory regions (`rdma resource show mr -j`): how many, and
/// their bytes in all.
pub fn registered_mrs(dev: &str) -> (u64, u64) {
    let out = sh(&["rdma", "resource", "show", "mr", "-j"]);
    let mrs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "rdma resource show mr -j: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let ours = mrs.iter().filter(|m| m["ifname"].as_str() == Some(dev));
    ours.fold((0, 0), |(n, b), m| {
        (n + 1, b + m["mrlen"].as_u64().unwrap_or(0))
    })
}

/// `rdma resource show` counts for `dev` (pd, cq, qp, mr, srq, ...).
pub fn rdma_resources(dev: &str) -> HashMap<String, u64> {
    let out = sh(&["rdma", "resource", "show"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(&format!("{dev}:")))
        .unwrap_or_else(|| panic!("no {dev} in rdma resource show: {text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .filter_map(|w| Some((w[0].to_string(), w[1].parse::<u64>().ok()?)))
        .collect()
}

/// Every RDMA device port's hardware counters (`/sys/class/infiniband/DEV/ports/N/hw_counters`):
/// (device, counter, value), for each port of each device.
pub fn rdma_hw_counters() -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for dev in std::fs::read_dir("/sys/class/infiniband")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = dev.file_name().to_string_lossy().into_owned();
        let ports = std::fs::read_dir(dev.path().join("ports"))
            .into_iter()
            .flatten();
        for port in ports.flatten() {
            let files = std::fs::read_dir(port.path().join("hw_counters"))
                .into_iter()
                .flatten();
            for f in files.flatten() {
                let v = std::fs::read_to_string(f.path()).ok();
                if let Some(v) = v.and_then(|v| v.trim().parse().ok()) {
                    let k = f.file_name().to_string_lossy().into_owned();
                    out.push((name.clone(), k, v));
                }
            }
        }
    }
    out
}

/// An rxe device on a veth pair, created when the kernel can have one. Returns its name.
pub fn rxe_device() -> Option<String> {
    // librdmacm's device (/dev/infiniband/rdma_cm), for path records: a distribution's
    // rdma-core loads it with the first RDMA device, the VM has no service that does.
    let _ = sh(&["modprobe", "rdma_ucm"]);
    let caps = sh(&[ctl_path().to_str().unwrap(), "caps", "--json"]);
    if caps.status.success() {
        let v: serde_json::Value = serde_json::from_slice(&caps.stdout).ok()?;
        let names: Vec<&str> = v["devices"]
            .as_array()?
            .iter()
            .filter_map(|d| d["device"]["name"].as_str())
            .collect();
        let first = names.iter().find(|n| **n == "rxe0").or(names.first());
        return first.map(|n| n.to_string());
    }
    if !sh(&["modprobe", "rdma_rxe"]).status.success() {
        return None;
    }
    let _ = sh(&[
        "ip", "link", "add", "rxev0", "type", "veth", "peer", "name", "rxev1",
    ]);
    // A veth has carrier only with both ends up.
    sh(&["ip", "link", "set", "rxev1", "up"]);
    make_rxe("rxe0", "rxev0", "10.78.0.1/24");
    Some("rxe0".into())
}

/// A second rxe device, `rxe1` (with what the kernel holds on it when new), on the other end of [`rxe_device`]'s veth pair (which must
/// exist: make it with [`device`] first), with its own address (10.79.0.1): a second rail's
/// HCA. Deleted when dropped, once nothing holds it: make it before the lab that uses it, so
/// that it is dropped after the lab (and [`rxe_device`] picks rxe0 where it stays).
pub struct SecondRxe(pub String, HashMap<String, u64>);

impl SecondRxe {
    pub fn make() -> Self {
        make_rxe("rxe1", "rxev1", "10.79.0.1/24");
        // What the kernel itself holds on a new device (the GSI QP with its PD and CQ).
        SecondRxe("rxe1".into(), rdma_resources("rxe1"))
    }
}

impl Drop for SecondRxe {
    /// Deletes the device once nothing holds it: deleting an rxe device that still has QPs
    /// or regions blocks in the kernel (seen: `rdma` hung for minutes when a test's panic
    /// dropped this before its lab). Left in place, with a warning, if something still does
    /// after 10 s.
    fn drop(&mut self) {
        if !std::path::Path::new(&format!("/sys/class/infiniband/{}", self.0)).exists() {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let res = rdma_resources(&self.0);
            let count = |m: &HashMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
            let held = ["qp", "cq", "mr", "pd", "srq"]
                .iter()
                .any(|k| count(&res, k) > count(&self.1, k));
            if !held {
                let _ = sh(&["rdma", "link", "delete", &self.0]);
                return;
            }
            if Instant::now() > deadline {
                eprintln!("{} still holds resources ({res:?}): not deleted", self.0);
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Makes rxe device `name` on `netdev` (up) and waits until its port is active and has a
/// GID from `cidr`, the address it gives the netdev.
fn make_rxe(name: &str, netdev: &str, cidr: &str) {
    sh(&["ip", "link", "set", netdev, "up"]);
    let out = sh(&["rdma", "link", "add", name, "type", "rxe", "netdev", netdev]);
    assert!(
        out.status.success() || String::from_utf8_lossy(&out.stderr).contains("exist"),
        "rdma link add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The port goes active once the netdev is up.
    for _ in 0..50 {
        let d = sh(&["ibv_devinfo", "-d", name]);
        if String::from_utf8_lossy(&d.stdout).contains("PORT_ACTIVE") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // RoCE GIDs come from the netdev's IP addresses: make sure it has one, and wait for the
    // GID table to show a GID.
    let _ = sh(&["ip", "addr", "add", cidr, "dev", netdev]);
    for _ in 0..50 {
        let any = (0..8).any(|i| {
            std::fs::read_to_string(format!("/sys/class/infiniband/{name}/ports/1/gids/{i}"))
                .is_ok_and(|g| g.trim() != "0000:0000:0000:0000:0000:0000:0000:0000")
        });
        if any {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Namespace `NAME-b` joined to the root namespace by a veth pair: 10.77.N.1 here,
/// 10.77.N.2 there. Removed on drop.
pub struct Netns {
    pub name: String,
    pub host: String,
}

impl Netns {
    pub fn new(name: &str, subnet: u8) -> Self {
        let ns = format!("{name}-b");
        let host = format!("{name}-a");
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host]).output();
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &host, "type", "veth", "peer", "name", "cmpeer0",
        ]);
        run(&["ip", "link", "set", "cmpeer0", "netns", &ns]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("10.77.{subnet}.1/24"),
            "dev",
            &host,
        ]);
        run(&["ip", "link", "set", &host, "up"]);
        for cmd in [
            format!("ip addr add 10.77.{subnet}.2/24 dev cmpeer0"),
            "ip link set cmpeer0 up".into(),
            "ip link set lo up".into(),
        ] {
            let mut args = vec!["ip", "netns", "exec", &ns];
            args.extend(cmd.split(' '));
            run(&args);
        }
        Self { name: ns, host }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host])
            .output();
    }
}

/// `cm-node` running in a namespace, its stdout lines on a channel.
pub struct Peer {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub hw: HwAddr,
    pub addr: SocketAddr,
}

impl Peer {
    pub fn start(ns: &Netns, dev: &str, addr: SocketAddr, ud_qpn: u32, extra: &[&str]) -> Self {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.name,
                sibling_exe("cm-node").to_str().expect("utf-8 path"),
            ])
            .args(["--device", dev, "--listen", &addr.to_string()])
            .args(["--ud-qpn", &ud_qpn.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if !l.starts_with("received") && !l.starts_with("stats") {
                    eprintln!("[cm-node] {l}");
                }
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Self {
            child,
            lines,
            hw: HwAddr {
                gid: [0; 16],
                ud_qpn,
            },
            addr,
        };
        let ready = p.expect("ready", Duration::from_secs(20));
        let gid = ready.split(' ').nth(1).unwrap();
        for (i, b) in p.hw.gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&gid[2 * i..2 * i + 2], 16).unwrap();
        }
        p
    }

    /// The next line that starts with `prefix` (others are skipped).
    pub fn expect(&mut self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(e) => panic!("cm-node said no `{prefix}` line within {within:?}: {e}"),
            }
        }
    }

    pub fn kill9(&mut self) {
        // `ip netns exec` execs the program, so this is cm-node itself.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `f` on a thread that has entered network namespace `ns`: sockets and TUN devices it
/// makes live there.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("netns file");
        // SAFETY: setns on this thread only, with a namespace fd.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread")
}

/// Whether RDMA tests must run (`cargo xtask vm-test` sets IPOIB_REQUIRE_RDMA=1).
/// `ip link set DEV STATE` (up, down) in this network namespace.
pub fn set_link(dev: &str, state: &str) -> Result<()> {
    let out = Command::new("ip")
        .args(["link", "set", dev, state])
        .output()?;
    if !out.status.success() {
        bail!(
            "ip link set {dev} {state}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Brings a link back up when dropped, however a test or the demo that took it down ends.
pub struct LinkUp(pub String);

impl Drop for LinkUp {
    fn drop(&mut self) {
        let _ = set_link(&self.0, "up");
    }
}

/// The netdev under an RDMA device: soft-RoCE's `parent` attribute, or a real HCA's
/// `device/net`.
pub fn rdma_netdev(dev: &str) -> Option<String> {
    let sys = format!("/sys/class/infiniband/{dev}");
    if let Ok(p) = std::fs::read_to_string(format!("{sys}/parent")) {
        return Some(p.trim().to_string());
    }
    std::fs::read_dir(format!("{sys}/device/net"))
        .ok()?
        .flatten()
        .next()
        .map(|e| e.file_name().to_string_lossy().into_owned())
}

pub fn required() -> bool {
    std::env::var("IPOIB_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// The rxe device, or None after a loud skip (a failure where RDMA is required).
pub fn device(test: &str) -> Option<String> {
    let dev = rxe_device();
    if dev.is_none() {
        assert!(
            !required(),
            "IPOIB_REQUIRE_RDMA=1 but no RDMA device could be made"
        );
        crate::loud_skip(
            test,
            "this kernel has no RDMA support; `cargo xtask vm-test` runs it on soft-RoCE",
        );
    }
    dev
}

/// Waits up to 10 s for the device's resource counts to equal `want` on `keys`.
pub fn settle(dev: &str, want: &std::collections::HashMap<String, u64>, keys: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = rdma_resources(dev);
        let same = keys
            .iter()
            .all(|k| now.get(*k).copied().unwrap_or(0) == want.get(*k).copied().unwrap_or(0));
        if same {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "resources did not return: now {now:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The verbs resources a node holds.
pub const COUNTED: &[&str] = &["pd", "cq", "qp", "mr", "srq"];

/// Brings an engine's TUN device up as the tests use it: address `cidr`, MTU 1500 (a UD-sized
/// link, so only whole GSO super-packets exceed it), gso_max_size 65000 (one RC message with
/// the header), and no IPv6 link-local address (the kernel's router solicitations and MLD
/// reports would come to the engine for addresses with no connection).
pub fn tun_up(dev: &str, cidr: &str) {
    run(&["ip", "addr", "add", cidr, "dev", dev]);
    run(&[
        "ip",
        "link",
        "set",
        dev,
        "addrgenmode",
        "none",
        "mtu",
        "1500",
        "gso_max_size",
        "65000",
        "up",
    ]);
}

/// One connection from A to B on loopback TCP, both ends: A's, and the one B's listener took.
pub fn connect_a_to_b(
    rt: &tokio::runtime::Runtime,
    cma: &Arc<Cm>,
    cmb: &Arc<Cm>,
) -> (Connection, Connection) {
    rt.block_on(async {
        let (addr_b, mut in_b) = listen(cmb).await;
        let c = cma.connect(addr_b, cmb.hwaddr()).await.unwrap();
        let p = in_b.recv().await.unwrap().1.unwrap();
        (c, p)
    })
}

pub type Incoming =
    tokio::sync::mpsc::UnboundedReceiver<(SocketAddr, Result<Connection, SetupError>)>;

/// B's handshake served on a loopback port: its address, and each setup it takes.
pub async fn listen(cm: &Arc<Cm>) -> (SocketAddr, Incoming) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(cm.clone().serve(l, tx));
    (addr, rx)
}
