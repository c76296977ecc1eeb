//! A CM peer for the soft-RoCE tests and benchmarks: listens for the handshake, keeps every
//! connection on one SRQ (or a ring each: --rings), and echoes (or only takes) what arrives. Runs in its own network
//! namespace as the second node; one line on stdout per event:
//! `ready <gid hex> <ud_qpn>`, `engine <tun>` and `stats k=v ...` once a second (with --tun),
//! `received <messages> <bytes>` (with --sink), `established <peer ud_qpn> <qpn> <mtu>`, `closed <peer ud_qpn>
//! <qpn>`, `failed <reason>`.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Result;
use clap::Parser;
use ipoib_ctl::{
    cm::{Cm, SetupConfig},
    engine::{Engine, EngineConfig, EngineStats, Route},
    tun::Tun,
    verbs::ReceiveModel,
};
use ipoib_tests::cmlab::{Pump, QpTable, Verbs};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "rxe0")]
    device: String,
    #[arg(long)]
    listen: SocketAddr,
    /// This node's UD QPN (a stand-in: there is no IPoIB interface on soft-RoCE).
    #[arg(long, value_parser = parse_u32)]
    ud_qpn: u32,
    /// SRQ depth (or, with --rings, each ring's).
    #[arg(long, default_value_t = 512)]
    depth: u32,
    /// No SRQ: a receive ring of --depth buffers per connection, at most this many rings.
    #[arg(long, value_name = "K")]
    rings: Option<u32>,
    /// Take messages without echoing or copying them (throughput benchmark); busy-polls and
    /// prints `received <messages> <bytes>` as they arrive.
    #[arg(long)]
    sink: bool,
    /// Setups in flight at once.
    #[arg(long, default_value_t = 16)]
    max_setups: usize,
    /// Seconds each handshake step may take.
    #[arg(long, default_value_t = 2.0)]
    step_timeout: f64,
    /// Run the CM engine instead of echoing: a TUN device with this address (CIDR), MTU 1500,
    /// gso_max_size 65000 and no IPv6 link-local address, its packets carried over the
    /// connections.
    #[arg(long, requires = "peer_ip")]
    tun: Option<String>,
    /// With --tun: the address whose packets go over the established connection (a stand-in
    /// for the neighbour table: the test has one peer).
    #[arg(long)]
    peer_ip: Option<std::net::IpAddr>,
    /// With --tun: a TUN device of this many queues, an engine on a thread of its own for
    /// each (a lane each: its own CQ and share of the send slots, the SRQ shared).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    queues: u32,
}

fn parse_u32(s: &str) -> Result<u32, String> {
    match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| e.to_string())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model = match args.rings {
        Some(max) => ReceiveModel::Rings {
            depth: args.depth,
            max,
        },
        None => ReceiveModel::Srq { depth: args.depth },
    };
    let node = Arc::new(Verbs::open_lanes(
        &args.device,
        model,
        ipoib_ctl::plan::CM_BUF_SIZE as u32,
        256,
        args.queues,
    )?);
    let cfg = SetupConfig {
        max_concurrent: args.max_setups,
        step_timeout: Duration::from_secs_f64(args.step_timeout),
        ..SetupConfig::default()
    };
    let cm = Arc::new(Cm::new(node.res.clone(), args.ud_qpn, cfg));
    let qps: QpTable = QpTable::default();
    let stop = Arc::new(AtomicBool::new(false));

    let engines = match &args.tun {
        Some(cidr) => {
            let queues = Tun::create_queues("cmn%d", args.queues as usize, true)?;
            let dev = queues[0].name().to_string();
            ipoib_tests::cmlab::tun_up(&dev, cidr);
            Engine::lanes(queues, node.res.clone(), EngineConfig::default())?
        }
        None => Vec::new(),
    };
    let engine_mode = !engines.is_empty();
    let pump = {
        let (node, qps, stop) = (node.clone(), qps.clone(), stop.clone());
        std::thread::spawn(move || -> Result<()> {
            if engine_mode {
                return Ok(());
            }
            let mut pump = Pump::new(node);
            pump.keep = !args.sink;
            let mut got = Vec::new();
            let (mut told, mut last) = (0, std::time::Instant::now());
            while !stop.load(Ordering::Relaxed) {
                // A sink busy-polls, as ib_send_bw's server does; an echo waits on the channel.
                let wait = if args.sink { 0 } else { 100 };
                pump.progress(&mut got, Duration::from_millis(wait))?;
                if args.sink && pump.received != told && last.elapsed() > Duration::from_millis(200)
                {
                    println!("received {} {}", pump.received, pump.received_bytes);
                    (told, last) = (pump.received, std::time::Instant::now());
                }
                for m in got.drain(..) {
                    if args.sink {
                        continue;
                    }
                    let qp = qps.lock().unwrap().get(&m.qp_num).cloned();
                    if let Some(qp) = qp {
                        pump.send(&qp, &m.data, &mut Vec::new())?;
                    }
                }
            }
            Ok(())
        })
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        let gid: String = cm.hwaddr().gid.iter().map(|b| format!("{b:02x}")).collect();
        println!("ready {gid} {:#x}", args.ud_qpn);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(cm.clone().serve(listener, tx));
        let control = engines.first().map(Engine::control);
        if let Some(first) = engines.first() {
            println!("engine {}", first.tun_name());
            let stats: Vec<_> = engines.iter().map(Engine::stats).collect();
            for engine in engines {
                // Each lane's engine on a thread of its own, as many as there are queues.
                engine.spawn_thread(std::future::pending(), |r| {
                    if let Err(e) = r {
                        println!("failed engine: {e}");
                    }
                })?;
            }
            // Counters once a second, for the tests: all lanes' as one.
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    println!("{}", EngineStats::total(stats.iter().map(|s| &**s)).line());
                }
            });
        }
        while let Some((_, r)) = rx.recv().await {
            match r {
                Ok(mut c) => {
                    let (peer, qpn) = (c.peer.ud_qpn, c.qp.qpn());
                    println!("established {peer:#x} {qpn} {}", c.mtu);
                    qps.lock().unwrap().insert(qpn, c.qp.clone());
                    if let (Some(ip), Some(control)) = (args.peer_ip, &control) {
                        let route = Route {
                            qp: c.qp.clone(),
                            mtu: c.mtu,
                        };
                        control.add_route(ip, route);
                    }
                    let (qps, control) = (qps.clone(), control.clone());
                    tokio::spawn(async move {
                        c.closed().await;
                        if let (Some(ip), Some(control)) = (args.peer_ip, control) {
                            control.remove_route(ip, qpn, None);
                        }
                        qps.lock().unwrap().remove(&qpn);
                        c.close();
                        println!("closed {peer:#x} {qpn}");
                    });
                }
                Err(e) => println!("failed {e}"),
            }
        }
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    pump.join().expect("pump thread")?;
    Ok(())
}
