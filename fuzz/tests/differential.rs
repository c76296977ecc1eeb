//! The fast path's parse against etherparse on seeded frames built to reach every branch:
//! both framings, IPv4 with options and fragments, IPv6 with an extension header, TCP to and
//! from the handshake port, UDP, ICMPv6 Neighbor Discovery, multicast at L2 and L3, bad
//! versions and header lengths, wrong length fields, and truncation anywhere. The seed is
//! printed, so a failure replays (`IPOIB_PARSE_SEED`).

use ipoib_fuzz::Outcome;
use ipoib_tests::Rng;

/// What the cases are drawn with, on the workspace's seeded generator.
trait Draw {
    fn chance(&mut self, percent: u64) -> bool;
    fn bytes(&mut self, n: usize) -> Vec<u8>;
    fn pick<T: Copy>(&mut self, from: &[T]) -> T;
}

impl Draw for Rng {
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

/// A payload cut short now and then (inside its L4 header), and the length field that goes
/// with it: right most of the time, anything else otherwise.
fn cut_with_length(rng: &mut Rng, mut payload: Vec<u8>, header: usize) -> (Vec<u8>, u16) {
    if rng.chance(8) {
        payload.truncate(rng.below(8) as usize);
    }
    let len = if rng.chance(90) {
        (header + payload.len()) as u16
    } else {
        rng.next_u64() as u16
    };
    (payload, len)
}

fn l4(rng: &mut Rng, proto: u8, v6: bool) -> Vec<u8> {
    let port = |rng: &mut Rng| {
        if rng.chance(30) {
            4755u16
        } else {
            rng.next_u64() as u16
        }
    };
    let mut b = match proto {
        6 => {
            let mut t = rng.bytes(20);
            t[0..2].copy_from_slice(&port(rng).to_be_bytes());
            t[2..4].copy_from_slice(&port(rng).to_be_bytes());
            t[12] = if rng.chance(90) {
                5 << 4
            } else {
                (rng.below(16) as u8) << 4
            };
            t
        }
        17 => {
            let mut u = rng.bytes(8);
            u[0..2].copy_from_slice(&port(rng).to_be_bytes());
            u[2..4].copy_from_slice(&port(rng).to_be_bytes());
            u
        }
        58 => {
            let mut i = rng.bytes(8);
            i[0] = if rng.chance(60) {
                133 + rng.below(5) as u8
            } else {
                rng.next_u64() as u8
            };
            i[1] = 0;
            i
        }
        _ => Vec::new(),
    };
    let n = rng.below(32) as usize;
    b.extend(rng.bytes(n));
    if proto == 17 {
        let len = b.len() as u16;
        b[4..6].copy_from_slice(&len.to_be_bytes());
    }
    let _ = v6;
    b
}

fn ipv4(rng: &mut Rng) -> Vec<u8> {
    let ihl = if rng.chance(80) {
        5
    } else {
        5 + rng.below(11) as usize
    };
    let mut h = rng.bytes(ihl * 4);
    h[0] = if rng.chance(95) {
        0x40
    } else {
        (rng.below(16) as u8) << 4
    } | ihl as u8;
    if rng.chance(3) {
        h[0] = (h[0] & 0xf0) | rng.below(5) as u8;
    }
    let frag: u16 = match rng.below(10) {
        0 => 0x2000,                               // MF, offset 0: a first fragment
        1 => 0x2000 | (1 + rng.below(100) as u16), // a middle one
        2 => 1 + rng.below(100) as u16,            // the last one
        _ => {
            if rng.chance(50) {
                0x4000
            } else {
                0
            }
        } // DF or nothing
    };
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    let proto = rng.pick(&[6u8, 6, 17, 17, 1, 58, 47, 0]);
    h[9] = proto;
    if rng.chance(15) {
        h[16] = 224 + rng.below(16) as u8;
    } else if rng.chance(5) {
        h[16..20].copy_from_slice(&[255; 4]);
    }
    let l4 = l4(rng, proto, false);
    let (payload, total) = cut_with_length(rng, l4, h.len());
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h.extend(payload);
    h
}

fn ipv6(rng: &mut Rng) -> Vec<u8> {
    let mut h = rng.bytes(40);
    h[0] = if rng.chance(95) {
        0x60
    } else {
        (rng.below(16) as u8) << 4
    };
    if rng.chance(20) {
        h[24] = 0xff;
    } else if h[24] == 0xff {
        h[24] = 0xfe;
    }
    let proto = rng.pick(&[6u8, 17, 58, 58, 58, 0, 44, 59]);
    let payload = match proto {
        // An extension header (hop-by-hop or fragment), then TCP, UDP or ICMPv6.
        0 | 44 => {
            let inner = rng.pick(&[6u8, 17, 58]);
            let mut e = vec![inner, 0, 0, 0, 0, 0, 0, 0];
            if proto == 0 {
                e[2..4].copy_from_slice(&[1, 4]); // PadN over the 6 bytes
            }
            e.extend(l4(rng, inner, true));
            e
        }
        _ => l4(rng, proto, true),
    };
    h[6] = proto;
    let (payload, len) = cut_with_length(rng, payload, 0);
    h[4..6].copy_from_slice(&len.to_be_bytes());
    h.extend(payload);
    h
}

fn frame(rng: &mut Rng) -> Vec<u8> {
    let pick = rng.next_u64() as u8;
    let ethertype: u16 = match rng.below(20) {
        0..=8 => 0x0800,
        9..=17 => 0x86dd,
        18 => 0x0806,
        _ => {
            let other = rng.next_u64() as u16;
            rng.pick(&[0x8100u16, 0x88a8, other])
        }
    };
    let mut f = vec![pick];
    if pick & 1 == 0 {
        let mut hw = rng.bytes(20);
        if rng.chance(15) {
            hw[4] = 0xff;
        } else if hw[4] == 0xff {
            hw[4] = 0xfe;
        }
        f.extend(hw);
        f.extend(ethertype.to_be_bytes());
        f.extend([0, 0]);
    } else {
        let mut mac = rng.bytes(12);
        if !rng.chance(15) {
            mac[0] &= !1;
        }
        f.extend(mac);
        f.extend(ethertype.to_be_bytes());
    }
    match ethertype {
        0x0800 => f.extend(ipv4(rng)),
        0x86dd => f.extend(ipv6(rng)),
        0x8100 | 0x88a8 => {
            f.extend(rng.bytes(2));
            f.extend(0x0800u16.to_be_bytes());
            f.extend(ipv4(rng));
        }
        _ => {
            let n = rng.below(60) as usize;
            f.extend(rng.bytes(n))
        }
    }
    if rng.chance(10) {
        let at = 1 + rng.below(f.len() as u64) as usize;
        f.truncate(at);
    }
    f
}

#[test]
fn the_fast_paths_parse_agrees_with_etherparse_on_seeded_frames() {
    let seed = std::env::var("IPOIB_PARSE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1b0b_5eed_u64);
    eprintln!("seed {seed} (IPOIB_PARSE_SEED replays it)");
    let mut rng = Rng::new(seed);
    let mut seen = std::collections::BTreeMap::<Outcome, u32>::new();
    for case in 0..50_000 {
        let f = frame(&mut rng);
        let r = std::panic::catch_unwind(|| ipoib_fuzz::fastpath_compare(&f));
        let Ok(outcome) = r else {
            panic!("case {case} of seed {seed}: {f:02x?}");
        };
        *seen.entry(outcome).or_default() += 1;
    }
    eprintln!("{seen:#?}");
    // Every kind of frame was reached, each often enough to mean something.
    let agreed = |f: fn(&Outcome) -> bool| {
        seen.iter()
            .filter(|(o, _)| f(o))
            .map(|(_, n)| n)
            .sum::<u32>()
    };
    for (what, n) in [
        (
            "IP",
            agreed(|o| matches!(o, Outcome::Agreed { ip: true, .. })),
        ),
        (
            "not IP",
            agreed(|o| matches!(o, Outcome::Agreed { ip: false, .. })),
        ),
        (
            "multicast",
            agreed(|o| {
                matches!(
                    o,
                    Outcome::Agreed {
                        multicast: true,
                        ..
                    }
                )
            }),
        ),
        (
            "handshake TCP",
            agreed(|o| matches!(o, Outcome::Agreed { control: true, .. })),
        ),
        (
            "Neighbor Discovery",
            agreed(|o| {
                matches!(
                    o,
                    Outcome::Agreed {
                        neighbor_discovery: true,
                        ..
                    }
                )
            }),
        ),
        ("not compared", agreed(|o| *o == Outcome::NotCompared)),
        (
            "only the fast path reads",
            agreed(|o| *o == Outcome::OnlyFastPath),
        ),
        ("both refuse", agreed(|o| *o == Outcome::BothRefused)),
    ] {
        assert!(n >= 200, "{what}: {n} of 50,000 cases");
    }
}
