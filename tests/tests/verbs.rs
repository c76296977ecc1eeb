//! Discovery on real verbs: soft-RoCE (rdma_rxe) in the VM, compared with ibv_devinfo.
//!
//! This host's kernel has no RDMA support, so here the test skips, loudly; `cargo xtask
//! vm-test` runs it on Debian's 6.1 kernel with IPOIB_REQUIRE_RDMA=1, where skipping fails.

use std::collections::HashMap;

use ipoib_tests::{
    cmlab::{rdma_resources, rxe_device},
    lab::ctl_path,
    programs::sh,
};

fn required() -> bool {
    std::env::var("IPOIB_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// `key: value` lines of `ibv_devinfo -v`, device part and port 1 part.
fn devinfo(dev: &str) -> (HashMap<String, String>, HashMap<String, String>) {
    let out = sh(&["ibv_devinfo", "-v", "-d", dev]);
    assert!(out.status.success(), "ibv_devinfo failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut devm, mut portm) = (HashMap::new(), HashMap::new());
    let mut in_port = false;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_string(), v.trim().to_string());
        if k == "port" {
            in_port = true;
            continue;
        }
        if in_port {
            portm.entry(k).or_insert(v);
        } else {
            devm.entry(k).or_insert(v);
        }
    }
    (devm, portm)
}

fn first_num(s: &str) -> u64 {
    s.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number in `{s}`"))
}

#[test]
fn discovery_matches_ibv_devinfo() {
    let Some(dev) = rxe_device() else {
        assert!(
            !required(),
            "IPOIB_REQUIRE_RDMA=1 but no RDMA device could be made"
        );
        ipoib_tests::loud_skip(
            "discovery_matches_ibv_devinfo",
            "this kernel has no RDMA support (rdma_rxe cannot load); `cargo xtask vm-test` \
             runs it on soft-RoCE",
        );
        return;
    };
    let out = sh(&[ctl_path().to_str().unwrap(), "caps", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let caps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ours = caps["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"]["name"] == dev.as_str())
        .expect("our device in caps")
        .clone();
    let (d, p) = devinfo(&dev);
    for key in [
        "max_qp",
        "max_qp_wr",
        "max_sge",
        "max_cqe",
        "max_srq",
        "max_srq_wr",
        "max_srq_sge",
    ] {
        assert_eq!(
            ours["device"][key].as_u64().unwrap(),
            first_num(&d[key]),
            "{key}: caps vs ibv_devinfo"
        );
    }
    assert_eq!(ours["device"]["fw_ver"], d["fw_ver"].as_str());
    assert_eq!(ours["device"]["node_guid"], d["node_guid"].as_str());
    let port = &ours["device"]["ports"][0];
    assert_eq!(
        port["active_mtu"].as_u64().unwrap(),
        first_num(&p["active_mtu"])
    );
    assert_eq!(port["max_mtu"].as_u64().unwrap(), first_num(&p["max_mtu"]));
    assert_eq!(port["link_layer"], p["link_layer"].as_str());
    assert_eq!(
        port["lid"].as_u64().unwrap(),
        first_num(&p["port_lid"]),
        "port_lid"
    );
    let state = p["state"].to_lowercase();
    assert!(
        state.contains(port["state"].as_str().unwrap()),
        "state {state} vs {port}"
    );
    // The GIDs that are set, one per table entry, as ibv_devinfo lists them
    // (`GID[  0]: fe80::..., RoCE v2`).
    let gid = |s: &str| -> std::net::Ipv6Addr {
        let addr = s.split(',').next().unwrap_or_default().trim();
        addr.parse().unwrap_or_else(|e| panic!("a GID: `{s}`: {e}"))
    };
    let mut theirs: Vec<_> = p
        .iter()
        .filter(|(k, _)| k.starts_with("GID["))
        .map(|(_, v)| gid(v))
        .collect();
    let mut listed: Vec<_> = port["gids"]
        .as_array()
        .expect("gids")
        .iter()
        .map(|g| gid(g.as_str().unwrap()))
        .collect();
    theirs.sort_unstable();
    listed.sort_unstable();
    assert!(!listed.is_empty(), "no GID listed: {port}");
    assert_eq!(listed, theirs, "the port's GIDs");
    // soft-RoCE has an SRQ: the plan uses it and stays inside its budget.
    let plan = &ours["plan"];
    assert_eq!(plan["kind"], "srq");
    assert!(plan["memory_bytes"].as_u64().unwrap() <= plan["budget_bytes"].as_u64().unwrap());
    eprintln!(
        "{dev}: discovery matches ibv_devinfo; plan: {}",
        plan["why"]
    );
    // `--srq off` plans what an HCA without an SRQ gets: rings of 64 buffers, as many as a
    // 14 MiB budget holds (three of 4 MiB), inside it.
    let ctl = ctl_path();
    let args = [ctl.to_str().unwrap(), "caps", "--json", "--srq", "off"];
    let out = sh(&[&args[..], &["--memory-budget", "14MiB"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let caps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = caps["devices"].as_array().unwrap();
    let off = devices
        .iter()
        .find(|d| d["device"]["name"] == dev.as_str())
        .unwrap();
    let plan = &off["plan"];
    assert_eq!(plan["kind"], "per_connection", "{plan}");
    assert_eq!(
        (plan["ring"].as_u64(), plan["max_cm_peers"].as_u64()),
        (Some(64), Some(3))
    );
    assert_eq!(plan["memory_bytes"].as_u64(), Some(12 << 20), "{plan}");
    eprintln!("{dev} with --srq off: {}", plan["why"]);
}

/// An SRQ sized by the memory plan: every buffer posted, the limit event armed, and after
/// teardown the kernel holds no PD, MR or SRQ of ours (counted).
#[test]
fn srq_from_the_plan_is_filled_and_freed() {
    use ipoib_ctl::{
        plan,
        verbs::{Device, SharedReceiveQueue, discover},
    };
    let Some(dev) = rxe_device() else {
        assert!(
            !required(),
            "IPOIB_REQUIRE_RDMA=1 but no RDMA device could be made"
        );
        ipoib_tests::loud_skip(
            "srq_from_the_plan_is_filled_and_freed",
            "this kernel has no RDMA support; `cargo xtask vm-test` runs it on soft-RoCE",
        );
        return;
    };
    let caps = discover().unwrap();
    let hca = caps.iter().find(|d| d.name == dev).unwrap();
    let p = plan::plan(&hca.limits(), 2 << 30, Some(64 << 20));
    assert_eq!(p.kind, plan::PlanKind::Srq);
    let depth = p.ring as u32;
    assert_eq!(depth, 1024, "64 MiB of 64 KiB buffers");
    let before = rdma_resources(&dev);
    {
        let d = Device::open(&dev).unwrap();
        // The one query connected mode makes gives what discovery found.
        assert_eq!(d.limits().unwrap(), hca.limits());
        let pd = d.alloc_pd().unwrap();
        let srq =
            SharedReceiveQueue::create(&pd, depth, p.buffer_bytes as u32, p.buffer_cost).unwrap();
        assert_eq!(srq.posted(), depth);
        let attr = srq.query().unwrap();
        assert!(attr.max_wr >= depth, "{attr:?}");
        assert_eq!(attr.srq_limit, depth / 4, "{attr:?}");
        let during = rdma_resources(&dev);
        for key in ["pd", "mr", "srq"] {
            assert_eq!(
                during.get(key).copied().unwrap_or(0),
                before.get(key).copied().unwrap_or(0) + 1,
                "{key} while the SRQ exists: {during:?}"
            );
        }
        eprintln!(
            "{dev}: SRQ of {depth} x {} B posted; {attr:?}; {during:?}",
            p.buffer_bytes
        );
    }
    assert_eq!(
        rdma_resources(&dev),
        before,
        "resources left after teardown"
    );
}
