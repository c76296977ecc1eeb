//! The property each fuzz target checks, one function per decoder of input from outside the
//! process. The targets (`fuzz_targets/`) run them under libFuzzer (`cargo xtask fuzz`);
//! `tests/corpus.rs` runs them on the seed corpus and on every past finding, on stable, in
//! the test suite. Beyond "no panic", each says what a good decode must give back.

mod differential;

use std::{net::IpAddr, path::Path};

use ipoib_common::{ARPHRD_INFINIBAND, PeerPin, Policy};
use ipoib_ctl::{
    cm::{
        peer::ipoib_hwaddr,
        wire::{
            HwAddr, MAX_RECV_MTU, MSG_LEN, Msg, PathParams, REJ_VERSIONS, VERSION, WireError,
            accepts_crossing, connection_mtu,
        },
    },
    iblink,
    path::{Endpoint, LinkLayer, address_vector},
    policy::PolicyChange,
    status::{PolicyView, Status, cm::CmStatus},
};

/// The handshake's 48-byte message (from anyone on the partition), then what the passive side
/// does with a REQ that decodes: the path it takes from it and its address vector toward the
/// asker, from an InfiniBand port and an Ethernet one whose GID is the next 16 bytes.
pub fn wire(data: &[u8]) {
    let Some(bytes) = data.get(..MSG_LEN) else {
        return;
    };
    let b: [u8; MSG_LEN] = bytes.try_into().expect("MSG_LEN bytes");
    let msg = match Msg::decode(&b) {
        Ok(m) => m,
        Err(e) => return refused(e),
    };
    assert_eq!(
        msg.encode(),
        b,
        "{msg:?} encodes to other bytes than it came from"
    );
    let (Msg::Req(h) | Msg::Rep(h)) = msg else {
        return;
    };
    let local_gid: [u8; 16] = data
        .get(MSG_LEN..MSG_LEN + 16)
        .map_or(h.rc.gid, |g| g.try_into().expect("16 bytes"));
    let path = h.path_for_passive(&local_gid);
    if let Some(r) = &path {
        assert_eq!(r.dlid, h.rc.lid);
        assert_eq!(Some(PathParams::of(r)), h.path);
    }
    for link_layer in [LinkLayer::InfiniBand, LinkLayer::Ethernet] {
        let local = Endpoint {
            link_layer,
            lid: 1,
            gid: local_gid,
            mtu: 5,
        };
        let Ok(av) = address_vector(&local, &h.rc.at(), path.as_ref(), 16) else {
            continue;
        };
        assert_eq!(link_layer, h.rc.link_layer, "a path across link layers");
        assert!((1..=h.rc.mtu.min(5)).contains(&av.path_mtu), "{av:?}");
        assert!(
            av.sl < 16 && av.ack_timeout.is_none_or(|t| t <= 31),
            "{av:?}"
        );
        if link_layer == LinkLayer::InfiniBand {
            assert!((1..0xc000).contains(&av.dlid), "not a unicast DLID: {av:?}");
        } else {
            assert!(av.dlid == 0 && av.grh.is_some(), "{av:?}");
        }
    }
    // Crossing REQs: of two different endpoints exactly one accepts the other's.
    let other = HwAddr {
        gid: local_gid,
        ud_qpn: 0x48,
    };
    if other != h.hwaddr() {
        assert_ne!(
            accepts_crossing(other, h.hwaddr()),
            accepts_crossing(h.hwaddr(), other)
        );
    }
    let mtu = connection_mtu(MAX_RECV_MTU, h.recv_mtu);
    assert!(mtu >= 1 && mtu < h.recv_mtu);
}

/// The REJ that answers a message that does not decode is one its sender reads: ours decodes,
/// and one to an older version carries that version.
fn refused(e: WireError) {
    let version = match e {
        WireError::Version(v) => v,
        _ => VERSION,
    };
    let rej = Msg::Rej {
        ud_qpn: 0x48,
        recv_mtu: MAX_RECV_MTU,
        reason: e.reason(),
    };
    let answer = rej.encode_as(version);
    if version == VERSION {
        assert_eq!(Msg::decode(&answer), Ok(rej));
    } else if REJ_VERSIONS.contains(&version) {
        assert_eq!(answer[4], version);
    }
}

/// The policy language: the operator's file, and the words given to `set-policy` (one a
/// line). A file that parses and applies prints back (`show-policy`) to the same policy.
pub fn policy(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let words: Vec<&str> = text.lines().collect();
    let _ = PolicyChange::parse(&words);
    let Ok(change) = PolicyChange::parse_file(text) else {
        return;
    };
    let base = Policy::new(ARPHRD_INFINIBAND);
    let Ok(applied) = change.apply(&base, change.peers.clone()) else {
        return;
    };
    let mut view = PolicyView::new(&applied, None);
    view.memory_budget = change.memory_budget;
    view.max_connections = change.max_connections;
    let pins: Vec<(String, PeerPin)> = change
        .peers
        .iter()
        .map(|(ip, pin)| (ip.to_string(), *pin))
        .collect();
    let printed = view.render_file("ib0", &pins);
    let again = PolicyChange::parse_file(&printed)
        .unwrap_or_else(|e| panic!("show-policy's file does not parse: {e}\n{printed}"));
    let reapplied = again
        .apply(&base, again.peers.clone())
        .unwrap_or_else(|e| panic!("show-policy's file does not apply: {e}\n{printed}"));
    assert_eq!(reapplied, applied, "from\n{text}\nprinted\n{printed}");
    assert_eq!(again.memory_budget, change.memory_budget, "{printed}");
    assert_eq!(again.max_connections, change.max_connections, "{printed}");
    let pinned = |c: &PolicyChange| -> Vec<(IpAddr, PeerPin)> {
        c.peers
            .iter()
            .filter(|(_, p)| **p != PeerPin::Auto)
            .map(|(ip, p)| (*ip, *p))
            .collect()
    };
    assert_eq!(pinned(&again), pinned(&change), "{printed}");
}

/// The CM status file another process (`status`, the metrics) reads: what decodes encodes
/// back to itself, and renders as status text and metrics.
pub fn cm_status(data: &[u8]) {
    let Ok(cm) = serde_json::from_slice::<CmStatus>(data) else {
        return;
    };
    let json = serde_json::to_string(&cm).expect("a CmStatus serializes");
    let again: CmStatus = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("its own JSON does not decode: {e}\n{json}"));
    assert_eq!(serde_json::to_string(&again).unwrap(), json);
    let _ = cm.engine_cpu_s_per_gb();
    let mut status = status_shell();
    status.cm = Some(cm);
    let _ = ipoib_ctl::status::render(&status);
    let _ = ipoib_ctl::metrics::render(&status, true);
}

/// A status with nothing in it but its interface, for the CM part to be rendered in.
fn status_shell() -> Status {
    serde_json::from_value(serde_json::json!({
        "iface": "ib0",
        "ifindex": 4,
        "egress_attach": null,
        "ingress": null,
        "policy": {
            "link": "ipoib", "mode": "auto", "cm_threshold": 1024,
            "heartbeat_timeout_ms": 3000, "kernel_cm": false, "ctl_port": 4755,
            "any_blocked": false, "memory_budget": null, "max_connections": null
        },
        "heartbeat_age_ms": 10,
        "heartbeat_writer_pid": 1,
        "failsafe_active": false,
        "loop_pid": 1,
        "loop_running": true,
        "reasons": {},
        "peers": [],
        "cm": null
    }))
    .expect("the shell status decodes")
}

/// The sysfs files the IPoIB readers take, from a tree the input lays out: its first byte says
/// which files exist, the rest is their texts split at NUL bytes (pkey, parent, dev_port,
/// dev_id, mode, mtu, the HCA's name).
pub fn iblink(data: &[u8]) {
    let Some((&present, rest)) = data.split_first() else {
        return;
    };
    let mut texts = rest.split(|&b| b == 0);
    let mut next = || String::from_utf8_lossy(texts.next().unwrap_or_default()).into_owned();
    let names = ["pkey", "parent", "dev_port", "dev_id", "mode", "mtu"];
    let files: Vec<(&str, String)> = names.iter().map(|n| (*n, next())).collect();
    let hca = next();
    let sys = Tree::new();
    let iface = sys.0.join("class/net/ib0");
    std::fs::create_dir_all(&iface).unwrap();
    for (i, (name, text)) in files.iter().enumerate() {
        if present & (1 << i) != 0 {
            std::fs::write(iface.join(name), text).unwrap();
        }
    }
    // The HCA's directory, where its name can be one (the kernel names it: mlx5_0).
    let hca_ok = present & 0x40 != 0
        && (1..=255).contains(&hca.len())
        && !hca.contains('/')
        && hca != "."
        && hca != "..";
    if hca_ok {
        let pci = sys.0.join("devices/pci0000:00/0000:00:02.0");
        std::fs::create_dir_all(pci.join("infiniband").join(&hca)).unwrap();
        std::os::unix::fs::symlink(&pci, iface.join("device")).unwrap();
    }
    let text = |name: &str| {
        let i = names.iter().position(|n| *n == name).unwrap();
        (present & (1 << i) != 0).then(|| files[i].1.clone())
    };
    if let Ok(Some(link)) = iblink::read(&sys.0, "ib0") {
        assert_eq!(iblink::parse_u16(&text("pkey").unwrap()), Some(link.pkey));
        assert!(link.port >= 1);
        assert_eq!(link.device, hca, "{link:?}");
        if let Some(parent) = &link.parent {
            assert!(
                !parent.is_empty() && !parent.contains('/') && parent != "." && parent != "..",
                "a parent that is no interface name: {parent:?}"
            );
        }
    }
    if let Ok(Some(mode)) = iblink::kernel_mode(&sys.0, "ib0") {
        assert_eq!(mode.connected, text("mode").unwrap().trim() == "connected");
        assert_eq!(
            Some(mode.mtu),
            text("mtu").unwrap_or_default().trim().parse().ok()
        );
    }
    if let Some(v) = iblink::parse_u16(&text("pkey").unwrap_or_default()) {
        assert_eq!(iblink::parse_u16(&format!("0x{v:04x}\n")), Some(v));
    }
}

/// A scratch sysfs root, removed when dropped.
struct Tree(std::path::PathBuf);

impl Tree {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("ipoib-fuzz-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tree(dir)
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The fast path's parse against etherparse on an IPoIB or Ethernet frame (see
/// [`differential`]).
pub use differential::{Outcome, compare as fastpath_compare, parse as fastpath_parse};

/// The IPoIB link-layer address a neighbour entry gives (netlink's NDA_LLADDR): 20 bytes,
/// or nothing.
pub fn hwaddr(data: &[u8]) {
    match ipoib_hwaddr(data) {
        Some(a) => {
            assert_eq!(data.len(), 20);
            assert_eq!(&a.gid[..], &data[4..]);
            assert!(a.ud_qpn <= 0xff_ffff);
            assert_eq!(a.ud_qpn.to_be_bytes()[1..], data[1..4]);
        }
        None => assert_ne!(data.len(), 20),
    }
}

/// A target's seed corpus, kept in the repository.
pub fn corpus_dir(target: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

/// Inputs that once failed a target, each kept as a regression (`fuzz/regressions/TARGET`).
pub fn regressions_dir(target: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("regressions")
        .join(target)
}

/// A target's property: panics on an input that breaks it.
pub type Property = fn(&[u8]);

/// The targets, by name, with their properties.
pub const TARGETS: &[(&str, Property)] = &[
    ("wire", wire),
    ("policy", policy),
    ("cm_status", cm_status),
    ("iblink", iblink),
    ("hwaddr", hwaddr),
    ("parse", fastpath_parse),
];
