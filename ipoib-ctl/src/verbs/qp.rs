//! RC queue pairs: INIT, RTR, RTS, sends, and the error state.

use std::{
    io, ptr,
    sync::{Arc, atomic::Ordering},
};

use ibverbs_sys as ffi;

use super::{
    Context, DRAIN_WR_ID, Lane, MemoryRegion, POST_CHAIN_MAX, PortAddress, ProtectionDomain,
    RecvRing, SEND_WR_ID, SharedReceiveQueue, VerbsError, post_receives,
};
use crate::path::{AddressVector, Endpoint, LinkLayer};

/// The far end of an RC connection, as the handshake carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcEndpoint {
    /// 24 bits.
    pub qpn: u32,
    /// 24 bits: the first PSN the endpoint sends with.
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// ibv_mtu enum (1 = 256 .. 5 = 4096): the endpoint's port MTU.
    pub mtu: u32,
    pub link_layer: LinkLayer,
}

impl RcEndpoint {
    /// Where its port is, for a path.
    pub fn at(&self) -> Endpoint {
        Endpoint {
            link_layer: self.link_layer,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu,
        }
    }
}

/// QP state as ibv_query_qp reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Error,
    Unknown(u32),
}

/// RC timing of a connection.
///
/// - Transport: local ACK timeout 4.096 µs * 2^14 (~67 ms), 7 retries: a peer that answers
///   nothing (gone, link down) ends in a completion error within about half a second.
/// - Receiver not ready (RNR): a receiver whose buffers are all in use answers with an RNR NAK
///   carrying its `min_rnr_timer`; the sender waits that long and tries again, `rnr_retry`
///   times (7: without end). A ring per connection holds 64 messages, a few milliseconds of
///   a fast stream, so any pause of the receiving engine longer than the retries cover kills
///   a connection that had a finite count (0.64 ms * 7 tries: under 5 ms). Retrying without
///   end at a short timer makes a busy receiver slow its sender to its own pace, and
///   liveness is judged elsewhere: word from the peer (its keepalive on the connection's
///   stream, its traffic, the sends its HCA acknowledges: all stop with a stopped peer once
///   its posted buffers are full), the engine's queue bound (a peer that takes nothing goes UD until it drains) and
///   the policy's idle reaping. Measured in `tests/cm.rs`
///   (`a_dry_ring_slows_its_sender_and_the_connection_lives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcTiming {
    pub ack_timeout: u8,
    pub retry_cnt: u8,
    /// 7: retry without end.
    pub rnr_retry: u8,
    /// The RNR NAK timer this end asks for (IB encoding: 12 = 0.64 ms, 31 = 491.52 ms).
    pub min_rnr_timer: u8,
}

impl Default for RcTiming {
    fn default() -> Self {
        Self {
            ack_timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// The RNR NAK timer's IB encoding in microseconds (IBA table 45).
pub fn rnr_timer_us(code: u8) -> u32 {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    US[usize::from(code & 31)]
}

/// A reliable-connected queue pair receiving on an SRQ or on a ring of its own.
pub struct RcQueuePair {
    qp: *mut ffi::ibv_qp,
    port: PortAddress,
    pub psn: u32,
    /// Its own receive buffers (no SRQ): freed after the QP is destroyed.
    ring: Option<RecvRing>,
    _pd: Arc<ProtectionDomain>,
    /// Its sends and receives complete on the lane's CQ; counted among the lane's QPs until
    /// dropped.
    lane: Arc<Lane>,
    _srq: Option<Arc<SharedReceiveQueue>>,
}

impl std::fmt::Debug for RcQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RcQueuePair(QP {})", self.qpn())
    }
}

// SAFETY: as Context.
unsafe impl Send for RcQueuePair {}
unsafe impl Sync for RcQueuePair {}

impl Drop for RcQueuePair {
    fn drop(&mut self) {
        // SAFETY: created here, destroyed once; the CQs, SRQ, ring and PD it uses are fields,
        // alive until after this.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
        self.lane.qps.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RcQueuePair {
    /// An RC QP receiving on `srq`, or on `ring` (exactly one of them), its sends and receives
    /// completing on `lane`'s CQ, moved to INIT on `port`. `psn` is the first
    /// PSN it will send with (24 bits). A ring's receives are posted by the caller.
    pub(super) fn create(
        pd: &Arc<ProtectionDomain>,
        lane: &Arc<Lane>,
        srq: Option<&Arc<SharedReceiveQueue>>,
        ring: Option<RecvRing>,
        port: PortAddress,
        max_send_wr: u32,
        psn: u32,
    ) -> Result<Self, VerbsError> {
        let max_recv_wr = ring.as_ref().map_or(0, |r| r.region.count);
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: lane.cq.cq,
            recv_cq: lane.cq.cq,
            srq: srq.map_or(ptr::null_mut(), |s| s.srq),
            cap: ffi::ibv_qp_cap {
                max_send_wr,
                max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 1,
        };
        // SAFETY: valid PD, CQs and SRQ, all kept alive by the QP's fields.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(pd.ctx.err("ibv_create_qp", io::Error::last_os_error()));
        }
        // Counted here, uncounted in drop.
        lane.qps.fetch_add(1, Ordering::Relaxed);
        let q = Self {
            qp,
            port,
            psn: psn & 0xff_ffff,
            ring,
            _pd: pd.clone(),
            lane: lane.clone(),
            _srq: srq.cloned(),
        };
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: port.pkey_index,
            port_num: port.port,
            qp_access_flags: 0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        q.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(q)
    }

    /// Its own receive ring (None on an SRQ).
    pub fn ring(&self) -> Option<&RecvRing> {
        self.ring.as_ref()
    }

    /// Posts the buffers `slots` of its ring (each receive's wr_id names the ring and slot),
    /// in chains of up to 64.
    pub fn post_ring(&self, slots: &[u32]) -> Result<(), VerbsError> {
        let Some(ring) = &self.ring else {
            return Err(self.ctx().err(
                "post_recv: the QP receives on an SRQ",
                io::Error::from(io::ErrorKind::InvalidInput),
            ));
        };
        let (region, len) = (&ring.region, ring.buffer_bytes);
        let rc = post_receives(region, len, ring.id, slots, 64, &ring.posted, |wr| {
            let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
            // SAFETY: valid QP; the chain and its SGEs outlive the call; the region is
            // registered on this QP's PD and outlives the QP.
            unsafe {
                let ctx = (*self.qp).context;
                match (*ctx).ops.post_recv {
                    Some(f) => f(self.qp, wr, &mut bad),
                    None => libc::EOPNOTSUPP,
                }
            }
        });
        self.ctx().check("post_recv", rc)
    }

    fn ctx(&self) -> &Context {
        &self._pd.ctx
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        what: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: valid QP and attributes.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        self.ctx().check(what, rc)
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: valid QP; qp_num is plain data.
        unsafe { (*self.qp).qp_num }
    }

    /// The lane it was made on: the engine that posts on it and polls its completions.
    pub fn lane(&self) -> u32 {
        self.lane.index
    }

    /// This end, for the handshake.
    pub fn endpoint(&self) -> RcEndpoint {
        RcEndpoint {
            qpn: self.qpn(),
            psn: self.psn,
            lid: self.port.lid,
            gid: self.port.gid,
            mtu: self.port.active_mtu,
            link_layer: self.port.link_layer,
        }
    }

    /// `av` as verbs takes it, from this QP's port.
    fn ah_attr(&self, av: &AddressVector) -> ffi::ibv_ah_attr {
        let grh = av.grh.unwrap_or(crate::path::Grh {
            dgid: [0; 16],
            hop_limit: 0,
            traffic_class: 0,
            flow_label: 0,
        });
        ffi::ibv_ah_attr {
            grh: ffi::ibv_global_route {
                dgid: ffi::ibv_gid { raw: grh.dgid },
                flow_label: grh.flow_label,
                sgid_index: self.port.gid_index,
                hop_limit: grh.hop_limit,
                traffic_class: grh.traffic_class,
            },
            dlid: av.dlid,
            sl: av.sl,
            src_path_bits: 0,
            static_rate: av.static_rate,
            is_global: u8::from(av.grh.is_some()),
            port_num: self.port.port,
        }
    }

    /// INIT -> RTR -> RTS towards `remote` along `av`, with `timing` (its ACK timeout where
    /// the path gave none).
    pub fn connect(
        &self,
        remote: &RcEndpoint,
        av: &AddressVector,
        timing: RcTiming,
    ) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: av.path_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: timing.min_rnr_timer,
            ah_attr: self.ah_attr(av),
            ..Default::default()
        };
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: av.ack_timeout.unwrap_or(timing.ack_timeout),
            retry_cnt: timing.retry_cnt,
            rnr_retry: timing.rnr_retry,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to the error state: outstanding work completes as flushed, so buffers can
    /// be reclaimed before the QP is destroyed.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }

    /// The ACK timeout and path MTU (`ibv_mtu`) the QP runs with, as the HCA reports them.
    pub fn path_attrs(&self) -> Result<(u8, u32), VerbsError> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: valid QP and out pointers.
        let rc = unsafe {
            ffi::ibv_query_qp(
                self.qp,
                &mut attr,
                (M::IBV_QP_TIMEOUT | M::IBV_QP_PATH_MTU).0 as i32,
                &mut init,
            )
        };
        self.ctx().check("ibv_query_qp", rc)?;
        Ok((attr.timeout, attr.path_mtu))
    }

    /// Posts the drain marker on this QP, in the error state: a zero-length signaled SEND
    /// (id [`DRAIN_WR_ID`] and the QP's number) that completes flushed after everything the
    /// QP put on its CQ before it.
    pub fn post_drain(&self) -> Result<(), VerbsError> {
        let mut wr = ffi::ibv_send_wr {
            wr_id: SEND_WR_ID | DRAIN_WR_ID | u64::from(self.qpn()),
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the request outlives the call and names no memory.
        let rc = unsafe { self.post_send_raw(&mut wr, &mut bad) };
        self.ctx().check("post_send(drain)", rc)
    }

    /// The provider's post_send (verbs.h's `ibv_post_send` is inline: no symbol to bind) for
    /// the chain at `wr`; its return code, `bad` naming the first request not taken.
    ///
    /// # Safety
    /// `wr` is a valid chain that outlives the call, its SGEs within memory registered on this
    /// QP's PD.
    unsafe fn post_send_raw(
        &self,
        wr: *mut ffi::ibv_send_wr,
        bad: &mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        // SAFETY: valid QP; the chain as the caller promises.
        unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, wr, bad),
                None => libc::EOPNOTSUPP,
            }
        }
    }

    pub fn state(&self) -> Result<QpState, VerbsError> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: valid QP and out pointers.
        let rc = unsafe {
            ffi::ibv_query_qp(
                self.qp,
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        self.ctx().check("ibv_query_qp", rc)?;
        use ffi::ibv_qp_state as S;
        Ok(match attr.qp_state {
            S::IBV_QPS_RESET => QpState::Reset,
            S::IBV_QPS_INIT => QpState::Init,
            S::IBV_QPS_RTR => QpState::Rtr,
            S::IBV_QPS_RTS => QpState::Rts,
            S::IBV_QPS_SQD => QpState::Sqd,
            S::IBV_QPS_SQE => QpState::Sqe,
            S::IBV_QPS_ERR => QpState::Error,
            other => QpState::Unknown(other),
        })
    }

    /// Posts one signaled SEND of the first `len` bytes of `region`'s slot `slot`
    /// (wr_id = `wr_id`). The slot must stay untouched until the send completes.
    pub fn post_send(
        &self,
        region: &MemoryRegion,
        slot: u32,
        len: u32,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let (_, r) = self.post_sends(region, &[SendRequest { slot, len, wr_id }]);
        r
    }

    /// Posts `sends` as chains of signaled SENDs, in order, one call per [`POST_CHAIN_MAX`]
    /// (one doorbell on the HCA, one system call on soft-RoCE). Returns how many were posted, from the first:
    /// on an error the rest were not (their slots are the caller's again). Each slot must stay
    /// untouched until its send completes.
    pub fn post_sends(
        &self,
        region: &MemoryRegion,
        sends: &[SendRequest],
    ) -> (usize, Result<(), VerbsError>) {
        if sends.is_empty() {
            return (0, Ok(()));
        }
        if let Some(bad) = sends.iter().position(|s| {
            s.slot >= region.count || u64::from(s.len) > region.stride || s.wr_id >= SEND_WR_ID
        }) {
            let e = self.ctx().err(
                "post_send: slot or length out of the region, or a work request id past 2^63",
                io::Error::from(io::ErrorKind::InvalidInput),
            );
            let (posted, r) = self.post_sends(region, &sends[..bad]);
            return (posted, r.and(Err(e)));
        }
        let mut posted = 0;
        for chunk in sends.chunks(POST_CHAIN_MAX) {
            let (n, r) = self.post_chain(region, chunk);
            posted += n;
            if r.is_err() {
                return (posted, r);
            }
        }
        (posted, Ok(()))
    }

    /// One call of the provider's post_send for `sends` (at most [`POST_CHAIN_MAX`], checked
    /// against the region), the chain built on the stack.
    fn post_chain(
        &self,
        region: &MemoryRegion,
        sends: &[SendRequest],
    ) -> (usize, Result<(), VerbsError>) {
        debug_assert!(!sends.is_empty() && sends.len() <= POST_CHAIN_MAX);
        // Only the chain's own entries are written (most chains are one send: the other 63
        // stay untouched on the hot path); nothing reads past them.
        let mut sges = [const { std::mem::MaybeUninit::<ffi::ibv_sge>::uninit() }; POST_CHAIN_MAX];
        let mut wrs =
            [const { std::mem::MaybeUninit::<ffi::ibv_send_wr>::uninit() }; POST_CHAIN_MAX];
        let n = sends.len();
        // Written through these pointers only, so neither array is borrowed again before the
        // call; neither moves.
        let base = wrs.as_mut_ptr().cast::<ffi::ibv_send_wr>();
        let sge_base = sges.as_mut_ptr().cast::<ffi::ibv_sge>();
        for (k, s) in sends.iter().enumerate() {
            // SAFETY: k < n <= POST_CHAIN_MAX: within both arrays; k + 1 is written next turn.
            unsafe {
                let sge = sge_base.add(k);
                sge.write(region.sge(s.slot, s.len));
                base.add(k).write(ffi::ibv_send_wr {
                    wr_id: s.wr_id | SEND_WR_ID,
                    next: if k + 1 < n {
                        base.add(k + 1)
                    } else {
                        ptr::null_mut()
                    },
                    sg_list: sge,
                    num_sge: 1,
                    opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
                    send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
                    ..Default::default()
                });
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the chain and its SGEs outlive the call; the region is registered on this PD.
        let rc = unsafe { self.post_send_raw(base, &mut bad) };
        if rc == 0 {
            return (n, Ok(()));
        }
        // The provider names the first request it did not take; without one, none went.
        let posted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into the chain, at or after its base.
            (unsafe { bad.offset_from(base) } as usize).min(n)
        };
        (posted, self.ctx().check("post_send", rc))
    }
}

/// One SEND of [`RcQueuePair::post_sends`]: the first `len` bytes of a registered slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRequest {
    pub slot: u32,
    pub len: u32,
    /// Below [`SEND_WR_ID`]: its completion gives it back as it was.
    pub wr_id: u64,
}
