//! The graves against a provider model that behaves as mlx5's does on destroy: the QP's
//! unpolled completions are cleaned out of the CQ and the SRQ buffers they had consumed are
//! freed with no completion, so they are never posted again.

use std::{cell::RefCell, collections::VecDeque, rc::Rc};

use super::*;

/// An SRQ of `depth` buffers shared by every QP, one CQ, and the QPs' states.
struct Provider {
    depth: u32,
    /// Buffers posted in the SRQ.
    posted: u32,
    /// Completions not yet polled: (QP, a receive or a drain marker).
    cq: VecDeque<(u32, bool)>,
    /// QPs in the error state: receives still to land before LAST_WQE_REACHED, and whether
    /// the event has been raised.
    erroring: HashMap<u32, (u32, bool)>,
    /// LAST_WQE_REACHED raised and not yet read.
    events: Vec<u32>,
    /// Whether LAST_WQE_REACHED is raised at all (a provider may not).
    raises_last_wqe: bool,
    destroyed: Vec<u32>,
}

impl Provider {
    fn recv_entries(&self) -> u32 {
        self.cq.iter().filter(|(_, recv)| *recv).count() as u32
    }

    /// A message lands on `qpn`: an SRQ buffer taken, its completion queued.
    fn receive(&mut self, qpn: u32) -> bool {
        if self.posted == 0 {
            return false;
        }
        self.posted -= 1;
        self.cq.push_back((qpn, true));
        true
    }

    /// mlx5's destroy: the QP's unpolled completions cleaned out of the CQ, their buffers
    /// freed in the SRQ with nothing to post them again.
    fn destroy(&mut self, qpn: u32) {
        self.cq.retain(|(q, _)| *q != qpn);
        self.erroring.remove(&qpn);
        self.destroyed.push(qpn);
    }
}

/// A QP of the model: destroyed in the provider when its last holder drops it.
struct Inner {
    qpn: u32,
    provider: Rc<RefCell<Provider>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.provider.borrow_mut().destroy(self.qpn);
    }
}

#[derive(Clone)]
struct Qp(Rc<Inner>);

impl SendEnd for Qp {
    fn qpn(&self) -> u32 {
        self.0.qpn
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// What a run found: the least buffers ever accounted for (posted, queued on the CQ or held by
/// the engine), QPs let go by each exit, and QPs closed long enough before the end (two
/// bounds and a housekeeping) that are still not destroyed.
#[derive(Debug, Default)]
struct Outcome {
    least: u32,
    drained: u32,
    timed_out: u32,
    held_long: usize,
}

/// One seeded run: the provider, the connections open, the graves, the buffers the engine
/// holds (polled, not yet posted again), and what it found.
struct Model {
    p: Rc<RefCell<Provider>>,
    rng: Rng,
    live: Vec<Qp>,
    g: Graves<Qp>,
    /// `graves`: closes go through [`Graves`]; otherwise the QP is dropped at the close, as
    /// before.
    graves: bool,
    held: u32,
    next_qpn: u32,
    /// Each close: the QP and the step.
    closed: Vec<(u32, u32)>,
    out: Outcome,
}

const DEPTH: u32 = 64;

impl Model {
    fn new(seed: u64, graves: bool, raises_last_wqe: bool) -> Self {
        Self {
            p: Rc::new(RefCell::new(Provider {
                depth: DEPTH,
                posted: DEPTH,
                cq: VecDeque::new(),
                erroring: HashMap::new(),
                events: Vec::new(),
                raises_last_wqe,
                destroyed: Vec::new(),
            })),
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            live: Vec::new(),
            g: Graves::default(),
            graves,
            held: 0,
            next_qpn: 0x100,
            closed: Vec::new(),
            out: Outcome {
                least: DEPTH,
                ..Outcome::default()
            },
        }
    }

    /// A connection opens, or one closes under traffic (a few messages still land on it in
    /// error), or messages land on open ones.
    fn churn(&mut self, step: u32) {
        match self.rng.next(10) {
            0 if self.live.len() < 8 => {
                let qp = Qp(Rc::new(Inner {
                    qpn: self.next_qpn,
                    provider: self.p.clone(),
                }));
                self.live.push(qp);
                self.next_qpn += 1;
            }
            1 if !self.live.is_empty() => {
                let i = self.rng.next(self.live.len() as u64) as usize;
                let qp = self.live.swap_remove(i);
                let late = self.rng.next(3) as u32;
                self.closed.push((qp.qpn(), step));
                self.p.borrow_mut().erroring.insert(qp.qpn(), (late, false));
                if self.graves {
                    self.g.bury(qp);
                }
            }
            _ => {
                for _ in 0..self.rng.next(6) {
                    let i = self.rng.next(self.live.len().max(1) as u64) as usize;
                    if let Some(qp) = self.live.get(i) {
                        self.p.borrow_mut().receive(qp.qpn());
                    }
                }
            }
        }
    }

    /// QPs in error: what was in flight lands, then LAST_WQE_REACHED.
    fn provider(&mut self) {
        let mut pv = self.p.borrow_mut();
        let erroring: Vec<u32> = pv.erroring.keys().copied().collect();
        for qpn in erroring {
            let (late, raised) = pv.erroring[&qpn];
            if late > 0 {
                pv.receive(qpn);
                pv.erroring.insert(qpn, (late - 1, false));
            } else if !raised {
                pv.erroring.insert(qpn, (0, true));
                if pv.raises_last_wqe {
                    pv.events.push(qpn);
                }
            }
        }
    }

    fn exit(&mut self, e: Exit) {
        match e {
            Exit::Drained => self.out.drained += 1,
            Exit::TimedOut | Exit::Refused => self.out.timed_out += 1,
        }
    }

    /// The engine: events, due markers (a marker's completion queued after the QP's others),
    /// a few completions polled, the buffers it holds posted again, a housekeeping every 20
    /// steps.
    fn engine(&mut self, step: u32) {
        let events: Vec<u32> = std::mem::take(&mut self.p.borrow_mut().events);
        for qpn in events {
            self.g.last_wqe(qpn);
        }
        for qp in self.g.due() {
            self.p.borrow_mut().cq.push_back((qp.qpn(), false));
        }
        for _ in 0..self.rng.next(8) {
            let e = self.p.borrow_mut().cq.pop_front();
            match e {
                Some((_, true)) => self.held += 1,
                Some((qpn, false)) => {
                    if let Some((qp, e)) = self.g.drained(qpn) {
                        self.exit(e);
                        drop(qp);
                    }
                }
                None => break,
            }
        }
        if self.rng.next(2) == 0 {
            self.p.borrow_mut().posted += self.held;
            self.held = 0;
        }
        if step % 20 == 19 {
            for (qp, e) in self.g.housekeeping() {
                self.exit(e);
                drop(qp);
            }
        }
    }

    /// Buffers posted, queued on the CQ or held: never more than the depth; the least seen.
    fn account(&mut self, seed: u64, step: u32) {
        let pv = self.p.borrow();
        let accounted = pv.posted + pv.recv_entries() + self.held;
        self.out.least = self.out.least.min(accounted);
        assert!(
            accounted <= pv.depth,
            "seed {seed} step {step}: {accounted}"
        );
    }
}

/// `steps` steps of [`Model`].
fn run(seed: u64, steps: u32, graves: bool, raises_last_wqe: bool) -> Outcome {
    let mut m = Model::new(seed, graves, raises_last_wqe);
    for step in 0..steps {
        m.churn(step);
        m.provider();
        m.engine(step);
        m.account(seed, step);
    }
    let window = 20 * (2 * GRAVE_HOUSEKEEPINGS + 2);
    let destroyed = m.p.borrow().destroyed.clone();
    m.out.held_long = m
        .closed
        .iter()
        .filter(|(qpn, at)| at + window < steps && !destroyed.contains(qpn))
        .count();
    m.out
}

/// Thousands of seeded churns under traffic: with the graves every buffer is always posted,
/// queued or held (posted + free = the depth at every step); each QP leaves by its marker.
#[test]
fn under_churn_the_srq_keeps_its_depth_when_each_qp_is_drained_first() {
    let mut drained = 0;
    for seed in 1..=300u64 {
        let o = run(seed, 400, true, true);
        assert_eq!(o.least, 64, "seed {seed}: {o:?}");
        assert_eq!(o.timed_out, 0, "seed {seed}: {o:?}");
        assert_eq!(o.held_long, 0, "seed {seed}: {o:?}");
        drained += o.drained;
    }
    assert!(drained > 3000, "too few closes to say anything: {drained}");
}

/// The model can fail: without the graves (a QP destroyed at its close, as before), the
/// provider's destroy loses the buffers of the completions it cleans out.
#[test]
fn the_model_fails_against_a_qp_destroyed_at_its_close() {
    let lost = (1..=300u64)
        .filter(|&seed| run(seed, 400, false, true).least < 64)
        .count();
    assert!(lost > 150, "only {lost} of 300 runs lost a buffer");
}

/// A provider that never raises LAST_WQE_REACHED: each QP is still let go (by its marker,
/// posted once the wait is past its bound), none held for good.
#[test]
fn without_last_wqe_reached_each_qp_still_goes() {
    for seed in 1..=100u64 {
        let o = run(seed, 400, true, false);
        assert_eq!(o.held_long, 0, "seed {seed}: {o:?}");
        assert!(o.drained > 0, "seed {seed}: {o:?}");
    }
}

#[derive(Clone)]
struct Plain(u32);

impl SendEnd for Plain {
    fn qpn(&self) -> u32 {
        self.0
    }
}

#[test]
fn each_wait_is_bounded_and_each_marker_posted_once() {
    let mut g = Graves::default();
    g.bury(Plain(7));
    assert!(g.due().is_empty(), "posted before LAST_WQE_REACHED");
    for _ in 0..GRAVE_HOUSEKEEPINGS - 1 {
        assert!(g.housekeeping().is_empty());
        assert!(g.due().is_empty());
    }
    assert!(g.housekeeping().is_empty());
    // Past the wait's bound: posted without the event, once.
    assert_eq!(g.due().iter().map(SendEnd::qpn).collect::<Vec<_>>(), [7]);
    assert!(g.due().is_empty());
    // The marker not reaped within the bound: let go, timed out.
    for _ in 0..GRAVE_HOUSEKEEPINGS {
        assert!(g.housekeeping().is_empty());
    }
    let gone = g.housekeeping();
    assert_eq!(gone.len(), 1);
    assert_eq!((gone[0].0.qpn(), gone[0].1), (7, Exit::TimedOut));
    assert!(g.is_empty());
}

#[test]
fn the_event_before_the_burial_counts_and_a_refused_marker_lets_go() {
    let mut g = Graves::default();
    g.last_wqe(9);
    g.bury(Plain(9));
    assert_eq!(g.due().len(), 1, "the early event was kept");
    assert_eq!(
        g.drained(9).map(|(q, e)| (q.0, e)),
        Some((9, Exit::Drained))
    );
    assert!(g.drained(9).is_none());
    // An early event too old is forgotten.
    g.last_wqe(11);
    for _ in 0..=GRAVE_HOUSEKEEPINGS {
        g.housekeeping();
    }
    g.bury(Plain(11));
    assert!(g.due().is_empty());
    assert_eq!(
        g.refused(11).map(|(q, e)| (q.0, e)),
        Some((11, Exit::Refused))
    );
    assert_eq!(g.len(), 0);
    assert_eq!(drain_of(DRAIN_WR_ID | 0x1234), Some(0x1234));
    assert_eq!(drain_of(0x1234), None);
}

/// A grave whose marker is not posted is never let go by a housekeeping, however long it
/// waits: its marker goes at the next look; an early event is kept through the bound's
/// housekeepings; the count of graves is what is held.
#[test]
fn only_a_posted_marker_times_out_and_an_early_event_lasts_its_bound() {
    let mut g = Graves::default();
    g.bury(Plain(5));
    g.bury(Plain(6));
    assert_eq!((g.len(), g.is_empty()), (2, false));
    for _ in 0..3 * GRAVE_HOUSEKEEPINGS {
        assert!(g.housekeeping().is_empty(), "let go before its marker");
    }
    assert_eq!(g.due().len(), 2);
    g.last_wqe(9);
    for _ in 0..GRAVE_HOUSEKEEPINGS {
        g.housekeeping();
    }
    g.bury(Plain(9));
    assert!(
        g.due().iter().any(|q| q.0 == 9),
        "an early event forgotten within its bound"
    );
}
