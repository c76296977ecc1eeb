//! Connected mode's decisions, with no I/O: events and the time go in (`handle_*`), commands
//! come out ([`Core::next_command`]) for the manager to carry out in order. No verbs, sockets,
//! maps or clock here, so unit tests drive it as the manager does and assert on the commands.
//!
//! Who gets a connection is [`Promoter`]'s call; this adds what the node holds: which
//! connection (by QP number) serves which peer, what the fast path's peer map must say and
//! when, the bytes each connection received, the connection cap and the SRQ limit event.
//!
//! The order it keeps, so nothing is ever redirected into a dead or missing connection:
//! - up: the engine gets the route ([`Command::AddRoute`]) and only once it has it
//!   ([`Core::handle_route_added`]) does the peer map say `CmUp`;
//! - down: the peer map says `Ud` first, then the engine sends what it still holds for the
//!   peer over the connection, drops the route and lets it be closed
//!   ([`Command::RemoveRoute`]).

use std::{
    collections::{HashMap, HashSet, VecDeque},
    net::IpAddr,
};

use ipoib_common::{PeerMode, PeerPin};

pub use crate::cm::Gone;
use crate::{
    policy::Mode,
    promotion::{Action, Demotion, Failure, LastFailure, Promoter, Sample, State, UdPath, UdWhy},
    status::cm::CmPeerState,
};

/// What the manager is to do, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Write the peer's mode into the fast path's peer map.
    SetPeerMode(IpAddr, PeerMode),
    /// Start a connection setup to the peer (resolve its address, then the handshake).
    Connect(IpAddr),
    /// Hand the established connection `qpn` to the engine as the peer's route and watch it
    /// (keepalive); the engine answers with a route-added event.
    AddRoute { ip: IpAddr, qpn: u32 },
    /// The engine drops the peer's route to `qpn` (if it is still that one), then the
    /// connection is closed when `close` (a watched connection that ended closed itself).
    RemoveRoute { ip: IpAddr, qpn: u32, close: bool },
    /// Close an established connection that is not kept (never routed).
    Discard { ip: IpAddr, qpn: u32 },
    /// Refuse incoming setups past this many connections (REJ no-resources).
    SetSetupLimit(usize),
    /// Arm the SRQ limit event again at this many posted buffers (it disarms itself when it
    /// fires).
    ArmSrqLimit(u32),
}

/// What the manager reads for a tick: the policy, the peer map's pins and the fast path's
/// per-peer counters.
#[derive(Debug, Clone, Default)]
pub struct TickInput {
    /// The policy's mode (None: unreadable, keep the last).
    pub mode: Option<Mode>,
    /// How the interface's UD path segments (None: unreadable, keep the last).
    pub ud_path: Option<UdPath>,
    /// The cap in force: the plan's, lowered by policy `max-connections`.
    pub max_connections: usize,
    pub pins: Vec<(IpAddr, PeerPin)>,
    /// Per peer: packets and bytes sent (UD and CM), and bytes sent over CM.
    pub traffic: Vec<(IpAddr, Traffic)>,
    /// Receive buffers posted on the SRQ now.
    pub srq_posted: u32,
}

/// The fast path's cumulative counters for one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_cm_bytes: u64,
}

/// One peer as status shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct CmPeer {
    pub addr: IpAddr,
    pub state: CmPeerState,
    pub why: String,
    pub failures: u32,
    pub last_failure: Option<LastFailure>,
    pub promotions: u64,
    /// Worth a connection, but on UD because the memory plan is full.
    pub waiting_for_plan: bool,
}

/// Connected mode's decision state for one interface.
pub struct Core {
    promoter: Promoter<IpAddr>,
    /// The connection that serves each peer, by QP number.
    live: HashMap<IpAddr, u32>,
    /// Bytes each live connection received so far (the engine's totals), and what each peer's
    /// connections received in all: a connection the peer sends over is not idle.
    rx_seen: HashMap<u32, u64>,
    cm_rx: HashMap<IpAddr, u64>,
    /// Connections given up on a failure (the peer gone, a QP error), their peer UD and the
    /// policy told already: their close changes nothing more.
    given_up: HashSet<u32>,
    max_connections: usize,
    srq_limit: u32,
    srq_armed: bool,
    srq_low_events: u64,
    commands: VecDeque<Command>,
}

impl Core {
    /// `promoter` carries the plan's cap; `srq_depth` sizes the limit event (a quarter).
    pub fn new(promoter: Promoter<IpAddr>, srq_depth: u32) -> Self {
        let max_connections = promoter.config().max_connections;
        let mut core = Self {
            promoter,
            live: HashMap::new(),
            rx_seen: HashMap::new(),
            cm_rx: HashMap::new(),
            given_up: HashSet::new(),
            max_connections,
            srq_limit: srq_depth / 4,
            srq_armed: true,
            srq_low_events: 0,
            commands: VecDeque::new(),
        };
        core.push(Command::SetSetupLimit(max_connections));
        core
    }

    /// The next command to carry out, in order.
    pub fn next_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    fn push(&mut self, c: Command) {
        self.commands.push_back(c);
    }

    /// The peer goes UD: the map first, then the engine's route and the connection.
    fn demote(&mut self, ip: IpAddr, qpn: u32, close: bool) {
        self.push(Command::SetPeerMode(ip, PeerMode::Ud));
        self.push(Command::RemoveRoute { ip, qpn, close });
    }

    /// Once a second: the policy, pins and counters in, the policy's actions out.
    pub fn handle_tick(&mut self, now: u64, input: TickInput) {
        if let Some(mode) = input.mode {
            self.promoter.set_mode(mode);
        }
        if let Some(path) = input.ud_path
            && path != self.promoter.ud_path()
        {
            tracing::info!(
                "the UD path is {path} now (was {}): {}",
                self.promoter.ud_path(),
                path.effect()
            );
            self.promoter.set_ud_path(path);
        }
        if !self.srq_armed && input.srq_posted > self.srq_limit {
            self.srq_armed = true;
            self.push(Command::ArmSrqLimit(self.srq_limit));
        }
        if input.max_connections != self.max_connections {
            tracing::info!(
                "at most {} connections (was {})",
                input.max_connections,
                self.max_connections
            );
            self.max_connections = input.max_connections;
            self.promoter.set_max_connections(input.max_connections);
            self.push(Command::SetSetupLimit(input.max_connections));
        }
        for (ip, pin) in input.pins {
            self.promoter.set_pin(ip, pin);
        }
        for (ip, t) in input.traffic {
            let received = self.cm_rx.get(&ip).copied().unwrap_or(0);
            let sample = Sample {
                tx_packets: t.tx_packets,
                tx_bytes: t.tx_bytes,
                cm_bytes: t.tx_cm_bytes + received,
            };
            self.promoter.observe(now, ip, sample);
        }
        for action in self.promoter.tick(now) {
            match action {
                Action::Connect(ip) => {
                    self.push(Command::SetPeerMode(ip, PeerMode::CmPending));
                    self.push(Command::Connect(ip));
                }
                Action::Disconnect(ip, why) => self.disconnect(now, ip, why),
            }
        }
    }

    fn disconnect(&mut self, now: u64, ip: IpAddr, why: Demotion) {
        match self.live.remove(&ip) {
            Some(qpn) => {
                tracing::info!("{ip}: closing its connection (QP {qpn}): {why:?}");
                self.demote(ip, qpn, true);
            }
            None => {
                // Still setting up, or already gone: UD, and the policy hears it closed.
                self.push(Command::SetPeerMode(ip, PeerMode::Ud));
                self.promoter.closed(now, &ip);
            }
        }
    }

    /// A connection to `ip` is established: set up by us (`Connect`) or accepted from the
    /// peer. It is kept within the plan and the policy, one per peer.
    pub fn handle_established(&mut self, now: u64, ip: IpAddr, qpn: u32) {
        let ours = matches!(
            self.promoter.explain(now, &ip).map(|e| e.state),
            Some(State::Connecting { .. })
        );
        let keep = if ours {
            self.promoter.connected(now, &ip);
            true
        } else {
            self.promoter.accepted(now, ip)
        };
        if !keep || self.live.contains_key(&ip) {
            tracing::debug!(
                "{ip}: not keeping connection QP {qpn} (one exists, policy, or the plan is full)"
            );
            self.push(Command::Discard { ip, qpn });
            return;
        }
        self.live.insert(ip, qpn);
        self.push(Command::AddRoute { ip, qpn });
    }

    /// The engine routes `ip` to `qpn` now: redirect the peer's big packets to it, if that
    /// connection is still the peer's.
    pub fn handle_route_added(&mut self, ip: IpAddr, qpn: u32) {
        if self.live.get(&ip) == Some(&qpn) {
            self.push(Command::SetPeerMode(ip, PeerMode::CmUp));
        }
    }

    /// Our setup to `ip` ended without a connection.
    pub fn handle_setup_failed(&mut self, now: u64, ip: IpAddr, why: Failure) {
        if self.live.contains_key(&ip) {
            // Our REQ lost the crossing to the peer's, whose connection is already up: that
            // one stands. (Seen in the VM: taking this as a failure marked the peer UD and let
            // the policy count it out, so the node held one connection more than its plan.)
            tracing::debug!("{ip}: our setup ended ({why:?}); the peer's connection stands");
            return;
        }
        self.push(Command::SetPeerMode(ip, PeerMode::Ud));
        self.promoter.failed(now, &ip, why);
    }

    /// The watcher found the peer of connection `qpn` gone: it closed its end of the
    /// control stream, or was silent past the deadline. The connection is still open, so the
    /// peer goes UD first, then what the engine holds for it goes over the connection, and
    /// only then is it closed, as in a demotion (a close first would flush what is held).
    pub fn handle_gone(&mut self, now: u64, ip: IpAddr, qpn: u32, gone: Gone) {
        self.rx_seen.remove(&qpn);
        if self.live.get(&ip) != Some(&qpn) {
            // An older connection of a peer that has a newer one, or one being let go already
            // (shed, or given up on a QP error): closed, and nothing else changes.
            self.push(Command::RemoveRoute {
                ip,
                qpn,
                close: true,
            });
            return;
        }
        self.live.remove(&ip);
        self.given_up.insert(qpn);
        self.demote(ip, qpn, true);
        match gone {
            Gone::Closed => {
                tracing::info!("{ip}: the peer closed its connection (QP {qpn}): UD, then closed");
                self.promoter.closed(now, &ip);
            }
            // Alive at the IP level but not taking what we send: UD, retry later.
            Gone::Silent => {
                tracing::warn!(
                    "{ip}: the peer's control loop went silent: UD, connection (QP {qpn}) closed"
                );
                self.promoter.failed(now, &ip, Failure::Timeout);
            }
        }
    }

    /// A connection we asked to close (`RemoveRoute` with `close`) is closed.
    pub fn handle_closed(&mut self, now: u64, ip: IpAddr, qpn: u32) {
        self.rx_seen.remove(&qpn);
        if self.given_up.remove(&qpn) {
            return;
        }
        match self.live.get(&ip) {
            // An older connection of a peer that has a new one: leave it be.
            Some(q) if *q != qpn => return,
            Some(_) => {
                self.live.remove(&ip);
            }
            None => {}
        }
        self.demote(ip, qpn, false);
        self.promoter.closed(now, &ip);
    }

    /// QP `qpn` is in error (a send completed in error, or the device said it went fatal):
    /// its peer goes UD with backoff.
    pub fn handle_qp_error(&mut self, now: u64, qpn: u32, what: &str) {
        let Some(ip) = self.peer_of(qpn) else {
            return;
        };
        tracing::warn!("{ip}: QP {qpn} failed ({what}): UD, retry later");
        self.live.remove(&ip);
        self.given_up.insert(qpn);
        self.demote(ip, qpn, true);
        self.promoter.failed(now, &ip, Failure::QpError);
    }

    /// The peer's send queue in the engine overflowed: UD until it drains.
    pub fn handle_congested(&mut self, ip: IpAddr) {
        if self.live.contains_key(&ip) {
            tracing::debug!("{ip}: the connection's queue is full: UD until it drains");
            self.push(Command::SetPeerMode(ip, PeerMode::Ud));
        }
    }

    /// Its queue drained: CM again.
    pub fn handle_drained(&mut self, ip: IpAddr) {
        if self.live.contains_key(&ip) {
            self.push(Command::SetPeerMode(ip, PeerMode::CmUp));
        }
    }

    /// The engine's totals of bytes received, per QP.
    pub fn handle_received(&mut self, totals: &[(u32, u64)]) {
        for &(qpn, total) in totals {
            let Some(ip) = self.peer_of(qpn) else {
                continue;
            };
            let before = self.rx_seen.insert(qpn, total).unwrap_or(0);
            *self.cm_rx.entry(ip).or_default() += total.saturating_sub(before);
        }
    }

    /// Fewer than a quarter of the SRQ's buffers are posted: counted and said; the limit is
    /// armed again on the first tick that finds the SRQ refilled.
    pub fn handle_srq_limit(&mut self) {
        self.srq_low_events += 1;
        self.srq_armed = false;
        tracing::warn!(
            "fewer than {} receive buffers posted (the engine is not keeping up); senders \
             will meet RNR NAKs",
            self.srq_limit
        );
    }

    /// Stopping: every peer UD, then every connection closed.
    pub fn handle_shutdown(&mut self) {
        let live: Vec<(IpAddr, u32)> = self.live.drain().collect();
        for (ip, qpn) in live {
            self.demote(ip, qpn, true);
        }
    }

    fn peer_of(&self, qpn: u32) -> Option<IpAddr> {
        self.live
            .iter()
            .find(|(_, q)| **q == qpn)
            .map(|(ip, _)| *ip)
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        self.live.len()
    }

    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    pub fn srq_low_events(&self) -> u64 {
        self.srq_low_events
    }

    pub fn mode(&self) -> Mode {
        self.promoter.mode()
    }

    pub fn ud_path(&self) -> UdPath {
        self.promoter.ud_path()
    }

    /// Every peer the policy knows, with why it is where it is.
    /// What status shows of each peer, at `now`.
    pub fn peers(&self, now: u64) -> Vec<CmPeer> {
        self.promoter
            .peers()
            .filter_map(|(ip, _)| {
                let e = self.promoter.explain(now, ip)?;
                let state = match e.state {
                    State::Ud { .. } => CmPeerState::Ud,
                    State::Connecting { .. } => CmPeerState::Connecting,
                    State::Up { .. } => CmPeerState::Cm,
                    State::Draining { .. } => CmPeerState::Closing,
                    State::Backoff { .. } => CmPeerState::Backoff,
                };
                Some(CmPeer {
                    addr: *ip,
                    state,
                    why: e.to_string(),
                    failures: e.failures,
                    last_failure: e.last_failure,
                    promotions: e.promotions,
                    waiting_for_plan: state == CmPeerState::Ud && e.why == Some(UdWhy::PlanFull),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
