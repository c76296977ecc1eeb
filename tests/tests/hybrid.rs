//! The whole hybrid on soft-RoCE in the VM: two lab nodes, each with `ipoib-ctl attach
//! --cm-device rxe0` (fast path + connected mode). A bulk TCP flow starts on UD, the policy
//! promotes the peer, the fast path redirects the flow's big packets to the TUN device and
//! the engine carries them over RC; the stream arrives intact across the switch; pings stay on
//! UD; and detaching releases every QP and the TUN devices.
//!
//! The lab's link is a veth pair (Ethernet); the one rxe device serves both nodes. On the host
//! (no RDMA) the test skips loudly; `cargo xtask vm-test` runs it with IPOIB_REQUIRE_RDMA=1.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ipoib_tests::{
    cmlab::{COUNTED, device, in_netns, rdma_resources, settle},
    lab::{Lab, Node, Which, json_u64 as u, lab_unavailable},
};

/// The stream repeats this pattern; its length is prime (65521), so a lost, duplicated or
/// reordered TCP segment (a few KiB, never a multiple of it) shows at the receiver.
fn period() -> Vec<u8> {
    ipoib_tests::cmlab::pattern(11, 65521)
}

/// A TCP stream from node `a` to node `b`, every byte checked at `b`, until `finish`.
struct Stream {
    stop: Arc<AtomicBool>,
    sender: std::thread::JoinHandle<u64>,
    receiver: std::thread::JoinHandle<u64>,
}

impl Stream {
    fn start(a: &Node, b: &Node, port: u16) -> Self {
        let addr = format!("{}:{port}", b.ip4);
        let listener = in_netns(&b.ns, {
            let addr = addr.clone();
            move || TcpListener::bind(addr).expect("listen at B")
        });
        let receiver = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let p = period();
            let mut buf = vec![0u8; 1 << 16];
            let mut off = 0u64;
            loop {
                let n = s.read(&mut buf).expect("read the stream");
                if n == 0 {
                    return off;
                }
                let mut got = &buf[..n];
                while !got.is_empty() {
                    let at = (off % p.len() as u64) as usize;
                    let k = got.len().min(p.len() - at);
                    assert!(
                        got[..k] == p[at..at + k],
                        "the stream differs near byte {off}"
                    );
                    got = &got[k..];
                    off += k as u64;
                }
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let sender = std::thread::spawn({
            let (ns, stop) = (a.ns.clone(), stop.clone());
            move || {
                in_netns(&ns, move || {
                    let mut s = TcpStream::connect(addr).expect("connect to B");
                    let p = period();
                    let mut off = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let at = (off % p.len() as u64) as usize;
                        s.write_all(&p[at..]).expect("send the stream");
                        off += (p.len() - at) as u64;
                    }
                    off
                })
            }
        });
        Self {
            stop,
            sender,
            receiver,
        }
    }

    /// Stops sending; returns the bytes sent, once the receiver got them all, intact.
    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.sender.join().expect("sender");
        let received = self.receiver.join().expect("receiver (a byte differed?)");
        assert_eq!(received, sent, "the stream arrived whole");
        sent
    }
}

/// The rxe device, the device's resource counts before the test, and a fresh lab named
/// `tag`; None after a loud skip where the kernel has no RDMA.
fn rdma_lab(test: &str, tag: &str) -> Option<(String, HashMap<String, u64>, Lab)> {
    let dev = device(test)?;
    if let Some(why) = lab_unavailable() {
        panic!("{test}: RDMA is here but the lab cannot run: {why}");
    }
    let baseline = rdma_resources(&dev);
    Some((dev, baseline, Lab::new(tag, false).unwrap()))
}

#[test]
fn bulk_tcp_is_promoted_to_cm_and_pings_stay_on_ud() {
    let test = "bulk_tcp_is_promoted_to_cm_and_pings_stay_on_ud";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyb") else {
        return;
    };
    // Loose reverse-path filtering, as systemd sets it on most distributions (the lab sets 0,
    // which the other test keeps): connected mode must make the TUN device pass it.
    for n in [&lab.a, &lab.b] {
        let out = n
            .cmd("sysctl")
            .args(["-qw", "net.ipv4.conf.all.rp_filter=2"])
            .output()
            .unwrap();
        assert!(out.status.success());
    }
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    // B reaps connections idle for 2 s: the one A sends the stream over must not look idle to
    // B, which only receives over it (its ACKs are small: UD).
    lab.attach(
        Which::B,
        &[
            "--cm-device",
            &dev,
            "--cm-idle-after",
            "2",
            "--cm-min-hold",
            "1",
        ],
    )
    .unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let tun_a = a.status().unwrap()["cm"]["tun"]
        .as_str()
        .expect("A runs connected mode")
        .to_string();

    let stream = Stream::start(&a, &b, 5301);
    // Promotion: B becomes cm_up at A within a few ticks of the flow starting.
    let t0 = Instant::now();
    let at_promotion = a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12));
    let at_promotion = at_promotion.unwrap_or_else(|| {
        panic!(
            "B was not promoted at A in 12 s: {:#}",
            a.status().unwrap()["cm"]
        )
    });
    let promoted_after = t0.elapsed();
    std::thread::sleep(Duration::from_secs(4));
    // Pings while the stream rides CM: small, so UD (the fast path's `tx_ud_small`).
    let small = |s: &serde_json::Value| u(&s["reasons"]["tx_ud_small"], "packets");
    let before = a.status().unwrap();
    let ping = a
        .cmd("ping")
        .args(["-c", "5", "-i", "0.2", "-W", "2", &b_ip])
        .output()
        .unwrap();
    assert!(
        ping.status.success(),
        "{}",
        String::from_utf8_lossy(&ping.stdout)
    );
    let after = a.status().unwrap();
    assert!(
        small(&after) >= small(&before) + 5,
        "5 pings, {} small packets counted UD",
        small(&after) - small(&before)
    );
    assert_eq!(a.peer(&b_ip).unwrap().unwrap()["mode"], "cm_up");
    std::thread::sleep(Duration::from_secs(3));
    let during = a.status().unwrap();
    let b_during = b.status().unwrap();
    let sent = stream.finish();

    let end = a.peer(&b_ip).unwrap().unwrap();
    let d = |k: &str| u(&end, k) - u(&at_promotion, k);
    let (cm, ud) = (d("tx_cm_bytes"), d("tx_ud_bytes"));
    eprintln!(
        "promoted after {promoted_after:.1?}; {} MiB sent; after promotion CM {} MiB, UD {} KiB; \
         A's connected mode: {:#}",
        sent >> 20,
        cm >> 20,
        ud >> 10,
        during["cm"]
    );
    if (cm as f64) < 0.9 * (cm + ud) as f64 {
        let tun_b = b.status().unwrap()["cm"].clone();
        let link = b.cmd("ip").args(["-s", "link"]).output().unwrap();
        let nstat = b.cmd("nstat").args(["-az"]).output().unwrap();
        let drops: Vec<String> = String::from_utf8_lossy(&nstat.stdout)
            .lines()
            .filter(|l| l.split_whitespace().nth(1).is_some_and(|v| v != "0"))
            .map(str::to_string)
            .collect();
        let ss_a = a.cmd("ss").args(["-tin"]).output().unwrap();
        let ss_b = b.cmd("ss").args(["-tin"]).output().unwrap();
        eprintln!(
            "A ss: {}\nB ss: {}\nA log: {}\nB log: {}",
            String::from_utf8_lossy(&ss_a.stdout),
            String::from_utf8_lossy(&ss_b.stdout),
            std::fs::read_to_string(std::env::temp_dir().join(format!("{}.ctl.log", a.ns)))
                .unwrap_or_default(),
            std::fs::read_to_string(std::env::temp_dir().join(format!("{}.ctl.log", b.ns)))
                .unwrap_or_default(),
        );
        panic!(
            "after promotion only {cm} of {} bytes went CM\nB's CM: {tun_b:#}\nB's links: {}\nB's drops: {drops:#?}",
            cm + ud,
            String::from_utf8_lossy(&link.stdout)
        );
    }
    assert!(cm > 1 << 20, "hardly anything went CM: {cm} bytes");
    let engine = &during["cm"]["engine"];
    assert!(
        u(engine, "tx_bytes") > 0 && u(engine, "tx_oversize") == 0,
        "{engine}"
    );
    assert_eq!(during["cm"]["connections"], 1);
    let peer_why = during["cm"]["peers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["addr"] == b_ip.as_str()).cloned())
        .expect("B in A's CM status");
    assert_eq!(peer_why["state"], "cm", "{peer_why}");
    assert_eq!(
        peer_why["promotions"], 1,
        "the connection was lost and set up again: {peer_why}"
    );
    // B took the connection as the passive side, and kept it while the stream came in over
    // it (it reaps after 2 s idle, and counts what it receives).
    assert_eq!(b_during["cm"]["connections"], 1, "{:#}", b_during["cm"]);

    // Detach A: its control loop stops connected mode, B sees the connection close, A's TUN
    // device goes. Then everything: QPs back to where they were.
    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert!(out.status.success());
    let t = Instant::now();
    let tun_gone = || {
        !a.cmd("ip")
            .args(["link", "show", &tun_a])
            .output()
            .unwrap()
            .status
            .success()
    };
    while !tun_gone() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(tun_gone(), "{tun_a} outlived A's control loop");
    let t = Instant::now();
    while b.status().unwrap()["cm"]["connections"] != 0 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        b.status().unwrap()["cm"]["connections"],
        0,
        "B kept a dead connection"
    );
    assert_eq!(b.peer(&a.ip4.to_string()).unwrap().unwrap()["mode"], "ud");
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The peer's control loop killed under the flow: A notices (the handshake stream ends), marks
/// it UD and the stream goes on over UD, intact; A retries with backoff (refused while B is
/// down); B restarted, the flow returns to CM.
#[test]
fn a_killed_peer_falls_back_to_ud_and_returns_to_cm() {
    let test = "a_killed_peer_falls_back_to_ud_and_returns_to_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyk") else {
        return;
    };
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    let pid_b = lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5302);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12))
        .expect("promoted");

    lab.kill9(pid_b);
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, "ud", Duration::from_secs(10))
        .expect("A kept B on CM after B's engine died");
    eprintln!("B killed: A fell back to UD after {:.1?}", t.elapsed());
    // The flow goes on over UD.
    std::thread::sleep(Duration::from_secs(3));
    let on_ud = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        u(&on_ud, "tx_ud_bytes") > u(&fell, "tx_ud_bytes") + (1 << 20),
        "the flow did not go on over UD: {on_ud}"
    );
    assert_eq!(a.status().unwrap()["cm"]["connections"], 0);

    // B back: its entry for A, left CM_UP by the killed loop (pointing at a TUN device that
    // died with it), is UD again until a new connection is up.
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let a_ip = a.ip4.to_string();
    let b_view = b.peer(&a_ip).unwrap().expect("B knows A")["mode"].clone();
    let a_view = a.peer(&b_ip).unwrap().unwrap()["mode"].clone();
    assert!(
        b_view == "ud" || a_view != "ud",
        "B restarted with a stale entry for A: {b_view} (A sees B as {a_view})"
    );
    // After A's backoff the flow is promoted again.
    let t = Instant::now();
    let back = a
        .wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(30))
        .unwrap_or_else(|| {
            panic!(
                "not promoted again within 30 s: {:#}",
                a.status().unwrap()["cm"]
            )
        });
    eprintln!("B restarted: back on CM after {:.1?}", t.elapsed());
    std::thread::sleep(Duration::from_secs(4));
    let later = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        u(&later, "tx_cm_bytes") > u(&back, "tx_cm_bytes") + (1 << 20),
        "back on CM, yet the flow does not go CM: {later}"
    );
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// Brings the soft-RoCE device's netdev back up however the test ends.
struct LinkUp(&'static str);
impl Drop for LinkUp {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "set", self.0, "up"])
            .output();
    }
}

/// The RC path fails under the flow while both control loops live: the link under the RDMA
/// device goes down, A's sends exhaust their retries and complete in error, the engine reports
/// the QP error, A marks B UD and backs off; the stream goes on over UD, intact. The link back,
/// a retry after the backoff connects again and the flow returns to CM.
#[test]
fn a_failed_rc_path_falls_back_to_ud_and_returns_to_cm() {
    let test = "a_failed_rc_path_falls_back_to_ud_and_returns_to_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyq") else {
        return;
    };
    let netdev = std::fs::read_dir(format!("/sys/class/infiniband/{dev}/device/net"))
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .unwrap_or_else(|| "rxev0".into());
    assert_eq!(netdev, "rxev0", "the test's rxe device runs on rxev0");
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5303);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12))
        .expect("promoted");

    let guard = LinkUp("rxev0");
    let out = std::process::Command::new("ip")
        .args(["link", "set", "rxev0", "down"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, "ud", Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "A kept B on CM with the RC path down: {:#}",
                a.status().unwrap()["cm"]
            )
        });
    eprintln!("RC path down: A fell back to UD after {:.1?}", t.elapsed());
    let cm = a.status().unwrap()["cm"].clone();
    assert!(
        u(&cm["engine"], "send_errors") > 0,
        "the fallback came from something else than the QP error: {cm:#}"
    );
    std::thread::sleep(Duration::from_secs(3));
    let on_ud = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        u(&on_ud, "tx_ud_bytes") > u(&fell, "tx_ud_bytes") + (1 << 20),
        "the flow did not go on over UD: {on_ud}"
    );

    drop(guard);
    let t = Instant::now();
    let back = a
        .wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(90))
        .unwrap_or_else(|| {
            panic!(
                "not back on CM within 90 s of the link's return: {:#}",
                a.status().unwrap()["cm"]
            )
        });
    eprintln!("RC path up: back on CM after {:.1?}", t.elapsed());
    std::thread::sleep(Duration::from_secs(4));
    let later = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        u(&later, "tx_cm_bytes") > u(&back, "tx_cm_bytes") + (1 << 20),
        "back on CM, yet the flow does not go CM: {later}"
    );
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The handshake port blocked at the peer (its TCP SYNs dropped): A's setups time out, B stays
/// on UD with A backing off, the stream goes on over UD, intact, and nothing is left half set
/// up. Unblocked, a retry after the backoff connects and the flow goes CM.
#[test]
fn a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens() {
    let test = "a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyp") else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let nft = |script: &str| {
        let mut c = b
            .cmd("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("nft (cargo xtask provision --vm installs nftables)");
        c.stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(c.wait().unwrap().success(), "nft: {script}");
    };
    nft(
        "table inet hs {\n chain in {\n  type filter hook input priority 0; policy accept;\n  tcp dport 4755 drop\n }\n}\n",
    );
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let stream = Stream::start(&a, &b, 5304);

    // 15 s blocked: never CM, at least one setup given up (timeouts), the stream on UD.
    let t = Instant::now();
    let start = a.peer(&b_ip).unwrap();
    while t.elapsed() < Duration::from_secs(15) {
        if let Ok(Some(p)) = a.peer(&b_ip) {
            assert_ne!(p["mode"], "cm_up", "CM with the handshake port blocked");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let cm = a.status().unwrap()["cm"].clone();
    let peer = cm["peers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["addr"] == b_ip.as_str()).cloned())
        .expect("B in A's CM status");
    eprintln!("blocked for 15 s: {peer}");
    assert!(u(&peer, "failures") >= 1, "no setup was given up: {peer}");
    assert!(u(&cm, "failed") >= 1, "{cm:#}");
    assert_eq!(cm["connections"], 0);
    let now = a.peer(&b_ip).unwrap().unwrap();
    let before = start.map_or(0, |p| u(&p, "tx_ud_bytes"));
    assert!(
        u(&now, "tx_ud_bytes") > before + (1 << 20),
        "the stream did not go on over UD: {now}"
    );

    // Open again: promoted after the backoff.
    nft("delete table inet hs");
    let t = Instant::now();
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(60))
        .unwrap_or_else(|| {
            panic!(
                "not on CM 60 s after the port opened: {:#}",
                a.status().unwrap()["cm"]
            )
        });
    eprintln!("port open: on CM after {:.1?}", t.elapsed());
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}
