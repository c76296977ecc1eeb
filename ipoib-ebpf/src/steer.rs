//! The CM engine's queue steering (TUNSETSTEERINGEBPF on its multi-queue TUN device): a packet
//! the kernel transmits on the TUN device goes to the queue of the engine that holds its
//! destination's connection, as `ipoib_tun_queue` says (filled by that engine as it takes
//! the route). Without it the kernel spreads flows over the queues by their hash, and one
//! peer's flows would reach its connection from several engines. A destination with no entry
//! goes to queue 0 (whichever engine reads it drops it, counted: it has no connection). The
//! kernel takes the result modulo the number of queues.
#![no_std]
#![no_main]

use aya_ebpf::{
    btf_maps::HashMap,
    macros::{btf_map, socket_filter},
    programs::SkBuffContext,
};
use ipoib_common::{MAX_PEERS, PeerKey};

#[btf_map(name = "ipoib_tun_queue")]
static QUEUE_OF_PEER: HashMap<PeerKey, u32, { MAX_PEERS as usize }> = HashMap::new();

/// Offsets of the destination address in an IPv4 and an IPv6 header (the TUN device has no
/// link-layer header: a packet starts with its IP header).
const IPV4_DST: usize = 16;
const IPV6_DST: usize = 24;

#[socket_filter]
pub fn ipoib_tun_steer(ctx: SkBuffContext) -> i64 {
    let key = match ctx.load::<u8>(0).map(|b| b >> 4) {
        Ok(4) => match ctx.load::<[u8; 4]>(IPV4_DST) {
            Ok(a) => PeerKey::v4(a),
            Err(_) => return 0,
        },
        Ok(6) => match ctx.load::<[u8; 16]>(IPV6_DST) {
            Ok(a) => PeerKey::v6(a),
            Err(_) => return 0,
        },
        _ => return 0,
    };
    // SAFETY: the value is copied out at once; the map is never shrunk under it.
    match unsafe { QUEUE_OF_PEER.get(key) } {
        Some(q) => i64::from(*q),
        None => 0,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
