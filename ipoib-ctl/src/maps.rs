//! Typed access to the fast path's maps, from a freshly loaded object or from pins.

use std::path::{Path, PathBuf};

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuValues},
};
use ipoib_common::{
    Counter, Heartbeat, MAX_TRAFFIC_PEERS, PEER_CACHE_SLOTS, PeerCacheSlot, PeerEntry, PeerKey,
    PeerTraffic, Policy, REASON_COUNT, Reason, map_names, peer_cache, peer_mode, peer_pin,
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
    #[error("counting the possible CPUs: {0}")]
    Cpus(#[source] std::io::Error),
    #[error("the maps of program {path}: {source}")]
    ProgramMaps {
        path: String,
        #[source]
        source: aya::programs::ProgramError,
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

/// The six maps of the fast path; see `ipoib_common::map_names` for what each holds.
pub struct DatapathMaps {
    pub policy: Array<MapData, Policy>,
    pub heartbeat: Array<MapData, Heartbeat>,
    pub peers: HashMap<MapData, PeerKey, PeerEntry>,
    pub traffic: PerCpuArray<MapData, PeerTraffic>,
    pub unknown: HashMap<MapData, PeerKey, PeerTraffic>,
    pub reasons: PerCpuArray<MapData, Counter>,
}

/// What [`DatapathMaps::assign_slots`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotReport {
    /// Peers given a traffic slot (their counts so far carried into it).
    pub assigned: usize,
    /// Entries removed: UD, unpinned, silent for longer than the idle limit.
    pub reclaimed: usize,
    /// Peers left counted apart: no slot was free.
    pub waiting: usize,
    /// Slots in use afterwards.
    pub in_use: usize,
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

/// What the fast path's per-CPU peer cache answered since its programs were loaded, summed over
/// its slots and every CPU (the counts of `PeerCacheSlot`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerCacheCounts {
    pub hits: u64,
    /// The slot held the peer under an older heartbeat (a write to the peers map, or a beat).
    pub misses_stale: u64,
    /// The slot was empty or held another peer.
    pub misses_other: u64,
    /// Slots holding an answer now, over every CPU.
    pub slots_filled: u64,
}

impl PeerCacheCounts {
    fn add(&mut self, s: &PeerCacheSlot) {
        self.hits = self.hits.saturating_add(s.hits);
        self.misses_stale = self.misses_stale.saturating_add(s.misses_stale);
        self.misses_other = self.misses_other.saturating_add(s.misses_other);
        self.slots_filled += u64::from(s.state != peer_cache::EMPTY);
    }

    /// Every lookup of the peers map's answers the programs made.
    pub fn lookups(&self) -> u64 {
        self.hits
            .saturating_add(self.misses_stale)
            .saturating_add(self.misses_other)
    }

    /// The share of lookups the cache answered, in percent (None before the first lookup).
    pub fn hit_percent(&self) -> Option<f64> {
        let n = self.lookups();
        (n > 0).then(|| self.hits as f64 * 100.0 / n as f64)
    }
}

/// The peer cache of the loaded program `prog` (the egress program's object holds the one
/// cache both programs use), found among the program's maps by name: it is not pinned.
/// `None` when the program has no cache that counts (a build from before the counts: same pins
/// and layout, a smaller slot).
pub fn peer_cache_of(
    prog: &aya::programs::ProgramInfo,
    path: &str,
) -> Result<Option<PeerCacheCounts>> {
    let in_prog = |source| MapsError::ProgramMaps {
        path: path.to_owned(),
        source,
    };
    for id in prog.map_ids().map_err(in_prog)?.unwrap_or_default() {
        let Ok(data) = MapData::from_id(id) else {
            // Freed since the program's list was read: not the cache the program holds.
            continue;
        };
        let info = data.info().map_err(in_map(map_names::PEER_CACHE))?;
        if info.name_as_str() != Some(map_names::PEER_CACHE) {
            continue;
        }
        if info.value_size() as usize != size_of::<PeerCacheSlot>() {
            return Ok(None);
        }
        let cache: PerCpuArray<MapData, PeerCacheSlot> = typed(
            map_names::PEER_CACHE,
            Map::from_map_data(data).map_err(in_map(map_names::PEER_CACHE))?,
        )?;
        let mut counts = PeerCacheCounts::default();
        for i in 0..PEER_CACHE_SLOTS {
            let per_cpu = cache.get(&i, 0).map_err(in_map(map_names::PEER_CACHE))?;
            per_cpu.iter().for_each(|s| counts.add(s));
        }
        return Ok(Some(counts));
    }
    Ok(None)
}

/// [`peer_cache_of`] the program pinned at `prog_pin`.
pub fn peer_cache_pinned(prog_pin: &Path) -> Result<Option<PeerCacheCounts>> {
    let path = prog_pin.display().to_string();
    match aya::programs::ProgramInfo::from_pin(prog_pin) {
        Ok(info) => peer_cache_of(&info, &path),
        Err(source) => Err(MapsError::ProgramMaps { path, source }),
    }
}

/// The peers map and every peer's traffic, read together by
/// [`DatapathMaps::peers_and_traffic`].
#[derive(Debug, Default)]
pub struct PeersRead {
    pub entries: Vec<(PeerKey, PeerEntry)>,
    pub traffic: Vec<(PeerKey, PeerTraffic)>,
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
            unknown: typed(map_names::UNKNOWN, take(map_names::UNKNOWN)?)?,
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
            unknown: typed(map_names::UNKNOWN, open(map_names::UNKNOWN)?)?,
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

    /// Stamps the heartbeat the fast path's fail-safe reads. `peers_stamp` goes back to 0:
    /// the new `monotonic_ns` alone makes the heartbeat one the peer cache has not seen.
    pub fn beat(&mut self, monotonic_ns: u64) -> Result<()> {
        let hb = Heartbeat {
            monotonic_ns,
            writer_pid: std::process::id(),
            peers_stamp: 0,
        };
        self.heartbeat
            .set(0, hb, 0)
            .map_err(in_map(map_names::HEARTBEAT))
    }

    pub fn set_peer(&mut self, key: PeerKey, entry: PeerEntry) -> Result<()> {
        self.peers
            .insert(key, entry, 0)
            .map_err(in_map(map_names::PEERS))?;
        self.peers_changed()
    }

    /// Tells the fast path that the peers map changed, after every write to it: a new
    /// `peers_stamp` in the heartbeat, its other fields as they are (a write to the peers
    /// map is no sign of life: the fail-safe must not hear one). The programs' per-CPU cache
    /// of peer entries holds only while the heartbeat is unchanged. The stamp is the clock's
    /// low bits, so two writers at once (the loop, a `set-policy`) leave different stamps.
    fn peers_changed(&mut self) -> Result<()> {
        let hb = self.heartbeat()?;
        let mut stamp = crate::clock::monotonic_ns() as u32;
        if stamp == hb.peers_stamp {
            stamp = stamp.wrapping_add(1);
        }
        self.heartbeat
            .set(
                0,
                Heartbeat {
                    peers_stamp: stamp,
                    ..hb
                },
                0,
            )
            .map_err(in_map(map_names::HEARTBEAT))
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
            Ok(()) => self.peers_changed(),
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

    /// The traffic counted at `slot`, summed over CPUs.
    fn slot_traffic(&self, slot: u32) -> Result<PeerTraffic> {
        self.traffic
            .get(&slot, 0)
            .map(|v| sum_traffic(&v))
            .map_err(in_map(map_names::TRAFFIC))
    }

    /// What the unknown map holds for `key`, if anything.
    fn unknown_of(&self, key: &PeerKey) -> Result<Option<PeerTraffic>> {
        match self.unknown.get(key, 0) {
            Ok(t) => Ok(Some(t)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(in_map(map_names::UNKNOWN)(e)),
        }
    }

    /// One peer's traffic, summed over CPUs: at its slot, or counted apart while it has
    /// none; `None` when the fast path has not seen it.
    pub fn traffic_of(&self, key: &PeerKey) -> Result<Option<PeerTraffic>> {
        match self.peer(key)? {
            Some(e) if e.traffic_slot != 0 => Ok(Some(self.slot_traffic(e.traffic_slot)?)),
            _ => self.unknown_of(key),
        }
    }

    /// Every entry, and every peer's traffic summed over CPUs (those with a slot, then those
    /// counted apart), read in the order that suits a reader beside the control loop
    /// (`status`, another process): the peers counted apart first, then the entries. The
    /// loop moves a peer to its slot by writing the entry, then removing it from the unknown
    /// map (`give_slot`), so a peer moved meanwhile is found in one or the other; the other
    /// order can miss it (seen: `a_peer_given_its_slot_while_status_reads_is_never_missing`,
    /// and a peer gone from status between two reads in a CI run).
    pub fn peers_and_traffic(&self) -> Result<PeersRead> {
        let apart = self.counted_apart()?;
        let entries = self.peers()?;
        let traffic = self.with_slot_traffic(&entries, apart)?;
        Ok(PeersRead { entries, traffic })
    }

    /// Every peer's traffic, with the peers map as the caller already read it (one
    /// pass over it serves a caller that needs the entries too). For the control loop's own
    /// use, between its writes; a reader beside it wants [`DatapathMaps::peers_and_traffic`].
    pub fn traffic_of_peers(
        &self,
        peers: &[(PeerKey, PeerEntry)],
    ) -> Result<Vec<(PeerKey, PeerTraffic)>> {
        self.with_slot_traffic(peers, self.counted_apart()?)
    }

    /// The peers counted apart (no slot yet) and their traffic.
    fn counted_apart(&self) -> Result<Vec<(PeerKey, PeerTraffic)>> {
        self.unknown
            .iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(in_map(map_names::UNKNOWN))
    }

    /// The traffic at the slots `peers` name, then what `apart` holds for the others.
    fn with_slot_traffic(
        &self,
        peers: &[(PeerKey, PeerEntry)],
        apart: Vec<(PeerKey, PeerTraffic)>,
    ) -> Result<Vec<(PeerKey, PeerTraffic)>> {
        let mut all = Vec::new();
        let mut slotted = std::collections::HashSet::new();
        for (k, e) in peers {
            if e.traffic_slot != 0 {
                all.push((*k, self.slot_traffic(e.traffic_slot)?));
                slotted.insert(*k);
            }
        }
        all.extend(apart.into_iter().filter(|(k, _)| !slotted.contains(k)));
        Ok(all)
    }

    /// Gives every peer counted apart a traffic slot (its counts so far carried into it),
    /// and takes back the entries that hold nothing any more: UD and unpinned, and idle past
    /// `idle_limit_ns` (or with no slot and no traffic). Stateless: the free slots are those
    /// no entry names, so a slot lost to another writer (set-policy rewriting an entry it
    /// read before) comes back, and one named twice is kept by one entry only. `now_ns` is
    /// the fast path's clock (CLOCK_MONOTONIC).
    pub fn assign_slots(&mut self, now_ns: u64, idle_limit_ns: u64) -> Result<SlotReport> {
        let mut report = SlotReport::default();
        let waiting: std::collections::BTreeSet<PeerKey> = self
            .unknown
            .keys()
            .collect::<std::result::Result<_, _>>()
            .map_err(in_map(map_names::UNKNOWN))?;
        let mut used = vec![false; MAX_TRAFFIC_PEERS as usize];
        used[0] = true;
        for (k, e) in self.peers()? {
            let slot = e.traffic_slot as usize;
            let holds_nothing = e.mode == peer_mode::UD && e.pin == peer_pin::AUTO;
            if slot == 0 || slot >= used.len() {
                if holds_nothing && !waiting.contains(&k) {
                    self.remove_peer(&k)?;
                    report.reclaimed += 1;
                }
                continue;
            }
            if used[slot] {
                // Named twice: this one counts apart until it gets a slot of its own.
                self.set_peer(
                    k,
                    PeerEntry {
                        traffic_slot: 0,
                        ..e
                    },
                )?;
                continue;
            }
            let t = self.slot_traffic(e.traffic_slot)?;
            if holds_nothing && now_ns.saturating_sub(t.last_seen_ns) > idle_limit_ns {
                self.remove_peer(&k)?;
                report.reclaimed += 1;
                continue;
            }
            used[slot] = true;
        }
        let in_use = used.iter().filter(|u| **u).count() - 1;
        let mut free = (1..used.len()).filter(|s| !used[*s]);
        let ncpus = aya::util::nr_cpus().map_err(|(_, e)| MapsError::Cpus(e))?;
        for k in waiting {
            let Some(slot) = free.next() else {
                report.waiting += 1;
                continue;
            };
            self.give_slot(k, slot as u32, ncpus)?;
            report.assigned += 1;
        }
        report.in_use = in_use + report.assigned;
        Ok(report)
    }

    /// `key` counts at `slot` from now, which starts with what the unknown map holds for it
    /// (in one CPU's copy; the others at zero); its entry there goes. The counts are read
    /// again here, not taken from the pass that found the peer: what the fast path counts
    /// apart between that read and the switch to the slot is lost, so the read is kept two
    /// map calls from the switch, not a pass over every peer (seen: a ping counted 19 of 20
    /// at a peer's first slot in the VM). Exact would need a place the fast path never
    /// writes for the counts carried (as the reasons map has), a change of layout.
    fn give_slot(&mut self, key: PeerKey, slot: u32, ncpus: usize) -> Result<()> {
        let entry = self.peer(&key)?.unwrap_or_default();
        let so_far = self.unknown_of(&key)?.unwrap_or_default();
        let mut values = vec![PeerTraffic::default(); ncpus];
        values[0] = so_far;
        let values = PerCpuValues::try_from(values).map_err(MapsError::Cpus)?;
        self.traffic
            .set(slot, values, 0)
            .map_err(in_map(map_names::TRAFFIC))?;
        self.set_peer(
            key,
            PeerEntry {
                traffic_slot: slot,
                ..entry
            },
        )?;
        match self.unknown.remove(&key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(in_map(map_names::UNKNOWN)(e)),
        }
    }

    /// Packets and bytes per reason, summed over CPUs, in `Reason::ALL` order.
    pub fn reasons(&self) -> Result<Vec<(Reason, Counter)>> {
        Reason::ALL
            .iter()
            .map(|&r| {
                let mut sum = Counter::default();
                // Counted here, then carried from the attachment this one replaced.
                for i in [r as u32, r as u32 + REASON_COUNT] {
                    let per_cpu = self
                        .reasons
                        .get(&i, 0)
                        .map_err(in_map(map_names::REASONS))?;
                    for c in per_cpu.iter() {
                        sum.packets += c.packets;
                        sum.bytes += c.bytes;
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(state: u32, hits: u64, misses_stale: u64, misses_other: u64) -> PeerCacheSlot {
        PeerCacheSlot {
            hb_ns: 0,
            hb_peers_stamp: 0,
            state,
            key: PeerKey::v4([10, 0, 0, 2]),
            entry: PeerEntry::default(),
            _pad: [0; 4],
            hits,
            misses_stale,
            misses_other,
        }
    }

    #[test]
    fn cache_counts_sum_every_slot_and_count_the_filled_ones() {
        let mut c = PeerCacheCounts::default();
        assert_eq!((c.lookups(), c.hit_percent()), (0, None));
        c.add(&slot(peer_cache::FOUND, 97, 1, 2));
        c.add(&slot(peer_cache::ABSENT, 0, 0, 1));
        // A slot never filled counts nothing and is not filled.
        c.add(&slot(peer_cache::EMPTY, 0, 0, 0));
        assert_eq!(
            c,
            PeerCacheCounts {
                hits: 97,
                misses_stale: 1,
                misses_other: 3,
                slots_filled: 2,
            }
        );
        assert_eq!(c.lookups(), 101);
        let pct = c.hit_percent().unwrap();
        assert!((pct - 9700.0 / 101.0).abs() < 1e-9, "{pct}");
        // Counts near the top saturate rather than wrap.
        c.add(&slot(peer_cache::FOUND, u64::MAX, 0, 0));
        assert_eq!((c.hits, c.lookups()), (u64::MAX, u64::MAX));
    }
}
