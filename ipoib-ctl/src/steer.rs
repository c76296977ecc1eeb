//! Which queue of the engine's multi-queue TUN device a packet the kernel transmits on it goes
//! to: the queue of the engine that holds its destination's connection. Without steering the
//! kernel spreads flows over the queues by their hash, so one peer's flows would reach its
//! connection from several engines; with it, each peer is read by one.
//!
//! The program (`ipoib_tun_steer`, a socket filter given to the device with
//! TUNSETSTEERINGEBPF) looks the destination address up in `ipoib_tun_queue`; a destination
//! with no entry goes to queue 0. The map is not pinned; it is emptied for each device.

use std::{
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
    sync::Mutex,
};

use aya::{
    Ebpf, EbpfError, EbpfLoader,
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

/// The program and its map, loaded once per process (a process runs connected mode on one
/// interface): a device made later, when connected mode starts again, is given the same
/// program with its map emptied, without the load's cost again (tens of milliseconds of
/// parsing, seconds under emulation, on the control loop's restart). Kept until the process
/// ends (its map's kernel memory with it), unpinned.
static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

struct Loaded {
    queues: HashMap<MapData, PeerKey, u32>,
    /// The program's fd, owned by `ebpf`.
    prog: libc::c_int,
    /// Holds the program (a device holds its own reference once given it).
    _ebpf: Ebpf,
}

impl Loaded {
    fn load() -> Result<Self, SteerError> {
        // No kernel BTF: the program reads no kernel structure (no CO-RE relocation), and
        // `Ebpf::load` would parse the kernel's BTF a second time.
        let mut ebpf = EbpfLoader::new().btf(None).load(STEER_OBJECT)?;
        let prog: &mut SocketFilter = ebpf
            .program_mut(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .ok_or(SteerError::Missing)?;
        prog.load()?;
        let prog = prog.fd()?.as_fd().as_raw_fd();
        let map = ebpf.take_map(MAP).ok_or(SteerError::Missing)?;
        Ok(Self {
            queues: HashMap::try_from(map)?,
            prog,
            _ebpf: ebpf,
        })
    }

    /// Every entry removed.
    fn empty(&mut self) -> Result<(), SteerError> {
        let keys = self.queues.keys().collect::<Result<Vec<_>, _>>()?;
        for k in keys {
            self.queues.remove(&k)?;
        }
        Ok(())
    }
}

/// The steering program, given to one TUN device, and its map. Dropped, it is kept for the
/// next device (the program is loaded once per process).
pub struct Steering(Option<Loaded>);

impl Drop for Steering {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            *LOADED.lock().unwrap_or_else(|p| p.into_inner()) = Some(l);
        }
    }
}

impl Steering {
    /// Gives the program to the device `tun` is a queue of (any queue: the program is the
    /// device's), loaded the first time. Every destination goes to queue 0 until
    /// [`Steering::set`].
    pub fn attach(tun: &Tun) -> Result<Self, SteerError> {
        let cached = LOADED.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Kept for the next device even when this one refuses it.
        let mut this = Self(Some(match cached {
            Some(l) => l,
            None => Loaded::load()?,
        }));
        let loaded = this.loaded();
        loaded.empty()?;
        // SAFETY: TUNSETSTEERINGEBPF reads an int (the program's fd) from the pointer.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETSTEERINGEBPF, &loaded.prog) } < 0 {
            return Err(SteerError::Attach {
                name: tun.name().to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(this)
    }

    fn loaded(&mut self) -> &mut Loaded {
        self.0.as_mut().expect("held until dropped")
    }

    /// `ip`'s packets to queue `queue` from now on.
    pub fn set(&mut self, ip: IpAddr, queue: u32) -> Result<(), SteerError> {
        Ok(self.loaded().queues.insert(PeerKey::from(ip), queue, 0)?)
    }

    /// `ip`'s packets to queue 0 again, if they went to `queue` (another engine may have
    /// taken the destination since).
    pub fn clear(&mut self, ip: IpAddr, queue: u32) -> Result<(), SteerError> {
        let key = PeerKey::from(ip);
        let queues = &mut self.loaded().queues;
        match queues.get(&key, 0) {
            Ok(q) if q == queue => Ok(queues.remove(&key)?),
            Ok(_) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The queue `ip` is steered to (`None`: no entry, queue 0).
    pub fn get(&self, ip: IpAddr) -> Result<Option<u32>, SteerError> {
        let loaded = self.0.as_ref().expect("held until dropped");
        match loaded.queues.get(&PeerKey::from(ip), 0) {
            Ok(q) => Ok(Some(q)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}
