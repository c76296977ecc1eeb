use super::*;

/// A ConnectX port on an InfiniBand subnet, as `ipoib-ctl caps` reads one: ACTIVE, LID 7, the
/// SM at LID 1, a 4096-byte MTU.
fn ib_port(port: u8) -> PortCaps {
    PortCaps {
        port,
        state: "active".into(),
        active_mtu: 4096,
        max_mtu: 4096,
        link_layer: "InfiniBand".into(),
        lid: 7,
        sm_lid: 1,
        gid_table_len: 128,
        gids: vec!["fe80:0000:0000:0000:ec0d:9a03:0044:368d".into()],
    }
}

fn device(name: &str, ports: Vec<PortCaps>, max_srq: u64) -> DeviceCaps {
    DeviceCaps {
        name: name.into(),
        fw_ver: "16.35.2000".into(),
        node_guid: "ec0d:9a03:0044:368c".into(),
        max_qp: 262_144,
        max_qp_wr: 32_768,
        max_sge: 30,
        max_cqe: 4_194_303,
        max_srq: 8_388_608 * u64::from(max_srq > 0),
        max_srq_wr: 32_767,
        max_srq_sge: 31,
        ports,
    }
}

fn srq_plan() -> Plan {
    Plan {
        kind: PlanKind::Srq,
        budget_bytes: 128 << 20,
        budget_source: "auto (1/64 of 8192 MiB, within 64 MiB..2 GiB)".into(),
        buffer_bytes: 65_536,
        buffer_cost: 69_632,
        cm_mtu: 65_520,
        ring: 963,
        max_cm_peers: 1000,
        memory_bytes: 64 << 20,
        why: "an SRQ".into(),
    }
}

/// A healthy node: Debian 12's kernel, an IPoIB interface in datagram mode on mlx5_0 port 1,
/// attached, connected mode up.
fn healthy() -> Facts {
    Facts {
        kernel: "6.1.0-57-amd64".into(),
        bpffs: true,
        memlock: Some(8 << 20),
        root: true,
        iface: Some(IfaceFacts {
            name: "ib0".into(),
            ipoib: Some(true),
            kernel_mode: Some(KernelMode {
                connected: false,
                mtu: 4092,
            }),
            tso: Some(true),
            link: Some(IbLink {
                device: "mlx5_0".into(),
                port: 1,
                pkey: 0xffff,
                parent: None,
            }),
        }),
        devices: Ok(vec![device("mlx5_0", vec![ib_port(1)], 1)]),
        pkeys: vec![("mlx5_0".into(), 1, vec![0xffff, 0x8001])],
        plan: Some(("mlx5_0".into(), srq_plan())),
        attach: Some(AttachFacts {
            loop_running: true,
            heartbeat_age_ms: Some(120),
            heartbeat_timeout_ms: 3000,
            failsafe: false,
            cm_connections: Some(3),
            cm_down: None,
        }),
    }
}

fn find<'a>(c: &'a [Check], what: &str) -> &'a Check {
    c.iter()
        .find(|c| c.what == what)
        .unwrap_or_else(|| panic!("no line `{what}` in {c:#?}"))
}

fn levels(c: &[Check]) -> Vec<(String, Level)> {
    c.iter().map(|c| (c.what.clone(), c.level)).collect()
}

#[test]
fn a_healthy_node_is_ok_on_every_line_in_the_operators_order() {
    let c = judge(&healthy());
    let whats: Vec<&str> = c.iter().map(|c| c.what.as_str()).collect();
    assert_eq!(
        whats,
        [
            "kernel",
            "bpffs",
            "memlock",
            "interface ib0",
            "interface ib0 mode",
            "interface ib0 offloads",
            "interface ib0 fabric",
            "port mlx5_0/1",
            "port mlx5_0/1 LID",
            "port mlx5_0/1 P_Key",
            "port mlx5_0/1 SRQ",
            "plan",
            "attach ib0",
        ]
    );
    assert!(c.iter().all(|c| c.level == Level::Ok), "{c:#?}");
    assert_eq!(worst(&c), Level::Ok);
    assert_eq!(worst(&c).exit_code(), 0);
    assert!(find(&c, "kernel").says.contains("netlink clsact"));
    assert!(
        find(&c, "port mlx5_0/1 LID")
            .says
            .contains("LID 7, SM LID 1")
    );
    assert!(
        find(&c, "port mlx5_0/1 P_Key")
            .says
            .contains("0xffff at index 0")
    );
    assert!(find(&c, "plan").says.contains("1000 connections at most"));
    assert!(find(&c, "attach ib0").says.contains("3 connection(s)"));
    assert!(
        find(&c, "interface ib0 fabric")
            .says
            .contains("mlx5_0 port 1, partition 0xffff")
    );
}

#[test]
fn a_port_the_subnet_manager_has_not_swept_fails_and_says_connected_mode_waits() {
    let mut f = healthy();
    let mut p = ib_port(1);
    (p.state, p.lid, p.sm_lid) = ("init".into(), 0, 0);
    f.devices = Ok(vec![device("mlx5_0", vec![p], 1)]);
    let c = judge(&f);
    let port = find(&c, "port mlx5_0/1");
    assert_eq!(port.level, Level::Fail);
    assert!(port.says.contains("INIT, not ACTIVE"), "{}", port.says);
    assert_eq!(find(&c, "port mlx5_0/1 LID").level, Level::Fail);
    assert!(find(&c, "port mlx5_0/1 LID").says.contains("not swept"));
    assert_eq!(worst(&c).exit_code(), 1);
    // A LID with no SM behind it.
    let mut p = ib_port(1);
    p.sm_lid = 0;
    f.devices = Ok(vec![device("mlx5_0", vec![p], 1)]);
    let lid = judge(&f);
    assert_eq!(find(&lid, "port mlx5_0/1 LID").level, Level::Fail);
    assert!(
        find(&lid, "port mlx5_0/1 LID")
            .says
            .contains("no subnet manager")
    );
}

#[test]
fn a_partition_the_port_is_not_in_fails() {
    let mut f = healthy();
    f.pkeys = vec![("mlx5_0".into(), 1, vec![0x8001])];
    let c = judge(&f);
    let l = find(&c, "port mlx5_0/1 P_Key");
    assert_eq!(l.level, Level::Fail);
    assert!(l.says.contains("0xffff is not in"), "{}", l.says);
    // A limited member matches as the kernel matches it (the low 15 bits).
    f.pkeys = vec![("mlx5_0".into(), 1, vec![0x7fff])];
    assert_eq!(find(&judge(&f), "port mlx5_0/1 P_Key").level, Level::Ok);
    // The table of the interface's own port, not another port's of the same HCA.
    f.devices = Ok(vec![device("mlx5_0", vec![ib_port(1), ib_port(2)], 1)]);
    f.pkeys = vec![
        ("mlx5_0".into(), 1, vec![0xffff]),
        ("mlx5_0".into(), 2, vec![0x8001]),
    ];
    f.iface.as_mut().unwrap().link.as_mut().unwrap().port = 2;
    assert_eq!(find(&judge(&f), "port mlx5_0/2 P_Key").level, Level::Fail);
}

#[test]
fn the_kernels_connected_mode_is_said_with_what_attach_does_about_it() {
    let mut f = healthy();
    f.iface.as_mut().unwrap().kernel_mode = Some(KernelMode {
        connected: true,
        mtu: 65520,
    });
    let c = judge(&f);
    let m = find(&c, "interface ib0 mode");
    assert_eq!(m.level, Level::Ok);
    assert!(
        m.says.contains("connected, MTU 65520: kernel-cm=on"),
        "{}",
        m.says
    );
    f.iface.as_mut().unwrap().kernel_mode = None;
    assert_eq!(find(&judge(&f), "interface ib0 mode").level, Level::Warn);
}

#[test]
fn the_lab_without_rdma_warns_and_fails_nothing() {
    let mut f = healthy();
    f.iface = Some(IfaceFacts {
        name: "veth-a".into(),
        ipoib: Some(false),
        kernel_mode: None,
        tso: Some(false),
        link: None,
    });
    f.devices = Err("no RDMA devices found".into());
    f.pkeys.clear();
    f.plan = None;
    f.attach = None;
    let c = judge(&f);
    assert_eq!(
        levels(&c),
        [
            ("kernel".into(), Level::Ok),
            ("bpffs".into(), Level::Ok),
            ("memlock".into(), Level::Ok),
            ("interface veth-a".into(), Level::Warn),
            ("rdma".into(), Level::Warn),
            ("attach veth-a".into(), Level::Ok),
        ]
    );
    assert!(find(&c, "rdma").says.contains("every peer stays on UD"));
    assert_eq!(worst(&c).exit_code(), 6);
    // No such interface at all.
    f.iface.as_mut().unwrap().ipoib = None;
    assert_eq!(find(&judge(&f), "interface veth-a").level, Level::Fail);
}

#[test]
fn the_kernel_is_held_to_the_floor_and_its_egress_hook_named() {
    let mut f = healthy();
    for (release, level, says) in [
        ("5.15.0-91-generic", Level::Fail, "below the floor 6.1"),
        ("6.0.12", Level::Fail, "below the floor"),
        ("6.1.0-57-amd64", Level::Ok, "netlink clsact"),
        ("6.6.0", Level::Ok, "TCX"),
        ("6.18.1-arch1", Level::Ok, "TCX"),
        ("7.0", Level::Ok, "TCX"),
        ("", Level::Warn, "unread"),
        ("linux", Level::Warn, "unread"),
    ] {
        f.kernel = release.into();
        let k = find(&judge(&f), "kernel").clone();
        assert_eq!(k.level, level, "{release}");
        assert!(k.says.contains(says), "{release}: {}", k.says);
    }
    assert_eq!(kernel_version("6.1.0-57-amd64"), Some((6, 1)));
    assert_eq!(kernel_version("10.2"), Some((10, 2)));
    assert_eq!(kernel_version("6"), None);
}

#[test]
fn bpffs_and_memlock() {
    let mut f = healthy();
    // attach mounts it: not a fault before attach.
    f.bpffs = false;
    let l = find(&judge(&f), "bpffs").clone();
    assert_eq!(l.level, Level::Ok);
    assert!(l.says.contains("attach mounts it"), "{}", l.says);
    f.bpffs = true;
    for (memlock, root, level) in [
        (None, false, Level::Ok),
        (None, true, Level::Ok),
        (Some(8 << 20), true, Level::Ok),
        (Some(8 << 20), false, Level::Warn),
    ] {
        (f.memlock, f.root) = (memlock, root);
        assert_eq!(
            find(&judge(&f), "memlock").level,
            level,
            "{memlock:?} {root}"
        );
    }
    assert!(find(&judge(&f), "memlock").says.contains("8.0 MiB"));
}

#[test]
fn only_the_interfaces_own_port_is_looked_at() {
    let mut f = healthy();
    let mut down = ib_port(2);
    down.state = "down".into();
    f.devices = Ok(vec![
        device("mlx5_0", vec![ib_port(1), down.clone()], 1),
        device("mlx5_1", vec![down.clone()], 1),
    ]);
    let c = judge(&f);
    assert!(c.iter().all(|c| !c.what.contains("/2")), "{c:#?}");
    assert!(c.iter().all(|c| !c.what.contains("mlx5_1")), "{c:#?}");
    assert_eq!(worst(&c), Level::Ok);
    // Without an interface every port is, down ones failing.
    f.iface = None;
    let all = judge(&f);
    assert_eq!(find(&all, "port mlx5_0/2").level, Level::Fail);
    assert_eq!(find(&all, "port mlx5_1/2").level, Level::Fail);
    assert!(all.iter().all(|c| !c.what.starts_with("attach")));
    // An interface on an HCA that is not there.
    let mut f = healthy();
    f.devices = Ok(vec![device("mlx5_1", vec![ib_port(1)], 1)]);
    let c = judge(&f);
    let l = find(&c, "rdma");
    assert_eq!(l.level, Level::Fail);
    assert!(l.says.contains("mlx5_0 port 1"), "{}", l.says);
}

#[test]
fn roce_has_no_lid_line_and_a_small_mtu_or_no_srq_warns() {
    let mut f = healthy();
    f.iface = None;
    let mut p = ib_port(1);
    (p.link_layer, p.lid, p.sm_lid, p.active_mtu) = ("Ethernet".into(), 0, 0, 1024);
    f.devices = Ok(vec![device("rxe0", vec![p], 0)]);
    let c = judge(&f);
    assert_eq!(
        levels(&c)[3..],
        [
            ("port rxe0/1".into(), Level::Ok),
            ("port rxe0/1 MTU".into(), Level::Warn),
            ("port rxe0/1 SRQ".into(), Level::Warn),
            ("plan".into(), Level::Ok),
        ]
    );
    assert!(find(&c, "port rxe0/1 MTU").says.contains("1020 bytes"));
}

#[test]
fn a_plan_without_connected_mode_fails() {
    let mut f = healthy();
    f.plan = Some((
        "mlx5_0".into(),
        Plan {
            kind: PlanKind::UdOnly,
            why: "the budget holds no buffer".into(),
            ..srq_plan()
        },
    ));
    let l = find(&judge(&f), "plan").clone();
    assert_eq!(l.level, Level::Fail);
    assert!(l.says.contains("the budget holds no buffer"));
    f.plan = Some((
        "mlx5_0".into(),
        Plan {
            kind: PlanKind::PerConnection,
            ..srq_plan()
        },
    ));
    assert!(
        find(&judge(&f), "plan")
            .says
            .contains("a ring per connection")
    );
}

#[test]
fn the_attach_line_follows_the_loop_the_heartbeat_and_connected_mode() {
    let mut f = healthy();
    let base = f.attach.clone().unwrap();
    let cases = [
        (None, Level::Ok, "not attached"),
        (
            Some(AttachFacts {
                loop_running: false,
                ..base.clone()
            }),
            Level::Fail,
            "no control loop runs",
        ),
        (
            Some(AttachFacts {
                failsafe: true,
                heartbeat_age_ms: Some(9000),
                ..base.clone()
            }),
            Level::Fail,
            "9000 ms old (timeout 3000 ms): FAIL-SAFE",
        ),
        (
            Some(AttachFacts {
                cm_connections: None,
                cm_down: Some("waits: the port is DOWN, not ACTIVE".into()),
                ..base.clone()
            }),
            Level::Warn,
            "connected mode not running: waits: the port is DOWN",
        ),
        (
            Some(AttachFacts {
                cm_connections: None,
                cm_down: None,
                ..base.clone()
            }),
            Level::Warn,
            "connected mode not running",
        ),
    ];
    for (a, level, says) in cases {
        f.attach = a;
        let l = find(&judge(&f), "attach ib0").clone();
        assert_eq!(l.level, level, "{says}");
        assert!(l.says.contains(says), "{}", l.says);
    }
}

#[test]
fn the_text_is_one_aligned_line_per_check_and_the_json_names_levels() {
    let c = vec![
        line("kernel", Level::Ok, "6.1"),
        line("port rxe0/1", Level::Fail, "DOWN"),
    ];
    assert_eq!(
        render(&c),
        "OK    kernel       6.1\nFAIL  port rxe0/1  DOWN\n"
    );
    let j = serde_json::to_value(&c).unwrap();
    assert_eq!(j[1]["level"], "FAIL");
    assert_eq!(j[0]["what"], "kernel");
    assert_eq!(worst(&[]), Level::Ok);
    assert_eq!(Level::Warn.exit_code(), 6);
    assert_eq!(Level::Fail.exit_code(), 1);
}
