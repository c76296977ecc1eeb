//! The datapath on real traffic: two network namespaces, real `ipoib-ctl` processes, ping and
//! iperf3. Needs root (CI is root).

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ipoib_common::{PeerEntry, PeerKey, peer_mode};
use ipoib_ctl::{attach::IngressAttach, connmgr::listen, maps::DatapathMaps, status::PeerModeView};
use ipoib_tests::lab::{json_u64 as u, *};

fn ping(from: &Node, to: &str, count: u32, size: u32, interval: &str) -> (u32, u32) {
    let out = from
        .cmd("ping")
        .args([
            "-n",
            "-q",
            "-c",
            &count.to_string(),
            "-s",
            &size.to_string(),
        ])
        .args(["-i", interval, "-W", "2", to])
        .output()
        .expect("ping");
    let text = String::from_utf8_lossy(&out.stdout);
    ping_summary(&text).unwrap_or_else(|| panic!("no ping summary in: {text}"))
}

fn kernel_at_least(major: u32, minor: u32) -> bool {
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut it = rel
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|x| x.parse::<u32>().ok());
    let (ma, mi) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (ma, mi) >= (major, minor)
}

fn reason(status: &serde_json::Value, name: &str) -> u64 {
    status["reasons"][name]["packets"].as_u64().unwrap_or(0)
}

fn peer_or_zero(n: &Node, addr: &str) -> serde_json::Value {
    n.peer_json(addr).unwrap().unwrap_or(serde_json::json!({}))
}

/// Both receive hooks on real traffic: A receives at TC ingress (`--ingress tc`, the hook an
/// IPoIB interface gets by itself), B in XDP. Each counts what the other sends, per peer and per
/// decision; policy changes take effect live (a mode, a block at A's TC ingress); `detach`
/// leaves no program behind (TCX links on 6.6+, clsact filters below).
#[test]
fn lab_counts_traffic_and_takes_policy_live() {
    let Some(mut lab) = lab_or_skip("lab_counts_traffic_and_takes_policy_live", "e2e", false)
    else {
        return;
    };
    lab.attach(Which::A, &["--ingress", "tc"]).unwrap();
    lab.attach(Which::B, &[]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let (a_ip, b_ip) = (a.ip4.to_string(), b.ip4.to_string());
    assert_eq!(a.status().unwrap().ingress, Some(IngressAttach::Tc));
    let b_hook = b.status().unwrap().ingress;
    assert!(
        matches!(b_hook, Some(IngressAttach::Driver | IngressAttach::Generic)),
        "{b_hook:?}"
    );

    // Warm up ARP so the counted pings are the only IPv4 unicast between the two.
    ping(&a, &b_ip, 1, 56, "0.2");
    // The pings are counted at each peer's traffic slot: the entry that names it comes with
    // it (a peer first seen is counted apart, and a packet counted apart as it moves to its
    // slot can be lost: see `DatapathMaps::give_slot`).
    for (n, peer) in [(&a, &b_ip), (&b, &a_ip)] {
        assert!(
            n.wait_peer_mode(peer, PeerModeView::Ud, Duration::from_secs(10))
                .is_some(),
            "{}: no entry for {peer}: {:?}",
            n.ns,
            n.peer(peer)
        );
    }
    let a0 = peer_or_zero(&a, &b_ip);
    let b0 = peer_or_zero(&b, &a_ip);
    let cache = |n: &Node| {
        n.status()
            .unwrap()
            .peer_cache
            .expect("this build's programs count their peer cache")
    };
    let cache0 = cache(&a);
    assert_eq!(ping(&a, &b_ip, 20, 56, "0.05"), (20, 20));
    let cache1 = cache(&a);
    let a1 = a.peer_json(&b_ip).unwrap().expect("A sees B");
    let b1 = b.peer_json(&a_ip).unwrap().expect("B sees A");
    // 20 echo requests out of A and into B; 20 replies out of B and into A.
    assert_eq!(u(&a1, "tx_ud_packets") - u(&a0, "tx_ud_packets"), 20);
    assert_eq!(u(&a1, "rx_packets") - u(&a0, "rx_packets"), 20);
    assert_eq!(u(&b1, "rx_packets") - u(&b0, "rx_packets"), 20);
    assert_eq!(u(&b1, "tx_ud_packets") - u(&b0, "tx_ud_packets"), 20);
    // 84-byte ICMP packets (20 IP + 8 ICMP + 56).
    assert_eq!(u(&a1, "tx_ud_bytes") - u(&a0, "tx_ud_bytes"), 20 * 84);
    assert_eq!(u(&a1, "tx_cm_packets"), 0);
    // A's programs asked their peer cache for B once per packet each way (and for nothing
    // else but stray unicast, none expected here), most from the cache: a miss is a CPU's
    // first packet to B, or its first after a beat (every 750 ms), so a handful in a second.
    let lookups = cache1.lookups() - cache0.lookups();
    let hits = cache1.hits - cache0.hits;
    eprintln!("A's peer cache over 20 pings: {lookups} lookups, {hits} hits");
    assert!((40..=44).contains(&lookups), "{cache0:?} -> {cache1:?}");
    assert!(hits >= 30, "{cache0:?} -> {cache1:?}");
    assert!(cache1.slots_filled >= 1, "{cache1:?}");

    // set-policy takes effect on the live datapath.
    let s0 = a.status_json().unwrap();
    a.set_policy("mode=datagram").unwrap();
    assert_eq!(ping(&a, &b_ip, 5, 56, "0.05"), (5, 5));
    let s1 = a.status_json().unwrap();
    assert_eq!(
        reason(&s1, "tx_ud_datagram_mode") - reason(&s0, "tx_ud_datagram_mode"),
        5
    );
    assert_eq!(s1["policy"]["mode"], "datagram");
    a.set_policy("mode=auto").unwrap();
    assert_eq!(ping(&a, &b_ip, 5, 56, "0.05"), (5, 5));
    let s2 = a.status_json().unwrap();
    assert_eq!(
        reason(&s2, "tx_ud_datagram_mode"),
        reason(&s1, "tx_ud_datagram_mode")
    );
    assert_eq!(reason(&s2, "tx_ud_small") - reason(&s1, "tx_ud_small"), 5);

    // A block drops at A's TC ingress what B sends (B's replies), and nothing once lifted.
    let pin = |p: &str| a.set_policy(&format!("peer={b_ip}:{p}")).unwrap();
    pin("block");
    assert_eq!(
        ping(&a, &b_ip, 5, 56, "0.05"),
        (5, 0),
        "B's replies dropped"
    );
    let s3 = a.status_json().unwrap();
    assert_eq!(
        reason(&s3, "rx_drop_blocked") - reason(&s2, "rx_drop_blocked"),
        5
    );
    pin("auto");
    assert_eq!(ping(&a, &b_ip, 5, 56, "0.05"), (5, 5), "unblocked");

    // TCX where the kernel has it (>= 6.6), a netlink clsact filter below.
    let tcx = kernel_at_least(6, 6);
    assert_eq!(s2["egress_attach"], if tcx { "tcx" } else { "netlink" });
    let prog_id = |name: &str| {
        let path = format!("/sys/fs/bpf/ipoib/{}/{name}", a.iface);
        let out = Command::new("bpftool")
            .args(["-j", "prog", "show", "pinned", &path])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool json");
        v["id"].as_u64().expect("prog id")
    };
    let ids = [prog_id("prog_egress"), prog_id("prog_ingress")];

    // detach: programs, links and pins gone, traffic still flows.
    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert!(out.status.success());
    // Nothing references the programs any more (no link, filter, pin or fd): the kernel freed
    // them, so nothing of ours stays attached, on the TCX path or the netlink one.
    for id in ids {
        let gone = wait_until(Duration::from_secs(3), || {
            !Command::new("bpftool")
                .args(["prog", "show", "id", &id.to_string()])
                .output()
                .unwrap()
                .status
                .success()
        });
        assert!(gone, "program id {id} still exists after detach");
    }
    assert_eq!(a.ctl(&["status", &a.iface]).unwrap().status.code(), Some(4));
    assert!(!std::path::Path::new(&format!("/sys/fs/bpf/ipoib/{}", a.iface)).exists());
    assert_eq!(ping(&a, &b_ip, 5, 56, "0.05"), (5, 5));
    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert_eq!(out.status.code(), Some(4), "double detach");
}

/// Each interface has its own handshake listener on the same port (SO_BINDTODEVICE): another
/// interface of the node binds it too; a second listener on one interface, or one where
/// another program listens on the port for every interface, gets an error that says so.
#[test]
fn handshake_listeners_are_per_interface() {
    let Some(lab) = lab_or_skip("handshake_listeners_are_per_interface", "hsl", false) else {
        return;
    };
    let iface = lab.a.iface.clone();
    let (again, taken) = ipoib_tests::cmlab::in_netns(&lab.a.ns, {
        let iface = iface.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let port = 4755;
                let first = listen(&iface, port).expect("the interface's listener");
                let lo = listen("lo", port).expect("another interface's, on the same port");
                let again = listen(&iface, port).err().map(|e| e.to_string());
                drop((first, lo));
                // The port comes free when the last reference to those sockets goes: a child
                // another test thread is spawning holds a copy of every fd until its exec.
                let deadline = Instant::now() + Duration::from_secs(5);
                let everywhere = loop {
                    match std::net::TcpListener::bind("[::]:4755") {
                        Ok(l) => break l,
                        Err(e)
                            if e.kind() == std::io::ErrorKind::AddrInUse
                                && Instant::now() < deadline =>
                        {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => panic!("binding [::]:4755 after our listeners closed: {e}"),
                    }
                };
                let taken = listen(&iface, port).err().map(|e| e.to_string());
                drop(everywhere);
                (again, taken)
            })
        }
    });
    let want = format!("the handshake port (TCP 4755) is taken on {iface}");
    for (case, err) in [
        ("a second listener", again),
        ("a program on every interface", taken),
    ] {
        let err = err.unwrap_or_else(|| panic!("{case}: bound anyway"));
        assert!(err.starts_with(&want), "{case}: {err}");
    }
}

#[test]
fn bpftool_shows_programs_and_field_names() {
    let Some(mut lab) = lab_or_skip("bpftool_shows_programs_and_field_names", "btf", false) else {
        return;
    };
    lab.attach(Which::A, &[]).unwrap();
    let a = lab.a.clone();
    let b_ip = lab.b.ip4.to_string();
    a.set_policy(&format!("peer={b_ip}:ud")).unwrap();
    ping(&a, &b_ip, 2, 56, "0.1");
    let dir = format!("/sys/fs/bpf/ipoib/{}", a.iface);
    let dump = |map: &str| {
        let out = Command::new("bpftool")
            .args(["map", "dump", "pinned", &format!("{dir}/{map}")])
            .output()
            .expect("bpftool");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let peers = dump("ipoib_peers");
    for field in [
        "\"addr\"",
        "\"family\"",
        "\"mode\"",
        "\"pin\": 1",
        "\"cm_ifindex\"",
        "\"generation\"",
        "\"traffic_slot\"",
    ] {
        assert!(peers.contains(field), "peers dump lacks {field}:\n{peers}");
    }
    let traffic = dump(ipoib_common::map_names::TRAFFIC);
    for field in ["\"tx_ud_packets\"", "\"rx_bytes\"", "\"last_seen_ns\""] {
        assert!(
            traffic.contains(field),
            "traffic dump lacks {field}:\n{traffic}"
        );
    }
    let policy = dump("ipoib_policy");
    for field in [
        "\"link_type\": 1",
        "\"cm_min_bytes\": 1024",
        "\"heartbeat_timeout_ns\"",
    ] {
        assert!(
            policy.contains(field),
            "policy dump lacks {field}:\n{policy}"
        );
    }
    let progs = Command::new("bpftool")
        .args(["prog", "show"])
        .output()
        .unwrap();
    let progs = String::from_utf8_lossy(&progs.stdout);
    assert!(progs.contains("name ipoib_egress") && progs.contains("name ipoib_ingress"));
}

/// Marks `peer` CM_UP on `node`, redirecting to the node's CM stand-in, as the engine would.
fn mark_cm_up(node: &Node, peer: &str) {
    let ifindex = node.ifindex(node.cm_iface.as_deref().unwrap()).unwrap();
    let mut maps = DatapathMaps::from_pins(&ipoib_ctl::attach::pin_dir(&node.iface)).unwrap();
    let key = PeerKey::from(peer.parse::<std::net::IpAddr>().unwrap());
    maps.set_peer(
        key,
        PeerEntry {
            mode: peer_mode::CM_UP,
            cm_ifindex: ifindex,
            generation: 1,
            ..Default::default()
        },
    )
    .unwrap();
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// kill -9 of the control loop under traffic: no packet lost, the heartbeat goes stale and
/// big packets fall back to UD within the deadline; a new attach adopts the pins and the
/// counters go on.
#[test]
fn restart_under_traffic_loses_nothing() {
    let Some(mut lab) = lab_or_skip("restart_under_traffic_loses_nothing", "rst", true) else {
        return;
    };
    let policy = std::env::temp_dir().join("ipoib-rst.policy");
    std::fs::write(&policy, "heartbeat-timeout=1s\n").unwrap();
    let policy_arg = ["--policy", policy.to_str().unwrap()];
    let pid = lab.attach(Which::A, &policy_arg).unwrap();
    lab.attach(Which::B, &[]).unwrap();
    let (a, b_ip) = (lab.a.clone(), lab.b.ip4.to_string());
    mark_cm_up(&a, &b_ip);

    // 1400-byte pings: over the 1024-byte threshold, so they take the CM stand-in.
    let pinger = a
        .cmd("ping")
        .args([
            "-n", "-q", "-c", "400", "-s", "1400", "-i", "0.02", "-W", "2", &b_ip,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("CM traffic", Duration::from_secs(5), || {
        u(&peer_or_zero(&a, &b_ip), "tx_cm_packets") >= 20
    });
    let before_kill = a.peer_json(&b_ip).unwrap().unwrap();
    lab.kill9(pid);
    let stale0 = reason(&a.status_json().unwrap(), "tx_ud_heartbeat_stale");
    let took = wait_for("the fail-safe", Duration::from_secs(4), || {
        let s = a.status_json().unwrap();
        s["failsafe_active"] == true && reason(&s, "tx_ud_heartbeat_stale") > stale0 + 5
    });
    // Deadline 1s, plus at most one 0.25s beat interval and a tick of the coarse clock.
    assert!(
        took < Duration::from_millis(2500),
        "fail-safe took {took:?}"
    );
    let s = a.status_json().unwrap();
    assert_eq!(s["loop_running"], false);

    // Adopt: counters go on from where they were, CM resumes.
    let pid2 = lab.attach(Which::A, &[]).unwrap();
    assert_ne!(pid, pid2);
    let after = a.peer_json(&b_ip).unwrap().unwrap();
    assert!(u(&after, "tx_cm_packets") >= u(&before_kill, "tx_cm_packets"));
    let cm0 = u(&after, "tx_cm_packets");
    wait_for("CM again", Duration::from_secs(5), || {
        u(&peer_or_zero(&a, &b_ip), "tx_cm_packets") > cm0 + 10
    });
    let out = pinger.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let (sent, got) = ping_summary(&text).unwrap();
    assert_eq!(
        (sent, got),
        (400, 400),
        "packets lost across the restart: {text}"
    );
}

/// TC egress sees TCP super-packets before segmentation: a bulk flow through the CM stand-in
/// is classified and counted in packets far above the MTU, and its data arrives whole.
#[test]
fn gso_super_packets_take_the_cm_path_whole() {
    if Command::new("iperf3").arg("-v").output().is_err() {
        assert!(
            std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
            "iperf3 missing (cargo xtask provision)"
        );
        ipoib_tests::loud_skip(
            "gso_super_packets_take_the_cm_path_whole",
            "iperf3 is not installed",
        );
        return;
    }
    let Some(mut lab) = lab_or_skip("gso_super_packets_take_the_cm_path_whole", "gso", true) else {
        return;
    };
    lab.attach(Which::A, &[]).unwrap();
    lab.attach(Which::B, &[]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    mark_cm_up(&a, &b_ip);
    let mut server = b
        .cmd("iperf3")
        .args(["-s", "-1", "-B", &b_ip, "-p", "5299"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let client = a
        .cmd("iperf3")
        .args(["-c", &b_ip, "-p", "5299", "-t", "2", "-J"])
        .output()
        .unwrap();
    let _ = server.wait();
    assert!(
        client.status.success(),
        "{}",
        String::from_utf8_lossy(&client.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&client.stdout).unwrap();
    let received = report["end"]["sum_received"]["bytes"].as_u64().unwrap();
    let p = a.peer_json(&b_ip).unwrap().unwrap();
    let (cm_pkts, cm_bytes) = (u(&p, "tx_cm_packets"), u(&p, "tx_cm_bytes"));
    assert!(
        cm_bytes as f64 >= received as f64 * 0.9,
        "CM carried {cm_bytes} of {received}"
    );
    let mean = cm_bytes / cm_pkts.max(1);
    assert!(
        mean > 3000,
        "mean CM packet {mean} bytes: no super-packets were seen"
    );
    eprintln!(
        "iperf3 moved {received} bytes; egress redirected {cm_pkts} packets, {cm_bytes} bytes \
         (mean {mean} B/packet), UD {} packets",
        u(&p, "tx_ud_packets")
    );
}

fn dump_pinned(dir: &str, map: &str) -> String {
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned", &format!("{dir}/{map}")])
        .output()
        .expect("bpftool");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let Some(mut lab) = lab_or_skip("bad_input_is_refused_and_changes_nothing", "bad", false)
    else {
        return;
    };
    lab.attach(Which::A, &[]).unwrap();
    let a = lab.a.clone();
    let out = a
        .ctl(&["set-policy", &a.iface, "peer=10.77.0.9:ud"])
        .unwrap();
    assert!(out.status.success());
    let dir = format!("/sys/fs/bpf/ipoib/{}", a.iface);
    // The policy, and every entry but for its traffic slot and those the control loop makes
    // for peers it sees (UD, unpinned, never connected), which come and go meanwhile.
    let snapshot = || {
        let maps = DatapathMaps::from_pins(std::path::Path::new(&dir)).unwrap();
        let mut peers: Vec<(PeerKey, PeerEntry)> = maps
            .peers()
            .unwrap()
            .into_iter()
            .map(|(k, e)| {
                (
                    k,
                    PeerEntry {
                        traffic_slot: 0,
                        ..e
                    },
                )
            })
            .filter(|(_, e)| *e != PeerEntry::default())
            .collect();
        peers.sort_by_key(|(k, _)| *k);
        (dump_pinned(&dir, "ipoib_policy"), peers)
    };
    let before = snapshot();
    let bad: &[&[&str]] = &[
        &["mode=turbo"],
        &["cm-threshold=10"],
        &["cm-threshold=70000"],
        &["cm-threshold=abc"],
        &["heartbeat-timeout=1ms"],
        &["heartbeat-timeout=9h"],
        &["kernel-cm=perhaps"],
        &["ctl-port=0"],
        &["ctl-port=99999"],
        &["memory-budget=1KiB"],
        &["memory-budget=5TiB"],
        &["peer=10.77.0.9"],
        &["peer=not-an-ip:ud"],
        &["peer=224.1.1.1:cm"],
        &["peer=10.77.0.9:sometimes"],
        &["nonsense=1"],
        &["mode"],
        // A valid setting beside an invalid one: the valid one must not be written either.
        &["cm-threshold=2048", "mode=turbo"],
        &["peer=10.77.0.8:block", "ctl-port=0"],
        // Conflicts.
        &["mode=auto", "mode=datagram"],
        &["peer=10.77.0.9:ud", "peer=10.77.0.9:cm"],
        &["mode=datagram", "peer=10.77.0.9:cm"],
    ];
    for args in bad {
        let mut argv = vec!["set-policy", a.iface.as_str()];
        argv.extend_from_slice(args);
        let out = a.ctl(&argv).unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?} was not refused as bad input"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("ipoib-ctl: "),
            "{args:?}: unclear error: {err}"
        );
        assert_eq!(snapshot(), before, "{args:?} changed the pinned maps");
    }
    // A memory-budget within the key's range but over the node's budget (1/64 of this
    // machine's memory, at most 2 GiB), which its interfaces share.
    let out = a
        .ctl(&["set-policy", &a.iface, "memory-budget=1TiB"])
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("more than the node's budget"), "{err}");
    assert_eq!(snapshot(), before);
    // A mode=datagram with an existing CM pin is a conflict with state, also refused.
    let out = a
        .ctl(&["set-policy", &a.iface, "peer=10.77.0.9:cm"])
        .unwrap();
    assert!(out.status.success());
    let before = snapshot();
    let out = a.ctl(&["set-policy", &a.iface, "mode=datagram"]).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(snapshot(), before);

    // A policy file (`systemctl reload` runs `set-policy --file`): one bad line, a file that
    // is not there, a file that conflicts with the words beside it: refused whole, exit 2,
    // the error naming the file.
    let file = std::env::temp_dir().join(format!("ipoib-bad-{}.policy", std::process::id()));
    let path = file.to_str().unwrap();
    for (text, words) in [
        ("# reload\ncm-threshold=2048\nmode=turbo\n", &[][..]),
        ("cm-threshold=2048\n", &["cm-threshold=4096"][..]),
    ] {
        std::fs::write(&file, text).unwrap();
        let mut argv = vec!["set-policy", a.iface.as_str(), "--file", path];
        argv.extend_from_slice(words);
        let out = a.ctl(&argv).unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?} {words:?}: {err}");
        assert_eq!(snapshot(), before, "{text:?} {words:?} changed the maps");
    }
    let out = a
        .ctl(&["set-policy", &a.iface, "--file", "/nonexistent/ib0.policy"])
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("/nonexistent/ib0.policy"), "{err}");
    assert_eq!(snapshot(), before);
    // A good one is applied.
    std::fs::write(&file, "# reload\ncm-threshold=2048 # bigger\n").unwrap();
    let out = a.ctl(&["set-policy", &a.iface, "--file", path]).unwrap();
    assert!(out.status.success(), "{out:?}");
    let shown = a.ctl(&["show-policy", &a.iface, "--json"]).unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["cm_threshold"], 2048, "{shown}");
    // show-policy prints a policy file: read back, it changes nothing (pins included, an
    // IPv6 one among them).
    let out = a
        .ctl(&[
            "set-policy",
            &a.iface,
            "peer=[fd00::9]:block",
            "max-connections=7",
        ])
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let before = snapshot();
    let shown = a.ctl(&["show-policy", &a.iface]).unwrap();
    let text = String::from_utf8(shown.stdout).unwrap();
    for line in [
        "cm-threshold=2048",
        "max-connections=7",
        "peer=[fd00::9]:block",
        "peer=10.77.0.9:cm",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line} in:\n{text}");
    }
    std::fs::write(&file, &text).unwrap();
    let out = a.ctl(&["set-policy", &a.iface, "--file", path]).unwrap();
    assert!(out.status.success(), "{out:?}\n{text}");
    assert_eq!(
        snapshot(),
        before,
        "show-policy's file changed the policy:\n{text}"
    );
    std::fs::remove_file(&file).unwrap();

    // Attaching to what cannot be attached.
    assert_eq!(
        a.ctl(&["attach", "nosuch0"]).unwrap().status.code(),
        Some(2)
    );
    assert_eq!(a.ctl(&["attach", "lo"]).unwrap().status.code(), Some(2));
    // Durations as the policy writes them: `1m` and `500ms` are taken (the refusal is about
    // the interface), `1x` and `0` are not.
    let out = a
        .ctl(&[
            "attach",
            "nosuch0",
            "--cm-idle-after",
            "1m",
            "--cm-min-hold",
            "500ms",
        ])
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nosuch0") && !err.contains("duration"),
        "{err}"
    );
    for bad in ["1x", "0", "25h", "s"] {
        let out = a
            .ctl(&["attach", &a.iface, "--cm-idle-after", bad])
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--cm-idle-after {bad}: {err}");
        assert!(
            err.contains("--cm-idle-after"),
            "--cm-idle-after {bad}: {err}"
        );
    }
    let down = "baddown0";
    Command::new("nsenter")
        .args([
            &format!("--net=/run/netns/{}", a.ns),
            "--",
            "ip",
            "link",
            "add",
            down,
            "type",
            "veth",
            "peer",
            "name",
            "baddown1",
        ])
        .status()
        .unwrap();
    // Down is no configuration error: the interface may come up later (exit 1, which
    // systemd's Restart=on-failure retries; 2 it would not).
    let out = a.ctl(&["attach", down]).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is down"));
    assert!(!std::path::Path::new(&format!("/sys/fs/bpf/ipoib/{down}")).exists());
    // A second control loop for the same interface is refused while the first runs.
    let out = a.ctl(&["attach", &a.iface]).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another ipoib-ctl"));
    // Commands on an interface that is not attached.
    assert_eq!(
        a.ctl(&["set-policy", "nosuch0", "mode=auto"])
            .unwrap()
            .status
            .code(),
        Some(4)
    );
    assert_eq!(a.ctl(&["peers", "nosuch0"]).unwrap().status.code(), Some(4));
    assert_eq!(
        a.ctl(&["detach", "nosuch0"]).unwrap().status.code(),
        Some(4)
    );
}

#[test]
fn without_root_every_command_says_so() {
    if lab_unavailable().is_some() {
        ipoib_tests::loud_skip(
            "without_root_every_command_says_so",
            "needs root to drop root",
        );
        return;
    }
    let ctl = ctl_path();
    for args in [
        &["status"][..],
        &["attach", "lo"],
        &["set-policy", "x0", "mode=auto"],
    ] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&ctl)
            .args(args)
            .output()
            .expect("setpriv");
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("needs root"),
            "{args:?}"
        );
    }
}

/// `cargo xtask run` without IPoIB: Ctrl-C in the middle of the demo tears the lab down and
/// leaves nothing behind (namespaces, links, pins, programs).
#[test]
fn lab_demo_leaves_nothing_behind_on_ctrl_c() {
    if let Some(why) = lab_unavailable() {
        assert!(
            std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
            "{why}"
        );
        ipoib_tests::loud_skip("lab_demo_leaves_nothing_behind_on_ctrl_c", &why);
        return;
    }
    let demo = Command::new(env!("CARGO_BIN_EXE_ipoib-lab"))
        .args(["--lab", "--duration", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pins = std::path::Path::new("/sys/fs/bpf/ipoib/demoa0");
    // The test's bound, not the product's: the demo's first attach loads the programs, 35 s
    // under the VM's slow-machine mode (a 30 s bound failed there).
    let up = wait_until(Duration::from_secs(120), || {
        pins.exists() && std::path::Path::new("/run/netns/ipoib-lab-demo-b").exists()
    });
    assert!(up, "the demo did not come up");
    std::thread::sleep(Duration::from_secs(3)); // into the bulk phase
    // SAFETY: plain kill(2).
    unsafe { libc::kill(demo.id() as i32, libc::SIGINT) };
    let out = demo.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo exited with {}: {text}",
        out.status
    );
    assert!(text.contains("tearing the lab down"), "{text}");
    for ns in ["ipoib-lab-demo-a", "ipoib-lab-demo-b"] {
        assert!(
            !std::path::Path::new(&format!("/run/netns/{ns}")).exists(),
            "{ns} left behind"
        );
    }
    for iface in ["demoa0", "demob0"] {
        assert!(!std::path::Path::new(&format!("/sys/fs/bpf/ipoib/{iface}")).exists());
        assert!(!std::path::Path::new(&format!("/run/ipoib-ctl/{iface}.json")).exists());
        assert!(!std::path::Path::new(&format!("/run/ipoib-ctl/{iface}.lock")).exists());
    }
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&links.stdout).contains("demo"),
        "links left behind"
    );
}

/// systemd's notify protocol against a real notify socket: READY comes once, and only when the
/// fast path is attached and the loop runs; WATCHDOG comes within each period while the loop
/// turns, and not while the process is stopped; STOPPING on SIGTERM. (A wedged engine stops
/// it too: `hybrid.rs`, `a_stalled_engine_sends_the_flow_ud`.)
#[test]
fn systemd_hears_ready_after_attach_and_a_watchdog_while_the_loop_turns() {
    use ipoib_tests::notify::NotifySocket;
    let test = "systemd_hears_ready_after_attach_and_a_watchdog_while_the_loop_turns";
    let Some(lab) = lab_or_skip(test, "ntf", false) else {
        return;
    };
    let a = lab.a.clone();
    let sock = NotifySocket::bind("ntf").unwrap();
    let period = Duration::from_secs(1);
    let mut child = a
        .cmd(ipoib_tests::lab::ctl_path().to_str().unwrap())
        // As the unit starts it, with no policy file in place.
        .args([
            "attach",
            &a.iface,
            "--policy-if-present",
            "/nonexistent/ntf.policy",
        ])
        .env("NOTIFY_SOCKET", sock.path())
        .env("WATCHDOG_USEC", period.as_micros().to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Kills the loop however the test ends; the lab's teardown detaches.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let start = Instant::now();
    let ready = loop {
        if let Some(m) = sock.wait_for("READY=1", start, Duration::from_millis(20)) {
            break m;
        }
        // The test's bound: READY came 35 s after the start in the slow-machine mode.
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "no READY=1 within 120 s; heard {:?}; its log:\n{}",
                sock.messages(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let child = Kill(child);
    // Read after READY came: the loop must have said in its state that it runs (it writes
    // its pid there before it tells systemd).
    let s = a.status().unwrap();
    assert!(
        s.loop_running && s.loop_pid == Some(pid),
        "READY=1 before the loop ran: {s:#?}"
    );
    eprintln!("READY after {:?}: {:?}", ready.at - start, ready.text);
    assert!(
        ready.get("STATUS").is_some_and(|s| s.contains(&a.iface)),
        "{ready:?}"
    );

    // Turning: a WATCHDOG=1 within every period (the loop beats thrice per period).
    let t0 = Instant::now();
    std::thread::sleep(4 * period);
    let t1 = Instant::now();
    let gap = sock.longest_gap("WATCHDOG=1", t0, t1);
    let pings = sock
        .since(t0)
        .iter()
        .filter(|m| m.has("WATCHDOG=1"))
        .count();
    eprintln!("{pings} WATCHDOG=1 in {:?}, longest gap {gap:?}", t1 - t0);
    assert!(
        gap < period,
        "{gap:?} without WATCHDOG=1 (period {period:?})"
    );
    let readies = sock.messages().iter().filter(|m| m.has("READY=1")).count();
    assert_eq!(readies, 1, "{:?}", sock.messages());

    // Stopped: nothing, then pings again once it runs.
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    std::thread::sleep(2 * period);
    let resumed = Instant::now();
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let quiet: Vec<_> = sock
        .since(stopped + Duration::from_millis(50))
        .into_iter()
        .filter(|m| m.at < resumed)
        .collect();
    assert!(
        quiet.iter().all(|m| !m.has("WATCHDOG=1")),
        "WATCHDOG=1 from a stopped process: {quiet:?}"
    );
    assert!(
        sock.wait_for("WATCHDOG=1", resumed, period).is_some(),
        "no WATCHDOG=1 within {period:?} of SIGCONT"
    );

    // SIGTERM: STOPPING=1, then a clean exit.
    let term = Instant::now();
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    assert!(
        sock.wait_for("STOPPING=1", term, Duration::from_secs(10))
            .is_some(),
        "no STOPPING=1 after SIGTERM: {:?}",
        sock.since(term)
    );
    let mut child = child;
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");
    drop(lab);
}

/// `status` from another network namespace tells an interface that lives there from one that
/// is gone (its namespace deleted): the second is shown stale, with the `detach` that clears
/// its pins, and that detach works.
#[test]
fn status_tells_a_gone_interface_from_one_elsewhere() {
    let test = "status_tells_a_gone_interface_from_one_elsewhere";
    let Some(mut lab) = lab_or_skip(test, "stl", false) else {
        return;
    };
    let pid = lab.attach(Which::A, &[]).unwrap();
    let a = lab.a.clone();
    // This test runs in the host's namespace, the interface in A's.
    let status = || {
        let out = Command::new(ipoib_tests::lab::ctl_path())
            .args(["status", &a.iface, "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0]["presence"].clone()
    };
    assert_eq!(status(), "elsewhere");
    assert_eq!(a.status_json().unwrap()["presence"], "here");
    lab.kill9(pid);
    let out = Command::new("ip")
        .args(["netns", "del", &a.ns])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(status(), "gone");
    let text = Command::new(ipoib_tests::lab::ctl_path())
        .args(["status", &a.iface])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("STALE") && text.contains(&format!("ipoib-ctl detach {}", a.iface)),
        "{text}"
    );
    let out = Command::new(ipoib_tests::lab::ctl_path())
        .args(["detach", &a.iface])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!std::path::Path::new(&format!("/sys/fs/bpf/ipoib/{}", a.iface)).exists());
    assert!(!std::path::Path::new(&format!("/run/ipoib-ctl/{}.json", a.iface)).exists());
}

/// `doctor` on a lab node, before and after attach, and once its control loop is killed:
/// the report's lines as the node is (a veth, not IPoIB: WARN; not attached yet: OK; the loop
/// running with no connected mode: WARN and why; the loop gone: FAIL), its exit code the worst
/// line's (6 for a WARN, 1 for a FAIL), and the kernel's own checks OK on any kernel the suite
/// runs on.
#[test]
fn doctor_reports_the_node_as_it_is_before_and_after_attach() {
    let test = "doctor_reports_the_node_as_it_is_before_and_after_attach";
    let Some(mut lab) = lab_or_skip(test, "doc", false) else {
        return;
    };
    let a = lab.a.clone();
    let doctor = || {
        let out = a.ctl(&["doctor", &a.iface, "--json"]).unwrap();
        let v: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        let line = |what: &str| -> (String, String) {
            let l = v
                .iter()
                .find(|l| l["what"] == what)
                .unwrap_or_else(|| panic!("no `{what}` in {v:#?}"));
            (
                l["level"].as_str().unwrap().to_string(),
                l["says"].as_str().unwrap().to_string(),
            )
        };
        for what in ["kernel", "bpffs", "memlock"] {
            assert_eq!(line(what).0, "OK", "{what}: {v:#?}");
        }
        let worst = v
            .iter()
            .map(|l| match l["level"].as_str().unwrap() {
                "OK" => 0,
                "WARN" => 1,
                _ => 2,
            })
            .max()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some([0, 6, 1][worst]),
            "the exit code is not the worst line's: {v:#?}"
        );
        (
            line(&format!("interface {}", a.iface)),
            line(&format!("attach {}", a.iface)),
        )
    };
    let (iface, attach) = doctor();
    assert_eq!(iface.0, "WARN", "{iface:?}");
    assert!(iface.1.contains("not IPoIB"), "{iface:?}");
    assert_eq!(attach, ("OK".into(), "not attached (yet)".into()));

    let pid = lab.attach(Which::A, &[]).unwrap();
    let (_, attach) = doctor();
    assert_eq!(attach.0, "WARN", "{attach:?}");
    assert!(
        attach.1.contains("control loop running")
            && attach.1.contains("connected mode not running"),
        "{attach:?}"
    );
    lab.kill9(pid);
    let (_, attach) = doctor();
    assert_eq!(attach.0, "FAIL", "{attach:?}");
    assert!(attach.1.contains("no control loop runs"), "{attach:?}");
    lab.teardown();
}

/// The shipped unit's capability bounding set is what the kernel asks for, found by trying:
/// with any one of them left out `attach` fails (the kernel refuses a map, a program or an
/// attachment) and leaves no loop running; with all of them, under the unit's memlock limit
/// and no new privileges, it attaches and the fast path counts traffic. Here and on 6.1 in
/// the VM (the hybrid tests run connected mode, registration included, the same way).
#[test]
fn the_units_capabilities_are_each_needed_and_together_enough() {
    use ipoib_tests::sandbox::{unit_capabilities, wrapper};
    let test = "the_units_capabilities_are_each_needed_and_together_enough";
    let Some(mut lab) = lab_or_skip(test, "cap", false) else {
        return;
    };
    let caps = unit_capabilities();
    assert!(caps.contains(&"bpf".to_string()), "{caps:?}");
    ipoib_tests::sandbox::bpffs_mounted();
    let dir = std::env::temp_dir().join(format!("ipoib-caps-{}", std::process::id()));
    let a = lab.a.clone();
    let for_attach = caps
        .iter()
        .filter(|c| !ipoib_tests::sandbox::CONNECTED_MODE_ONLY.contains(&c.as_str()));
    for left_out in for_attach {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != left_out).cloned().collect();
        let w = wrapper(&dir.join(format!("without-{left_out}")), &fewer);
        let out = a
            .cmd("timeout")
            .arg("60")
            .arg(&w)
            .args(["attach", &a.iface])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "without CAP_{}: {}\n{said}",
            left_out.to_uppercase(),
            out.status
        );
        assert!(
            !out.status.success() && out.status.code() != Some(124),
            "attach ran without CAP_{}: {said}",
            left_out.to_uppercase()
        );
        let _ = a.ctl(&["detach", &a.iface]);
    }
    // All of them: the control loop comes up. `status` is the operator's, run with every
    // capability (reading a program's maps by id takes CAP_SYS_ADMIN).
    let w = wrapper(&dir.join("unit"), &caps);
    lab.attach_node_as(&a, &w, &[], &[]).unwrap();
    let small = || reason(&a.status_json().unwrap(), "tx_ud_small");
    let before = small();
    let (_, received) = ping(&a, &lab.b.ip4.to_string(), 3, 56, "0.2");
    assert_eq!(received, 3);
    assert!(
        small() - before >= 3,
        "the fast path did not count the pings"
    );
    lab.teardown();
    let _ = std::fs::remove_dir_all(&dir);
}
