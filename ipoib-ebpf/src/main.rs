//! The fast path: per-packet mode selection on the IPoIB netdev.
//!
//! * `ipoib_egress` (TC classifier, egress): big unicast IP packets to a peer whose CM
//!   connection is up are redirected to the CM device; everything else goes UD, untouched but
//!   for the RC flag of the destination address when the kernel's own connected mode is
//!   forbidden.
//! * `ipoib_ingress` (XDP, where a driver has it) and its twin `ipoib_tcingress` (TC ingress,
//!   on IPoIB): read-only accounting per source peer, and a drop only for peers the policy
//!   blocks. Both see the frame from its link header and decide alike ([`ingress`]).
//!
//! Every packet is counted under exactly one decision reason. Unknown, truncated or malformed
//! frames pass as UD; nothing is dropped on egress.
#![no_std]
#![no_main]

mod parse;

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    helpers::{bpf_check_mtu, bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_redirect},
    macros::{btf_map, classifier, xdp},
    programs::{TcContext, XdpContext},
};
use ipoib_common::{
    Counter, Heartbeat, IPOIB_FLAG_RC, MAX_PEERS, MAX_TRAFFIC_PEERS, MAX_UNKNOWN_PEERS,
    PEER_CACHE_SLOTS, PeerCacheSlot, PeerEntry, PeerKey, PeerTraffic, Policy, REASON_SLOTS, Reason,
    TickCache, UD_MARK, global_mode, peer_cache, peer_mode, peer_pin,
};
use parse::{Frame, PARSE_MAX, ParseError, key_at, parse};

#[btf_map(name = "ipoib_policy")]
static POLICY: Array<Policy, 1> = Array::new();

#[btf_map(name = "ipoib_heartbeat")]
static HEARTBEAT: Array<Heartbeat, 1> = Array::new();

#[btf_map(name = "ipoib_peers")]
static PEERS: HashMap<PeerKey, PeerEntry, { MAX_PEERS as usize }> = HashMap::new();

#[btf_map(name = "ipoib_slot_traf")]
static TRAFFIC: PerCpuArray<PeerTraffic, { MAX_TRAFFIC_PEERS as usize }> = PerCpuArray::new();

#[btf_map(name = "ipoib_unknown")]
static UNKNOWN: LruHashMap<PeerKey, PeerTraffic, { MAX_UNKNOWN_PEERS as usize }> =
    LruHashMap::new();

#[btf_map(name = "ipoib_reasons")]
static REASONS: PerCpuArray<Counter, { REASON_SLOTS as usize }> = PerCpuArray::new();

#[btf_map(name = "ipoib_tick")]
static TICK: PerCpuArray<TickCache, 1> = PerCpuArray::new();

#[btf_map(name = "ipoib_peercache")]
static PEER_CACHE: PerCpuArray<PeerCacheSlot, { PEER_CACHE_SLOTS as usize }> = PerCpuArray::new();

/// This CPU's cache for the current jiffy (see [`TickCache`]), cleared when jiffies moved.
#[inline(always)]
fn tick() -> Option<*mut TickCache> {
    // SAFETY: no arguments; the verifier turns it into a load of jiffies_64.
    let jiffies = unsafe { bpf_jiffies64() };
    let c = TICK.get_ptr_mut(0)?;
    // SAFETY: this CPU's copy; see `count`.
    unsafe {
        if (*c).jiffies != jiffies {
            // Field by field: a whole struct assigned compiles to a call to memset.
            (*c).jiffies = jiffies;
            (*c).coarse_ns = 0;
            (*c).live_ifindex = 0;
        }
    }
    Some(c)
}

/// CLOCK_MONOTONIC_COARSE in ns, asked of the kernel once per jiffy on each CPU (`tick`, from
/// [`tick`]): a tick's resolution is plenty for last-seen times and a deadline of seconds.
#[inline(always)]
fn coarse_now(tick: Option<*mut TickCache>) -> u64 {
    let Some(c) = tick else {
        // SAFETY: no arguments.
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    // SAFETY: this CPU's copy; see `count`.
    unsafe {
        if (*c).coarse_ns == 0 {
            (*c).coarse_ns = bpf_ktime_get_coarse_ns();
        }
        (*c).coarse_ns
    }
}

#[inline(always)]
fn count(reason: Reason, bytes: u64) {
    if let Some(c) = REASONS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot of a preallocated array; programs do not migrate CPUs mid-run.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes;
        }
    }
}

/// Where the traffic of a peer is counted: this CPU's copy of its slot (`slot`, from its
/// entry: found without a second hash lookup); else, for a peer with no slot yet, its entry
/// in the unknown map under its key (built by `key` only then: one shared copy, where
/// counts from CPUs at once may be lost, which only delays the peer's first tick by that
/// much), created on first sight.
#[inline(always)]
fn traffic(slot: u32, key: impl Fn() -> PeerKey) -> Option<*mut PeerTraffic> {
    if slot != 0 {
        return TRAFFIC.get_ptr_mut(slot);
    }
    let key = &key();
    if let Some(t) = UNKNOWN.get_ptr_mut(key) {
        return Some(t);
    }
    // Another CPU may insert concurrently: NOEXIST makes that harmless.
    let _ = UNKNOWN.insert(key, PeerTraffic::default(), BPF_NOEXIST as u64);
    UNKNOWN.get_ptr_mut(key)
}

/// What the one lookup found of a peer: a copy of its entry (no map pointer is kept across
/// the program), all zeros where there is none. Not an `Option<PeerEntry>`: the payload of
/// its `None` is undefined, and the verifier refuses code that reads or spills undefined
/// registers (seen: "R3 !read_ok", "invalid size of register spill").
#[derive(Clone, Copy)]
struct Peer {
    found: bool,
    entry: PeerEntry,
}

impl Peer {
    const NONE: Self = Self {
        found: false,
        entry: PeerEntry {
            mode: 0,
            pin: 0,
            _pad0: [0; 2],
            cm_ifindex: 0,
            generation: 0,
            traffic_slot: 0,
        },
    };

    /// The peers map's answer for `key`: from this CPU's cache when its slot holds that key
    /// under the heartbeat `hb` (a read of an inlined array, no hash lookup), else the
    /// lookup, which fills the slot. Every write to the peers map changes the heartbeat
    /// ([`Heartbeat::peers_stamp`]), so a slot never outlives the entry it copied.
    #[inline(always)]
    fn of(key: &PeerKey, hb: Option<&Heartbeat>) -> Self {
        let (Some(hb), Some(s)) = (hb, PEER_CACHE.get_ptr_mut(key.cache_slot())) else {
            return Self::lookup(key);
        };
        // The heartbeat as it is now, read once, before the lookup: the control plane may
        // write it at any time, and a slot filled with what the lookup found must carry the
        // heartbeat from before the lookup (at worst an older one, which the next packet
        // misses), never one a later write to the peers map left (that would keep an entry
        // older than the write until the next beat). No barrier: x86 keeps loads in order,
        // and elsewhere a reordered pair would have to straddle the writer's two syscalls
        // (the entry, then the stamp), microseconds apart, not a CPU's reordering window.
        // SAFETY: a map value; plain loads of aligned integers.
        let (hb_ns, hb_stamp) = unsafe {
            (
                core::ptr::read_volatile(&hb.monotonic_ns),
                core::ptr::read_volatile(&hb.peers_stamp),
            )
        };
        // SAFETY: this CPU's slot; see `count`.
        unsafe {
            // An empty slot (zeros) is not asked about: it matches only the zero key (no
            // address) under a heartbeat never written, and then answers "absent", as the
            // map would.
            let held = (*s).key.same(key);
            if held && (*s).hb_ns == hb_ns && (*s).hb_peers_stamp == hb_stamp {
                (*s).hits = (*s).hits.wrapping_add(1);
                return Self {
                    found: (*s).state == peer_cache::FOUND,
                    entry: (*s).entry,
                };
            }
            if held {
                (*s).misses_stale = (*s).misses_stale.wrapping_add(1);
            } else {
                (*s).misses_other = (*s).misses_other.wrapping_add(1);
            }
            let peer = Self::lookup(key);
            (*s).hb_ns = hb_ns;
            (*s).hb_peers_stamp = hb_stamp;
            (*s).state = if peer.found {
                peer_cache::FOUND
            } else {
                peer_cache::ABSENT
            };
            (*s).key = *key;
            (*s).entry = peer.entry;
            peer
        }
    }

    /// The one hash lookup.
    #[inline(always)]
    fn lookup(key: &PeerKey) -> Self {
        match PEERS.get_ptr(key) {
            // SAFETY: a map value the control plane replaces whole; read once.
            Some(p) => Self {
                found: true,
                entry: unsafe { *p },
            },
            None => Self::NONE,
        }
    }
}

#[classifier]
pub fn ipoib_egress(ctx: TcContext) -> i32 {
    egress(&ctx)
}

/// What egress decided for one packet.
struct Verdict {
    reason: Reason,
    /// ifindex of the CM device, when `reason` is `TxCmRedirect`.
    cm_ifindex: u32,
    /// The kernel's own connected mode must not carry this packet.
    forbid_kernel_cm: bool,
}

impl Verdict {
    const fn ud(reason: Reason, forbid_kernel_cm: bool) -> Self {
        Self {
            reason,
            cm_ifindex: 0,
            forbid_kernel_cm,
        }
    }

    /// Whether the packet goes to the CM device: only a redirect names one. The code after
    /// `decide` branches on this, never on the reason: a branch on the reason, a constant on
    /// each path, would have the verifier walk what follows once per reason.
    #[inline(always)]
    fn redirects(&self) -> bool {
        self.cm_ifindex != 0
    }
}

#[inline(always)]
fn egress(ctx: &TcContext) -> i32 {
    let len = ctx.len() as usize;
    let Some(policy) = POLICY.get(0) else {
        count(Reason::TxUdNoPolicy, len as u64);
        return TC_ACT_OK;
    };
    if policy.link_type == 0 {
        // Off the hot path: only before the control plane has configured the interface.
        aya_log_ebpf::warn!(ctx, "ipoib_egress: no policy configured, passing as UD");
        count(Reason::TxUdNoPolicy, len as u64);
        return TC_ACT_OK;
    }
    // Headers of locally built packets are linear; pull them in when they are not.
    let want = if len < PARSE_MAX { len } else { PARSE_MAX };
    if ctx.data_end() - ctx.data() < want {
        let _ = ctx.pull_data(want as u32);
    }

    let frame = match parse(
        ctx.data(),
        ctx.data_end(),
        policy.link_type,
        policy.ctl_port,
    ) {
        Ok(f) => f,
        Err(ParseError::Malformed) => {
            count(Reason::TxUdMalformed, len as u64);
            return TC_ACT_OK;
        }
        Err(ParseError::UnknownLink) => {
            count(Reason::TxUdNoPolicy, len as u64);
            return TC_ACT_OK;
        }
    };
    let l3_len = (len - frame.l2_len) as u64;
    // What the CM engine hands back to UD (read from the CM device, and not sendable over its
    // connection): UD as it is, counted by the engine, not here (it was, when redirected).
    // SAFETY: the context's skb is valid for the program's run; `mark` is readable in TC.
    if unsafe { (*ctx.skb.skb).mark } == UD_MARK {
        if kernel_cm_forbidden(policy) {
            keep_off_kernel_cm(ctx, &frame, l3_len);
        }
        return TC_ACT_OK;
    }
    // Read once, and only for unicast IP: the only packets that use them (`decide` answers
    // every other packet before it asks the heartbeat).
    let unicast = frame.unicast();
    let (tick, now, hb) = if unicast {
        let t = tick();
        (t, coarse_now(t), HEARTBEAT.get(0))
    } else {
        (None, 0, None)
    };
    // At most one hash lookup (none when this CPU's cache has the peer): the peer's entry
    // decides its path and names its traffic slot. The key is built where it is used: here,
    // and in `traffic` for a peer with no slot yet. (Built once ahead for every packet, it
    // was zeroed for the packets that are not unicast by a call to a byte-at-a-time memset.)
    let dst = || key_at(ctx.data(), ctx.data_end(), frame.family, frame.dst_at);
    let peer = if unicast {
        Peer::of(&dst(), hb)
    } else {
        Peer::NONE
    };
    let mut verdict = decide(&frame, policy, hb, &peer, l3_len, now);
    if verdict.redirects() && !device_exists(ctx, tick, verdict.cm_ifindex) {
        verdict = Verdict::ud(Reason::TxUdCmDeviceGone, kernel_cm_forbidden(policy));
    }
    count(verdict.reason, l3_len);

    if unicast && let Some(t) = traffic(peer.entry.traffic_slot, dst) {
        // SAFETY: this CPU's slot; see `count`.
        unsafe {
            if verdict.redirects() {
                (*t).tx_cm_packets += 1;
                (*t).tx_cm_bytes += l3_len;
            } else {
                (*t).tx_ud_packets += 1;
                (*t).tx_ud_bytes += l3_len;
            }
            (*t).last_seen_ns = now;
        }
    }

    if verdict.redirects() {
        // The CM device has no L2 header: the kernel pulls ours off itself.
        return unsafe { bpf_redirect(verdict.cm_ifindex, 0) } as i32;
    }
    if verdict.forbid_kernel_cm {
        keep_off_kernel_cm(ctx, &frame, l3_len);
    }
    TC_ACT_OK
}

/// Clears the IPoIB RC flag of a frame that has it, so the kernel's connected mode does not
/// carry it.
#[inline(always)]
fn keep_off_kernel_cm(ctx: &TcContext, frame: &Frame, l3_len: u64) {
    if frame.rc_flag {
        let flags = frame.flags & !IPOIB_FLAG_RC;
        if ctx.store(0, &flags, 0).is_ok() {
            count(Reason::TxRcFlagCleared, l3_len);
        }
    }
}

#[inline(always)]
fn decide(
    frame: &Frame,
    policy: &Policy,
    hb: Option<&Heartbeat>,
    peer: &Peer,
    l3_len: u64,
    now: u64,
) -> Verdict {
    if !frame.ip {
        // Not IP (ARP, or an ethertype we do not handle): the kernel sends it UD itself.
        return Verdict::ud(frame.non_ip_reason(), false);
    }
    if frame.multicast {
        return Verdict::ud(Reason::TxUdMulticast, false);
    }
    let global_forbids = kernel_cm_forbidden(policy);
    if frame.neighbor_discovery {
        return Verdict::ud(Reason::TxUdNeighborDiscovery, true);
    }
    if frame.control {
        return Verdict::ud(Reason::TxUdControl, global_forbids);
    }
    if policy.mode == global_mode::DATAGRAM {
        return Verdict::ud(Reason::TxUdDatagramMode, true);
    }
    let small = l3_len < policy.cm_min_bytes as u64;
    if small && global_forbids {
        // Whatever the peer's state, this packet goes UD with kernel CM forbidden.
        return Verdict::ud(Reason::TxUdSmall, true);
    }
    if !peer.found {
        return Verdict::ud(Reason::TxUdNoPeer, global_forbids);
    }
    let peer = &peer.entry;
    if peer.pin == peer_pin::UD {
        return Verdict::ud(Reason::TxUdPinnedUd, true);
    }
    if peer.mode != peer_mode::CM_UP || peer.cm_ifindex == 0 {
        return Verdict::ud(Reason::TxUdPeerNotUp, global_forbids);
    }
    if small {
        return Verdict::ud(Reason::TxUdSmall, global_forbids);
    }
    if heartbeat_stale(policy, hb, now) {
        return Verdict::ud(Reason::TxUdHeartbeatStale, global_forbids);
    }
    Verdict {
        reason: Reason::TxCmRedirect,
        cm_ifindex: peer.cm_ifindex,
        forbid_kernel_cm: false,
    }
}

/// The kernel's own connected mode must not carry unicast IP, whatever the peer.
#[inline(always)]
fn kernel_cm_forbidden(policy: &Policy) -> bool {
    policy.mode == global_mode::DATAGRAM || policy.kernel_cm == 0
}

/// Whether the device `ifindex` exists (in the packet's namespace). The CM device is the
/// control loop's TUN, which dies with the process: a redirect to it after a crash would drop
/// every packet until the heartbeat deadline. bpf_check_mtu looks the device up by index and
/// answers -ENODEV when there is none (Linux 5.12+; its other answers, about the length, do
/// not matter here). A device found is remembered for the rest of the tick on this CPU
/// (`tick`, from [`tick`]): one that dies is redirected to for at most that long.
#[inline(always)]
fn device_exists(ctx: &TcContext, tick: Option<*mut TickCache>, ifindex: u32) -> bool {
    // SAFETY: this CPU's copy; see `count`.
    if let Some(c) = tick
        && unsafe { (*c).live_ifindex } == ifindex
    {
        return true;
    }
    let mut mtu_len: u32 = 0;
    // SAFETY: the helper reads the skb of this program's context and writes mtu_len.
    let rc = unsafe { bpf_check_mtu(ctx.skb.skb.cast(), ifindex, &mut mtu_len, 0, 0) };
    if rc < 0 {
        return false;
    }
    if let Some(c) = tick {
        // SAFETY: as above.
        unsafe { (*c).live_ifindex = ifindex };
    }
    true
}

/// The fail-safe: a control plane that stopped writing its heartbeat gets no CM traffic.
#[inline(always)]
fn heartbeat_stale(policy: &Policy, hb: Option<&Heartbeat>, now: u64) -> bool {
    let Some(hb) = hb else {
        return true;
    };
    if hb.monotonic_ns == 0 {
        return true;
    }
    now > hb.monotonic_ns && now - hb.monotonic_ns > policy.heartbeat_timeout_ns
}

#[xdp]
pub fn ipoib_ingress(ctx: XdpContext) -> u32 {
    let (data, data_end) = (ctx.data(), ctx.data_end());
    match ingress(data, data_end, data_end - data) {
        Rx::Pass => xdp_action::XDP_PASS,
        Rx::Drop => xdp_action::XDP_DROP,
    }
}

#[classifier]
pub fn ipoib_tcingress(ctx: TcContext) -> i32 {
    let len = ctx.len() as usize;
    // The headers of a received skb may sit in its pages (IPoIB's CM receive fills pages):
    // pull in what the parser reads, as egress does.
    let want = if len < PARSE_MAX { len } else { PARSE_MAX };
    if ctx.data_end() - ctx.data() < want {
        let _ = ctx.pull_data(want as u32);
    }
    match ingress(ctx.data(), ctx.data_end(), len) {
        Rx::Pass => TC_ACT_OK,
        Rx::Drop => TC_ACT_SHOT,
    }
}

/// What ingress does with a packet.
enum Rx {
    Pass,
    Drop,
}

/// The receive decision for the frame at `data..data_end` (from its link header; `len` bytes
/// in all, some maybe beyond `data_end`). Read-only: never writes the packet (generic XDP
/// re-runs eth_type_trans if the first 14 bytes change, which would corrupt an IPoIB frame).
#[inline(always)]
fn ingress(data: usize, data_end: usize, len: usize) -> Rx {
    let Some(policy) = POLICY.get(0) else {
        count(Reason::RxNoPolicy, len as u64);
        return Rx::Pass;
    };
    if policy.link_type == 0 {
        count(Reason::RxNoPolicy, len as u64);
        return Rx::Pass;
    }
    let frame = match parse(data, data_end, policy.link_type, 0) {
        Ok(f) => f,
        Err(ParseError::Malformed) => {
            count(Reason::RxMalformed, len as u64);
            return Rx::Pass;
        }
        Err(ParseError::UnknownLink) => {
            count(Reason::RxNoPolicy, len as u64);
            return Rx::Pass;
        }
    };
    if !frame.ip {
        count(Reason::RxNonIp, len as u64);
        return Rx::Pass;
    }
    let l3_len = (len - frame.l2_len) as u64;
    // At most one hash lookup (see egress), for the block and the traffic slot.
    let src = || key_at(data, data_end, frame.family, frame.src_at);
    let peer = Peer::of(&src(), HEARTBEAT.get(0));
    let blocked = policy.any_blocked != 0 && peer.found && peer.entry.pin == peer_pin::BLOCK;
    if let Some(t) = traffic(peer.entry.traffic_slot, src) {
        // SAFETY: this CPU's slot; see `count`.
        unsafe {
            if blocked {
                (*t).rx_dropped += 1;
            } else {
                (*t).rx_packets += 1;
                (*t).rx_bytes += l3_len;
            }
            (*t).last_seen_ns = coarse_now(tick());
        }
    }
    if blocked {
        count(Reason::RxDropBlocked, l3_len);
        return Rx::Drop;
    }
    count(Reason::RxPeer, l3_len);
    Rx::Pass
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
