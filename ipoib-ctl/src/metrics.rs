//! Prometheus metrics of one attached interface, made from what `status --json` shows (so the
//! two agree), encoded by the `prometheus-client` crate and written as a node_exporter
//! textfile (`attach --metrics-textfile DIR`): `DIR/ipoib-ctl-IFACE.prom`, replaced whole by a
//! rename, so a scrape never reads half a file.
//!
//! Per-peer series only with `--metrics-peers`: on a cluster of thousands of nodes they are
//! thousands of series per node.

use std::{
    path::{Path, PathBuf},
    sync::atomic::AtomicU64,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{
    maps::PeerCacheCounts,
    promotion::UdPath,
    status::{
        Status,
        cm::{CmPeerState, CmStatus},
    },
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Iface {
    iface: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    iface: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Event {
    iface: String,
    event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Lookup {
    iface: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerState {
    iface: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureReason {
    iface: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerPath {
    iface: String,
    peer: String,
    path: String,
}

type Gauges = Family<Iface, Gauge>;
type FloatGauges = Family<Iface, Gauge<f64, AtomicU64>>;

/// A family registered under `name`, and filled by the caller.
fn family<L, M>(reg: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Default
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let f = Family::<L, M>::default();
    reg.register(name, help, f.clone());
    f
}

/// The metrics of `s`, in Prometheus' text format.
pub fn render(s: &Status, per_peer: bool) -> String {
    let mut reg = Registry::with_prefix("ipoib");
    let iface = Iface {
        iface: s.iface.clone(),
    };
    decision_metrics(&mut reg, s);
    if let Some(c) = &s.peer_cache {
        peer_cache_metrics(&mut reg, &iface, c);
    }
    heartbeat_metrics(&mut reg, &iface, s);
    let mut gauges = vec![
        (
            "failsafe_active",
            "1 while the fail-safe sends every packet UD (the heartbeat is stale)",
            u64::from(s.failsafe_active),
        ),
        (
            "loop_running",
            "1 while the control loop runs",
            u64::from(s.loop_running),
        ),
        (
            "cm_running",
            "1 while connected mode runs (0: every peer on UD)",
            u64::from(s.cm.is_some()),
        ),
    ];
    if let Some(cm) = &s.cm {
        gauges.extend(cm_gauges(cm));
        cm_counters(&mut reg, &iface, cm);
        let g: FloatGauges = family(
            &mut reg,
            "cm_tick_late_max_seconds",
            "The latest the control loop's tick ran after its time since connected mode started",
        );
        g.get_or_create(&iface)
            .set(cm.tick_late_max_ms as f64 / 1e3);
    }
    for (name, help, v) in gauges {
        let g: Gauges = family(&mut reg, name, help);
        g.get_or_create(&iface)
            .set(i64::try_from(v).unwrap_or(i64::MAX));
    }
    if per_peer {
        peer_metrics(&mut reg, s);
    }
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing into a String");
    out
}

/// The heartbeat's age (when there is one) and the timeout it is held to.
fn heartbeat_metrics(reg: &mut Registry, iface: &Iface, s: &Status) {
    if let Some(ms) = s.heartbeat_age_ms {
        let g: FloatGauges = family(
            reg,
            "heartbeat_age_seconds",
            "Age of the heartbeat the fast path trusts",
        );
        g.get_or_create(iface).set(ms as f64 / 1e3);
    }
    let timeout: FloatGauges = family(
        reg,
        "heartbeat_timeout_seconds",
        "The heartbeat's age past which the fail-safe sends every packet UD (the policy's \
         heartbeat-timeout)",
    );
    timeout
        .get_or_create(iface)
        .set(s.policy.heartbeat_timeout_ms as f64 / 1e3);
}

/// The fast path's decisions by reason: packets and bytes.
fn decision_metrics(reg: &mut Registry, s: &Status) {
    let decisions: Family<Reason, Counter> = family(
        reg,
        "decisions",
        "Packets the fast path sent, by the reason for their path",
    );
    let decision_bytes: Family<Reason, Counter> = family(
        reg,
        "decision_bytes",
        "Bytes the fast path sent, by the reason for their path",
    );
    for (reason, c) in &s.reasons {
        let l = Reason {
            iface: s.iface.clone(),
            reason: reason.clone(),
        };
        decisions.get_or_create(&l).inc_by(c.packets);
        decision_bytes.get_or_create(&l).inc_by(c.bytes);
    }
}

/// The peer cache's lookups by result, and its slots in use.
fn peer_cache_metrics(reg: &mut Registry, iface: &Iface, c: &PeerCacheCounts) {
    let lookups: Family<Lookup, Counter> = family(
        reg,
        "peer_cache_lookups",
        "Peers-map answers the fast path asked its per-CPU cache for since the programs were \
         loaded: hit, stale (the peer held under an older heartbeat), other (an empty slot or \
         another peer's)",
    );
    for (result, n) in [
        ("hit", c.hits),
        ("stale", c.misses_stale),
        ("other", c.misses_other),
    ] {
        let l = Lookup {
            iface: iface.iface.clone(),
            result: result.to_owned(),
        };
        lookups.get_or_create(&l).inc_by(n);
    }
    let g: Gauges = family(
        reg,
        "peer_cache_slots_filled",
        "Slots of the fast path's peer cache holding an answer, over every CPU",
    );
    g.get_or_create(iface)
        .set(i64::try_from(c.slots_filled).unwrap_or(i64::MAX));
}

/// Bytes sent to each peer by path (`--metrics-peers`).
fn peer_metrics(reg: &mut Registry, s: &Status) {
    let bytes: Family<PeerPath, Counter> = family(
        reg,
        "peer_tx_bytes",
        "Bytes sent to a peer, by path (--metrics-peers)",
    );
    for p in &s.peers {
        for (path, v) in [("ud", p.traffic.tx_ud_bytes), ("cm", p.traffic.tx_cm_bytes)] {
            let l = PeerPath {
                iface: s.iface.clone(),
                peer: p.addr.clone(),
                path: path.to_owned(),
            };
            bytes.get_or_create(&l).inc_by(v);
        }
    }
}

/// Connected mode's levels: connections against the plan, receive memory against the budget.
fn cm_gauges(cm: &CmStatus) -> [(&'static str, &'static str, u64); 7] {
    [
        ("cm_connections", "RC connections up", cm.connections as u64),
        (
            "cm_engine_lanes",
            "CM engines, one per TUN queue (attach --cm-lanes)",
            u64::from(cm.engine_lanes),
        ),
        (
            "ud_segmentation_offloaded",
            "1 when the interface segments in the device (TSO): mode auto then promotes no \
             peer by its rate",
            u64::from(cm.ud_path == UdPath::Offloaded),
        ),
        (
            "cm_max_connections",
            "RC connections the memory plan and the policy allow",
            cm.max_connections as u64,
        ),
        (
            "cm_receive_registered_bytes",
            "Receive memory registered for connected mode",
            cm.receive.registered_bytes,
        ),
        (
            "cm_receive_budget_bytes",
            "The memory plan's budget for receive memory",
            cm.receive.budget_bytes,
        ),
        (
            "cm_receive_rings",
            "Receive rings in use (0 with a shared receive queue)",
            u64::from(cm.receive.rings),
        ),
    ]
}

/// Connected mode's counts: setups, failures, peers by state (backoff among them), the
/// engine's counters.
fn cm_counters(reg: &mut Registry, iface: &Iface, cm: &CmStatus) {
    for (name, help, v) in [
        (
            "cm_setups_established",
            "Connections established (set up by us or accepted)",
            cm.established,
        ),
        (
            "cm_setups_failed",
            "Connection setups that failed or were refused",
            cm.failed,
        ),
        (
            "cm_srq_low_events",
            "Times fewer than a quarter of the SRQ's buffers were posted",
            cm.srq_low_events,
        ),
    ] {
        let c: Family<Iface, Counter> = family(reg, name, help);
        c.get_or_create(iface).inc_by(v);
    }
    let cpu: Family<Iface, Counter<f64, AtomicU64>> = family(
        reg,
        "cm_engine_cpu_seconds",
        "CPU time of the connected-mode engine's threads (with one lane, the control loop's \
         too)",
    );
    cpu.get_or_create(iface)
        .inc_by(cm.engine_cpu_ns as f64 / 1e9);
    cm_peers(reg, iface, cm);
    let engine: Family<Event, Counter> =
        family(reg, "engine_events", "The connected-mode engine's counters");
    for (event, v) in &cm.engine {
        let l = Event {
            iface: iface.iface.clone(),
            event: event.clone(),
        };
        engine.get_or_create(&l).inc_by(*v);
    }
}

/// Connected mode's peers by state, and those failing by their last failure's reason.
fn cm_peers(reg: &mut Registry, iface: &Iface, cm: &CmStatus) {
    let peers: Family<PeerState, Gauge> = family(
        reg,
        "cm_peers",
        "Peers the policy knows, by state (ud, connecting, cm, closing, backoff)",
    );
    for state in CmPeerState::ALL {
        let n = cm.peers.iter().filter(|p| p.state == state).count();
        let l = PeerState {
            iface: iface.iface.clone(),
            state: state.name().to_owned(),
        };
        peers.get_or_create(&l).set(n as i64);
    }
    let waiting: Gauges = family(
        reg,
        "cm_peers_waiting_for_plan",
        "Peers worth a connection but kept on UD because the memory plan is full",
    );
    waiting
        .get_or_create(iface)
        .set(cm.peers.iter().filter(|p| p.waiting_for_plan).count() as i64);
    let failing: Family<FailureReason, Gauge> = family(
        reg,
        "cm_peers_failing",
        "Peers whose last setup failed or connection broke (not on CM since), by reason",
    );
    for reason in crate::promotion::Failure::ALL {
        let n = cm
            .peers
            .iter()
            .filter(|p| {
                p.state != CmPeerState::Cm
                    && p.last_failure.as_ref().is_some_and(|l| l.reason == reason)
            })
            .count();
        let l = FailureReason {
            iface: iface.iface.clone(),
            reason: reason.key().to_owned(),
        };
        failing.get_or_create(&l).set(n as i64);
    }
}

/// `DIR/ipoib-ctl-IFACE.prom`.
pub fn textfile_path(dir: &Path, iface: &str) -> PathBuf {
    dir.join(format!("ipoib-ctl-{iface}.prom"))
}

/// Replaces the textfile whole: written beside it (a name node_exporter does not read), then
/// renamed over it.
pub fn write_textfile(dir: &Path, iface: &str, text: &str) -> std::io::Result<()> {
    crate::files::replace(&textfile_path(dir, iface), text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A status as `status --json` prints it: two reasons, connected mode with a connection,
    /// two peers in the policy and one engine counter, one peer in the maps.
    fn status(cm: bool) -> Status {
        let mut v = serde_json::json!({
            "iface": "ib0", "ifindex": 4, "egress_attach": "netlink", "ingress": "tc",
            "policy": {"link": "ipoib", "mode": "auto", "cm_threshold": 1024,
                       "heartbeat_timeout_ms": 3000, "kernel_cm": false, "ctl_port": 4755,
                       "any_blocked": false, "memory_budget": null, "max_connections": null},
            "heartbeat_age_ms": 250, "heartbeat_writer_pid": 7, "failsafe_active": false,
            "loop_pid": 7, "loop_running": true,
            "reasons": {"tx_cm": {"packets": 10, "bytes": 650000},
                        "tx_ud_small": {"packets": 3, "bytes": 200}},
            "peer_cache": {"hits": 11, "misses_stale": 2, "misses_other": 3,
                           "slots_filled": 4},
            "peers": [{"addr": "10.0.0.2", "mode": "cm_up", "pin": "auto", "cm_ifindex": 9,
                       "generation": 1, "tx_ud_packets": 3, "tx_ud_bytes": 200,
                       "tx_cm_packets": 10, "tx_cm_bytes": 650000, "rx_packets": 0,
                       "rx_bytes": 0, "rx_dropped": 0, "last_seen_ms_ago": 5}],
            "cm": null,
        });
        if cm {
            let mut c = serde_json::to_value(CmStatus::default()).unwrap();
            c["connections"] = 1.into();
            c["max_connections"] = 96.into();
            c["established"] = 4.into();
            c["failed"] = 2.into();
            c["srq_low_events"] = 1.into();
            c["tick_late_max_ms"] = 125.into();
            c["engine_lanes"] = 2.into();
            c["engine_cpu_ns"] = 1_500_000_000u64.into();
            c["ud_path"] = "offloaded".into();
            c["receive"]["registered_bytes"] = 4194304.into();
            c["receive"]["budget_bytes"] = 16777216.into();
            c["receive"]["rings"] = 1.into();
            c["engine"] = serde_json::json!({"tx_posted": 10});
            c["peers"] = serde_json::json!([
                {"addr": "10.0.0.2", "state": "cm", "why": "", "failures": 0, "promotions": 1},
                {"addr": "10.0.0.3", "state": "backoff", "why": "", "failures": 2,
                 "last_failure": {"reason": "not_running", "said": "", "secs_ago": 3},
                 "promotions": 1},
                {"addr": "10.0.0.4", "state": "connecting", "why": "", "failures": 1,
                 "last_failure": {"reason": "not_running", "said": "", "secs_ago": 9},
                 "promotions": 0},
                // Up again after a failure: failing no more.
                {"addr": "10.0.0.5", "state": "cm", "why": "", "failures": 1,
                 "last_failure": {"reason": "timeout", "said": "", "secs_ago": 30},
                 "promotions": 2},
                {"addr": "10.0.0.6", "state": "ud", "why": "", "failures": 0,
                 "promotions": 0, "waiting_for_plan": true},
                {"addr": "10.0.0.7", "state": "ud", "why": "", "failures": 0, "promotions": 0}
            ]);
            v["cm"] = c;
        }
        serde_json::from_value(v).unwrap()
    }

    /// The value of one series in the text.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_number_of_the_status_is_a_series() {
        let t = render(&status(true), false);
        let want = [
            (r#"ipoib_decisions_total{iface="ib0",reason="tx_cm"}"#, 10.0),
            (
                r#"ipoib_decision_bytes_total{iface="ib0",reason="tx_cm"}"#,
                650000.0,
            ),
            (
                r#"ipoib_decisions_total{iface="ib0",reason="tx_ud_small"}"#,
                3.0,
            ),
            (r#"ipoib_heartbeat_age_seconds{iface="ib0"}"#, 0.25),
            (r#"ipoib_heartbeat_timeout_seconds{iface="ib0"}"#, 3.0),
            (r#"ipoib_failsafe_active{iface="ib0"}"#, 0.0),
            (r#"ipoib_loop_running{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_running{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_connections{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_engine_lanes{iface="ib0"}"#, 2.0),
            (r#"ipoib_cm_engine_cpu_seconds_total{iface="ib0"}"#, 1.5),
            (r#"ipoib_cm_max_connections{iface="ib0"}"#, 96.0),
            (
                r#"ipoib_cm_receive_registered_bytes{iface="ib0"}"#,
                4194304.0,
            ),
            (r#"ipoib_cm_receive_budget_bytes{iface="ib0"}"#, 16777216.0),
            (r#"ipoib_cm_receive_rings{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_tick_late_max_seconds{iface="ib0"}"#, 0.125),
            (r#"ipoib_ud_segmentation_offloaded{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_setups_established_total{iface="ib0"}"#, 4.0),
            (r#"ipoib_cm_setups_failed_total{iface="ib0"}"#, 2.0),
            (r#"ipoib_cm_srq_low_events_total{iface="ib0"}"#, 1.0),
            (r#"ipoib_cm_peers{iface="ib0",state="cm"}"#, 2.0),
            (r#"ipoib_cm_peers{iface="ib0",state="connecting"}"#, 1.0),
            (
                r#"ipoib_cm_peers_failing{iface="ib0",reason="not_running"}"#,
                2.0,
            ),
            (
                r#"ipoib_cm_peers_failing{iface="ib0",reason="timeout"}"#,
                0.0,
            ),
            (r#"ipoib_cm_peers{iface="ib0",state="backoff"}"#, 1.0),
            (r#"ipoib_cm_peers{iface="ib0",state="ud"}"#, 2.0),
            (r#"ipoib_cm_peers_waiting_for_plan{iface="ib0"}"#, 1.0),
            (
                r#"ipoib_engine_events_total{iface="ib0",event="tx_posted"}"#,
                10.0,
            ),
        ];
        for (series, v) in want {
            assert_eq!(value(&t, series), Some(v), "{series} in:\n{t}");
        }
    }

    #[test]
    fn per_peer_series_only_on_request() {
        let t = render(&status(true), false);
        assert!(!t.contains("peer="), "{t}");
        let t = render(&status(true), true);
        let peer = r#"ipoib_peer_tx_bytes_total{iface="ib0",peer="10.0.0.2",path="#;
        assert_eq!(
            value(&t, &format!(r#"{peer}"cm"}}"#)),
            Some(650000.0),
            "{t}"
        );
        assert_eq!(value(&t, &format!(r#"{peer}"ud"}}"#)), Some(200.0), "{t}");
    }

    #[test]
    fn the_peer_cache_is_counted_by_result_and_its_filled_slots_gauged() {
        let t = render(&status(false), false);
        let lookups = r#"ipoib_peer_cache_lookups_total{iface="ib0",result="#;
        for (result, v) in [("hit", 11.0), ("stale", 2.0), ("other", 3.0)] {
            let series = format!(r#"{lookups}"{result}"}}"#);
            assert_eq!(value(&t, &series), Some(v), "{series} in:\n{t}");
        }
        assert_eq!(
            value(&t, r#"ipoib_peer_cache_slots_filled{iface="ib0"}"#),
            Some(4.0),
            "{t}"
        );
    }

    #[test]
    fn without_connected_mode_it_says_so_and_has_no_cm_series() {
        let mut s = status(false);
        s.failsafe_active = true;
        s.heartbeat_age_ms = None;
        let t = render(&s, false);
        assert_eq!(value(&t, r#"ipoib_cm_running{iface="ib0"}"#), Some(0.0));
        assert_eq!(
            value(&t, r#"ipoib_failsafe_active{iface="ib0"}"#),
            Some(1.0)
        );
        assert!(!t.contains("ipoib_cm_connections"), "{t}");
        assert!(!t.contains("heartbeat_age"), "{t}");
        // Programs that do not count their cache: no cache series (not zeros).
        s.peer_cache = None;
        let t = render(&s, false);
        assert!(!t.contains("peer_cache"), "{t}");
    }

    #[test]
    fn the_textfile_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("ipoib-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_textfile(&dir, "ib0", "a 1\n").unwrap();
        write_textfile(&dir, "ib0", "b 2\n").unwrap();
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["ipoib-ctl-ib0.prom"]);
        assert_eq!(
            std::fs::read_to_string(textfile_path(&dir, "ib0")).unwrap(),
            "b 2\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The shipped alerting rules, their tests and the dashboard name only series that
    /// `render` writes (or node_exporter's own): a metric renamed here breaks this test.
    #[test]
    fn the_shipped_rules_and_dashboard_name_only_series_it_writes() {
        let text = render(&status(true), true);
        let written: std::collections::BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        assert!(written.len() > 20, "{written:?}");
        let shipped = [
            (
                "ipoib-hybrid.rules.yml",
                include_str!("../../deploy/prometheus/ipoib-hybrid.rules.yml"),
            ),
            (
                "ipoib-hybrid.rules.test.yml",
                include_str!("../../deploy/prometheus/ipoib-hybrid.rules.test.yml"),
            ),
            (
                "ipoib-hybrid.json",
                include_str!("../../deploy/grafana/ipoib-hybrid.json"),
            ),
        ];
        for (file, body) in shipped {
            let names: Vec<&str> = body
                .match_indices("ipoib_")
                .map(|(i, _)| {
                    let rest = &body[i..];
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(rest.len());
                    &rest[..end]
                })
                // `ipoib-ctl-IFACE.prom` in a file name is not a series.
                .filter(|n| n.len() > "ipoib_".len())
                .collect();
            assert!(!names.is_empty(), "{file} names no series");
            for n in names {
                assert!(
                    written.contains(n),
                    "{file} names {n}, which ipoib-ctl does not write: {written:?}"
                );
            }
        }
    }
}
