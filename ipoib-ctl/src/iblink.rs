//! Where an IPoIB interface sits on the fabric, as the kernel's IPoIB driver shows it in
//! sysfs: its HCA, the HCA's port and its partition (P_Key); and the P_Key index its RC QPs
//! take, found as the kernel finds it (`ib_find_pkey`).
//!
//! The layout (drivers/infiniband/ulp/ipoib): an interface the driver made for a port (ib0)
//! has `device` -> the HCA's parent device, whose `infiniband/` names the HCA, and
//! `dev_port` = port - 1 (`dev_id` too, the only one before Linux 3.15). A P_Key child
//! (ib0.8001, from `create_child` or `ip link add ... type ipoib pkey`) has neither; its
//! `parent` names the interface it hangs off. Both have `pkey` ("0x8001"), the full-member
//! bit set.
//!
//! Pure but for reading files under a sysfs root, so the unit tests run it on fixture trees
//! laid out as the kernel lays them out (no machine here has an IPoIB interface).

use std::path::{Path, PathBuf};

/// One IPoIB interface's place on the fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IbLink {
    /// The RDMA device (`mlx5_0`).
    pub device: String,
    /// The HCA port, from 1.
    pub port: u8,
    /// The interface's P_Key, full-member bit as the driver shows it.
    pub pkey: u16,
    /// The interface a P_Key child hangs off; None for the port's own interface.
    pub parent: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{path}: {why}")]
    Sysfs { path: PathBuf, why: String },
    #[error(
        "{iface} is on {device} (sysfs); --cm-device {asked} would set up its connections on \
         another HCA (leave --cm-device out on IPoIB interfaces)"
    )]
    WrongDevice {
        iface: String,
        device: String,
        asked: String,
    },
    #[error(
        "{iface} is on port {port} of {device} (sysfs dev_port); --cm-port {asked} would set up \
         its connections on another port (leave --cm-port out on IPoIB interfaces)"
    )]
    WrongPort {
        iface: String,
        device: String,
        port: u8,
        asked: u8,
    },
    #[error(
        "{iface} is in partition 0x{pkey:04x} (sysfs pkey); --cm-pkey 0x{asked:04x} would set \
         up its connections in another (leave --cm-pkey out on IPoIB interfaces)"
    )]
    WrongPkey {
        iface: String,
        pkey: u16,
        asked: u16,
    },
    #[error(
        "{iface} is in the kernel's connected mode with MTU {mtu}, and the policy says \
         kernel-cm=off: the kernel would drop every packet above {UD_MTU_MAX} bytes to a peer \
         we keep on UD. Leave kernel-cm out (it follows the kernel), or put {iface} in datagram \
         mode (`echo datagram > /sys/class/net/{iface}/mode`)"
    )]
    KernelCm { iface: String, mtu: u32 },
}

/// `iface`'s place on the fabric, read under `sys` (`/sys`); None where it is no IPoIB
/// interface (it has no `pkey`).
pub fn read(sys: &Path, iface: &str) -> Result<Option<IbLink>, LinkError> {
    let net = sys.join("class/net");
    let pkey_path = net.join(iface).join("pkey");
    let Some(text) = read_opt(&pkey_path)? else {
        return Ok(None);
    };
    let pkey =
        parse_u16(&text).ok_or_else(|| bad(&pkey_path, &text, "a P_Key (0x0001..0xffff)"))?;
    let parent_path = net.join(iface).join("parent");
    let parent = read_opt(&parent_path)?.map(|p| p.trim().to_string());
    // An interface name, so the parent's files are read under class/net and nowhere else.
    if let Some(p) = &parent
        && (p.is_empty() || p.len() > 15 || p.contains('/') || p == "." || p == "..")
    {
        return Err(bad(&parent_path, p, "an interface name"));
    }
    let base = net.join(parent.as_deref().unwrap_or(iface));
    let device = hca_of(&base)?;
    let port = port_of(&base)?;
    Ok(Some(IbLink {
        device,
        port,
        pkey,
        parent,
    }))
}

impl IbLink {
    /// Checks what the operator gave (`--cm-device`, `--cm-port`, `--cm-pkey`) against the
    /// interface. P_Keys compare as the fabric does: on their low 15 bits.
    pub fn check(
        &self,
        iface: &str,
        device: Option<&str>,
        port: Option<u8>,
        pkey: Option<u16>,
    ) -> Result<(), LinkError> {
        if let Some(asked) = device.filter(|d| *d != self.device) {
            return Err(LinkError::WrongDevice {
                iface: iface.into(),
                device: self.device.clone(),
                asked: asked.into(),
            });
        }
        if let Some(asked) = port.filter(|p| *p != self.port) {
            return Err(LinkError::WrongPort {
                iface: iface.into(),
                device: self.device.clone(),
                port: self.port,
                asked,
            });
        }
        if let Some(asked) = pkey.filter(|p| p & 0x7fff != self.pkey & 0x7fff) {
            return Err(LinkError::WrongPkey {
                iface: iface.into(),
                pkey: self.pkey,
                asked,
            });
        }
        Ok(())
    }
}

/// The kernel's own IPoIB mode of an interface (`/sys/class/net/IFACE/mode`) and its MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelMode {
    /// "connected": the kernel's connected mode (mlx4; mlx5 with `ipoib_enhanced=0`).
    pub connected: bool,
    pub mtu: u32,
}

/// The largest MTU the kernel's datagram mode carries (a 4096-byte IB MTU less the 4-byte
/// IPoIB header): past it, only the kernel's connected mode moves a packet.
pub const UD_MTU_MAX: u32 = 4092;

/// `iface`'s kernel mode and MTU, read under `sys`; None where the interface has no `mode`
/// (no IPoIB interface).
pub fn kernel_mode(sys: &Path, iface: &str) -> Result<Option<KernelMode>, LinkError> {
    let dir = sys.join("class/net").join(iface);
    let mode_path = dir.join("mode");
    let Some(mode) = read_opt(&mode_path)? else {
        return Ok(None);
    };
    let connected = match mode.trim() {
        "connected" => true,
        "datagram" => false,
        _ => return Err(bad(&mode_path, &mode, "`datagram` or `connected`")),
    };
    let mtu_path = dir.join("mtu");
    let text = read_opt(&mtu_path)?.unwrap_or_default();
    let mtu = text
        .trim()
        .parse()
        .map_err(|_| bad(&mtu_path, &text, "an MTU (decimal)"))?;
    Ok(Some(KernelMode { connected, mtu }))
}

/// What the policy's `kernel-cm` is to be on an interface in `mode`, given what the operator
/// `asked` (None: nothing said), and what that means, for the log and status.
///
/// `kernel-cm=off` clears the connected-mode flag in the addresses the fast path sends to:
/// the kernel then sends every packet for those peers over UD, and drops one above the UD MTU
/// ("packet len too long", an ICMP too-big back). So on an interface in the kernel's
/// connected mode with an MTU above [`UD_MTU_MAX`], `off` would cut every big packet to a
/// peer we keep on UD: unsaid, `kernel-cm` follows the kernel's mode (the kernel's
/// connections carry them, as before the attach); said `off`, the attach is refused.
pub fn kernel_cm_for(
    iface: &str,
    mode: KernelMode,
    asked: Option<bool>,
) -> Result<(bool, String), LinkError> {
    let KernelMode { connected, mtu } = mode;
    match (connected, asked) {
        (false, Some(true)) => Ok((
            true,
            format!(
                "datagram, MTU {mtu}: kernel-cm=on changes nothing (the kernel has no \
                 connections to lend)"
            ),
        )),
        (false, _) => Ok((
            false,
            format!("datagram, MTU {mtu}: every peer we keep on UD rides the kernel's UD"),
        )),
        (true, None | Some(true)) => Ok((
            true,
            format!(
                "connected, MTU {mtu}: kernel-cm=on{}, so peers we keep on UD ride the \
                 kernel's own connections as before",
                if asked.is_none() {
                    " (follows the kernel)"
                } else {
                    ""
                }
            ),
        )),
        (true, Some(false)) if mtu > UD_MTU_MAX => Err(LinkError::KernelCm {
            iface: iface.into(),
            mtu,
        }),
        (true, Some(false)) => Ok((
            false,
            format!(
                "connected, MTU {mtu}: kernel-cm=off as asked (the MTU fits UD, so nothing is \
                 cut)"
            ),
        )),
    }
}

/// The index of `pkey` in a port's P_Key table, as the kernel's `ib_find_pkey` picks it:
/// entries match on the low 15 bits; the first full member (bit 15 set) wins, else the
/// first limited member.
pub fn pkey_index(table: &[u16], pkey: u16) -> Option<u16> {
    let same = |i: &usize| table[*i] & 0x7fff == pkey & 0x7fff;
    let mut matching = (0..table.len()).filter(same);
    let first = matching.clone().next()?;
    let full = matching.find(|i| table[*i] & 0x8000 != 0);
    u16::try_from(full.unwrap_or(first)).ok()
}

/// The HCA under an interface the driver made for a port: `device/infiniband/*`.
fn hca_of(base: &Path) -> Result<String, LinkError> {
    let dir = base.join("device/infiniband");
    let entries = std::fs::read_dir(&dir).map_err(|e| LinkError::Sysfs {
        path: dir.clone(),
        why: e.to_string(),
    })?;
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.into_iter().next().ok_or_else(|| LinkError::Sysfs {
        path: dir,
        why: "no RDMA device in it".into(),
    })
}

/// The port: `dev_port` + 1; where `dev_port` is 0, `dev_id` + 1 (kernels before 3.15 set
/// only `dev_id`; udev's naming reads them the same way).
fn port_of(base: &Path) -> Result<u8, LinkError> {
    let dev_port_path = base.join("dev_port");
    let dev_port = match read_opt(&dev_port_path)? {
        Some(t) => t
            .trim()
            .parse::<u8>()
            .map_err(|_| bad(&dev_port_path, &t, "a port index (decimal)"))?,
        None => 0,
    };
    let dev_id_path = base.join("dev_id");
    let index = match (dev_port, read_opt(&dev_id_path)?) {
        (0, Some(t)) => parse_u16(&t)
            .and_then(|v| u8::try_from(v).ok())
            .ok_or_else(|| bad(&dev_id_path, &t, "a port index (0x..)"))?,
        (p, _) => p,
    };
    index
        .checked_add(1)
        .ok_or_else(|| bad(&dev_port_path, "255", "a port index below 255"))
}

/// "0x8001", "32769" or "0" as sysfs writes them (and as `--cm-pkey` takes them); None for
/// anything else.
pub fn parse_u16(text: &str) -> Option<u16> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(h) => u16::from_str_radix(h, 16).ok(),
        None => t.parse().ok(),
    }
}

fn read_opt(path: &Path) -> Result<Option<String>, LinkError> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LinkError::Sysfs {
            path: path.into(),
            why: e.to_string(),
        }),
    }
}

fn bad(path: &Path, text: &str, want: &str) -> LinkError {
    LinkError::Sysfs {
        path: path.into(),
        why: format!("`{}` is not {want}", text.trim()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A sysfs tree as the kernel lays it out for IPoIB: `class/net/IFACE` entries, the
    /// `device` link into `devices/`, the HCA under the PCI function.
    struct Sysfs(PathBuf);

    impl Drop for Sysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    impl Sysfs {
        fn new() -> Self {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let d = std::env::temp_dir().join(format!("ipoib-sysfs-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Self(d)
        }

        fn root(&self) -> &Path {
            &self.0
        }

        fn write(&self, rel: &str, text: &str) {
            let p = self.root().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }

        /// The interface the driver makes for `port` of `hca` on PCI function `pci`.
        fn port_iface(&self, name: &str, pci: &str, hca: &str, port: u8) {
            let dev = self.root().join(format!("devices/pci0000:00/{pci}"));
            std::fs::create_dir_all(dev.join("infiniband").join(hca)).unwrap();
            let net = self.root().join("class/net").join(name);
            std::fs::create_dir_all(&net).unwrap();
            symlink(&dev, net.join("device")).unwrap();
            self.write(
                &format!("class/net/{name}/dev_port"),
                &format!("{}\n", port - 1),
            );
            self.write(
                &format!("class/net/{name}/dev_id"),
                &format!("{:#x}\n", port - 1),
            );
            self.write(&format!("class/net/{name}/pkey"), "0xffff\n");
        }

        /// A P_Key child of `parent`, as `create_child` makes it (no `device`, no port).
        fn child(&self, parent: &str, pkey: u16) -> String {
            let name = format!("{parent}.{pkey:04x}");
            self.write(&format!("class/net/{name}/parent"), &format!("{parent}\n"));
            self.write(
                &format!("class/net/{name}/pkey"),
                &format!("0x{pkey:04x}\n"),
            );
            self.write(&format!("class/net/{name}/dev_port"), "0\n");
            name
        }
    }

    #[test]
    fn the_kernels_mode_is_read_as_the_driver_writes_it() {
        let fs = Sysfs::new();
        fs.port_iface("ib0", "0000:03:00.0", "mlx4_0", 1);
        fs.write("class/net/ib0/mode", "connected\n");
        fs.write("class/net/ib0/mtu", "65520\n");
        assert_eq!(
            kernel_mode(fs.root(), "ib0").unwrap(),
            Some(KernelMode {
                connected: true,
                mtu: 65520
            })
        );
        let child = fs.child("ib0", 0x8001);
        fs.write(&format!("class/net/{child}/mode"), "datagram\n");
        fs.write(&format!("class/net/{child}/mtu"), "2044\n");
        assert_eq!(
            kernel_mode(fs.root(), &child).unwrap(),
            Some(KernelMode {
                connected: false,
                mtu: 2044
            })
        );
        // Not IPoIB: no mode file.
        fs.write("class/net/eth0/mtu", "1500\n");
        assert_eq!(kernel_mode(fs.root(), "eth0").unwrap(), None);
        // A mode or MTU the driver never writes.
        fs.write("class/net/ib0/mode", "hybrid\n");
        let e = kernel_mode(fs.root(), "ib0").unwrap_err().to_string();
        assert!(
            e.contains("`hybrid` is not `datagram` or `connected`"),
            "{e}"
        );
        fs.write("class/net/ib0/mode", "connected\n");
        fs.write("class/net/ib0/mtu", "big\n");
        let e = kernel_mode(fs.root(), "ib0").unwrap_err().to_string();
        assert!(e.contains("`big` is not an MTU"), "{e}");
    }

    #[test]
    fn kernel_cm_follows_the_kernels_mode_and_off_is_refused_where_it_cuts() {
        let cm = |mtu| KernelMode {
            connected: true,
            mtu,
        };
        let ud = |mtu| KernelMode {
            connected: false,
            mtu,
        };
        // Unsaid: the kernel's mode.
        assert!(kernel_cm_for("ib0", cm(65520), None).unwrap().0);
        assert!(!kernel_cm_for("ib0", ud(4092), None).unwrap().0);
        // Said on: on, either way.
        assert!(kernel_cm_for("ib0", cm(65520), Some(true)).unwrap().0);
        let (on, why) = kernel_cm_for("ib0", ud(2044), Some(true)).unwrap();
        assert!(on && why.contains("changes nothing"), "{why}");
        // Said off: refused where the MTU is past UD's, kept where it fits.
        for mtu in [UD_MTU_MAX + 1, 65520] {
            let e = kernel_cm_for("ib0", cm(mtu), Some(false)).unwrap_err();
            assert!(
                matches!(e, LinkError::KernelCm { mtu: m, .. } if m == mtu),
                "{e}"
            );
            assert!(
                e.to_string()
                    .contains("echo datagram > /sys/class/net/ib0/mode")
            );
        }
        assert!(!kernel_cm_for("ib0", cm(UD_MTU_MAX), Some(false)).unwrap().0);
        assert!(!kernel_cm_for("ib0", ud(2044), Some(false)).unwrap().0);
        let (_, why) = kernel_cm_for("ib0", cm(65520), None).unwrap();
        assert!(
            why.contains("connected, MTU 65520") && why.contains("follows"),
            "{why}"
        );
    }

    #[test]
    fn a_ports_own_interface() {
        let s = Sysfs::new();
        s.port_iface("ib0", "0000:3b:00.0", "mlx4_0", 1);
        s.port_iface("ib1", "0000:3b:00.0", "mlx4_0", 2);
        let ib1 = read(s.root(), "ib1").unwrap().unwrap();
        assert_eq!(
            ib1,
            IbLink {
                device: "mlx4_0".into(),
                port: 2,
                pkey: 0xffff,
                parent: None
            }
        );
        assert_eq!(read(s.root(), "ib0").unwrap().unwrap().port, 1);
    }

    #[test]
    fn a_pkey_child_takes_its_parents_hca_and_port() {
        let s = Sysfs::new();
        s.port_iface("ib0", "0000:3b:00.0", "mlx5_0", 1);
        s.port_iface("ib1", "0000:3b:00.1", "mlx5_1", 1);
        let child = s.child("ib1", 0x8001);
        let link = read(s.root(), &child).unwrap().unwrap();
        assert_eq!(
            link,
            IbLink {
                device: "mlx5_1".into(),
                port: 1,
                pkey: 0x8001,
                parent: Some("ib1".into())
            }
        );
    }

    /// A `parent` that is no interface name (a path) is refused, not followed out of
    /// class/net (the fuzz target checks this of every tree it makes).
    #[test]
    fn a_parent_that_is_no_interface_name_is_refused() {
        let s = Sysfs::new();
        s.port_iface("ib0", "0000:3b:00.0", "mlx5_0", 1);
        let child = s.child("ib0", 0x8001);
        for parent in ["ib0/", "..", ".", "", "../net/ib0", "abcdefghijklmnop"] {
            s.write(&format!("class/net/{child}/parent"), &format!("{parent}\n"));
            let e = read(s.root(), &child).unwrap_err().to_string();
            assert!(e.contains("is not an interface name"), "{parent:?}: {e}");
        }
        s.write(&format!("class/net/{child}/parent"), "abcdefghijklmno\n");
        assert!(
            matches!(read(s.root(), &child), Err(LinkError::Sysfs { path, .. }) if path.ends_with("device/infiniband"))
        );
    }

    #[test]
    fn an_old_kernel_shows_the_port_in_dev_id_only() {
        let s = Sysfs::new();
        s.port_iface("ib1", "0000:3b:00.0", "mlx4_0", 2);
        std::fs::remove_file(s.root().join("class/net/ib1/dev_port")).unwrap();
        assert_eq!(read(s.root(), "ib1").unwrap().unwrap().port, 2);
        s.write("class/net/ib1/dev_port", "0\n");
        assert_eq!(read(s.root(), "ib1").unwrap().unwrap().port, 2);
    }

    #[test]
    fn not_ipoib_is_none_and_a_broken_tree_is_an_error() {
        let s = Sysfs::new();
        s.write("class/net/eth0/dev_port", "0\n");
        assert_eq!(read(s.root(), "eth0").unwrap(), None);
        assert_eq!(read(s.root(), "nosuch").unwrap(), None);
        s.write("class/net/ib9/pkey", "0xffff\n");
        let e = read(s.root(), "ib9").unwrap_err().to_string();
        assert!(e.contains("ib9/device/infiniband"), "{e}");
        s.port_iface("ib0", "0000:3b:00.0", "mlx5_0", 1);
        s.write("class/net/ib0/pkey", "banana\n");
        let e = read(s.root(), "ib0").unwrap_err().to_string();
        assert!(e.contains("`banana` is not a P_Key"), "{e}");
        // A file that is there but cannot be read is an error, not "no such interface".
        std::fs::create_dir_all(s.root().join("class/net/ib7/pkey")).unwrap();
        let e = read(s.root(), "ib7").unwrap_err().to_string();
        assert!(e.contains("ib7/pkey"), "{e}");
        s.write("class/net/ib0/pkey", "0x8001\n");
        s.write("class/net/ib0/dev_port", "300\n");
        let e = read(s.root(), "ib0").unwrap_err().to_string();
        assert!(e.contains("`300` is not a port index"), "{e}");
    }

    #[test]
    fn pkey_index_follows_ib_find_pkey() {
        // The default partition at 0, as every subnet manager puts it.
        assert_eq!(pkey_index(&[0xffff], 0xffff), Some(0));
        // Matching is on the low 15 bits: a limited member of the default partition.
        assert_eq!(pkey_index(&[0xffff], 0x7fff), Some(0));
        // A full member wins over an earlier limited one...
        let t = [0xffff, 0x0001, 0x8002, 0x8001];
        assert_eq!(pkey_index(&t, 0x8001), Some(3));
        assert_eq!(pkey_index(&t, 0x0001), Some(3));
        // ...else the first limited one.
        assert_eq!(pkey_index(&[0xffff, 0, 0x0005, 0x0005], 0x8005), Some(2));
        // The first of two full members.
        assert_eq!(pkey_index(&[0x8003, 0x8003], 0x8003), Some(0));
        // Not in the table, and the empty table.
        assert_eq!(pkey_index(&t, 0x8004), None);
        assert_eq!(pkey_index(&[], 0xffff), None);
    }

    #[test]
    fn what_the_operator_gave_is_checked_against_the_interface() {
        let link = IbLink {
            device: "mlx5_1".into(),
            port: 1,
            pkey: 0x8001,
            parent: Some("ib1".into()),
        };
        assert!(link.check("ib1.8001", None, None, None).is_ok());
        assert!(
            link.check("ib1.8001", Some("mlx5_1"), Some(1), Some(0x0001))
                .is_ok()
        );
        let e = link
            .check("ib1.8001", Some("mlx5_0"), None, None)
            .unwrap_err();
        assert!(matches!(e, LinkError::WrongDevice { .. }), "{e}");
        let e = link.check("ib1.8001", None, Some(2), None).unwrap_err();
        assert!(
            e.to_string().contains("ib1.8001 is on port 1 of mlx5_1"),
            "{e}"
        );
        let e = link
            .check("ib1.8001", None, None, Some(0x8002))
            .unwrap_err();
        assert!(
            matches!(e, LinkError::WrongPkey { asked: 0x8002, .. }),
            "{e}"
        );
    }
}
