//! Where RC receives land: one shared receive queue for every connection, or, on an HCA
//! without an SRQ, a ring of receive buffers per connection from a [`RingPool`] that holds
//! at most `max` rings at once (the memory plan's K).
//!
//! A ring's buffers are registered when its QP is made and deregistered when the QP is gone.
//! The pool counts a ring from before its memory is registered until after it is freed, so
//! the receive memory registered never exceeds `max` rings, whatever is being set up, torn
//! down or refused at the time; a QP past the cap fails before anything is allocated.
//!
//! Every receive's `wr_id` names its ring and slot ([`wr_id`]): ring 0 is the SRQ, rings are
//! numbered from 1 and not reused before 2^31 - 1 more rings were made, so a completion that
//! arrives after its ring is gone (a flush after teardown) finds nothing rather than another
//! connection's buffer. Ring numbers keep to 31 bits: the id's top bit marks a send
//! ([`super::SEND_WR_ID`]).

use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex, OnceLock, Weak,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
};

use super::{
    Completion, MemoryRegion, ProtectionDomain, RcQueuePair, SharedReceiveQueue, VerbsError,
};

/// How a node receives: what the memory plan chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiveModel {
    /// One SRQ of `depth` buffers shared by every connection.
    Srq { depth: u32 },
    /// A ring of `depth` buffers per connection, at most `max` connections' rings at once.
    Rings { depth: u32, max: u32 },
}

impl ReceiveModel {
    /// Receives that may be posted at once (what the CQ must hold beside the sends).
    pub fn receives(&self) -> u32 {
        match *self {
            Self::Srq { depth } => depth,
            Self::Rings { depth, max } => depth.saturating_mul(max),
        }
    }
}

/// Ring numbers: 1 to this (0 is the SRQ), so a receive's id stays below
/// [`super::SEND_WR_ID`].
const RING_IDS: u32 = (1 << 31) - 1;

/// A receive's work request id: its ring (0: the SRQ; at most 2^31 - 1) and its slot in the
/// ring's region.
pub fn wr_id(ring: u32, slot: u32) -> u64 {
    debug_assert!(ring <= RING_IDS);
    (u64::from(ring) << 32) | u64::from(slot)
}

/// The number of the `n`th ring made (from 0): 1 to [`RING_IDS`], then around again.
fn ring_number(n: u32) -> u32 {
    n % RING_IDS + 1
}

/// The ring and slot of a receive's work request id.
pub fn ring_and_slot(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

/// Where a node's receives land.
pub enum Receive {
    Srq(Arc<SharedReceiveQueue>),
    Rings(Arc<RingPool>),
}

impl Receive {
    /// Bytes of one receive buffer (the largest message a peer may send us).
    pub fn buffer_bytes(&self) -> u32 {
        match self {
            Self::Srq(s) => s.buffer_bytes,
            Self::Rings(p) => p.buffer_bytes,
        }
    }

    /// The SRQ, when there is one.
    pub fn srq(&self) -> Option<&Arc<SharedReceiveQueue>> {
        match self {
            Self::Srq(s) => Some(s),
            Self::Rings(_) => None,
        }
    }

    /// The ring pool, when there is one.
    pub fn rings(&self) -> Option<&Arc<RingPool>> {
        match self {
            Self::Srq(_) => None,
            Self::Rings(p) => Some(p),
        }
    }

    /// Receive memory registered now, in bytes.
    pub fn registered_bytes(&self) -> u64 {
        match self {
            Self::Srq(s) => u64::from(s.region.count) * s.region.stride,
            Self::Rings(p) => p.registered_bytes(),
        }
    }

    /// The buffer a receive completion filled, or None when its ring is gone (a flush that
    /// came after the connection was torn down: nothing to read, nothing to post again).
    pub fn filled(&self, wc: &Completion) -> Option<Filled> {
        let (ring, slot) = ring_and_slot(wc.wr_id);
        let owner = match self {
            Self::Srq(s) if ring == 0 => {
                s.completed(1);
                Owner::Srq(s.clone())
            }
            Self::Rings(p) if ring != 0 => {
                let qp = p.lookup(ring)?;
                qp.ring()?.posted.fetch_sub(1, Ordering::Relaxed);
                Owner::Ring(qp)
            }
            _ => return None,
        };
        Some(Filled {
            owner,
            slot,
            len: wc.bytes,
        })
    }
}

enum Owner {
    Srq(Arc<SharedReceiveQueue>),
    Ring(Arc<RcQueuePair>),
}

/// A completed receive buffer: the caller's until [`Filled::repost`] (or dropped: then it is
/// not posted again, as after an error).
pub struct Filled {
    owner: Owner,
    slot: u32,
    len: u32,
}

impl Filled {
    /// The message: the completion's bytes.
    pub fn bytes(&self) -> &[u8] {
        let region = match &self.owner {
            Owner::Srq(s) => &s.region,
            Owner::Ring(qp) => match qp.ring() {
                Some(r) => &r.region,
                None => return &[],
            },
        };
        // SAFETY: the receive completed and this handle is the only one for the slot until
        // it is posted again (`repost` takes self); the region outlives the handle (held by
        // the SRQ or the QP this holds).
        unsafe { &region.slot(self.slot)[..self.len as usize] }
    }

    /// The QP whose ring this is (None for the SRQ).
    pub fn qp(&self) -> Option<&Arc<RcQueuePair>> {
        match &self.owner {
            Owner::Srq(_) => None,
            Owner::Ring(qp) => Some(qp),
        }
    }

    /// Posts the buffer again, on the SRQ or its connection's ring.
    pub fn repost(self) -> Result<(), VerbsError> {
        match &self.owner {
            Owner::Srq(s) => s.post_slots(&[self.slot]),
            Owner::Ring(qp) => qp.post_ring(&[self.slot]),
        }
    }
}

/// A budget the rings share with others (the node's other interfaces): each ring takes its
/// memory from it before it is registered and gives it back once freed.
pub trait SharedBudget: Send + Sync + std::fmt::Debug {
    /// Takes `bytes` if they fit; false when they do not.
    fn take(&self, bytes: u64) -> bool;
    fn give_back(&self, bytes: u64);
}

/// Receive rings, one per connection, at most `max` at once.
pub struct RingPool {
    pd: Arc<ProtectionDomain>,
    pub depth: u32,
    pub buffer_bytes: u32,
    pub stride: u64,
    pub max: u32,
    /// Rings that exist: counted before their memory is registered, released after it is
    /// freed.
    in_use: AtomicU32,
    registered: AtomicU64,
    next_id: AtomicU32,
    /// The QP of each ring, for routing completions.
    live: Mutex<HashMap<u32, Weak<RcQueuePair>>>,
    /// Rings made, rings refused at the cap, and the time spent registering (ns).
    pub made: AtomicU64,
    pub refused: AtomicU64,
    pub register_ns: AtomicU64,
    /// The budget shared with the node's other interfaces, when there is one.
    shared: OnceLock<Arc<dyn SharedBudget>>,
}

impl RingPool {
    pub(super) fn new(
        pd: &Arc<ProtectionDomain>,
        depth: u32,
        max: u32,
        buffer_bytes: u32,
        stride: u64,
    ) -> Result<Arc<Self>, VerbsError> {
        if depth == 0 || max == 0 || buffer_bytes == 0 || stride < u64::from(buffer_bytes) {
            return Err(pd
                .ctx
                .err("ring sizing", io::Error::from(io::ErrorKind::InvalidInput)));
        }
        Ok(Arc::new(Self {
            pd: pd.clone(),
            depth,
            buffer_bytes,
            stride,
            max,
            in_use: AtomicU32::new(0),
            registered: AtomicU64::new(0),
            next_id: AtomicU32::new(0),
            live: Mutex::new(HashMap::new()),
            made: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            register_ns: AtomicU64::new(0),
            shared: OnceLock::new(),
        }))
    }

    /// From now on each ring also takes its memory from `budget` (set once).
    pub fn share_budget(&self, budget: Arc<dyn SharedBudget>) {
        let _ = self.shared.set(budget);
    }

    /// Rings that exist now (set up, in use, or being torn down).
    pub fn in_use(&self) -> u32 {
        self.in_use.load(Ordering::Relaxed)
    }

    /// Receive memory the rings hold registered now.
    pub fn registered_bytes(&self) -> u64 {
        self.registered.load(Ordering::Relaxed)
    }

    /// One ring's memory.
    pub fn ring_bytes(&self) -> u64 {
        u64::from(self.depth) * self.stride
    }

    /// A new ring: counted first (refused past `max`, before anything is allocated), then its
    /// buffers registered.
    pub(super) fn ring(self: &Arc<Self>) -> Result<RecvRing, VerbsError> {
        let counted = self
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            });
        if counted.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(VerbsError::RingsExhausted { max: self.max });
        }
        let mut permit = Permit {
            pool: self.clone(),
            bytes: 0,
            shared: 0,
        };
        if let Some(b) = self.shared.get() {
            if !b.take(self.ring_bytes()) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(VerbsError::RingsExhausted { max: self.max });
            }
            permit.shared = self.ring_bytes();
        }
        let t0 = std::time::Instant::now();
        let region = MemoryRegion::register(&self.pd, self.depth, self.stride)?;
        self.register_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        permit.bytes = self.ring_bytes();
        self.registered.fetch_add(permit.bytes, Ordering::Relaxed);
        self.made.fetch_add(1, Ordering::Relaxed);
        Ok(RecvRing {
            id: ring_number(self.next_id.fetch_add(1, Ordering::Relaxed)),
            region,
            buffer_bytes: self.buffer_bytes,
            posted: AtomicU32::new(0),
            _permit: permit,
        })
    }

    /// Makes `qp`'s ring findable by its id (for completions).
    pub(super) fn register(&self, id: u32, qp: &Arc<RcQueuePair>) {
        self.live.lock().unwrap().insert(id, Arc::downgrade(qp));
    }

    /// The QP of ring `id`, while it lives.
    pub fn lookup(&self, id: u32) -> Option<Arc<RcQueuePair>> {
        self.live.lock().unwrap().get(&id)?.upgrade()
    }
}

/// A ring's place in the pool's count, and its registered bytes; released when dropped (after
/// the ring's region, a field before it, is deregistered and freed).
struct Permit {
    pool: Arc<RingPool>,
    bytes: u64,
    /// Taken from the shared budget.
    shared: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.pool
            .registered
            .fetch_sub(self.bytes, Ordering::Relaxed);
        if let (Some(b), n @ 1..) = (self.pool.shared.get(), self.shared) {
            b.give_back(n);
        }
        self.pool.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection's receive buffers, owned by its QP (destroyed before them).
pub struct RecvRing {
    pub id: u32,
    pub region: Arc<MemoryRegion>,
    pub buffer_bytes: u32,
    /// Receives posted and not yet completed.
    pub posted: AtomicU32,
    /// Last: released after the region is freed.
    _permit: Permit,
}

impl Drop for RecvRing {
    fn drop(&mut self) {
        self._permit.pool.live.lock().unwrap().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_work_request_id_names_its_ring_and_slot() {
        for (ring, slot) in [(0, 0), (0, 4095), (1, 0), (7, 63), (RING_IDS, u32::MAX)] {
            assert_eq!(ring_and_slot(wr_id(ring, slot)), (ring, slot));
            assert!(wr_id(ring, slot) < super::super::SEND_WR_ID, "ring {ring}");
        }
        // The SRQ's ids are plain slot numbers, as before rings existed.
        assert_eq!(wr_id(0, 42), 42);
        assert_ne!(wr_id(1, 42), wr_id(2, 42));
    }

    #[test]
    fn ring_numbers_skip_the_srq_and_keep_below_the_send_bit() {
        assert_eq!(ring_number(0), 1);
        assert_eq!(ring_number(1), 2);
        assert_eq!(ring_number(RING_IDS - 1), RING_IDS);
        assert_eq!(ring_number(RING_IDS), 1);
        assert_eq!(ring_number(u32::MAX), u32::MAX % RING_IDS + 1);
        assert!((1..=RING_IDS).contains(&ring_number(u32::MAX)));
    }

    #[test]
    fn receives_that_may_be_posted() {
        assert_eq!(ReceiveModel::Srq { depth: 4096 }.receives(), 4096);
        assert_eq!(ReceiveModel::Rings { depth: 64, max: 96 }.receives(), 6144);
        let huge = ReceiveModel::Rings {
            depth: 1 << 20,
            max: 1 << 20,
        };
        assert_eq!(huge.receives(), u32::MAX);
    }
}
