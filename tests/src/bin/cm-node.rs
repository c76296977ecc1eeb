//! A CM peer for the soft-RoCE tests and benchmarks: listens for the handshake, keeps every
//! connection on one SRQ, and echoes (or only takes) what arrives. Runs in its own network
//! namespace as the second node; one line on stdout per event:
//! `ready <gid hex> <ud_qpn>`, `established <peer ud_qpn> <qpn> <mtu>`, `closed <peer ud_qpn>
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
use ipoib_ctl::cm::{Cm, SetupConfig};
use ipoib_tests::cmlab::{Node, Pump, QpTable};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "rxe0")]
    device: String,
    #[arg(long)]
    listen: SocketAddr,
    /// This node's UD QPN (a stand-in: there is no IPoIB interface on soft-RoCE).
    #[arg(long, value_parser = parse_u32)]
    ud_qpn: u32,
    /// SRQ depth.
    #[arg(long, default_value_t = 512)]
    depth: u32,
    /// Take messages without echoing them (throughput benchmark).
    #[arg(long)]
    sink: bool,
    /// Setups in flight at once.
    #[arg(long, default_value_t = 16)]
    max_setups: usize,
    /// Seconds each handshake step may take.
    #[arg(long, default_value_t = 2.0)]
    step_timeout: f64,
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
    let node = Arc::new(Node::open(&args.device, args.depth, 256)?);
    let cfg = SetupConfig {
        max_concurrent: args.max_setups,
        step_timeout: Duration::from_secs_f64(args.step_timeout),
        ..SetupConfig::default()
    };
    let cm = Arc::new(Cm::new(node.res.clone(), args.ud_qpn, cfg));
    let qps: QpTable = QpTable::default();
    let stop = Arc::new(AtomicBool::new(false));

    let pump = {
        let (node, qps, stop) = (node.clone(), qps.clone(), stop.clone());
        std::thread::spawn(move || -> Result<()> {
            let mut pump = Pump::new(node);
            let mut got = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                pump.progress(&mut got, Duration::from_millis(100))?;
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
        while let Some((_, r)) = rx.recv().await {
            match r {
                Ok(mut c) => {
                    let (peer, qpn) = (c.peer.ud_qpn, c.qp.qpn());
                    println!("established {peer:#x} {qpn} {}", c.mtu);
                    qps.lock().unwrap().insert(qpn, c.qp.clone());
                    let qps = qps.clone();
                    tokio::spawn(async move {
                        c.closed().await;
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
