//! The promotion policy (`ipoib_ctl::promotion`, the code the engine runs) driven at thousands
//! of peers: 4096 neighbours, a memory plan of 64 connections, bulk flows that come and go,
//! setups that take time and sometimes fail, peers that never answer, and a switch to
//! `mode=datagram`. Ten simulated minutes, one tick a second; the invariants are checked at
//! every tick. Pure logic: no root, no kernel, deterministic.

use std::collections::{BTreeMap, BTreeSet};

use ipoib_ctl::{
    policy::Mode,
    promotion::{Action, Config, Demotion, Failure, Promoter, Sample, State},
};
use ipoib_tests::{
    Rng,
    sim::{BULK, DEAD, traffic},
};

const S: u64 = 1_000_000_000;
const PEERS: u32 = 4096;
const PLAN: usize = 64;

#[test]
fn four_thousand_peers_on_a_plan_of_sixty_four() {
    let cfg = Config {
        max_connections: PLAN,
        idle_after: std::time::Duration::from_secs(20),
        min_hold: std::time::Duration::from_secs(10),
        ..Config::default()
    };
    let (burst, per_sec) = (cfg.setup_burst as usize, cfg.setups_per_sec);
    let mut p: Promoter<u32> = Promoter::new(cfg, Mode::Auto);
    let mut rng = Rng::new(0x1234_5678_9abc_def1);
    let mut totals: BTreeMap<u32, Sample> = BTreeMap::new();
    // Outcomes the "engine" will report: (time, peer, Ok(()) = established / Err = failed).
    let mut pending: Vec<(u64, u32, Result<(), Failure>)> = Vec::new();
    let mut closing: Vec<(u64, u32)> = Vec::new();
    let mut up: BTreeSet<u32> = BTreeSet::new();
    let mut connects: Vec<(u64, u32)> = Vec::new();
    let mut evictions = 0;
    let mut idle_reaps = 0;
    let mut full_ticks = 0;
    let mut checked = 0;
    let datagram_at = 540;

    for t in 1..=600u64 {
        let now = t * S;
        if t == datagram_at {
            p.set_mode(Mode::Datagram);
        }
        // Outcomes due now.
        for (at, k, r) in std::mem::take(&mut pending) {
            if at > now {
                pending.push((at, k, r));
                continue;
            }
            match r {
                Ok(()) => {
                    p.connected(now, &k);
                    up.insert(k);
                }
                Err(f) => p.failed(now, &k, f),
            }
        }
        for (at, k) in std::mem::take(&mut closing) {
            if at > now {
                closing.push((at, k));
            } else {
                up.remove(&k);
                p.closed(now, &k);
            }
        }
        // Counters: what went over the connection counts as CM bytes.
        for k in 0..PEERS {
            let (bytes, pkt) = traffic(k, t);
            let s = totals.entry(k).or_default();
            s.tx_bytes += bytes;
            s.tx_packets += bytes.div_ceil(pkt);
            if up.contains(&k) {
                s.cm_bytes += bytes;
            }
            p.observe(now, k, *s);
        }
        let actions = p.tick(now);
        let mut this_tick = 0;
        for a in actions {
            match a {
                Action::Connect(k) => {
                    assert!(t < datagram_at, "a Connect in mode=datagram");
                    assert!(
                        k < BULK || DEAD.contains(&k),
                        "peer {k} sends only small packets, yet was promoted"
                    );
                    this_tick += 1;
                    connects.push((t, k));
                    let latency = 1 + rng.below(2);
                    let r = if DEAD.contains(&k) {
                        Err(Failure::Timeout)
                    } else if rng.below(20) == 0 {
                        Err(Failure::Rejected)
                    } else {
                        Ok(())
                    };
                    pending.push((now + latency * S, k, r));
                }
                Action::Disconnect(k, why) => {
                    match why {
                        Demotion::Evicted => evictions += 1,
                        Demotion::Idle => idle_reaps += 1,
                        _ => {}
                    }
                    closing.push((now + S, k));
                }
            }
        }
        // Invariants, every tick.
        let c = p.counts();
        assert!(
            c.held() <= PLAN,
            "t={t}: {} connections held, plan {PLAN}",
            c.held()
        );
        assert!(this_tick <= burst, "t={t}: {this_tick} setups in one tick");
        let last10 = connects.iter().filter(|(ct, _)| *ct + 10 > t).count();
        assert!(
            last10 as f64 <= per_sec * 10.0 + burst as f64,
            "t={t}: {last10} setups in 10 s"
        );
        // Demand above the plan: the plan is used in full (soon after start).
        let wanting_at = |t: u64| (0..BULK).filter(|&k| traffic(k, t).0 > 0).count();
        let wanting = wanting_at(t);
        let within_plan_35s = t > 40 && (0..35).all(|d| wanting_at(t - d) + DEAD.len() <= PLAN);
        if t > 30 && t < datagram_at && wanting > PLAN && c.held() == PLAN {
            full_ticks += 1;
        }
        // Demand within the plan for 35 s (counting the dead peers' setups): every bulk peer
        // that has been on for 35 s (idle_after + min_hold + 5 s: by then every stale connection was
        // reaped) is on CM, or in a backoff after a REJ, or held after a demotion.
        if t > 40 && t < datagram_at {
            for k in 0..BULK {
                let on_since = (0..35).take_while(|d| traffic(k, t - d).0 > 0).count();
                if on_since < 35 || !within_plan_35s {
                    continue;
                }
                checked += 1;
                let e = p.explain(now, &k).unwrap();
                let ok = matches!(
                    e.state,
                    State::Up { .. } | State::Connecting { .. } | State::Backoff { .. }
                ) || e.why == Some(ipoib_ctl::promotion::UdWhy::Hold);
                assert!(ok, "t={t}: bulk peer {k} on for 35 s is {e}");
            }
        }
    }

    assert!(
        full_ticks > 50,
        "excess demand filled the plan in only {full_ticks} ticks"
    );
    assert!(
        checked > 1000,
        "the within-plan invariant was checked only {checked} times"
    );
    // mode=datagram at 540 s: everything drained, nothing held at the end.
    assert_eq!(p.counts().held(), 0, "{:?}", p.counts());
    assert!(up.is_empty());

    // Dead peers: tried with a backoff that doubles to its cap, not every second.
    for k in DEAD {
        let tries: Vec<u64> = connects
            .iter()
            .filter(|(_, c)| *c == k)
            .map(|(t, _)| *t)
            .collect();
        assert!(
            tries.len() <= 16,
            "dead peer {k} tried {} times: {tries:?}",
            tries.len()
        );
        assert!(tries.len() >= 3, "dead peer {k} gave up: {tries:?}");
        let gaps: Vec<u64> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        // The n-th retry comes no sooner than 2^n s after the one before (1 s .. 60 s).
        assert!(
            gaps.iter()
                .enumerate()
                .all(|(i, &g)| g >= (1u64 << i.min(10)).min(60)),
            "dead peer {k}: retried sooner than its backoff: {gaps:?}"
        );
    }
    // No flapping: a bulk peer is promoted about once per on-phase (3 phases in 540 s, plus
    // retries after a REJ and evictions), never every few seconds.
    let mut per_peer: BTreeMap<u32, usize> = BTreeMap::new();
    for (_, k) in &connects {
        *per_peer.entry(*k).or_default() += 1;
    }
    let most = (0..BULK)
        .map(|k| per_peer.get(&k).copied().unwrap_or(0))
        .max()
        .unwrap();
    assert!(
        most <= 8,
        "a bulk peer was promoted {most} times: {per_peer:?}"
    );
    assert!(idle_reaps > 0, "bulk peers went quiet, none was reaped");
    eprintln!(
        "{PEERS} peers, plan {PLAN}: {} setups, {idle_reaps} idle reaps, {evictions} evictions, \
         plan full in {full_ticks} ticks of excess demand, most promotions of one peer {most}",
        connects.len()
    );
}
