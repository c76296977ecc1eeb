//! What `status`, `peers` and `show-policy` report, gathered from the pinned maps, and its
//! rendering as a human table or JSON.

pub mod cm;

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr};

use ipoib_common::{
    ARPHRD_ETHER, ARPHRD_INFINIBAND, PeerEntry, PeerMode, PeerPin, PeerTraffic, Policy,
};
use serde::{Deserialize, Serialize};

use crate::{
    attach::{self, AttachError, AttachState, EgressAttach},
    clock::monotonic_ns,
    maps::{self, DatapathMaps, PeerCacheCounts},
    policy::{Mode, format_size},
};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PolicyView {
    pub link: LinkKind,
    pub mode: ModeView,
    pub cm_threshold: u32,
    pub heartbeat_timeout_ms: u64,
    pub kernel_cm: bool,
    pub ctl_port: u16,
    pub any_blocked: bool,
    /// Bytes; `None`: worked out by the control plane.
    pub memory_budget: Option<u64>,
    /// `None`: as many as the memory plan allows.
    pub max_connections: Option<u32>,
}

impl PolicyView {
    pub fn new(p: &Policy, state: Option<&AttachState>) -> Self {
        Self {
            link: match p.link_type {
                ARPHRD_INFINIBAND => LinkKind::Ipoib,
                ARPHRD_ETHER => LinkKind::Ethernet,
                _ => LinkKind::Unconfigured,
            },
            mode: Mode::from_raw(p.mode).map_or(ModeView::Unknown(p.mode), ModeView::Known),
            cm_threshold: p.cm_min_bytes,
            heartbeat_timeout_ms: p.heartbeat_timeout_ns / 1_000_000,
            kernel_cm: p.kernel_cm != 0,
            ctl_port: p.ctl_port,
            any_blocked: p.any_blocked != 0,
            memory_budget: state.and_then(|s| s.memory_budget),
            max_connections: state.and_then(|s| s.max_connections),
        }
    }

    pub fn render(&self) -> String {
        format!(
            "mode={} cm-threshold={} heartbeat-timeout={}ms kernel-cm={} ctl-port={} memory-budget={} max-connections={} (link {})",
            self.mode,
            self.cm_threshold,
            self.heartbeat_timeout_ms,
            if self.kernel_cm { "on" } else { "off" },
            self.ctl_port,
            self.memory_budget
                .map_or_else(|| "auto".to_string(), format_size),
            self.max_connections
                .map_or_else(|| "plan".to_string(), |n| n.to_string()),
            self.link,
        )
    }
}

impl PolicyView {
    /// As a policy file that `set-policy IFACE --file` reads back unchanged: one setting per
    /// line, the pins (`pins`: address and pin, `auto` left out) last, what no key sets as
    /// comments.
    pub fn render_file(&self, iface: &str, pins: &[(String, PeerPin)]) -> String {
        let mut out = format!(
            "# ipoib-ctl show-policy {iface} (link {}); `ipoib-ctl set-policy {iface} --file \
             FILE` reads it back\nmode={}\ncm-threshold={}\nheartbeat-timeout={}ms\n\
             kernel-cm={}\nctl-port={}\n",
            self.link,
            self.mode,
            self.cm_threshold,
            self.heartbeat_timeout_ms,
            if self.kernel_cm { "on" } else { "off" },
            self.ctl_port,
        );
        match self.memory_budget {
            Some(b) => out.push_str(&format!("memory-budget={}\n", format_size(b))),
            None => out.push_str("# memory-budget: worked out by the control loop\n"),
        }
        match self.max_connections {
            Some(n) => out.push_str(&format!("max-connections={n}\n")),
            None => out.push_str("# max-connections: as many as the memory plan allows\n"),
        }
        for (addr, pin) in pins.iter().filter(|(_, pin)| *pin != PeerPin::Auto) {
            if addr.contains(':') {
                out.push_str(&format!("peer=[{addr}]:{pin}\n"));
            } else {
                out.push_str(&format!("peer={addr}:{pin}\n"));
            }
        }
        out
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerView {
    pub addr: String,
    /// In JSON "ud", "cm_pending", "cm_up", or "-" for a peer only seen in traffic.
    pub mode: PeerModeView,
    /// In JSON by its `set-policy` name: "auto", "ud", "cm" or "block".
    #[serde(with = "pin_by_name")]
    pub pin: PeerPin,
    pub cm_ifindex: u32,
    pub generation: u32,
    #[serde(flatten)]
    pub traffic: TrafficView,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrafficView {
    pub tx_ud_packets: u64,
    pub tx_ud_bytes: u64,
    pub tx_cm_packets: u64,
    pub tx_cm_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    /// Milliseconds since the fast path last saw the peer; `None`: never.
    pub last_seen_ms_ago: Option<u64>,
}

impl TrafficView {
    fn new(t: &PeerTraffic, now: u64) -> Self {
        Self {
            tx_ud_packets: t.tx_ud_packets,
            tx_ud_bytes: t.tx_ud_bytes,
            tx_cm_packets: t.tx_cm_packets,
            tx_cm_bytes: t.tx_cm_bytes,
            rx_packets: t.rx_packets,
            rx_bytes: t.rx_bytes,
            rx_dropped: t.rx_dropped,
            last_seen_ms_ago: (t.last_seen_ns != 0)
                .then(|| now.saturating_sub(t.last_seen_ns) / 1_000_000),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct CounterView {
    pub packets: u64,
    pub bytes: u64,
}

/// What `status --json` prints for one interface (and tests read back, typed).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub iface: String,
    pub ifindex: Option<u32>,
    pub egress_attach: Option<EgressAttach>,
    pub ingress: Option<attach::IngressAttach>,
    pub policy: PolicyView,
    /// Milliseconds since the control plane last wrote the heartbeat; `None`: never.
    pub heartbeat_age_ms: Option<u64>,
    pub heartbeat_writer_pid: u32,
    /// True when the fail-safe is sending every packet UD.
    pub failsafe_active: bool,
    pub loop_pid: Option<u32>,
    pub loop_running: bool,
    pub reasons: BTreeMap<String, CounterView>,
    /// What the fast path's peer cache answered since the programs were loaded (None: these
    /// programs do not count it, a build from before the counts).
    #[serde(default)]
    pub peer_cache: Option<PeerCacheCounts>,
    pub peers: Vec<PeerView>,
    /// Connected mode, as its control loop last wrote it (None: not running).
    pub cm: Option<cm::CmStatus>,
    /// Why connected mode does not run, as a running control loop last said (for one that
    /// waits for its port, say: it starts once the port is ready).
    #[serde(default)]
    pub cm_down: Option<String>,
    /// The kernel's own IPoIB mode at attach, and what it means for us (None: not IPoIB).
    #[serde(default)]
    pub kernel_mode: Option<String>,
    /// Where the interface is, seen from here (None: no state file to tell).
    #[serde(default)]
    pub presence: Option<attach::Presence>,
}

/// A peer's mode in the fast path's map, as `status` and `peers` show it; in JSON by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum PeerModeView {
    Ud,
    CmPending,
    CmUp,
    /// Seen in traffic only: no entry in the map ("-").
    Unseen,
    /// A value this build does not know ("unknown(N)").
    Unknown(u8),
}

impl PeerModeView {
    /// The mode of an entry as the map holds it.
    pub fn of(m: u8) -> Self {
        match PeerMode::try_from(m) {
            Ok(PeerMode::Ud) => Self::Ud,
            Ok(PeerMode::CmPending) => Self::CmPending,
            Ok(PeerMode::CmUp) => Self::CmUp,
            Err(other) => Self::Unknown(other),
        }
    }
}

impl std::fmt::Display for PeerModeView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ud => f.pad("ud"),
            Self::CmPending => f.pad("cm_pending"),
            Self::CmUp => f.pad("cm_up"),
            Self::Unseen => f.pad("-"),
            Self::Unknown(n) => f.pad(&format!("unknown({n})")),
        }
    }
}

impl From<PeerModeView> for String {
    fn from(m: PeerModeView) -> String {
        m.to_string()
    }
}

impl TryFrom<String> for PeerModeView {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "ud" => Ok(Self::Ud),
            "cm_pending" => Ok(Self::CmPending),
            "cm_up" => Ok(Self::CmUp),
            "-" => Ok(Self::Unseen),
            other => unknown_value(other)
                .map(Self::Unknown)
                .ok_or_else(|| format!("not a peer mode: `{s}`")),
        }
    }
}

/// The raw value of a map field this build does not know, as its views print it
/// (`unknown(N)`).
fn unknown_value(s: &str) -> Option<u8> {
    s.strip_prefix("unknown(")?.strip_suffix(')')?.parse().ok()
}

/// The kind of link the fast path was configured for; in JSON by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    Ipoib,
    Ethernet,
    /// The policy map holds no link type this build knows.
    Unconfigured,
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Self::Ipoib => "ipoib",
            Self::Ethernet => "ethernet",
            Self::Unconfigured => "unconfigured",
        })
    }
}

/// The policy's mode as the map holds it; in JSON by name, or "unknown(N)".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ModeView {
    Known(Mode),
    /// A value this build does not know.
    Unknown(u8),
}

impl std::fmt::Display for ModeView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Known(m) => f.pad(&m.to_string()),
            Self::Unknown(n) => f.pad(&format!("unknown({n})")),
        }
    }
}

impl From<ModeView> for String {
    fn from(m: ModeView) -> String {
        m.to_string()
    }
}

impl TryFrom<String> for ModeView {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        [Mode::Auto, Mode::Datagram, Mode::Connected]
            .into_iter()
            .find(|m| m.to_string() == s)
            .map(Self::Known)
            .or_else(|| unknown_value(&s).map(Self::Unknown))
            .ok_or_else(|| format!("not a mode: `{s}`"))
    }
}

/// A [`PeerPin`] in JSON by its `set-policy` name (ipoib-common, shared with eBPF, has no serde).
mod pin_by_name {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    use super::PeerPin;

    pub fn serialize<S: Serializer>(pin: &PeerPin, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(pin)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PeerPin, D::Error> {
        let name = String::deserialize(d)?;
        [PeerPin::Auto, PeerPin::Ud, PeerPin::Cm, PeerPin::Block]
            .into_iter()
            .find(|p| p.to_string() == name)
            .ok_or_else(|| D::Error::custom(format!("not a pin: `{name}`")))
    }
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Every peer the control plane has state for or the fast path has seen, by address.
pub fn peers(maps: &DatapathMaps) -> Result<Vec<PeerView>, AttachError> {
    let now = monotonic_ns();
    let mut by_ip: BTreeMap<IpAddr, (Option<PeerEntry>, Option<PeerTraffic>)> = BTreeMap::new();
    let read = maps.peers_and_traffic()?;
    for (k, e) in read.entries {
        if let Some(ip) = k.ip() {
            by_ip.entry(ip).or_default().0 = Some(e);
        }
    }
    for (k, t) in read.traffic {
        if let Some(ip) = k.ip() {
            by_ip.entry(ip).or_default().1 = Some(t);
        }
    }
    Ok(by_ip
        .into_iter()
        .map(|(ip, (e, t))| PeerView {
            addr: ip.to_string(),
            mode: e.map_or(PeerModeView::Unseen, |e| PeerModeView::of(e.mode)),
            pin: e
                .and_then(|e| PeerPin::try_from(e.pin).ok())
                .unwrap_or_default(),
            cm_ifindex: e.map_or(0, |e| e.cm_ifindex),
            generation: e.map_or(0, |e| e.generation),
            traffic: t.map(|t| TrafficView::new(&t, now)).unwrap_or_default(),
        })
        .collect())
}

pub fn gather(iface: &str) -> Result<Status, AttachError> {
    let maps = attach::open(iface)?;
    let state = attach::read_state(iface);
    let loop_pid = state.as_ref().and_then(|s| s.loop_pid);
    let running = loop_pid.is_some_and(pid_alive);
    let cm = cm::read_status(iface).filter(|_| running);
    gather_from(iface, &maps, state.as_ref(), cm, running)
}

/// `iface`'s status from what the caller holds: its maps, its state, connected mode's status
/// and whether its control loop runs (the control loop's own, for its metrics).
pub fn gather_from(
    iface: &str,
    maps: &DatapathMaps,
    state: Option<&AttachState>,
    cm: Option<cm::CmStatus>,
    loop_running: bool,
) -> Result<Status, AttachError> {
    let policy = maps.policy()?;
    let hb = maps.heartbeat()?;
    let (heartbeat_age_ms, failsafe_active) =
        heartbeat_seen(monotonic_ns(), hb.monotonic_ns, policy.heartbeat_timeout_ns);
    let reasons = maps
        .reasons()?
        .into_iter()
        .map(|(r, c)| {
            (
                r.name().to_string(),
                CounterView {
                    packets: c.packets,
                    bytes: c.bytes,
                },
            )
        })
        .collect();
    Ok(Status {
        iface: iface.to_string(),
        ifindex: state.map(|s| s.ifindex),
        egress_attach: state.map(|s| s.egress),
        ingress: state.map(|s| s.ingress),
        policy: PolicyView::new(&policy, state),
        heartbeat_age_ms,
        heartbeat_writer_pid: hb.writer_pid,
        failsafe_active,
        loop_pid: state.and_then(|s| s.loop_pid),
        loop_running,
        reasons,
        peer_cache: maps::peer_cache_pinned(&attach::pin_dir(iface).join(attach::PROG_EGRESS))?,
        peers: peers(maps)?,
        cm_down: state
            .and_then(|s| s.cm_down.clone())
            .filter(|_| loop_running && cm.is_none()),
        kernel_mode: state.and_then(|s| s.kernel_mode.clone()),
        cm,
        presence: state.map(attach::presence),
    })
}

/// The heartbeat's age in milliseconds (None: never written, a stamp of 0) at `now_ns`, and
/// whether the fast path's fail-safe is on: never written, or older than `timeout_ns`, as the
/// programs judge it.
fn heartbeat_seen(now_ns: u64, written_ns: u64, timeout_ns: u64) -> (Option<u64>, bool) {
    let age_ns = (written_ns != 0).then(|| now_ns.saturating_sub(written_ns));
    (
        age_ns.map(|a| a / 1_000_000),
        age_ns.is_none_or(|a| a > timeout_ns),
    )
}

/// `b` in the largest binary unit under 1024 of it, one decimal (`3.0 MiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

pub fn render_peers(peers: &[PeerView]) -> String {
    let mut out = String::new();
    // As wide as the longest address (a full IPv6 address is 39 characters).
    let w = peers
        .iter()
        .map(|p| p.addr.len())
        .max()
        .unwrap_or(0)
        .max(15);
    let _ = writeln!(
        out,
        "  {:<w$} {:<10} {:<5} {:>10} {:>11} {:>10} {:>11} {:>10} {:>11} {:>7} {:>10}",
        "peer",
        "mode",
        "pin",
        "tx-ud-pkt",
        "tx-ud-bytes",
        "tx-cm-pkt",
        "tx-cm-bytes",
        "rx-pkt",
        "rx-bytes",
        "rx-drop",
        "last-seen"
    );
    for p in peers {
        let t = &p.traffic;
        let _ = writeln!(
            out,
            "  {:<w$} {:<10} {:<5} {:>10} {:>11} {:>10} {:>11} {:>10} {:>11} {:>7} {:>10}",
            p.addr,
            p.mode,
            p.pin,
            t.tx_ud_packets,
            human_bytes(t.tx_ud_bytes),
            t.tx_cm_packets,
            human_bytes(t.tx_cm_bytes),
            t.rx_packets,
            human_bytes(t.rx_bytes),
            t.rx_dropped,
            t.last_seen_ms_ago.map_or_else(
                || "never".into(),
                |ms| format!("{:.1}s ago", ms as f64 / 1000.0)
            ),
        );
    }
    if peers.is_empty() {
        out.push_str("  (no peers yet)\n");
    }
    out
}

pub fn render(s: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: ifindex {} egress {} ingress {}",
        s.iface,
        s.ifindex.map_or_else(|| "?".into(), |i| i.to_string()),
        s.egress_attach.map_or("?", EgressAttach::name),
        match s.ingress {
            Some(attach::IngressAttach::Tc) => "tc",
            Some(attach::IngressAttach::Driver) => "xdp driver",
            Some(attach::IngressAttach::Generic) => "xdp generic",
            Some(attach::IngressAttach::Unknown) | None => "?",
        },
    );
    match s.presence {
        Some(attach::Presence::Gone) => {
            let _ = writeln!(
                out,
                "  STALE: {0} is gone (the device was removed or its network namespace \
                 deleted); its pins remain: `ipoib-ctl detach {0}` removes them",
                s.iface
            );
        }
        Some(attach::Presence::Elsewhere) => {
            let _ = writeln!(
                out,
                "  in another network namespace (run ipoib-ctl there to change it)"
            );
        }
        _ => {}
    }
    let _ = writeln!(out, "  policy: {}", s.policy.render());
    if let Some(k) = &s.kernel_mode {
        let _ = writeln!(out, "  the kernel's IPoIB mode: {k}");
    }
    let _ = writeln!(
        out,
        "  control loop: {}; heartbeat {}{}",
        match (s.loop_pid, s.loop_running) {
            (Some(pid), true) => format!("running (pid {pid})"),
            (Some(pid), false) => format!("gone (pid {pid} exited)"),
            (None, _) => "not running".into(),
        },
        s.heartbeat_age_ms
            .map_or_else(|| "never written".into(), |ms| format!("{ms} ms old")),
        if s.failsafe_active {
            " -> FAIL-SAFE: every packet goes UD"
        } else {
            ""
        }
    );
    render_reasons(&mut out, s);
    render_peer_cache(&mut out, s.peer_cache.as_ref());
    out.push_str(&render_peers(&s.peers));
    match &s.cm {
        None => render_cm_down(&mut out, s.cm_down.as_deref()),
        Some(cm) => render_cm(&mut out, cm),
    }
    out
}

fn render_cm_down(out: &mut String, why: Option<&str>) {
    let _ = match why {
        Some(why) => writeln!(
            out,
            "  connected mode: not running, {why} (every peer on UD)"
        ),
        None => writeln!(out, "  connected mode: not running (every peer on UD)"),
    };
}

fn render_reasons(out: &mut String, s: &Status) {
    let _ = writeln!(out, "  decisions:");
    for (name, c) in &s.reasons {
        if c.packets > 0 {
            let _ = writeln!(
                out,
                "    {name:<26} {:>12} pkts {:>12}",
                c.packets,
                human_bytes(c.bytes)
            );
        }
    }
    if s.reasons.values().all(|c| c.packets == 0) {
        out.push_str("    (no packets yet)\n");
    }
}

fn render_peer_cache(out: &mut String, c: Option<&PeerCacheCounts>) {
    let Some(c) = c else {
        out.push_str("  peer cache: not counted by these programs (loaded by an earlier build)\n");
        return;
    };
    let Some(hit) = c.hit_percent() else {
        out.push_str("  peer cache: no lookups yet\n");
        return;
    };
    let _ = writeln!(
        out,
        "  peer cache: {hit:.1}% of {} lookups hit since the programs were loaded; missed {} \
         after a write or beat, {} to an empty slot or another peer's; {} slots filled",
        c.lookups(),
        c.misses_stale,
        c.misses_other,
        c.slots_filled
    );
}

/// A connection cap at least this large is the HCA's QP limit, not a plan's.
const UNCAPPED: usize = 1 << 16;

fn render_cm(out: &mut String, cm: &cm::CmStatus) {
    let r = &cm.receive;
    let receive = match r.model {
        cm::ReceiveKind::Rings => format!(
            "rings of {} buffers: {} of K={} in use",
            r.depth, r.rings, r.max_rings
        ),
        cm::ReceiveKind::Srq => format!("SRQ {} buffers", cm.srq_depth),
    };
    // With an SRQ the memory does not grow with connections: the plan's cap is then the
    // HCA's QPs, a number nobody means (1048552 on soft-RoCE).
    let cap = if r.model == cm::ReceiveKind::Srq && cm.max_connections >= UNCAPPED {
        "no cap but the HCA's QPs".to_owned()
    } else {
        format!("at most {}", cm.max_connections)
    };
    let _ = writeln!(
        out,
        "  connected mode: {} via {}, {receive}, {} connections ({cap}), \
         {} established / {} failed setups",
        cm.device, cm.tun, cm.connections, cm.established, cm.failed
    );
    let _ = writeln!(out, "    UD path: {}", cm.ud_path.effect());
    let _ = writeln!(
        out,
        "    receive memory: {} registered of a {} budget",
        human_bytes(r.registered_bytes),
        human_bytes(r.budget_bytes)
    );
    let shares: Vec<String> = cm
        .node
        .shares
        .iter()
        .map(|s| format!("{} {}", s.iface, human_bytes(s.bytes)))
        .collect();
    let _ = writeln!(
        out,
        "    node budget: {}, held: {}",
        human_bytes(cm.node.budget_bytes),
        shares.join(", ")
    );
    let _ = writeln!(
        out,
        "    handshake: {} streams waiting for a REQ, {} dropped unanswered; {} tasks; tick \
         late by {} ms at most",
        cm.awaiting_req, cm.dropped_awaiting_req, cm.tasks, cm.tick_late_max_ms
    );
    let _ = writeln!(
        out,
        "    path records: {} resolved, {} not (SL 0, the ports' MTU), {} from the peers' REQs",
        cm.paths_resolved, cm.paths_unresolved, cm.paths_from_peer
    );
    render_engine(out, cm);
    for p in &cm.peers {
        let _ = writeln!(out, "    {:<26} {}", p.addr, p.why);
    }
}

/// The engine's counters, one line.
fn render_engine(out: &mut String, cm: &cm::CmStatus) {
    let e = |k: &str| cm.engine.get(k).copied().unwrap_or(0);
    let lanes = match cm.engine_lanes {
        0 | 1 => String::new(),
        n => format!(" ({n} lanes)"),
    };
    let _ = writeln!(
        out,
        "    engine{lanes}: tx {} msgs {}, rx {} msgs {}, let go to UD (backpressure {}, no connection {}, oversize {}, \
         and sends the QP refused): {} sent, {} lost; send errors {}, receive errors {}, congested (a connection's queue past its backlog: its peer sent UD) {}, SRQ low {}",
        e("tx_packets"),
        human_bytes(e("tx_bytes")),
        e("rx_packets"),
        human_bytes(e("rx_bytes")),
        e("tx_backpressure"),
        e("tx_no_connection"),
        e("tx_oversize"),
        e("tx_sent_ud"),
        e("tx_not_sent_ud"),
        e("send_errors"),
        e("rx_errors"),
        e("tx_congested"),
        cm.srq_low_events
    );
    let cost = cm
        .engine_cpu_s_per_gb()
        .map_or(String::new(), |c| format!(" ({c:.2} s per GB moved)"));
    let _ = writeln!(
        out,
        "    engine CPU: {:.1} s{cost}",
        cm.engine_cpu_ns as f64 / 1e9
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy_view() -> PolicyView {
        PolicyView {
            link: LinkKind::Ipoib,
            mode: ModeView::Known(Mode::Auto),
            cm_threshold: 1024,
            heartbeat_timeout_ms: 3000,
            kernel_cm: false,
            ctl_port: 18515,
            any_blocked: false,
            memory_budget: None,
            max_connections: None,
        }
    }

    fn status() -> Status {
        Status {
            iface: "ib0".into(),
            ifindex: Some(7),
            egress_attach: Some(EgressAttach::Tcx),
            ingress: Some(attach::IngressAttach::Generic),
            policy: policy_view(),
            heartbeat_age_ms: Some(120),
            heartbeat_writer_pid: 42,
            failsafe_active: false,
            loop_pid: Some(42),
            loop_running: true,
            reasons: BTreeMap::new(),
            peer_cache: None,
            peers: Vec::new(),
            cm: None,
            cm_down: None,
            kernel_mode: None,
            presence: Some(attach::Presence::Here),
        }
    }

    #[test]
    fn bytes_are_shown_in_the_largest_binary_unit_under_1024() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 30), "5.0 GiB");
        assert_eq!(human_bytes(1 << 40), "1.0 TiB");
        // No unit past TiB: a PiB is 1024 of them.
        assert_eq!(human_bytes(1 << 50), "1024.0 TiB");
    }

    #[test]
    fn the_heartbeat_is_stale_only_past_the_timeout() {
        let ms = 1_000_000;
        assert_eq!(heartbeat_seen(5_000 * ms, 0, 3_000 * ms), (None, true));
        assert_eq!(
            heartbeat_seen(5_000 * ms, 4_000 * ms, 3_000 * ms),
            (Some(1_000), false)
        );
        // Exactly the timeout old: still trusted, as the programs judge it; a nanosecond
        // more and the fail-safe is on.
        assert_eq!(
            heartbeat_seen(5_000 * ms, 2_000 * ms, 3_000 * ms),
            (Some(3_000), false)
        );
        assert_eq!(
            heartbeat_seen(5_000 * ms + 1, 2_000 * ms, 3_000 * ms),
            (Some(3_000), true)
        );
        // A stamp from the future (another reader's clock a moment ahead) is 0 ms old.
        assert_eq!(heartbeat_seen(ms, 2 * ms, 3_000 * ms), (Some(0), false));
    }

    #[test]
    fn peer_modes_by_name_and_unknown_ones_by_number() {
        let name = |m: u8| PeerModeView::of(m).to_string();
        assert_eq!(name(PeerMode::Ud as u8), "ud");
        assert_eq!(name(PeerMode::CmPending as u8), "cm_pending");
        assert_eq!(name(PeerMode::CmUp as u8), "cm_up");
        assert_eq!(name(200), "unknown(200)");
        // The same names in JSON, both ways, "-" for a peer seen in traffic only.
        for m in [
            PeerModeView::Ud,
            PeerModeView::CmPending,
            PeerModeView::CmUp,
            PeerModeView::Unseen,
            PeerModeView::Unknown(200),
        ] {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{m}\""));
            assert_eq!(serde_json::from_str::<PeerModeView>(&json).unwrap(), m);
        }
        assert!(serde_json::from_str::<PeerModeView>("\"up\"").is_err());
    }

    /// The typed fields print the names scripts read from `status --json` (the strings they
    /// were before they had types), and read back the same.
    #[test]
    fn typed_fields_keep_their_json_names() {
        let mut s = status();
        s.policy.mode = ModeView::Known(Mode::Connected);
        s.peers = vec![PeerView {
            pin: PeerPin::Block,
            ..peer("10.0.0.9")
        }];
        let mut c = cm::CmStatus {
            mode: Mode::Datagram,
            ud_path: crate::promotion::UdPath::Offloaded,
            ..cm::CmStatus::default()
        };
        c.receive.model = cm::ReceiveKind::Rings;
        s.cm = Some(c);
        let v = serde_json::to_value(&s).unwrap();
        let at = |path: &[&str]| {
            path.iter()
                .fold(&v, |v, k| match k.parse::<usize>() {
                    Ok(i) => &v[i],
                    Err(_) => &v[*k],
                })
                .clone()
        };
        assert_eq!(at(&["egress_attach"]), "tcx");
        assert_eq!(at(&["policy", "link"]), "ipoib");
        assert_eq!(at(&["policy", "mode"]), "connected");
        assert_eq!(at(&["peers", "0", "pin"]), "block");
        assert_eq!(at(&["cm", "mode"]), "datagram");
        assert_eq!(at(&["cm", "ud_path"]), "offloaded");
        assert_eq!(at(&["cm", "receive", "model"]), "rings");
        let back: Status = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), v);
    }

    /// Every value of each typed field, both ways; unknown ones refused.
    #[test]
    fn each_typed_value_has_its_json_name() {
        for e in [EgressAttach::Tcx, EgressAttach::Netlink] {
            assert_eq!(serde_json::to_value(e).unwrap(), e.name());
        }
        for (link, name) in [
            (LinkKind::Ipoib, "ipoib"),
            (LinkKind::Ethernet, "ethernet"),
            (LinkKind::Unconfigured, "unconfigured"),
        ] {
            assert_eq!(link.to_string(), name);
            assert_eq!(serde_json::to_value(link).unwrap(), name);
        }
        for m in [
            ModeView::Known(Mode::Auto),
            ModeView::Known(Mode::Datagram),
            ModeView::Known(Mode::Connected),
            ModeView::Unknown(9),
        ] {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{m}\""));
            assert_eq!(serde_json::from_str::<ModeView>(&json).unwrap(), m);
        }
        assert_eq!(ModeView::Unknown(9).to_string(), "unknown(9)");
        assert!(serde_json::from_str::<ModeView>("\"fast\"").is_err());
        for p in [PeerPin::Auto, PeerPin::Ud, PeerPin::Cm, PeerPin::Block] {
            let view = PeerView {
                pin: p,
                ..peer("10.0.0.9")
            };
            let json = serde_json::to_value(&view).unwrap();
            assert_eq!(json["pin"], p.to_string());
            assert_eq!(serde_json::from_value::<PeerView>(json).unwrap().pin, p);
        }
        let mut bad = serde_json::to_value(peer("10.0.0.9")).unwrap();
        bad["pin"] = "sticky".into();
        assert!(serde_json::from_value::<PeerView>(bad).is_err());
        for (k, name) in [
            (cm::ReceiveKind::Srq, "srq"),
            (cm::ReceiveKind::Rings, "rings"),
        ] {
            assert_eq!(serde_json::to_value(k).unwrap(), name);
        }
        // A pin pads in the peers table's column.
        assert_eq!(format!("{:<5}|", PeerPin::Cm), "cm   |");
    }

    #[test]
    fn this_process_is_alive_and_a_pid_past_the_kernels_limit_is_not() {
        assert!(pid_alive(std::process::id()));
        // pid_max is at most 2^22.
        assert!(!pid_alive((1 << 22) + 1));
    }

    #[test]
    fn only_decisions_that_counted_packets_are_listed() {
        let mut s = status();
        let mut out = String::new();
        render_reasons(&mut out, &s);
        assert!(out.contains("(no packets yet)"), "{out}");
        // Decisions known but none taken yet: the same.
        s.reasons.insert("cm_bulk".into(), CounterView::default());
        let mut out = String::new();
        render_reasons(&mut out, &s);
        assert!(out.contains("(no packets yet)"), "{out}");
        s.reasons.insert(
            "ud_small".into(),
            CounterView {
                packets: 3,
                bytes: 2048,
            },
        );
        let mut out = String::new();
        render_reasons(&mut out, &s);
        assert!(!out.contains("(no packets yet)"), "{out}");
        let line = out.lines().find(|l| l.contains("ud_small")).expect(&out);
        assert!(
            line.contains(" 3 pkts") && line.contains("2.0 KiB"),
            "{line}"
        );
        assert!(!out.contains("cm_bulk"), "{out}");
    }

    #[test]
    fn the_peer_cache_line_gives_the_hit_share_and_each_kind_of_miss() {
        let line = |c: Option<&PeerCacheCounts>| {
            let mut out = String::new();
            render_peer_cache(&mut out, c);
            out
        };
        assert!(line(None).contains("not counted by these programs"));
        assert!(line(Some(&PeerCacheCounts::default())).contains("no lookups yet"));
        let out = line(Some(&PeerCacheCounts {
            hits: 995,
            misses_stale: 2,
            misses_other: 3,
            slots_filled: 12,
        }));
        for want in [
            "99.5% of 1000 lookups hit",
            "missed 2 after a write or beat",
            "3 to an empty slot",
            "12 slots filled",
        ] {
            assert!(out.contains(want), "{want:?} in {out}");
        }
        // And the status shows it.
        let mut s = status();
        s.peer_cache = Some(PeerCacheCounts::default());
        assert!(render(&s).contains("  peer cache: no lookups yet\n"));
    }

    #[test]
    fn status_says_where_the_interface_is_and_how_its_loop_is() {
        let mut s = status();
        let here = render(&s);
        assert!(
            here.starts_with("ib0: ifindex 7 egress tcx ingress xdp generic\n"),
            "{here}"
        );
        let tc = Status {
            ingress: Some(attach::IngressAttach::Tc),
            ..status()
        };
        assert!(render(&tc).starts_with("ib0: ifindex 7 egress tcx ingress tc\n"));
        assert!(!here.contains("STALE") && !here.contains("another network namespace"));
        assert!(
            here.contains("control loop: running (pid 42); heartbeat 120 ms old\n"),
            "{here}"
        );
        assert!(here.contains("connected mode: not running"), "{here}");
        assert!(
            here.contains("policy: mode=auto cm-threshold=1024"),
            "{here}"
        );
        s.presence = Some(attach::Presence::Gone);
        let gone = render(&s);
        assert!(
            gone.contains("STALE: ib0 is gone") && gone.contains("`ipoib-ctl detach ib0`"),
            "{gone}"
        );
        s.presence = Some(attach::Presence::Elsewhere);
        assert!(render(&s).contains("in another network namespace"));
        s.presence = None;
        s.loop_running = false;
        s.heartbeat_age_ms = None;
        s.failsafe_active = true;
        let dead = render(&s);
        assert!(
            dead.contains(
                "control loop: gone (pid 42 exited); heartbeat never written -> FAIL-SAFE"
            ),
            "{dead}"
        );
        s.loop_pid = None;
        assert!(render(&s).contains("control loop: not running;"));
        s.cm_down = Some(
            "waits: rxe0 port 1 is not ready for connected mode: the port is DOWN, \
                          not ACTIVE"
                .into(),
        );
        assert!(
            render(&s).contains(
                "  connected mode: not running, waits: rxe0 port 1 is not ready for connected \
                 mode: the port is DOWN, not ACTIVE (every peer on UD)\n"
            ),
            "{}",
            render(&s)
        );
    }

    #[test]
    fn the_policy_line_and_file_show_every_setting() {
        let mut p = policy_view();
        assert_eq!(
            p.render(),
            "mode=auto cm-threshold=1024 heartbeat-timeout=3000ms kernel-cm=off ctl-port=18515 \
             memory-budget=auto max-connections=plan (link ipoib)"
        );
        let file = p.render_file(
            "ib0",
            &[
                ("10.0.0.7".into(), PeerPin::Ud),
                ("10.0.0.8".into(), PeerPin::Auto),
                ("fd00::9".into(), PeerPin::Block),
            ],
        );
        let lines: Vec<&str> = file.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            [
                "mode=auto",
                "cm-threshold=1024",
                "heartbeat-timeout=3000ms",
                "kernel-cm=off",
                "ctl-port=18515",
                "peer=10.0.0.7:ud",
                "peer=[fd00::9]:block",
            ]
        );
        assert!(file.contains("# memory-budget: worked out by the control loop"));
        p.memory_budget = Some(512 << 20);
        p.max_connections = Some(16);
        p.kernel_cm = true;
        assert!(p.render().contains("kernel-cm=on"));
        assert!(
            p.render()
                .contains("memory-budget=512MiB max-connections=16 (link ipoib)")
        );
        let file = p.render_file("ib0", &[]);
        assert!(
            file.contains("kernel-cm=on\n")
                && file.contains("\nmemory-budget=512MiB\n")
                && file.contains("\nmax-connections=16\n"),
            "{file}"
        );
    }

    fn peer(addr: &str) -> PeerView {
        PeerView {
            addr: addr.into(),
            mode: PeerModeView::Ud,
            pin: PeerPin::Auto,
            cm_ifindex: 0,
            generation: 0,
            traffic: TrafficView::default(),
        }
    }

    #[test]
    fn an_srq_plan_shows_no_cap_where_the_qps_are_the_cap() {
        let mut cm = cm::CmStatus {
            max_connections: 1_048_552,
            connections: 2,
            ..Default::default()
        };
        cm.receive.model = cm::ReceiveKind::Srq;
        let mut out = String::new();
        render_cm(&mut out, &cm);
        assert!(
            out.contains("2 connections (no cap but the HCA's QPs)"),
            "{out}"
        );
        cm.max_connections = 3;
        let mut out = String::new();
        render_cm(&mut out, &cm);
        assert!(out.contains("2 connections (at most 3)"), "{out}");
        // Rings: their use against K, and the cap as it is even when large.
        cm.receive.model = cm::ReceiveKind::Rings;
        cm.receive.depth = 64;
        cm.receive.rings = 2;
        cm.receive.max_rings = 3;
        cm.max_connections = 1_048_552;
        let mut out = String::new();
        render_cm(&mut out, &cm);
        assert!(
            out.contains("rings of 64 buffers: 2 of K=3 in use"),
            "{out}"
        );
        assert!(out.contains("(at most 1048552)"), "{out}");
    }

    /// Each engine counter under its own words: what was let go to UD by cause, then sent or lost;
    /// flushed receives (a closing connection's ring) not among the errors.
    #[test]
    fn the_engine_line_names_each_counter() {
        let mut cm = cm::CmStatus::default();
        for (i, k) in [
            "tx_packets",
            "rx_packets",
            "tx_backpressure",
            "tx_no_connection",
            "tx_oversize",
            "send_errors",
            "rx_errors",
            "rx_flushed",
            "tx_congested",
            "tx_sent_ud",
            "tx_not_sent_ud",
        ]
        .iter()
        .enumerate()
        {
            cm.engine.insert((*k).into(), 10 + i as u64);
        }
        let mut out = String::new();
        render_engine(&mut out, &cm);
        for want in [
            "tx 10 msgs",
            "rx 11 msgs",
            "let go to UD (backpressure 12, no connection 13, oversize 14, and sends the QP refused): 19 sent, 20 lost;",
            "send errors 15, receive errors 16, congested",
            "its peer sent UD) 18,",
        ] {
            assert!(out.contains(want), "{want:?} not in {out}");
        }
        assert!(out.starts_with("    engine: "), "one lane unsaid: {out}");
        assert!(
            out.ends_with("    engine CPU: 0.0 s\n"),
            "no cost before enough moved: {out}"
        );
        cm.engine_cpu_ns = 2_500_000_000;
        cm.engine.insert("tx_bytes".into(), 3_000_000_000);
        cm.engine.insert("rx_bytes".into(), 2_000_000_000);
        let mut out = String::new();
        render_engine(&mut out, &cm);
        assert!(
            out.ends_with("    engine CPU: 2.5 s (0.50 s per GB moved)\n"),
            "{out}"
        );
        cm.engine_lanes = 2;
        let mut out = String::new();
        render_engine(&mut out, &cm);
        assert!(out.starts_with("    engine (2 lanes): tx 10 msgs"), "{out}");
    }

    /// Every row's columns start where the header's do, the longest IPv6 address included.
    #[test]
    fn peer_columns_fit_the_longest_address() {
        let long = "fd00:1234:5678:9abc:def0:1234:5678:9abc";
        let text = render_peers(&[peer("10.0.0.7"), peer(long)]);
        let lines: Vec<&str> = text.lines().collect();
        let col = |l: &str, word: &str| l.find(word).unwrap();
        let mode_at = col(lines[0], "mode");
        for l in &lines[1..] {
            assert_eq!(col(l, "ud"), mode_at, "{text}");
            assert_eq!(l.len(), lines[1].len(), "{text}");
        }
        assert!(lines[2].starts_with(&format!("  {long} ")), "{text}");
    }
}
