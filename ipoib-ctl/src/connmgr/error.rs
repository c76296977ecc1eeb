//! Why connected mode stops or does not start ([`CmError`]), and how a failed setup is filed
//! for the policy ([`Failure`]).

use std::io;

use crate::{
    cm::{RejectReason, SetupError},
    engine::EngineError,
    maps::MapsError,
    netdev::NetdevError,
    promotion::Failure,
    rtnl,
    tun::TunError,
    verbs::VerbsError,
};

#[derive(Debug, thiserror::Error)]
pub enum CmError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error(transparent)]
    Tun(#[from] TunError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The handshake port is taken on this interface.
    #[error(
        "the handshake port (TCP {port}) is taken on {iface}: another `ipoib-ctl attach {iface}`, \
         or another program listening on it for every interface (`ss -ltnp 'sport = {port}'`)"
    )]
    PortTaken { iface: String, port: u16 },
    #[error("RDMA device {0} not found")]
    NoDevice(String),
    #[error("{device} has {ports} port(s); port {port} is not one of them")]
    NoPort { device: String, port: u8, ports: u8 },
    #[error(
        "partition P_Key 0x{pkey:04x} is not in the P_Key table of {device} port {port} \
         (`cat /sys/class/infiniband/{device}/ports/{port}/pkeys/*`; the subnet manager \
         gives the port its partitions)"
    )]
    NoPartition { device: String, port: u8, pkey: u16 },
    #[error("the memory plan for {device} allows no connected mode: {why}")]
    NoPlan { device: String, why: String },
    #[error(
        "memory-budget {} is more than the node's whole budget, {} (`--node-memory-budget`)",
        crate::policy::format_size(*asked), crate::policy::format_size(*node)
    )]
    OverNodeBudget { asked: u64, node: u64 },
    #[error(transparent)]
    Netdev(#[from] NetdevError),
    #[error("the engine stopped: {0}")]
    EngineStopped(String),
    #[error("the handshake listener stopped: {0}")]
    ListenerStopped(String),
    /// Connected mode waits for the port: UD until it is ready, looked at again soon.
    #[error("{device} port {port} is not ready for connected mode: {why}")]
    PortNotReady {
        device: String,
        port: u8,
        why: crate::path::PortNotReady,
    },
    /// Something about the port changed: connected mode starts again on the port as it is
    /// now, as the kernel's IPoIB flushes its paths and connections.
    #[error("{device} port {port}: {event}")]
    PortEvent {
        device: String,
        port: u8,
        event: crate::path::PortEvent,
    },
}

impl CmError {
    /// Whether the error is the port's: connected mode is started again as soon as the port
    /// is ready, with no backoff that grows (a port that comes and goes is the subnet's
    /// doing, not a fault of ours to slow down for).
    pub fn is_the_ports(&self) -> bool {
        matches!(self, Self::PortNotReady { .. } | Self::PortEvent { .. })
    }
}

/// A netlink request's failure is the interface's, as the exit codes tell them apart.
impl From<rtnl::RtnlError> for CmError {
    fn from(e: rtnl::RtnlError) -> Self {
        CmError::Netdev(e.into())
    }
}

impl From<&SetupError> for Failure {
    fn from(e: &SetupError) -> Self {
        match e {
            SetupError::Rejected(RejectReason::NoResources | RejectReason::Busy)
            | SetupError::Busy
            | SetupError::Full => Failure::NoResources,
            SetupError::Rejected(RejectReason::Version)
            | SetupError::Malformed(crate::cm::wire::WireError::Version(_)) => Failure::Version,
            SetupError::Rejected(RejectReason::NoPath) | SetupError::NoPath(_) => Failure::NoPath,
            SetupError::Rejected(_)
            | SetupError::Crossed
            | SetupError::InProgress
            | SetupError::WrongPeer { .. } => Failure::Rejected,
            SetupError::Timeout(_) => Failure::Timeout,
            SetupError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Failure::NotRunning
            }
            SetupError::Malformed(_) | SetupError::Unexpected(_) => Failure::NotRunning,
            SetupError::Io(_) => Failure::Network,
            SetupError::Verbs(_) => Failure::QpError,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What status says of a failed setup comes from here: a refused handshake port is a peer
    /// without ipoib-hybrid, not a QP error.
    #[test]
    fn setup_errors_are_filed_as_what_they_are() {
        use std::io::{Error, ErrorKind};

        use crate::cm::wire::WireError;
        let f = |e: SetupError| Failure::from(&e);
        assert_eq!(
            f(SetupError::Io(Error::from(ErrorKind::ConnectionRefused))),
            Failure::NotRunning
        );
        assert_eq!(
            f(SetupError::Unexpected(crate::cm::wire::Kind::Rep)),
            Failure::NotRunning
        );
        assert_eq!(
            f(SetupError::Io(Error::from(ErrorKind::ConnectionReset))),
            Failure::Network
        );
        assert_eq!(f(SetupError::Timeout("REP")), Failure::Timeout);
        assert_eq!(f(SetupError::Full), Failure::NoResources);
        assert_eq!(
            f(SetupError::Rejected(RejectReason::NoResources)),
            Failure::NoResources
        );
        assert_eq!(f(SetupError::Crossed), Failure::Rejected);
        // An older node answers a REJ in its own version, or its REQ shows its version.
        assert_eq!(
            f(SetupError::Rejected(RejectReason::Version)),
            Failure::Version
        );
        assert_eq!(
            f(SetupError::Malformed(WireError::Version(1))),
            Failure::Version
        );
        assert_eq!(
            f(SetupError::Malformed(WireError::Gid)),
            Failure::NotRunning
        );
        assert_eq!(
            f(SetupError::Rejected(RejectReason::NoPath)),
            Failure::NoPath
        );
        assert_eq!(
            f(SetupError::NoPath(crate::path::NoPath::NoRemoteLid)),
            Failure::NoPath
        );
        assert_eq!(
            f(SetupError::Rejected(RejectReason::Policy)),
            Failure::Rejected
        );
    }
}
