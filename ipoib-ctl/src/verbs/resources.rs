//! What every connection of a node shares ([`Resources`]), and its lanes.

use std::{
    io,
    os::fd::RawFd,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use super::{
    CompletionQueue, Device, MemoryRegion, PortAddress, ProtectionDomain, RcQueuePair, Receive,
    ReceiveModel, RingPool, SharedReceiveQueue, VerbsError,
};

/// What every connection of a node shares: the PD, where receives land (the SRQ, or the pool
/// of per-connection rings), the registered send slots, the port's address, and its lanes:
/// one per engine, each a CQ (with a completion channel) for the sends and receives of the
/// QPs made on it and a range of the send slots. Built once, for the daemon and the test nodes
/// alike. Each object holds an Arc of what it was made from (the QPs made from these too), so
/// the HCA's drop order holds whatever drops first.
pub struct Resources {
    pub pd: Arc<ProtectionDomain>,
    pub recv: Receive,
    /// Send slots, each one CM message in whole pages.
    pub send: Arc<MemoryRegion>,
    pub port: PortAddress,
    /// At least one. A QP is made on the lane with the fewest QPs ([`Resources::rc_qp`]).
    pub lanes: Vec<Arc<Lane>>,
}

/// One engine's share of [`Resources`]: the CQ its QPs' sends and receives complete on, and
/// the send slots it posts from.
pub struct Lane {
    pub index: u32,
    pub cq: Arc<CompletionQueue>,
    pub slots: std::ops::Range<u32>,
    /// QPs made on this lane and not yet dropped.
    pub(super) qps: AtomicU32,
}

impl Lane {
    /// QPs made on this lane and not yet dropped.
    pub fn qps(&self) -> u32 {
        self.qps.load(Ordering::Relaxed)
    }
}

/// Send slots `0..slots` shared out over `lanes` lanes, in order, the first ones one more when
/// they do not divide evenly.
fn lane_slots(slots: u32, lanes: u32, lane: u32) -> std::ops::Range<u32> {
    let (each, more) = (slots / lanes, slots % lanes);
    let start = lane * each + lane.min(more);
    start..start + each + u32::from(lane < more)
}

impl Resources {
    /// On `port` of `dev` (its first GID that is set), QPs in the partition at `pkey_index` of
    /// the port's P_Key table: receives of `buffer_bytes` as `model` says (an SRQ with every
    /// buffer posted, or a pool that registers a ring per connection), `send_slots` send
    /// slots, every buffer `stride` bytes apart, and `lanes` lanes (at least one, at most one
    /// per send slot) sharing the send slots out. Each lane's CQ is deep enough for every
    /// receive that may be posted (any of them may complete on any lane) and its sends (twice:
    /// a slot may complete in error after a flush).
    #[allow(clippy::too_many_arguments)]
    pub fn create_lanes(
        dev: &Device,
        port: u8,
        pkey_index: u16,
        model: ReceiveModel,
        buffer_bytes: u32,
        send_slots: u32,
        stride: u64,
        lanes: u32,
    ) -> Result<Arc<Self>, VerbsError> {
        let lanes = lanes.clamp(1, send_slots.max(1));
        let port = PortAddress {
            pkey_index,
            ..dev.first_address(port)?
        };
        let pd = dev.alloc_pd()?;
        let lanes = (0..lanes)
            .map(|index| {
                let slots = lane_slots(send_slots, lanes, index);
                let cqe = model.receives().saturating_add(2 * slots.len() as u32);
                Ok(Arc::new(Lane {
                    index,
                    cq: CompletionQueue::create(dev, cqe, true)?,
                    slots,
                    qps: AtomicU32::new(0),
                }))
            })
            .collect::<Result<Vec<_>, VerbsError>>()?;
        let recv = match model {
            ReceiveModel::Srq { depth } => Receive::Srq(SharedReceiveQueue::create(
                &pd,
                depth,
                buffer_bytes,
                stride,
            )?),
            ReceiveModel::Rings { depth, max } => {
                Receive::Rings(RingPool::new(&pd, depth, max, buffer_bytes, stride)?)
            }
        };
        let send = MemoryRegion::register(&pd, send_slots, stride)?;
        Ok(Arc::new(Self {
            pd,
            recv,
            send,
            port,
            lanes,
        }))
    }

    /// An RC QP on these resources, first PSN `psn`, on the lane with the fewest QPs (the
    /// first of them): receiving on the SRQ, or on a ring of its own (registered and posted
    /// here; Err([`VerbsError::RingsExhausted`]) before anything is allocated when the pool is
    /// at its cap).
    pub fn rc_qp(&self, max_send_wr: u32, psn: u32) -> Result<Arc<RcQueuePair>, VerbsError> {
        let lane = self
            .lanes
            .iter()
            .min_by_key(|l| l.qps())
            .expect("at least one lane");
        let ring = match &self.recv {
            Receive::Srq(_) => None,
            Receive::Rings(pool) => Some(pool.ring()?),
        };
        let qp = Arc::new(RcQueuePair::create(
            &self.pd,
            lane,
            self.recv.srq(),
            ring,
            self.port,
            max_send_wr,
            psn,
        )?);
        if let (Some(pool), Some(ring)) = (self.recv.rings(), qp.ring()) {
            pool.register(ring.id, &qp);
            let slots: Vec<u32> = (0..pool.depth).collect();
            qp.post_ring(&slots)?;
        }
        Ok(qp)
    }
}

/// Waits until `fd` is readable; false on timeout.
pub(super) fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use ibverbs_sys as ffi;

    use super::*;
    use crate::verbs::{Completion, RcTiming, SEND_WR_ID, rnr_timer_us, wr_id};

    /// A receive that failed has no opcode to trust (soft-RoCE leaves 0, `IBV_WC_SEND`): its
    /// id says receive, and names its ring and slot. A send, failed or not, gives back the id
    /// it was posted with.
    #[test]
    fn a_completion_is_a_send_or_a_receive_by_its_id_also_in_error() {
        use ffi::ibv_wc_status as st;
        let (len_err, flushed) = (Some(st::IBV_WC_LOC_LEN_ERR), Some(st::IBV_WC_WR_FLUSH_ERR));
        let c = Completion::from_id(wr_id(0, 309), 261, 0, len_err);
        assert!(c.recv);
        assert_eq!((c.wr_id, c.error), (309, len_err));
        let c = Completion::from_id(wr_id(5, 7), 261, 0, flushed);
        assert!(c.recv);
        assert_eq!(c.wr_id, wr_id(5, 7));
        let c = Completion::from_id(wr_id(0, 3), 261, 1000, None);
        assert_eq!((c.recv, c.wr_id, c.qp_num, c.bytes), (true, 3, 261, 1000));
        for error in [None, Some(st::IBV_WC_RETRY_EXC_ERR), flushed] {
            let c = Completion::from_id(SEND_WR_ID | 255, 261, 0, error);
            assert!(!c.recv);
            assert_eq!((c.wr_id, c.error), (255, error));
        }
    }

    #[test]
    fn rnr_timer_codes_in_microseconds() {
        assert_eq!(rnr_timer_us(0), 655_360);
        assert_eq!(rnr_timer_us(1), 10);
        assert_eq!(rnr_timer_us(12), 640);
        assert_eq!(rnr_timer_us(14), 1280);
        assert_eq!(rnr_timer_us(31), 491_520);
    }

    /// The chosen RNR timing: retried without end, at 0.64 ms (see [`RcTiming`]).
    #[test]
    fn a_busy_receiver_is_waited_for() {
        let t = RcTiming::default();
        assert_eq!((t.rnr_retry, rnr_timer_us(t.min_rnr_timer)), (7, 640));
        assert_eq!((t.ack_timeout, t.retry_cnt), (14, 7));
    }

    /// Every send slot on exactly one lane, in order, the lanes as even as can be.
    #[test]
    fn lanes_share_the_send_slots_out_evenly_in_order() {
        for (slots, lanes) in [(256, 1), (256, 2), (10, 3), (7, 7), (5, 4)] {
            let ranges: Vec<_> = (0..lanes).map(|l| lane_slots(slots, lanes, l)).collect();
            assert_eq!(ranges[0].start, 0, "{slots}/{lanes}: {ranges:?}");
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{slots}/{lanes}: {ranges:?}");
            }
            assert_eq!(ranges[ranges.len() - 1].end, slots, "{ranges:?}");
            let sizes: Vec<_> = ranges.iter().map(|r| r.len()).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "{slots}/{lanes}: {sizes:?}");
            assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
        }
        assert_eq!(lane_slots(10, 3, 0), 0..4);
        assert_eq!(lane_slots(10, 3, 2), 7..10);
    }
}
