//! Connected mode: the handshake that sets up RC connections over the IP path ([`handshake`]),
//! its wire format ([`wire`], pure), and a peer's address found from its IP address
//! ([`peer`]).

pub mod handshake;
pub mod peer;
pub mod wire;

pub use handshake::{Cm, Connection, Gone, SetupConfig, SetupError};
pub use peer::{Resolve, ipoib_hwaddr, lab_ud_qpn};
pub use wire::{HwAddr, RejectReason};
