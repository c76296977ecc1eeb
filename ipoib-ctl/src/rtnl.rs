//! Routing netlink (rtnetlink) in the caller's network namespace: what the daemon reads and
//! changes beyond the ioctls in [`crate::netdev`] (a link's hardware address and
//! gso_max_size, its IPv4 addresses, one neighbour; the TUN device's settings and addresses),
//! through the `rtnetlink` crate rather than an `ip` subprocess per call.
//!
//! An [`Rtnl`] is one netlink socket whose connection runs as a task on the runtime it was
//! made in (and is aborted when it is dropped). [`AddressMirror`] keeps one interface's IPv4
//! addresses on another as they change.

use std::{
    io,
    net::{IpAddr, Ipv4Addr},
};

use futures_util::{StreamExt as _, TryStreamExt as _};
use rtnetlink::{
    Handle, LinkMessageBuilder, LinkUnspec, MulticastGroup,
    packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        address::{AddressAttribute, AddressFlags, AddressMessage},
        link::{AfSpecInet6, AfSpecUnspec, In6AddrGenMode, LinkAttribute, LinkMessage},
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage},
    },
};
use tokio::task::JoinHandle;

/// What a netlink request ends with when it fails.
#[derive(Debug, thiserror::Error)]
pub enum RtnlError {
    #[error("no interface named `{0}` in this network namespace")]
    NotFound(String),
    #[error("{what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// What the kernel says of one link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub index: u32,
    pub name: String,
    /// The hardware address (20 bytes on IPoIB, 6 on Ethernet).
    pub address: Vec<u8>,
    pub mtu: Option<u32>,
    pub gso_max_size: Option<u32>,
}

impl LinkInfo {
    fn from_message(m: LinkMessage) -> Self {
        let mut info = LinkInfo {
            index: m.header.index,
            name: String::new(),
            address: Vec::new(),
            mtu: None,
            gso_max_size: None,
        };
        for a in m.attributes {
            match a {
                LinkAttribute::IfName(n) => info.name = n,
                LinkAttribute::Address(a) => info.address = a,
                LinkAttribute::Mtu(m) => info.mtu = Some(m),
                LinkAttribute::GsoMaxSize(g) => info.gso_max_size = Some(g),
                _ => {}
            }
        }
        info
    }
}

/// The error a request came back with, as an io::Error where the kernel gave an errno.
fn to_io(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io(),
        other => io::Error::other(other.to_string()),
    }
}

fn failed(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> RtnlError {
    move |e| RtnlError::Netlink {
        what: what.into(),
        source: to_io(e),
    }
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

/// The IPv4 address an address message is about (IFA_LOCAL, else IFA_ADDRESS), with its
/// link's index.
fn ipv4_of(m: &AddressMessage) -> Option<(u32, Ipv4Addr)> {
    if m.header.family != AddressFamily::Inet {
        return None;
    }
    let pick = |local: bool| {
        m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(IpAddr::V4(v)) if local => Some(*v),
            AddressAttribute::Address(IpAddr::V4(v)) if !local => Some(*v),
            _ => None,
        })
    };
    Some((m.header.index, pick(true).or_else(|| pick(false))?))
}

/// One netlink socket in this network namespace.
pub struct Rtnl {
    handle: Handle,
    conn: JoinHandle<()>,
}

impl Drop for Rtnl {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Rtnl {
    /// Opens the socket (in this thread's network namespace) and spawns its connection on
    /// the current tokio runtime. Strict checking, so the kernel filters dumps by link.
    pub fn new() -> Result<Self, RtnlError> {
        let (conn, handle, _) =
            rtnetlink::new_connection_with_strict_check().map_err(|source| RtnlError::Netlink {
                what: "opening a netlink socket".into(),
                source,
            })?;
        Ok(Self {
            handle,
            conn: tokio::spawn(conn),
        })
    }

    /// The crate's handle, for requests this module does not wrap.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// `name`'s index, hardware address, MTU and gso_max_size.
    pub async fn link(&self, name: &str) -> Result<LinkInfo, RtnlError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        match links.try_next().await {
            Ok(Some(m)) => Ok(LinkInfo::from_message(m)),
            Ok(None) => Err(RtnlError::NotFound(name.to_string())),
            Err(e) if is_errno(&e, libc::ENODEV) => Err(RtnlError::NotFound(name.to_string())),
            Err(e) => Err(failed(format!("reading link {name}"))(e)),
        }
    }

    /// The IPv4 addresses of link `index`, in the kernel's order (the primary first).
    pub async fn ipv4_addrs(&self, index: u32) -> Result<Vec<Ipv4Addr>, RtnlError> {
        let msgs: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(failed(format!("listing the addresses of link {index}")))?;
        Ok(msgs
            .iter()
            .filter_map(ipv4_of)
            .filter(|(i, _)| *i == index)
            .map(|(_, a)| a)
            .collect())
    }

    /// Adds `addr`/32 to link `index` without a prefix route (so no routing changes); an
    /// address already there is no error.
    pub async fn add_host_addr(&self, index: u32, addr: Ipv4Addr) -> Result<(), RtnlError> {
        let mut req = self.handle.address().add(index, addr.into(), 32);
        req.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
        match req.execute().await {
            Err(e) if !is_errno(&e, libc::EEXIST) => {
                Err(failed(format!("adding {addr}/32 to link {index}"))(e))
            }
            _ => Ok(()),
        }
    }

    /// Removes `addr`/32 from link `index`; an address already gone is no error.
    pub async fn del_host_addr(&self, index: u32, addr: Ipv4Addr) -> Result<(), RtnlError> {
        let mut msg = AddressMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.prefix_len = 32;
        msg.header.index = index;
        msg.attributes.push(AddressAttribute::Local(addr.into()));
        match self.handle.address().del(msg).execute().await {
            Err(e) if !is_errno(&e, libc::EADDRNOTAVAIL) && !is_errno(&e, libc::ENODEV) => {
                Err(failed(format!("removing {addr}/32 from link {index}"))(e))
            }
            _ => Ok(()),
        }
    }

    async fn set_link(&self, msg: LinkMessage, what: String) -> Result<(), RtnlError> {
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(failed(what))
    }

    /// Sets link `index`'s gso_max_size.
    pub async fn set_gso_max_size(&self, index: u32, size: u32) -> Result<(), RtnlError> {
        let msg = LinkMessageBuilder::<LinkUnspec>::new()
            .index(index)
            .append_extra_attribute(LinkAttribute::GsoMaxSize(size))
            .build();
        self.set_link(msg, format!("setting gso_max_size {size} on link {index}"))
            .await
    }

    /// Brings link `index` up with `mtu` and no IPv6 address generation (no link-local
    /// address, so none of the kernel's IPv6 chatter is sent into it). Two requests: in one,
    /// the kernel brings the link up before it applies the mode (seen here: a link-local
    /// address on the TUN device).
    pub async fn bring_up_without_ipv6(&self, index: u32, mtu: u32) -> Result<(), RtnlError> {
        let no_ll =
            LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(
                In6AddrGenMode::None,
            )])]);
        let msg = LinkMessageBuilder::<LinkUnspec>::new()
            .index(index)
            .mtu(mtu)
            .append_extra_attribute(no_ll)
            .build();
        self.set_link(
            msg,
            format!("setting mtu {mtu} and no IPv6 on link {index}"),
        )
        .await?;
        let up = LinkMessageBuilder::<LinkUnspec>::new()
            .index(index)
            .up()
            .build();
        self.set_link(up, format!("bringing link {index} up")).await
    }

    /// The link-layer address the neighbour table holds for `ip` on link `index`, if any.
    /// One RTM_GETNEIGH for that address (hand-built: the crate's request dumps the whole
    /// table, thousands of entries on a big fabric, for each connection setup).
    pub async fn neighbour(&self, index: u32, ip: IpAddr) -> Result<Option<Vec<u8>>, RtnlError> {
        let mut msg = NeighbourMessage::default();
        msg.header.ifindex = index;
        let (family, dst) = match ip {
            IpAddr::V4(v) => (AddressFamily::Inet, NeighbourAddress::Inet(v)),
            IpAddr::V6(v) => (AddressFamily::Inet6, NeighbourAddress::Inet6(v)),
        };
        msg.header.family = family;
        msg.attributes.push(NeighbourAttribute::Destination(dst));
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetNeighbour(msg));
        req.header.flags = NLM_F_REQUEST;
        let what = || format!("looking up neighbour {ip} on link {index}");
        let mut responses = self.handle.clone().request(req).map_err(failed(what()))?;
        while let Some(m) = responses.next().await {
            match m.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n)) => {
                    return Ok(link_layer_address(n));
                }
                NetlinkPayload::Error(e) if e.raw_code() == -libc::ENOENT => return Ok(None),
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    return Err(RtnlError::Netlink {
                        what: what(),
                        source: e.to_io(),
                    });
                }
                _ => {}
            }
        }
        Ok(None)
    }
}

/// The link-layer address of a neighbour entry (20 bytes on IPoIB), if it has one.
fn link_layer_address(n: NeighbourMessage) -> Option<Vec<u8>> {
    n.attributes.into_iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(l) if !l.is_empty() => Some(l),
        _ => None,
    })
}

/// Runs `f` with an [`Rtnl`] on a runtime of its own, for callers that have none (attach's
/// checks, before the daemon's runtime starts).
pub fn blocking<T>(f: impl AsyncFnOnce(&Rtnl) -> Result<T, RtnlError>) -> Result<T, RtnlError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| RtnlError::Netlink {
            what: "starting a runtime for netlink".into(),
            source,
        })?;
    rt.block_on(async {
        let rtnl = Rtnl::new()?;
        f(&rtnl).await
    })
}

/// Keeps link `from`'s IPv4 addresses on link `to` as /32 without a prefix route: those
/// there when made, then each one added or removed, as the kernel announces it. Ends when
/// dropped.
pub struct AddressMirror {
    /// Owns the subscription's [`Rtnl`]: aborted, it drops it, which ends the connection.
    task: JoinHandle<()>,
}

impl Drop for AddressMirror {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A link as the mirror names it in its log: index and name.
#[derive(Debug, Clone)]
pub struct NamedLink {
    pub index: u32,
    pub name: String,
}

impl AddressMirror {
    /// Subscribes to IPv4 address changes first, then copies what `from` has now, so no
    /// change between the two is missed. Must be called inside a tokio runtime.
    pub async fn start(from: NamedLink, to: NamedLink) -> Result<Self, RtnlError> {
        let (conn, handle, mut messages) =
            rtnetlink::new_multicast_connection(&[MulticastGroup::Ipv4Ifaddr]).map_err(
                |source| RtnlError::Netlink {
                    what: "subscribing to address changes".into(),
                    source,
                },
            )?;
        let rtnl = Rtnl {
            handle,
            conn: tokio::spawn(conn),
        };
        for addr in rtnl.ipv4_addrs(from.index).await? {
            rtnl.add_host_addr(to.index, addr).await?;
            tracing::debug!("{}: {addr}/32, as on {}", to.name, from.name);
        }
        let task = tokio::spawn(async move {
            while let Some((m, _)) = messages.next().await {
                let NetlinkPayload::InnerMessage(m) = m.payload else {
                    continue;
                };
                let (added, a) = match &m {
                    RouteNetlinkMessage::NewAddress(a) => (true, a),
                    RouteNetlinkMessage::DelAddress(a) => (false, a),
                    _ => continue,
                };
                let Some((_, addr)) = ipv4_of(a).filter(|(i, _)| *i == from.index) else {
                    continue;
                };
                let r = if added {
                    rtnl.add_host_addr(to.index, addr).await
                } else {
                    rtnl.del_host_addr(to.index, addr).await
                };
                match r {
                    Ok(()) => tracing::info!(
                        "{}: {addr}/32 {}, as on {}",
                        to.name,
                        if added { "added" } else { "removed" },
                        from.name
                    ),
                    Err(e) => tracing::warn!("{}: following {}: {e}", to.name, from.name),
                }
            }
        });
        Ok(Self { task })
    }
}

#[cfg(test)]
mod tests {
    /// An RTM_NEWNEIGH as the kernel sends it for an IPoIB neighbour (ndmsg, NDA_DST,
    /// NDA_LLADDR of 20 bytes, NDA_CACHEINFO), built byte by byte: its address comes out whole
    /// and parses to the peer's GID and UD QPN, the flags left out. The address is a
    /// real ConnectX-3 port's in connected mode (RC flag 0x80; docs/testing.md).
    #[test]
    fn an_ipoib_neighbour_message_gives_its_20_byte_address() {
        const LLADDR: [u8; 20] = [
            0x80, 0x00, 0x0a, 0x80, 0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x00, 0x02, 0xc9, 0x03, 0x00,
            0xa0, 0x00, 0x91,
        ];
        let mut body = vec![
            libc::AF_INET as u8,
            0,
            0,
            0, // family, pad
            7,
            0,
            0,
            0, // ifindex 7 (host order: the test runs little-endian)
            0x02,
            0x00, // NUD_REACHABLE
            0,
            1, // flags, type (RTN_UNICAST)
        ];
        let attr = |t: u16, v: &[u8]| {
            let mut a = ((4 + v.len()) as u16).to_ne_bytes().to_vec();
            a.extend(t.to_ne_bytes());
            a.extend(v);
            a.resize(a.len().next_multiple_of(4), 0);
            a
        };
        body.extend(attr(1, &[10, 0, 0, 2]));
        body.extend(attr(2, &LLADDR));
        body.extend(attr(3, &[0; 16]));
        let mut msg = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend(28u16.to_ne_bytes()); // RTM_NEWNEIGH
        msg.extend(0u16.to_ne_bytes());
        msg.extend([0; 8]);
        msg.extend(body);
        let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&msg).unwrap();
        let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n)) = m.payload else {
            panic!("not a neighbour: {m:?}")
        };
        assert_eq!(n.header.ifindex, 7);
        let l = link_layer_address(n).expect("its link-layer address");
        assert_eq!(l, LLADDR);
        let hw = crate::cm::ipoib_hwaddr(&l).unwrap();
        assert_eq!(hw.ud_qpn, 0xa80);
        assert_eq!(hw.gid[..8], [0xfe, 0x80, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            hw.gid[8..],
            [0x00, 0x02, 0xc9, 0x03, 0x00, 0xa0, 0x00, 0x91]
        );
    }

    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// The real kernel: `lo` exists in every network namespace, with 127.0.0.1, a
    /// gso_max_size, no neighbours; reading needs no privilege.
    #[test]
    fn loopback_as_netlink_tells_it() {
        rt().block_on(async {
            let r = Rtnl::new().unwrap();
            let lo = r.link("lo").await.unwrap();
            assert_eq!(
                lo.index,
                crate::netdev::Netdev::lookup("lo").unwrap().ifindex
            );
            assert_eq!(lo.name, "lo");
            assert_eq!(lo.address, vec![0u8; 6]);
            assert_eq!(lo.mtu, Some(65536));
            assert!(lo.gso_max_size.is_some_and(|g| g >= 65536), "{lo:?}");
            assert_eq!(
                r.ipv4_addrs(lo.index).await.unwrap(),
                vec![Ipv4Addr::LOCALHOST]
            );
            assert_eq!(
                r.neighbour(lo.index, "127.0.0.9".parse().unwrap())
                    .await
                    .unwrap(),
                None
            );
            assert!(matches!(
                r.link("nosuchif0").await,
                Err(RtnlError::NotFound(n)) if n == "nosuchif0"
            ));
        });
    }

    #[test]
    fn blocking_runs_without_a_runtime() {
        let addrs = blocking(async |r| {
            let lo = r.link("lo").await?;
            r.ipv4_addrs(lo.index).await
        })
        .unwrap();
        assert_eq!(addrs, vec![Ipv4Addr::LOCALHOST]);
    }
}
