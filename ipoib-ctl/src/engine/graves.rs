//! QPs on an SRQ on their way out, taken down as the kernel's `ipoib_cm.c` takes its
//! connections down: the QP in the error state, then `IBV_EVENT_QP_LAST_WQE_REACHED` (no more
//! receive of the SRQ will complete on it), then a drain marker (a send posted on the errored
//! QP, which completes flushed after everything the QP put on the CQ before it), then, once
//! the engine has reaped that marker, the QP is let go and destroyed.
//!
//! Why: a provider may clean a destroyed QP's unpolled completions out of the CQ and free the
//! SRQ buffers they had consumed with no completion at all (mlx5's `mlx5_destroy_qp` does), so
//! a buffer received into but not yet polled would never be posted again, and the SRQ would
//! shrink with every connection that ends under traffic. rxe delivers those completions after
//! the destroy instead, so the lab never showed it. Each wait is bounded (a provider that
//! sends no LAST_WQE_REACHED, or does not flush a send posted in error, gets today's
//! teardown, counted), so a QP is never held for good.
//!
//! Pure: the engine's loop buries, hears the event, posts the marker, reaps it, and drops
//! what is let go. The model test below runs it against a provider that behaves as mlx5 does.

use std::collections::HashMap;

use super::SendEnd;

/// Housekeepings (2 s) a buried QP waits for LAST_WQE_REACHED before its marker is posted
/// anyway, and again for the marker's completion before it is let go anyway.
pub const GRAVE_HOUSEKEEPINGS: u32 = 4;

pub use crate::verbs::DRAIN_WR_ID;

/// The QP number a drain marker's id names, if it is one (the id as a completion gives it,
/// [`crate::verbs::SEND_WR_ID`] taken off).
pub fn drain_of(wr_id: u64) -> Option<u32> {
    (wr_id & DRAIN_WR_ID != 0).then_some((wr_id & 0xff_ffff) as u32)
}

struct Grave<Q> {
    qp: Q,
    last_wqe: bool,
    drain_posted: bool,
    housekeepings: u32,
}

/// How a QP left its grave, counted by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Its marker was reaped: every completion of it was taken before it goes.
    Drained,
    /// No LAST_WQE_REACHED within the bound, or no marker completion: let go as before.
    TimedOut,
    /// The QP refused the marker: let go at once.
    Refused,
}

/// The QPs being taken down, by QP number.
pub struct Graves<Q> {
    graves: HashMap<u32, Grave<Q>>,
    /// LAST_WQE_REACHED heard for a QP not (yet) buried, and housekeepings since: the event
    /// may come before the burial's command does.
    early: HashMap<u32, u32>,
}

impl<Q> Default for Graves<Q> {
    fn default() -> Self {
        Self {
            graves: HashMap::new(),
            early: HashMap::new(),
        }
    }
}

impl<Q: SendEnd> Graves<Q> {
    /// QPs held.
    pub fn len(&self) -> usize {
        self.graves.len()
    }

    pub fn is_empty(&self) -> bool {
        self.graves.is_empty()
    }

    /// `qp`, already in the error state, is held until drained.
    pub fn bury(&mut self, qp: Q) {
        let qpn = qp.qpn();
        let last_wqe = self.early.remove(&qpn).is_some();
        self.graves.insert(
            qpn,
            Grave {
                qp,
                last_wqe,
                drain_posted: false,
                housekeepings: 0,
            },
        );
    }

    /// IBV_EVENT_QP_LAST_WQE_REACHED for `qpn`.
    pub fn last_wqe(&mut self, qpn: u32) {
        match self.graves.get_mut(&qpn) {
            Some(g) => g.last_wqe = true,
            None => {
                self.early.insert(qpn, 0);
            }
        }
    }

    /// The QPs whose marker is to be posted now (each once): LAST_WQE_REACHED heard, or its
    /// wait past the bound.
    pub fn due(&mut self) -> Vec<Q> {
        self.graves
            .values_mut()
            .filter(|g| !g.drain_posted && (g.last_wqe || g.housekeepings >= GRAVE_HOUSEKEEPINGS))
            .map(|g| {
                g.drain_posted = true;
                g.housekeepings = 0;
                g.qp.clone()
            })
            .collect()
    }

    /// `qpn`'s marker could not be posted: let go at once.
    pub fn refused(&mut self, qpn: u32) -> Option<(Q, Exit)> {
        self.graves.remove(&qpn).map(|g| (g.qp, Exit::Refused))
    }

    /// `qpn`'s marker was reaped: every completion of the QP has been taken; let go.
    pub fn drained(&mut self, qpn: u32) -> Option<(Q, Exit)> {
        self.graves.remove(&qpn).map(|g| (g.qp, Exit::Drained))
    }

    /// A housekeeping: each wait ages; a marker posted and not reaped past the bound is let go
    /// (what it returns), and early events too old to be matched are forgotten.
    pub fn housekeeping(&mut self) -> Vec<(Q, Exit)> {
        for g in self.graves.values_mut() {
            g.housekeepings += 1;
        }
        self.early.retain(|_, n| {
            *n += 1;
            *n <= GRAVE_HOUSEKEEPINGS
        });
        let late: Vec<u32> = self
            .graves
            .iter()
            .filter(|(_, g)| g.drain_posted && g.housekeepings > GRAVE_HOUSEKEEPINGS)
            .map(|(qpn, _)| *qpn)
            .collect();
        late.into_iter()
            .filter_map(|qpn| self.graves.remove(&qpn))
            .map(|g| (g.qp, Exit::TimedOut))
            .collect()
    }
}

#[cfg(test)]
mod tests;
