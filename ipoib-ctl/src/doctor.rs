//! `ipoib-ctl doctor [IFACE]`: what an operator checks on real hardware before and after
//! `attach`, one line per check, each OK, WARN or FAIL with its reason. What the system says is
//! gathered into [`Facts`] ([`gather`], the only I/O); what it means is [`judge`], pure, so
//! each verdict is unit-tested on fixtures of machines this one is not.

use std::{fmt, path::Path};

use serde::Serialize;

use crate::{
    iblink::{self, IbLink, KernelMode},
    plan::{Plan, PlanKind},
    verbs::{DeviceCaps, PortCaps},
};

/// How a check came out; a run's exit code follows its worst ([`Level::exit_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    /// 0 when every line is OK, 6 when the worst is a WARN, 1 when a line FAILs.
    pub fn exit_code(self) -> u8 {
        match self {
            Level::Ok => 0,
            Level::Warn => 6,
            Level::Fail => crate::exit::FAILURE,
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Level::Ok => "OK",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        })
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was looked at: `kernel`, `bpffs`, `interface`, `port mlx5_0/1`, ...
    pub what: String,
    pub level: Level,
    pub says: String,
}

/// The kernel floor: Debian 12's 6.1.
pub const KERNEL_FLOOR: (u32, u32) = (6, 1);
/// TCX (the egress hook on newer kernels) came with 6.6.
const TCX_FROM: (u32, u32) = (6, 6);

/// The interface as the doctor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfaceFacts {
    pub name: String,
    /// None: no such interface in this network namespace.
    pub ipoib: Option<bool>,
    pub kernel_mode: Option<KernelMode>,
    pub tso: Option<bool>,
    /// Where it sits (HCA, port, P_Key), from sysfs.
    pub link: Option<IbLink>,
}

/// A running (or not) attach of the interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachFacts {
    pub loop_running: bool,
    pub heartbeat_age_ms: Option<u64>,
    pub heartbeat_timeout_ms: u64,
    pub failsafe: bool,
    /// Connected mode's connections, where it runs.
    pub cm_connections: Option<u64>,
    /// Why connected mode does not run, as the loop said.
    pub cm_down: Option<String>,
}

/// Everything [`judge`] looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// `uname -r`.
    pub kernel: String,
    pub bpffs: bool,
    /// RLIMIT_MEMLOCK's soft limit (None: unlimited), and whether we run as root.
    pub memlock: Option<u64>,
    pub root: bool,
    pub iface: Option<IfaceFacts>,
    /// The RDMA devices, or why none could be read.
    pub devices: Result<Vec<DeviceCaps>, String>,
    /// Each device's P_Key table by port, where it could be read.
    pub pkeys: Vec<(String, u8, Vec<u16>)>,
    /// The memory plan one more attach would make on the interface's device (or the first).
    pub plan: Option<(String, Plan)>,
    /// None: the interface is not attached (or no interface was named).
    pub attach: Option<AttachFacts>,
}

/// `major.minor` of a kernel release (`6.1.0-57-amd64`).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn line(what: impl Into<String>, level: Level, says: impl Into<String>) -> Check {
    Check {
        what: what.into(),
        level,
        says: says.into(),
    }
}

/// The report on `f`, one line per check, in the order an operator reads them: the kernel,
/// the interface, its HCA and port, the budget and plan, the attach.
pub fn judge(f: &Facts) -> Vec<Check> {
    let mut out = system(f);
    if let Some(i) = &f.iface {
        out.extend(interface(i));
    }
    out.extend(ports(f));
    out.extend(plan(f));
    if let Some(i) = &f.iface {
        out.push(attach(&i.name, f.attach.as_ref()));
    }
    out
}

/// The worst level of a report (OK for none).
pub fn worst(checks: &[Check]) -> Level {
    checks.iter().map(|c| c.level).max().unwrap_or(Level::Ok)
}

fn system(f: &Facts) -> Vec<Check> {
    let kernel = match kernel_version(&f.kernel) {
        None => line(
            "kernel",
            Level::Warn,
            format!("release `{}` unread", f.kernel),
        ),
        Some(v) if v < KERNEL_FLOOR => line(
            "kernel",
            Level::Fail,
            format!(
                "{} is below the floor {}.{}: the fast path's programs need it",
                f.kernel, KERNEL_FLOOR.0, KERNEL_FLOOR.1
            ),
        ),
        Some(v) => line(
            "kernel",
            Level::Ok,
            format!(
                "{}: egress by {}",
                f.kernel,
                if v >= TCX_FROM {
                    "TCX"
                } else {
                    "a netlink clsact filter (TCX from 6.6)"
                }
            ),
        ),
    };
    // attach mounts it where it is not (and says so if it cannot).
    let bpffs = if f.bpffs {
        line("bpffs", Level::Ok, "mounted at /sys/fs/bpf")
    } else {
        line(
            "bpffs",
            Level::Ok,
            "not mounted at /sys/fs/bpf yet: attach mounts it there",
        )
    };
    let memlock = match (f.memlock, f.root) {
        (None, _) => line("memlock", Level::Ok, "unlimited"),
        (Some(_), true) => line(
            "memlock",
            Level::Ok,
            "limited, but root: registering receive memory is not held to it (CAP_IPC_LOCK)",
        ),
        (Some(b), false) => line(
            "memlock",
            Level::Warn,
            format!(
                "{} and not root: receive buffers past it cannot be registered",
                crate::status::human_bytes(b)
            ),
        ),
    };
    vec![kernel, bpffs, memlock]
}

fn interface(i: &IfaceFacts) -> Vec<Check> {
    let what = format!("interface {}", i.name);
    let Some(ipoib) = i.ipoib else {
        return vec![line(
            what,
            Level::Fail,
            "no such interface in this network namespace",
        )];
    };
    if !ipoib {
        return vec![line(
            what,
            Level::Warn,
            "not IPoIB (the lab's Ethernet stand-in works; on a fabric attach an IPoIB interface)",
        )];
    }
    let mut out = vec![line(what.clone(), Level::Ok, "IPoIB")];
    out.push(match i.kernel_mode {
        None => line(
            format!("{what} mode"),
            Level::Warn,
            "the kernel's IPoIB mode unread",
        ),
        Some(m) => {
            // What attach would do, with nothing said in the policy.
            let means = iblink::kernel_cm_for(&i.name, m, None)
                .map_or_else(|e| e.to_string(), |(_, means)| means);
            line(format!("{what} mode"), Level::Ok, means)
        }
    });
    out.push(offloads(&what, i.tso));
    out.push(fabric(&what, i.link.as_ref()));
    out
}

fn offloads(what: &str, tso: Option<bool>) -> Check {
    match tso {
        Some(true) => line(
            format!("{what} offloads"),
            Level::Ok,
            "TSO on: UD is offloaded, so mode auto promotes no peer by its rate",
        ),
        Some(false) => line(
            format!("{what} offloads"),
            Level::Ok,
            "TSO off: UD is per-packet, bulk peers are promoted to CM",
        ),
        None => line(
            format!("{what} offloads"),
            Level::Warn,
            "unread (ETHTOOL_GTSO)",
        ),
    }
}

fn fabric(what: &str, link: Option<&IbLink>) -> Check {
    match link {
        Some(l) => line(
            format!("{what} fabric"),
            Level::Ok,
            format!(
                "{} port {}, partition 0x{:04x}{}",
                l.device,
                l.port,
                l.pkey,
                l.parent
                    .as_deref()
                    .map(|p| format!(" (a P_Key child of {p})"))
                    .unwrap_or_default()
            ),
        ),
        None => line(
            format!("{what} fabric"),
            Level::Warn,
            "sysfs does not say its HCA and port (`--cm-device` and `--cm-port` then)",
        ),
    }
}

/// The ports to look at: the interface's own where sysfs names it, else every port.
fn ports(f: &Facts) -> Vec<Check> {
    let devices = match &f.devices {
        Ok(d) => d,
        Err(why) => {
            return vec![line(
                "rdma",
                Level::Warn,
                format!("{why}: connected mode cannot run, every peer stays on UD"),
            )];
        }
    };
    let link = f.iface.as_ref().and_then(|i| i.link.as_ref());
    let mut out = Vec::new();
    for d in devices {
        if link.is_some_and(|l| l.device != d.name) {
            continue;
        }
        for p in &d.ports {
            if link.is_some_and(|l| l.port != p.port) {
                continue;
            }
            let pkeys = f
                .pkeys
                .iter()
                .find(|(n, port, _)| *n == d.name && *port == p.port)
                .map(|(_, _, t)| t.as_slice());
            out.extend(port(d, p, pkeys, link.map(|l| l.pkey)));
        }
    }
    if out.is_empty() {
        let l = link.map_or_else(String::new, |l| format!(" ({} port {})", l.device, l.port));
        out.push(line(
            "rdma",
            Level::Fail,
            format!("the interface's HCA port{l} is not among the RDMA devices"),
        ));
    }
    out
}

fn port(d: &DeviceCaps, p: &PortCaps, pkeys: Option<&[u16]>, pkey: Option<u16>) -> Vec<Check> {
    let what = format!("port {}/{}", d.name, p.port);
    let ib = p.link_layer == "InfiniBand";
    let mut out = vec![if p.state == "active" {
        line(
            &what,
            Level::Ok,
            format!("ACTIVE, {}, active MTU {}", p.link_layer, p.active_mtu),
        )
    } else {
        line(
            &what,
            Level::Fail,
            format!(
                "{}, not ACTIVE: connected mode waits for it, every peer on UD",
                p.state.to_uppercase()
            ),
        )
    }];
    if ib {
        out.push(lid(&what, p));
    }
    if p.active_mtu < 4096 {
        out.push(line(
            format!("{what} MTU"),
            Level::Warn,
            format!(
                "active MTU {}: UD carries {} bytes a packet at most",
                p.active_mtu,
                p.active_mtu.saturating_sub(4)
            ),
        ));
    }
    if let (Some(table), Some(pkey)) = (pkeys, pkey) {
        out.push(partition(&what, table, pkey));
    }
    out.push(if d.srq() {
        line(
            format!("{what} SRQ"),
            Level::Ok,
            format!("the HCA has SRQs ({} WRs each)", d.max_srq_wr),
        )
    } else {
        line(
            format!("{what} SRQ"),
            Level::Warn,
            "no SRQ: a receive ring per connection, fewer connections per budget",
        )
    });
    out
}

fn lid(what: &str, p: &PortCaps) -> Check {
    match (p.lid, p.sm_lid) {
        (0, _) => line(
            format!("{what} LID"),
            Level::Fail,
            "no LID: the subnet manager has not swept the port (`sminfo`)",
        ),
        (lid, 0) => line(
            format!("{what} LID"),
            Level::Fail,
            format!("LID {lid} but no subnet manager (SM LID 0)"),
        ),
        (lid, sm) => line(
            format!("{what} LID"),
            Level::Ok,
            format!("LID {lid}, SM LID {sm}"),
        ),
    }
}

fn partition(what: &str, table: &[u16], pkey: u16) -> Check {
    match iblink::pkey_index(table, pkey) {
        Some(i) => line(
            format!("{what} P_Key"),
            Level::Ok,
            format!("0x{pkey:04x} at index {i} of the port's table"),
        ),
        None => line(
            format!("{what} P_Key"),
            Level::Fail,
            format!("0x{pkey:04x} is not in the port's P_Key table: the SM gives partitions"),
        ),
    }
}

fn plan(f: &Facts) -> Vec<Check> {
    let Some((device, p)) = &f.plan else {
        return Vec::new();
    };
    let size = crate::status::human_bytes;
    vec![match p.kind {
        PlanKind::UdOnly => line(
            "plan",
            Level::Fail,
            format!("{device}: no connected mode: {}", p.why),
        ),
        kind => line(
            "plan",
            Level::Ok,
            format!(
                "{device}: {} within {} ({}): {} connections at most, {} of receive memory",
                if kind == PlanKind::Srq {
                    "an SRQ"
                } else {
                    "a ring per connection"
                },
                size(p.budget_bytes),
                p.budget_source,
                p.max_cm_peers,
                size(p.memory_bytes)
            ),
        ),
    }]
}

fn attach(iface: &str, a: Option<&AttachFacts>) -> Check {
    let what = format!("attach {iface}");
    let Some(a) = a else {
        return line(what, Level::Ok, "not attached (yet)");
    };
    if !a.loop_running {
        return line(
            what,
            Level::Fail,
            "attached, but no control loop runs: the fail-safe sends every packet UD \
             (`systemctl status ipoib-ctl@IFACE`)",
        );
    }
    let age = a
        .heartbeat_age_ms
        .map_or_else(|| "never".into(), |ms| format!("{ms} ms old"));
    if a.failsafe {
        return line(
            what,
            Level::Fail,
            format!(
                "the heartbeat is {age} (timeout {} ms): FAIL-SAFE, every packet UD",
                a.heartbeat_timeout_ms
            ),
        );
    }
    match (a.cm_connections, &a.cm_down) {
        (Some(n), _) => line(
            what,
            Level::Ok,
            format!("control loop running, heartbeat {age}; connected mode up, {n} connection(s)"),
        ),
        (None, Some(why)) => line(
            what,
            Level::Warn,
            format!("control loop running, heartbeat {age}; connected mode not running: {why}"),
        ),
        (None, None) => line(
            what,
            Level::Warn,
            format!("control loop running, heartbeat {age}; connected mode not running"),
        ),
    }
}

/// The report as text, one line per check.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.what.len()).max().unwrap_or(0);
    checks
        .iter()
        .map(|c| format!("{:<4}  {:<width$}  {}\n", c.level, c.what, c.says))
        .collect()
}

/// What the system says, for [`judge`]: read from /proc, sysfs, verbs and the attach's state.
pub fn gather(iface: Option<&str>) -> Facts {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let iface = iface.map(gather_iface);
    let devices = crate::verbs::discover().map_err(|e| e.to_string());
    let pkeys = devices
        .as_ref()
        .map(|ds| pkey_tables(ds))
        .unwrap_or_default();
    let link = iface.as_ref().and_then(|i| i.link.as_ref());
    let plan = devices.as_ref().ok().and_then(|ds| {
        let d = ds
            .iter()
            .find(|d| link.is_none_or(|l| l.device == d.name))?;
        let mem = crate::verbs::system_memory();
        let node = crate::ledger::node_budget_now(mem);
        let p = crate::plan::plan_for_node(
            &d.limits(),
            mem,
            node.budget,
            node.free,
            None,
            crate::plan::SrqChoice::Auto,
        );
        Some((d.name.clone(), p))
    });
    let attach = iface.as_ref().and_then(|i| gather_attach(&i.name));
    Facts {
        kernel,
        bpffs: crate::attach::bpffs_mounted(),
        memlock: memlock(),
        // SAFETY: geteuid has no preconditions.
        root: unsafe { libc::geteuid() } == 0,
        iface,
        devices,
        pkeys,
        plan,
        attach,
    }
}

fn gather_iface(name: &str) -> IfaceFacts {
    let sys = Path::new("/sys");
    let dev = crate::netdev::Netdev::lookup(name).ok();
    IfaceFacts {
        name: name.to_string(),
        ipoib: dev.as_ref().map(crate::netdev::Netdev::is_ipoib),
        kernel_mode: iblink::kernel_mode(sys, name).ok().flatten(),
        tso: crate::netdev::tso_on(name).ok(),
        link: iblink::read(sys, name).ok().flatten(),
    }
}

fn pkey_tables(devices: &[DeviceCaps]) -> Vec<(String, u8, Vec<u16>)> {
    let mut out = Vec::new();
    for d in devices {
        let Ok(dev) = crate::verbs::Device::open(&d.name) else {
            continue;
        };
        for p in &d.ports {
            if let Ok(t) = dev.pkey_table(p.port) {
                out.push((d.name.clone(), p.port, t));
            }
        }
    }
    out
}

fn gather_attach(iface: &str) -> Option<AttachFacts> {
    crate::attach::read_state(iface)?;
    let s = crate::status::gather(iface).ok()?;
    Some(AttachFacts {
        loop_running: s.loop_running,
        heartbeat_age_ms: s.heartbeat_age_ms,
        heartbeat_timeout_ms: s.policy.heartbeat_timeout_ms,
        failsafe: s.failsafe_active,
        cm_connections: s.cm.as_ref().map(|c| c.connections as u64),
        cm_down: s.cm_down.clone(),
    })
}

/// RLIMIT_MEMLOCK's soft limit; None when unlimited.
fn memlock() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: an out pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return None;
    }
    (r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

#[cfg(test)]
mod tests;
