//! Which queue of the engine's multi-queue TUN device a packet the kernel transmits on it goes
//! to: the queue of the engine that holds its destination's connection. Without steering the
//! kernel spreads flows over the queues by their hash, so one peer's flows would reach its
//! connection from several engines; with it, each peer is read by one.
//!
//! The program (`ipoib_tun_steer`, a socket filter given to the device with
//! TUNSETSTEERINGEBPF) looks the destination address up in `ipoib_tun_queue`; a destination
//! with no entry goes to queue 0. The map is the device's, not pinned: it lives as long as this
//! value and the device.

use std::{
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{
    Ebpf, EbpfError,
    maps::{HashMap, MapData, MapError},
    programs::{ProgramError, SocketFilter},
};
use ipoib_common::PeerKey;

use crate::tun::Tun;

/// The steering program's object, built by this crate's build script.
pub static STEER_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ipoib-steer"));

const PROGRAM: &str = "ipoib_tun_steer";
const MAP: &str = "ipoib_tun_queue";

#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    #[error("loading the TUN steering object failed (needs root, or CAP_BPF): {0}")]
    Object(#[from] EbpfError),
    #[error("the TUN steering object has no socket filter {PROGRAM} or no map {MAP}")]
    Missing,
    #[error("the kernel refused the TUN steering program: {0}")]
    Program(#[from] ProgramError),
    #[error("the TUN steering map: {0}")]
    Map(#[from] MapError),
    #[error("TUNSETSTEERINGEBPF on {name}: {source}")]
    Attach {
        name: String,
        #[source]
        source: std::io::Error,
    },
}

/// The steering program, given to one TUN device, and its map.
pub struct Steering {
    queues: HashMap<MapData, PeerKey, u32>,
    /// Holds the program (the device holds its own reference once given it).
    _ebpf: Ebpf,
}

impl Steering {
    /// Loads the program and gives it to the device `tun` is a queue of (any queue: the
    /// program is the device's). Every destination goes to queue 0 until [`Steering::set`].
    pub fn attach(tun: &Tun) -> Result<Self, SteerError> {
        let mut ebpf = Ebpf::load(STEER_OBJECT)?;
        let prog: &mut SocketFilter = ebpf
            .program_mut(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .ok_or(SteerError::Missing)?;
        prog.load()?;
        let fd: libc::c_int = prog.fd()?.as_fd().as_raw_fd();
        // SAFETY: TUNSETSTEERINGEBPF reads an int (the program's fd) from the pointer.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETSTEERINGEBPF, &fd) } < 0 {
            return Err(SteerError::Attach {
                name: tun.name().to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        let map = ebpf.take_map(MAP).ok_or(SteerError::Missing)?;
        Ok(Self {
            queues: HashMap::try_from(map)?,
            _ebpf: ebpf,
        })
    }

    /// `ip`'s packets to queue `queue` from now on.
    pub fn set(&mut self, ip: IpAddr, queue: u32) -> Result<(), SteerError> {
        Ok(self.queues.insert(PeerKey::from(ip), queue, 0)?)
    }

    /// `ip`'s packets to queue 0 again, if they went to `queue` (another engine may have
    /// taken the destination since).
    pub fn clear(&mut self, ip: IpAddr, queue: u32) -> Result<(), SteerError> {
        let key = PeerKey::from(ip);
        match self.queues.get(&key, 0) {
            Ok(q) if q == queue => Ok(self.queues.remove(&key)?),
            Ok(_) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The queue `ip` is steered to (`None`: no entry, queue 0).
    pub fn get(&self, ip: IpAddr) -> Result<Option<u32>, SteerError> {
        match self.queues.get(&PeerKey::from(ip), 0) {
            Ok(q) => Ok(Some(q)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}
