//! The CM engine's TUN device in the running kernel: two network namespaces, each with a TUN
//! device made by `ipoib_ctl::tun::Tun`, joined by a relay that moves every packet with its
//! virtio-net header from one to the other as it is, which is what the engine does across an
//! RC connection. A TCP bulk flow crosses it: the data must arrive intact, and with TSO on the
//! relay must see whole GSO super-packets far larger than the devices' MTU (one RC message
//! each, later). Needs root (CI is root); elsewhere it skips loudly.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use ipoib_ctl::tun::{TUN_READ_MAX, Tun, VNET_GSO_TCPV4, VnetHdr};
use ipoib_tests::cmlab::{in_netns, pattern, run};

const MTU: &str = "1500";
const BYTES: usize = 32 << 20;

struct Namespaces(Vec<String>);
impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

#[derive(Default)]
struct Seen {
    packets: AtomicU64,
    gso: AtomicU64,
    largest: AtomicU64,
}

/// Moves packets from `from` to `to` until `stop`, counting what it sees.
fn relay(from: Arc<Tun>, to: Arc<Tun>, stop: Arc<AtomicBool>, seen: Arc<Seen>) {
    let mut buf = vec![0u8; TUN_READ_MAX];
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: from.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
            continue;
        }
        let n = match from.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => panic!("read {}: {e}", from.name()),
        };
        let hdr = VnetHdr::parse(&buf[..n]).expect("vnet header");
        seen.packets.fetch_add(1, Ordering::Relaxed);
        if hdr.gso_type == VNET_GSO_TCPV4 {
            seen.gso.fetch_add(1, Ordering::Relaxed);
        }
        seen.largest.fetch_max(n as u64, Ordering::Relaxed);
        to.send(&buf[..n]).expect("write into the other TUN");
    }
}

/// Whether the test may run: root, or else a loud skip (a failure where CI requires it).
fn root_or_skip(test: &str) -> bool {
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
        "CI runs as root: this test must run"
    );
    ipoib_tests::loud_skip(test, "needs root (network namespaces, /dev/net/tun)");
    false
}

#[test]
fn tcp_crosses_two_tun_devices_as_whole_gso_super_packets() {
    if !root_or_skip("tcp_crosses_two_tun_devices_as_whole_gso_super_packets") {
        return;
    }
    let (a, b) = ("tunt-a", "tunt-b");
    let _ = Command::new("ip").args(["netns", "del", a]).output();
    let _ = Command::new("ip").args(["netns", "del", b]).output();
    run(&["ip", "netns", "add", a]);
    let nss = Namespaces(vec![a.into(), b.into()]);
    run(&["ip", "netns", "add", b]);

    let ta = Arc::new(in_netns(a, || Tun::create("cm%d", true).expect("TUN in a")));
    let tb = Arc::new(in_netns(b, || Tun::create("cm%d", true).expect("TUN in b")));
    for (ns, tun, addr) in [(a, &ta, "10.99.0.1/24"), (b, &tb, "10.99.0.2/24")] {
        let dev = tun.name().to_string();
        run(&["ip", "-n", ns, "addr", "add", addr, "dev", &dev]);
        run(&["ip", "-n", ns, "link", "set", &dev, "mtu", MTU, "up"]);
        run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (ab, ba) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
    let relays = [
        {
            let (f, t, s, n) = (ta.clone(), tb.clone(), stop.clone(), ab.clone());
            std::thread::spawn(move || relay(f, t, s, n))
        },
        {
            let (f, t, s, n) = (tb.clone(), ta.clone(), stop.clone(), ba.clone());
            std::thread::spawn(move || relay(f, t, s, n))
        },
    ];

    let listener = in_netns(b, || {
        TcpListener::bind("10.99.0.2:5001").expect("listen in b")
    });
    let receiver = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut got = Vec::with_capacity(BYTES);
        s.read_to_end(&mut got).expect("read the flow");
        got
    });
    let data = pattern(7, BYTES);
    let sent = data.clone();
    in_netns(a, move || {
        let mut s =
            TcpStream::connect_timeout(&"10.99.0.2:5001".parse().unwrap(), Duration::from_secs(10))
                .expect("connect across the relay");
        s.write_all(&sent).expect("send the flow");
    });
    let got = receiver.join().expect("receiver");
    stop.store(true, Ordering::Relaxed);
    for r in relays {
        r.join().expect("relay");
    }
    assert_eq!(got.len(), BYTES, "bytes arrived");
    assert!(got == data, "the flow's contents differ");

    let (pk, gso, largest) = (
        ab.packets.load(Ordering::Relaxed),
        ab.gso.load(Ordering::Relaxed),
        ab.largest.load(Ordering::Relaxed),
    );
    eprintln!(
        "a->b: {pk} packets, {gso} GSO TCPv4, largest {largest} B (MTU {MTU}); b->a: {} packets",
        ba.packets.load(Ordering::Relaxed)
    );
    assert!(gso > 0, "no GSO super-packet crossed: TSO is not on");
    assert!(
        largest > 16 * 1024,
        "the largest packet was {largest} B: super-packets are not whole"
    );
    assert!(
        pk < (BYTES / 1448) as u64,
        "{pk} packets for {BYTES} B: no fewer than MTU-sized segments"
    );

    // Dropping the last handle removes the device.
    let name = ta.name().to_string();
    drop(ta);
    let out = Command::new("ip")
        .args(["-n", a, "link", "show", &name])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{name} outlived its handle");
    drop(nss);
}

/// A multi-queue device (what an engine task per queue would read): the kernel sees one
/// device with two queues, and spreads the flows it transmits over both, each packet whole on
/// one queue.
#[test]
fn a_multi_queue_device_spreads_flows_over_its_queues() {
    if !root_or_skip("a_multi_queue_device_spreads_flows_over_its_queues") {
        return;
    }
    let ns = "tunt-mq";
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
    run(&["ip", "netns", "add", ns]);
    let nss = Namespaces(vec![ns.into()]);
    let queues = in_netns(ns, || Tun::create_queues("mq%d", 2, true).expect("queues"));
    assert_eq!(queues.len(), 2);
    let dev = queues[0].name().to_string();
    assert!(queues.iter().all(|q| q.name() == dev), "one device");
    run(&["ip", "-n", ns, "addr", "add", "10.98.7.1/24", "dev", &dev]);
    run(&["ip", "-n", ns, "link", "set", &dev, "up"]);
    let shown = Command::new("ip")
        .args(["-n", ns, "-d", "link", "show", &dev])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).to_string();
    assert!(
        shown.contains("multi_queue") && shown.contains("numqueues 2"),
        "the kernel's view of {dev}:\n{shown}"
    );
    // 32 UDP flows (one source port each) to an address behind the device.
    const FLOWS: u16 = 32;
    in_netns(ns, || {
        for i in 0..FLOWS {
            let s = std::net::UdpSocket::bind(("10.98.7.1", 40000 + i)).unwrap();
            s.send_to(&[i as u8; 100], "10.98.7.2:9").unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let mut buf = vec![0u8; TUN_READ_MAX];
    let mut per_queue = [0u32; 2];
    let mut ports = std::collections::BTreeSet::new();
    for (i, q) in queues.iter().enumerate() {
        while let Ok(n) = q.recv(&mut buf) {
            let ip = &buf[10..n];
            // IPv4 to 10.98.7.2, UDP: the source port names the flow.
            if ip[0] >> 4 == 4 && ip[9] == 17 && ip[16..20] == [10, 98, 7, 2] {
                let l4 = &ip[usize::from(ip[0] & 0xf) * 4..];
                ports.insert(u16::from_be_bytes([l4[0], l4[1]]));
                per_queue[i] += 1;
            }
        }
    }
    eprintln!("{FLOWS} flows: {per_queue:?} packets per queue");
    assert_eq!(
        ports.len(),
        usize::from(FLOWS),
        "every flow's packet read once"
    );
    assert_eq!(per_queue.iter().sum::<u32>(), u32::from(FLOWS));
    assert!(
        per_queue.iter().all(|n| *n > 0),
        "every flow on one queue: {per_queue:?}"
    );
    drop(queues);
    drop(nss);
}

/// What the queues of a device held: per queue, the number of UDP packets read for each
/// destination address.
fn udp_by_queue(queues: &[Tun]) -> Vec<std::collections::BTreeMap<std::net::IpAddr, u32>> {
    let mut buf = vec![0u8; TUN_READ_MAX];
    let mut seen = Vec::new();
    for q in queues {
        let mut by_dst = std::collections::BTreeMap::new();
        while let Ok(n) = q.recv(&mut buf) {
            let ip = &buf[10..n];
            let dst: std::net::IpAddr = match ip[0] >> 4 {
                4 if ip[9] == 17 => <[u8; 4]>::try_from(&ip[16..20]).unwrap().into(),
                6 if ip[6] == 17 => <[u8; 16]>::try_from(&ip[24..40]).unwrap().into(),
                _ => continue,
            };
            *by_dst.entry(dst).or_insert(0) += 1;
        }
        seen.push(by_dst);
    }
    seen
}

/// The engine's steering program on a two-queue device: every flow to a destination is
/// transmitted on the queue its entry names, whatever its hash (16 flows each, which the
/// kernel's own spreading puts on both queues, as the test above shows); a destination with
/// no entry, or whose entry was cleared, on queue 0; IPv6 as IPv4.
#[test]
fn steering_puts_each_destination_on_its_queue() {
    if !root_or_skip("steering_puts_each_destination_on_its_queue") {
        return;
    }
    use ipoib_ctl::steer::Steering;
    use std::net::IpAddr;
    let ns = "tunt-steer";
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
    run(&["ip", "netns", "add", ns]);
    let nss = Namespaces(vec![ns.into()]);
    let queues = in_netns(ns, || Tun::create_queues("st%d", 2, true).expect("queues"));
    let dev = queues[0].name().to_string();
    run(&["ip", "-n", ns, "addr", "add", "10.98.8.1/24", "dev", &dev]);
    run(&[
        "ip",
        "-n",
        ns,
        "addr",
        "add",
        "fd00:98::1/64",
        "dev",
        &dev,
        "nodad",
    ]);
    run(&["ip", "-n", ns, "link", "set", &dev, "up"]);
    let t0 = std::time::Instant::now();
    let mut steering = Steering::attach(&queues[1]).expect("steering attached");
    eprintln!(
        "the steering program loaded and given in {:?}",
        t0.elapsed()
    );

    let (to_1, to_0, unknown, v6): (IpAddr, IpAddr, IpAddr, IpAddr) = (
        "10.98.8.2".parse().unwrap(),
        "10.98.8.3".parse().unwrap(),
        "10.98.8.4".parse().unwrap(),
        "fd00:98::2".parse().unwrap(),
    );
    steering.set(to_1, 1).unwrap();
    steering.set(to_0, 0).unwrap();
    steering.set(v6, 1).unwrap();
    assert_eq!(steering.get(to_1).unwrap(), Some(1));
    assert_eq!(steering.get(unknown).unwrap(), None);
    const FLOWS: u16 = 16;
    let send = move |dsts: Vec<IpAddr>| {
        in_netns(ns, move || {
            for dst in dsts {
                for i in 0..FLOWS {
                    let src: IpAddr = if dst.is_ipv4() {
                        "10.98.8.1".parse().unwrap()
                    } else {
                        "fd00:98::1".parse().unwrap()
                    };
                    let s = std::net::UdpSocket::bind((src, 41000 + i)).unwrap();
                    s.send_to(&[1; 64], (dst, 9)).unwrap();
                }
            }
        });
        std::thread::sleep(Duration::from_millis(200));
    };
    send(vec![to_1, to_0, unknown, v6]);
    let seen = udp_by_queue(&queues);
    eprintln!("per queue, packets by destination: {seen:?}");
    let n = u32::from(FLOWS);
    assert_eq!(seen[1].get(&to_1), Some(&n), "{to_1}: steered to queue 1");
    assert_eq!(seen[1].get(&v6), Some(&n), "{v6}: steered to queue 1");
    assert_eq!(seen[0].get(&to_0), Some(&n), "{to_0}: steered to queue 0");
    assert_eq!(
        seen[0].get(&unknown),
        Some(&n),
        "{unknown}: no entry, queue 0"
    );
    assert_eq!(
        seen[0].len() + seen[1].len(),
        4,
        "each destination on one queue"
    );

    // Cleared only by the queue it names: another queue's clear leaves it.
    steering.clear(to_1, 0).unwrap();
    assert_eq!(steering.get(to_1).unwrap(), Some(1));
    steering.clear(to_1, 1).unwrap();
    assert_eq!(steering.get(to_1).unwrap(), None);
    send(vec![to_1]);
    let seen = udp_by_queue(&queues);
    assert_eq!(seen[0].get(&to_1), Some(&n), "{to_1} cleared: queue 0");
    assert!(seen[1].is_empty(), "queue 1 after the clear: {:?}", seen[1]);

    // A device made later (connected mode started again) gets the program again, its map
    // emptied of the last device's entries, and steers as the first did.
    steering.set(to_0, 1).unwrap();
    drop(steering);
    drop(queues);
    let queues = in_netns(ns, || Tun::create_queues("st%d", 2, true).expect("queues"));
    let dev = queues[0].name().to_string();
    run(&["ip", "-n", ns, "addr", "add", "10.98.8.1/24", "dev", &dev]);
    run(&["ip", "-n", ns, "link", "set", &dev, "up"]);
    let t0 = std::time::Instant::now();
    let mut steering = Steering::attach(&queues[0]).expect("steering given again");
    eprintln!("given again in {:?}", t0.elapsed());
    assert_eq!(steering.get(to_0).unwrap(), None, "the last device's entry");
    steering.set(unknown, 1).unwrap();
    send(vec![unknown, to_0]);
    let seen = udp_by_queue(&queues);
    assert_eq!(
        seen[1].get(&unknown),
        Some(&n),
        "{unknown} steered on the new device"
    );
    assert_eq!(seen[0].get(&to_0), Some(&n), "{to_0}: no entry any more");
    drop(steering);
    drop(queues);
    drop(nss);
}
