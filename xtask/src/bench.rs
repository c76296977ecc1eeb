//! `cargo xtask bench`'s subcommands: each benchmark, its options and what it prints.

use std::path::PathBuf;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Bench {
    /// ns per packet of each eBPF program through BPF_PROG_TEST_RUN, beside a trivial program
    /// of the same type in the same run.
    Datapath {
        /// Runs per measurement (the kernel reports the mean).
        #[arg(long, default_value_t = 1_000_000)]
        repeat: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Another build of the fast path's eBPF object, timed beside this one (what a change
        /// to the programs costs, in one run).
        #[arg(long)]
        compare_object: Option<PathBuf>,
    },
    /// In the soft-RoCE VM: message throughput over 1 RC connection and over N sharing one
    /// SRQ, beside perftest's ib_send_bw on the same device in the same run, as ratios.
    Verbs {
        /// Message size in bytes.
        #[arg(long, default_value_t = 65520)]
        size: u32,
        /// Seconds per measurement.
        #[arg(long, default_value_t = 3)]
        seconds: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Connections of the many-connection case.
        #[arg(long, default_value_t = 16)]
        qps: u32,
    },
    /// In the VM: TCP throughput between the lab's nodes on CM (engine over rxe) and on UD,
    /// interleaved in one boot, with CPU time per byte of each path.
    Engine {
        /// Seconds per measurement.
        #[arg(long, default_value_t = 8)]
        seconds: u32,
        /// Interleaved rounds; the median is reported (issue 15 asks for at least 5: one
        /// round in three can be far off under emulation).
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Parallel TCP streams (iperf3 -P), to offer the engine more than one stream's window.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
        streams: u32,
        /// An ipoib-ctl built from another commit (e.g. a worktree's target/release/ipoib-ctl),
        /// measured on CM beside this build in every round.
        #[arg(long)]
        baseline_ctl: Option<PathBuf>,
        /// The baseline on rings per connection, beside this build's rings (else on an SRQ).
        #[arg(long, requires = "baseline_ctl")]
        baseline_rings: bool,
        /// A's ipoib-ctl (the sender's) at this nice value (an experiment: does the engine's
        /// rate follow the CPU its thread gets?).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true,
              value_parser = clap::value_parser!(i32).range(-20..=19))]
        ctl_nice: i32,
        /// --ctl-nice for B's ipoib-ctl too.
        #[arg(long)]
        ctl_nice_both: bool,
    },
    /// In the VM: the CM engine on one lane against two (a TUN queue, a CQ and a thread each),
    /// TCP to two addresses of the peer at once, each over a connection of its own,
    /// interleaved in one boot: Gbit/s and CPU seconds per GB.
    Lanes {
        /// Seconds per measurement.
        #[arg(long, default_value_t = 8)]
        seconds: u32,
        /// Rounds (one lane and two in each); the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// TCP streams to each of the peer's two addresses.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
        streams: u32,
    },
    /// On this machine's kernel (root): TCP between two namespaces through the engine's TUN
    /// hop (two TUN devices and a relay: read and write, io_uring, a packet-mmap ring), over
    /// the kernel's UD stand-ins (veth at MTU 2044 without offloads, at 4092 with software GSO
    /// and GRO) and over a plain veth, 1 and N streams, interleaved: Gbit/s, CPU seconds per
    /// GB, the relay's system calls per packet.
    Hop {
        /// Seconds per measurement.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Streams of the many-stream case.
        #[arg(long, default_value_t = 4)]
        streams: u32,
        /// Only these paths (e.g. hop,hop-mmap,ud-4092,veth).
        #[arg(long, value_delimiter = ',')]
        paths: Vec<String>,
        /// Bytes per write of the sender (iperf3's -l; 128 KiB by default).
        #[arg(long)]
        len: Option<u32>,
        /// In the VM (Debian's 6.1 under emulation: it shows what runs on the floor kernel,
        /// not what it costs).
        #[arg(long)]
        vm: bool,
    },
    /// The receive hook for IPoIB (root): TCP through a veth with GRO, forced into generic
    /// XDP, against TC ingress and no program, each hook with a trivial program and with the
    /// fast path's ingress, at MTU 2044 and 4092, interleaved: Gbit/s and CPU seconds per GB.
    /// On this machine's kernel, or with --vm on the VM's 6.1.
    Hook {
        /// Seconds per measurement.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// In the VM (Debian's 6.1 under emulation) instead of on this machine's kernel.
        #[arg(long)]
        vm: bool,
    },
    /// Connected mode's once-a-second tick (the promotion policy and what the node holds) at
    /// thousands of peers, release build: median, p99 and slowest tick.
    Tick {
        #[arg(long, default_value_t = 4096)]
        peers: u32,
        /// Connections the plan allows.
        #[arg(long, default_value_t = 64)]
        plan: usize,
        /// Ticks timed.
        #[arg(long, default_value_t = 600)]
        ticks: u64,
    },
    /// In the VM: receive memory registered against connected peers (1, K, 3K) with an SRQ and
    /// with a ring per connection (the kernel's view), beside the kernel's formula and the
    /// plan for 4096 peers.
    Memory {
        /// The budget both models are planned with.
        #[arg(long, default_value = "14MiB")]
        budget: String,
    },
}
