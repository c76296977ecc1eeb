//! What the control plane needs to know about a network interface, asked of the kernel in the
//! caller's network namespace (ioctls on a socket; /sys/class/net would show the namespace
//! sysfs was mounted in, which under `nsenter --net` is not ours).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use ipoib_common::{ARPHRD_ETHER, ARPHRD_INFINIBAND};

pub const ARPHRD_LOOPBACK: u16 = 772;

#[derive(Debug, thiserror::Error)]
pub enum NetdevError {
    #[error("no interface named `{0}` in this network namespace")]
    NotFound(String),
    #[error("`{0}` is not a valid interface name")]
    BadName(String),
    #[error(
        "{name} is a loopback interface: the datapath attaches to IPoIB (or, in the lab, Ethernet)"
    )]
    Loopback { name: String },
    #[error(
        "{name} has link type {arphrd}: the datapath attaches to IPoIB (ARPHRD_INFINIBAND 32) or, in the lab, Ethernet (ARPHRD_ETHER 1)"
    )]
    Unsupported { name: String, arphrd: u16 },
    #[error("{name} is down: bring it up first (ip link set {name} up)")]
    Down { name: String },
    #[error("querying {name}: {source}")]
    Io {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: io::Error,
    },
}

impl From<crate::rtnl::RtnlError> for NetdevError {
    fn from(e: crate::rtnl::RtnlError) -> Self {
        use crate::rtnl::RtnlError;
        match e {
            RtnlError::NotFound(name) => NetdevError::NotFound(name),
            RtnlError::Netlink { what, source } => NetdevError::Netlink { what, source },
        }
    }
}

impl NetdevError {
    /// Whether retrying cannot help: a name that is wrong or an interface of the wrong kind
    /// (the operator's to fix), not a query that failed or an interface that is down (a
    /// service started at boot may find it not yet up).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            NetdevError::NotFound(_)
                | NetdevError::BadName(_)
                | NetdevError::Loopback { .. }
                | NetdevError::Unsupported { .. }
        )
    }
}

/// One interface as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netdev {
    pub name: String,
    pub ifindex: u32,
    /// ARPHRD_* link type.
    pub arphrd: u16,
    /// IFF_* flags.
    pub flags: u32,
}

/// A socket to ask the kernel about interfaces of this network namespace with.
fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket call; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// ethtool's legacy "get TSO" command (include/uapi/linux/ethtool.h): answers whether any
/// TCP segmentation offload is on.
const ETHTOOL_GTSO: u32 = 0x1e;

/// `struct ethtool_value`.
#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

/// Whether `name` segments TCP in the device (TSO on): its UD path then costs the CPU one
/// send per super-packet, not per datagram. One ioctl (SIOCETHTOOL), as the other questions
/// here: a netlink family for one bit would not be simpler.
pub fn tso_on(name: &str) -> Result<bool, NetdevError> {
    let io_err = |source| NetdevError::Io {
        name: name.to_string(),
        source,
    };
    let sock = ioctl_socket().map_err(io_err)?;
    let mut value = EthtoolValue {
        cmd: ETHTOOL_GTSO,
        data: 0,
    };
    let mut req = ifreq_for(name)?;
    req.ifr_ifru.ifru_data = (&raw mut value).cast();
    // SAFETY: SIOCETHTOOL with ETHTOOL_GTSO writes `data` of the ethtool_value that ifr_data
    // points to, which outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL, &mut req) } < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENODEV) => NetdevError::NotFound(name.to_string()),
            _ => io_err(e),
        });
    }
    Ok(value.data != 0)
}

fn ifreq_for(name: &str) -> Result<libc::ifreq, NetdevError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) || name.contains('/')
    {
        return Err(NetdevError::BadName(name.to_string()));
    }
    // SAFETY: ifreq is plain old data; all zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(req)
}

impl Netdev {
    /// Looks `name` up in the current network namespace.
    pub fn lookup(name: &str) -> Result<Self, NetdevError> {
        let cname = CString::new(name).map_err(|_| NetdevError::BadName(name.to_string()))?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENODEV) | Some(libc::ENXIO) => NetdevError::NotFound(name.to_string()),
                _ if ifreq_for(name).is_err() => NetdevError::BadName(name.to_string()),
                _ => NetdevError::NotFound(name.to_string()),
            });
        }
        let io_err = |source| NetdevError::Io {
            name: name.to_string(),
            source,
        };
        let sock = ioctl_socket().map_err(io_err)?;

        let mut req = ifreq_for(name)?;
        // SAFETY: SIOCGIFHWADDR fills ifr_hwaddr of a valid ifreq.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &mut req) } < 0 {
            return Err(io_err(io::Error::last_os_error()));
        }
        // SAFETY: the kernel wrote the hwaddr member.
        let arphrd = unsafe { req.ifr_ifru.ifru_hwaddr.sa_family };

        let mut req = ifreq_for(name)?;
        // SAFETY: SIOCGIFFLAGS fills ifr_flags of a valid ifreq.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
            return Err(io_err(io::Error::last_os_error()));
        }
        // SAFETY: the kernel wrote the flags member.
        let flags = unsafe { req.ifr_ifru.ifru_flags } as u16 as u32;
        Ok(Self {
            name: name.to_string(),
            ifindex,
            arphrd,
            flags,
        })
    }

    pub fn is_up(&self) -> bool {
        self.flags & libc::IFF_UP as u32 != 0
    }

    pub fn is_loopback(&self) -> bool {
        self.arphrd == ARPHRD_LOOPBACK || self.flags & libc::IFF_LOOPBACK as u32 != 0
    }

    pub fn is_ipoib(&self) -> bool {
        self.arphrd == ARPHRD_INFINIBAND
    }

    /// Checks that the datapath can attach here: IPoIB or Ethernet, not loopback, up.
    pub fn check_attachable(&self) -> Result<(), NetdevError> {
        if self.is_loopback() {
            return Err(NetdevError::Loopback {
                name: self.name.clone(),
            });
        }
        if self.arphrd != ARPHRD_INFINIBAND && self.arphrd != ARPHRD_ETHER {
            return Err(NetdevError::Unsupported {
                name: self.name.clone(),
                arphrd: self.arphrd,
            });
        }
        if !self.is_up() {
            return Err(NetdevError::Down {
                name: self.name.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs against the real kernel: `lo` exists in every network namespace.
    #[test]
    fn loopback_is_found_and_refused() {
        let lo = Netdev::lookup("lo").expect("lo exists");
        assert!(lo.ifindex > 0);
        assert!(lo.is_loopback());
        assert!(matches!(
            lo.check_attachable(),
            Err(NetdevError::Loopback { .. })
        ));
    }

    /// The real kernel again: loopback segments in software at no cost and says TSO is on.
    #[test]
    fn tso_is_read_and_a_missing_interface_is_named() {
        assert!(tso_on("lo").expect("lo answers ETHTOOL_GTSO"));
        assert!(matches!(tso_on("nosuchif0"), Err(NetdevError::NotFound(_))));
        assert!(matches!(tso_on("a/b"), Err(NetdevError::BadName(_))));
    }

    #[test]
    fn missing_and_bad_names() {
        assert!(matches!(
            Netdev::lookup("nosuchif0"),
            Err(NetdevError::NotFound(_))
        ));
        assert!(matches!(
            Netdev::lookup("a/b"),
            Err(NetdevError::NotFound(_) | NetdevError::BadName(_))
        ));
        assert!(matches!(
            Netdev::lookup("waytoolonginterfacename"),
            Err(NetdevError::NotFound(_) | NetdevError::BadName(_))
        ));
    }
}
