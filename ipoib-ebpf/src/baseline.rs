//! The benchmark's baseline: programs of the same types that do nothing, so a measurement of
//! ours can be read as "N times the cost of merely running a program".
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

#[classifier]
pub fn baseline_tc(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

#[xdp]
pub fn baseline_xdp(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
