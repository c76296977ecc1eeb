//! The relays of `bench-hop`: from one TUN device to another with a `read` and a `write` per
//! packet, or through io_uring; from a packet ring to a TUN device through io_uring.

use std::{
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use ipoib_ctl::tun::{TUN_READ_MAX, Tun, VNET_HDR_LEN, VnetHdr};

use crate::ring::{PacketRing, RING_FRAME, RING_FRAMES};

/// Packets of at least this many bytes are counted as data; the rest are ACKs, and data
/// segments that small.
pub(crate) const LARGE: u64 = 1024;

/// What a relay thread moved.
#[derive(Default)]
pub(crate) struct Moved {
    /// Packets a packet ring had no free frame for (read from the socket now and then).
    pub(crate) drops: AtomicU64,
    /// System calls made moving them (reads, writes and waits; io_uring enters).
    pub(crate) calls: AtomicU64,
    pub(crate) packets: AtomicU64,
    /// Packets of [`LARGE`] bytes or more, and their bytes.
    pub(crate) large: AtomicU64,
    pub(crate) large_bytes: AtomicU64,
    pub(crate) errors: AtomicU64,
}

impl Moved {
    /// Counts one packet of `n` bytes moved.
    pub(crate) fn packet(&self, n: u64) {
        self.packets.fetch_add(1, Ordering::Relaxed);
        if n >= LARGE {
            self.large.fetch_add(1, Ordering::Relaxed);
            self.large_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// What every relay thread of a hop moved so far, or between two points.
#[derive(Clone, Copy, Default)]
pub(crate) struct Totals {
    pub(crate) packets: u64,
    pub(crate) large: u64,
    pub(crate) large_bytes: u64,
    pub(crate) errors: u64,
    pub(crate) calls: u64,
    pub(crate) drops: u64,
}

impl Totals {
    pub(crate) fn since(self, before: Totals) -> Totals {
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

/// How a relay thread moves packets from one device to the other.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mover {
    /// A `read` and a `write` per packet, as the engine does.
    Syscalls,
    /// The same, with each packet copied once more between them.
    Copy,
    /// io_uring, [`URING_DEPTH`] registered buffers in turn.
    Uring,
}

/// Buffers per io_uring relay: reads kept queued on its device, and writes in flight.
pub(crate) const URING_DEPTH: usize = 32;

/// Moves packets from `from` to `to` as the engine does: non-blocking reads until the device
/// has no more, then a wait for readiness. With `copy`, each packet is copied into a second
/// buffer before it is written (the engine's transmit before it read into its send slots).
pub(crate) fn relay(
    from: Arc<Tun>,
    to: Arc<Tun>,
    copy: bool,
    stop: Arc<AtomicBool>,
    moved: Arc<Moved>,
) {
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
pub(crate) fn relay_uring(from: &Tun, to: &Tun, stop: &AtomicBool, moved: &Moved) {
    counted(
        "io_uring relay",
        moved,
        try_relay_uring(from, to, stop, moved),
    );
}

/// A relay's end: an error is said and counted (the run then fails its check).
fn counted(what: &str, moved: &Moved, r: std::io::Result<()>) {
    if let Err(e) = r {
        eprintln!("{what}: {e}");
        moved.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// One `io_uring_enter`: what is queued submitted, then a wait of at most 100 ms for one
/// completion (so that the relay sees its stop flag).
fn enter(ring: &io_uring::IoUring, moved: &Moved) -> std::io::Result<()> {
    let timeout = io_uring::types::Timespec::new().nsec(100_000_000);
    let args = io_uring::types::SubmitArgs::new().timespec(&timeout);
    moved.calls.fetch_add(1, Ordering::Relaxed);
    match ring.submitter().submit_with_args(1, &args) {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => Ok(()),
        Err(e) => Err(e),
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
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: every entry names a registered buffer no other entry in flight uses.
        unsafe { ring.submission().push_multiple(&next) }
            .map_err(|_| std::io::Error::other("submission queue full"))?;
        next.clear();
        enter(&ring, moved)?;
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

/// `user_data` of the poll for a filled frame.
const POLLED: u64 = u64::MAX;

/// Moves packets from `ring` to `to`: each frame the kernel filled is written from the ring
/// itself through io_uring, its vnet header moved up against the IP header (TUN takes no
/// Ethernet header) and its offsets made relative to it, then handed back to the kernel once
/// written. Where no frame is filled, a poll for one waits in the same ring: one
/// `io_uring_enter` per turn.
pub(crate) fn relay_ring(ring: &PacketRing, to: &Tun, stop: &AtomicBool, moved: &Moved) {
    counted(
        "packet ring relay",
        moved,
        try_relay_ring(ring, to, stop, moved),
    );
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
        enter(&uring, moved)?;
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
