//! Typed access to the fast path's maps, from a freshly loaded object or from pins.

use std::path::{Path, PathBuf};

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap, PerCpuValues},
};
use ipoib_common::{
    Counter, Heartbeat, PeerEntry, PeerKey, PeerTraffic, Policy, Reason, map_names,
};

#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error("map {name} is missing from the eBPF object")]
    Missing { name: &'static str },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("pinned map {}: {source}", path.display())]
    Pinned {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error("pinning map {name} at {}: {source}", path.display())]
    Pin {
        name: &'static str,
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
}

type Result<T> = std::result::Result<T, MapsError>;

/// The five maps of the fast path; see `ipoib_common::map_names` for what each holds.
pub struct DatapathMaps {
    pub policy: Array<MapData, Policy>,
    pub heartbeat: Array<MapData, Heartbeat>,
    pub peers: HashMap<MapData, PeerKey, PeerEntry>,
    pub traffic: PerCpuHashMap<MapData, PeerKey, PeerTraffic>,
    pub reasons: PerCpuArray<MapData, Counter>,
}

/// Maps an error of the map `name` into ours.
fn in_map(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

fn typed<T>(name: &'static str, map: Map) -> Result<T>
where
    T: TryFrom<Map, Error = MapError>,
{
    T::try_from(map).map_err(in_map(name))
}

impl DatapathMaps {
    /// Takes the maps out of a loaded object (the programs keep their own references), pinning
    /// each under `pin_dir` when given (the directory must exist on a bpffs).
    pub fn take(ebpf: &mut Ebpf, pin_dir: Option<&Path>) -> Result<Self> {
        let mut take = |name: &'static str| {
            let map = ebpf.take_map(name).ok_or(MapsError::Missing { name })?;
            if let Some(dir) = pin_dir {
                let path = dir.join(name);
                map.pin(&path)
                    .map_err(|source| MapsError::Pin { name, path, source })?;
            }
            Ok::<_, MapsError>(map)
        };
        Ok(Self {
            policy: typed(map_names::POLICY, take(map_names::POLICY)?)?,
            heartbeat: typed(map_names::HEARTBEAT, take(map_names::HEARTBEAT)?)?,
            peers: typed(map_names::PEERS, take(map_names::PEERS)?)?,
            traffic: typed(map_names::TRAFFIC, take(map_names::TRAFFIC)?)?,
            reasons: typed(map_names::REASONS, take(map_names::REASONS)?)?,
        })
    }

    /// Opens the maps pinned under `dir` (one file per map, named as in `map_names`).
    pub fn from_pins(dir: &Path) -> Result<Self> {
        let open = |name: &'static str| {
            let path = dir.join(name);
            MapData::from_pin(&path)
                .and_then(Map::from_map_data)
                .map_err(|source| MapsError::Pinned { path, source })
        };
        Ok(Self {
            policy: typed(map_names::POLICY, open(map_names::POLICY)?)?,
            heartbeat: typed(map_names::HEARTBEAT, open(map_names::HEARTBEAT)?)?,
            peers: typed(map_names::PEERS, open(map_names::PEERS)?)?,
            traffic: typed(map_names::TRAFFIC, open(map_names::TRAFFIC)?)?,
            reasons: typed(map_names::REASONS, open(map_names::REASONS)?)?,
        })
    }

    pub fn policy(&self) -> Result<Policy> {
        self.policy.get(&0, 0).map_err(in_map(map_names::POLICY))
    }

    pub fn set_policy(&mut self, policy: &Policy) -> Result<()> {
        self.policy
            .set(0, policy, 0)
            .map_err(in_map(map_names::POLICY))
    }

    pub fn heartbeat(&self) -> Result<Heartbeat> {
        self.heartbeat
            .get(&0, 0)
            .map_err(in_map(map_names::HEARTBEAT))
    }

    /// Stamps the heartbeat the fast path's fail-safe reads.
    pub fn beat(&mut self, monotonic_ns: u64) -> Result<()> {
        let hb = Heartbeat {
            monotonic_ns,
            writer_pid: std::process::id(),
            _pad: [0; 4],
        };
        self.heartbeat
            .set(0, hb, 0)
            .map_err(in_map(map_names::HEARTBEAT))
    }

    pub fn set_peer(&mut self, key: PeerKey, entry: PeerEntry) -> Result<()> {
        self.peers
            .insert(key, entry, 0)
            .map_err(in_map(map_names::PEERS))
    }

    /// One peer's entry; `None` when the control plane has none for it.
    pub fn peer(&self, key: &PeerKey) -> Result<Option<PeerEntry>> {
        match self.peers.get(key, 0) {
            Ok(e) => Ok(Some(e)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(in_map(map_names::PEERS)(e)),
        }
    }

    /// Removes a peer's entry; a peer that has none is not an error.
    pub fn remove_peer(&mut self, key: &PeerKey) -> Result<()> {
        match self.peers.remove(key) {
            Ok(()) => Ok(()),
            Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(in_map(map_names::PEERS)(e)),
        }
    }

    pub fn peers(&self) -> Result<Vec<(PeerKey, PeerEntry)>> {
        self.peers
            .iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(in_map(map_names::PEERS))
    }

    /// One peer's traffic, summed over CPUs; `None` when the fast path has not seen it.
    pub fn traffic_of(&self, key: &PeerKey) -> Result<Option<PeerTraffic>> {
        match self.traffic.get(key, 0) {
            Ok(per_cpu) => Ok(Some(sum_traffic(&per_cpu))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(in_map(map_names::TRAFFIC)(e)),
        }
    }

    /// Every peer's traffic, summed over CPUs.
    pub fn traffic(&self) -> Result<Vec<(PeerKey, PeerTraffic)>> {
        self.traffic
            .iter()
            .map(|r| r.map(|(k, v)| (k, sum_traffic(&v))))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(in_map(map_names::TRAFFIC))
    }

    /// Packets and bytes per reason, summed over CPUs, in `Reason::ALL` order.
    pub fn reasons(&self) -> Result<Vec<(Reason, Counter)>> {
        Reason::ALL
            .iter()
            .map(|&r| {
                let per_cpu = self
                    .reasons
                    .get(&(r as u32), 0)
                    .map_err(in_map(map_names::REASONS))?;
                let mut sum = Counter::default();
                for c in per_cpu.iter() {
                    sum.packets += c.packets;
                    sum.bytes += c.bytes;
                }
                Ok((r, sum))
            })
            .collect()
    }
}

fn sum_traffic(per_cpu: &PerCpuValues<PeerTraffic>) -> PeerTraffic {
    let mut sum = PeerTraffic::default();
    for t in per_cpu.iter() {
        sum.accumulate(t);
    }
    sum
}
