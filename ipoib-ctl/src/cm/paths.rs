//! The path records of one node's setups, by peer address: resolved once (blocking, on
//! tokio's blocking pool) and kept until connected mode restarts, which the port's events
//! make it do, as the kernel's IPoIB flushes its paths on them.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use super::handshake::CmStats;
use crate::path::PathRecord;

/// A failed resolution is tried again for the same peer after this.
const RETRY: Duration = Duration::from_secs(30);

/// Path records by peer address, and when each was looked up (None: the lookup failed).
#[derive(Default)]
pub(super) struct Paths(Mutex<HashMap<IpAddr, (Instant, Option<PathRecord>)>>);

impl Paths {
    /// The record to `ip`: kept, or resolved with each step bounded by `timeout` (counted in
    /// `stats`; the first failure said at warn level, the rest at debug).
    pub(super) async fn get(
        &self,
        ip: IpAddr,
        timeout: Duration,
        stats: &CmStats,
    ) -> Option<PathRecord> {
        if let Some((at, rec)) = self.0.lock().unwrap().get(&ip)
            && (rec.is_some() || at.elapsed() < RETRY)
        {
            return *rec;
        }
        let r = tokio::task::spawn_blocking(move || crate::verbs::resolve_path(ip, timeout)).await;
        let rec = match r {
            Ok(Ok(rec)) => {
                stats.paths_resolved.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("{ip}: path record {rec:?}");
                Some(rec)
            }
            Ok(Err(e)) => {
                let first = stats.paths_unresolved.fetch_add(1, Ordering::Relaxed) == 0;
                let say = format!("{ip}: no path record, SL 0 and the ports' MTU: {e}");
                if first {
                    tracing::warn!("{say}");
                } else {
                    tracing::debug!("{say}");
                }
                None
            }
            Err(_) => None,
        };
        self.0.lock().unwrap().insert(ip, (Instant::now(), rec));
        rec
    }
}
