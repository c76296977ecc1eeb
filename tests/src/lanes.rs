//! The CM engine on several lanes between two nodes on real verbs (soft-RoCE in the VM), for
//! the tests and `bench lanes`: node A in this process (a lane per TUN queue, an engine on a
//! thread of its own per lane), node B `cm-node --queues N` in a second namespace. A connects
//! to B twice, as two nodes would (two CMs on the same resources: a CM keeps one connection
//! per peer), and B's two addresses on its TUN device are routed one over each connection.

use std::{net::IpAddr, sync::Arc, thread::JoinHandle, time::Duration};

use anyhow::{Context as _, Result};
use ipoib_ctl::{
    cm::{Cm, Connection, SetupConfig},
    engine::{Engine, EngineConfig, EngineControl, EngineStats, Route},
    plan::CM_BUF_SIZE,
    tun::Tun,
    verbs::ReceiveModel,
};

use crate::cmlab::{Netns, Peer, Verbs, run, tun_up};

/// A's side of the pair, and B's process.
pub struct LanePair {
    pub peer: Peer,
    pub node: Arc<Verbs>,
    pub cms: Vec<Arc<Cm>>,
    /// A's connections, the first routing `dsts[0]`, the second `dsts[1]`.
    pub conns: Vec<Connection>,
    /// B's two addresses.
    pub dsts: [IpAddr; 2],
    pub control: EngineControl,
    /// A's engines' counters, by lane.
    pub stats: Vec<Arc<EngineStats>>,
    /// A's TUN device.
    pub tun: String,
    stop: tokio::sync::watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl LanePair {
    /// B on `ns` (its handshake address 10.77.`subnet`.2), data addresses 10.98.`net`.1 (A)
    /// and 10.98.`net`.2 and .3 (B); `lanes` lanes on each node; both nodes receive on an SRQ
    /// of 512 buffers or, with `rings`, on a ring of 64 per connection.
    pub fn start(
        dev: &str,
        ns: &Netns,
        (subnet, net): (u8, u8),
        lanes: u32,
        rings: bool,
    ) -> Result<Self> {
        let (a_ip, b_cidr) = (format!("10.98.{net}.1"), format!("10.98.{net}.2/24"));
        let queues = lanes.to_string();
        let mut b_args = vec!["--tun", &b_cidr, "--peer-ip", &a_ip, "--queues", &queues];
        let model = if rings {
            b_args.extend(["--rings", "4", "--depth", "64"]);
            ReceiveModel::Rings { depth: 64, max: 4 }
        } else {
            ReceiveModel::Srq { depth: 512 }
        };
        let mut peer = Peer::start(
            ns,
            dev,
            format!("10.77.{subnet}.2:4755").parse()?,
            0x49,
            &b_args,
        );
        let b_tun = peer.expect("engine", Duration::from_secs(10));
        let b_tun = b_tun.split(' ').nth(1).context("B's TUN device")?;
        let second = format!("10.98.{net}.3/24");
        run(&["ip", "-n", &ns.name, "addr", "add", &second, "dev", b_tun]);
        let node = Arc::new(Verbs::open_lanes(
            dev,
            model,
            CM_BUF_SIZE as u32,
            256,
            lanes,
        )?);
        let queues = Tun::create_queues("cmt%d", lanes as usize, true)?;
        let tun = queues[0].name().to_string();
        tun_up(&tun, &format!("{a_ip}/24"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let cms: Vec<_> = [0x101, 0x102]
            .map(|ud_qpn| Arc::new(Cm::new(node.res.clone(), ud_qpn, SetupConfig::default())))
            .into();
        let mut conns = Vec::new();
        for cm in &cms {
            conns.push(rt.block_on(cm.connect(peer.addr, peer.hw))?);
            peer.expect("established", Duration::from_secs(10));
        }
        let engines = Engine::lanes(queues, node.res.clone(), EngineConfig::default())?;
        let control = engines[0].control();
        let dsts: [IpAddr; 2] = [
            format!("10.98.{net}.2").parse()?,
            format!("10.98.{net}.3").parse()?,
        ];
        for (ip, c) in dsts.iter().zip(&conns) {
            let route = Route {
                qp: c.qp.clone(),
                mtu: c.mtu,
            };
            control.add_route(*ip, route);
        }
        let stats = engines.iter().map(Engine::stats).collect();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let threads = engines
            .into_iter()
            .map(|engine| {
                let mut stop = stop_rx.clone();
                let stopped = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                engine.spawn_thread(stopped, |r| r.expect("a lane's engine"))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            peer,
            node,
            cms,
            conns,
            dsts,
            control,
            stats,
            tun,
            stop,
            threads,
        })
    }

    /// A's counters by lane, each by name.
    pub fn lanes(&self) -> Vec<std::collections::HashMap<&'static str, u64>> {
        self.stats
            .iter()
            .map(|s| s.snapshot().into_iter().collect())
            .collect()
    }

    /// Routes removed, engines stopped (a panicked engine's thread is an error), connections
    /// closed (B says so for each); B's process is left to the caller.
    pub fn stop(mut self) -> Result<Peer> {
        for (ip, c) in self.dsts.iter().zip(&self.conns) {
            self.control.remove_route(*ip, c.qp.qpn(), None);
        }
        let _ = self.stop.send(true);
        for t in self.threads.drain(..) {
            t.join()
                .map_err(|_| anyhow::anyhow!("a lane's engine panicked"))?;
        }
        for c in self.conns.drain(..) {
            c.close();
            self.peer.expect("closed", Duration::from_secs(5));
        }
        Ok(self.peer)
    }
}
