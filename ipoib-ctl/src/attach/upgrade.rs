//! Replacing an attachment of an earlier layout (`ipoib_common::LAYOUT`) in place, under
//! traffic: what `attach` does when the pins it would adopt were left by an earlier version.
//!
//! The new programs and maps are loaded and pinned beside the old ones (in [`NEXT`] under the
//! pin directory), the state the old maps hold is copied across (the policy, every peer's
//! entry; per-peer traffic into the map of peers counted apart, from which the control loop
//! gives each a slot), the heartbeat is stamped, and only then is
//! each program swapped for the new one atomically on its hook (bpf_link_update for the
//! TCX and XDP links, a filter replaced at its own priority and handle for a netlink tc
//! filter): every packet meets one program or the other, with the same policy and pins.
//! The old decision counters, final once the old programs are off their hooks, go into the
//! new map's carried half. (Per-peer traffic the old programs counted between the copy and
//! the swap is lost: a few milliseconds of rates.)
//! Last, the new pins are renamed over the old ones and what only the old layout had goes.

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues},
    programs::{
        SchedClassifier, TcAttachType, Xdp,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcHandle},
        xdp::XdpLink,
    },
};
use ipoib_common::{
    Counter, LAYOUT, PeerEntry, PeerKey, PeerTraffic, Policy, REASON_COUNT, Reason, map_names,
};

use super::{
    AttachError, AttachState, EgressAttach, LINK_EGRESS, LINK_INGRESS, PROG_EGRESS, PROG_INGRESS,
    bpffs_err, io_err, prog_err,
};
use crate::{
    clock::monotonic_ns,
    datapath::Datapath,
    maps::{DatapathMaps, MapsError},
    netdev::Netdev,
};

type Result<T> = std::result::Result<T, AttachError>;

/// Where the new pins wait, under the pin directory (bpffs takes no name with a dot).
pub const NEXT: &str = "upgrade_next";

/// The layout of the pins under `dir`: [`LAYOUT`], 1 for the first one (per-peer traffic in
/// `ipoib_traffic`), or 0 when neither is there.
pub fn pinned_layout(dir: &Path) -> u32 {
    if dir.join(map_names::TRAFFIC).exists() {
        LAYOUT
    } else if dir.join(map_names::TRAFFIC_V1).exists() {
        1
    } else {
        0
    }
}

fn open<T>(dir: &Path, name: &'static str) -> Result<T>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    let path = dir.join(name);
    let map = MapData::from_pin(&path)
        .and_then(Map::from_map_data)
        .map_err(|source| MapsError::Pinned {
            path: path.clone(),
            source,
        })?;
    T::try_from(map).map_err(|source| MapsError::Pinned { path, source }.into())
}

/// Replaces the layout-1 attachment of `dev` pinned under `dir` (`state` as it was
/// recorded); returns the state with the new layout, written.
pub fn from_layout_1(dev: &Netdev, dir: &Path, mut state: AttachState) -> Result<AttachState> {
    let next = dir.join(NEXT);
    if next.exists() {
        // A replacement that died half-way: its pins were never in use.
        for e in fs::read_dir(&next).map_err(io_err("reading", &next))? {
            let p = e.map_err(io_err("reading", &next))?.path();
            fs::remove_file(&p).map_err(io_err("removing", &p))?;
        }
    } else {
        fs::create_dir(&next).map_err(io_err("creating", &next))?;
    }
    let mut dp = Datapath::load_pinned(Some(&next))?;
    copy_state(dir, &mut dp.maps)?;
    let egress: &mut SchedClassifier = dp.egress()?;
    egress.pin(next.join(PROG_EGRESS)).map_err(bpffs_err)?;
    let ingress: &mut Xdp = dp.ingress()?;
    ingress.pin(next.join(PROG_INGRESS)).map_err(bpffs_err)?;
    swap_egress(&mut dp, dev, dir, state.egress)?;
    swap_ingress(&mut dp, dev, dir)?;
    carry_reasons(dir, &mut dp.maps)?;
    // Traffic runs through the new programs: their pins take the old names.
    for e in fs::read_dir(&next).map_err(io_err("reading", &next))? {
        let from = e.map_err(io_err("reading", &next))?.path();
        let to: PathBuf = dir.join(from.file_name().expect("a pin has a name"));
        fs::rename(&from, &to).map_err(io_err("renaming", &from))?;
    }
    fs::remove_dir(&next).map_err(io_err("removing", &next))?;
    let old = dir.join(map_names::TRAFFIC_V1);
    fs::remove_file(&old).map_err(io_err("removing", &old))?;
    state.layout = LAYOUT;
    super::write_state(&state)?;
    tracing::info!(
        "{}: the attachment of layout 1 was replaced by layout {LAYOUT} in place (policy, pins \
         and counters kept)",
        dev.name
    );
    Ok(state)
}

/// The old maps' state into the new ones; the heartbeat stamped, so the new programs trust
/// the connected peers the old ones did until the control loop takes over.
fn copy_state(dir: &Path, new: &mut DatapathMaps) -> Result<()> {
    let policy: Array<MapData, Policy> = open(dir, map_names::POLICY)?;
    let in_map = |name| move |source| MapsError::Map { name, source };
    new.set_policy(&policy.get(&0, 0).map_err(in_map(map_names::POLICY))?)?;
    new.beat(monotonic_ns())?;
    // The entry's layout is the same: the slot is where layout 1 had padding (zero).
    let peers: HashMap<MapData, PeerKey, PeerEntry> = open(dir, map_names::PEERS)?;
    for r in peers.iter() {
        let (k, e) = r.map_err(in_map(map_names::PEERS))?;
        new.set_peer(
            k,
            PeerEntry {
                traffic_slot: 0,
                ..e
            },
        )?;
    }
    let traffic: PerCpuHashMap<MapData, PeerKey, PeerTraffic> = open(dir, map_names::TRAFFIC_V1)?;
    for r in traffic.iter() {
        let (k, per_cpu) = r.map_err(in_map(map_names::TRAFFIC_V1))?;
        let mut sum = PeerTraffic::default();
        for t in per_cpu.iter() {
            sum.accumulate(t);
        }
        new.unknown
            .insert(k, sum, 0)
            .map_err(in_map(map_names::UNKNOWN))?;
    }
    Ok(())
}

/// The old programs' decision counters, final now that they run no more, into the new
/// map's carried half (which the new programs never write: no increment is lost).
fn carry_reasons(dir: &Path, new: &mut DatapathMaps) -> Result<()> {
    // A packet that entered an old program just before its swap may still be counting on
    // another CPU (programs run under RCU): let it finish.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let in_map = |name| move |source| MapsError::Map { name, source };
    let reasons: PerCpuArray<MapData, Counter> = open(dir, map_names::REASONS)?;
    for r in Reason::ALL {
        let per_cpu = reasons
            .get(&(r as u32), 0)
            .map_err(in_map(map_names::REASONS))?;
        let values: Vec<Counter> = per_cpu.iter().copied().collect();
        let values = PerCpuValues::try_from(values).map_err(MapsError::Cpus)?;
        new.reasons
            .set(r as u32 + REASON_COUNT, values, 0)
            .map_err(in_map(map_names::REASONS))?;
    }
    Ok(())
}

/// The pinned link `name` under `dir`, as the link type `L` a program can be swapped into.
fn pinned_link<L: TryFrom<FdLink>>(dir: &Path, name: &str) -> Result<L> {
    let path = dir.join(name);
    let pinned = PinnedLink::from_pin(&path).map_err(bpffs_err)?;
    L::try_from(FdLink::from(pinned))
        .map_err(|_| AttachError::Bpffs(format!("{}: not a link of this hook", path.display())))
}

fn swap_egress(dp: &mut Datapath, dev: &Netdev, dir: &Path, how: EgressAttach) -> Result<()> {
    let iface = dev.name.as_str();
    let link = match how {
        EgressAttach::Tcx => pinned_link::<SchedClassifierLink>(dir, LINK_EGRESS)?,
        EgressAttach::Netlink => {
            let (priority, handle) = egress_filter(dev)?;
            SchedClassifierLink::attached(iface, TcAttachType::Egress, priority, handle, None)
                .map_err(|e| AttachError::Bpffs(e.to_string()))?
        }
    };
    let egress = dp.egress()?;
    let id = egress
        .attach_to_link(link)
        .map_err(prog_err("ipoib_egress", iface))?;
    let link = egress
        .take_link(id)
        .map_err(prog_err("ipoib_egress", iface))?;
    // A TCX link stays pinned under its old name; a netlink filter has no link: converting
    // releases the handle without detaching, as at attach.
    drop(FdLink::try_from(link));
    Ok(())
}

fn swap_ingress(dp: &mut Datapath, dev: &Netdev, dir: &Path) -> Result<()> {
    let iface = dev.name.as_str();
    let link = pinned_link::<XdpLink>(dir, LINK_INGRESS)?;
    let ingress = dp.ingress()?;
    let id = ingress
        .attach_to_link(link)
        .map_err(prog_err("ipoib_ingress", iface))?;
    let link = ingress
        .take_link(id)
        .map_err(prog_err("ipoib_ingress", iface))?;
    drop(FdLink::try_from(link));
    Ok(())
}

/// The priority and handle of the one bpf filter on `dev`'s clsact egress (ours: the first
/// layout attached it there with the kernel's choice of both).
fn egress_filter(dev: &Netdev) -> Result<(u16, TcHandle)> {
    use futures_util::TryStreamExt as _;
    use rtnetlink::packet_route::tc::TcAttribute;
    let filters = crate::rtnl::blocking(async |r| {
        let mut filters = r.handle().traffic_filter(dev.ifindex as i32);
        filters
            .get()
            .egress()
            .execute()
            .try_collect::<Vec<_>>()
            .await
            .map_err(|e| crate::rtnl::RtnlError::Netlink {
                what: format!("listing the egress filters of {}", dev.name),
                source: std::io::Error::other(e.to_string()),
            })
    })
    .map_err(crate::netdev::NetdevError::from)?;
    let bpf: Vec<(u16, TcHandle)> = filters
        .iter()
        .filter(|f| {
            f.attributes
                .iter()
                .any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf"))
                && f.header.handle.major | f.header.handle.minor != 0
        })
        .map(|f| {
            let h = f.header.handle;
            (
                (f.header.info >> 16) as u16,
                TcHandle::new(h.major, h.minor),
            )
        })
        .collect();
    match bpf.as_slice() {
        [one] => Ok(*one),
        other => Err(AttachError::Bpffs(format!(
            "{}: expected one bpf filter on egress to replace, found {}",
            dev.name,
            other.len()
        ))),
    }
}
