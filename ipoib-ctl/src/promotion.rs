//! Who gets a CM connection: promotion, demotion, reaping and fallback, as pure logic.
//!
//! The engine feeds in what it sees (per-peer traffic counters, connection outcomes) with the
//! time, and takes back [`Action`]s to carry out. Nothing here does I/O or reads a clock: the
//! same code runs in the engine, the unit tests and the simulation (`promotion_sim.rs`).
//!
//! The rules, in the order [`Promoter::tick`] applies them:
//! 1. **Demote** a live connection when the mode is `datagram`, the peer is pinned to UD or
//!    blocked, or it has moved nothing for `idle_after` (and has lived at least `min_hold`:
//!    hysteresis, a fresh connection is not reaped before it had a chance). A peer pinned to
//!    CM is never reaped for idleness.
//! 2. **Retry after failure**: a REJ, a timeout or a QP error sends the peer to UD for a
//!    backoff that doubles with each failure in a row (`backoff_initial` .. `backoff_max`);
//!    a connection that lived `min_hold` clears the count.
//! 3. **Promote** the peers worth it, best first, while the plan has room and the setup rate
//!    allows (a token bucket, `setups_per_sec` with a burst of `setup_burst`): pinned-CM peers
//!    first; then, in mode `auto` on a UD path that builds every datagram in the CPU
//!    ([`UdPath::PerPacket`]), peers whose bulk transmit rate (bytes/s of packets averaging
//!    at least `min_mean_packet` bytes, smoothed) reaches `promote_rate` (on a UD path that
//!    segments in the HCA, [`UdPath::Offloaded`], none: see there); in mode `connected`,
//!    every peer that sent anything within `idle_after`. A peer demoted by us waits
//!    `min_hold` before it can be promoted again (no flapping).
//! 4. **Make room** when the plan is full: the least recently active connection is evicted
//!    for a candidate whose rate is more than twice its own, if it has lived `min_hold` and is
//!    not pinned. The candidate gets the slot once the eviction completes. A candidate whose
//!    last setup failed takes only free slots: a peer that never answers evicts nobody.

use std::{collections::BTreeMap, fmt, time::Duration};

use ipoib_common::PeerPin;

use crate::policy::Mode;

mod failure;
pub use failure::Failure;

/// The knobs, with defaults that need no configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Bulk transmit rate (bytes/s) that makes a peer worth a connection in mode `auto`.
    pub promote_rate: f64,
    /// Mean packet size (bytes) over a sample for its bytes to count as bulk.
    pub min_mean_packet: u64,
    /// A connection that moved nothing this long is reaped.
    pub idle_after: Duration,
    /// The least life of a connection before it is reaped or evicted, and the wait after a
    /// demotion before the peer can be promoted again.
    pub min_hold: Duration,
    /// Connection setups started per second, at most, and the burst allowed.
    pub setups_per_sec: f64,
    pub setup_burst: f64,
    /// Backoff after the first failure in a row, doubled per failure up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Weight of the newest sample in the smoothed rate (0..=1).
    pub smoothing: f64,
    /// Most connections at once (the memory plan's `max_cm_peers`); draining ones count.
    pub max_connections: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            promote_rate: 4.0 * 1024.0 * 1024.0,
            min_mean_packet: u64::from(ipoib_common::DEFAULT_CM_MIN_BYTES),
            idle_after: Duration::from_secs(30),
            min_hold: Duration::from_secs(10),
            setups_per_sec: 50.0,
            setup_burst: 16.0,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            smoothing: 0.5,
            max_connections: 0,
        }
    }
}

/// Cumulative counters of one peer, as the fast path and the engine count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sample {
    /// Everything sent to the peer (UD and CM), packets and L3 bytes.
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Bytes moved over the peer's connection, both directions.
    pub cm_bytes: u64,
}

/// Why we take a connection down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demotion {
    Datagram,
    Pinned,
    Idle,
    Evicted,
    Forgotten,
    /// The plan shrank below the connections held (policy `max-connections` lowered).
    OverPlan,
}

/// What the engine is to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<K> {
    /// Set up a connection (the peer's map entry goes CmPending, then CmUp once established).
    Connect(K),
    /// Mark the peer UD in the map, then tear its connection down; report [`Promoter::closed`].
    Disconnect(K, Demotion),
}

/// Where a peer is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum State {
    /// On UD; `hold_until`: not promoted again before (after a demotion by us).
    Ud {
        hold_until: u64,
    },
    Connecting {
        since: u64,
    },
    Up {
        since: u64,
    },
    /// Disconnect asked for, not yet reported closed: still holds its resources.
    Draining {
        since: u64,
        why: Demotion,
    },
    /// On UD after a failure, not retried before `until`.
    Backoff {
        until: u64,
        last: Failure,
    },
}

/// How the interface's UD path carries bulk traffic, which decides whether mode `auto` moves
/// a busy peer to CM: where the CPU builds every datagram the engine's hop costs less per
/// byte, where the device segments it costs more (`bench hop`, docs/benchmarks.md), so no
/// rate makes a connection worth it there. Mode `connected` and a pin still give CM.
/// In the CM status by its [`fmt::Display`] name (`per-packet`, `offloaded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UdPath {
    /// The CPU builds every datagram (no segmentation offload).
    #[default]
    PerPacket,
    /// The device segments (TSO on the interface).
    Offloaded,
}

impl UdPath {
    /// From whether the interface has segmentation offload (TSO) on.
    pub fn of_tso(tso: bool) -> Self {
        if tso {
            Self::Offloaded
        } else {
            Self::PerPacket
        }
    }

    /// What the path is and what it means for mode `auto`, as the log and `status` say it.
    pub fn effect(self) -> &'static str {
        match self {
            Self::PerPacket => "every datagram built by the CPU: mode auto promotes busy peers",
            Self::Offloaded => {
                "the device segments (TSO): mode auto promotes no peer by its rate \
                 (mode=connected or a pin gives CM)"
            }
        }
    }
}

impl fmt::Display for UdPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PerPacket => "per-packet",
            Self::Offloaded => "offloaded",
        })
    }
}

/// Why a peer on UD is there (for status).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UdWhy {
    BelowThreshold,
    /// Mode `auto` on a UD path that segments in the device: CM would not pay.
    UdOffloaded,
    ModeDatagram,
    Pinned,
    Hold,
    PlanFull,
    SetupRate,
    NoPlan,
}

#[derive(Debug, Clone)]
struct Peer {
    pin: PeerPin,
    state: State,
    last: Option<(u64, Sample)>,
    /// Smoothed bulk transmit rate, bytes/s.
    rate: f64,
    /// When it last moved bulk data (or any, in mode `connected`), or over its connection.
    last_active: Option<u64>,
    failures: u32,
    /// The last of the `failures` and when it came: kept through the retry, so status says
    /// why the peer is not on CM while the next setup runs.
    last_failure: Option<(u64, Failure)>,
    why: UdWhy,
    /// Connections set up for this peer, over its life (flap count).
    promotions: u64,
}

impl Peer {
    fn new() -> Self {
        Self {
            pin: PeerPin::Auto,
            state: State::Ud { hold_until: 0 },
            last: None,
            rate: 0.0,
            last_active: None,
            failures: 0,
            last_failure: None,
            why: UdWhy::BelowThreshold,
            promotions: 0,
        }
    }

    /// Holds connection resources (counts against the plan).
    fn holds(&self) -> bool {
        matches!(
            self.state,
            State::Connecting { .. } | State::Up { .. } | State::Draining { .. }
        )
    }
}

/// What status shows of one peer.
#[derive(Debug, Clone, PartialEq)]
pub struct Explain {
    pub state: State,
    pub pin: PeerPin,
    pub rate: f64,
    pub failures: u32,
    /// While `failures` counts any: the last one, and how long ago it came.
    pub last_failure: Option<LastFailure>,
    pub promotions: u64,
    /// For a peer on UD (not in backoff): why it is not on CM.
    pub why: Option<UdWhy>,
}

/// The last failure of a peer's run of failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastFailure {
    pub why: Failure,
    pub ago: Duration,
}

impl fmt::Display for Explain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = self.rate / 1e6;
        match self.state {
            State::Up { .. } => write!(f, "cm: connected ({rate:.1} MB/s bulk)"),
            State::Connecting { .. } => match self.last_failure {
                Some(l) => write!(
                    f,
                    "ud: connecting (last failure {} s ago: {}; {} failure(s))",
                    l.ago.as_secs(),
                    l.why,
                    self.failures
                ),
                None => write!(f, "ud: connecting"),
            },
            State::Draining { why, .. } => write!(f, "ud: closing ({why:?})"),
            State::Backoff { last, .. } => write!(
                f,
                "ud: retry after {last} ({} failure(s) in a row)",
                self.failures
            ),
            State::Ud { .. } => {
                let why = match self.why.unwrap_or(UdWhy::BelowThreshold) {
                    UdWhy::BelowThreshold => "traffic below the CM threshold",
                    UdWhy::UdOffloaded => {
                        "UD segments in the device here (CM only for mode=connected or a pin)"
                    }
                    UdWhy::ModeDatagram => "mode=datagram",
                    UdWhy::Pinned => "pinned to UD",
                    UdWhy::Hold => "recently demoted (hold)",
                    UdWhy::PlanFull => "memory plan full",
                    UdWhy::SetupRate => "setup rate limit",
                    UdWhy::NoPlan => "no connected mode in the plan",
                };
                write!(f, "ud: {why} ({rate:.1} MB/s bulk)")
            }
        }
    }
}

/// Counts by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub ud: usize,
    pub connecting: usize,
    pub up: usize,
    pub draining: usize,
    pub backoff: usize,
}

impl Counts {
    /// Connections holding resources.
    pub fn held(&self) -> usize {
        self.connecting + self.up + self.draining
    }
}

/// A peer on UD worth a connection, as [`Promoter::tick`] ranks it.
struct Candidate<K> {
    key: K,
    pinned: bool,
    rate: f64,
    may_evict: bool,
}

/// The decision state of one interface. Times are monotonic nanoseconds.
pub struct Promoter<K> {
    cfg: Config,
    mode: Mode,
    ud_path: UdPath,
    peers: BTreeMap<K, Peer>,
    tokens: f64,
    last_tick: Option<u64>,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl<K: Ord + Clone> Promoter<K> {
    pub fn new(cfg: Config, mode: Mode) -> Self {
        Self {
            tokens: cfg.setup_burst,
            cfg,
            mode,
            ud_path: UdPath::default(),
            peers: BTreeMap::new(),
            last_tick: None,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Takes effect at the next tick (mode `datagram` drains every connection).
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    pub fn ud_path(&self) -> UdPath {
        self.ud_path
    }

    /// Takes effect at the next tick: promotions by rate in mode `auto` stop or start;
    /// connections up stay until idle (the traffic they carry is not lost by keeping them).
    pub fn set_ud_path(&mut self, ud_path: UdPath) {
        self.ud_path = ud_path;
    }

    /// A new plan size. When it is below the connections held, the next tick closes the
    /// least recently active ones (never a pinned one) down to it.
    pub fn set_max_connections(&mut self, n: usize) {
        self.cfg.max_connections = n;
    }

    pub fn set_pin(&mut self, key: K, pin: PeerPin) {
        self.peers.entry(key).or_insert_with(Peer::new).pin = pin;
    }

    /// New cumulative counters of a peer. A counter that went backwards (the entry was made
    /// anew) starts a new baseline.
    pub fn observe(&mut self, now: u64, key: K, s: Sample) {
        let cfg = &self.cfg;
        let p = self.peers.entry(key).or_insert_with(Peer::new);
        if let Some((t0, s0)) = p.last
            && now > t0
            && s.tx_bytes >= s0.tx_bytes
            && s.tx_packets >= s0.tx_packets
            && s.cm_bytes >= s0.cm_bytes
        {
            let (db, dp) = (s.tx_bytes - s0.tx_bytes, s.tx_packets - s0.tx_packets);
            let bulk = if dp > 0 && db / dp >= cfg.min_mean_packet {
                db
            } else {
                0
            };
            let inst = bulk as f64 / ((now - t0) as f64 / 1e9);
            p.rate = cfg.smoothing * inst + (1.0 - cfg.smoothing) * p.rate;
            let moved = s.cm_bytes > s0.cm_bytes;
            let sent = db > 0 && (bulk > 0 || self.mode == Mode::Connected);
            if moved || sent {
                p.last_active = Some(now);
            }
        }
        p.last = Some((now, s));
    }

    /// The peer is gone (its neighbour entry expired): a connection is taken down, and the
    /// peer is dropped once it holds nothing.
    pub fn forget(&mut self, now: u64, key: &K) -> Option<Action<K>> {
        let p = self.peers.get_mut(key)?;
        match p.state {
            State::Up { .. } => {
                p.state = State::Draining {
                    since: now,
                    why: Demotion::Forgotten,
                };
                Some(Action::Disconnect(key.clone(), Demotion::Forgotten))
            }
            State::Connecting { .. } | State::Draining { .. } => None,
            _ => {
                self.peers.remove(key);
                None
            }
        }
    }

    /// The connection asked for is established.
    pub fn connected(&mut self, now: u64, key: &K) {
        if let Some(p) = self.peers.get_mut(key)
            && matches!(p.state, State::Connecting { .. })
        {
            p.state = State::Up { since: now };
            p.last_active = Some(now);
        }
    }

    /// The peer set up a connection to us (the passive side). Returns false when it is not
    /// to be kept (the caller closes it): the peer already has one, policy keeps it on UD
    /// (mode=datagram, a UD or block pin), or the plan is full. A peer we are connecting to
    /// whose REQ won the crossing ends up here too, its own slot already counted.
    pub fn accepted(&mut self, now: u64, key: K) -> bool {
        let mode = self.mode;
        let others = self
            .peers
            .iter()
            .filter(|(k, p)| **k != key && p.holds())
            .count();
        let max = self.cfg.max_connections;
        let p = self.peers.entry(key).or_insert_with(Peer::new);
        if mode == Mode::Datagram || matches!(p.pin, PeerPin::Ud | PeerPin::Block) || others >= max
        {
            return false;
        }
        match p.state {
            State::Up { .. } | State::Draining { .. } => false,
            State::Connecting { .. } | State::Ud { .. } | State::Backoff { .. } => {
                p.state = State::Up { since: now };
                p.last_active = Some(now);
                true
            }
        }
    }

    /// A setup failed, or a live connection broke (QP error, peer gone). The peer is on UD
    /// until its backoff ends.
    pub fn failed(&mut self, now: u64, key: &K, why: Failure) {
        let cfg = &self.cfg;
        if let Some(p) = self.peers.get_mut(key) {
            if let State::Up { since } = p.state
                && now.saturating_sub(since) >= ns(cfg.min_hold)
            {
                // It worked for a while: this is a new run of failures.
                p.failures = 0;
            }
            p.failures = p.failures.saturating_add(1);
            p.last_failure = Some((now, why));
            let shift = (p.failures - 1).min(20);
            let backoff = ns(cfg.backoff_initial)
                .saturating_mul(1 << shift)
                .min(ns(cfg.backoff_max));
            p.state = State::Backoff {
                until: now + backoff,
                last: why,
            };
        }
    }

    /// A connection ended without error: after our Disconnect, or closed by the peer.
    pub fn closed(&mut self, now: u64, key: &K) {
        let hold = ns(self.cfg.min_hold);
        if let Some(p) = self.peers.get_mut(key) {
            match p.state {
                State::Draining { why, .. } => {
                    if why == Demotion::Forgotten {
                        self.peers.remove(key);
                        return;
                    }
                    p.failures = 0;
                    p.last_failure = None;
                    p.state = State::Ud {
                        hold_until: now + hold,
                    };
                }
                State::Up { .. } | State::Connecting { .. } => {
                    p.state = State::Ud {
                        hold_until: now + hold,
                    }
                }
                _ => {}
            }
        }
    }

    /// Applies the rules (module docs) at time `now` and returns what to do.
    pub fn tick(&mut self, now: u64) -> Vec<Action<K>> {
        let dt = self.last_tick.map_or(0, |t| now.saturating_sub(t));
        self.last_tick = Some(now);
        let cfg = &self.cfg;
        self.tokens =
            (self.tokens + cfg.setups_per_sec * dt as f64 / 1e9).min(cfg.setup_burst.max(1.0));
        let mut actions = Vec::new();
        self.demote(now, &mut actions);
        self.shed_over_plan(now, &mut actions);
        let candidates = self.candidates(now);
        self.promote(now, candidates, &mut actions);
        actions
    }

    /// 1. Demotions; 2. backoffs that ended.
    fn demote(&mut self, now: u64, actions: &mut Vec<Action<K>>) {
        let (cfg, mode) = (&self.cfg, self.mode);
        for (k, p) in self.peers.iter_mut() {
            match p.state {
                State::Up { since } => {
                    let why = if mode == Mode::Datagram {
                        Some(Demotion::Datagram)
                    } else if matches!(p.pin, PeerPin::Ud | PeerPin::Block) {
                        Some(Demotion::Pinned)
                    } else if p.pin != PeerPin::Cm
                        && now.saturating_sub(p.last_active.unwrap_or(0)) >= ns(cfg.idle_after)
                        && now.saturating_sub(since) >= ns(cfg.min_hold)
                    {
                        Some(Demotion::Idle)
                    } else {
                        None
                    };
                    if let Some(why) = why {
                        p.state = State::Draining { since: now, why };
                        actions.push(Action::Disconnect(k.clone(), why));
                    }
                }
                State::Backoff { until, .. } if now >= until => {
                    p.state = State::Ud { hold_until: 0 };
                }
                _ => {}
            }
        }
    }

    /// The plan shrank: shed the least recently active connections down to it.
    fn shed_over_plan(&mut self, now: u64, actions: &mut Vec<Action<K>>) {
        let up = |p: &Peer| matches!(p.state, State::Up { .. } | State::Connecting { .. });
        let held = self.peers.values().filter(|p| up(p)).count();
        let mut excess = held.saturating_sub(self.cfg.max_connections);
        if excess == 0 {
            return;
        }
        let mut victims: Vec<(Option<u64>, K)> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p.state, State::Up { .. }) && p.pin != PeerPin::Cm)
            .map(|(k, p)| (p.last_active, k.clone()))
            .collect();
        victims.sort();
        for (_, k) in victims {
            if excess == 0 {
                break;
            }
            excess -= 1;
            self.drain(now, &k, Demotion::OverPlan);
            actions.push(Action::Disconnect(k, Demotion::OverPlan));
        }
    }

    fn drain(&mut self, now: u64, key: &K, why: Demotion) {
        if let Some(p) = self.peers.get_mut(key) {
            p.state = State::Draining { since: now, why };
        }
    }

    /// Rule 3: the peers on UD worth a connection, best first. Every other peer on UD gets
    /// its reason.
    fn candidates(&mut self, now: u64) -> Vec<Candidate<K>> {
        let (cfg, mode) = (&self.cfg, self.mode);
        let by_rate = self.ud_path == UdPath::PerPacket;
        let idle = ns(cfg.idle_after);
        let mut candidates = Vec::new();
        for (k, p) in self.peers.iter_mut() {
            let State::Ud { hold_until } = p.state else {
                continue;
            };
            let pinned = p.pin == PeerPin::Cm;
            let worth = pinned
                || match mode {
                    Mode::Auto => by_rate && p.rate >= cfg.promote_rate,
                    Mode::Connected => p.last_active.is_some_and(|t| now.saturating_sub(t) < idle),
                    Mode::Datagram => false,
                };
            p.why = if mode == Mode::Datagram {
                UdWhy::ModeDatagram
            } else if matches!(p.pin, PeerPin::Ud | PeerPin::Block) {
                UdWhy::Pinned
            } else if !worth && mode == Mode::Auto && !by_rate {
                UdWhy::UdOffloaded
            } else if !worth {
                UdWhy::BelowThreshold
            } else if now < hold_until && !pinned {
                UdWhy::Hold
            } else if cfg.max_connections == 0 {
                UdWhy::NoPlan
            } else {
                // A peer whose last setup failed takes only free slots, so a peer that never
                // answers cannot churn the others out.
                candidates.push(Candidate {
                    key: k.clone(),
                    pinned,
                    rate: p.rate,
                    may_evict: p.failures == 0,
                });
                continue;
            };
        }
        candidates.sort_by(|a, b| b.pinned.cmp(&a.pinned).then(b.rate.total_cmp(&a.rate)));
        candidates
    }

    /// Connects the candidates while the plan has room and the setup rate allows; 4. makes
    /// room by eviction when the plan is full.
    fn promote(&mut self, now: u64, candidates: Vec<Candidate<K>>, actions: &mut Vec<Action<K>>) {
        let max = self.cfg.max_connections;
        let mut held = self.peers.values().filter(|p| p.holds()).count();
        // Slots on their way back: a candidate waits for one before anything more is evicted.
        let mut freeing = self
            .peers
            .values()
            .filter(|p| matches!(p.state, State::Draining { .. }))
            .count();
        // Made once, at the first candidate that may evict: one pass over the peers per tick,
        // not one per waiting candidate.
        let mut evictable = None;
        for c in candidates {
            let why = if held >= max && (freeing > 0 || !c.may_evict) {
                freeing = freeing.saturating_sub(1);
                UdWhy::PlanFull
            } else if held >= max {
                let victims = evictable.get_or_insert_with(|| self.evictable(now));
                if let Some(vk) = Self::victim(victims, c.pinned, c.rate) {
                    self.drain(now, &vk, Demotion::Evicted);
                    actions.push(Action::Disconnect(vk, Demotion::Evicted));
                }
                UdWhy::PlanFull
            } else if self.tokens < 1.0 {
                UdWhy::SetupRate
            } else {
                self.tokens -= 1.0;
                held += 1;
                let p = self.peers.get_mut(&c.key).expect("candidate");
                p.state = State::Connecting { since: now };
                p.promotions += 1;
                actions.push(Action::Connect(c.key));
                continue;
            };
            self.peers.get_mut(&c.key).expect("candidate").why = why;
        }
    }

    /// The connections that may be evicted (held `min_hold`, not pinned), least recently
    /// active first (ties in key order), with their rates.
    fn evictable(&self, now: u64) -> Vec<(f64, K)> {
        let hold = ns(self.cfg.min_hold);
        let mut v: Vec<(Option<u64>, f64, K)> = self
            .peers
            .iter()
            .filter(|(_, p)| {
                matches!(p.state, State::Up { since } if now.saturating_sub(since) >= hold)
                    && p.pin == PeerPin::Auto
            })
            .map(|(k, p)| (p.last_active, p.rate, k.clone()))
            .collect();
        v.sort_by_key(|(active, _, _)| *active);
        v.into_iter().map(|(_, rate, k)| (rate, k)).collect()
    }

    /// Takes from `evictable` the first connection that may be evicted for a candidate of
    /// `rate` (or a pinned one): less than half as busy.
    fn victim(evictable: &mut Vec<(f64, K)>, pinned: bool, rate: f64) -> Option<K> {
        let i = evictable
            .iter()
            .position(|(r, _)| pinned || r * 2.0 < rate)?;
        Some(evictable.remove(i).1)
    }

    /// What status shows of a peer, at `now`.
    pub fn explain(&self, now: u64, key: &K) -> Option<Explain> {
        self.peers.get(key).map(|p| Explain {
            state: p.state,
            pin: p.pin,
            rate: p.rate,
            failures: p.failures,
            last_failure: p.last_failure.map(|(at, why)| LastFailure {
                why,
                ago: Duration::from_nanos(now.saturating_sub(at)),
            }),
            promotions: p.promotions,
            why: matches!(p.state, State::Ud { .. }).then_some(p.why),
        })
    }

    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for p in self.peers.values() {
            match p.state {
                State::Ud { .. } => c.ud += 1,
                State::Connecting { .. } => c.connecting += 1,
                State::Up { .. } => c.up += 1,
                State::Draining { .. } => c.draining += 1,
                State::Backoff { .. } => c.backoff += 1,
            }
        }
        c
    }

    /// Every peer and its state, in key order.
    pub fn peers(&self) -> impl Iterator<Item = (&K, State)> {
        self.peers.iter().map(|(k, p)| (k, p.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MB: u64 = 1_000_000;

    fn cfg(max: usize) -> Config {
        Config {
            max_connections: max,
            ..Config::default()
        }
    }

    /// Feeds `secs` one-second samples of `rate` bytes/s in `pkt`-byte packets to `k`,
    /// ticking after each; returns every action and the time reached.
    struct Sim {
        p: Promoter<u32>,
        now: u64,
        totals: BTreeMap<u32, Sample>,
    }

    impl Sim {
        fn new(cfg: Config, mode: Mode) -> Self {
            Self {
                p: Promoter::new(cfg, mode),
                now: 0,
                totals: BTreeMap::new(),
            }
        }

        /// One second: each (peer, bytes/s, packet size, bytes over its connection).
        fn second(&mut self, traffic: &[(u32, u64, u64, u64)]) -> Vec<Action<u32>> {
            self.now += S;
            for &(k, rate, pkt, cm) in traffic {
                let t = self.totals.entry(k).or_default();
                t.tx_bytes += rate;
                t.tx_packets += rate.div_ceil(pkt.max(1));
                t.cm_bytes += cm;
                self.p.observe(self.now, k, *t);
            }
            self.p.tick(self.now)
        }

        fn state(&self, k: u32) -> State {
            self.p.explain(self.now, &k).unwrap().state
        }
    }

    #[test]
    fn bulk_traffic_is_promoted_and_small_packets_are_not() {
        let mut s = Sim::new(cfg(8), Mode::Auto);
        s.second(&[
            (1, 50 * MB, 65000, 0),
            (2, 50 * MB, 100, 0),
            (3, MB, 9000, 0),
        ]);
        let a = s.second(&[
            (1, 50 * MB, 65000, 0),
            (2, 50 * MB, 100, 0),
            (3, MB, 9000, 0),
        ]);
        assert_eq!(a, vec![Action::Connect(1)]);
        assert!(matches!(s.state(1), State::Connecting { .. }));
        // Many small packets are no reason for CM, however many bytes; a slow bulk flow
        // is below the threshold.
        let e2 = s.p.explain(s.now, &2).unwrap();
        assert_eq!(e2.why, Some(UdWhy::BelowThreshold));
        assert_eq!(e2.rate, 0.0);
        assert_eq!(
            s.p.explain(s.now, &3).unwrap().why,
            Some(UdWhy::BelowThreshold)
        );
        s.p.connected(s.now, &1);
        assert!(matches!(s.state(1), State::Up { .. }));
        // No second Connect while it is up.
        assert!(s.second(&[(1, 50 * MB, 65000, 50 * MB)]).is_empty());
    }

    #[test]
    fn a_ud_path_that_segments_in_the_device_promotes_no_one_by_rate() {
        let mut s = Sim::new(cfg(8), Mode::Auto);
        s.p.set_ud_path(UdPath::Offloaded);
        assert_eq!(s.p.ud_path(), UdPath::Offloaded);
        s.p.set_pin(3, PeerPin::Cm);
        let bulk = [(1, 50 * MB, 65000, 0), (2, 100, 100, 0), (3, 100, 100, 0)];
        let mut acts = Vec::new();
        for _ in 0..5 {
            acts.extend(s.second(&bulk));
        }
        // The pinned peer still gets CM; the bulk sender stays UD, and so does the quiet
        // one: on this path no rate is enough, so both give the path as the reason.
        assert_eq!(acts, vec![Action::Connect(3)]);
        let e1 = s.p.explain(s.now, &1).unwrap();
        assert_eq!(e1.why, Some(UdWhy::UdOffloaded));
        assert!(e1.rate > 40.0 * MB as f64, "{e1:?}");
        assert!(e1.to_string().contains("segments in the device"), "{e1}");
        assert_eq!(
            s.p.explain(s.now, &2).unwrap().why,
            Some(UdWhy::UdOffloaded)
        );
        // The same bulk sender is promoted at the first tick once the path builds every
        // datagram in the CPU (offload turned off): its rate was kept all along.
        s.p.set_ud_path(UdPath::PerPacket);
        assert_eq!(s.second(&bulk), vec![Action::Connect(1)]);
        assert_eq!(
            s.p.explain(s.now, &2).unwrap().why,
            Some(UdWhy::BelowThreshold)
        );
    }

    #[test]
    fn mode_connected_gives_cm_on_a_ud_path_that_segments_in_the_device() {
        let mut s = Sim::new(cfg(8), Mode::Connected);
        s.p.set_ud_path(UdPath::Offloaded);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(1, 50 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
        // Mode datagram says so, whatever the path.
        s.p.set_mode(Mode::Datagram);
        s.second(&[(2, 50 * MB, 65000, 0)]);
        assert_eq!(
            s.p.explain(s.now, &2).unwrap().why,
            Some(UdWhy::ModeDatagram)
        );
    }

    #[test]
    fn the_ud_path_is_read_from_tso() {
        assert_eq!(UdPath::of_tso(true), UdPath::Offloaded);
        assert_eq!(UdPath::of_tso(false), UdPath::PerPacket);
        assert_eq!(UdPath::default(), UdPath::PerPacket);
        assert_eq!(UdPath::Offloaded.to_string(), "offloaded");
        assert_eq!(UdPath::PerPacket.to_string(), "per-packet");
        for p in [UdPath::Offloaded, UdPath::PerPacket] {
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{p}\""));
            assert_eq!(serde_json::from_str::<UdPath>(&json).unwrap(), p);
        }
        assert!(serde_json::from_str::<UdPath>("\"\"").is_err());
        assert!(
            UdPath::Offloaded
                .effect()
                .starts_with("the device segments (TSO)")
        );
        assert!(UdPath::PerPacket.effect().contains("promotes busy peers"));
    }

    #[test]
    fn the_rate_is_smoothed_so_one_burst_does_not_promote() {
        let mut c = cfg(8);
        c.promote_rate = 10.0 * MB as f64;
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 0, 1500, 0)]);
        // 12 MB in one second after silence: smoothed to 6 MB/s, below 10.
        assert!(s.second(&[(1, 12 * MB, 9000, 0)]).is_empty());
        assert!(s.second(&[(1, 0, 9000, 0)]).is_empty());
        // Sustained, it crosses.
        let mut promoted = false;
        for _ in 0..5 {
            promoted |= !s.second(&[(1, 12 * MB, 9000, 0)]).is_empty();
        }
        assert!(promoted);
    }

    #[test]
    fn idle_connections_are_reaped_after_idle_after_but_not_before_min_hold() {
        let mut c = cfg(8);
        c.idle_after = Duration::from_secs(5);
        c.min_hold = Duration::from_secs(20);
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(1, 50 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
        s.p.connected(s.now, &1);
        let up_at = s.now;
        // Silent from now on: idle after 5 s, but held for 20 s.
        let mut reaped_at = None;
        for _ in 0..40 {
            let a = s.second(&[(1, 0, 1, 0)]);
            if a == vec![Action::Disconnect(1, Demotion::Idle)] {
                reaped_at = Some(s.now);
                break;
            }
            assert!(a.is_empty(), "{a:?}");
        }
        assert_eq!(reaped_at, Some(up_at + 20 * S));
        assert!(matches!(s.state(1), State::Draining { .. }));
        s.p.closed(s.now, &1);
        // Traffic again at once: held back for min_hold, then promoted.
        let mut again = None;
        for i in 1..=30 {
            if s.second(&[(1, 50 * MB, 65000, 0)]) == vec![Action::Connect(1)] {
                again = Some(i);
                break;
            }
            assert_eq!(s.p.explain(s.now, &1).unwrap().why, Some(UdWhy::Hold));
        }
        assert_eq!(again, Some(20));
    }

    #[test]
    fn traffic_over_the_connection_keeps_it() {
        let mut c = cfg(8);
        c.idle_after = Duration::from_secs(5);
        c.min_hold = Duration::from_secs(1);
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.p.connected(s.now, &1);
        // The peer sends to us over the connection; we send nothing.
        for _ in 0..30 {
            assert!(s.second(&[(1, 0, 1, MB)]).is_empty());
        }
        assert!(matches!(s.state(1), State::Up { .. }));
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap_and_success_resets() {
        let mut c = cfg(8);
        c.backoff_initial = Duration::from_secs(1);
        c.backoff_max = Duration::from_secs(16);
        c.min_hold = Duration::from_secs(5);
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        let mut attempts = Vec::new();
        for _ in 0..120 {
            if s.second(&[(1, 50 * MB, 65000, 0)]) == vec![Action::Connect(1)] {
                attempts.push(s.now / S);
                s.p.failed(s.now, &1, Failure::Timeout);
            }
        }
        let gaps: Vec<u64> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            &gaps[..6],
            &[1, 2, 4, 8, 16, 16],
            "attempts at {attempts:?}"
        );
        assert_eq!(
            s.p.explain(s.now, &1).unwrap().failures as usize,
            attempts.len()
        );
        // A connection that lives min_hold clears the count: the next failure backs off 1 s.
        while s.second(&[(1, 50 * MB, 65000, 0)]) != vec![Action::Connect(1)] {}
        s.p.connected(s.now, &1);
        for _ in 0..6 {
            s.second(&[(1, 50 * MB, 65000, 50 * MB)]);
        }
        s.p.failed(s.now, &1, Failure::QpError);
        assert_eq!(s.p.explain(s.now, &1).unwrap().failures, 1);
        assert!(matches!(s.state(1), State::Backoff { until, .. } if until == s.now + S));
    }

    #[test]
    fn the_plan_caps_connections_and_a_much_busier_peer_evicts_the_least_active() {
        let mut c = cfg(2);
        c.min_hold = Duration::from_secs(3);
        let mut s = Sim::new(c, Mode::Auto);
        let t = [
            (1, 20 * MB, 65000, 0),
            (2, 30 * MB, 65000, 0),
            (3, 25 * MB, 65000, 0),
        ];
        s.second(&t);
        let a = s.second(&t);
        assert_eq!(
            a,
            vec![Action::Connect(2), Action::Connect(3)],
            "best first"
        );
        s.p.connected(s.now, &2);
        s.p.connected(s.now, &3);
        for _ in 0..5 {
            // Peer 1 is not clearly better than either: no eviction.
            let a = s.second(&[
                (1, 20 * MB, 65000, 0),
                (2, 30 * MB, 65000, 30 * MB),
                (3, 25 * MB, 65000, 25 * MB),
            ]);
            assert!(a.is_empty(), "{a:?}");
            assert_eq!(s.p.explain(s.now, &1).unwrap().why, Some(UdWhy::PlanFull));
        }
        // Peer 3 goes quiet and peer 1 speeds up: 3 (the least recently active) is evicted,
        // once, and 1 takes its slot when it is free.
        let busy = [
            (1, 200 * MB, 65000, 0),
            (2, 30 * MB, 65000, 30 * MB),
            (3, 0, 1, 0),
        ];
        let a = s.second(&busy);
        assert_eq!(a, vec![Action::Disconnect(3, Demotion::Evicted)]);
        assert_eq!(
            s.p.counts().held(),
            2,
            "a draining connection still holds its slot"
        );
        for _ in 0..3 {
            assert!(s.second(&busy).is_empty(), "one eviction per candidate");
        }
        s.p.closed(s.now, &3);
        assert_eq!(
            s.second(&[(1, 200 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
    }

    #[test]
    fn candidates_in_one_tick_evict_one_connection_each_least_active_first() {
        let mut c = cfg(3);
        c.min_hold = Duration::from_secs(1);
        c.setup_burst = 8.0;
        let mut s = Sim::new(c, Mode::Auto);
        // Bytes/s of peers 1, 2 and 3 (a peer that sends is active).
        let flows = |r1: u64, r2: u64, r3: u64| {
            [
                (1, r1 * MB, 65000, r1 * MB),
                (2, r2 * MB, 65000, r2 * MB),
                (3, r3 * MB, 65000, r3 * MB),
            ]
        };
        s.second(&flows(20, 20, 20));
        let a = s.second(&flows(20, 20, 20));
        assert_eq!(a.len(), 3, "{a:?}");
        for k in 1..=3 {
            s.p.connected(s.now, &k);
        }
        // 2 goes quiet first, 1 next; 3 stays busy.
        s.second(&flows(20, 0, 20));
        s.second(&flows(0, 0, 20));
        // Two much busier peers appear at once: each takes one victim, the least recently
        // active first, and the busy one stays.
        let hot = |s: &mut Sim| {
            let mut t = flows(0, 0, 20).to_vec();
            t.extend([(4, 400 * MB, 65000, 0), (5, 300 * MB, 65000, 0)]);
            s.second(&t)
        };
        hot(&mut s);
        let a = hot(&mut s);
        assert_eq!(
            a,
            vec![
                Action::Disconnect(2, Demotion::Evicted),
                Action::Disconnect(1, Demotion::Evicted)
            ]
        );
        assert!(matches!(s.state(3), State::Up { .. }));
    }

    #[test]
    fn a_peer_that_failed_evicts_nobody() {
        let mut c = cfg(1);
        c.min_hold = Duration::from_secs(1);
        c.backoff_initial = Duration::from_secs(1);
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 20 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(1, 20 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
        s.p.connected(s.now, &1);
        // Peer 2 is first seen while the plan is full; its failure is made up here.
        s.p.set_pin(2, PeerPin::Auto);
        s.p.failed(s.now, &2, Failure::Timeout);
        for _ in 0..10 {
            let a = s.second(&[(1, 20 * MB, 65000, 20 * MB), (2, 900 * MB, 65000, 0)]);
            assert!(a.is_empty(), "{a:?}");
        }
        assert_eq!(s.p.explain(s.now, &2).unwrap().why, Some(UdWhy::PlanFull));
    }

    /// Status says why a setup failed, in words that tell the causes apart.
    #[test]
    fn a_failed_setup_is_explained_by_its_cause() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        s.second(&[(1, 20 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(1, 20 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
        s.p.failed(s.now, &1, Failure::NotRunning);
        assert_eq!(
            s.p.explain(s.now, &1).unwrap().to_string(),
            "ud: retry after the peer runs no ipoib-hybrid (nothing of ours answers its \
             handshake port) (1 failure(s) in a row)"
        );
        let all = Failure::ALL;
        let words: std::collections::HashSet<String> = all.iter().map(|f| f.to_string()).collect();
        assert_eq!(words.len(), all.len(), "{words:?}");
        assert!(words.iter().all(|w| !w.is_empty()));
        // The keys JSON and the metrics use: one each, and serde's name is the same key.
        let keys: std::collections::HashSet<&str> = all.iter().map(|f| f.key()).collect();
        assert_eq!(keys.len(), all.len(), "{keys:?}");
        for f in all {
            assert_eq!(
                serde_json::to_string(&f).unwrap(),
                format!("\"{}\"", f.key())
            );
        }
    }

    /// While a retry runs, status still says why the last setup failed, and how long ago; a
    /// connection closed cleanly ends the run of failures.
    #[test]
    fn a_retry_keeps_the_last_failure_in_view() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        let bulk = [(1, 20 * MB, 65000, 0)];
        s.second(&bulk);
        assert_eq!(s.second(&bulk), vec![Action::Connect(1)]);
        let failed_at = s.now;
        s.p.failed(s.now, &1, Failure::NotRunning);
        let retried = (0..30).any(|_| s.second(&bulk) == vec![Action::Connect(1)]);
        assert!(retried, "{:?}", s.state(1));
        let e = s.p.explain(s.now, &1).unwrap();
        assert!(matches!(e.state, State::Connecting { .. }), "{e:?}");
        let ago = Duration::from_nanos(s.now - failed_at);
        assert!(ago >= Duration::from_secs(1), "{ago:?}");
        let last = LastFailure {
            why: Failure::NotRunning,
            ago,
        };
        assert_eq!(e.last_failure, Some(last));
        assert_eq!(
            e.to_string(),
            format!(
                "ud: connecting (last failure {} s ago: the peer runs no ipoib-hybrid (nothing \
                 of ours answers its handshake port); 1 failure(s))",
                ago.as_secs()
            )
        );
        // A second failure takes its place.
        s.p.failed(s.now, &1, Failure::Timeout);
        let e = s.p.explain(s.now + S, &1).unwrap();
        assert_eq!(
            (e.failures, e.last_failure.map(|l| l.why)),
            (2, Some(Failure::Timeout))
        );
        assert_eq!(e.last_failure.unwrap().ago, Duration::from_secs(1));
        // Connected, then taken down by policy and closed: no failure left to show.
        while s.second(&bulk) != vec![Action::Connect(1)] {}
        s.p.connected(s.now, &1);
        assert!(matches!(s.state(1), State::Up { .. }), "{:?}", s.state(1));
        s.p.set_mode(Mode::Datagram);
        assert_eq!(
            s.second(&bulk),
            vec![Action::Disconnect(1, Demotion::Datagram)]
        );
        s.p.closed(s.now, &1);
        let e = s.p.explain(s.now, &1).unwrap();
        assert_eq!((e.failures, e.last_failure), (0, None));
    }

    /// A connection that worked for a while and then broke starts a new run of one failure.
    #[test]
    fn a_failure_after_a_lasting_connection_is_the_first_of_a_new_run() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        let bulk = [(1, 20 * MB, 65000, 0)];
        s.second(&bulk);
        s.second(&bulk);
        s.p.failed(s.now, &1, Failure::Rejected);
        while s.second(&bulk) != vec![Action::Connect(1)] {}
        s.p.connected(s.now, &1);
        for _ in 0..cfg(4).min_hold.as_secs() {
            s.second(&bulk);
        }
        s.p.failed(s.now, &1, Failure::QpError);
        let e = s.p.explain(s.now, &1).unwrap();
        let last = LastFailure {
            why: Failure::QpError,
            ago: Duration::ZERO,
        };
        assert_eq!((e.failures, e.last_failure), (1, Some(last)));
    }

    #[test]
    fn datagram_mode_drains_everything_and_promotes_nothing() {
        let mut s = Sim::new(cfg(8), Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0), (2, 50 * MB, 65000, 0)]);
        s.second(&[(1, 50 * MB, 65000, 0), (2, 50 * MB, 65000, 0)]);
        s.p.connected(s.now, &1);
        // 2 is still connecting when the mode changes.
        s.p.set_mode(Mode::Datagram);
        let a = s.second(&[(1, 50 * MB, 65000, 0), (2, 50 * MB, 65000, 0)]);
        assert_eq!(a, vec![Action::Disconnect(1, Demotion::Datagram)]);
        // The setup in flight completes: it is taken down at the next tick.
        s.p.connected(s.now, &2);
        let a = s.second(&[(1, 50 * MB, 65000, 0), (2, 50 * MB, 65000, 0)]);
        assert_eq!(a, vec![Action::Disconnect(2, Demotion::Datagram)]);
        s.p.closed(s.now, &1);
        s.p.closed(s.now, &2);
        for _ in 0..30 {
            assert!(
                s.second(&[(1, 50 * MB, 65000, 0), (2, 50 * MB, 65000, 0)])
                    .is_empty()
            );
        }
        assert_eq!(
            s.p.explain(s.now, &1).unwrap().why,
            Some(UdWhy::ModeDatagram)
        );
        assert_eq!(
            s.p.explain(s.now, &1).unwrap().to_string(),
            "ud: mode=datagram (50.0 MB/s bulk)"
        );
    }

    #[test]
    fn connected_mode_promotes_every_peer_that_talks_within_the_plan() {
        let mut s = Sim::new(cfg(3), Mode::Connected);
        let t: Vec<_> = (1..=5).map(|k| (k, 1000, 100, 0)).collect();
        s.second(&t);
        let a = s.second(&t);
        assert_eq!(a.len(), 3, "{a:?}");
        assert!(a.iter().all(|a| matches!(a, Action::Connect(_))));
        // A silent peer is not promoted.
        s.second(&[(9, 0, 1, 0)]);
        s.second(&[(9, 0, 1, 0)]);
        assert_eq!(
            s.p.explain(s.now, &9).unwrap().why,
            Some(UdWhy::BelowThreshold)
        );
    }

    #[test]
    fn pins_override_the_traffic() {
        let mut s = Sim::new(cfg(1), Mode::Auto);
        s.p.set_pin(7, PeerPin::Cm);
        s.p.set_pin(8, PeerPin::Ud);
        let a = s.second(&[(8, 500 * MB, 65000, 0)]);
        assert_eq!(a, vec![Action::Connect(7)], "pinned CM first, even silent");
        s.second(&[(8, 500 * MB, 65000, 0)]);
        assert_eq!(s.p.explain(s.now, &8).unwrap().why, Some(UdWhy::Pinned));
        // Pinned CM is never reaped for idleness.
        s.p.connected(s.now, &7);
        for _ in 0..100 {
            assert!(s.second(&[(7, 0, 1, 0)]).is_empty());
        }
        // Pinning a live connection to UD takes it down.
        s.p.set_pin(7, PeerPin::Ud);
        assert_eq!(s.second(&[]), vec![Action::Disconnect(7, Demotion::Pinned)]);
    }

    #[test]
    fn setups_are_rate_limited() {
        let mut c = cfg(1000);
        c.setups_per_sec = 10.0;
        c.setup_burst = 10.0;
        let mut s = Sim::new(c, Mode::Auto);
        let t: Vec<_> = (0..100).map(|k| (k, 50 * MB, 65000, 0)).collect();
        s.second(&t);
        let mut per_tick = Vec::new();
        for _ in 0..5 {
            per_tick.push(s.second(&t).len());
        }
        assert_eq!(per_tick, vec![10, 10, 10, 10, 10]);
        let waiting = (0..100)
            .filter(|k| s.p.explain(s.now, k).unwrap().why == Some(UdWhy::SetupRate))
            .count();
        assert_eq!(waiting, 50);
    }

    #[test]
    fn setups_refill_at_their_rate_after_a_burst() {
        let mut c = cfg(1000);
        c.setups_per_sec = 2.0;
        c.setup_burst = 6.0;
        let mut s = Sim::new(c, Mode::Auto);
        let t: Vec<_> = (0..100).map(|k| (k, 50 * MB, 65000, 0)).collect();
        s.second(&t);
        let per_tick: Vec<usize> = (0..4).map(|_| s.second(&t).len()).collect();
        // The burst first (the bucket starts full), then 2 a second.
        assert_eq!(per_tick, vec![6, 2, 2, 2]);
    }

    #[test]
    fn a_connection_the_peer_set_up_is_adopted_once() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        assert!(s.p.accepted(S, 9));
        assert!(matches!(s.state(9), State::Up { .. }));
        assert!(!s.p.accepted(S, 9), "a second one is refused");
        // It is reaped like our own when idle (default idle_after 30 s, min_hold 10 s).
        let mut reaped = false;
        for _ in 0..40 {
            reaped |= s.second(&[(9, 0, 1, 0)]) == vec![Action::Disconnect(9, Demotion::Idle)];
        }
        assert!(reaped);
    }

    #[test]
    fn connections_the_peers_set_up_stay_within_the_plan_and_the_policy() {
        let mut s = Sim::new(cfg(2), Mode::Auto);
        assert!(s.p.accepted(S, 1));
        // Our own setup under way holds the second slot.
        s.second(&[(2, 50 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(2, 50 * MB, 65000, 0)]),
            vec![Action::Connect(2)]
        );
        assert!(!s.p.accepted(s.now, 3), "the plan is full");
        assert!(matches!(s.state(3), State::Ud { .. }));
        // The peer we are connecting to won the crossing: its slot is already counted.
        assert!(s.p.accepted(s.now, 2));
        assert_eq!(s.p.counts().up, 2);
        s.p.set_pin(4, PeerPin::Block);
        s.p.set_max_connections(8);
        assert!(!s.p.accepted(s.now, 4), "pinned away from CM");
        s.p.set_mode(Mode::Datagram);
        assert!(!s.p.accepted(s.now, 5), "mode=datagram");
    }

    #[test]
    fn a_smaller_plan_sheds_the_least_recently_active_connections() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        for k in 1..=3 {
            assert!(s.p.accepted(S, k));
        }
        s.p.set_pin(3, PeerPin::Cm);
        // 2 is active, 1 and 3 are not; 3 is pinned.
        s.second(&[(2, MB, 65000, MB)]);
        s.p.set_max_connections(1);
        let a = s.second(&[(2, MB, 65000, MB)]);
        assert_eq!(
            a,
            vec![
                Action::Disconnect(1, Demotion::OverPlan),
                Action::Disconnect(2, Demotion::OverPlan)
            ]
        );
        assert!(matches!(s.state(3), State::Up { .. }), "a pin is kept");
        s.p.closed(s.now, &1);
        s.p.closed(s.now, &2);
        assert!(
            s.second(&[(2, MB, 65000, MB)]).is_empty(),
            "and no churn after"
        );
    }

    #[test]
    fn no_plan_means_no_connections() {
        let mut s = Sim::new(cfg(0), Mode::Connected);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        assert!(s.second(&[(1, 50 * MB, 65000, 0)]).is_empty());
        assert_eq!(s.p.explain(s.now, &1).unwrap().why, Some(UdWhy::NoPlan));
    }

    #[test]
    fn counters_that_go_backwards_start_a_new_baseline() {
        let mut p: Promoter<u32> = Promoter::new(cfg(4), Mode::Auto);
        let big = Sample {
            tx_packets: 1_000_000,
            tx_bytes: 60_000_000_000,
            cm_bytes: 0,
        };
        p.observe(S, 1, big);
        p.observe(2 * S, 1, Sample::default());
        assert_eq!(p.explain(0, &1).unwrap().rate, 0.0);
    }

    #[test]
    fn forgetting_a_peer_tears_its_connection_down_then_drops_it() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.p.connected(s.now, &1);
        assert_eq!(
            s.p.forget(s.now, &1),
            Some(Action::Disconnect(1, Demotion::Forgotten))
        );
        assert_eq!(s.p.counts().draining, 1);
        s.p.closed(s.now, &1);
        assert!(s.p.explain(s.now, &1).is_none());
        assert_eq!(s.p.counts(), Counts::default());
    }

    #[test]
    fn the_rate_is_bytes_per_second_smoothed_and_a_sample_at_the_same_instant_is_not_one() {
        let mut s = Sim::new(cfg(8), Mode::Auto);
        s.second(&[(1, 0, 1, 0)]);
        s.second(&[(1, 10 * MB, 65000, 0)]);
        // 10 MB in one second, weighed 0.5 against the rate before (0).
        assert_eq!(s.p.explain(s.now, &1).unwrap().rate, 5.0 * MB as f64);
        // More bytes, but no time passed: no rate can be taken from it.
        let t = s.totals[&1];
        let more = Sample {
            tx_bytes: t.tx_bytes + MB,
            tx_packets: t.tx_packets + 16,
            ..t
        };
        s.p.observe(s.now, 1, more);
        assert_eq!(s.p.explain(s.now, &1).unwrap().rate, 5.0 * MB as f64);
        // 8 MB more over the next 2 s: 4 MB/s, weighed against 5.
        let later = Sample {
            tx_bytes: more.tx_bytes + 8 * MB,
            tx_packets: more.tx_packets + 128,
            ..more
        };
        s.p.observe(s.now + 2 * S, 1, later);
        assert_eq!(s.p.explain(s.now, &1).unwrap().rate, 4.5 * MB as f64);
    }

    #[test]
    fn a_connection_is_active_while_bulk_leaves_by_either_path_and_idle_when_nothing_moves() {
        let mut c = cfg(8);
        c.idle_after = Duration::from_secs(5);
        c.min_hold = Duration::from_secs(1);
        for mode in [Mode::Auto, Mode::Connected] {
            let mut s = Sim::new(c.clone(), mode);
            s.second(&[(1, 50 * MB, 65000, 0)]);
            let a = s.second(&[(1, 50 * MB, 65000, 0)]);
            assert_eq!(a, vec![Action::Connect(1)], "{mode:?}");
            s.p.connected(s.now, &1);
            // Bulk still leaves on UD (a queue draining, say): the connection is wanted.
            for _ in 0..10 {
                let a = s.second(&[(1, 50 * MB, 65000, 0)]);
                assert!(a.is_empty(), "{mode:?}: {a:?}");
            }
            // Small packets only (no bulk): not what a connection is for.
            if mode == Mode::Auto {
                let mut t = Sim::new(c.clone(), mode);
                t.second(&[(1, 50 * MB, 65000, 0)]);
                t.second(&[(1, 50 * MB, 65000, 0)]);
                t.p.connected(t.now, &1);
                let reaped = (0..10).any(|_| {
                    t.second(&[(1, 100_000, 100, 0)]) == vec![Action::Disconnect(1, Demotion::Idle)]
                });
                assert!(reaped, "small packets kept a connection");
            }
            // Nothing moves either way: reaped once idle.
            let reaped = (0..10)
                .any(|_| s.second(&[(1, 0, 1, 0)]) == vec![Action::Disconnect(1, Demotion::Idle)]);
            assert!(reaped, "{mode:?}");
        }
    }

    #[test]
    fn in_connected_mode_a_peer_is_worth_a_connection_until_idle_after() {
        let mut c = cfg(0);
        c.idle_after = Duration::from_secs(5);
        let mut s = Sim::new(c, Mode::Connected);
        s.second(&[(1, 0, 1, 0)]);
        s.second(&[(1, 1000, 100, 0)]);
        let why = |s: &Sim| s.p.explain(s.now, &1).unwrap().why;
        // Worth it (the plan is what stops it) for 5 s after it last sent, not at 5 s.
        for _ in 0..4 {
            s.second(&[]);
            assert_eq!(why(&s), Some(UdWhy::NoPlan));
        }
        s.second(&[]);
        assert_eq!(why(&s), Some(UdWhy::BelowThreshold));
    }

    #[test]
    fn promotions_are_counted() {
        let mut s = Sim::new(cfg(8), Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        assert_eq!(s.p.explain(s.now, &1).unwrap().promotions, 1);
    }

    #[test]
    fn a_pinned_connection_is_never_evicted() {
        let mut c = cfg(1);
        c.min_hold = Duration::from_secs(1);
        let mut s = Sim::new(c, Mode::Auto);
        s.p.set_pin(7, PeerPin::Cm);
        assert_eq!(s.second(&[]), vec![Action::Connect(7)]);
        s.p.connected(s.now, &7);
        for _ in 0..10 {
            let a = s.second(&[(7, 0, 1, 0), (8, 900 * MB, 65000, 0)]);
            assert!(a.is_empty(), "{a:?}");
        }
        assert_eq!(s.p.explain(s.now, &8).unwrap().why, Some(UdWhy::PlanFull));
    }

    #[test]
    fn eviction_needs_more_than_twice_the_rate() {
        let mut c = cfg(1);
        c.min_hold = Duration::from_secs(1);
        // No smoothing: the rate is the last second's.
        c.smoothing = 1.0;
        let mut s = Sim::new(c, Mode::Auto);
        s.second(&[(1, 10 * MB, 65000, 0)]);
        assert_eq!(
            s.second(&[(1, 10 * MB, 65000, 0)]),
            vec![Action::Connect(1)]
        );
        s.p.connected(s.now, &1);
        for _ in 0..5 {
            let a = s.second(&[(1, 10 * MB, 65000, 10 * MB), (2, 20 * MB, 65000, 0)]);
            assert!(a.is_empty(), "exactly twice the rate evicts nobody: {a:?}");
        }
        let a = s.second(&[(1, 10 * MB, 65000, 10 * MB), (2, 21 * MB, 65000, 0)]);
        assert_eq!(a, vec![Action::Disconnect(1, Demotion::Evicted)]);
    }

    #[test]
    fn counts_has_every_state() {
        let mut c = cfg(8);
        c.backoff_initial = Duration::from_secs(60);
        let mut s = Sim::new(c, Mode::Auto);
        let bulk = |k| (k, 50 * MB, 65000, 0);
        s.second(&[bulk(1), bulk(2), bulk(3), bulk(4), (5, 1000, 100, 0)]);
        s.second(&[bulk(1), bulk(2), bulk(3), bulk(4), (5, 1000, 100, 0)]);
        // 1 stays connecting; 2 is up; 3 is up and then draining; 4 failed; 5 is UD.
        s.p.connected(s.now, &2);
        s.p.connected(s.now, &3);
        s.p.set_pin(3, PeerPin::Ud);
        s.p.failed(s.now, &4, Failure::Timeout);
        s.second(&[]);
        assert_eq!(
            s.p.counts(),
            Counts {
                ud: 1,
                connecting: 1,
                up: 1,
                draining: 1,
                backoff: 1
            }
        );
    }

    #[test]
    fn forgetting_a_peer_that_is_connecting_or_draining_keeps_it_until_it_is_closed() {
        let mut s = Sim::new(cfg(4), Mode::Auto);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        s.second(&[(1, 50 * MB, 65000, 0)]);
        assert_eq!(s.p.forget(s.now, &1), None);
        assert!(matches!(s.state(1), State::Connecting { .. }));
        s.p.connected(s.now, &1);
        s.p.forget(s.now, &1);
        assert_eq!(s.p.forget(s.now, &1), None, "already draining");
        assert!(matches!(s.state(1), State::Draining { .. }));
    }
}
