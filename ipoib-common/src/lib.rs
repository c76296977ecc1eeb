//! Types shared by the eBPF fast path (`ipoib-ebpf`) and the control plane (`ipoib-ctl`).
//!
//! Every type that crosses the kernel boundary is `#[repr(C)]` with its padding spelled out as
//! named `_pad` fields, so the layout has no implicit holes and both sides agree byte for byte.
//! The layout tests at the bottom pin sizes, alignments and offsets.
//!
//! Enumerations are stored as plain integers in map values (the kernel side cannot validate a
//! Rust enum it reads from a map, and an invalid discriminant would be undefined behaviour);
//! userspace converts them with the `TryFrom` impls behind the `user` feature.
#![cfg_attr(not(test), no_std)]

#[cfg(feature = "user")]
extern crate std;

/// IPoIB hard header: 20-byte pseudo header (destination hardware address) + 4-byte IPoIB header.
pub const IPOIB_HARD_LEN: usize = 24;
/// Length of an IPoIB hardware address: flags byte, 24-bit QPN, 16-byte GID.
pub const IPOIB_HWADDR_LEN: usize = 20;
/// Offset of the GID inside the hardware address.
pub const IPOIB_GID_OFFSET: usize = 4;
/// Flags byte bit: the peer can do connected mode (RC).
pub const IPOIB_FLAG_RC: u8 = 0x80;
/// Ethernet header length, for the veth lab.
pub const ETH_HLEN: usize = 14;

/// `ARPHRD_ETHER`: the lab's veth devices.
pub const ARPHRD_ETHER: u16 = 1;
/// `ARPHRD_INFINIBAND`: a real IPoIB netdev.
pub const ARPHRD_INFINIBAND: u16 = 32;

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86dd;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;
/// ICMPv6 Neighbor Discovery types (RFC 4861): router solicitation .. redirect.
pub const ICMPV6_ND_FIRST: u8 = 133;
pub const ICMPV6_ND_LAST: u8 = 137;

/// Linux' connected-mode MTU (IPOIB_CM_MTU).
pub const IPOIB_CM_MTU: u32 = 65520;

/// The socket mark of packets the CM engine hands back to UD (what it read and cannot send
/// over a connection): egress passes them as they are, never to the CM device again.
pub const UD_MARK: u32 = 0x1b0d_ca7e;

/// Map names, exactly as the eBPF object declares them (at most 15 bytes: BPF_OBJ_NAME_LEN).
pub mod map_names {
    /// `Array<Policy, 1>`: the policy in force.
    pub const POLICY: &str = "ipoib_policy";
    /// `Array<Heartbeat, 1>`: the control plane's liveness stamp, and a stamp of its last
    /// write to the peers map (what keeps the programs' peer cache honest).
    pub const HEARTBEAT: &str = "ipoib_heartbeat";
    /// `HashMap<PeerKey, PeerEntry>`: per-peer state written by the control plane.
    pub const PEERS: &str = "ipoib_peers";
    /// `PerCpuArray<PeerTraffic, MAX_TRAFFIC_PEERS>`: per-peer traffic counted by the fast
    /// path, at the slot the peer's entry names (`PeerEntry::traffic_slot`; slot 0 unused).
    pub const TRAFFIC: &str = "ipoib_slot_traf";
    /// `LruHashMap<PeerKey, PeerTraffic, MAX_UNKNOWN_PEERS>`: traffic of peers with no slot
    /// yet (no entry, or one without a slot), counted apart until the control plane gives
    /// them one; also how it learns of new peers.
    pub const UNKNOWN: &str = "ipoib_unknown";
    /// `PerCpuArray<Counter, REASON_SLOTS>`: packets and bytes per decision reason, as the
    /// programs count them (`[0, REASON_COUNT)`), then as the attachment this one replaced
    /// left them (`[REASON_COUNT, REASON_SLOTS)`, written once, by the control plane).
    pub const REASONS: &str = "ipoib_reasons";

    pub const ALL: [&str; 6] = [POLICY, HEARTBEAT, PEERS, TRAFFIC, UNKNOWN, REASONS];

    /// `PerCpuArray<TickCache, 1>`: what the programs learned from the kernel this jiffy.
    /// Not pinned and not in [`ALL`]: nothing in it outlives the current tick, and the
    /// programs hold it alive themselves.
    pub const TICK: &str = "ipoib_tick";
    /// `PerCpuArray<PeerCacheSlot, PEER_CACHE_SLOTS>`: the programs' cache of peers-map
    /// lookups. Not pinned and not in [`ALL`]: a slot holds only while the heartbeat is
    /// unchanged, and the programs hold it alive themselves.
    pub const PEER_CACHE: &str = "ipoib_peercache";

    /// Maps of earlier layouts, which an attach of this version replaces (with the
    /// programs that use them) when it adopts their pins.
    pub const TRAFFIC_V1: &str = "ipoib_traffic";
}

/// The layout of the maps and programs above. Kept with the pins (`layout` in the attach
/// state): an attach that adopts pins of another layout replaces them.
/// 1: per-peer traffic in an LRU per-CPU hash keyed by address (two hash lookups per packet).
/// 2: per-peer traffic in a per-CPU array at a slot kept in the peer's entry.
pub const LAYOUT: u32 = 2;

/// Program names in the eBPF object.
pub mod prog_names {
    pub const EGRESS: &str = "ipoib_egress";
    /// XDP: native where a driver has it, generic elsewhere.
    pub const INGRESS: &str = "ipoib_ingress";
    /// The same decisions at TC ingress: IPoIB's hook (no native XDP there, and generic XDP
    /// costs 1.5-2x the CPU per byte received; docs/benchmarks.md). 15 bytes: the kernel's
    /// limit for a program's name.
    pub const INGRESS_TC: &str = "ipoib_tcingress";
}

/// Capacity of the peers map (control-plane state per peer).
pub const MAX_PEERS: u32 = 16384;
/// Slots of the per-peer traffic array (slot 0 unused: an entry without a slot has 0).
/// Memory is `MAX_TRAFFIC_PEERS * size_of::<PeerTraffic>() * possible CPUs`.
pub const MAX_TRAFFIC_PEERS: u32 = 8192;
/// Capacity of the map of peers with no traffic slot yet (LRU: one shared copy, not per CPU;
/// a peer stays there for a tick of the control loop at most while slots are free).
pub const MAX_UNKNOWN_PEERS: u32 = 4096;

/// Address family tags in [`PeerKey::family`].
pub const FAMILY_IPV4: u8 = 4;
pub const FAMILY_IPV6: u8 = 6;

/// A peer, identified by its IP address on the IPoIB subnet.
///
/// On IPoIB ingress the source GID/QPN is not in the packet (the driver zeroes the pseudo
/// header), so the IP address is the only identity both directions share.
/// IPv4 addresses sit in the first four bytes of `addr`, the rest zero.
///
/// Aligned to 4 (the map sees 20 bytes either way): the fast path copies keys with five
/// 4-byte moves instead of twenty 1-byte ones.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerKey {
    pub addr: [u8; 16],
    /// [`FAMILY_IPV4`] or [`FAMILY_IPV6`].
    pub family: u8,
    pub _pad: [u8; 3],
}

impl PeerKey {
    /// All zeros: no peer (family 0 is neither IPv4 nor IPv6).
    pub const ZERO: Self = Self {
        addr: [0; 16],
        family: 0,
        _pad: [0; 3],
    };

    #[inline(always)]
    pub const fn v4(a: [u8; 4]) -> Self {
        Self {
            addr: [a[0], a[1], a[2], a[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            family: FAMILY_IPV4,
            _pad: [0; 3],
        }
    }

    /// The key of `family`'s address given as four words in memory order (an IPv4 address
    /// in the first, the rest zero): what [`Self::v4`] and [`Self::v6`] build, in five 4-byte
    /// stores. The fast path builds its keys this way: built field by field, LLVM zeroed the
    /// key's tail and padding with calls to a byte-at-a-time `memset`.
    #[inline(always)]
    pub fn of_words(addr: [u32; 4], family: u8) -> Self {
        let w = [
            addr[0],
            addr[1],
            addr[2],
            addr[3],
            u32::from_ne_bytes([family, 0, 0, 0]),
        ];
        // SAFETY: 20 bytes of plain integers aligned to 4 (the layout test below), so any
        // five words are a PeerKey.
        unsafe { core::mem::transmute::<[u32; 5], Self>(w) }
    }

    /// The five words of the key in memory order ([`Self::of_words`] backwards).
    #[inline(always)]
    pub fn words(&self) -> [u32; 5] {
        // SAFETY: 20 bytes of plain integers aligned to 4 (the layout test below).
        unsafe { core::mem::transmute::<Self, [u32; 5]>(*self) }
    }

    /// Whether two keys are the same, word by word without a branch (a comparison of the
    /// structs would be a call to `memcmp`, which the fast path avoids).
    #[inline(always)]
    pub fn same(&self, other: &Self) -> bool {
        let (a, b) = (self.words(), other.words());
        ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4])) == 0
    }

    /// The key's slot in the fast path's peer cache, `[0, PEER_CACHE_SLOTS)`: the words
    /// folded, then Fibonacci hashing (the top bits of a product with 2^32 / phi), which
    /// gives the 256 addresses of an IPv4 /24 (their last byte varies) 256 different slots.
    #[inline(always)]
    pub fn cache_slot(&self) -> u32 {
        let w = self.words();
        let folded = w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4];
        folded.wrapping_mul(0x9e37_79b1) >> (32 - PEER_CACHE_SLOTS.trailing_zeros())
    }

    #[inline(always)]
    pub const fn v6(addr: [u8; 16]) -> Self {
        Self {
            addr,
            family: FAMILY_IPV6,
            _pad: [0; 3],
        }
    }
}

/// [`PeerEntry::mode`]: the state of our own CM path to the peer.
pub mod peer_mode {
    /// No CM connection: everything goes over UD.
    pub const UD: u8 = 0;
    /// A connection is being set up: still UD.
    pub const CM_PENDING: u8 = 1;
    /// The RC connection is established: big packets are redirected to the CM device.
    pub const CM_UP: u8 = 2;
}

/// [`PeerEntry::mode`] as a type, for the control plane (the eBPF side compares the raw
/// values of [`peer_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PeerMode {
    Ud = peer_mode::UD,
    CmPending = peer_mode::CM_PENDING,
    CmUp = peer_mode::CM_UP,
}

impl From<PeerMode> for u8 {
    fn from(m: PeerMode) -> u8 {
        m as u8
    }
}

impl TryFrom<u8> for PeerMode {
    /// The raw value that is no mode.
    type Error = u8;

    fn try_from(v: u8) -> Result<Self, u8> {
        match v {
            peer_mode::UD => Ok(PeerMode::Ud),
            peer_mode::CM_PENDING => Ok(PeerMode::CmPending),
            peer_mode::CM_UP => Ok(PeerMode::CmUp),
            other => Err(other),
        }
    }
}

/// [`PeerEntry::pin`]: an operator's override for one peer.
pub mod peer_pin {
    /// The policy decides.
    pub const AUTO: u8 = 0;
    /// Always UD, and the kernel's own connected mode is forbidden for this peer.
    pub const UD: u8 = 1;
    /// Always worth CM (the control plane promotes it first); the fast path still needs CM_UP.
    pub const CM: u8 = 2;
    /// Drop what this peer sends us (ingress), counted.
    pub const BLOCK: u8 = 3;
}

/// [`PeerEntry::pin`] as a type: an operator's per-peer override (`set-policy peer=ADDR:PIN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum PeerPin {
    #[default]
    Auto = peer_pin::AUTO,
    Ud = peer_pin::UD,
    Cm = peer_pin::CM,
    Block = peer_pin::BLOCK,
}

impl From<PeerPin> for u8 {
    fn from(p: PeerPin) -> u8 {
        p as u8
    }
}

impl TryFrom<u8> for PeerPin {
    /// The raw value that is no pin.
    type Error = u8;

    fn try_from(v: u8) -> Result<Self, u8> {
        match v {
            peer_pin::AUTO => Ok(PeerPin::Auto),
            peer_pin::UD => Ok(PeerPin::Ud),
            peer_pin::CM => Ok(PeerPin::Cm),
            peer_pin::BLOCK => Ok(PeerPin::Block),
            other => Err(other),
        }
    }
}

impl core::fmt::Display for PeerPin {
    /// As `set-policy` takes it (padded as asked: `status` aligns it in a column).
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.pad(match self {
            PeerPin::Auto => "auto",
            PeerPin::Ud => "ud",
            PeerPin::Cm => "cm",
            PeerPin::Block => "block",
        })
    }
}

/// Control-plane state for one peer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PeerEntry {
    /// One of [`peer_mode`].
    pub mode: u8,
    /// One of [`peer_pin`].
    pub pin: u8,
    pub _pad0: [u8; 2],
    /// ifindex of the CM device (the engine's TUN) packets are redirected to when `CM_UP`.
    pub cm_ifindex: u32,
    /// Bumped by the control plane every time the entry's connection changes.
    pub generation: u32,
    /// The peer's slot in the traffic array; 0: none yet (its traffic is counted in the
    /// unknown map). Given by the control plane; kept by every writer of the entry.
    pub traffic_slot: u32,
}

/// [`Policy::mode`]: the interface-wide mode.
pub mod global_mode {
    /// Hybrid: CM for big packets to peers with a live connection, UD for the rest.
    pub const AUTO: u8 = 0;
    /// UD only: nothing is redirected and the kernel's connected mode is forbidden.
    pub const DATAGRAM: u8 = 1;
    /// Promote every peer that talks (within the memory plan); the fast path behaves as AUTO.
    pub const CONNECTED: u8 = 2;
}

/// The policy in force, one entry in the policy map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// `ARPHRD_INFINIBAND` or `ARPHRD_ETHER`, fixed at attach time from the device.
    /// Zero means "not configured": every packet passes untouched as UD.
    pub link_type: u16,
    /// One of [`global_mode`].
    pub mode: u8,
    /// 1: leave the RC flag in the destination address (the kernel may use its own connected
    /// mode). 0: clear it on unicast UD packets so the kernel driver sends them over UD.
    pub kernel_cm: u8,
    /// Smallest L3 packet (IP header onwards, GSO super-packets whole) worth the CM path.
    pub cm_min_bytes: u32,
    /// The fail-safe: when the heartbeat is older than this, every packet goes UD.
    pub heartbeat_timeout_ns: u64,
    /// TCP port of the CM handshake: its traffic always goes UD (it must not depend on CM).
    pub ctl_port: u16,
    /// 1 when at least one peer is pinned `BLOCK`: only then does ingress drop. The control
    /// plane keeps it in step. (In layout 1 it spared ingress a lookup; since layout 2
    /// ingress looks every source up once anyway, for its traffic slot.)
    pub any_blocked: u8,
    pub _pad: [u8; 5],
}

pub const DEFAULT_CM_MIN_BYTES: u32 = 1024;
pub const DEFAULT_HEARTBEAT_TIMEOUT_NS: u64 = 3_000_000_000;
/// The CM handshake's TCP port (RFC 4755's number, unassigned by IANA for TCP).
pub const DEFAULT_CTL_PORT: u16 = 4755;

impl Policy {
    pub const fn new(link_type: u16) -> Self {
        Self {
            link_type,
            mode: global_mode::AUTO,
            kernel_cm: 0,
            cm_min_bytes: DEFAULT_CM_MIN_BYTES,
            heartbeat_timeout_ns: DEFAULT_HEARTBEAT_TIMEOUT_NS,
            ctl_port: DEFAULT_CTL_PORT,
            any_blocked: 0,
            _pad: [0; 5],
        }
    }
}

/// The control plane's liveness stamp, written every loop iteration; `peers_stamp` changes
/// with every write to the peers map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Heartbeat {
    /// CLOCK_MONOTONIC in ns. The fast path compares it with CLOCK_MONOTONIC_COARSE, the
    /// same clock at a tick's resolution, read once per tick (see [`TickCache`]). Zero: never
    /// written.
    pub monotonic_ns: u64,
    /// pid of the process that wrote it.
    pub writer_pid: u32,
    /// Changed (to a value it did not hold) after every write to the peers map, by the
    /// writer, without touching the other fields: the fast path's per-CPU cache of peer
    /// entries ([`PeerCacheSlot`]) holds only while the heartbeat is the one it was filled
    /// under, so a write takes effect with the next packet. (These bytes were padding before,
    /// always zero: a writer of that version never changes them, and is heard at its next
    /// beat instead, since `monotonic_ns` changes with each.)
    pub peers_stamp: u32,
}

/// Slots of the fast path's per-CPU cache of peer entries ([`PeerCacheSlot`]), a power of
/// two: `PEER_CACHE_SLOTS * size_of::<PeerCacheSlot>()` bytes per possible CPU.
pub const PEER_CACHE_SLOTS: u32 = 256;
const _: () = assert!(PEER_CACHE_SLOTS.is_power_of_two());

/// One slot of the fast path's per-CPU cache of the peers map, at [`PeerKey::cache_slot`]:
/// the answer of the peers map's lookup for `key`, valid while the heartbeat is the one it was
/// filled under (`hb_ns`, `hb_peers_stamp`; every write to the peers map changes it, see
/// [`Heartbeat::peers_stamp`]). A hit costs no hash lookup (the map's hash, bucket walk and key
/// compare are calls, 30 ns of 70-80 per packet on an EPYC with SRSO's return thunks); a
/// miss, or another key in the slot, costs the lookup and fills the slot.
///
/// Each slot also counts what it answered since the programs were loaded (kept across fills):
/// the cache's hit rate on a node, which only its own traffic can tell (`ipoib-ctl status`
/// sums them). A hit adds to a line the packet has just read; a miss was a lookup anyway.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCacheSlot {
    pub hb_ns: u64,
    pub hb_peers_stamp: u32,
    /// One of [`peer_cache`].
    pub state: u32,
    pub key: PeerKey,
    /// The entry when `state` is [`peer_cache::FOUND`], else zeros.
    pub entry: PeerEntry,
    pub _pad: [u8; 4],
    /// Lookups this slot answered.
    pub hits: u64,
    /// Lookups of the key the slot held, under an older heartbeat: a write to the peers map
    /// or a beat since it was filled (what the control plane's writes cost the cache).
    pub misses_stale: u64,
    /// Lookups of a key the slot did not hold: empty, or another peer's (what the cache's
    /// size costs, when peers that share a slot take turns).
    pub misses_other: u64,
}

/// [`PeerCacheSlot::state`].
pub mod peer_cache {
    /// Never filled (all zeros: its key is the zero key, which no packet's address gives).
    pub const EMPTY: u32 = 0;
    /// The peers map had no entry for the key.
    pub const ABSENT: u32 = 1;
    /// The peers map had the entry held.
    pub const FOUND: u32 = 2;
}

/// What one CPU's programs learned from the kernel in the current jiffy, so that they ask
/// it once per tick rather than per packet (both answers cost a helper call: 12-15 ns each
/// of 72-106 per packet on an EPYC with SRSO's return thunks). `jiffies` is read with
/// `bpf_jiffies64`, which the verifier inlines as a load; a new jiffy clears the rest.
/// * `coarse_ns`: CLOCK_MONOTONIC_COARSE as `bpf_ktime_get_coarse_ns` gave it (0: not read
///   yet). That clock moves only on a tick, when jiffies moves; a read that raced the tick's
///   update (jiffies moved, the clock not yet) lags by what that update brought (a tick, or
///   the ticks an idle system skipped) until jiffies moves again.
/// * `live_ifindex`: a device found to exist (0: none yet), the CM device that egress
///   redirects to. A device that dies is redirected to for at most the rest of the tick.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TickCache {
    pub jiffies: u64,
    pub coarse_ns: u64,
    pub live_ifindex: u32,
    pub _pad: [u8; 4],
}

/// Per-peer traffic as the fast path saw it, one copy per CPU.
/// Bytes are L3 bytes (IP header onwards), so both link types count alike.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PeerTraffic {
    pub tx_ud_packets: u64,
    pub tx_ud_bytes: u64,
    pub tx_cm_packets: u64,
    pub tx_cm_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    /// CLOCK_MONOTONIC_COARSE (tick resolution, see [`TickCache`]) at the last packet.
    pub last_seen_ns: u64,
}

impl PeerTraffic {
    /// Sums the per-CPU copies (last_seen is the newest).
    pub fn accumulate(&mut self, o: &Self) {
        self.tx_ud_packets += o.tx_ud_packets;
        self.tx_ud_bytes += o.tx_ud_bytes;
        self.tx_cm_packets += o.tx_cm_packets;
        self.tx_cm_bytes += o.tx_cm_bytes;
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.rx_dropped += o.rx_dropped;
        if o.last_seen_ns > self.last_seen_ns {
            self.last_seen_ns = o.last_seen_ns;
        }
    }
}

/// Packets and L3 bytes (whole frame when no L3 header was found).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Why the fast path did what it did; the index into the reasons map.
///
/// Every packet a program sees is counted under exactly one *decision* reason. `TxRcFlagCleared`
/// is an *action* counted on top of the decision (see [`Reason::is_decision`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    TxUdNoPolicy = 0,
    TxUdMalformed = 1,
    TxUdMulticast = 2,
    TxUdArp = 3,
    TxUdNonIp = 4,
    TxUdNeighborDiscovery = 5,
    TxUdControl = 6,
    TxUdDatagramMode = 7,
    TxUdPinnedUd = 8,
    TxUdHeartbeatStale = 9,
    TxUdNoPeer = 10,
    TxUdPeerNotUp = 11,
    TxUdSmall = 12,
    TxCmRedirect = 13,
    TxRcFlagCleared = 14,
    RxNoPolicy = 15,
    RxMalformed = 16,
    RxNonIp = 17,
    RxPeer = 18,
    RxDropBlocked = 19,
    /// The peer's connection is up but its CM device is gone (the control loop that owned it
    /// died): UD at once, before the heartbeat deadline says so.
    TxUdCmDeviceGone = 20,
}

pub const REASON_COUNT: u32 = 21;
/// Entries of the reasons map: what the programs count, then what was carried over.
pub const REASON_SLOTS: u32 = 2 * REASON_COUNT;

impl Reason {
    pub const ALL: [Reason; REASON_COUNT as usize] = [
        Reason::TxUdNoPolicy,
        Reason::TxUdMalformed,
        Reason::TxUdMulticast,
        Reason::TxUdArp,
        Reason::TxUdNonIp,
        Reason::TxUdNeighborDiscovery,
        Reason::TxUdControl,
        Reason::TxUdDatagramMode,
        Reason::TxUdPinnedUd,
        Reason::TxUdHeartbeatStale,
        Reason::TxUdNoPeer,
        Reason::TxUdPeerNotUp,
        Reason::TxUdSmall,
        Reason::TxCmRedirect,
        Reason::TxRcFlagCleared,
        Reason::RxNoPolicy,
        Reason::RxMalformed,
        Reason::RxNonIp,
        Reason::RxPeer,
        Reason::RxDropBlocked,
        Reason::TxUdCmDeviceGone,
    ];

    /// Stable snake_case name, for status output and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::TxUdNoPolicy => "tx_ud_no_policy",
            Reason::TxUdMalformed => "tx_ud_malformed",
            Reason::TxUdMulticast => "tx_ud_multicast",
            Reason::TxUdArp => "tx_ud_arp",
            Reason::TxUdNonIp => "tx_ud_non_ip",
            Reason::TxUdNeighborDiscovery => "tx_ud_neighbor_discovery",
            Reason::TxUdControl => "tx_ud_control",
            Reason::TxUdDatagramMode => "tx_ud_datagram_mode",
            Reason::TxUdPinnedUd => "tx_ud_pinned_ud",
            Reason::TxUdHeartbeatStale => "tx_ud_heartbeat_stale",
            Reason::TxUdNoPeer => "tx_ud_no_peer",
            Reason::TxUdPeerNotUp => "tx_ud_peer_not_up",
            Reason::TxUdSmall => "tx_ud_small",
            Reason::TxCmRedirect => "tx_cm_redirect",
            Reason::TxRcFlagCleared => "tx_rc_flag_cleared",
            Reason::RxNoPolicy => "rx_no_policy",
            Reason::RxMalformed => "rx_malformed",
            Reason::RxNonIp => "rx_non_ip",
            Reason::RxPeer => "rx_peer",
            Reason::RxDropBlocked => "rx_drop_blocked",
            Reason::TxUdCmDeviceGone => "tx_ud_cm_device_gone",
        }
    }

    /// True for the reasons that are a packet's one decision; false for actions on top of one.
    pub const fn is_decision(self) -> bool {
        !matches!(self, Reason::TxRcFlagCleared)
    }

    /// True for egress (`ipoib_egress`) reasons.
    pub const fn is_egress(self) -> bool {
        !matches!(
            self,
            Reason::RxNoPolicy
                | Reason::RxMalformed
                | Reason::RxNonIp
                | Reason::RxPeer
                | Reason::RxDropBlocked
        )
    }

    pub fn from_index(i: u32) -> Option<Reason> {
        Reason::ALL.get(i as usize).copied()
    }
}

#[cfg(feature = "user")]
mod user {
    use core::net::IpAddr;

    use super::*;

    // SAFETY: all of these are `#[repr(C)]`, contain only integers and byte arrays, and have
    // their padding spelled out as fields, so every bit pattern is valid and none is uninit.
    unsafe impl aya::Pod for PeerKey {}
    unsafe impl aya::Pod for PeerEntry {}
    unsafe impl aya::Pod for Policy {}
    unsafe impl aya::Pod for Heartbeat {}
    unsafe impl aya::Pod for PeerTraffic {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for TickCache {}
    unsafe impl aya::Pod for PeerCacheSlot {}

    impl From<IpAddr> for PeerKey {
        fn from(ip: IpAddr) -> Self {
            match ip {
                IpAddr::V4(v4) => PeerKey::v4(v4.octets()),
                IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                    Some(v4) => PeerKey::v4(v4.octets()),
                    None => PeerKey::v6(v6.octets()),
                },
            }
        }
    }

    impl PeerKey {
        /// The address, or `None` for a key with an unknown family tag.
        pub fn ip(&self) -> Option<IpAddr> {
            match self.family {
                FAMILY_IPV4 => Some(IpAddr::from([
                    self.addr[0],
                    self.addr[1],
                    self.addr[2],
                    self.addr[3],
                ])),
                FAMILY_IPV6 => Some(IpAddr::from(self.addr)),
                _ => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use core::mem::{align_of, offset_of, size_of};

    use super::*;

    /// The kernel side sees exactly these layouts: a change here is a change to the ABI
    /// between the eBPF object and every control plane that adopts its pinned maps.
    #[test]
    fn layouts_are_pinned() {
        assert_eq!((size_of::<PeerKey>(), align_of::<PeerKey>()), (20, 4));
        assert_eq!(offset_of!(PeerKey, family), 16);

        assert_eq!((size_of::<PeerEntry>(), align_of::<PeerEntry>()), (16, 4));
        assert_eq!(offset_of!(PeerEntry, mode), 0);
        assert_eq!(offset_of!(PeerEntry, pin), 1);
        assert_eq!(offset_of!(PeerEntry, cm_ifindex), 4);
        assert_eq!(offset_of!(PeerEntry, generation), 8);
        assert_eq!(offset_of!(PeerEntry, traffic_slot), 12);

        assert_eq!((size_of::<Policy>(), align_of::<Policy>()), (24, 8));
        assert_eq!(offset_of!(Policy, link_type), 0);
        assert_eq!(offset_of!(Policy, mode), 2);
        assert_eq!(offset_of!(Policy, kernel_cm), 3);
        assert_eq!(offset_of!(Policy, cm_min_bytes), 4);
        assert_eq!(offset_of!(Policy, heartbeat_timeout_ns), 8);
        assert_eq!(offset_of!(Policy, ctl_port), 16);
        assert_eq!(offset_of!(Policy, any_blocked), 18);

        assert_eq!((size_of::<Heartbeat>(), align_of::<Heartbeat>()), (16, 8));
        assert_eq!(offset_of!(Heartbeat, writer_pid), 8);

        assert_eq!(
            (size_of::<PeerTraffic>(), align_of::<PeerTraffic>()),
            (64, 8)
        );
        assert_eq!(offset_of!(PeerTraffic, rx_packets), 32);
        assert_eq!(offset_of!(PeerTraffic, last_seen_ns), 56);

        assert_eq!((size_of::<Counter>(), align_of::<Counter>()), (16, 8));
        assert_eq!(size_of::<Reason>(), 4);
    }

    #[test]
    fn peer_modes_round_trip_through_their_raw_values() {
        for m in [PeerMode::Ud, PeerMode::CmPending, PeerMode::CmUp] {
            assert_eq!(PeerMode::try_from(u8::from(m)), Ok(m));
        }
        assert_eq!(u8::from(PeerMode::CmUp), peer_mode::CM_UP);
        assert_eq!(PeerMode::try_from(3), Err(3));
        for p in [PeerPin::Auto, PeerPin::Ud, PeerPin::Cm, PeerPin::Block] {
            assert_eq!(PeerPin::try_from(u8::from(p)), Ok(p));
        }
        assert_eq!(u8::from(PeerPin::Block), peer_pin::BLOCK);
        assert_eq!(PeerPin::try_from(4), Err(4));
        assert_eq!(PeerPin::default(), PeerPin::Auto);
    }

    /// No implicit holes: the sum of the fields' sizes is the struct's size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(16 + 1 + 3, size_of::<PeerKey>());
        assert_eq!(1 + 1 + 2 + 4 + 4 + 4, size_of::<PeerEntry>());
        assert_eq!(2 + 1 + 1 + 4 + 8 + 2 + 1 + 5, size_of::<Policy>());
        assert_eq!(8 + 4 + 4, size_of::<Heartbeat>());
        assert_eq!(offset_of!(Heartbeat, peers_stamp), 12);
        assert_eq!(
            (size_of::<PeerCacheSlot>(), align_of::<PeerCacheSlot>()),
            (8 + 4 + 4 + 20 + 16 + 4 + 3 * 8, 8)
        );
        assert_eq!(offset_of!(PeerCacheSlot, key), 16);
        assert_eq!(offset_of!(PeerCacheSlot, entry), 36);
        assert_eq!(offset_of!(PeerCacheSlot, hits), 56);
        assert_eq!(offset_of!(PeerCacheSlot, misses_other), 72);
        assert_eq!(8 * 8, size_of::<PeerTraffic>());
        assert_eq!(8 + 8, size_of::<Counter>());
        assert_eq!((size_of::<TickCache>(), align_of::<TickCache>()), (24, 8));
        assert_eq!(offset_of!(TickCache, coarse_ns), 8);
        assert_eq!(offset_of!(TickCache, live_ifindex), 16);
    }

    #[test]
    fn map_names_fit_the_kernel() {
        for name in map_names::ALL
            .iter()
            .chain([&map_names::TICK, &map_names::PEER_CACHE])
        {
            assert!(
                name.len() <= 15,
                "{name} is longer than BPF_OBJ_NAME_LEN - 1"
            );
        }
    }

    #[test]
    fn reasons_are_dense_and_named_uniquely() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as u32, i as u32);
            assert_eq!(Reason::from_index(i as u32), Some(*r));
            for other in &Reason::ALL[..i] {
                assert_ne!(other.name(), r.name());
            }
        }
        assert_eq!(Reason::from_index(REASON_COUNT), None);
        assert!(!Reason::TxRcFlagCleared.is_decision());
        assert!(Reason::TxCmRedirect.is_egress());
        assert!(!Reason::RxPeer.is_egress());
        assert!(Reason::TxUdCmDeviceGone.is_egress());
        // Names tell the direction.
        for r in Reason::ALL {
            assert_eq!(r.is_egress(), r.name().starts_with("tx_"), "{}", r.name());
        }
    }

    #[test]
    fn a_key_of_words_is_the_key_of_bytes() {
        let v4 = [10, 0, 0, 7];
        assert_eq!(
            PeerKey::of_words([u32::from_ne_bytes(v4), 0, 0, 0], FAMILY_IPV4),
            PeerKey::v4(v4)
        );
        let v6: [u8; 16] = core::array::from_fn(|i| 0xf0 + i as u8);
        let words: [u32; 4] =
            core::array::from_fn(|i| u32::from_ne_bytes(v6[4 * i..4 * i + 4].try_into().unwrap()));
        assert_eq!(PeerKey::of_words(words, FAMILY_IPV6), PeerKey::v6(v6));
        assert_eq!(PeerKey::of_words([0; 4], 0), PeerKey::ZERO);
    }

    #[test]
    fn keys_are_the_same_only_word_for_word() {
        let a = PeerKey::v4([10, 0, 0, 7]);
        assert!(a.same(&PeerKey::v4([10, 0, 0, 7])));
        assert!(!a.same(&PeerKey::v4([10, 0, 0, 8])));
        assert!(!a.same(&PeerKey::ZERO));
        // The same bytes under another family, and a difference in each word alone.
        let mut v6 = [0u8; 16];
        v6[..4].copy_from_slice(&[10, 0, 0, 7]);
        assert!(!a.same(&PeerKey::v6(v6)));
        for word in 0..4 {
            let mut other = a;
            other.addr[4 * word + 3] ^= 0x80;
            assert!(!a.same(&other), "word {word}");
            assert!(!other.same(&a), "word {word}");
        }
        assert_eq!(a.words(), [u32::from_ne_bytes([10, 0, 0, 7]), 0, 0, 0, 4]);
        // Every word set: each is compared, not just those of an IPv4 key.
        let full = PeerKey::v6([0xa5; 16]);
        assert!(full.same(&PeerKey::v6([0xa5; 16])));
        // Two words that differ by the same bits must not cancel out.
        for (i, j) in [(0, 1), (1, 2), (2, 3), (0, 3)] {
            let mut other = full;
            other.addr[4 * i] ^= 0x01;
            other.addr[4 * j] ^= 0x01;
            assert!(!full.same(&other), "words {i} and {j}");
        }
        let mut other = full;
        other.addr[12] ^= 0x01;
        other.family ^= 0x01;
        assert!(!full.same(&other), "words 3 and 4");
    }

    /// The words are folded without losing a bit: from every address bit set (where a fold
    /// by OR would lose them all) and from none (where one by AND would), flipping any one
    /// bit moves the key to another slot.
    #[test]
    fn every_address_bit_moves_the_cache_slot() {
        for fill in [0xff, 0x00] {
            let base = PeerKey::v6([fill; 16]);
            for byte in 0..16 {
                for bit in 0..8 {
                    let mut k = base;
                    k.addr[byte] ^= 1 << bit;
                    assert_ne!(
                        k.cache_slot(),
                        base.cache_slot(),
                        "{fill:#x}: byte {byte} bit {bit}"
                    );
                }
            }
            // The family counts too: the same bytes as IPv4 and as IPv6 sit apart.
            let mut v4 = base;
            v4.family = FAMILY_IPV4;
            assert_ne!(v4.cache_slot(), base.cache_slot(), "{fill:#x}");
        }
    }

    #[test]
    fn cache_slots_spread_a_subnet_and_stay_in_range() {
        use std::collections::HashSet;
        // Every address of a /24 in a slot of its own.
        let slots: HashSet<u32> = (0..=255u8)
            .map(|b| PeerKey::v4([10, 1, 2, b]).cache_slot())
            .collect();
        assert_eq!(slots.len(), PEER_CACHE_SLOTS as usize);
        // A /16 and IPv6 addresses of a /64 spread over every slot, evenly enough: no slot
        // holds more than four times its share.
        for keys in [
            (0..=u16::MAX)
                .map(|i| PeerKey::v4([10, 9, (i >> 8) as u8, i as u8]))
                .collect::<Vec<_>>(),
            (0..=u16::MAX)
                .map(|i| {
                    let mut a = [0u8; 16];
                    a[..2].copy_from_slice(&[0xfd, 0x00]);
                    a[12..].copy_from_slice(&(i as u32 * 7919).to_be_bytes());
                    PeerKey::v6(a)
                })
                .collect(),
        ] {
            let mut per = vec![0usize; PEER_CACHE_SLOTS as usize];
            for k in &keys {
                per[k.cache_slot() as usize] += 1;
            }
            let share = keys.len() / PEER_CACHE_SLOTS as usize;
            assert!(per.iter().all(|n| *n > 0 && *n <= 4 * share), "{per:?}");
        }
    }

    #[test]
    fn peer_key_v4_is_zero_padded() {
        let k = PeerKey::v4([10, 0, 0, 7]);
        assert_eq!(&k.addr[..4], &[10, 0, 0, 7]);
        assert!(k.addr[4..].iter().all(|b| *b == 0));
        assert_eq!(k.family, FAMILY_IPV4);
    }
}
