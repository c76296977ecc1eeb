//! The memory plan: how much receive memory connected mode may use, and how it is spent.
//! A pure function of (HCA capabilities, system memory, policy); no I/O.
//!
//! # The rule
//!
//! * **Budget.** `memory-budget` when the policy sets it; otherwise 1/64 of system memory,
//!   clamped to [64 MiB, 2 GiB] (a 24 GiB node: 384 MiB; 256 GiB and more: 2 GiB).
//! * **Buffer.** One receive buffer holds one CM message: 65524 bytes (Linux' CM receive
//!   buffer: a 4084-byte head and 15 pages, 16 SGEs). Where the HCA allows fewer SGEs per SRQ
//!   receive, the buffer shrinks as the kernel's does: `max_srq_sge * PAGE_SIZE - 0x10`.
//!   Each buffer costs whole pages (64 KiB for the default).
//! * **With SRQ** (`max_srq > 0`): one SRQ per port shared by every RC QP, as deep as the budget
//!   allows, a power of two (as the kernel's ring sizes), at most `max_srq_wr` and the CQ's
//!   `max_cqe`. Memory does not grow with the number of peers; connections are capped only by
//!   `max_qp` (minus a reserve for the UD side).
//! * **Without SRQ**: each connection needs its own ring of [`RING_PER_CONNECTION`] buffers
//!   (4 MiB; the kernel uses 256 buffers, 16 MiB). The number of CM peers is capped so that
//!   every ring fits the budget; every other peer uses UD.
//! * **UD only** when the budget cannot hold [`MIN_SRQ_DEPTH`] buffers (SRQ) or one ring (no
//!   SRQ), or the HCA has no RC queue pairs to spare.
//!
//! For comparison, the kernel's costs (../shared/notes/ipoib-reference.md): with SRQ one
//! 256-buffer SRQ, ~16 MiB; without SRQ ~16 MiB per connection: at 4096 peers ~64 GiB, and
//! past `max_nonsrq_conn_qp` (128 by default) further connections are refused.

use serde::Serialize;

pub const PAGE_SIZE: u64 = 4096;
/// Linux' CM receive buffer (IPOIB_CM_BUF_SIZE: IPOIB_CM_MTU + IPOIB_ENCAP_LEN).
pub const CM_BUF_SIZE: u64 = 65524;
/// Bytes between registered buffers: one CM message in whole pages.
pub const CM_BUF_STRIDE: u64 = CM_BUF_SIZE.div_ceil(PAGE_SIZE) * PAGE_SIZE;
/// SGEs the default buffer needs (a head plus 15 pages).
pub const CM_BUF_SGES: u32 = 16;
/// Kernel default ring size per connection without SRQ, for comparisons.
pub const KERNEL_RECV_QUEUE_SIZE: u64 = 256;
/// Receive ring per connection without SRQ.
pub const RING_PER_CONNECTION: u64 = 64;
/// Smallest SRQ worth having.
pub const MIN_SRQ_DEPTH: u64 = 64;
/// Largest SRQ we post (the kernel's recv_queue_size maximum).
pub const MAX_SRQ_DEPTH: u64 = 8192;
/// Queue pairs left to the UD side and the control plane.
pub const QP_RESERVE: u64 = 8;
/// Registered send buffers, shared by every connection.
pub const SEND_SLOTS: u32 = 256;
/// Sends in flight per connection: each RC QP's send queue depth (`SetupConfig`) and the
/// engine's window on it (`EngineConfig`), one number so the two cannot disagree.
pub const SEND_WINDOW: u32 = 64;
/// Completion queue entries kept for the sends (twice the slots: a slot may complete in
/// error after a flush); every receive that may be posted needs one besides.
pub const CQ_SEND_RESERVE: u64 = 2 * SEND_SLOTS as u64;

pub const BUDGET_MIN: u64 = 64 << 20;
pub const BUDGET_MAX: u64 = 2 << 30;

/// What the plan needs to know about one port's HCA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HcaLimits {
    pub max_qp: u64,
    pub max_qp_wr: u64,
    pub max_cqe: u64,
    /// 0: the HCA has no SRQ.
    pub max_srq: u64,
    pub max_srq_wr: u64,
    pub max_srq_sge: u64,
}

impl HcaLimits {
    /// These limits as an HCA without an SRQ would have them (`--srq off`).
    pub fn without_srq(self) -> Self {
        Self {
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            ..self
        }
    }
}

/// Whether connected mode may use the HCA's SRQ: the operator's one override of the receive
/// model (`attach --srq`). `Auto` follows the HCA (an SRQ where it has one and creating it
/// works, else a ring per connection); `Off` takes rings per connection on any HCA (for an
/// HCA whose SRQ misbehaves, and to prove the rings on one that has an SRQ).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[derive(clap::ValueEnum)]
pub enum SrqChoice {
    #[default]
    Auto,
    Off,
}

/// The plan with the operator's SRQ choice applied.
pub fn plan_with(
    hca: &HcaLimits,
    system_memory: u64,
    policy_budget: Option<u64>,
    srq: SrqChoice,
) -> Plan {
    match srq {
        SrqChoice::Auto => plan(hca, system_memory, policy_budget),
        SrqChoice::Off => plan(&hca.without_srq(), system_memory, policy_budget),
    }
}

/// The plan of one interface on a node whose budget (`node`, shared by its interfaces) has
/// `free` bytes not held by the others; `policy_budget` is the interface's `memory-budget`.
/// An SRQ is held from its start: it is planned within what is free and, without a
/// `memory-budget`, at most half the node's budget, so that a second rail finds room. Where
/// that holds no SRQ (or the HCA has none, or `srq` is off), rings per connection, up to the
/// interface's budget: they take from the node's budget one at a time, as connections come.
pub fn plan_for_node(
    hca: &HcaLimits,
    system_memory: u64,
    node: u64,
    free: u64,
    policy_budget: Option<u64>,
    srq: SrqChoice,
) -> Plan {
    let srq_budget = policy_budget.unwrap_or(node / 2).min(free);
    let p = plan_with(hca, system_memory, Some(srq_budget), srq);
    if p.kind == PlanKind::Srq {
        return p;
    }
    rings_for_node(hca, system_memory, node, policy_budget)
}

/// Rings per connection on a node whose budget is `node`, up to the interface's
/// `policy_budget`.
pub fn rings_for_node(
    hca: &HcaLimits,
    system_memory: u64,
    node: u64,
    policy_budget: Option<u64>,
) -> Plan {
    let budget = policy_budget.unwrap_or(node).min(node);
    plan_with(hca, system_memory, Some(budget), SrqChoice::Off)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanKind {
    /// One SRQ shared by every connection.
    Srq,
    /// A receive ring per connection, connections capped by the budget.
    PerConnection,
    /// No connected mode: everything UD.
    UdOnly,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub kind: PlanKind,
    pub budget_bytes: u64,
    /// Where the budget came from: "policy" or "auto (1/64 of N MiB)".
    pub budget_source: String,
    /// Bytes of one CM message (the receive buffer).
    pub buffer_bytes: u64,
    /// Memory one buffer takes (whole pages).
    pub buffer_cost: u64,
    /// The connection MTU this buffer allows (buffer - 4-byte IPoIB header).
    pub cm_mtu: u64,
    /// SRQ depth (Srq), or ring per connection (PerConnection), or 0.
    pub ring: u64,
    /// Most CM connections at once.
    pub max_cm_peers: u64,
    /// Receive memory the plan uses at `max_cm_peers` (never above the budget).
    pub memory_bytes: u64,
    /// Why, in a sentence.
    pub why: String,
}

/// The budget rule; `policy_budget` wins when set.
pub fn budget(system_memory: u64, policy_budget: Option<u64>) -> (u64, String) {
    match policy_budget {
        Some(b) => (b, "policy".into()),
        None => (
            (system_memory / 64).clamp(BUDGET_MIN, BUDGET_MAX),
            format!(
                "auto (1/64 of {} MiB, within 64 MiB..2 GiB)",
                system_memory >> 20
            ),
        ),
    }
}

fn pages(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_SIZE) * PAGE_SIZE
}

fn pow2_floor(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        1 << (63 - n.leading_zeros())
    }
}

pub fn plan(hca: &HcaLimits, system_memory: u64, policy_budget: Option<u64>) -> Plan {
    let (budget_bytes, budget_source) = budget(system_memory, policy_budget);
    let sges = if hca.max_srq > 0 {
        hca.max_srq_sge.min(CM_BUF_SGES as u64)
    } else {
        CM_BUF_SGES as u64
    };
    let buffer_bytes = if sges >= CM_BUF_SGES as u64 {
        CM_BUF_SIZE
    } else {
        (sges * PAGE_SIZE).saturating_sub(0x10)
    };
    let mut p = Plan {
        kind: PlanKind::UdOnly,
        budget_bytes,
        budget_source,
        buffer_bytes,
        buffer_cost: pages(buffer_bytes).max(PAGE_SIZE),
        cm_mtu: buffer_bytes.saturating_sub(4),
        ring: 0,
        max_cm_peers: 0,
        memory_bytes: 0,
        why: String::new(),
    };
    let qps = hca.max_qp.saturating_sub(QP_RESERVE);
    if qps == 0 || buffer_bytes <= 4 {
        p.why = "the HCA has no RC queue pairs or receive SGEs to spare: UD only".into();
    } else if hca.max_srq > 0 {
        plan_srq(&mut p, hca, qps);
    } else {
        plan_rings(&mut p, hca, qps);
    }
    p
}

/// With an SRQ: one, as deep as the budget allows (a power of two within the HCA's limits).
fn plan_srq(p: &mut Plan, hca: &HcaLimits, qps: u64) {
    let fit = p.budget_bytes / p.buffer_cost;
    let depth = pow2_floor(
        fit.min(hca.max_srq_wr)
            .min(hca.max_cqe.saturating_sub(CQ_SEND_RESERVE))
            .min(MAX_SRQ_DEPTH),
    );
    if depth < MIN_SRQ_DEPTH {
        p.why = format!(
            "the budget holds {fit} buffers of {} KiB, fewer than the {MIN_SRQ_DEPTH} an SRQ needs: UD only",
            p.buffer_cost >> 10
        );
        return;
    }
    p.kind = PlanKind::Srq;
    p.ring = depth;
    p.max_cm_peers = qps;
    p.memory_bytes = depth * p.buffer_cost;
    p.why = format!(
        "one SRQ of {depth} buffers shared by up to {qps} connections: memory does not grow with peers"
    );
}

/// Without an SRQ: a ring per connection, and as many connections as the budget holds.
fn plan_rings(p: &mut Plan, hca: &HcaLimits, qps: u64) {
    let ring = RING_PER_CONNECTION.min(hca.max_qp_wr);
    let per_conn = ring * p.buffer_cost;
    // Every ring's receives complete on the one CQ, beside the sends.
    let cq_rings = hca.max_cqe.saturating_sub(CQ_SEND_RESERVE) / ring.max(1);
    let k = (p.budget_bytes / per_conn.max(1)).min(qps).min(cq_rings);
    if k == 0 || ring == 0 {
        let short = if p.budget_bytes < per_conn {
            "the budget"
        } else {
            "the completion queue"
        };
        p.why = format!(
            "no SRQ, and one connection's ring ({} MiB) does not fit {short}: UD only",
            per_conn >> 20
        );
        return;
    }
    p.kind = PlanKind::PerConnection;
    p.ring = ring;
    p.max_cm_peers = k;
    p.memory_bytes = k * per_conn;
    p.why = format!(
        "no SRQ: a {ring}-buffer ring per connection ({} MiB), at most {k} CM peers; every other peer uses UD",
        per_conn >> 20
    );
}

/// The kernel's receive memory for `peers` CM peers (the comparison in `caps`).
pub fn kernel_memory(peers: u64, srq: bool) -> u64 {
    let ring = KERNEL_RECV_QUEUE_SIZE * pages(CM_BUF_SIZE);
    if srq { ring } else { ring * peers }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    /// rdma_rxe's limits as ibv_devinfo printed them in the soft-RoCE VM.
    fn rxe() -> HcaLimits {
        HcaLimits {
            max_qp: 1048560,
            max_qp_wr: 1048576,
            max_cqe: 32767,
            max_srq: 917503,
            max_srq_wr: 1048576,
            max_srq_sge: 27,
        }
    }

    fn no_srq() -> HcaLimits {
        HcaLimits {
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            ..rxe()
        }
    }

    /// The node's budget shared by its interfaces: an SRQ takes at most half of it (or the
    /// interface's `memory-budget`), never more than is free; with no room for an SRQ, rings up
    /// to the interface's budget.
    #[test]
    fn plans_on_a_shared_node_budget() {
        let hca = HcaLimits {
            max_qp: 1 << 16,
            max_qp_wr: 1 << 14,
            max_srq: 1 << 10,
            max_srq_wr: 1 << 14,
            max_srq_sge: 16,
            max_cqe: 1 << 22,
        };
        let node = 384 * MIB;
        let first = plan_for_node(&hca, 24 * GIB, node, node, None, SrqChoice::Auto);
        assert_eq!((first.kind, first.memory_bytes), (PlanKind::Srq, 128 * MIB));
        let second = plan_for_node(
            &hca,
            24 * GIB,
            node,
            node - 128 * MIB,
            None,
            SrqChoice::Auto,
        );
        assert_eq!(
            (second.kind, second.memory_bytes),
            (PlanKind::Srq, 128 * MIB)
        );
        // Too little free for the smallest SRQ: rings, as many as the node's budget holds.
        let third = plan_for_node(&hca, 24 * GIB, node, 2 * MIB, None, SrqChoice::Auto);
        assert_eq!(third.kind, PlanKind::PerConnection);
        assert_eq!(third.budget_bytes, node);
        // A memory-budget replaces the half, within what is free.
        let set = plan_for_node(&hca, 24 * GIB, node, node, Some(16 * MIB), SrqChoice::Auto);
        assert_eq!((set.kind, set.memory_bytes), (PlanKind::Srq, 16 * MIB));
        let off = plan_for_node(&hca, 24 * GIB, node, node, Some(16 * MIB), SrqChoice::Off);
        assert_eq!((off.kind, off.max_cm_peers), (PlanKind::PerConnection, 4));
        assert_eq!(
            rings_for_node(&hca, 24 * GIB, node, Some(GIB)).budget_bytes,
            node
        );
    }

    #[test]
    fn budget_rule() {
        assert_eq!(budget(24 * GIB, None).0, 384 * MIB);
        assert_eq!(budget(GIB, None).0, 64 * MIB);
        assert_eq!(budget(1024 * GIB, None).0, 2 * GIB);
        assert_eq!(budget(24 * GIB, Some(100 * MIB)).0, 100 * MIB);
    }

    #[test]
    fn srq_plan_is_bounded_and_independent_of_peers() {
        let p = plan(&rxe(), 24 * GIB, None);
        assert_eq!(p.kind, PlanKind::Srq);
        assert_eq!(p.buffer_bytes, CM_BUF_SIZE);
        assert_eq!(p.buffer_cost, 64 * 1024);
        assert_eq!(p.ring, 4096); // 384 MiB / 64 KiB = 6144, floored to a power of two
        assert_eq!(p.memory_bytes, 256 * MIB);
        assert!(p.max_cm_peers >= 4096);
        assert_eq!(p.cm_mtu, 65520);
    }

    #[test]
    fn few_srq_sges_shrink_the_buffer_as_the_kernel_does() {
        let hca = HcaLimits {
            max_srq_sge: 4,
            ..rxe()
        };
        let p = plan(&hca, 24 * GIB, None);
        assert_eq!(p.buffer_bytes, 4 * 4096 - 0x10);
        assert_eq!(p.buffer_cost, 16 * 1024);
    }

    #[test]
    fn without_srq_peers_are_capped_by_the_budget() {
        let p = plan(&no_srq(), 24 * GIB, None);
        assert_eq!(p.kind, PlanKind::PerConnection);
        assert_eq!(p.max_cm_peers, 96); // 384 MiB / 4 MiB
        assert!(p.memory_bytes <= p.budget_bytes);
        // 4096 peers: the kernel without SRQ needs 64 GiB; the plan stays in its budget.
        assert_eq!(kernel_memory(4096, false), 64 * GIB);
        assert!(p.memory_bytes <= 384 * MIB);
    }

    /// One CM message in whole pages; two completions kept per send slot.
    #[test]
    fn buffer_stride_and_send_reserve() {
        assert_eq!(CM_BUF_STRIDE, 65536);
        assert_eq!(CM_BUF_STRIDE % PAGE_SIZE, 0);
        assert_eq!(CQ_SEND_RESERVE, 512);
    }

    /// Rings: K rings of `ring` buffers are what is registered, and the reason for UD names
    /// what was short.
    #[test]
    fn rings_memory_and_why_not() {
        let p = plan(&no_srq(), 24 * GIB, Some(20 * MIB));
        assert_eq!(p.kind, PlanKind::PerConnection);
        assert_eq!(p.max_cm_peers, 5);
        assert_eq!(p.memory_bytes, 5 * p.ring * p.buffer_cost);
        let p = plan(&no_srq(), 24 * GIB, Some(2 * MIB));
        assert!(p.why.contains("does not fit the budget"), "{}", p.why);
        let cq = HcaLimits {
            max_cqe: 63 + CQ_SEND_RESERVE,
            ..no_srq()
        };
        for budget in [None, Some(RING_PER_CONNECTION * CM_BUF_STRIDE)] {
            // With no budget given, or exactly one ring's: the queue is what was short.
            let p = plan(&cq, 24 * GIB, budget);
            assert!(
                p.why.contains("does not fit the completion queue"),
                "{budget:?}: {}",
                p.why
            );
        }
    }

    /// An SRQ of exactly the smallest depth is still an SRQ.
    #[test]
    fn the_smallest_srq_is_planned() {
        let p = plan(&rxe(), 24 * GIB, Some(MIN_SRQ_DEPTH * CM_BUF_STRIDE));
        assert_eq!((p.kind, p.ring), (PlanKind::Srq, MIN_SRQ_DEPTH));
        let p = plan(&rxe(), 24 * GIB, Some(MIN_SRQ_DEPTH * CM_BUF_STRIDE - 1));
        assert_eq!(p.kind, PlanKind::UdOnly);
    }

    /// `--srq off` plans rings on an HCA that has an SRQ, as if it had none.
    #[test]
    fn srq_off_plans_rings_as_without_an_srq() {
        let off = plan_with(&rxe(), 24 * GIB, None, SrqChoice::Off);
        assert_eq!(off, plan(&no_srq(), 24 * GIB, None));
        assert_eq!(off.kind, PlanKind::PerConnection);
        assert_eq!(
            plan_with(&rxe(), 24 * GIB, None, SrqChoice::Auto).kind,
            PlanKind::Srq
        );
        assert_eq!(rxe().without_srq(), no_srq());
    }

    /// Every ring's receives share the CQ with the sends: K stops where the CQ is full, even
    /// when the budget holds more (rxe's 32767 CQEs: 503 rings of 64, not 2 GiB's 512).
    #[test]
    fn rings_are_capped_by_the_completion_queue() {
        let p = plan(&no_srq(), 1024 * GIB, None);
        assert_eq!(p.budget_bytes, 2 * GIB);
        assert_eq!(p.max_cm_peers, (32767 - CQ_SEND_RESERVE) / 64);
        let small = HcaLimits {
            max_cqe: 64 + CQ_SEND_RESERVE,
            ..no_srq()
        };
        assert_eq!(plan(&small, 24 * GIB, None).max_cm_peers, 1);
        let none = HcaLimits {
            max_cqe: 63 + CQ_SEND_RESERVE,
            ..no_srq()
        };
        assert_eq!(plan(&none, 24 * GIB, None).kind, PlanKind::UdOnly);
    }

    #[test]
    fn tiny_budgets_fall_back_to_ud() {
        let p = plan(&rxe(), 24 * GIB, Some(2 * MIB));
        assert_eq!(p.kind, PlanKind::UdOnly);
        assert_eq!(p.memory_bytes, 0);
        let p = plan(&no_srq(), 24 * GIB, Some(2 * MIB));
        assert_eq!(p.kind, PlanKind::UdOnly);
        let hca = HcaLimits { max_qp: 4, ..rxe() };
        assert_eq!(plan(&hca, 24 * GIB, None).kind, PlanKind::UdOnly);
    }

    /// The plan never exceeds its budget, for any HCA and budget on a grid.
    #[test]
    fn never_over_budget() {
        for budget_mib in [16u64, 63, 64, 100, 384, 1000, 2048, 65536] {
            for (max_srq, sge, wr, cqe, qp) in [
                (0, 0, 0, 0, 0),
                (1, 1, 1, 1, 9),
                (1024, 16, 16384, 65536, 262144),
                (1024, 2, 128, 100, 64),
                (0, 0, 0, 0, 100000),
                (0, 0, 16, 16, 20),
            ] {
                let hca = HcaLimits {
                    max_qp: qp,
                    max_qp_wr: wr.max(1),
                    max_cqe: cqe,
                    max_srq,
                    max_srq_wr: wr,
                    max_srq_sge: sge,
                };
                let p = plan(&hca, 24 * GIB, Some(budget_mib * MIB));
                assert!(
                    p.memory_bytes <= p.budget_bytes,
                    "{hca:?} {budget_mib} MiB: {p:?}"
                );
                if p.kind == PlanKind::Srq {
                    assert!(p.ring <= hca.max_srq_wr && p.ring < hca.max_cqe.max(1));
                    assert!(p.ring.is_power_of_two());
                }
                if p.kind == PlanKind::PerConnection {
                    assert!(p.max_cm_peers <= qp);
                }
                if p.kind != PlanKind::UdOnly {
                    let receives = match p.kind {
                        PlanKind::Srq => p.ring,
                        _ => p.ring * p.max_cm_peers,
                    };
                    assert!(receives + CQ_SEND_RESERVE <= cqe, "{hca:?}: {p:?}");
                }
            }
        }
    }
}
