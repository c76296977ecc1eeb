//! The eBPF object and its loading.

use aya::{
    Ebpf, EbpfError, EbpfLoader,
    programs::{ProgramError, SchedClassifier, Xdp},
};
use ipoib_common::prog_names;

use crate::maps::{DatapathMaps, MapsError, PeerCacheCounts};

/// The fast path's eBPF object, built by this crate's build script.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ipoib-ebpf"));

/// Trivial programs of the same types (`baseline_tc`, `baseline_xdp`), for benchmarks.
pub static BASELINE_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ipoib-baseline"));

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("loading the eBPF object failed (needs root, or CAP_BPF and CAP_NET_ADMIN): {0}")]
    Object(#[from] EbpfError),
    #[error("program {name} is missing from the eBPF object or has the wrong type")]
    MissingProgram { name: &'static str },
    #[error("the kernel refused program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("reading what the kernel holds of program {name}: {source}")]
    Info {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error(transparent)]
    Maps(#[from] MapsError),
}

/// The programs loaded into the kernel (not attached), and their maps. Egress is loaded with
/// the object; an ingress program on first use, so only the hook attached is verified.
pub struct Datapath {
    ebpf: Ebpf,
    /// Must stay alive: dropping it closes the log map the programs refer to.
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    pub maps: DatapathMaps,
}

impl Datapath {
    /// Loads the object, verifies and loads the egress program, and takes the maps.
    pub fn load() -> Result<Self, DatapathError> {
        Self::load_pinned(None)
    }

    /// Like [`Datapath::load`], pinning every map under `pin_dir` (an existing bpffs
    /// directory) as it is taken.
    pub fn load_pinned(pin_dir: Option<&std::path::Path>) -> Result<Self, DatapathError> {
        Self::load_object(EBPF_OBJECT, pin_dir)
    }

    /// Like [`Datapath::load_pinned`], from another build of the object (`object`: the bytes
    /// of its ELF file; a benchmark times one beside this build's).
    pub fn load_object(
        object: &[u8],
        pin_dir: Option<&std::path::Path>,
    ) -> Result<Self, DatapathError> {
        raise_memlock_limit();
        // No kernel BTF for relocation: the programs read no kernel structure (no CO-RE).
        // `Ebpf::load` would parse the kernel's BTF (megabytes) a second time.
        let mut ebpf = EbpfLoader::new().btf(None).load(object)?;
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!("eBPF logger not initialised: {e}");
                None
            }
        };
        let name = prog_names::EGRESS;
        program::<SchedClassifier>(&mut ebpf, name)?
            .load()
            .map_err(|source| DatapathError::Program { name, source })?;
        let maps = DatapathMaps::take(&mut ebpf, pin_dir)?;
        Ok(Self { ebpf, logger, maps })
    }

    pub fn egress(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        program(&mut self.ebpf, prog_names::EGRESS)
    }

    /// The XDP ingress program, loaded on first use.
    pub fn ingress(&mut self) -> Result<&mut Xdp, DatapathError> {
        let name = prog_names::INGRESS;
        let prog: &mut Xdp = program(&mut self.ebpf, name)?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        Ok(prog)
    }

    /// The TC ingress program (IPoIB's hook), loaded on first use.
    pub fn ingress_tc(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        let name = prog_names::INGRESS_TC;
        let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        Ok(prog)
    }

    /// What the programs' peer cache answered since they were loaded (`None`: this object's
    /// programs do not count it); see [`crate::maps::peer_cache_of`].
    pub fn peer_cache(&mut self) -> Result<Option<PeerCacheCounts>, DatapathError> {
        let name = prog_names::EGRESS;
        let info = self
            .egress()?
            .info()
            .map_err(|source| DatapathError::Info { name, source })?;
        Ok(crate::maps::peer_cache_of(&info, name)?)
    }

    /// Forwards what the programs logged to `log` (off the hot path: call it from the loop).
    pub fn flush_logs(&mut self) {
        if let Some(l) = self.logger.as_mut() {
            l.flush();
        }
    }
}

/// The program `name` of the object, as its type `T`.
fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .and_then(|p| p.try_into().ok())
        .ok_or(DatapathError::MissingProgram { name })
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; newer ones ignore it.
fn raise_memlock_limit() {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: valid pointer to an rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        tracing::debug!(
            "could not raise RLIMIT_MEMLOCK: {}",
            std::io::Error::last_os_error()
        );
    }
}
