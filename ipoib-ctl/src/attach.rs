//! Attaching the fast path to an interface, adopting an attachment, and detaching it.
//!
//! Everything that must outlive the control plane is pinned under
//! `/sys/fs/bpf/ipoib/IFACE/` (mode 0700): the maps, both programs and their links (a
//! netlink tc filter, on kernels before 6.6, has none: the filter itself holds the program). A
//! control plane that exits leaves the datapath running (the heartbeat goes stale and the
//! fail-safe sends every packet UD); one that starts again adopts the pins, so counters go on
//! and traffic never sees a gap. Pins of an earlier map layout are replaced in place
//! ([`upgrade`]).
//!
//! What bpffs cannot hold (how egress was attached, the control plane's own settings, the
//! control loop's pid) lives in `/run/ipoib-ctl/IFACE.json`.

pub mod upgrade;

use std::{
    fs,
    io::{self, ErrorKind},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{self, TcError},
    },
    util::KernelVersion,
};
use ipoib_common::{PeerPin, Policy, map_names, prog_names};
use serde::{Deserialize, Serialize};

use crate::{
    clock::monotonic_ns,
    datapath::{Datapath, DatapathError},
    maps::{DatapathMaps, MapsError},
    netdev::{Netdev, NetdevError},
    policy::{PolicyChange, PolicyError},
};

pub const PIN_ROOT: &str = "/sys/fs/bpf/ipoib";
pub const RUN_DIR: &str = "/run/ipoib-ctl";

pub(crate) const PROG_EGRESS: &str = "prog_egress";
pub(crate) const PROG_INGRESS: &str = "prog_ingress";
pub(crate) const LINK_EGRESS: &str = "link_egress";
pub(crate) const LINK_INGRESS: &str = "link_ingress";

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Netdev(#[from] NetdevError),
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("{iface} is not attached (no pins under {})", dir.display())]
    NotAttached { iface: String, dir: PathBuf },
    #[error("the pins under {} belong to an interface with ifindex {pinned}, but {iface} is now ifindex {now}: the interface was recreated; run `ipoib-ctl detach {iface}` first", dir.display())]
    Stale {
        iface: String,
        dir: PathBuf,
        pinned: u32,
        now: u32,
    },
    #[error(
        "{iface} is attached with map layout {layout}, not this version's {}: `ipoib-ctl \
         attach {iface}` replaces an earlier layout in place, under traffic",
        ipoib_common::LAYOUT
    )]
    OtherLayout { iface: String, layout: u32 },
    #[error("attaching {what} to {iface}: {source}")]
    Program {
        what: &'static str,
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("tc on {iface}: {source}")]
    Tc {
        iface: String,
        #[source]
        source: TcError,
    },
    #[error("bpffs: {0}")]
    Bpffs(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, AttachError>;

pub(crate) fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> AttachError + 'a {
    move |source| AttachError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// How egress was attached: a TCX link (kernels >= 6.6) or a netlink clsact filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EgressAttach {
    Tcx,
    Netlink,
}

impl EgressAttach {
    /// As `status` and its JSON name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        }
    }
}

/// Where ingress runs, as attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IngressAttach {
    /// TC ingress: a TCX link (kernels >= 6.6) or a netlink clsact filter.
    Tc,
    /// XDP in the driver.
    Driver,
    /// Generic XDP, on the skb.
    Generic,
    /// Not known: pins adopted without the state that said.
    Unknown,
}

/// What the control plane remembers about an attachment beside the pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachState {
    pub iface: String,
    pub ifindex: u32,
    pub egress: EgressAttach,
    /// Where ingress runs (read from the `xdp_mode` of a state written before TC ingress).
    #[serde(alias = "xdp_mode")]
    pub ingress: IngressAttach,
    /// The control plane's memory budget (bytes) when set by policy; `None`: worked out.
    pub memory_budget: Option<u64>,
    /// Policy `max-connections`; `None`: as many as the memory plan allows.
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// pid of the control loop in charge, if one runs.
    pub loop_pid: Option<u32>,
    /// The network namespace the interface was attached in (its inode), so `status` from
    /// elsewhere can tell an interface in another namespace from one that is gone.
    #[serde(default)]
    pub netns: Option<u64>,
    /// The layout of the pinned maps and programs (`ipoib_common::LAYOUT` when this version
    /// attached them; a state written before layouts were recorded is layout 1).
    #[serde(default = "first_layout")]
    pub layout: u32,
    /// Why connected mode does not run now, as the control loop last said (None: it runs,
    /// or no loop has said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cm_down: Option<String>,
    /// The kernel's own IPoIB mode at attach and what it means for us (None: not IPoIB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_mode: Option<String>,
}

fn first_layout() -> u32 {
    1
}

/// The inode of this process's network namespace.
pub fn current_netns() -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata("/proc/self/ns/net").ok().map(|m| m.ino())
}

/// Whether a network namespace with this inode still exists: a process in it, or a name
/// under /run/netns that holds it.
pub fn netns_exists(ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let holds = |p: PathBuf| fs::metadata(p).is_ok_and(|m| m.ino() == ino);
    let named = fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| holds(e.path()));
    named
        || fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            })
            .any(|e| holds(e.path().join("ns/net")))
}

/// Where an attached interface is, seen from this network namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Presence {
    /// Here, with the ifindex it was attached with.
    Here,
    /// In another network namespace that still exists.
    Elsewhere,
    /// Gone: the device was removed (or replaced: another ifindex) or its namespace deleted.
    /// The pins are stale; `detach` removes them.
    Gone,
}

pub fn presence(state: &AttachState) -> Presence {
    let here = current_netns();
    match state.netns {
        Some(ns) if Some(ns) != here => {
            if netns_exists(ns) {
                Presence::Elsewhere
            } else {
                Presence::Gone
            }
        }
        _ => match Netdev::lookup(&state.iface) {
            Ok(d) if d.ifindex == state.ifindex => Presence::Here,
            _ => Presence::Gone,
        },
    }
}

pub fn pin_dir(iface: &str) -> PathBuf {
    Path::new(PIN_ROOT).join(iface)
}

/// The file `IFACE.SUFFIX` of [`RUN_DIR`]: what a running attach of `iface` keeps there.
pub fn run_file(iface: &str, suffix: &str) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{iface}.{suffix}"))
}

pub fn state_path(iface: &str) -> PathBuf {
    run_file(iface, "json")
}

pub fn read_state(iface: &str) -> Option<AttachState> {
    let text = fs::read_to_string(state_path(iface)).ok()?;
    serde_json::from_str(&text).ok()
}

pub fn write_state(state: &AttachState) -> Result<()> {
    let dir = Path::new(RUN_DIR);
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    let path = state_path(&state.iface);
    let text = serde_json::to_string_pretty(state).expect("state serialises");
    crate::files::replace(&path, text.as_bytes()).map_err(io_err("writing", &path))
}

/// Whether bpffs is mounted at /sys/fs/bpf (in this process's mount namespace).
pub fn bpffs_mounted() -> bool {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (_, at, ty) = (f.next(), f.next(), f.next());
        at == Some("/sys/fs/bpf") && ty == Some("bpf")
    })
}

/// Mounts bpffs at /sys/fs/bpf when nothing is mounted there.
pub fn ensure_bpffs() -> Result<()> {
    if bpffs_mounted() {
        return Ok(());
    }
    let target = c"/sys/fs/bpf";
    // SAFETY: valid C strings; mount(2) with no data.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(AttachError::Bpffs(format!(
            "bpffs is not mounted at /sys/fs/bpf and mounting it failed: {}",
            io::Error::last_os_error()
        )));
    }
    tracing::info!("mounted bpffs at /sys/fs/bpf");
    Ok(())
}

/// Whether `iface` has the datapath's pins.
pub fn is_attached(iface: &str) -> bool {
    pin_dir(iface).join(map_names::POLICY).exists()
}

/// The maps of an attached interface, for status and set-policy.
pub fn open(iface: &str) -> Result<DatapathMaps> {
    let dir = pin_dir(iface);
    if !is_attached(iface) {
        return Err(AttachError::NotAttached {
            iface: iface.to_string(),
            dir,
        });
    }
    let layout = upgrade::pinned_layout(&dir);
    if layout != ipoib_common::LAYOUT {
        return Err(AttachError::OtherLayout {
            iface: iface.to_string(),
            layout,
        });
    }
    Ok(DatapathMaps::from_pins(&dir)?)
}

/// An attached interface, as the control loop holds it.
pub struct Attached {
    pub maps: DatapathMaps,
    pub state: AttachState,
    /// True when existing pins were adopted rather than a fresh attach made.
    pub adopted: bool,
    /// The loaded object of a fresh attach (keeps the eBPF logger alive).
    pub datapath: Option<Datapath>,
}

/// Attaches the fast path to `dev`, or adopts the attachment its pins describe. `change`
/// (from `--policy FILE`) is validated before anything is created or written.
pub fn attach(
    dev: &Netdev,
    change: Option<&PolicyChange>,
    ingress: IngressChoice,
) -> Result<Attached> {
    dev.check_attachable()?;
    ensure_bpffs()?;
    if is_attached(&dev.name) {
        return adopt(dev, change);
    }
    // Validate against the fresh policy before creating anything.
    let base = Policy::new(dev.arphrd);
    let policy = match change {
        Some(c) => c.apply(&base, c.peers.iter().map(|(ip, pin)| (*ip, *pin)))?,
        None => base,
    };

    let dir = pin_dir(&dev.name);
    let hook = ingress_hook(ingress, dev.is_ipoib());
    match fresh_attach(dev, &dir, &policy, change, hook) {
        Ok(a) => Ok(a),
        Err(e) => {
            // Nothing half-made stays behind.
            if let Err(cleanup) = remove_attachment(&dev.name, None) {
                tracing::warn!("cleaning up after a failed attach: {cleanup}");
            }
            Err(e)
        }
    }
}

fn fresh_attach(
    dev: &Netdev,
    dir: &Path,
    policy: &Policy,
    change: Option<&PolicyChange>,
    hook: IngressHook,
) -> Result<Attached> {
    let root = Path::new(PIN_ROOT);
    fs::create_dir_all(root).map_err(io_err("creating", root))?;
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(io_err("chmod 0700", dir))?;

    let mut dp = Datapath::load_pinned(Some(dir))?;
    dp.maps.set_policy(policy)?;
    dp.maps.beat(monotonic_ns())?;
    if let Some(c) = change {
        apply_peer_pins(&mut dp.maps, c)?;
    }
    let egress = attach_egress(&mut dp, dev, dir)?;
    let ingress = attach_ingress(&mut dp, dev, dir, hook)?;
    let state = AttachState {
        iface: dev.name.clone(),
        ifindex: dev.ifindex,
        egress,
        ingress,
        memory_budget: change.and_then(|c| c.memory_budget),
        max_connections: change.and_then(|c| c.max_connections),
        loop_pid: None,
        netns: current_netns(),
        layout: ipoib_common::LAYOUT,
        cm_down: None,
        kernel_mode: None,
    };
    write_state(&state)?;
    // The maps stay pinned; reopen them from the pins so a fresh attach and an adoption hold
    // the same thing.
    let maps = DatapathMaps::from_pins(dir)?;
    Ok(Attached {
        maps,
        state,
        adopted: false,
        datapath: Some(dp),
    })
}

pub(crate) fn prog_err<'a>(
    what: &'static str,
    iface: &'a str,
) -> impl FnOnce(ProgramError) -> AttachError + 'a {
    move |source| AttachError::Program {
        what,
        iface: iface.to_string(),
        source,
    }
}

pub(crate) fn bpffs_err(e: impl std::fmt::Display) -> AttachError {
    AttachError::Bpffs(e.to_string())
}

/// Egress: TCX where the kernel has it (>= 6.6), a clsact filter otherwise; the program and
/// (TCX) its link pinned under `dir`.
fn attach_egress(dp: &mut Datapath, dev: &Netdev, dir: &Path) -> Result<EgressAttach> {
    let iface = dev.name.as_str();
    let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
    let egress: &mut SchedClassifier = dp.egress()?;
    egress.pin(dir.join(PROG_EGRESS)).map_err(bpffs_err)?;
    if !tcx && let Err(e) = tc::qdisc_add_clsact(iface) {
        let exists =
            matches!(&e, TcError::NetlinkError(n) if n.raw_os_error() == Some(libc::EEXIST));
        if !exists {
            return Err(AttachError::Tc {
                iface: iface.to_string(),
                source: e,
            });
        }
    }
    if attach_tc(
        egress,
        "ipoib_egress",
        iface,
        TcAttachType::Egress,
        dir,
        LINK_EGRESS,
    )? {
        Ok(EgressAttach::Tcx)
    } else {
        Ok(EgressAttach::Netlink)
    }
}

/// Attaches TC program `prog` (`name`, pinned already) at `at` on `iface`, and pins its link
/// as `link_pin` under `dir` where it has one: true for a TCX link, false for a netlink
/// filter, which stays attached because no link of it is dropped (the conversion consumes
/// and releases the handle without detaching).
fn attach_tc(
    prog: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    at: TcAttachType,
    dir: &Path,
    link_pin: &str,
) -> Result<bool> {
    let id = prog.attach(iface, at).map_err(prog_err(name, iface))?;
    let link = prog.take_link(id).map_err(prog_err(name, iface))?;
    match FdLink::try_from(link) {
        Ok(fd) => {
            fd.pin(dir.join(link_pin)).map_err(bpffs_err)?;
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

/// Where ingress may run (`attach --ingress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum IngressChoice {
    /// TC on IPoIB, XDP elsewhere.
    #[default]
    Auto,
    Tc,
    Xdp,
}

/// The hook ingress runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngressHook {
    Tc,
    Xdp,
}

/// The hook `choice` means on an interface, IPoIB (`ipoib`) or not: TC on IPoIB, which has no
/// native XDP, and whose generic XDP costs 1.5-2x the CPU per byte received
/// (docs/benchmarks.md); XDP elsewhere, native where the driver has it.
pub fn ingress_hook(choice: IngressChoice, ipoib: bool) -> IngressHook {
    match choice {
        IngressChoice::Tc => IngressHook::Tc,
        IngressChoice::Xdp => IngressHook::Xdp,
        IngressChoice::Auto if ipoib => IngressHook::Tc,
        IngressChoice::Auto => IngressHook::Xdp,
    }
}

/// Ingress at `hook`: TC as egress is (TCX, or a filter on egress's clsact before 6.6), or
/// XDP (native where the driver has it, else generic).
fn attach_ingress(
    dp: &mut Datapath,
    dev: &Netdev,
    dir: &Path,
    hook: IngressHook,
) -> Result<IngressAttach> {
    let iface = dev.name.as_str();
    if hook == IngressHook::Tc {
        let ingress = dp.ingress_tc()?;
        ingress.pin(dir.join(PROG_INGRESS)).map_err(bpffs_err)?;
        attach_tc(
            ingress,
            "ipoib_tcingress",
            iface,
            TcAttachType::Ingress,
            dir,
            LINK_INGRESS,
        )?;
        return Ok(IngressAttach::Tc);
    }
    let ingress: &mut Xdp = dp.ingress()?;
    ingress.pin(dir.join(PROG_INGRESS)).map_err(bpffs_err)?;
    let (id, mode) = if dev.is_ipoib() {
        (ingress.attach(iface, XdpMode::Skb), IngressAttach::Generic)
    } else {
        match ingress.attach(iface, XdpMode::Driver) {
            Ok(id) => (Ok(id), IngressAttach::Driver),
            Err(_) => (ingress.attach(iface, XdpMode::Skb), IngressAttach::Generic),
        }
    };
    let id = id.map_err(prog_err("ipoib_ingress", iface))?;
    let link = ingress
        .take_link(id)
        .map_err(prog_err("ipoib_ingress", iface))?;
    let fd = FdLink::try_from(link).map_err(bpffs_err)?;
    fd.pin(dir.join(LINK_INGRESS)).map_err(bpffs_err)?;
    Ok(mode)
}

fn adopt(dev: &Netdev, change: Option<&PolicyChange>) -> Result<Attached> {
    let dir = pin_dir(&dev.name);
    let mut state = read_state(&dev.name).unwrap_or(AttachState {
        iface: dev.name.clone(),
        ifindex: dev.ifindex,
        egress: if dir.join(LINK_EGRESS).exists() {
            EgressAttach::Tcx
        } else {
            EgressAttach::Netlink
        },
        ingress: IngressAttach::Unknown,
        memory_budget: None,
        max_connections: None,
        loop_pid: None,
        netns: None,
        layout: upgrade::pinned_layout(&dir),
        cm_down: None,
        kernel_mode: None,
    });
    // Adopted here: this is its namespace now.
    state.netns = current_netns();
    if state.ifindex != dev.ifindex {
        return Err(AttachError::Stale {
            iface: dev.name.clone(),
            dir,
            pinned: state.ifindex,
            now: dev.ifindex,
        });
    }
    match upgrade::pinned_layout(&dir) {
        ipoib_common::LAYOUT => {}
        1 => state = upgrade::from_layout_1(dev, &dir, state)?,
        other => {
            return Err(AttachError::Bpffs(format!(
                "{}: pins of an unknown layout ({other}); `ipoib-ctl detach {}` removes them",
                dir.display(),
                dev.name
            )));
        }
    }
    let mut maps = DatapathMaps::from_pins(&dir)?;
    if let Some(c) = change {
        set_policy(&mut maps, &mut state, c)?;
    }
    maps.beat(monotonic_ns())?;
    write_state(&state)?;
    Ok(Attached {
        maps,
        state,
        adopted: true,
        datapath: None,
    })
}

/// Every peer's pin once `change` is applied.
fn pins_after(
    maps: &DatapathMaps,
    change: &PolicyChange,
) -> Result<Vec<(std::net::IpAddr, PeerPin)>> {
    let mut pins: std::collections::BTreeMap<_, _> = maps
        .peers()?
        .into_iter()
        .filter_map(|(k, e)| Some((k.ip()?, PeerPin::try_from(e.pin).unwrap_or_default())))
        .collect();
    pins.extend(change.peers.iter().map(|(ip, pin)| (*ip, *pin)));
    Ok(pins.into_iter().collect())
}

fn apply_peer_pins(maps: &mut DatapathMaps, change: &PolicyChange) -> Result<()> {
    for (ip, pin) in &change.peers {
        let key = ipoib_common::PeerKey::from(*ip);
        let mut entry = maps.peer(&key)?.unwrap_or_default();
        entry.pin = u8::from(*pin);
        maps.set_peer(key, entry)?;
    }
    Ok(())
}

/// Applies a validated change to a live attachment: the whole change is checked before the
/// first write.
pub fn set_policy(
    maps: &mut DatapathMaps,
    state: &mut AttachState,
    change: &PolicyChange,
) -> Result<Policy> {
    let current = maps.policy()?;
    let next = change.apply(&current, pins_after(maps, change)?)?;
    apply_peer_pins(maps, change)?;
    maps.set_policy(&next)?;
    if change.memory_budget.is_some() || change.max_connections.is_some() {
        state.memory_budget = change.memory_budget.or(state.memory_budget);
        state.max_connections = change.max_connections.or(state.max_connections);
        write_state(state)?;
    }
    Ok(next)
}

/// Detaches the datapath from `iface` and removes its pins and state; traffic keeps flowing
/// on the kernel's own path. The control loop in charge, if any, is told to stop.
pub fn detach(iface: &str) -> Result<()> {
    let dir = pin_dir(iface);
    if !dir.exists() {
        return Err(AttachError::NotAttached {
            iface: iface.to_string(),
            dir,
        });
    }
    let state = read_state(iface);
    remove_attachment(iface, state.as_ref())?;
    // Only now, with nothing left for it to write into, tell the loop to go.
    if let Some(pid) = state.as_ref().and_then(|s| s.loop_pid)
        && pid != std::process::id()
    {
        // SAFETY: kill(2) with a plain signal; a pid that is gone returns ESRCH.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    Ok(())
}

fn remove_attachment(iface: &str, state: Option<&AttachState>) -> Result<()> {
    let dir = pin_dir(iface);
    // Links first: unpinning and closing the last reference detaches the program.
    for link in [LINK_EGRESS, LINK_INGRESS] {
        let path = dir.join(link);
        if path.exists() {
            match PinnedLink::from_pin(&path) {
                Ok(pinned) => {
                    let fd = pinned.unpin().map_err(io_err("unpinning", &path))?;
                    drop(fd);
                }
                Err(e) => {
                    tracing::warn!("{}: {e}; removing the pin", path.display());
                    fs::remove_file(&path).map_err(io_err("removing", &path))?;
                }
            }
        }
    }
    if state.is_none_or(|s| s.egress == EgressAttach::Netlink) {
        let filters = [
            (TcAttachType::Egress, prog_names::EGRESS),
            (TcAttachType::Ingress, prog_names::INGRESS_TC),
        ];
        for (at, name) in filters {
            match tc::qdisc_detach_program(iface, at, name) {
                Ok(()) => {}
                Err(TcError::IoError(e)) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => tracing::debug!("netlink detach of {name} on {iface}: {e}"),
            }
        }
    }
    if dir.exists() {
        for entry in fs::read_dir(&dir).map_err(io_err("reading", &dir))? {
            let path = entry.map_err(io_err("reading", &dir))?.path();
            fs::remove_file(&path).map_err(io_err("removing", &path))?;
        }
        fs::remove_dir(&dir).map_err(io_err("removing", &dir))?;
    }
    let sp = state_path(iface);
    if sp.exists() {
        fs::remove_file(&sp).map_err(io_err("removing", &sp))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingress_runs_at_tc_on_ipoib_and_at_xdp_elsewhere_unless_told() {
        use IngressChoice::{Auto, Tc, Xdp};
        let hooks: Vec<_> = [(Auto, true), (Auto, false), (Tc, true), (Tc, false)]
            .into_iter()
            .chain([(Xdp, true), (Xdp, false)])
            .map(|(c, ipoib)| ingress_hook(c, ipoib))
            .collect();
        use IngressHook as H;
        assert_eq!(hooks, [H::Tc, H::Xdp, H::Tc, H::Tc, H::Xdp, H::Xdp]);
    }

    /// A state written before TC ingress names the XDP mode `xdp_mode`: it still reads.
    #[test]
    fn a_state_from_before_tc_ingress_reads() {
        let old = r#"{"iface": "ib0", "ifindex": 4, "egress": "tcx", "xdp_mode": "generic",
            "memory_budget": null, "loop_pid": null}"#;
        let s: AttachState = serde_json::from_str(old).unwrap();
        assert_eq!((s.ingress, s.layout), (IngressAttach::Generic, 1));
        let now = serde_json::to_value(&s).unwrap();
        assert_eq!(now["ingress"], "generic");
        assert!(now.get("xdp_mode").is_none());
    }
}
