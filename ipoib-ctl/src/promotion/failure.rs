//! Why a connection setup failed or a connection ended badly, as status, JSON and the
//! metrics name it.

use std::fmt;

/// Why a connection failed or ended badly; in JSON by its key (`not_running`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    Rejected,
    Timeout,
    QpError,
    NoResources,
    /// Nothing of ours answers at the peer: its handshake port refused the TCP connection or
    /// spoke another protocol (a node without ipoib-hybrid, say during a rolling upgrade).
    NotRunning,
    /// The handshake's TCP connection failed otherwise (unreachable, reset).
    Network,
    /// The peer speaks another version of the handshake (an older or newer ipoib-hybrid).
    Version,
    /// No path between the two ports: link layers that differ, or a port without a LID.
    NoPath,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Failure::Rejected => "the peer refused",
            Failure::Timeout => "a timeout",
            Failure::QpError => "a QP error",
            Failure::NoResources => "the peer had no room",
            Failure::NotRunning => {
                "the peer runs no ipoib-hybrid (nothing of ours answers its handshake port)"
            }
            Failure::Network => "a network error on the handshake",
            Failure::Version => {
                "the peer speaks another handshake version (upgrade the older ipoib-hybrid)"
            }
            Failure::NoPath => "no path between the two ports (ipoib-ctl's log says why)",
        })
    }
}

impl Failure {
    pub const ALL: [Failure; 8] = [
        Failure::Rejected,
        Failure::Timeout,
        Failure::QpError,
        Failure::NoResources,
        Failure::NotRunning,
        Failure::Network,
        Failure::Version,
        Failure::NoPath,
    ];

    /// Its key, as JSON and the metrics' `reason` label name it.
    pub fn key(self) -> &'static str {
        match self {
            Failure::Rejected => "rejected",
            Failure::Timeout => "timeout",
            Failure::QpError => "qp_error",
            Failure::NoResources => "no_resources",
            Failure::NotRunning => "not_running",
            Failure::Network => "network",
            Failure::Version => "version",
            Failure::NoPath => "no_path",
        }
    }
}
