//! An upgrade under traffic: node A attached by the first layout's fast path (its eBPF object
//! as built by that version, `tests/fixtures/ipoib-ebpf-layout1.o`, attached and pinned as
//! that version did), then `ipoib-ctl attach` of this version adopts the pins and replaces
//! them in place while B sends A a steady stream that A's policy blocks. Every packet must
//! meet one program or the other: none reaches A's socket, and the blocked-drop counter,
//! carried from the old maps into the new ones, equals what B sent. Needs root.

use std::{
    net::UdpSocket,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData},
    programs::{SchedClassifier, TcAttachType, Xdp, XdpMode, links::FdLink, tc},
    util::KernelVersion,
};
use ipoib_common::{
    ARPHRD_ETHER, LAYOUT, PeerEntry, PeerKey, PeerPin, Policy, map_names, peer_pin,
};
use ipoib_ctl::attach::{AttachState, EgressAttach, IngressAttach, pin_dir, state_path};
use ipoib_tests::{
    cmlab::in_netns,
    lab::{Node, Which, lab_or_skip},
};

const LAYOUT_1: &[u8] = include_bytes!("../fixtures/ipoib-ebpf-layout1.o");
const PORT: u16 = 5533;

/// What layout 1's `attach` did: load the object, pin its five maps and both programs, set
/// the policy (here with B pinned BLOCK), attach egress (TCX from 6.6, else a clsact filter)
/// and XDP (driver mode on Ethernet), pin the links, write the state (no `layout` in it).
fn attach_layout_1(a: &Node, b_ip: std::net::IpAddr) -> EgressAttach {
    let dir = pin_dir(&a.iface);
    ipoib_ctl::attach::ensure_bpffs().unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    let (iface, ns) = (a.iface.clone(), a.ns.clone());
    in_netns(&ns, move || {
        let dir = pin_dir(&iface);
        let mut ebpf = Ebpf::load(LAYOUT_1).expect("layout 1's object loads");
        let egress: &mut SchedClassifier = ebpf
            .program_mut("ipoib_egress")
            .unwrap()
            .try_into()
            .unwrap();
        egress.load().unwrap();
        let ingress: &mut Xdp = ebpf
            .program_mut("ipoib_ingress")
            .unwrap()
            .try_into()
            .unwrap();
        ingress.load().unwrap();
        for name in [
            "ipoib_policy",
            "ipoib_heartbeat",
            "ipoib_peers",
            "ipoib_traffic",
            "ipoib_reasons",
        ] {
            ebpf.map(name).expect(name).pin(dir.join(name)).unwrap();
        }
        let mut policy: Array<&mut MapData, Policy> =
            Array::try_from(ebpf.map_mut("ipoib_policy").unwrap()).unwrap();
        policy
            .set(
                0,
                Policy {
                    any_blocked: 1,
                    ..Policy::new(ARPHRD_ETHER)
                },
                0,
            )
            .unwrap();
        let mut peers: HashMap<&mut MapData, PeerKey, PeerEntry> =
            HashMap::try_from(ebpf.map_mut("ipoib_peers").unwrap()).unwrap();
        let blocked = PeerEntry {
            pin: peer_pin::BLOCK,
            ..Default::default()
        };
        peers.insert(PeerKey::from(b_ip), blocked, 0).unwrap();

        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        let egress: &mut SchedClassifier = ebpf
            .program_mut("ipoib_egress")
            .unwrap()
            .try_into()
            .unwrap();
        egress.pin(dir.join("prog_egress")).unwrap();
        if !tcx {
            let _ = tc::qdisc_add_clsact(&iface);
        }
        let id = egress.attach(&iface, TcAttachType::Egress).unwrap();
        let how = match FdLink::try_from(egress.take_link(id).unwrap()) {
            Ok(fd) => {
                fd.pin(dir.join("link_egress")).unwrap();
                EgressAttach::Tcx
            }
            Err(_) => EgressAttach::Netlink,
        };
        let ingress: &mut Xdp = ebpf
            .program_mut("ipoib_ingress")
            .unwrap()
            .try_into()
            .unwrap();
        ingress.pin(dir.join("prog_ingress")).unwrap();
        let id = ingress
            .attach(&iface, XdpMode::Driver)
            .or_else(|_| ingress.attach(&iface, XdpMode::Skb))
            .unwrap();
        let fd = FdLink::try_from(ingress.take_link(id).unwrap()).unwrap();
        fd.pin(dir.join("link_ingress")).unwrap();
        how
    })
}

fn write_layout_1_state(a: &Node, egress: EgressAttach) {
    let state = AttachState {
        iface: a.iface.clone(),
        ifindex: a.ifindex(&a.iface).unwrap(),
        egress,
        ingress: IngressAttach::Driver,
        memory_budget: None,
        max_connections: None,
        loop_pid: None,
        netns: None,
        layout: 1,
        cm_down: None,
        kernel_mode: None,
    };
    let mut v = serde_json::to_value(&state).unwrap();
    v.as_object_mut().unwrap().remove("layout");
    std::fs::create_dir_all(ipoib_ctl::attach::RUN_DIR).unwrap();
    std::fs::write(state_path(&a.iface), serde_json::to_vec(&v).unwrap()).unwrap();
}

/// `bpftool -j ARGS` in node `n`'s namespace, parsed.
fn bpftool(n: &Node, args: &[&str]) -> serde_json::Value {
    let out = n.cmd("bpftool").arg("-j").args(args).output().unwrap();
    assert!(out.status.success(), "bpftool {args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The ids of the maps program `id` uses.
fn maps_of(n: &Node, id: u64) -> Vec<u64> {
    bpftool(n, &["prog", "show", "id", &id.to_string()])["map_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// The programs on `n`'s interface's egress and XDP hooks, each with the ids of the maps it
/// uses, as the kernel reports them: `bpftool net show` for XDP and a tc filter; for TCX
/// (which this bpftool does not list) the program of the pinned link under `dir`.
fn hooked_programs(n: &Node, dir: &Path, egress: EgressAttach) -> Vec<(String, Vec<u64>)> {
    let mut progs = Vec::new();
    if egress == EgressAttach::Tcx {
        let link = dir.join("link_egress");
        let l = bpftool(n, &["link", "show", "pinned", link.to_str().unwrap()]);
        progs.push((
            "tcx egress".to_string(),
            maps_of(n, l["prog_id"].as_u64().unwrap()),
        ));
    }
    let net = bpftool(n, &["net", "show", "dev", &n.iface]);
    for section in net.as_array().unwrap() {
        for (kind, entries) in section.as_object().unwrap() {
            for e in entries.as_array().into_iter().flatten() {
                let hook = format!(
                    "{kind} {}",
                    e["kind"].as_str().or(e["mode"].as_str()).unwrap_or("")
                );
                if !(hook.contains("egress") || kind == "xdp") {
                    continue;
                }
                let id = e["prog_id"]
                    .as_u64()
                    .or(e["id"].as_u64())
                    .expect("a program id");
                progs.push((hook, maps_of(n, id)));
            }
        }
    }
    progs
}

/// Each pinned map under `dir`: (name, type, the kernel's memory for it in bytes).
fn memory(dir: &Path) -> Vec<(String, String, u64)> {
    let mut maps = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let out = std::process::Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(&path)
            .output()
            .expect("bpftool");
        if !out.status.success() {
            continue; // a program or a link
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        maps.push((
            v["name"].as_str().unwrap_or("?").to_string(),
            v["type"].as_str().unwrap_or("?").to_string(),
            v["bytes_memlock"].as_u64().unwrap_or(0),
        ));
    }
    maps.sort();
    maps
}

fn map_id(dir: &Path, name: &str) -> u64 {
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(dir.join(name))
        .output()
        .expect("bpftool");
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"]
        .as_u64()
        .unwrap()
}

#[test]
fn an_attachment_of_layout_1_is_replaced_under_traffic_without_a_gap() {
    let test = "an_attachment_of_layout_1_is_replaced_under_traffic_without_a_gap";
    let Some(mut lab) = lab_or_skip(test, "upg", false) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let egress = attach_layout_1(&a, b.ip4.into());
    write_layout_1_state(&a, egress);
    let dir = pin_dir(&a.iface);
    assert!(dir.join("ipoib_traffic").exists());
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    eprintln!(
        "kernel memory of layout 1's maps (possible CPUs {}; name, type, bytes):",
        cpus.trim()
    );
    for m in memory(&dir) {
        eprintln!("  {m:?}");
    }

    // A listens; B sends a datagram every 200 us until told to stop.
    let a_addr = std::net::SocketAddr::new(a.ip4.into(), PORT);
    let sock = in_netns(&a.ns, move || UdpSocket::bind(a_addr).unwrap());
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let receiver = {
        let (got, stop) = (got.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                if sock.recv(&mut buf).is_ok() {
                    got.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    let sent = Arc::new(AtomicU64::new(0));
    let sender = {
        let (sent, stop, ns) = (sent.clone(), stop.clone(), b.ns.clone());
        std::thread::spawn(move || {
            in_netns(&ns, move || {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                let payload = [7u8; 200];
                let start = Instant::now();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if s.send_to(&payload, a_addr).is_ok() {
                        n += 1;
                        sent.store(n, Ordering::Relaxed);
                    }
                    let next = start + Duration::from_micros(200 * n);
                    if let Some(d) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(d);
                    }
                }
            })
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    // This version's status reads no other layout, and says what to do.
    let out = a.ctl(&["status", &a.iface]).unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("map layout 1") && said.contains("ipoib-ctl attach"),
        "{said}"
    );
    let before_upgrade = sent.load(Ordering::Relaxed);
    let t = Instant::now();
    lab.attach(Which::A, &[]).unwrap();
    let took = t.elapsed();
    std::thread::sleep(Duration::from_millis(700));
    stop.store(true, Ordering::Relaxed);
    sender.join().unwrap();
    receiver.join().unwrap();
    let sent = sent.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(200));

    let status = a.status().unwrap();
    let dropped = status
        .reasons
        .get("rx_drop_blocked")
        .map_or(0, |c| c.packets);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_path(&a.iface)).unwrap()).unwrap();
    eprintln!(
        "B sent {sent} datagrams ({before_upgrade} before the new attach, which took \
         {took:.1?}); A's socket got {}; blocked drops counted {dropped}; state layout {}",
        got.load(Ordering::Relaxed),
        state["layout"]
    );
    eprintln!("kernel memory of layout {LAYOUT}'s maps:");
    for m in memory(&dir) {
        eprintln!("  {m:?}");
    }
    assert_eq!(
        got.load(Ordering::Relaxed),
        0,
        "a blocked datagram got through"
    );
    assert_eq!(dropped, sent, "packets no program counted");
    assert_eq!(state["layout"], LAYOUT);
    // The pins are the new layout's, and the programs on the hooks use them.
    assert!(!dir.join(map_names::TRAFFIC_V1).exists());
    assert!(!dir.join(ipoib_ctl::attach::upgrade::NEXT).exists());
    let slots = map_id(&dir, map_names::TRAFFIC);
    let hooked = hooked_programs(&a, &dir, egress);
    eprintln!(
        "programs on {}'s hooks: {hooked:?}; the new traffic map is {slots}",
        a.iface
    );
    assert_eq!(hooked.len(), 2, "{hooked:?}");
    for (hook, maps) in &hooked {
        assert!(
            maps.contains(&slots),
            "{hook} runs a program without the new maps"
        );
    }
    // B's pin came across.
    let b_view = a.peer(&b.ip4.to_string()).unwrap().expect("A knows B");
    assert_eq!(b_view.pin, PeerPin::Block, "{b_view:?}");
    lab.teardown();
}
