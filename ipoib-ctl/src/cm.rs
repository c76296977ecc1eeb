//! Connected mode: the handshake that sets up RC connections over the IP path ([`handshake`])
//! and its wire format ([`wire`], pure).

pub mod handshake;
pub mod wire;

pub use handshake::{Cm, Connection, Gone, SetupConfig, SetupError};
pub use wire::{HwAddr, RejectReason};
