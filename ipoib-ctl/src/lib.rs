//! Control plane of the IPoIB hybrid datapath.
//!
//! One module per concern: [`datapath`] loads the eBPF object, [`maps`] reads and writes its
//! maps with the shared types of `ipoib-common`, [`clock`] is the clock both sides share.

pub mod clock;
pub mod datapath;
pub mod maps;
