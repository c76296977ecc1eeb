//! Connected mode's status: what a control loop writes once a tick (`RUN_DIR/IFACE.cm.json`)
//! and `status`, the metrics and the tests read.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

use crate::{
    ledger::Share,
    policy::Mode,
    promotion::{Failure, UdPath},
};

/// One peer in the status.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerStatus {
    pub addr: IpAddr,
    pub state: CmPeerState,
    pub why: String,
    pub failures: u32,
    /// While `failures` counts any: the last one (kept while the next setup runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<FailureStatus>,
    pub promotions: u64,
    /// Worth a connection, but kept on UD because the memory plan is full.
    #[serde(default)]
    pub waiting_for_plan: bool,
}

/// Where a peer is in connected mode's policy; in JSON by its name (`backoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CmPeerState {
    Ud,
    Connecting,
    Cm,
    Closing,
    Backoff,
}

impl CmPeerState {
    pub const ALL: [CmPeerState; 5] = [
        CmPeerState::Ud,
        CmPeerState::Connecting,
        CmPeerState::Cm,
        CmPeerState::Closing,
        CmPeerState::Backoff,
    ];

    /// Its name, as JSON and the metrics' `state` label say it.
    pub fn name(self) -> &'static str {
        match self {
            CmPeerState::Ud => "ud",
            CmPeerState::Connecting => "connecting",
            CmPeerState::Cm => "cm",
            CmPeerState::Closing => "closing",
            CmPeerState::Backoff => "backoff",
        }
    }
}

/// A peer's last failed setup or broken connection, in the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureStatus {
    pub reason: Failure,
    /// The reason in words.
    pub said: String,
    /// Seconds since it failed, when the status was written.
    pub secs_ago: u64,
}

/// Where a connection's receives land; in JSON `srq` or `rings`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReceiveKind {
    /// One shared receive queue for every connection.
    #[default]
    Srq,
    /// A ring of buffers per connection.
    Rings,
}

/// Where receives land, and what they cost, in the CM status.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct ReceiveStatus {
    pub model: ReceiveKind,
    /// Buffers of the SRQ, or of each ring.
    pub depth: u32,
    /// Rings that exist now (set up, in use or being torn down), and the plan's K.
    pub rings: u32,
    pub max_rings: u32,
    /// Receive memory registered now, and the plan's budget.
    pub registered_bytes: u64,
    pub budget_bytes: u64,
    /// Rings made, refused at K, and the mean time to register one (µs).
    pub rings_made: u64,
    pub rings_refused: u64,
    pub ring_register_us: u64,
}

/// What the CM side reports, written as JSON to `status_path` every tick.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct CmStatus {
    pub device: String,
    pub tun: String,
    #[serde(default)]
    pub receive: ReceiveStatus,
    /// The SRQ's buffers (0 with rings per connection).
    pub srq_depth: u32,
    /// Times fewer than a quarter of the SRQ's buffers were posted (the SRQ limit event).
    #[serde(default)]
    pub srq_low_events: u64,
    pub max_connections: usize,
    pub mode: Mode,
    /// How the interface's UD path segments: `per-packet` (mode auto promotes busy peers) or
    /// `offloaded` (TSO: it promotes none by rate).
    #[serde(default)]
    pub ud_path: UdPath,
    pub connections: usize,
    pub established: u64,
    pub failed: u64,
    /// The node's budget, and what each attached interface holds of it.
    #[serde(default)]
    pub node: NodeBudget,
    /// Incoming handshake streams waiting for their REQ now, and those dropped (oldest
    /// first) because too many waited.
    #[serde(default)]
    pub awaiting_req: u64,
    #[serde(default)]
    pub dropped_awaiting_req: u64,
    /// Path records resolved for our setups, resolutions that failed, and setups whose REQ
    /// brought the peer's path.
    #[serde(default)]
    pub paths_resolved: u64,
    #[serde(default)]
    pub paths_unresolved: u64,
    #[serde(default)]
    pub paths_from_peer: u64,
    /// Tasks alive in the control loop's runtime.
    #[serde(default)]
    pub tasks: u64,
    /// The latest the policy's tick ran after its time, since connected mode started: how
    /// long the thread that runs the control loop, the engine and the handshakes was kept
    /// from it (milliseconds).
    #[serde(default)]
    pub tick_late_max_ms: u64,
    /// Engines, one per lane (TUN queue); `engine` counts for all of them.
    #[serde(default)]
    pub engine_lanes: u32,
    /// By name, sorted: the file reads the same for the same counts.
    pub engine: BTreeMap<String, u64>,
    /// CPU time of the engines' threads since they started, all lanes (ns): see
    /// [`crate::engine::EngineStats::cpu_ns`].
    #[serde(default)]
    pub engine_cpu_ns: u64,
    pub peers: Vec<PeerStatus>,
}

/// Bytes the engine must have moved before its CPU per byte is said: less says little.
pub const COST_MIN_BYTES: u64 = 64 << 20;

impl CmStatus {
    /// The engine's CPU seconds per GB it moved (sent and received), once it has moved
    /// [`COST_MIN_BYTES`].
    pub fn engine_cpu_s_per_gb(&self) -> Option<f64> {
        let e = |k: &str| self.engine.get(k).copied().unwrap_or(0);
        let bytes = e("tx_bytes") + e("rx_bytes");
        (bytes >= COST_MIN_BYTES).then(|| self.engine_cpu_ns as f64 / bytes as f64)
    }
}

/// Where `iface`'s control loop writes its CM status.
pub fn status_path(iface: &str) -> PathBuf {
    crate::attach::run_file(iface, "cm.json")
}

/// The CM status of `iface` as its control loop last wrote it.
pub fn read_status(iface: &str) -> Option<CmStatus> {
    serde_json::from_slice(&std::fs::read(status_path(iface)).ok()?).ok()
}

/// The node's receive-memory budget in the status: its size and each interface's share.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct NodeBudget {
    pub budget_bytes: u64,
    pub shares: Vec<Share>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_cost_is_said_once_it_has_moved_enough() {
        let mut cm = CmStatus {
            engine_cpu_ns: 300_000_000,
            ..CmStatus::default()
        };
        assert_eq!(cm.engine_cpu_s_per_gb(), None, "nothing moved");
        cm.engine.insert("tx_bytes".into(), COST_MIN_BYTES / 2);
        cm.engine.insert("rx_bytes".into(), COST_MIN_BYTES / 2 - 1);
        assert_eq!(cm.engine_cpu_s_per_gb(), None, "a byte short");
        cm.engine.insert("rx_bytes".into(), COST_MIN_BYTES / 2);
        assert!(cm.engine_cpu_s_per_gb().is_some(), "just enough");
        cm.engine
            .insert("tx_bytes".into(), 1_000_000_000 - COST_MIN_BYTES / 2);
        // 0.3 s of CPU over 1 GB, sent and received together.
        let cost = cm.engine_cpu_s_per_gb().unwrap();
        assert!((cost - 0.3).abs() < 1e-9, "{cost}");
    }

    #[test]
    fn a_peers_state_is_its_name_in_json() {
        for s in CmPeerState::ALL {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.name()));
            assert_eq!(serde_json::from_str::<CmPeerState>(&json).unwrap(), s);
        }
    }
}
