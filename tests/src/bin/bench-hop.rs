//! `cargo xtask bench hop` (this machine's kernel, root): what the CM engine's userspace hop
//! costs on a real CPU, beside the kernel paths it competes with. The VM cannot tell: under
//! software emulation every path is slow. TCP (iperf3) between two network namespaces, with 1
//! and N streams, over these paths, interleaved in one run (`--paths` picks some):
//!
//! - `hop`: each namespace has a TUN device opened as the engine opens its own (virtio-net
//!   header, checksum and TSO offloads, MTU 65520); one thread per direction reads a packet
//!   from one into a buffer of a send slot's size and writes it into the other: the sender's
//!   engine reading its TUN and the receiver's engine writing its own. No RC between them: on
//!   an HCA the transfer is DMA, which costs the CPU nothing.
//! - `hop-2copy`: the same, but each packet is copied once more (read into a buffer, then
//!   copied into the slot) as the engine did before it read into its send slots directly.
//! - `hop-2q`: `hop` on multi-queue TUN devices (IFF_MULTI_QUEUE), two queues each and a
//!   thread per queue and direction: what an engine task per queue would give. The kernel
//!   spreads flows over the queues by their hash, so one stream uses one queue.
//! - `hop-uring`: `hop` with io_uring in place of a `read` and a `write` per packet: per
//!   direction a ring, [`URING_DEPTH`] buffers of a send slot's size registered with it (as
//!   the engine's send slots would be), a read of each kept queued on the one device, each
//!   packet read written into the other device from the same buffer, and the buffer queued for
//!   a read again once written: one `io_uring_enter` per batch of completions.
//! - `hop-mmap`: the sender's side takes its packets from a packet-mmap ring in place of TUN
//!   reads. Each namespace sends through an ifb device (what the fast path would redirect to:
//!   its transmit frees a packet that no TC action redirected to it, as a dummy device's does,
//!   and ifb is built into kernels that lack dummy), whose outgoing packets the kernel
//!   copies, GSO super-packets whole with their vnet header, into the frames of a TPACKET_V2
//!   receive ring on an AF_PACKET socket (one frame per packet, [`RING_FRAMES`] of them); the
//!   relay writes each frame's packet from the ring itself into the other namespace's TUN
//!   device through io_uring, and hands the frame back once written. No system call per
//!   packet on either side, and no copy in userspace.
//! - `ud-2044`: a veth pair, MTU 2044, TSO and GSO off on the sender, GRO off on the receiver:
//!   IPoIB datagram mode on an HCA without offloads, a cost per 2 KiB packet on both sides.
//! - `ud-4092`: MTU 4092, segmentation in software (GSO) on the sender, GRO on the receiver:
//!   close to Enhanced IPoIB on mlx5, but that its HCA segments for free.
//! - `veth`: a plain veth pair with every offload (the kernel's best case).
//!
//! Measured per run: Gbit/s (iperf3's receiver side), CPU seconds per GB moved over all CPUs
//! (/proc/stat across the run: iperf3 on both ends, the kernel's softirqs, the relay), and
//! for the hops the relay's own CPU per GB (this process's, io_uring's workers included), the
//! mean of the data packets it moved (1 KiB or more), its other packets (ACKs) per data packet
//! and its system calls per packet; for `hop-mmap` the packets its rings
//! dropped for want of a free frame. The median
//! of the rounds is reported, with ratios to `veth` of the same stream count. One JSON line
//! after `BENCH-JSON `; `--out` saves it.
//!
//! With `hop-mmap`, first: whether this kernel lets a packet ring's mapping be registered,
//! as io_uring fixed buffers and as a verbs memory region on the first RDMA device (which
//! would let its frames be sent over RC with no copy in userspace at all).

use std::{
    collections::BTreeMap,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::{Result, ensure};
use clap::Parser;
use ipoib_ctl::tun::{TUN_READ_MAX, Tun, VNET_HDR_LEN, VnetHdr};
use ipoib_tests::{
    bench::{NsPair, TICKS_PER_S, median, publish, sh, stat_ticks},
    cmlab::in_netns,
};
use serde_json::json;

#[derive(Parser)]
#[command(about = "TCP through the engine's TUN hop vs the kernel's UD stand-ins and veth")]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Interleaved rounds; the median of each measurement is reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Parallel TCP streams of the many-stream case (the other is 1).
    #[arg(long, default_value_t = 4)]
    streams: u32,
    /// Only these paths (by name, e.g. `hop,hop-uring,veth`); all when not given. The ratios
    /// need `veth`.
    #[arg(long, value_delimiter = ',')]
    paths: Vec<String>,
    /// Where to save the JSON result.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Hop,
    Hop2Copy,
    Hop2Q,
    HopUring,
    HopMmap,
    Ud2044,
    Ud4092,
    Veth,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::Hop,
        Kind::Hop2Copy,
        Kind::Hop2Q,
        Kind::HopUring,
        Kind::HopMmap,
        Kind::Ud2044,
        Kind::Ud4092,
        Kind::Veth,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Hop => "hop",
            Kind::Hop2Copy => "hop-2copy",
            Kind::Hop2Q => "hop-2q",
            Kind::HopUring => "hop-uring",
            Kind::HopMmap => "hop-mmap",
            Kind::Ud2044 => "ud-2044",
            Kind::Ud4092 => "ud-4092",
            Kind::Veth => "veth",
        }
    }

    /// MTU, and the `ethtool -K` settings of the sender's and the receiver's device.
    fn veth(
        self,
    ) -> Option<(
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
    )> {
        match self {
            Kind::Hop | Kind::Hop2Copy | Kind::Hop2Q | Kind::HopUring | Kind::HopMmap => None,
            Kind::Ud2044 => Some(("2044", &["tso", "off", "gso", "off"], &["gro", "off"])),
            Kind::Ud4092 => Some(("4092", &["tso", "off", "gso", "on"], &["gro", "on"])),
            Kind::Veth => Some(("1500", &[], &[])),
        }
    }
}

/// Packets of at least this many bytes carry data; the rest are ACKs and the like.
const LARGE: u64 = 1024;

/// What a relay thread moved.
#[derive(Default)]
struct Moved {
    /// Packets a packet ring had no free frame for (read from the socket now and then).
    drops: AtomicU64,
    /// System calls made moving them (reads, writes and waits; io_uring enters).
    calls: AtomicU64,
    packets: AtomicU64,
    /// Packets of [`LARGE`] bytes or more, and their bytes.
    large: AtomicU64,
    large_bytes: AtomicU64,
    errors: AtomicU64,
}

impl Moved {
    /// Counts one packet of `n` bytes moved.
    fn packet(&self, n: u64) {
        self.packets.fetch_add(1, Ordering::Relaxed);
        if n >= LARGE {
            self.large.fetch_add(1, Ordering::Relaxed);
            self.large_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// What every relay thread of a hop moved so far, or between two points.
#[derive(Clone, Copy, Default)]
struct Totals {
    packets: u64,
    large: u64,
    large_bytes: u64,
    errors: u64,
    calls: u64,
    drops: u64,
}

impl Totals {
    fn since(self, before: Totals) -> Totals {
        Totals {
            packets: self.packets - before.packets,
            large: self.large - before.large,
            large_bytes: self.large_bytes - before.large_bytes,
            errors: self.errors - before.errors,
            calls: self.calls - before.calls,
            drops: self.drops - before.drops,
        }
    }
}

/// The hop: two TUN devices and a thread per queue and direction between them.
struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    moved: Vec<Arc<Moved>>,
}

impl Relay {
    /// CPU ticks (user + system) of this process so far: the relay threads, and the worker
    /// threads io_uring may start for them (the other pairs' relays sit idle meanwhile).
    fn ticks(&self) -> Result<u64> {
        stat_ticks("/proc/self/stat")
    }

    /// What every relay thread moved so far.
    fn totals(&self) -> Totals {
        let f = |get: fn(&Moved) -> &AtomicU64| {
            self.moved
                .iter()
                .map(|m| get(m).load(Ordering::Relaxed))
                .sum()
        };
        Totals {
            packets: f(|m| &m.packets),
            large: f(|m| &m.large),
            large_bytes: f(|m| &m.large_bytes),
            errors: f(|m| &m.errors),
            calls: f(|m| &m.calls),
            drops: f(|m| &m.drops),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How a relay thread moves packets from one device to the other.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mover {
    /// A `read` and a `write` per packet, as the engine does.
    Syscalls,
    /// The same, with each packet copied once more between them.
    Copy,
    /// io_uring, [`URING_DEPTH`] registered buffers in turn.
    Uring,
}

/// Buffers per io_uring relay: reads kept queued on its device, and writes in flight.
const URING_DEPTH: usize = 32;

/// Moves packets from `from` to `to` as the engine does: non-blocking reads until the device
/// has no more, then a wait for readiness. With `copy`, each packet is copied into a second
/// buffer before it is written (the engine's transmit before it read into its send slots).
fn relay(from: Arc<Tun>, to: Arc<Tun>, copy: bool, stop: Arc<AtomicBool>, moved: Arc<Moved>) {
    let mut buf = vec![0u8; TUN_READ_MAX];
    let mut slot = vec![0u8; if copy { TUN_READ_MAX } else { 0 }];
    while !stop.load(Ordering::Relaxed) {
        moved.calls.fetch_add(1, Ordering::Relaxed);
        match from.recv(&mut buf) {
            Ok(n) => {
                let pkt = if copy {
                    slot[..n].copy_from_slice(&buf[..n]);
                    &slot[..n]
                } else {
                    &buf[..n]
                };
                moved.calls.fetch_add(1, Ordering::Relaxed);
                if to.send(pkt).is_ok() {
                    moved.packet(n as u64);
                } else {
                    moved.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut pfd = libc::pollfd {
                    fd: from.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                moved.calls.fetch_add(1, Ordering::Relaxed);
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, 100) };
            }
            Err(_) => return,
        }
    }
}

/// `user_data` bit of a write's completion; the low bits are the buffer's index.
const WRITTEN: u64 = 1 << 32;

/// Moves packets from `from` to `to` through one io_uring: each of [`URING_DEPTH`] registered
/// buffers is read into on `from` (the reads stay queued in the kernel until a packet comes),
/// written from on `to` once filled, then read into again once written. A failed relay
/// counts one error and stops.
fn relay_uring(from: &Tun, to: &Tun, stop: &AtomicBool, moved: &Moved) {
    if let Err(e) = try_relay_uring(from, to, stop, moved) {
        eprintln!("io_uring relay: {e}");
        moved.errors.fetch_add(1, Ordering::Relaxed);
    }
}

fn try_relay_uring(from: &Tun, to: &Tun, stop: &AtomicBool, moved: &Moved) -> std::io::Result<()> {
    use io_uring::{IoUring, opcode, types};
    let mut ring: IoUring = IoUring::new(2 * URING_DEPTH as u32)?;
    let mut bufs: Vec<Vec<u8>> = (0..URING_DEPTH).map(|_| vec![0u8; TUN_READ_MAX]).collect();
    let iovecs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: the buffers outlive the ring (dropped after it, below), and are not moved.
    unsafe { ring.submitter().register_buffers(&iovecs)? };
    ring.submitter()
        .register_files(&[from.as_raw_fd(), to.as_raw_fd()])?;
    let read = |i: usize| {
        opcode::ReadFixed::new(
            types::Fixed(0),
            iovecs[i].iov_base.cast(),
            TUN_READ_MAX as u32,
            i as u16,
        )
        .build()
        .user_data(i as u64)
    };
    let write = |i: usize, n: u32| {
        opcode::WriteFixed::new(types::Fixed(1), iovecs[i].iov_base.cast(), n, i as u16)
            .build()
            .user_data(WRITTEN | i as u64)
    };
    let mut next: Vec<io_uring::squeue::Entry> = (0..URING_DEPTH).map(read).collect();
    let timeout = types::Timespec::new().nsec(100_000_000);
    let args = types::SubmitArgs::new().timespec(&timeout);
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: every entry names a registered buffer no other entry in flight uses.
        unsafe { ring.submission().push_multiple(&next) }
            .map_err(|_| std::io::Error::other("submission queue full"))?;
        next.clear();
        moved.calls.fetch_add(1, Ordering::Relaxed);
        match ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
            Err(e) => return Err(e),
        }
        for cqe in ring.completion() {
            let i = (cqe.user_data() & 0xffff) as usize;
            let res = cqe.result();
            if cqe.user_data() & WRITTEN != 0 {
                if res < 0 {
                    moved.errors.fetch_add(1, Ordering::Relaxed);
                } else {
                    moved.packet(res as u64);
                }
                next.push(read(i));
            } else if res > 0 {
                next.push(write(i, res as u32));
            } else if res == -libc::EAGAIN || res == -libc::EINTR {
                next.push(read(i));
            } else {
                return Err(std::io::Error::from_raw_os_error(-res));
            }
        }
    }
    drop(ring);
    drop(bufs);
    Ok(())
}

/// The device `hop-mmap` sends through in each namespace.
const RING_DEV: &str = "hopd";

/// Frames of a `hop-mmap` packet ring: packets taken and not yet written.
const RING_FRAMES: usize = 256;

/// One ring frame, in whole pages: the ring's header, the vnet and Ethernet headers, and a
/// 64 KiB packet (a GSO super-packet at most).
const RING_FRAME: usize = (libc::TPACKET2_HDRLEN + 16 + VNET_HDR_LEN + 65536 + 4095) & !4095;

/// An AF_PACKET socket on one device with a TPACKET_V2 receive ring of [`RING_FRAMES`]
/// frames mapped into this process, each taking one outgoing packet with its vnet header.
struct PacketRing {
    fd: OwnedFd,
    map: *mut u8,
}

// SAFETY: the mapping is only reached through `&self` by the one thread that relays from it.
unsafe impl Send for PacketRing {}

impl PacketRing {
    /// Opens the ring on `dev` of the calling thread's network namespace.
    fn open(dev: &str) -> std::io::Result<Self> {
        let err = std::io::Error::last_os_error;
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket call; the fd is owned at once.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                all.into(),
            )
        };
        if raw < 0 {
            return Err(err());
        }
        // SAFETY: fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let set = |opt: libc::c_int, val: *const libc::c_void, len: usize| {
            // SAFETY: val points at len readable bytes.
            let rc = unsafe {
                libc::setsockopt(raw, libc::SOL_PACKET, opt, val, len as libc::socklen_t)
            };
            if rc < 0 {
                let e = err();
                Err(std::io::Error::new(
                    e.kind(),
                    format!("SOL_PACKET option {opt}: {e}"),
                ))
            } else {
                Ok(())
            }
        };
        let (v2, on) = (
            libc::tpacket_versions::TPACKET_V2 as libc::c_int,
            1 as libc::c_int,
        );
        set(libc::PACKET_VERSION, (&raw const v2).cast(), 4)?;
        // The vnet header keeps a GSO super-packet whole, as TUN reads give it.
        set(libc::PACKET_VNET_HDR, (&raw const on).cast(), 4)?;
        let req = libc::tpacket_req {
            tp_block_size: RING_FRAME as u32,
            tp_block_nr: RING_FRAMES as u32,
            tp_frame_size: RING_FRAME as u32,
            tp_frame_nr: RING_FRAMES as u32,
        };
        let req_ptr = (&raw const req).cast::<libc::c_void>();
        set(
            libc::PACKET_RX_RING,
            req_ptr,
            size_of::<libc::tpacket_req>(),
        )?;
        // SAFETY: maps the ring just made on this socket.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RING_FRAME * RING_FRAMES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(err());
        }
        let ring = Self {
            fd,
            map: map.cast(),
        };
        let name = std::ffi::CString::new(dev).map_err(std::io::Error::other)?;
        // SAFETY: a valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(err());
        }
        // SAFETY: sockaddr_ll is plain old data; zero is valid.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = all;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: binds to a valid sockaddr_ll of its size.
        let rc = unsafe {
            libc::bind(
                raw,
                (&raw const addr).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(err());
        }
        Ok(ring)
    }

    /// The socket's pending error (which `poll` keeps reporting until it is read).
    fn take_error(&self) -> std::io::Error {
        let mut e: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: SO_ERROR writes one int.
        unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut e).cast(),
                &mut len,
            )
        };
        std::io::Error::from_raw_os_error(e)
    }

    /// Packets dropped for want of a free frame since the last call.
    fn drops(&self) -> std::io::Result<u64> {
        /// `struct tpacket_stats` and its socket option (not in the libc crate).
        #[repr(C)]
        struct TpacketStats {
            packets: u32,
            drops: u32,
        }
        const PACKET_STATISTICS: libc::c_int = 6;
        let mut st = TpacketStats {
            packets: 0,
            drops: 0,
        };
        let mut len = size_of::<TpacketStats>() as libc::socklen_t;
        // SAFETY: PACKET_STATISTICS writes at most len bytes into st (and resets them).
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_STATISTICS,
                (&raw mut st).cast(),
                &mut len,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st.drops.into())
    }

    /// Frame `i`'s header.
    fn header(&self, i: usize) -> *mut libc::tpacket2_hdr {
        // SAFETY: i < RING_FRAMES, inside the mapping.
        unsafe { self.map.add(i * RING_FRAME).cast() }
    }

    /// Frame `i`'s status word, shared with the kernel.
    fn status(&self, i: usize) -> &AtomicU32 {
        // SAFETY: tp_status is the header's first field, an aligned u32 the kernel also
        // reads and writes.
        unsafe { AtomicU32::from_ptr(self.header(i).cast()) }
    }
}

impl Drop for PacketRing {
    fn drop(&mut self) {
        // SAFETY: the mapping made in open, unmapped once.
        unsafe { libc::munmap(self.map.cast(), RING_FRAME * RING_FRAMES) };
    }
}

/// Whether a packet ring's mapping can be registered with io_uring (as fixed buffers) and
/// with verbs (as a memory region on the first RDMA device, read-only and writable): "ok",
/// or the error.
fn ring_registration() -> serde_json::Value {
    let ring = match PacketRing::open("lo") {
        Ok(r) => r,
        Err(e) => return json!({ "ring": e.to_string() }),
    };
    let len = RING_FRAME * RING_FRAMES;
    let outcome = |r: std::io::Result<()>| r.map_or_else(|e| e.to_string(), |()| "ok".into());
    let uring = io_uring::IoUring::new(4).and_then(|ring_| {
        let iov = libc::iovec {
            iov_base: ring.map.cast(),
            iov_len: len,
        };
        // SAFETY: the mapping outlives the io_uring, which is dropped at once.
        unsafe { ring_.submitter().register_buffers(&[iov]) }
    });
    json!({
        "io_uring_fixed_buffers": outcome(uring),
        "verbs_mr_read": verbs_register(ring.map, len, 0),
        "verbs_mr_write": verbs_register(
            ring.map,
            len,
            ibverbs_sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        ),
    })
}

/// Registers `len` bytes at `addr` with `access` as a memory region on the first RDMA device,
/// then lets it go: "ok on DEVICE", the error, or "no RDMA device".
fn verbs_register(addr: *mut u8, len: usize, access: i32) -> String {
    use ibverbs_sys as v;
    let err = || std::io::Error::last_os_error().to_string();
    let mut n = 0;
    // SAFETY: plain verbs calls; each object made is let go before return, in reverse.
    unsafe {
        let list = v::ibv_get_device_list(&mut n);
        if list.is_null() || n == 0 {
            if !list.is_null() {
                v::ibv_free_device_list(list);
            }
            return "no RDMA device".into();
        }
        let dev = *list;
        let name = std::ffi::CStr::from_ptr(v::ibv_get_device_name(dev))
            .to_string_lossy()
            .into_owned();
        let ctx = v::ibv_open_device(dev);
        v::ibv_free_device_list(list);
        if ctx.is_null() {
            return format!("ibv_open_device {name}: {}", err());
        }
        let pd = v::ibv_alloc_pd(ctx);
        let out = if pd.is_null() {
            format!("ibv_alloc_pd {name}: {}", err())
        } else {
            let mr = v::ibv_reg_mr(pd, addr.cast(), len, access);
            let out = if mr.is_null() {
                format!("ibv_reg_mr on {name}: {}", err())
            } else {
                v::ibv_dereg_mr(mr);
                format!("ok on {name}")
            };
            v::ibv_dealloc_pd(pd);
            out
        };
        v::ibv_close_device(ctx);
        out
    }
}

/// `user_data` of the poll for a filled frame.
const POLLED: u64 = u64::MAX;

/// Moves packets from `ring` to `to`: each frame the kernel filled is written from the ring
/// itself through io_uring, its vnet header moved up against the IP header (TUN takes no
/// Ethernet header) and its offsets made relative to it, then handed back to the kernel once
/// written. Where no frame is filled, a poll for one waits in the same ring: one
/// `io_uring_enter` per turn.
fn relay_ring(ring: &PacketRing, to: &Tun, stop: &AtomicBool, moved: &Moved) {
    if let Err(e) = try_relay_ring(ring, to, stop, moved) {
        eprintln!("packet ring relay: {e}");
        moved.errors.fetch_add(1, Ordering::Relaxed);
    }
}

fn try_relay_ring(
    ring: &PacketRing,
    to: &Tun,
    stop: &AtomicBool,
    moved: &Moved,
) -> std::io::Result<()> {
    use io_uring::{IoUring, opcode, types};
    let mut uring: IoUring = IoUring::new(RING_FRAMES as u32)?;
    uring.submitter().register_files(&[to.as_raw_fd()])?;
    // The next frame to take, how many taken frames are being written, and whether a poll
    // for more is queued.
    let (mut head, mut writing, mut polling) = (0usize, 0usize, false);
    let timeout = types::Timespec::new().nsec(100_000_000);
    let args = types::SubmitArgs::new().timespec(&timeout);
    let mut turns = 0u64;
    while !stop.load(Ordering::Relaxed) {
        turns += 1;
        if turns.is_multiple_of(1024) {
            moved.drops.fetch_add(ring.drops()?, Ordering::Relaxed);
        }
        let mut taken = 0;
        while writing + taken < RING_FRAMES {
            let i = (head + taken) % RING_FRAMES;
            if ring.status(i).load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
                break;
            }
            taken += 1;
            let h = ring.header(i);
            // SAFETY: a frame the kernel handed over is ours until its status goes back.
            let (len, snap, mac, net) = unsafe {
                let h = &*h;
                (h.tp_len, h.tp_snaplen, h.tp_mac as usize, h.tp_net as usize)
            };
            // SAFETY: the frame's bytes, inside the mapping.
            let frame = unsafe { std::slice::from_raw_parts_mut(h.cast::<u8>(), RING_FRAME) };
            let l2 = (net - mac) as u16;
            let vnet = VnetHdr::parse(&frame[mac - VNET_HDR_LEN..mac]);
            let Some(mut vnet) = vnet.filter(|_| len == snap && net >= VNET_HDR_LEN + mac) else {
                moved.errors.fetch_add(1, Ordering::Relaxed);
                // An empty write keeps the frames handed back in order.
                let sqe = opcode::Nop::new().build().user_data(i as u64);
                // SAFETY: a no-op names no memory.
                unsafe { uring.submission().push(&sqe) }.map_err(std::io::Error::other)?;
                continue;
            };
            vnet.csum_start = vnet.csum_start.saturating_sub(l2);
            vnet.hdr_len = vnet.hdr_len.saturating_sub(l2);
            frame[net - VNET_HDR_LEN..net].copy_from_slice(&vnet.encode());
            let pkt = frame[net - VNET_HDR_LEN..].as_ptr();
            let n = (snap as usize - (net - mac) + VNET_HDR_LEN) as u32;
            let sqe = opcode::Write::new(types::Fixed(0), pkt, n)
                .build()
                .user_data(i as u64);
            // SAFETY: the frame stays ours, unchanged, until this write completes.
            unsafe { uring.submission().push(&sqe) }.map_err(std::io::Error::other)?;
        }
        head = (head + taken) % RING_FRAMES;
        writing += taken;
        if taken == 0 && !polling {
            // Nothing to take: wait in the same enter for the socket to be readable.
            let fd = types::Fd(ring.fd.as_raw_fd());
            let sqe = opcode::PollAdd::new(fd, libc::POLLIN as u32)
                .build()
                .user_data(POLLED);
            // SAFETY: a poll names no memory.
            unsafe { uring.submission().push(&sqe) }.map_err(std::io::Error::other)?;
            polling = true;
        }
        moved.calls.fetch_add(1, Ordering::Relaxed);
        match uring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
            Err(e) => return Err(e),
        }
        for cqe in uring.completion() {
            if cqe.user_data() == POLLED {
                polling = false;
                if cqe.result() > 0 && cqe.result() & libc::POLLERR as i32 != 0 {
                    return Err(ring.take_error());
                }
                continue;
            }
            if cqe.result() > 0 {
                moved.packet(cqe.result() as u64);
            } else if cqe.result() < 0 {
                moved.errors.fetch_add(1, Ordering::Relaxed);
            }
            ring.status(cqe.user_data() as usize)
                .store(libc::TP_STATUS_KERNEL, Ordering::Release);
            writing -= 1;
        }
    }
    moved.drops.fetch_add(ring.drops()?, Ordering::Relaxed);
    Ok(())
}

/// Two namespaces joined by one path, with an iperf3 server in the second; the relay is
/// stopped, then the namespaces deleted, when dropped.
struct Pair {
    kind: Kind,
    relay: Option<Relay>,
    ends: NsPair,
}

impl Pair {
    fn new(kind: Kind, subnet: u8) -> Result<Self> {
        let mut pair = Pair {
            kind,
            relay: None,
            ends: NsPair::new(&format!("bhop-{}", kind.name()), [97, subnet])?,
        };
        let devs = match kind.veth() {
            None if kind == Kind::HopMmap => pair.hop_mmap()?,
            None => {
                let queues = if kind == Kind::Hop2Q { 2 } else { 1 };
                let mover = match kind {
                    Kind::Hop2Copy => Mover::Copy,
                    Kind::HopUring => Mover::Uring,
                    _ => Mover::Syscalls,
                };
                pair.hop(mover, queues)?
            }
            Some((mtu, tx, rx)) => {
                let names = ["hopva", "hopvb"];
                pair.ends.veth(names, mtu, [tx, rx])?;
                names.map(String::from)
            }
        };
        pair.ends.address(devs.each_ref().map(String::as_str))?;
        pair.ends.serve()?;
        Ok(pair)
    }

    /// The TUN devices, opened as the engine opens its own with `queues` queues each, and
    /// the relay between them: a thread per queue and direction, queue i to queue i.
    fn hop(&mut self, mover: Mover, queues: usize) -> Result<[String; 2]> {
        let [qa, qb] = self.ends.ns.clone().map(|n| {
            in_netns(&n, move || Tun::create_queues("hop%d", queues, true))
                .map(|q| q.into_iter().map(Arc::new).collect::<Vec<_>>())
        });
        let (qa, qb) = (qa?, qb?);
        let names = [qa[0].name().to_string(), qb[0].name().to_string()];
        for (ns, name) in self.ends.ns.iter().zip(&names) {
            let up = ["link", "set", name, "addrgenmode", "none", "mtu", "65520"];
            sh(&[&["ip", "-n", ns][..], &up[..]].concat())?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut moved = Vec::new();
        let mut threads = Vec::new();
        for (a, b) in qa.iter().zip(&qb) {
            for (from, to) in [(a, b), (b, a)] {
                let m = Arc::new(Moved::default());
                let (f, t, s, m2) = (from.clone(), to.clone(), stop.clone(), m.clone());
                threads.push(std::thread::spawn(move || match mover {
                    Mover::Uring => relay_uring(&f, &t, &s, &m2),
                    _ => relay(f, t, mover == Mover::Copy, s, m2),
                }));
                moved.push(m);
            }
        }
        self.relay = Some(Relay {
            stop,
            threads,
            moved,
        });
        Ok(names)
    }

    /// `hop-mmap`'s devices in each namespace, a dummy device to send through (returned: it
    /// gets the address) and a TUN device to receive on, and the relay between them: a thread
    /// per direction from one namespace's packet ring to the other's TUN device.
    fn hop_mmap(&mut self) -> Result<[String; 2]> {
        let mut rings = Vec::new();
        let mut tuns = Vec::new();
        for ns in &self.ends.ns {
            let add = ["link", "add", RING_DEV, "mtu", "65520", "type", "ifb"];
            sh(&[&["ip", "-n", ns][..], &add[..]].concat())?;
            // Up before the ring binds to it: a bind to a device that is down leaves
            // ENETDOWN pending on the socket.
            sh(&["ip", "-n", ns, "link", "set", RING_DEV, "up"])?;
            let tun = in_netns(ns, || Tun::create("hopr%d", true))?;
            let up = [
                "link",
                "set",
                tun.name(),
                "addrgenmode",
                "none",
                "mtu",
                "65520",
                "up",
            ];
            sh(&[&["ip", "-n", ns][..], &up[..]].concat())?;
            rings.push(in_netns(ns, || PacketRing::open(RING_DEV))?);
            tuns.push(tun);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut moved = Vec::new();
        let mut threads = Vec::new();
        for (ring, to) in rings.into_iter().zip(tuns.into_iter().rev()) {
            let m = Arc::new(Moved::default());
            let (s, m2) = (stop.clone(), m.clone());
            threads.push(std::thread::spawn(move || relay_ring(&ring, &to, &s, &m2)));
            moved.push(m);
        }
        self.relay = Some(Relay {
            stop,
            threads,
            moved,
        });
        Ok([RING_DEV, RING_DEV].map(String::from))
    }

    /// One iperf3 run of `streams` streams for `secs` seconds.
    fn run(&self, streams: u32, secs: u32) -> Result<Run> {
        let relay0 = self.relay.as_ref().map(|r| (r.ticks(), r.totals()));
        let io = self.ends.iperf3(streams, secs, self.kind.name())?;
        let gb = io.bytes / 1e9;
        let mut run = Run {
            gbit_s: io.gbit_s,
            cpu_s_per_gb: io.cpu_s_per_gb(),
            relay_cpu_s_per_gb: None,
            relay_data_bytes: None,
            relay_small_per_data: None,
            relay_calls_per_packet: None,
            ring_drops: None,
        };
        if let (Some(r), Some((t0, before))) = (&self.relay, relay0) {
            let (t1, d) = (r.ticks()?, r.totals().since(before));
            run.ring_drops = (self.kind == Kind::HopMmap).then_some(d.drops);
            ensure!(d.errors == 0, "the relay failed {} writes", d.errors);
            let (packets, large) = (d.packets.max(1) as f64, d.large.max(1) as f64);
            run.relay_cpu_s_per_gb = Some((t1 - t0?) as f64 / TICKS_PER_S / gb);
            run.relay_data_bytes = Some(d.large_bytes as f64 / large);
            run.relay_small_per_data = Some((d.packets - d.large) as f64 / large);
            run.relay_calls_per_packet = Some(d.calls as f64 / packets);
        }
        Ok(run)
    }
}

#[derive(Clone, Copy, Debug)]
struct Run {
    gbit_s: f64,
    cpu_s_per_gb: f64,
    relay_cpu_s_per_gb: Option<f64>,
    /// Mean bytes of the relay's data packets ([`LARGE`] bytes or more).
    relay_data_bytes: Option<f64>,
    /// The relay's other packets (ACKs) per data packet.
    relay_small_per_data: Option<f64>,
    relay_calls_per_packet: Option<f64>,
    /// Packets the packet ring dropped for want of a frame (counted with a lag).
    ring_drops: Option<u64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "bench-hop needs root (network namespaces, /dev/net/tun, veth)"
    );
    ensure!(
        args.rounds > 0 && args.seconds > 0,
        "rounds and seconds must be positive"
    );
    for p in &args.paths {
        ensure!(
            Kind::ALL.iter().any(|k| k.name() == p),
            "no path {p:?}; the paths are {}",
            Kind::ALL.map(Kind::name).join(", ")
        );
    }
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| args.paths.is_empty() || args.paths.iter().any(|p| p == k.name()))
        .collect();
    let pairs: Vec<Pair> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| Pair::new(*k, i as u8 + 1))
        .collect::<Result<_>>()?;
    let registration = kinds.contains(&Kind::HopMmap).then(|| {
        // soft-RoCE where the kernel has it (the VM), for the verbs registration.
        let _ = ipoib_tests::cmlab::rxe_device();
        ring_registration()
    });
    if let Some(r) = &registration {
        eprintln!("packet ring mapping registered: {r}");
    }
    let counts = if args.streams == 1 {
        vec![1]
    } else {
        vec![1, args.streams]
    };
    let mut runs: BTreeMap<(Kind, u32), Vec<Run>> = BTreeMap::new();
    for round in 0..args.rounds {
        for &streams in &counts {
            for p in &pairs {
                let r = p.run(streams, args.seconds)?;
                let drops = r
                    .ring_drops
                    .map_or(String::new(), |d| format!(", {d} ring drops"));
                eprintln!(
                    "round {}/{}: {:<9} {streams} stream(s): {:6.2} Gbit/s, {:5.2} CPU s/GB{drops}",
                    round + 1,
                    args.rounds,
                    p.kind.name(),
                    r.gbit_s,
                    r.cpu_s_per_gb
                );
                runs.entry((p.kind, streams)).or_default().push(r);
            }
        }
    }
    drop(pairs);
    report(&args, &kinds, &counts, &runs, registration)
}

fn report(
    args: &Args,
    kinds: &[Kind],
    counts: &[u32],
    runs: &BTreeMap<(Kind, u32), Vec<Run>>,
    registration: Option<serde_json::Value>,
) -> Result<()> {
    let m = |k: Kind, s: u32, f: fn(&Run) -> Option<f64>| {
        let v: Vec<f64> = runs.get(&(k, s))?.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "\nTCP between two namespaces (iperf3), {} s x {} interleaved rounds (median), kernel {}, {cpus} CPUs",
        args.seconds,
        args.rounds,
        kernel.trim()
    );
    println!(
        "{:<9} {:>7} {:>8} {:>9} {:>10} {:>10} {:>14} {:>12} {:>10} {:>13}",
        "path",
        "streams",
        "Gbit/s",
        "CPU s/GB",
        "Gbit/veth",
        "CPU/veth",
        "relay CPU s/GB",
        "data mean B",
        "small/data",
        "syscalls/pkt"
    );
    let mut rows = Vec::new();
    for &s in counts {
        let veth_g = m(Kind::Veth, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
        let veth_c = m(Kind::Veth, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
        for &k in kinds {
            let g = m(k, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
            let c = m(k, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
            let rc = m(k, s, |r| r.relay_cpu_s_per_gb);
            let rb = m(k, s, |r| r.relay_data_bytes);
            let ra = m(k, s, |r| r.relay_small_per_data);
            let rs = m(k, s, |r| r.relay_calls_per_packet);
            let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |v| format!("{v:.p$}"));
            println!(
                "{:<9} {s:>7} {g:>8.2} {c:>9.2} {:>10.2} {:>10.2} {:>14} {:>12} {:>10} {:>13}",
                k.name(),
                g / veth_g,
                c / veth_c,
                opt(rc, 2),
                opt(rb, 0),
                opt(ra, 2),
                opt(rs, 2)
            );
            rows.push(json!({
                "path": k.name(), "streams": s, "gbit_s": g, "cpu_s_per_gb": c,
                "gbit_over_veth": g / veth_g, "cpu_over_veth": c / veth_c,
                "relay_cpu_s_per_gb": rc, "relay_data_bytes": rb, "relay_small_per_data": ra,
                "relay_syscalls_per_packet": rs,
                "rounds": runs[&(k, s)].iter().map(|r| json!({
                    "gbit_s": r.gbit_s, "cpu_s_per_gb": r.cpu_s_per_gb, "ring_drops": r.ring_drops,
                })).collect::<Vec<_>>(),
            }));
        }
    }
    let result = json!({
        "bench": "hop", "kernel": kernel.trim(), "cpus": cpus, "seconds": args.seconds,
        "rounds": args.rounds, "rows": rows, "ring_registration": registration,
    });
    publish(&result, args.out.as_deref())
}
