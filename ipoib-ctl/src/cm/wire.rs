//! The CM handshake's messages: fixed 48-byte records, big-endian, carried over TCP on the
//! IP path (`ctl-port`, 4755 by default). Pure: encode, decode and validate, no I/O.
//!
//! ```text
//!  0  magic "IPHC"          4  version (2)   5  kind   6  reject reason (REJ only)  7  0
//!  8  UD QPN (be32, high byte 0)       } RFC 4755 private data: every message, REJ too
//! 12  receive MTU (be32)               }
//! 16  RC QPN (be32, high byte 0)   20  first PSN (be32, 24 bits)      } REQ and REP only;
//! 24  LID (be16)   26  port MTU (ibv_mtu 1..=5)   27  link layer      } zero in REJ, RTU
//! 28  GID (16 bytes)                                                  }
//! 44  path: 0x80 | SL, or 0    45  path MTU   46  rate   47  packet lifetime (REQ, REP)
//! ```
//!
//! Version 2 added the link layer (1 InfiniBand, 2 Ethernet), byte 27, which version 1 kept
//! zero: a LID of 0 no longer has to stand for RoCE; and the path the sender resolved to the
//! receiver (bytes 44-47, zero where it had none), from which the receiver builds its own
//! address vector as the kernel's CM builds the passive side's from the REQ's primary path. A message of another version is
//! refused with REJ `Version`, written in the asker's version where it is 1 (a REJ's layout
//! is the same in both), so an older node says why too.
//!
//! A REQ opens the exchange, the passive side answers REP (its QP already in RTS) or REJ, and
//! the active side confirms with RTU once its QP is in RTS. Every field is checked before
//! anything is allocated for the message; a violation names the field.

use crate::{
    path::{LinkLayer, PathRecord},
    verbs::RcEndpoint,
};

pub const MAGIC: [u8; 4] = *b"IPHC";
pub const VERSION: u8 = 2;
/// The versions whose REJ we can write (the same layout): an older asker reads ours.
pub const REJ_VERSIONS: [u8; 2] = [1, 2];
pub const MSG_LEN: usize = 48;
/// The largest receive MTU a CM endpoint may announce: Linux' CM receive buffer
/// (IPOIB_CM_BUF_SIZE = 65520-byte CM MTU + 4-byte IPoIB header).
pub const MAX_RECV_MTU: u32 = 65524;
/// Linux rejects a REP whose MTU is 4 or less (no room for the IPoIB header); so do we, for
/// every message that carries one.
pub const MIN_RECV_MTU: u32 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Req = 1,
    Rep = 2,
    Rej = 3,
    Rtu = 4,
}

/// Why a REQ (or REP) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum RejectReason {
    /// A field failed validation.
    Malformed = 1,
    /// A protocol version we do not speak.
    Version = 2,
    /// Too many setups in flight here; try again later.
    Busy = 3,
    /// Crossing REQs: the other one wins the tie-break, or a connection already exists.
    Crossing = 4,
    /// No QP or memory for another connection (the memory plan is full).
    NoResources = 5,
    /// Policy keeps this peer on UD.
    Policy = 6,
    /// No path between the two ports (link layers that differ, a port without a LID).
    NoPath = 7,
}

impl RejectReason {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Malformed,
            2 => Self::Version,
            3 => Self::Busy,
            4 => Self::Crossing,
            5 => Self::NoResources,
            6 => Self::Policy,
            7 => Self::NoPath,
            _ => return None,
        })
    }

    /// Worth asking again later (with backoff).
    pub fn transient(self) -> bool {
        matches!(self, Self::Busy | Self::NoResources)
    }
}

/// The IPoIB link-layer address of a CM endpoint without its flags: UD QPN and port GID.
/// Orders crossing REQs (RFC 4755 3.3: the lower address accepts the other side's REQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HwAddr {
    pub gid: [u8; 16],
    pub ud_qpn: u32,
}

/// Whether the side at `local` accepts the REQ of `remote` when both sent one.
pub fn accepts_crossing(local: HwAddr, remote: HwAddr) -> bool {
    local < remote
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg {
    Req(Hello),
    Rep(Hello),
    Rej {
        ud_qpn: u32,
        recv_mtu: u32,
        reason: RejectReason,
    },
    Rtu {
        ud_qpn: u32,
        recv_mtu: u32,
    },
}

/// What a REQ or REP carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// RFC 4755 private data: the sender's UD QPN and receive MTU.
    pub ud_qpn: u32,
    pub recv_mtu: u32,
    /// The sender's RC QP.
    pub rc: RcEndpoint,
    /// The path the sender resolved to the receiver, if it had one.
    pub path: Option<PathParams>,
}

/// What a REQ or REP says of the sender's path record: the fields the receiver's address
/// vector takes from it (the DLID is the sender's LID).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathParams {
    /// 4 bits.
    pub sl: u8,
    /// `ibv_mtu` (1..=5).
    pub mtu: u8,
    /// `ibv_rate`, 6 bits.
    pub rate: u8,
    /// IB encoding, 6 bits.
    pub packet_life_time: u8,
}

impl PathParams {
    /// The fields of `r` a peer needs.
    pub fn of(r: &PathRecord) -> Self {
        Self {
            sl: r.sl & 0xf,
            mtu: r.mtu.clamp(1, 5) as u8,
            rate: r.rate & 0x3f,
            packet_life_time: r.packet_life_time & 0x3f,
        }
    }

    /// The record the receiver takes from it, toward the sender's port at `dlid` (same
    /// subnet: no GRH fields).
    pub fn record(&self, dlid: u16) -> PathRecord {
        PathRecord {
            dlid,
            sl: self.sl,
            mtu: u32::from(self.mtu),
            rate: self.rate,
            packet_life_time: self.packet_life_time,
            hop_limit: 0,
            traffic_class: 0,
            flow_label: 0,
        }
    }
}

impl Hello {
    pub fn hwaddr(&self) -> HwAddr {
        HwAddr {
            gid: self.rc.gid,
            ud_qpn: self.ud_qpn,
        }
    }

    /// The path the passive side takes from a REQ, toward the asker's LID, as the kernel's CM
    /// takes the passive side's from the REQ's primary path; none across a router (another
    /// subnet prefix than `local_gid`'s), where that LID is not the one to send to.
    pub fn path_for_passive(&self, local_gid: &[u8; 16]) -> Option<PathRecord> {
        self.path
            .filter(|_| self.rc.gid[..8] == local_gid[..8])
            .map(|p| p.record(self.rc.lid))
    }
}

/// What is wrong with a message, by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}")]
    Magic([u8; 4]),
    #[error("unsupported protocol version {0}")]
    Version(u8),
    #[error("unknown message kind {0}")]
    Kind(u8),
    #[error("unknown reject reason {0}")]
    Reason(u8),
    #[error("reserved byte at offset {0} is not zero")]
    Reserved(usize),
    #[error("UD QPN {0:#x} is not a 24-bit QPN above 1")]
    UdQpn(u32),
    #[error("receive MTU {0} is outside {MIN_RECV_MTU}..={MAX_RECV_MTU}")]
    RecvMtu(u32),
    #[error("RC QPN {0:#x} is not a 24-bit QPN above 1")]
    RcQpn(u32),
    #[error("PSN {0:#x} is wider than 24 bits")]
    Psn(u32),
    #[error("LID {0:#x} is not a unicast LID")]
    Lid(u16),
    #[error("port MTU {0} is not an ibv_mtu (1..=5)")]
    PortMtu(u8),
    #[error("GID is zero or multicast")]
    Gid,
    #[error("link layer {0} is neither InfiniBand (1) nor Ethernet (2)")]
    LinkLayer(u8),
    #[error("path bytes {0:02x?}: not 0x80|SL, an ibv_mtu, a 6-bit rate and lifetime, or all 0")]
    Path([u8; 4]),
    #[error("a {0:?} carries RC endpoint fields, which must be zero")]
    Extra(Kind),
}

impl WireError {
    /// The reason a REJ gives for it.
    pub fn reason(&self) -> RejectReason {
        match self {
            Self::Version(_) => RejectReason::Version,
            _ => RejectReason::Malformed,
        }
    }
}

fn qpn_ok(q: u32) -> bool {
    q > 1 && q <= 0xff_ffff
}

impl Msg {
    pub fn kind(&self) -> Kind {
        match self {
            Msg::Req(_) => Kind::Req,
            Msg::Rep(_) => Kind::Rep,
            Msg::Rej { .. } => Kind::Rej,
            Msg::Rtu { .. } => Kind::Rtu,
        }
    }

    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind() as u8;
        let (ud_qpn, recv_mtu) = match *self {
            Msg::Req(h) | Msg::Rep(h) => {
                b[16..20].copy_from_slice(&h.rc.qpn.to_be_bytes());
                b[20..24].copy_from_slice(&h.rc.psn.to_be_bytes());
                b[24..26].copy_from_slice(&h.rc.lid.to_be_bytes());
                b[26] = h.rc.mtu as u8;
                b[27] = h.rc.link_layer.code();
                b[28..44].copy_from_slice(&h.rc.gid);
                if let Some(p) = h.path {
                    b[44..48].copy_from_slice(&[0x80 | p.sl, p.mtu, p.rate, p.packet_life_time]);
                }
                (h.ud_qpn, h.recv_mtu)
            }
            Msg::Rej {
                ud_qpn,
                recv_mtu,
                reason,
            } => {
                b[6] = reason as u8;
                (ud_qpn, recv_mtu)
            }
            Msg::Rtu { ud_qpn, recv_mtu } => (ud_qpn, recv_mtu),
        };
        b[8..12].copy_from_slice(&ud_qpn.to_be_bytes());
        b[12..16].copy_from_slice(&recv_mtu.to_be_bytes());
        b
    }

    /// Encoded as protocol `version` speaks it: only a REJ, whose layout every version in
    /// [`REJ_VERSIONS`] shares, is written in another version than ours.
    pub fn encode_as(&self, version: u8) -> [u8; MSG_LEN] {
        let mut b = self.encode();
        if matches!(self, Msg::Rej { .. }) && REJ_VERSIONS.contains(&version) {
            b[4] = version;
        }
        b
    }

    /// Decodes and validates every field.
    pub fn decode(b: &[u8; MSG_LEN]) -> Result<Msg, WireError> {
        let kind = decode_header(b)?;
        let ud_qpn = be32(b, 8);
        if !qpn_ok(ud_qpn) {
            return Err(WireError::UdQpn(ud_qpn));
        }
        let recv_mtu = be32(b, 12);
        if !(MIN_RECV_MTU..=MAX_RECV_MTU).contains(&recv_mtu) {
            return Err(WireError::RecvMtu(recv_mtu));
        }
        match kind {
            Kind::Rej | Kind::Rtu => {
                if b[16..44].iter().any(|&x| x != 0) {
                    return Err(WireError::Extra(kind));
                }
                Ok(if kind == Kind::Rej {
                    Msg::Rej {
                        ud_qpn,
                        recv_mtu,
                        reason: RejectReason::from_u8(b[6]).ok_or(WireError::Reason(b[6]))?,
                    }
                } else {
                    Msg::Rtu { ud_qpn, recv_mtu }
                })
            }
            Kind::Req | Kind::Rep => {
                let h = Hello {
                    ud_qpn,
                    recv_mtu,
                    rc: decode_endpoint(b)?,
                    path: decode_path(b)?,
                };
                Ok(if kind == Kind::Req {
                    Msg::Req(h)
                } else {
                    Msg::Rep(h)
                })
            }
        }
    }
}

fn be32(b: &[u8; MSG_LEN], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Magic, version, kind and the reserved bytes.
fn decode_header(b: &[u8; MSG_LEN]) -> Result<Kind, WireError> {
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != MAGIC {
        return Err(WireError::Magic(magic));
    }
    if b[4] != VERSION {
        return Err(WireError::Version(b[4]));
    }
    let kind = match b[5] {
        1 => Kind::Req,
        2 => Kind::Rep,
        3 => Kind::Rej,
        4 => Kind::Rtu,
        k => return Err(WireError::Kind(k)),
    };
    if b[7] != 0 {
        return Err(WireError::Reserved(7));
    }
    if kind != Kind::Rej && b[6] != 0 {
        return Err(WireError::Reserved(6));
    }
    if matches!(kind, Kind::Rej | Kind::Rtu) && b[27..28].iter().chain(&b[44..48]).any(|&x| x != 0)
    {
        return Err(WireError::Extra(kind));
    }
    Ok(kind)
}

/// The RC endpoint of a REQ or REP: QPN, PSN, LID, port MTU, GID.
fn decode_endpoint(b: &[u8; MSG_LEN]) -> Result<RcEndpoint, WireError> {
    let qpn = be32(b, 16);
    if !qpn_ok(qpn) {
        return Err(WireError::RcQpn(qpn));
    }
    let psn = be32(b, 20);
    if psn > 0xff_ffff {
        return Err(WireError::Psn(psn));
    }
    let lid = u16::from_be_bytes([b[24], b[25]]);
    // 0: RoCE (no LIDs); 0xc000.. are multicast LIDs and 0xffff the permissive LID.
    if lid >= 0xc000 {
        return Err(WireError::Lid(lid));
    }
    let mtu = b[26];
    if !(1..=5).contains(&mtu) {
        return Err(WireError::PortMtu(mtu));
    }
    let link_layer = LinkLayer::from_code(b[27]).ok_or(WireError::LinkLayer(b[27]))?;
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[28..44]);
    if gid == [0; 16] || gid[0] == 0xff {
        return Err(WireError::Gid);
    }
    Ok(RcEndpoint {
        qpn,
        psn,
        lid,
        gid,
        mtu: mtu as u32,
        link_layer,
    })
}

/// The path bytes of a REQ or REP: all zero, or 0x80 | SL, an ibv_mtu, a 6-bit rate and a
/// 6-bit packet lifetime.
fn decode_path(b: &[u8; MSG_LEN]) -> Result<Option<PathParams>, WireError> {
    let p = [b[44], b[45], b[46], b[47]];
    if p == [0; 4] {
        return Ok(None);
    }
    if p[0] & 0xf0 != 0x80 || !(1..=5).contains(&p[1]) || p[2] > 0x3f || p[3] > 0x3f {
        return Err(WireError::Path(p));
    }
    Ok(Some(PathParams {
        sl: p[0] & 0xf,
        mtu: p[1],
        rate: p[2],
        packet_life_time: p[3],
    }))
}

/// The per-connection MTU (RFC 4755 5.1): the smaller receive MTU, less the IPoIB header.
pub fn connection_mtu(local_recv_mtu: u32, remote_recv_mtu: u32) -> u32 {
    local_recv_mtu.min(remote_recv_mtu) - 4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            ud_qpn: 0x48,
            recv_mtu: 65524,
            rc: RcEndpoint {
                qpn: 0x1234,
                psn: 0xabcdef,
                lid: 0,
                gid: [
                    0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55,
                ],
                mtu: 3,
                link_layer: LinkLayer::Ethernet,
            },
            path: None,
        }
    }

    /// A path as OpenSM gives one with QoS on: SL 3, 4096 bytes, 100 Gb/s, lifetime 0x12.
    fn with_path() -> Hello {
        Hello {
            path: Some(PathParams {
                sl: 3,
                mtu: 5,
                rate: 16,
                packet_life_time: 0x12,
            }),
            ..hello()
        }
    }

    #[test]
    fn every_kind_round_trips() {
        let h = hello();
        for m in [
            Msg::Req(h),
            Msg::Rep(h),
            Msg::Req(with_path()),
            Msg::Rep(with_path()),
            Msg::Rej {
                ud_qpn: 0x48,
                recv_mtu: 65524,
                reason: RejectReason::Crossing,
            },
            Msg::Rtu {
                ud_qpn: 0x48,
                recv_mtu: 2048,
            },
        ] {
            assert_eq!(Msg::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn layout_is_the_documented_one() {
        let b = Msg::Req(hello()).encode();
        assert_eq!(&b[0..4], b"IPHC");
        assert_eq!(b[4], 2);
        assert_eq!(b[5], 1);
        assert_eq!(&b[8..12], &[0, 0, 0, 0x48]);
        assert_eq!(&b[12..16], &65524u32.to_be_bytes());
        assert_eq!(&b[16..20], &[0, 0, 0x12, 0x34]);
        assert_eq!(&b[20..24], &[0, 0xab, 0xcd, 0xef]);
        assert_eq!(b[26], 3);
        assert_eq!(b[27], 2);
        assert_eq!(b[28], 0xfe);
        assert_eq!(b[43], 0x55);
    }

    /// The path bytes: 0x80 | SL, MTU, rate, lifetime; zero without a path; REJ and RTU carry
    /// none. The record the receiver takes is toward the sender's LID.
    #[test]
    fn the_senders_path_is_on_the_wire() {
        let b = Msg::Req(with_path()).encode();
        assert_eq!(&b[44..48], &[0x83, 5, 16, 0x12]);
        assert_eq!(&Msg::Req(hello()).encode()[44..48], &[0; 4]);
        let p = with_path().path.unwrap();
        let r = p.record(7);
        assert_eq!(
            (r.dlid, r.sl, r.mtu, r.rate, r.packet_life_time, r.hop_limit),
            (7, 3, 5, 16, 0x12, 0)
        );
        assert_eq!(PathParams::of(&r), p);
        // What does not fit the bytes is cut to them.
        let wide = PathRecord {
            sl: 0x13,
            mtu: 9,
            rate: 0x55,
            packet_life_time: 0x7f,
            ..r
        };
        assert_eq!(
            PathParams::of(&wide),
            PathParams {
                sl: 3,
                mtu: 5,
                rate: 0x15,
                packet_life_time: 0x3f
            }
        );
        for (kind, mut b) in [
            (
                Kind::Rej,
                Msg::Rej {
                    ud_qpn: 0x48,
                    recv_mtu: 65524,
                    reason: RejectReason::Busy,
                }
                .encode(),
            ),
            (
                Kind::Rtu,
                Msg::Rtu {
                    ud_qpn: 0x48,
                    recv_mtu: 65524,
                }
                .encode(),
            ),
        ] {
            b[44] = 0x80;
            assert_eq!(Msg::decode(&b), Err(WireError::Extra(kind)));
        }
    }

    /// Each field, broken on its own, is refused with that field named.
    #[test]
    fn each_malformed_field_is_named() {
        let good = Msg::Req(hello()).encode();
        type Breaker = Box<dyn Fn(&mut [u8; MSG_LEN])>;
        let cases: Vec<(Breaker, WireError)> = vec![
            (Box::new(|b| b[0] = b'X'), WireError::Magic(*b"XPHC")),
            (Box::new(|b| b[4] = 1), WireError::Version(1)),
            (Box::new(|b| b[4] = 3), WireError::Version(3)),
            (Box::new(|b| b[5] = 0), WireError::Kind(0)),
            (Box::new(|b| b[5] = 9), WireError::Kind(9)),
            (Box::new(|b| b[6] = 1), WireError::Reserved(6)),
            (Box::new(|b| b[7] = 1), WireError::Reserved(7)),
            (Box::new(|b| b[27] = 0), WireError::LinkLayer(0)),
            (Box::new(|b| b[27] = 3), WireError::LinkLayer(3)),
            (Box::new(|b| b[47] = 1), WireError::Path([0, 0, 0, 1])),
            (Box::new(|b| b[8] = 1), WireError::UdQpn(0x0100_0048)),
            (
                Box::new(|b| b[8..12].copy_from_slice(&[0, 0, 0, 1])),
                WireError::UdQpn(1),
            ),
            (
                Box::new(|b| b[12..16].copy_from_slice(&4u32.to_be_bytes())),
                WireError::RecvMtu(4),
            ),
            (
                Box::new(|b| b[12..16].copy_from_slice(&65525u32.to_be_bytes())),
                WireError::RecvMtu(65525),
            ),
            (
                Box::new(|b| b[16..20].copy_from_slice(&[0, 0, 0, 0])),
                WireError::RcQpn(0),
            ),
            (Box::new(|b| b[16] = 0x80), WireError::RcQpn(0x8000_1234)),
            (Box::new(|b| b[20] = 1), WireError::Psn(0x01ab_cdef)),
            (
                Box::new(|b| b[24..26].copy_from_slice(&[0xc0, 0x01])),
                WireError::Lid(0xc001),
            ),
            (
                Box::new(|b| b[24..26].copy_from_slice(&[0xff, 0xff])),
                WireError::Lid(0xffff),
            ),
            (Box::new(|b| b[26] = 0), WireError::PortMtu(0)),
            (Box::new(|b| b[26] = 6), WireError::PortMtu(6)),
            (Box::new(|b| b[28..44].fill(0)), WireError::Gid),
            (Box::new(|b| b[28] = 0xff), WireError::Gid),
        ];
        for (i, (breakit, want)) in cases.iter().enumerate() {
            let mut b = good;
            breakit(&mut b);
            assert_eq!(Msg::decode(&b), Err(*want), "case {i}");
        }
    }

    /// The largest value of each path field decodes.
    #[test]
    fn the_largest_path_fields_decode() {
        let mut top = Msg::Req(with_path()).encode();
        top[44..48].copy_from_slice(&[0x8f, 5, 0x3f, 0x3f]);
        let Ok(Msg::Req(h)) = Msg::decode(&top) else {
            panic!("{:?}", Msg::decode(&top))
        };
        assert_eq!(
            h.path,
            Some(PathParams {
                sl: 15,
                mtu: 5,
                rate: 0x3f,
                packet_life_time: 0x3f
            })
        );
    }

    /// Path bytes that are not 0x80 | SL, an ibv_mtu, a 6-bit rate and lifetime.
    #[test]
    fn malformed_path_bytes_are_named() {
        let good = Msg::Req(hello()).encode();
        type Breaker = Box<dyn Fn(&mut [u8; MSG_LEN])>;
        let cases: Vec<(Breaker, WireError)> = vec![
            (Box::new(|b| b[44] = 0x80), WireError::Path([0x80, 0, 0, 0])),
            (
                Box::new(|b| b[44..48].copy_from_slice(&[0x93, 5, 16, 18])),
                WireError::Path([0x93, 5, 16, 18]),
            ),
            (
                Box::new(|b| b[44..48].copy_from_slice(&[0x83, 6, 16, 18])),
                WireError::Path([0x83, 6, 16, 18]),
            ),
            (
                Box::new(|b| b[44..48].copy_from_slice(&[0x83, 5, 64, 18])),
                WireError::Path([0x83, 5, 64, 18]),
            ),
            (
                Box::new(|b| b[44..48].copy_from_slice(&[0x83, 5, 16, 64])),
                WireError::Path([0x83, 5, 16, 64]),
            ),
        ];
        for (i, (breakit, want)) in cases.iter().enumerate() {
            let mut b = good;
            breakit(&mut b);
            assert_eq!(Msg::decode(&b), Err(*want), "case {i}");
        }
    }

    #[test]
    fn rej_and_rtu_carry_no_endpoint_and_a_known_reason() {
        let rej = Msg::Rej {
            ud_qpn: 0x48,
            recv_mtu: 65524,
            reason: RejectReason::Busy,
        };
        let mut b = rej.encode();
        b[6] = 0;
        assert_eq!(Msg::decode(&b), Err(WireError::Reason(0)));
        b[6] = 200;
        assert_eq!(Msg::decode(&b), Err(WireError::Reason(200)));
        let mut b = rej.encode();
        b[30] = 1;
        assert_eq!(Msg::decode(&b), Err(WireError::Extra(Kind::Rej)));
        let mut b = Msg::Rtu {
            ud_qpn: 0x48,
            recv_mtu: 65524,
        }
        .encode();
        b[16] = 1;
        assert_eq!(Msg::decode(&b), Err(WireError::Extra(Kind::Rtu)));
        for kind in [Kind::Rej, Kind::Rtu] {
            let mut b = if kind == Kind::Rej {
                rej.encode()
            } else {
                Msg::Rtu {
                    ud_qpn: 0x48,
                    recv_mtu: 65524,
                }
                .encode()
            };
            b[27] = 1;
            assert_eq!(Msg::decode(&b), Err(WireError::Extra(kind)));
        }
    }

    /// An InfiniBand endpoint (a LID, the link layer 1) round-trips, and a version 1 REQ
    /// (byte 27 zero, as version 1 wrote it) is told apart by its version before any field.
    #[test]
    fn the_link_layer_is_on_the_wire_and_version_1_is_told_apart() {
        let mut h = hello();
        h.rc.link_layer = LinkLayer::InfiniBand;
        h.rc.lid = 7;
        let b = Msg::Req(h).encode();
        assert_eq!((b[24], b[25], b[27]), (0, 7, 1));
        assert_eq!(Msg::decode(&b), Ok(Msg::Req(h)));
        let mut v1 = b;
        v1[4] = 1;
        v1[27] = 0;
        assert_eq!(Msg::decode(&v1), Err(WireError::Version(1)));
        assert_eq!(WireError::Version(1).reason(), RejectReason::Version);
    }

    /// A REJ is written in an older asker's version (its layout is the same), nothing else is,
    /// and no version is made up.
    #[test]
    fn a_rej_speaks_the_askers_version() {
        let rej = Msg::Rej {
            ud_qpn: 0x48,
            recv_mtu: 65524,
            reason: RejectReason::Version,
        };
        let b = rej.encode_as(1);
        assert_eq!(b[4], 1);
        assert_eq!(&b[5..], &rej.encode()[5..]);
        assert_eq!(rej.encode_as(2), rej.encode());
        for v in [0, 3, 255] {
            assert_eq!(rej.encode_as(v)[4], VERSION, "{v}");
        }
        assert_eq!(Msg::Req(hello()).encode_as(1)[4], VERSION);
        let rtu = Msg::Rtu {
            ud_qpn: 0x48,
            recv_mtu: 65524,
        };
        assert_eq!(rtu.encode_as(1)[4], VERSION);
    }

    #[test]
    fn every_reject_reason_round_trips_and_only_busy_and_no_resources_are_transient() {
        use RejectReason::*;
        for (reason, transient) in [
            (Malformed, false),
            (Version, false),
            (Busy, true),
            (Crossing, false),
            (NoResources, true),
            (Policy, false),
            (NoPath, false),
        ] {
            let rej = Msg::Rej {
                ud_qpn: 0x48,
                recv_mtu: 65524,
                reason,
            };
            assert_eq!(Msg::decode(&rej.encode()), Ok(rej));
            assert_eq!(reason.transient(), transient, "{reason:?}");
        }
    }

    #[test]
    fn a_rej_says_version_for_a_version_and_malformed_for_the_rest() {
        assert_eq!(WireError::Version(2).reason(), RejectReason::Version);
        assert_eq!(WireError::Magic(*b"XPHC").reason(), RejectReason::Malformed);
        assert_eq!(WireError::Gid.reason(), RejectReason::Malformed);
    }

    /// The largest PSN (24 bits) is a PSN.
    #[test]
    fn the_largest_psn_decodes() {
        let mut b = Msg::Req(hello()).encode();
        b[20..24].copy_from_slice(&0x00ff_ffffu32.to_be_bytes());
        let Ok(Msg::Req(h)) = Msg::decode(&b) else {
            panic!("{:?}", Msg::decode(&b))
        };
        assert_eq!(h.rc.psn, 0x00ff_ffff);
    }

    /// The passive side takes the asker's path toward the asker's LID on its own subnet, and
    /// none from an asker behind a router or without one.
    #[test]
    fn the_passive_side_takes_the_askers_path_on_its_own_subnet_only() {
        let mut req = with_path();
        req.rc.lid = 0x17;
        let mut local = req.rc.gid;
        local[8..].copy_from_slice(&[9; 8]);
        let r = req.path_for_passive(&local).unwrap();
        assert_eq!(r, req.path.unwrap().record(0x17));
        assert_eq!((r.dlid, r.sl, r.mtu), (0x17, 3, 5));
        local[7] ^= 1;
        assert_eq!(req.path_for_passive(&local), None, "another subnet");
        local[7] ^= 1;
        req.path = None;
        assert_eq!(req.path_for_passive(&local), None, "no path given");
    }

    #[test]
    fn tie_break_is_antisymmetric() {
        let a = HwAddr {
            gid: [1; 16],
            ud_qpn: 0x48,
        };
        let b = HwAddr {
            gid: [1; 16],
            ud_qpn: 0x49,
        };
        let c = HwAddr {
            gid: [2; 16],
            ud_qpn: 0x10,
        };
        for (x, y) in [(a, b), (b, c), (a, c)] {
            assert!(accepts_crossing(x, y));
            assert!(!accepts_crossing(y, x));
        }
        assert!(!accepts_crossing(a, a), "a peer never accepts itself");
    }

    #[test]
    fn connection_mtu_is_the_smaller_less_the_header() {
        assert_eq!(connection_mtu(65524, 65524), 65520);
        assert_eq!(connection_mtu(65524, 4096), 4092);
        assert_eq!(connection_mtu(2048, 65524), 2044);
    }
}
