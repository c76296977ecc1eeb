//! Connected mode: the handshake that sets up RC connections over the IP path ([`handshake`]),
//! its wire format ([`wire`], pure), a peer's address found from its IP address ([`peer`]),
//! and the path records of the setups ([`paths`]).

pub mod handshake;
mod paths;
pub mod peer;
pub mod wire;

pub use handshake::{Cm, Connection, Gone, SetupConfig, SetupError};
pub use peer::{Resolve, ipoib_hwaddr, lab_ud_qpn};
pub use wire::{HwAddr, RejectReason};
