//! `cargo xtask bench tick`: what connected mode's once-a-second decision costs at 4096 peers,
//! release build. Timed is `connmgr::Core::handle_tick` (the promotion policy and what the
//! node holds) with its commands drained, as the control loop runs it; the tick's input (the
//! fast path's counters, which the loop reads from the kernel) is built before the clock
//! starts.
//!
//! The cluster is the promotion simulation's (`ipoib_tests::sim`): a hundred bulk senders that
//! come and go among 4096 peers, ten that never answer, a plan of 64 connections. Setups
//! complete a second after they are asked for (1 in 20 refused), an established connection's
//! route is added at once, and a closed one is reported a second after it was asked to close:
//! the core promotes, evicts and reaps while it is timed, as on a busy node. Median, p99 and
//! the slowest tick are reported; one JSON line after `BENCH-JSON `, saved with `--out`.

use std::{
    collections::HashMap,
    net::IpAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use clap::Parser;
use ipoib_ctl::{
    connmgr::{Command, Core, TickInput, Traffic},
    policy::Mode,
    promotion::{Config, Failure, Promoter},
};
use ipoib_tests::{
    Rng,
    bench::{median, publish},
    sim::traffic,
};
use serde_json::json;

const S: u64 = 1_000_000_000;

#[derive(Parser)]
#[command(about = "connected mode's tick (promotion policy) at thousands of peers")]
struct Args {
    #[arg(long, default_value_t = 4096)]
    peers: u32,
    /// Connections the plan allows.
    #[arg(long, default_value_t = 64)]
    plan: usize,
    /// Ticks (simulated seconds) timed.
    #[arg(long, default_value_t = 600)]
    ticks: u64,
    /// Where to save the JSON result.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// What the simulated manager reports back later.
enum Outcome {
    Established(IpAddr),
    Refused(IpAddr),
    Closed(IpAddr, u32),
}

/// The simulated rest of the node: carries out the core's commands as the manager would.
struct Node {
    rng: Rng,
    next_qpn: u32,
    /// Peers whose route the engine has: what they send counts as CM bytes.
    routed: HashMap<IpAddr, u32>,
    pending: Vec<(u64, Outcome)>,
    connects: u64,
    evictions_or_reaps: u64,
    most_routed: usize,
}

impl Node {
    fn carry_out(&mut self, core: &mut Core, now: u64, cmds: Vec<Command>) {
        for c in cmds {
            match c {
                Command::Connect(ip) => {
                    self.connects += 1;
                    let o = if self.rng.below(20) == 0 {
                        Outcome::Refused(ip)
                    } else {
                        Outcome::Established(ip)
                    };
                    self.pending.push((now + S, o));
                }
                Command::AddRoute { ip, qpn } => {
                    self.routed.insert(ip, qpn);
                    self.most_routed = self.most_routed.max(self.routed.len());
                    core.handle_route_added(ip, qpn);
                }
                Command::RemoveRoute { ip, qpn, close } => {
                    self.routed.remove(&ip);
                    if close {
                        self.evictions_or_reaps += 1;
                        self.pending.push((now + S, Outcome::Closed(ip, qpn)));
                    }
                }
                _ => {}
            }
        }
    }

    /// The outcomes due by `now`, handed to the core.
    fn report(&mut self, core: &mut Core, now: u64) {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.pending = later;
        for (_, o) in due {
            match o {
                Outcome::Established(ip) => {
                    self.next_qpn += 1;
                    core.handle_established(now, ip, self.next_qpn);
                }
                Outcome::Refused(ip) => core.handle_setup_failed(now, ip, Failure::Rejected),
                Outcome::Closed(ip, qpn) => core.handle_closed(now, ip, qpn),
            }
            let cmds = drain(core);
            self.carry_out(core, now, cmds);
        }
    }
}

fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.next_command()).collect()
}

fn peer_ip(k: u32) -> IpAddr {
    let [_, b, c, d] = k.to_be_bytes();
    IpAddr::from([10, b.wrapping_add(1), c, d])
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.peers > 0 && args.ticks > 0,
        "peers and ticks must be positive"
    );
    let cfg = Config {
        max_connections: args.plan,
        idle_after: Duration::from_secs(20),
        min_hold: Duration::from_secs(10),
        ..Config::default()
    };
    let mut core = Core::new(Promoter::new(cfg, Mode::Auto), 256);
    drain(&mut core);
    let ips: Vec<IpAddr> = (0..args.peers).map(peer_ip).collect();
    let mut totals = vec![Traffic::default(); ips.len()];
    let mut node = Node {
        rng: Rng::new(0x0bad_cafe_f00d_d00d),
        next_qpn: 100,
        routed: HashMap::new(),
        pending: Vec::new(),
        connects: 0,
        evictions_or_reaps: 0,
        most_routed: 0,
    };
    let mut times = Vec::with_capacity(args.ticks as usize);
    for t in 1..=args.ticks {
        let now = t * S;
        node.report(&mut core, now);
        for (k, (ip, tot)) in ips.iter().zip(&mut totals).enumerate() {
            let (bytes, pkt) = traffic(k as u32, t);
            tot.tx_bytes += bytes;
            tot.tx_packets += bytes.div_ceil(pkt);
            if node.routed.contains_key(ip) {
                tot.tx_cm_bytes += bytes;
            }
        }
        let input = TickInput {
            mode: Some(Mode::Auto),
            max_connections: args.plan,
            traffic: ips.iter().copied().zip(totals.iter().copied()).collect(),
            srq_posted: 256,
            ..TickInput::default()
        };
        let t0 = Instant::now();
        core.handle_tick(now, input);
        let cmds = drain(&mut core);
        times.push(t0.elapsed().as_secs_f64() * 1e6);
        node.carry_out(&mut core, now, cmds);
    }
    // A core that never promoted was timed idle: not the case this measures.
    ensure!(
        node.connects > 0,
        "nothing was promoted: the benchmark timed an idle core"
    );
    ensure!(
        node.most_routed <= args.plan,
        "{} routed at once, plan {}",
        node.most_routed,
        args.plan
    );
    let mut slowest: Vec<(f64, usize)> = times.iter().copied().zip(1..).collect();
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    let top: Vec<String> = slowest
        .iter()
        .take(3)
        .map(|(us, t)| format!("{us:.0} us at t={t}"))
        .collect();
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let p99 = sorted[(sorted.len() * 99 / 100).min(sorted.len() - 1)];
    let max = sorted[sorted.len() - 1];
    let med = median(&times);
    println!(
        "connmgr::Core::handle_tick, {} peers, plan {}, {} ticks (release): median {med:.0} us, p99 {p99:.0} us, max {max:.0} us (goal: under 1000 us)",
        args.peers, args.plan, args.ticks
    );
    println!(
        "slowest: {} (t=1: every peer seen for the first time)",
        top.join(", ")
    );
    println!(
        "while timed: {} setups asked, {} connections closed by the policy, at most {} routed",
        node.connects, node.evictions_or_reaps, node.most_routed
    );
    let result = json!({
        "bench": "tick", "peers": args.peers, "plan": args.plan, "ticks": args.ticks,
        "median_us": med, "p99_us": p99, "max_us": max,
        "setups": node.connects, "policy_closes": node.evictions_or_reaps,
        "most_routed": node.most_routed,
    });
    publish(&result, args.out.as_deref())
}
