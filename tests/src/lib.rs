//! Test support: exact IPoIB and Ethernet frames, and a harness that runs the real eBPF
//! programs in the running kernel with BPF_PROG_TEST_RUN.

pub mod bench;
pub mod cmlab;
pub mod lab;
pub mod lanes;
pub mod notify;
pub mod pace;
pub mod perftest;
pub mod programs;
pub mod sandbox;
pub mod sim;
pub mod steps;

use std::net::IpAddr;

use aya::programs::{ProgramError, TestRun, TestRunOptions};
use ipoib_common::{
    ARPHRD_ETHER, ARPHRD_INFINIBAND, Counter, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMPV6,
    IPPROTO_TCP, IPPROTO_UDP, PeerKey, PeerTraffic, Policy, Reason,
};
use ipoib_ctl::{clock::monotonic_ns, datapath::Datapath};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// Link framing of a test frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    Ipoib,
    Ether,
}

impl Link {
    pub fn arphrd(self) -> u16 {
        match self {
            Link::Ipoib => ARPHRD_INFINIBAND,
            Link::Ether => ARPHRD_ETHER,
        }
    }
}

/// The 20-byte IPoIB hardware address: flags, 24-bit QPN, 16-byte GID.
pub fn ipoib_hwaddr(flags: u8, qpn: u32, gid: [u8; 16]) -> [u8; 20] {
    let mut a = [0u8; 20];
    a[0] = flags;
    a[1..4].copy_from_slice(&qpn.to_be_bytes()[1..]);
    a[4..].copy_from_slice(&gid);
    a
}

/// A unicast port GID: link-local prefix fe80::/64 and a node GUID.
pub fn unicast_gid(node: u8) -> [u8; 16] {
    [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x00, 0x02, 0xc9, 0x03, 0x00, 0x12, 0x34, node,
    ]
}

/// The IPv4 broadcast GID of P_Key 0xffff: ff12:401b:ffff::ffff:ffff.
pub fn broadcast_gid() -> [u8; 16] {
    [
        0xff, 0x12, 0x40, 0x1b, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff,
    ]
}

/// An IPv4 multicast GID for group 224.0.0.251 (RFC 4391 mapping).
pub fn multicast_gid() -> [u8; 16] {
    [
        0xff, 0x12, 0x40, 0x1b, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0xe0, 0x00, 0x00, 0xfb,
    ]
}

/// L2 header of a frame.
#[derive(Clone, Copy, Debug)]
pub enum L2 {
    /// IPoIB hard header as TC egress sees it: destination hardware address, then the
    /// 4-byte IPoIB header (proto, reserved 0).
    Ipoib { dst: [u8; 20] },
    /// Ethernet: destination MAC (source is fixed).
    Ether { dst: [u8; 6] },
}

impl L2 {
    pub fn link(&self) -> Link {
        match self {
            L2::Ipoib { .. } => Link::Ipoib,
            L2::Ether { .. } => Link::Ether,
        }
    }

    /// Default unicast RC-capable destination (IPoIB) or a unicast MAC (Ethernet).
    pub fn unicast(link: Link) -> L2 {
        match link {
            Link::Ipoib => L2::Ipoib {
                dst: ipoib_hwaddr(0x80, 0x000048, unicast_gid(2)),
            },
            Link::Ether => L2::Ether {
                dst: [0x02, 0, 0, 0, 0, 2],
            },
        }
    }

    pub fn multicast(link: Link) -> L2 {
        match link {
            Link::Ipoib => L2::Ipoib {
                dst: ipoib_hwaddr(0x00, 0xffffff, multicast_gid()),
            },
            Link::Ether => L2::Ether {
                dst: [0x01, 0x00, 0x5e, 0, 0, 0xfb],
            },
        }
    }

    pub fn broadcast(link: Link) -> L2 {
        match link {
            Link::Ipoib => L2::Ipoib {
                dst: ipoib_hwaddr(0x00, 0xffffff, broadcast_gid()),
            },
            Link::Ether => L2::Ether { dst: [0xff; 6] },
        }
    }

    pub fn len(&self) -> usize {
        match self {
            L2::Ipoib { .. } => 24,
            L2::Ether { .. } => 14,
        }
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    fn write(&self, ethertype: u16, out: &mut Vec<u8>) {
        match self {
            L2::Ipoib { dst } => {
                out.extend_from_slice(dst);
                out.extend_from_slice(&ethertype.to_be_bytes());
                out.extend_from_slice(&[0, 0]);
            }
            L2::Ether { dst } => {
                out.extend_from_slice(dst);
                out.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
                out.extend_from_slice(&ethertype.to_be_bytes());
            }
        }
    }
}

/// L4 of a test packet.
#[derive(Clone, Copy, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
    },
    Udp {
        sport: u16,
        dport: u16,
    },
    /// ICMP (v4) or ICMPv6 with this type.
    Icmp {
        ty: u8,
    },
}

impl L4 {
    pub fn header_len(&self) -> usize {
        match self {
            L4::Tcp { .. } => 20,
            L4::Udp { .. } => 8,
            // RFC 4443/792: type, code, checksum; the message body follows.
            L4::Icmp { .. } => 4,
        }
    }
}

/// A whole frame built field by field.
#[derive(Clone, Debug)]
pub struct FrameSpec {
    pub l2: L2,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub l4: L4,
    /// Total L3 length (IP header onwards); the payload fills what headers leave.
    pub l3_len: usize,
}

fn checksum(bytes: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in bytes.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += w as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

impl FrameSpec {
    pub fn tcp(l2: L2, src: &str, dst: &str, l3_len: usize) -> Self {
        Self {
            l2,
            src: src.parse().expect("src ip"),
            dst: dst.parse().expect("dst ip"),
            l4: L4::Tcp {
                sport: 40000,
                dport: 5201,
            },
            l3_len,
        }
    }

    pub fn with_l4(mut self, l4: L4) -> Self {
        self.l4 = l4;
        self
    }

    /// Offset of the end of the L4 header: every shorter truncation is malformed.
    pub fn l4_end(&self) -> usize {
        let ip = if self.dst.is_ipv4() { 20 } else { 40 };
        self.l2.len() + ip + self.l4.header_len()
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.l2.len() + self.l3_len);
        let ethertype = if self.dst.is_ipv4() {
            ETH_P_IP
        } else {
            ETH_P_IPV6
        };
        self.l2.write(ethertype, &mut out);
        let l3_start = out.len();
        let (proto, l4_hdr) = self.l4_bytes();
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut ip = [0u8; 20];
                ip[0] = 0x45;
                ip[2..4].copy_from_slice(&(self.l3_len as u16).to_be_bytes());
                ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
                ip[6] = 0x40; // DF
                ip[8] = 64;
                ip[9] = proto;
                ip[12..16].copy_from_slice(&s.octets());
                ip[16..20].copy_from_slice(&d.octets());
                let c = checksum(&ip);
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                out.extend_from_slice(&ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ip = [0u8; 40];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&((self.l3_len - 40) as u16).to_be_bytes());
                ip[6] = proto;
                ip[7] = if matches!(self.l4, L4::Icmp { ty } if (133..=137).contains(&ty)) {
                    255
                } else {
                    64
                };
                ip[8..24].copy_from_slice(&s.octets());
                ip[24..40].copy_from_slice(&d.octets());
                out.extend_from_slice(&ip);
            }
            _ => panic!("mixed address families"),
        }
        out.extend_from_slice(&l4_hdr);
        let payload = self.l3_len - (out.len() - l3_start);
        out.extend((0..payload).map(|i| (i % 251) as u8));
        out
    }

    fn l4_bytes(&self) -> (u8, Vec<u8>) {
        match self.l4 {
            L4::Tcp { sport, dport } => {
                let mut h = vec![0u8; 20];
                h[0..2].copy_from_slice(&sport.to_be_bytes());
                h[2..4].copy_from_slice(&dport.to_be_bytes());
                h[4..8].copy_from_slice(&1u32.to_be_bytes());
                h[12] = 5 << 4;
                h[13] = 0x18; // PSH|ACK
                h[14..16].copy_from_slice(&65535u16.to_be_bytes());
                (IPPROTO_TCP, h)
            }
            L4::Udp { sport, dport } => {
                let mut h = vec![0u8; 8];
                h[0..2].copy_from_slice(&sport.to_be_bytes());
                h[2..4].copy_from_slice(&dport.to_be_bytes());
                let ip_hdr = if self.dst.is_ipv4() { 20 } else { 40 };
                h[4..6].copy_from_slice(&((self.l3_len - ip_hdr) as u16).to_be_bytes());
                (IPPROTO_UDP, h)
            }
            L4::Icmp { ty } => {
                let h = vec![ty, 0, 0, 0, 0, 1, 0, 1];
                let proto = if self.dst.is_ipv4() {
                    1
                } else {
                    IPPROTO_ICMPV6
                };
                (proto, h)
            }
        }
    }
}

/// An ARP request (IPv4 over the given link), as the kernel would send it.
pub fn arp_frame(l2: L2) -> Vec<u8> {
    let mut out = Vec::new();
    l2.write(ETH_P_ARP, &mut out);
    let (hrd, hln): (u16, u8) = match l2 {
        L2::Ipoib { .. } => (32, 20),
        L2::Ether { .. } => (1, 6),
    };
    out.extend_from_slice(&hrd.to_be_bytes());
    out.extend_from_slice(&ETH_P_IP.to_be_bytes());
    out.push(hln);
    out.push(4);
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend(std::iter::repeat_n(0x11, hln as usize));
    out.extend_from_slice(&[10, 0, 0, 1]);
    out.extend(std::iter::repeat_n(0, hln as usize));
    out.extend_from_slice(&[10, 0, 0, 2]);
    out
}

/// A TCP frame of `len` bytes from this node (10.0.0.1, or fd00::1 to an IPv6 address) to
/// `dst`, as the fast path's egress sees it.
pub fn tcp_to(l2: L2, dst: &str, len: usize) -> Vec<u8> {
    let src = if dst.contains(':') {
        "fd00::1"
    } else {
        "10.0.0.1"
    };
    FrameSpec::tcp(l2, src, dst, len).build()
}

/// A frame of an ethertype the fast path does not handle.
pub fn non_ip_frame(l2: L2, ethertype: u16, len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    l2.write(ethertype, &mut out);
    out.resize(len, 0xab);
    out
}

/// The same frame as egress sees it, rewritten as the IPoIB driver delivers it on receive:
/// the 20-byte pseudo header zeroed.
pub fn as_ingress(frame: &[u8], link: Link) -> Vec<u8> {
    let mut f = frame.to_vec();
    if link == Link::Ipoib {
        let n = f.len().min(20);
        f[..n].fill(0);
    }
    f
}

/// Whether BPF_PROG_TEST_RUN refuses `frame` as input to a TC program (EINVAL), measured on
/// 6.18: it reads the input as Ethernet, and refuses less than an Ethernet header, or an
/// IPv4/IPv6 ethertype (bytes 12..14, whatever our framing) without a whole IP header behind.
/// The program never sees such input from the test harness; a real skb has no such limit.
pub fn test_run_refuses_skb(frame: &[u8]) -> bool {
    if frame.len() < 14 {
        return true;
    }
    match u16::from_be_bytes([frame[12], frame[13]]) {
        ETH_P_IP => frame.len() < 14 + 20,
        ETH_P_IPV6 => frame.len() < 14 + 40,
        _ => false,
    }
}

/// Whether BPF_PROG_TEST_RUN refuses `frame` as input to an XDP program: under 14 bytes.
pub fn test_run_refuses_xdp(frame: &[u8]) -> bool {
    frame.len() < 14
}

/// A small, seeded PRNG (xorshift64*), so random cases repeat exactly.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Whether this is the long run (`cargo xtask vm-test --long`, which sets IPOIB_TEST_LONG=1):
/// a scenario runs its full rounds there, a cheaper sibling of it in the suite.
pub fn long_run() -> bool {
    std::env::var("IPOIB_TEST_LONG").as_deref() == Ok("1")
}

/// Says that a test skipped, where a person sees it: the test harness captures the output of
/// passing tests, so this writes to the process' stderr file itself.
pub fn loud_skip(test: &str, why: &str) {
    use std::io::Write as _;
    let msg = format!("\n!!! SKIPPED {test}: {why}\n");
    match std::fs::OpenOptions::new().write(true).open("/dev/stderr") {
        Ok(mut f) => {
            let _ = f.write_all(msg.as_bytes());
        }
        Err(_) => eprint!("{msg}"),
    }
}

/// Whether a test that needs BPF may run here. Returns the loaded datapath, `None` (after a
/// loud message) only where the machine truly cannot: not root and no CAP_BPF. With
/// `IPOIB_REQUIRE_BPF=1` (set by CI) a missing capability is a failure, not a skip.
pub fn load_or_skip(test: &str) -> Option<Datapath> {
    load_pinned_or_skip(test, None)
}

/// As [`load_or_skip`], with every map pinned under `pin_dir` (an existing bpffs directory)
/// when given.
pub fn load_pinned_or_skip(test: &str, pin_dir: Option<&std::path::Path>) -> Option<Datapath> {
    match Datapath::load_pinned(pin_dir) {
        Ok(dp) => Some(dp),
        Err(e) => {
            bpf_unavailable(test, &format!("loading the datapath failed: {e}"));
            None
        }
    }
}

/// A test that needs BPF found it unavailable (`why`): a failure as root or with
/// `IPOIB_REQUIRE_BPF=1`, else a loud skip.
pub fn bpf_unavailable(test: &str, why: &str) {
    let is_root = unsafe { libc::geteuid() } == 0;
    let required = std::env::var("IPOIB_REQUIRE_BPF").is_ok_and(|v| v == "1");
    if is_root || required {
        panic!("{test}: {why}");
    }
    loud_skip(
        test,
        &format!(
            "this test runs eBPF in the kernel and needs root (or CAP_BPF + CAP_NET_ADMIN); \
             {why}"
        ),
    );
}

/// A loaded datapath configured for one link type, with helpers to run frames through it.
pub struct Harness {
    pub dp: Datapath,
    pub link: Link,
}

/// One test run's result.
#[derive(Debug)]
pub struct Outcome {
    pub retval: u32,
    pub data_out: Vec<u8>,
}

impl Harness {
    pub fn new(dp: Datapath, link: Link) -> Self {
        let mut h = Self { dp, link };
        h.set_policy(Policy::new(link.arphrd()));
        h.beat();
        h
    }

    pub fn set_policy(&mut self, p: Policy) {
        self.dp.maps.set_policy(&p).expect("set policy");
    }

    pub fn policy(&self) -> Policy {
        self.dp.maps.policy().expect("policy")
    }

    pub fn beat(&mut self) {
        self.dp.maps.beat(monotonic_ns()).expect("heartbeat");
    }

    pub fn beat_at(&mut self, ns: u64) {
        self.dp.maps.beat(ns).expect("heartbeat");
    }

    pub fn reasons(&self) -> Vec<Counter> {
        self.dp
            .maps
            .reasons()
            .expect("reasons")
            .into_iter()
            .map(|(_, c)| c)
            .collect()
    }

    pub fn traffic(&self, ip: &str) -> PeerTraffic {
        let key = PeerKey::from(ip.parse::<IpAddr>().expect("ip"));
        self.dp
            .maps
            .traffic_of(&key)
            .expect("traffic")
            .unwrap_or_default()
    }

    /// Runs `ipoib_egress` once on `frame`.
    pub fn egress(&mut self, frame: &[u8]) -> Result<Outcome, ProgramError> {
        let prog = self.dp.egress().expect("egress program");
        run(prog, frame, 1).map(|(o, _)| o)
    }

    /// Runs `ipoib_egress` once on `frame` as if sent by a socket with mark `mark`.
    pub fn egress_marked(&mut self, frame: &[u8], mark: u32) -> Result<Outcome, ProgramError> {
        // `struct __sk_buff` up to its mark (len and pkt_type zero: the kernel fills them).
        let mut ctx = [0u8; 12];
        ctx[8..].copy_from_slice(&mark.to_ne_bytes());
        let prog = self.dp.egress().expect("egress program");
        let mut out = vec![0u8; frame.len() + 256];
        let res = prog.test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            repeat: 1,
            ..Default::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok(Outcome {
            retval: res.return_value,
            data_out: out,
        })
    }

    /// Runs `ipoib_ingress` (XDP) once on `frame`.
    pub fn ingress(&mut self, frame: &[u8]) -> Result<Outcome, ProgramError> {
        let prog = self.dp.ingress().expect("ingress program");
        run(prog, frame, 1).map(|(o, _)| o)
    }

    /// Runs `ipoib_tcingress` (TC ingress, IPoIB's hook) once on `frame`.
    pub fn ingress_tc(&mut self, frame: &[u8]) -> Result<Outcome, ProgramError> {
        let prog = self.dp.ingress_tc().expect("TC ingress program");
        run(prog, frame, 1).map(|(o, _)| o)
    }
}

/// Runs a program `repeat` times on `frame`; returns the outcome and the kernel's mean
/// duration per run.
pub fn run<P>(
    prog: &mut P,
    frame: &[u8],
    repeat: u32,
) -> Result<(Outcome, std::time::Duration), ProgramError>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>,
{
    let mut out = vec![0u8; frame.len() + 256];
    let res = prog.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        repeat,
        ..Default::default()
    })?;
    out.truncate(res.data_size_out as usize);
    Ok((
        Outcome {
            retval: res.return_value,
            data_out: out,
        },
        res.duration,
    ))
}

/// The per-reason difference between two snapshots.
pub fn delta(before: &[Counter], after: &[Counter]) -> Vec<(Reason, u64, u64)> {
    Reason::ALL
        .iter()
        .zip(before.iter().zip(after))
        .filter(|(_, (b, a))| b != a)
        .map(|(r, (b, a))| (*r, a.packets - b.packets, a.bytes - b.bytes))
        .collect()
}

/// Keeps the calling thread on the CPU it runs on now (the fast path's caches are per CPU:
/// runs that must meet what the one before left stay on one).
pub fn pin_to_this_cpu() {
    // SAFETY: plain calls on a zeroed cpu_set_t of this thread.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(
            cpu >= 0,
            "sched_getcpu: {}",
            std::io::Error::last_os_error()
        );
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Three addresses of 10.0.1.0-10.0.16.255 for the fast path's per-CPU peer cache: the first
/// two share a slot (`PeerKey::cache_slot`), the third sits in another.
pub fn cache_slot_neighbours() -> [String; 3] {
    let addr = |i: u32| format!("10.0.{}.{}", 1 + i / 256, i % 256);
    let slot = |i: u32| PeerKey::from(addr(i).parse::<IpAddr>().expect("ip")).cache_slot();
    let same = (1..4096)
        .find(|i| slot(*i) == slot(0))
        .expect("two addresses of 4096 in one of 256 slots");
    let other = (1..4096)
        .find(|i| slot(*i) != slot(0))
        .expect("addresses in more than one slot");
    [addr(0), addr(same), addr(other)]
}
