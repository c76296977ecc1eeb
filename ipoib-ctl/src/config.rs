//! `attach`'s connected-mode arguments as the operator gives them ([`CmArgs`]), and what
//! they resolve to against the system: where an IPoIB interface sits on the fabric, our UD
//! QPN, and the [`CmOptions`] connected mode runs with. Read before anything changes, so bad
//! input changes nothing.

use std::{path::Path, time::Duration};

use crate::{
    attach::Attached,
    cm::{self, Resolve},
    connmgr::CmOptions,
    iblink::{IbLink, LinkError},
    netdev::{Netdev, NetdevError},
    plan::SrqChoice,
    policy::PolicyChange,
    rtnl,
};

/// Why `attach`'s connected-mode arguments do not resolve.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Netdev(#[from] NetdevError),
    #[error("{iface}: {address:02x?} is no IPoIB hardware address")]
    NotIpoib { iface: String, address: Vec<u8> },
    #[error("{iface} has no IPv4 address for the lab's UD QPN (or --ud-qpn)")]
    NoIpv4 { iface: String },
}

/// Connected mode of `attach`.
#[derive(clap::Args, Debug)]
pub struct CmArgs {
    /// RDMA device for connected mode (default: the HCA under an IPoIB interface; on other
    /// interfaces connected mode needs this).
    #[arg(long, value_name = "DEV")]
    pub cm_device: Option<String>,
    /// Port of the RDMA device (default: an IPoIB interface's own, from sysfs; 1 elsewhere).
    #[arg(long, value_name = "N")]
    pub cm_port: Option<u8>,
    /// P_Key of the partition the RC connections are set up in (default: an IPoIB
    /// interface's own, e.g. 0x8001 on ib0.8001; the default partition elsewhere).
    #[arg(long, value_name = "PKEY", value_parser = parse_pkey)]
    pub cm_pkey: Option<u16>,
    /// Our UD QPN (default: from the IPoIB hardware address; on Ethernet, the lab's stand-in:
    /// 0x100 + the last byte of the interface's IPv4 address).
    #[arg(long, value_name = "QPN", value_parser = parse_qpn)]
    pub ud_qpn: Option<u32>,
    /// Whether connected mode may use the HCA's shared receive queue: `auto` follows the HCA
    /// (an SRQ where it has one, else a receive ring per connection, as many as the memory
    /// budget holds); `off` takes rings per connection on any HCA (for one whose SRQ
    /// misbehaves).
    #[arg(long, value_enum, default_value_t = SrqChoice::Auto, value_name = "WHEN")]
    pub srq: SrqChoice,
    /// The node's receive memory for connected mode, shared by every attached interface of
    /// this network namespace (default: 1/64 of system memory, 64 MiB to 2 GiB; the smallest
    /// any running attach was given holds). 4MiB..1TiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    pub node_memory_budget: Option<u64>,
    /// No connected mode: the fast path only, every peer on UD.
    #[arg(long, conflicts_with = "cm_device")]
    pub no_cm: bool,
    /// Time without traffic over a connection (either way) before it is reaped (30s, 2m, ...;
    /// a bare number is seconds).
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = parse_secs)]
    pub cm_idle_after: f64,
    /// Time a connection lives at least, and a demoted peer waits before promotion again.
    #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = parse_secs)]
    pub cm_min_hold: f64,
    /// Engine lanes: the CM engine's TUN device gets this many queues, each read by an engine
    /// on a thread of its own with a CQ and a share of the send slots, every peer's packets by
    /// the engine of its connection (1: one engine, on the control loop's thread). More than
    /// one pays only with CPUs to spare; see `bench lanes` in docs/benchmarks.md.
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub cm_lanes: u32,
    /// Tests only: break the engine on request (`panic`, `stall`, `hang` or `pause MS` written into
    /// /run/ipoib-ctl/IFACE.fault), or end the handshake listener's task (`listener`), to prove
    /// the control loop catches it; and have each start of connected mode wait the
    /// milliseconds in /run/ipoib-ctl/IFACE.start-delay after the HCA's setup.
    #[arg(long, hide = true)]
    pub test_faults: bool,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    use crate::policy::{MEMORY_BUDGET_MAX, MEMORY_BUDGET_MIN};
    crate::policy::parse_size(s)
        .filter(|b| (MEMORY_BUDGET_MIN..=MEMORY_BUDGET_MAX).contains(b))
        .ok_or_else(|| format!("`{s}`: a size from 4MiB to 1TiB (e.g. 512MiB)"))
}

/// A duration as the policy writes them (`30s`, `500ms`, `2m`, `1h`; a bare number is
/// seconds), in seconds.
fn parse_secs(s: &str) -> Result<f64, String> {
    match crate::policy::parse_duration(s).map(|d| d.as_secs_f64()) {
        Some(v) if (0.1..=86400.0).contains(&v) => Ok(v),
        Some(_) => Err(format!("`{s}`: 100ms to 24h")),
        None => Err(format!(
            "`{s}`: not a duration (30s, 500ms, 2m, 1h; bare: seconds)"
        )),
    }
}

fn parse_pkey(s: &str) -> Result<u16, String> {
    crate::iblink::parse_u16(s)
        .filter(|v| v & 0x7fff != 0)
        .ok_or_else(|| format!("`{s}`: a P_Key is 0x0001..0xffff, not 0x0000 or 0x8000"))
}

fn parse_qpn(s: &str) -> Result<u32, String> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("`{s}`: {e}"))?;
    if !(2..=0xff_ffff).contains(&v) {
        return Err(format!("`{s}`: a QPN is 2..=0xffffff"));
    }
    Ok(v)
}

/// Where an IPoIB interface sits (HCA, port, partition), checked against what the operator
/// gave; None on other interfaces, and where sysfs does not say (a P_Key child moved into a
/// container's namespace, where its parent is not seen): then `--cm-device`, `--cm-port` and
/// `--cm-pkey` hold as given, or every peer stays UD. Read before anything changes, so bad
/// input changes nothing.
pub fn ib_link(iface: &str, dev: &Netdev, args: &CmArgs) -> Result<Option<IbLink>, ConfigError> {
    if args.no_cm || !dev.is_ipoib() {
        return Ok(None);
    }
    let link = match crate::iblink::read(Path::new("/sys"), iface) {
        Ok(Some(link)) => link,
        Ok(None) => return Ok(None),
        Err(e) => {
            tracing::warn!("{iface}: sysfs does not say where it sits on the fabric: {e}");
            return Ok(None);
        }
    };
    link.check(iface, args.cm_device.as_deref(), args.cm_port, args.cm_pkey)?;
    tracing::info!(
        "{iface}: {} port {}, partition 0x{:04x}{}",
        link.device,
        link.port,
        link.pkey,
        link.parent
            .as_deref()
            .map(|p| format!(" (a P_Key child of {p})"))
            .unwrap_or_default()
    );
    Ok(Some(link))
}

/// The policy change `attach` applies on `iface` once the kernel's own IPoIB mode is taken
/// into account ([`crate::iblink::kernel_cm_for`]): `kernel-cm` set to follow it where the
/// operator said nothing and the kernel runs connected mode; refused where the operator said
/// off and that would cut big packets. With what that means, for the log and status (None on
/// other interfaces). Read before anything changes.
pub fn with_kernel_mode(
    iface: &str,
    dev: &Netdev,
    change: Option<&PolicyChange>,
) -> Result<(Option<PolicyChange>, Option<String>), ConfigError> {
    let unchanged = || change.cloned();
    if !dev.is_ipoib() {
        return Ok((unchanged(), None));
    }
    let mode = match crate::iblink::kernel_mode(Path::new("/sys"), iface) {
        Ok(Some(m)) => m,
        Ok(None) => return Ok((unchanged(), None)),
        Err(e) => {
            tracing::warn!("{iface}: the kernel's IPoIB mode is unknown: {e}");
            return Ok((unchanged(), None));
        }
    };
    let asked = change.and_then(|c| c.kernel_cm);
    let (kernel_cm, means) = crate::iblink::kernel_cm_for(iface, mode, asked)?;
    tracing::info!("{iface}: the kernel's IPoIB mode: {means}");
    let mut out = change.cloned().unwrap_or_default();
    if asked.is_none() && kernel_cm {
        out.kernel_cm = Some(true);
        return Ok((Some(out), Some(means)));
    }
    Ok((unchanged(), Some(means)))
}

/// What connected mode runs with on `iface`; None (said why) when it cannot run.
pub fn cm_options(
    iface: &str,
    dev: &Netdev,
    args: &CmArgs,
    link: Option<&IbLink>,
    att: &Attached,
) -> Result<Option<CmOptions>, ConfigError> {
    if args.no_cm {
        return Ok(None);
    }
    let Some(device) = cm_device(args, link) else {
        tracing::info!(
            "no RDMA device under {iface}: every peer on UD (--cm-device DEV to use one)"
        );
        return Ok(None);
    };
    let ud_qpn = match args.ud_qpn {
        Some(q) => q,
        None => own_ud_qpn(iface, dev)?,
    };
    let resolve = if dev.is_ipoib() {
        Resolve::Neighbour {
            ifindex: dev.ifindex,
        }
    } else {
        Resolve::Lab
    };
    let ctl_port = att
        .maps
        .policy()
        .map(|p| p.ctl_port)
        .unwrap_or(ipoib_common::DEFAULT_CTL_PORT);
    Ok(Some(CmOptions {
        device,
        port: cm_port(args, link),
        pkey: cm_pkey(args, link),
        ud_qpn,
        resolve,
        ctl_port,
        memory_budget: att.state.memory_budget,
        node_budget: args.node_memory_budget,
        srq: args.srq,
        send_slots: crate::plan::SEND_SLOTS,
        lanes: args.cm_lanes,
        tick: Duration::from_secs(1),
        status_path: crate::status::cm::status_path(iface),
        promotion: crate::promotion::Config {
            idle_after: Duration::from_secs_f64(args.cm_idle_after),
            min_hold: Duration::from_secs_f64(args.cm_min_hold),
            ..Default::default()
        },
        test_faults: args.test_faults,
    }))
}

/// The HCA port for connected mode: an IPoIB interface's own, else `--cm-port`, else 1.
pub fn cm_port(args: &CmArgs, link: Option<&IbLink>) -> u8 {
    link.map(|l| l.port).or(args.cm_port).unwrap_or(1)
}

/// The partition: an IPoIB interface's own, else `--cm-pkey`, else the default one.
pub fn cm_pkey(args: &CmArgs, link: Option<&IbLink>) -> Option<u16> {
    link.map(|l| l.pkey).or(args.cm_pkey)
}

/// The RDMA device for connected mode: the HCA an IPoIB interface is on, else `--cm-device`.
pub fn cm_device(args: &CmArgs, link: Option<&IbLink>) -> Option<String> {
    link.map(|l| l.device.clone())
        .or_else(|| args.cm_device.clone())
}

/// Our own UD QPN: in the IPoIB hardware address, or the lab's stand-in on Ethernet.
fn own_ud_qpn(iface: &str, dev: &Netdev) -> Result<u32, ConfigError> {
    if dev.is_ipoib() {
        let link = rtnl::blocking(async |r| r.link(iface).await).map_err(NetdevError::from)?;
        let hw = cm::ipoib_hwaddr(&link.address).ok_or_else(|| ConfigError::NotIpoib {
            iface: iface.to_string(),
            address: link.address.clone(),
        })?;
        return Ok(hw.ud_qpn);
    }
    let ip = rtnl::blocking(async |r| r.ipv4_addrs(dev.ifindex).await)
        .map_err(NetdevError::from)?
        .first()
        .copied()
        .ok_or_else(|| ConfigError::NoIpv4 {
            iface: iface.to_string(),
        })?;
    Ok(cm::lab_ud_qpn(ip.into()))
}
