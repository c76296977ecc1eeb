//! What the daemon does over netlink (`ipoib_ctl::rtnl`), against the running kernel in a
//! network namespace of its own, checked with `ip` (iproute2), which reads the same state by
//! its own code: a veth interface stands for the IPoIB one and a TUN device made by
//! `ipoib_ctl::tun::Tun` for connected mode's. Needs root; elsewhere it skips loudly.

use std::{
    net::Ipv4Addr,
    process::Command,
    time::{Duration, Instant},
};

use ipoib_ctl::{
    rtnl::{AddressMirror, NamedLink, Rtnl},
    tun::Tun,
};
use ipoib_tests::cmlab::{in_netns, run};
use serde_json::Value;

const NS: &str = "rtnl-t";

struct Netns;
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", NS]).output();
    }
}

/// `ip -j ARGS` in the test's namespace, parsed.
fn ip_json(args: &[&str]) -> Value {
    let out = Command::new("ip")
        .args(["-n", NS, "-j"])
        .args(args)
        .output()
        .expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("ip's JSON")
}

fn ip(args: &[&str]) {
    let mut all = vec!["ip", "-n", NS];
    all.extend_from_slice(args);
    run(&all);
}

/// The addresses on `dev` as `ip` lists them: (address/prefix, flags such as
/// "noprefixroute").
fn addrs(dev: &str) -> Vec<(String, Vec<String>)> {
    let v = ip_json(&["addr", "show", "dev", dev]);
    v[0]["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let flags = ["noprefixroute", "permanent"]
                .iter()
                .filter(|f| a.get(**f).is_some_and(|v| v.as_bool() == Some(true)))
                .map(|f| f.to_string())
                .collect();
            (
                format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]),
                flags,
            )
        })
        .collect()
}

fn v4_on(dev: &str) -> Vec<String> {
    addrs(dev)
        .into_iter()
        .map(|(a, _)| a)
        .filter(|a| !a.contains(':'))
        .collect()
}

/// Waits up to 3 s (with the runtime running the mirror meanwhile) for `dev`'s IPv4
/// addresses to be `want`.
async fn wait_v4(dev: &str, want: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let now = v4_on(dev);
        if now == want || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn is_root() -> bool {
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("IPOIB_REQUIRE_BPF").as_deref() != Ok("1"),
        "CI runs as root: this test must run"
    );
    ipoib_tests::loud_skip("netlink", "needs root (a network namespace, /dev/net/tun)");
    false
}

/// A TUN device brought up as connected mode's is (MTU 65520, no IPv6 link-local address),
/// an interface's gso_max_size set, a neighbour found and one not, and the interface's IPv4
/// addresses followed onto the TUN device as /32 without a prefix route: at start, added,
/// removed, and no longer once the mirror is dropped.
#[test]
fn the_daemons_netlink_changes_are_what_ip_shows() {
    if !is_root() {
        return;
    }
    let _ = Command::new("ip").args(["netns", "del", NS]).output();
    run(&["ip", "netns", "add", NS]);
    let _ns = Netns;
    ip(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
    ip(&["link", "set", "d1", "up"]);
    ip(&["link", "set", "d0", "up"]);
    ip(&["addr", "add", "10.98.0.1/24", "dev", "d0"]);
    ip(&[
        "neigh",
        "add",
        "10.98.0.9",
        "lladdr",
        "02:00:00:00:00:09",
        "dev",
        "d0",
        "nud",
        "permanent",
    ]);

    in_netns(NS, || {
        let tun = Tun::create("ipt%d", true).expect("TUN");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = Rtnl::new().unwrap();
            let d0 = r.link("d0").await.unwrap();
            let t = r.link(tun.name()).await.unwrap();

            r.bring_up_without_ipv6(t.index, 65520).await.unwrap();
            let link = &ip_json(&["-d", "link", "show", "dev", tun.name()])[0];
            assert_eq!(link["mtu"], 65520, "{link}");
            assert!(
                link["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
                "{link}"
            );
            assert_eq!(link["inet6_addr_gen_mode"], "none", "{link}");

            r.set_gso_max_size(d0.index, 65000).await.unwrap();
            assert_eq!(
                ip_json(&["-d", "link", "show", "dev", "d0"])[0]["gso_max_size"],
                65000
            );
            assert_eq!(r.link("d0").await.unwrap().gso_max_size, Some(65000));

            let hw = r.neighbour(d0.index, "10.98.0.9".parse().unwrap()).await;
            assert_eq!(hw.unwrap(), Some(vec![2, 0, 0, 0, 0, 9]));
            let none = r.neighbour(d0.index, "10.98.0.10".parse().unwrap()).await;
            assert_eq!(none.unwrap(), None);

            let (from, to) = (
                NamedLink {
                    index: d0.index,
                    name: "d0".into(),
                },
                NamedLink {
                    index: t.index,
                    name: tun.name().into(),
                },
            );
            let mirror = AddressMirror::start(from, to).await.unwrap();
            assert_eq!(
                addrs(tun.name()),
                vec![(
                    "10.98.0.1/32".to_string(),
                    vec!["noprefixroute".to_string()]
                )]
            );
            let routes = ip_json(&["route", "show", "dev", tun.name()]);
            assert_eq!(
                routes,
                serde_json::json!([]),
                "no route through the TUN device"
            );

            ip(&["addr", "add", "10.98.1.1/24", "dev", "d0"]);
            let now = wait_v4(tun.name(), &["10.98.0.1/32", "10.98.1.1/32"]).await;
            assert_eq!(
                now,
                ["10.98.0.1/32", "10.98.1.1/32"],
                "an address added to d0"
            );
            ip(&["addr", "del", "10.98.0.1/24", "dev", "d0"]);
            let now = wait_v4(tun.name(), &["10.98.1.1/32"]).await;
            assert_eq!(now, ["10.98.1.1/32"], "an address removed from d0");
            assert_eq!(
                r.ipv4_addrs(d0.index).await.unwrap(),
                [Ipv4Addr::new(10, 98, 1, 1)]
            );

            drop(mirror);
            ip(&["addr", "add", "10.98.2.1/24", "dev", "d0"]);
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(
                v4_on(tun.name()),
                ["10.98.1.1/32"],
                "followed after the drop"
            );

            // Removing what is not there, adding what is: no error either way.
            r.del_host_addr(t.index, Ipv4Addr::new(10, 98, 7, 7))
                .await
                .unwrap();
            r.add_host_addr(t.index, Ipv4Addr::new(10, 98, 1, 1))
                .await
                .unwrap();
            let err = r.set_gso_max_size(9999, 65000).await.unwrap_err();
            assert!(err.to_string().contains("link 9999"), "{err}");
        });
    });
}
