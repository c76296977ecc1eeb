//! Control plane of the IPoIB hybrid datapath.
//!
//! One module per concern: [`datapath`] loads the eBPF object, [`maps`] reads and writes its
//! maps with the shared types of `ipoib-common`, [`attach`] attaches, adopts and detaches
//! (pins; an earlier layout's pins replaced in place by [`attach::upgrade`]), [`netdev`] asks the kernel about interfaces, [`policy`] parses and validates policy
//! changes (pure), [`promotion`] decides which peers get a CM connection (pure), [`status`] gathers and renders what the datapath reports, [`clock`] is the
//! clock both sides share, [`tun`] is the CM engine's TUN device, [`steer`] steers its queues by destination, [`connmgr`] runs the CM side of `attach` (plan, engine, handshake, promotion, peer map), [`engine`] moves packets between the TUN device and RC connections, [`verbs`] is the only module that touches verbs and [`cm`] sets up
//! RC connections with the handshake over the IP path.

pub mod attach;
pub mod clock;
pub mod cm;
pub mod config;
pub mod connmgr;
pub mod daemon;
pub mod datapath;
pub mod doctor;
pub mod engine;
pub mod exit;
pub mod files;
pub mod iblink;
pub mod ledger;
pub mod maps;
pub mod metrics;
pub mod netdev;
pub mod path;
pub mod plan;
pub mod policy;
pub mod promotion;
pub mod rtnl;
pub mod service;
pub mod signals;
pub mod status;
pub mod steer;
pub mod tun;
pub mod verbs;
